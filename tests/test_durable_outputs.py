"""Issue 45 items 8 and 9: a finished ``.npz`` is verified before "already complete", and
checkpoints, latent and sample shards, ``.npz`` files and exports reach the disk before
they are renamed into place (fsync of the files and of the folder); an extraction rerun
over a damaged shard keeps its ``meta.json``."""

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
from tests.test_sample_cli import FAST, write_checkpoint


def cli(*args) -> int:
    return sample.main([str(a) for a in args])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("runs") / "dit")


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


# --- item 9: fsync before and after every rename into place -------------------------------
@pytest.fixture
def fsynced(monkeypatch):
    """The paths os.fsync was called on, in order (read back from /proc/self/fd)."""
    paths = []
    real = os.fsync

    def recording(fd):
        paths.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return paths


def test_a_checkpoint_is_fsynced_file_by_file_then_its_folder(tmp_path, fsynced):
    run = write_checkpoint(tmp_path / "run")
    final = next((run / "checkpoints").iterdir())
    names = {p.name for p in final.iterdir()}
    tmp_dirs = {p.parent for p in fsynced if p.name in names}
    assert {p.name for p in fsynced if p.parent in tmp_dirs} == names     # every file, under its temporary name
    assert fsynced.index(run / "checkpoints") > max(i for i, p in enumerate(fsynced) if p.parent in tmp_dirs)


def test_sample_shards_npz_and_sidecar_are_fsynced(run_dir, tmp_path, fsynced):
    out = tmp_path / "s.npz"
    assert cli("--ckpt", run_dir, *MASS, "--out", out, "--keep-parts") == 0
    synced = {p.name for p in fsynced}
    for name in ("shard-000000.npz", "shard-000001.npz", "settings.json"):
        assert any(n.endswith(name) for n in synced), name
    assert any(n.endswith("-s.npz") for n in synced) and any(n.endswith("-s.npz.json") for n in synced)
    assert Path(f"{out}.parts") in fsynced and tmp_path in fsynced


def test_export_folder_is_fsynced_before_its_rename(run_dir, tmp_path, fsynced):
    import export

    assert export.main(["checkpoint", str(run_dir), str(tmp_path / "pipe")]) == 0
    weights = [p for p in fsynced if p.name == "diffusion_pytorch_model.safetensors"]
    assert weights and tmp_path in fsynced


@pytest.fixture(scope="module")
def extraction(tmp_path_factory):
    from tests.test_latent_stats import extract, write_vae
    from tests.test_training import make_image_folder

    root = tmp_path_factory.mktemp("extract")
    vae, images = write_vae(root / "vae", 0), make_image_folder(root / "images", seed=0)
    extract(images, root / "lat", vae, "--dtype", "float32")
    return root, vae, images


def test_latent_shards_and_meta_are_fsynced(extraction, tmp_path, fsynced):
    from tests.test_latent_stats import extract

    root, vae, images = extraction
    extract(images, tmp_path / "lat", vae, "--dtype", "float32")
    synced = [p.name for p in fsynced]
    assert any(n.endswith("latents-00000.safetensors") for n in synced)
    assert any(n.endswith("meta.json") for n in synced) and tmp_path / "lat" in fsynced


def test_rerun_over_a_truncated_shard_keeps_meta_json(extraction, tmp_path, capsys):
    import shutil

    from extract_latents import main as extract_main

    root, vae, images = extraction
    lat = shutil.copytree(root / "lat", tmp_path / "lat")
    meta_before = (lat / "meta.json").read_bytes()
    assert "latent_stats" in json.loads(meta_before)
    shard = lat / "latents-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])              # a power loss, or a copy cut short
    capsys.readouterr()
    argv = ["--data", str(images), "--out", str(lat), "--vae", str(vae), "--image-size", "64", "--shard-size", "4",
            "--num-workers", "0", "--dtype", "float32"]
    assert extract_main(argv) == 1
    err = one_line_error(capsys)
    assert str(shard) in err and "delete it" in err and "rerun" in err
    assert (lat / "meta.json").read_bytes() == meta_before
    shard.unlink()                                            # the fix the line names
    assert extract_main(argv) == 0
    assert json.loads((lat / "meta.json").read_text())["latent_stats"] == json.loads(meta_before)["latent_stats"]
