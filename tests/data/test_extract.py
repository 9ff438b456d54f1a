"""Tests of `nala_dit/data/extract.py`."""
import json

import pytest

from tests.training.test_loop import (
    make_image_folder,
    tiny_vae,
)
from tests.utils import assert_names


def test_extract_latents_lists_unreadable_files(tmp_path, capsys):
    from extract_latents import main as extract_main
    from nala_dit.data.datasets import LatentDataset

    images = make_image_folder(tmp_path / "images", per_class=2, size=16)
    for path in (images / "cat" / "bad1.png", images / "dog" / "bad2.jpg"):
        path.write_bytes(b"\x89PNG truncated")
    argv = ["--data", str(images), "--out", str(tmp_path / "lat"), "--vae", str(tiny_vae(tmp_path / "vae")),
            "--image-size", "16", "--num-workers", "0", "--dtype", "float32"]
    assert extract_main(argv) == 1
    err = capsys.readouterr().err
    assert_names(err, str(images / "cat" / "bad1.png"), str(images / "dog" / "bad2.jpg"), "fix or remove them")
    assert not (tmp_path / "lat").exists()
    with pytest.warns(UserWarning, match="leaving out 2 unreadable"):
        assert extract_main(argv + ["--skip-corrupt"]) == 0
    assert len(LatentDataset(tmp_path / "lat")) == 4  # the readable ones, none duplicated
    shard = tmp_path / "lat" / "latents-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(ValueError) as err:
        LatentDataset(tmp_path / "lat")
    assert_names(err, f"{shard}: ", "unreadable latent shard", "delete it and rerun extract_latents")


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def extraction(tmp_path_factory):
    from tests.data.test_latent_stats import extract, write_vae
    from tests.training.test_loop import make_image_folder

    root = tmp_path_factory.mktemp("extract")
    vae, images = write_vae(root / "vae", 0), make_image_folder(root / "images", seed=0)
    extract(images, root / "lat", vae, "--dtype", "float32")
    return root, vae, images


def test_latent_shards_and_meta_are_fsynced(extraction, tmp_path, fsynced):
    from tests.data.test_latent_stats import extract

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
