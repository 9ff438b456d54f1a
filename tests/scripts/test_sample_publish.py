"""``sample.py --grid`` / ``--out-dir`` publish their files without replacing one created while
sampling ran (``guards.durable_publish``: ``os.link`` of the temporary file): the other file is
kept, the error is one line naming both, and the sampled image stays at its temporary name."""
import errno
import os

import pytest

import sample
from nala_dit.guards import durable_publish


@pytest.mark.parametrize("flag", ["--grid", "--out-dir"])
def test_a_file_created_while_sampling_is_not_replaced(digits_checkpoint, tmp_path, monkeypatch, capsys, flag):
    from nala_dit.pipelines import sample_files

    target = tmp_path / "g.png" if flag == "--grid" else tmp_path / "pngs" / "000000_class1.png"
    real = sample_files.sample_images

    def meanwhile(*args, **kwargs):   # another program writes the output while this one samples
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"the user's")
        return real(*args, **kwargs)

    monkeypatch.setattr(sample_files, "sample_images", meanwhile)
    out = tmp_path / "g.png" if flag == "--grid" else tmp_path / "pngs"
    assert sample.main(["--ckpt", str(digits_checkpoint), "--labels", "1", "--steps", "2", flag, str(out)]) == 1
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if not line.startswith("sample: ")]   # (the progress line)
    assert len(errors) == 1 and errors[0].startswith("error: "), err
    err = errors[0]
    assert target.read_bytes() == b"the user's"
    kept = [p for p in target.parent.iterdir() if p.name.startswith(".tmp-")]
    assert len(kept) == 1 and f"{target} was created by something else" in err and str(kept[0]) in err, err
    assert kept[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("links", [True, False])
def test_durable_publish_never_replaces(tmp_path, monkeypatch, links):
    if not links:   # a filesystem without hard links: the name is claimed with O_EXCL instead
        def no_link(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(os, "link", no_link)
    tmp, final = tmp_path / ".tmp-a", tmp_path / "a"
    tmp.write_bytes(b"new")
    durable_publish(tmp, final)
    assert final.read_bytes() == b"new" and not tmp.exists()
    tmp.write_bytes(b"newer")
    with pytest.raises(FileExistsError):
        durable_publish(tmp, final)
    assert final.read_bytes() == b"new" and tmp.read_bytes() == b"newer"
