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


def test_a_missing_folder_a_shipped_config_names_points_to_the_page_that_makes_it(tmp_path):
    """configs/cifar10_*.yaml without the data: the error names docs/evaluation.md#cifar-10 (a
    heading that exists); every shipped config's folder has such a page, other paths none."""
    import yaml

    from nala_dit.data.choices import DATA_GUIDES, data_guide
    from nala_dit.data.datasets import ImageFolderDataset
    from tests.docs.test_pages import anchors
    from tests.utils import ROOT

    with pytest.raises(FileNotFoundError) as err:
        ImageFolderDataset(tmp_path / "data/cifar10/train", 32)
    assert one_line(err).endswith("; docs/evaluation.md#cifar-10 says how to make it")
    assert data_guide(tmp_path / "my_images") == ""
    for _, page in DATA_GUIDES:
        file, anchor = page.split("#")
        assert anchor in anchors(ROOT / file), page
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        data = yaml.safe_load(config.read_text())["data"]
        assert data in ("digits", "digits-canvas") or data_guide(data), (config.name, data)


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


# --- class lists taken unchecked ------------------------------------------
def test_hidden_folders_are_not_classes_nor_images(tmp_path):
    """Jupyter's ``.ipynb_checkpoints`` beside the class folders (and inside one) is skipped:
    torchvision's ImageFolder would make it class 0 and shift every real class by one."""
    from nala_dit.data.datasets import ImageFolderDataset

    images = make_image_folder(tmp_path / "images", per_class=2)
    plain = ImageFolderDataset(images, 16)
    for hidden in (images / ".ipynb_checkpoints", images / plain.classes[0] / ".ipynb_checkpoints"):
        hidden.mkdir()
        (hidden / "0-checkpoint.png").write_bytes((images / plain.classes[0] / "0.png").read_bytes())
    ((images / plain.classes[1]) / ".ghost.png").write_bytes((images / plain.classes[1] / "0.png").read_bytes())
    dataset = ImageFolderDataset(images, 16)
    assert dataset.classes == plain.classes and not any(c.startswith(".") for c in dataset.classes)
    assert dataset.samples == plain.samples   # the same files, the same labels


def test_a_latent_class_list_must_match_the_labels(tmp_path):
    """An edited ``classes`` list (100,000 names over 2 latents of classes 0 and 1) would build a
    100,000-class model: refused in one line naming meta.json, as are labels past the list and
    duplicate names."""
    from nala_dit.data.datasets import LatentDataset

    meta = write_latent_folder(tmp_path / "lat")
    meta_file = tmp_path / "lat" / "meta.json"
    cases = [([f"c{i}" for i in range(100_000)], ("'classes' lists 100,000 names for 2 latents",
                                                  "every class needs at least one")),
             (["a"], ("labels 0..1", "'classes' lists 1 name(s)")),
             (["a", "a"], ("'classes' names 'a' twice",))]
    for classes, words in cases:
        meta_file.write_text(json.dumps({**meta, "classes": classes}))
        with pytest.raises(ValueError) as err:
            LatentDataset(tmp_path / "lat")
        assert_names(one_line(err), f"{meta_file}: ", *words, "rerun extract_latents.py")
    # three names for two latents of classes 0 and 1: the third class is empty
    save_file({"moments": torch.zeros(3, 2, 2, 4, 2, 2), "labels": torch.tensor([0, 1, 1])},
              str(tmp_path / "lat" / "latents-000000.safetensors"))
    meta_file.write_text(json.dumps({**meta, "classes": ["a", "b", "z"]}))
    with pytest.raises(ValueError) as err:
        LatentDataset(tmp_path / "lat")
    assert_names(one_line(err), "1 of the 3 classes hold no latent", "'z', label 2")
    meta_file.write_text(json.dumps(meta))
    assert LatentDataset(tmp_path / "lat").num_classes == 2
