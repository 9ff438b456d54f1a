"""Tests of `nala_dit/data/datasets.py`."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.training.test_loop import (
    make_image_folder,
    run_train,
)
from tests.utils import DEEP, assert_names, one_line, train_fails


def test_a_missing_data_folder_is_not_described_as_an_image_folder_layout(tmp_path):
    from nala_dit.data.datasets import ImageFolderDataset

    (tmp_path / "latents-256").mkdir()
    missing = tmp_path / "latents-265"
    with pytest.raises(FileNotFoundError) as err:
        ImageFolderDataset(missing, 8)
    assert_names(one_line(err), f"data folder not found: {missing}", f"did you mean {tmp_path / 'latents-256'}?",
                 "--data takes digits, digits-canvas", "extract_latents.py", "<root>/<class name>/<images>")


# 9. latent folders' meta.json
def write_latent_folder(root: Path) -> dict:
    root.mkdir()
    save_file({"moments": torch.zeros(2, 2, 2, 4, 2, 2), "labels": torch.tensor([0, 1])},
              str(root / "latents-000000.safetensors"))
    meta = dict(scaling_factor=0.18215, image_size=16, latent_channels=4, classes=["a", "b"],
                shards=["latents-000000.safetensors"])
    (root / "meta.json").write_text(json.dumps(meta))
    return meta


def test_latent_meta_keys_and_types_are_checked(tmp_path):
    from nala_dit.data.datasets import LatentDataset

    meta = write_latent_folder(tmp_path / "lat")
    assert len(LatentDataset(tmp_path / "lat")) == 2
    meta_file = tmp_path / "lat" / "meta.json"
    cases = [({k: v for k, v in meta.items() if k != "shards"}, ("'shards'", "list of shard file names", "missing")),
             ({k: v for k, v in meta.items() if k != "classes"}, ("'classes'", "list of class names", "missing")),
             ({**meta, "classes": "ab"}, ("'classes'", "list of class names", "got 'ab' (str)")),
             ({**meta, "shards": [3]}, ("'shards'", "list of shard file names", "non-empty strings")),
             ({**meta, "image_size": "16"}, ("'image_size'", "an integer", "got '16' (str)")),
             ({**meta, "scaling_factor": -1}, ("'scaling_factor'", "positive number")),
             ({**meta, "shards": ["../../etc/hostname"]}, ("shard '../../etc/hostname'", "outside")),
             ({**meta, "shards": ["/etc/hostname"]}, ("shard '/etc/hostname'", "outside")),
             ([1, 2], ("JSON object", "got list"))]
    for bad, words in cases:
        meta_file.write_text(json.dumps(bad))
        with pytest.raises(ValueError) as err:
            LatentDataset(tmp_path / "lat")
        assert_names(one_line(err), f"{meta_file}: ", *words)


def test_image_folder_problems_are_found_up_front(tmp_path, capsys):
    images = make_image_folder(tmp_path / "images", per_class=2)
    for name in ("a.png", "b.png"):
        (images / "cat" / name).write_bytes(b"not a png")
    common = ["--data", str(images), "--image-size", "16", "--global-batch-size", "2", "--max-steps", "1"]
    err = train_fails(tmp_path, capsys, *common, "--check-data", "true")
    assert_names(err, f"2 unreadable image(s) in {images}", str(images / "cat" / "a.png"),
                 str(images / "cat" / "b.png"), "--skip-corrupt")
    assert not (tmp_path / "run").exists()  # a run that failed at once leaves no folder
    with pytest.warns(UserWarning, match="leaving out 2 unreadable image"):
        run_train(tmp_path, *common, "--check-data", "true", "--skip-corrupt", "true", "--ckpt-every", "1",
                  name="skipped")

    (images / "bird").mkdir()
    err = train_fails(tmp_path, capsys, *common, name="empty")
    assert_names(err, f"data folder {images}", "without images", "bird", "add images or remove those folders")

    broken = tmp_path / "broken"
    for c in ("x", "y"):
        (broken / c).mkdir(parents=True)
        (broken / c / "0.png").write_bytes(b"junk")
    with pytest.warns(UserWarning, match="skipping corrupt image"):
        err = train_fails(tmp_path, capsys, "--data", str(broken), "--image-size", "16", "--global-batch-size", "2",
                          "--max-steps", "1", "--skip-corrupt", "true", name="broken")
    assert_names(err, f"no readable image in {broken}", "all 2 files")


# --- latent caches ------------------------------------------------------------------------
def test_a_deep_latent_meta_json_is_one_line(tmp_path):
    from nala_dit.data.datasets import LatentDataset

    write_latent_folder(tmp_path / "lat")
    (tmp_path / "lat" / "meta.json").write_text(DEEP)
    with pytest.raises(ValueError) as err:
        LatentDataset(tmp_path / "lat")
    assert f"{tmp_path / 'lat' / 'meta.json'}: nested too deeply" in one_line(err)
    assert "rerun extract_latents.py" in one_line(err)


@pytest.mark.parametrize("shape", [(2, 2, 4, 2, 2), (2, 2, 2, 3, 2, 2), (2, 2, 2, 4, 2, 3)])
def test_a_shard_whose_moments_have_the_wrong_shape_is_one_line(tmp_path, shape):
    from nala_dit.data.datasets import LatentDataset

    write_latent_folder(tmp_path / "lat")
    shard = tmp_path / "lat" / "latents-000000.safetensors"
    save_file({"moments": torch.zeros(shape), "labels": torch.tensor([0, 1])}, str(shard))
    with pytest.raises(ValueError) as err:
        LatentDataset(tmp_path / "lat")
    assert str(shard) in one_line(err) and "'moments'" in one_line(err) and str(shape) in one_line(err)
    assert "rerun extract_latents.py" in one_line(err)
