"""Tests of `nala_dit/pipelines/sample_files.py`."""
import json
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.scripts.test_sample import FAST
from tests.utils import assert_names, cli, one_line_error


def test_non_finite_samples_never_become_images():
    from nala_dit.data.datasets import to_uint8
    from nala_dit.guards import NonFiniteError

    x = torch.zeros(3, 1, 4, 4)
    assert to_uint8(x).shape == (3, 4, 4, 1)
    x[1, 0, 2, 2] = float("nan")
    with pytest.raises(NonFiniteError) as err:
        to_uint8(x)
    assert_names(err, "1 of 3 samples", "NaN or inf", "first: sample 1")
    x[1, 0, 2, 2] = float("inf")  # clamp would make it 255: refused too
    with pytest.raises(ValueError, match="NaN or inf"):
        to_uint8(x)


# 3. nothing a user made is overwritten
def test_finished_npz_is_not_overwritten_by_other_settings(run_dir, tmp_path, capsys):
    out = tmp_path / "s.npz"
    common = ["--ckpt", run_dir, "--num-samples", 10, *FAST, "--out", out]
    assert cli(*common) == 0
    before = out.read_bytes(), Path(f"{out}.json").read_bytes()
    capsys.readouterr()
    assert cli(*common[:-2], "--seed", 1, "--out", out) == 1
    err = one_line_error(capsys)
    assert_names(err, f"{out} holds a finished run", "other settings", "{'seed': (0, 1)}",
                 "choose another --out, or move")
    assert (out.read_bytes(), Path(f"{out}.json").read_bytes()) == before
    assert cli(*common) == 0  # the same settings: complete, nothing to do
    assert "already complete" in capsys.readouterr().out


def test_a_file_at_out_that_is_not_ours_is_kept(run_dir, tmp_path, capsys):
    out = tmp_path / "mine.npz"
    out.write_bytes(b"a user's own file")
    assert cli("--ckpt", run_dir, "--num-samples", 10, *FAST, "--out", out) == 1
    assert_names(one_line_error(capsys), f"{out} exists", "not the output of this run", "no mine.npz.json",
                 "not overwriting", "choose another --out", f"move {out} away")
    assert out.read_bytes() == b"a user's own file"


def test_npz_written_but_sidecar_missing_resumes(run_dir, tmp_path, capsys):
    """Killed between the .npz and its sidecar: the run's shards are there, so it finishes."""
    out = tmp_path / "s.npz"
    common = ["--ckpt", run_dir, "--num-samples", 10, *FAST, "--out", out, "--keep-parts"]
    assert cli(*common) == 0
    Path(f"{out}.json").unlink()
    assert cli(*common) == 0 and Path(f"{out}.json").is_file()


def sample_cli(*args):
    import sample

    return sample.main([str(a) for a in args])


def test_mass_sampling_lock_and_leftovers(tmp_path, digits_checkpoint, capsys, monkeypatch):
    common = ["--ckpt", digits_checkpoint, "--num-samples", 4, "--sampler", "ddim", "--steps", 2,
              "--batch-size", 2, "--shard-size", 2]
    out = tmp_path / "s.npz"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        Path(f"{out}.lock").write_text(json.dumps(dict(pid=holder.pid, host=socket.gethostname(), time=time.time())))
        assert sample_cli(*common, "--out", out) == 1
        err = capsys.readouterr().err
        assert_names(err, f"output {out}", f"pid {holder.pid}", "choose another --out")
        assert not Path(f"{out}.parts").exists()
    finally:
        holder.kill()
        holder.wait()
    # Killed runs left a half-written .npz and shard: removed on the next start (stale lock taken over).
    Path(f"{out}.parts").mkdir()
    leftovers = [tmp_path / f".tmp-{holder.pid}-s.npz", Path(f"{out}.parts") / f".tmp-{holder.pid}-shard-000000.npz"]
    for p in leftovers:
        p.write_bytes(b"half")
    # This run is killed while assembling the .npz: its own temporary goes too.
    real_header = np.lib.format.write_array_header_2_0

    def killed(*args, **kwargs):
        real_header(*args, **kwargs)
        raise KeyboardInterrupt("killed during assembly")

    monkeypatch.setattr(np.lib.format, "write_array_header_2_0", killed)
    with pytest.raises(KeyboardInterrupt):
        sample_cli(*common, "--out", out)
    monkeypatch.undo()
    assert "taking over the stale lock" in capsys.readouterr().out
    assert not any(p.exists() for p in leftovers) and not list(tmp_path.glob(".tmp-*")) and not out.exists()
    assert sample_cli(*common, "--out", out) == 0
    assert not Path(f"{out}.lock").exists()
    with np.load(out) as done:
        assert done["arr_0"].shape == (4, 8, 8, 1)
    # An interrupted run's settings file damaged by hand: named, with the way out.
    assert sample_cli(*common, "--out", tmp_path / "t.npz", "--stop-after", 1) == 0
    (tmp_path / "t.npz.parts" / "settings.json").write_text("{")
    assert sample_cli(*common, "--out", tmp_path / "t.npz") == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 't.npz.parts' / 'settings.json'}: unreadable" in err and "to start over" in err


