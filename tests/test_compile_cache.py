"""``nala_dit.compile_cache``: every ``torch.compile`` of this package reads and writes inductor's
cache only in a folder of this user's that no one else can write (inductor imports the Python it
cached there on the next compile; its default is a folder in the shared ``$TMPDIR``)."""
import os
import stat

import pytest
import torch

from nala_dit import compile_cache
from nala_dit.compile_cache import UnsafeCacheError, private_compile_cache
from nala_dit.models.compile import compile_model
from tests.utils import cli

needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="making a folder of another user needs root")


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return monkeypatch


def test_default_is_made_private_and_given_to_inductor(env, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    folder = private_compile_cache()
    assert folder == tmp_path / "xdg" / "nala_dit" / "torchinductor"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 & ~_umask()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder) == cache_dir()   # inductor's own lookup
    assert private_compile_cache() == folder   # the second call (a second compile) accepts it


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_folder_others_can_write_is_refused_before_compiling(env, tmp_path):
    """A user-given (or pre-made default) folder with group/other write: compile_model refuses in one
    line naming it and the fix, and nothing is compiled (the model is left as it was)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    env.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UnsafeCacheError) as err:
        compile_model(model)
    message = str(err.value)
    assert "\n" not in message and str(shared) in message and "mode 777" in message and "chmod 700" in message
    assert model._compiled_call_impl is None
    env.delenv("TORCHINDUCTOR_CACHE_DIR")
    default = compile_cache.default_compile_cache()
    default.mkdir(parents=True)
    default.chmod(0o775)
    with pytest.raises(UnsafeCacheError, match="can be written by others"):
        private_compile_cache()


@needs_root
def test_a_folder_of_another_user_is_refused(env, tmp_path):
    """Another local user made the folder first (torch's default in /tmp allows it): refused, as is a
    link owned by another user and a TRITON_CACHE_DIR of another user."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4321, 4321)
    env.setenv("TORCHINDUCTOR_CACHE_DIR", str(theirs))
    with pytest.raises(UnsafeCacheError, match="belongs to uid 4321, not you"):
        private_compile_cache()
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, 4321, 4321)
    env.setenv("TORCHINDUCTOR_CACHE_DIR", str(link))
    with pytest.raises(UnsafeCacheError, match="is a link owned by uid 4321"):
        private_compile_cache()
    env.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    env.setenv("TRITON_CACHE_DIR", str(theirs))
    with pytest.raises(UnsafeCacheError, match=r"\(TRITON_CACHE_DIR\) belongs to uid 4321"):
        private_compile_cache()


def test_sample_compile_refuses_in_one_line(env, tmp_path, capsys):
    """``sample.py --compile`` with an unsafe cache: exit 2 and one line, before anything is sampled."""
    from tests.models.test_compile import FAST
    from tests.scripts.test_sample import write_checkpoint

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o757)
    env.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    run = write_checkpoint(tmp_path / "runs" / "one-block", depth=1)
    grid = tmp_path / "grid.png"
    assert cli("--ckpt", run, *FAST, "--compile", "--grid", grid) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "can be written by others (mode 757)" in err[0] and not grid.exists()
