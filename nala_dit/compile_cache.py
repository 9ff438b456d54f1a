"""Where ``torch.compile`` keeps what it builds: a folder only this user can write.

Inductor writes the Python and C++ it generates to a cache and, on a later compile of the
same graph, imports it from there. Its default is ``$TMPDIR/torchinductor_<user>``: in a
shared temporary folder, made with the umask's mode, never checked for owner or mode; a
file edited there (or a folder another local user made first) is code that the next
``--compile`` runs. ``private_compile_cache`` runs before every compile in this package
(``models/compile.py``, the CIFAR-10 speedrun, ``benchmarks/attention.py --compile``):

* ``TORCHINDUCTOR_CACHE_DIR`` unset: ``$XDG_CACHE_HOME/nala_dit/torchinductor`` (else
  ``~/.cache/nala_dit/torchinductor``), made with mode 0700, and the variable set to it;
* set by the user (or by an earlier call): used as it is. Importing ``torch._inductor`` sets
  it to inductor's default in ``$TMPDIR``; that value counts as unset.

Either way the folder (and ``TRITON_CACHE_DIR`` where set) must be this user's and writable
by no one else, else ``UnsafeCacheError`` says so in one line with the fix. Inductor's
Triton kernels live inside it; Triton's own default cache (``~/.triton``) is in the home.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeCacheError(PermissionError, ValueError):
    """A compile cache another user could write; the message names the folder and the fix."""


def default_compile_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nala_dit" / "torchinductor"


def _torch_default() -> str:
    """Inductor's own default (``$TMPDIR/torchinductor_<user>``): importing ``torch._inductor`` sets the
    variable to it, so a variable holding it was not chosen by the user."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def check_private_folder(path: Path, variable: str) -> None:
    """``path`` (followed through links) is a folder of this user's that no one else can write,
    and a link on the way is this user's too; raises ``UnsafeCacheError``."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:   # no POSIX owners (Windows): nothing to compare
        return
    fix = (f"make it yours with mode 0700 (chmod 700 {path}), or set {variable} to a folder of yours; "
           f"code compiled there is run by --compile")
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != getuid():
        raise UnsafeCacheError(f"compile cache {path} ({variable}) is a link owned by uid {link.st_uid}, "
                               f"not you: {fix}")
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheError(f"compile cache {path} ({variable}) is not a folder: set {variable} to a folder of yours")
    if info.st_uid != getuid():
        raise UnsafeCacheError(f"compile cache {path} ({variable}) belongs to uid {info.st_uid}, not you "
                               f"(uid {getuid()}): {fix}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(f"compile cache {path} ({variable}) can be written by others (mode "
                               f"{stat.S_IMODE(info.st_mode):o}): {fix}")


def private_compile_cache() -> Path:
    """Point inductor at a private cache (see the module's docstring) and return it."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) == _torch_default():   # set by importing torch._inductor, not a user
        given = None
    folder = Path(given).absolute() if given else default_compile_cache()
    if not given:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    elif not os.path.lexists(folder):
        folder.mkdir(mode=0o700, parents=True)
    check_private_folder(folder, "TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    if triton := os.environ.get("TRITON_CACHE_DIR"):
        if os.path.lexists(triton):
            check_private_folder(Path(triton).absolute(), "TRITON_CACHE_DIR")
    return folder