MASS = ["--num-samples", "10", *FAST, "--batch-size", "5", "--shard-size", "5"]   # 10 classes: balanced


# --- item 8: a damaged finished .npz is not "already complete" ---------------------------
def damage(npz: Path, how: str) -> None:
    data = bytearray(npz.read_bytes())
    if how == "truncated":
        npz.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flipped":               # same size, one byte of the images changed: only the CRC sees it
        with zipfile.ZipFile(npz) as zf:
            info = zf.getinfo("arr_0.npy")
        data[info.header_offset + 30 + len(info.filename) + len(info.extra) + 200] ^= 0xFF
        npz.write_bytes(bytes(data))
    else:                                # a valid .npz of other arrays under the same name
        np.savez(npz, arr_0=np.zeros((2, 8, 8, 1), np.uint8), arr_1=np.zeros(2, np.int64))


@pytest.mark.parametrize("how", ["truncated", "flipped", "other arrays"])
def test_a_damaged_finished_npz_is_refused_not_complete(run_dir, tmp_path, capsys, how):
    out = tmp_path / "s.npz"
    assert cli("--ckpt", run_dir, *MASS, "--out", out) == 0
    damage(out, how)
    before = out.read_bytes()
    capsys.readouterr()
    assert cli("--ckpt", run_dir, *MASS, "--out", out) == 1
    captured = capsys.readouterr()
    assert "already complete" not in captured.out
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{out} is damaged" in err and "move" in err and f"{out.name}.json" in err and "rerun" in err
    assert out.read_bytes() == before                      # nothing a run made is deleted


def test_a_damaged_npz_whose_shards_were_kept_is_reassembled(run_dir, tmp_path, capsys):
    out = tmp_path / "s.npz"
    assert cli("--ckpt", run_dir, *MASS, "--out", out, "--keep-parts") == 0
    good = np.load(out)["arr_0"].copy()
    damage(out, "truncated")
    capsys.readouterr()
    assert cli("--ckpt", run_dir, *MASS, "--out", out, "--keep-parts") == 0
    captured = capsys.readouterr()
    assert "already complete" not in captured.out and "reassembling" in captured.out
    np.testing.assert_array_equal(np.load(out)["arr_0"], good)
    assert cli("--ckpt", run_dir, *MASS, "--out", out, "--keep-parts") == 0
    assert "already complete" in capsys.readouterr().out


def test_sample_shards_npz_and_sidecar_are_fsynced(run_dir, tmp_path, fsynced):
    out = tmp_path / "s.npz"
    assert cli("--ckpt", run_dir, *MASS, "--out", out, "--keep-parts") == 0
    synced = {p.name for p in fsynced}
    for name in ("shard-000000.npz", "shard-000001.npz", "settings.json"):
        assert any(n.endswith(name) for n in synced), name
    assert any(n.endswith("-s.npz") for n in synced) and any(n.endswith("-s.npz.json") for n in synced)
    assert Path(f"{out}.parts") in fsynced and tmp_path in fsynced


def test_bad_shard_settings_json_names_its_file(tmp_path, capsys):
    import sample
    from tests.scripts.test_sample import FAST, write_checkpoint

    run = write_checkpoint(tmp_path / "run")
    out = tmp_path / "s.npz"
    argv = ["--ckpt", str(run), "--num-samples", "10", *FAST, "--batch-size", "5", "--shard-size", "5"]
    assert sample.main(argv + ["--out", str(out), "--stop-after", "1"]) == 0
    settings = Path(f"{out}.parts") / "settings.json"
    settings.write_text("{oops")
    capsys.readouterr()
    assert sample.main(argv[:-2] + ["--out", str(out)]) == 1         # no --shard-size: the stored one is read
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(settings) in err and f"delete {out}.parts" in err
