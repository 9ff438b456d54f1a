"""The data sources' registry (``nala_dit/data/sources.py``): a kind of data is its dataset plus
one line in ``DATA_SOURCES``, and every place that reads ``--data`` reaches it by that line: the
settings' check (``--image-size``), ``train.py`` (the training set and ``--val-every``'s
held-out split), and the class names a trained model's pipeline gets.

The toy source here lives in this file: two classes of flat 1×S×S images, "dark" (−0.5) and
"light" (+0.5), S = 8 or 12."""

import json
from pathlib import Path

import pytest
import torch

import train as train_cli
from nala_dit.data.sources import DATA_SOURCES, DataSource, class_names, data_help, data_source
from tests.utils import TINY_RUN

TOY_SIZES = (8, 12)


class Flat(torch.utils.data.Dataset):
    """``count`` flat images, labels alternating 0 (dark) / 1 (light)."""

    classes, channels, is_latent = ["dark", "light"], 1, False
    num_classes = len(classes)

    def __init__(self, count: int, size: int):
        self.count, self.image_size = count, size

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        label = index % 2
        return torch.full((1, self.image_size, self.image_size), 0.5 if label else -0.5), label


def check_toy_size(size: int) -> int:
    if size not in TOY_SIZES:
        raise ValueError(f"--image-size {size} is not a toy size; choose 8 or 12")
    return size


@pytest.fixture
def toy(monkeypatch):
    opened = []

    def open_toy(data, cfg, split="train", size=None, state=None):
        opened.append((data, split, size))
        return Flat(32 if split == "train" else 6, size or cfg.image_size or TOY_SIZES[0])

    # the one registry line a new kind of data adds (monkeypatch removes it after the test)
    monkeypatch.setitem(DATA_SOURCES, "toy", DataSource(open_toy, "'toy' (flat squares)", check_size=check_toy_size,
                                                        class_names=lambda data: list(Flat.classes), heldout=True))
    return opened


def test_a_registered_source_trains_through_train_py(toy, tmp_path, capsys):
    argv = TINY_RUN + ["--data", "toy", "--results-dir", str(tmp_path), "--exp-name", "toy", "--max-steps", "2",
                       "--val-every", "2", "--val-samples", "4"]
    assert train_cli.main(argv) == 0, capsys.readouterr().err
    # opened once for training (the source's default size), once for the held-out split at the training size
    assert toy == [("toy", "train", None), ("toy", "heldout", 8)]
    log = [json.loads(line) for line in (tmp_path / "toy" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log if "loss" in r)
    assert [r["step"] for r in log if "val/loss" in r] == [2]
    # the model was built for the data (1 channel, 8 px, 2 classes) and its pipeline names the classes
    from nala_dit.pipelines.sources import load_source

    source = load_source(tmp_path / "toy")
    config = source.model.config
    assert (config.in_channels, config.input_size, config.num_classes) == (1, 8, 2)
    assert source.id2label == {0: "dark", 1: "light"}


def test_a_registered_source_gets_its_size_checked_and_listed(toy, capsys):
    assert train_cli.main(TINY_RUN + ["--data", "toy", "--image-size", "12", "--dry-run"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        train_cli.main(TINY_RUN + ["--data", "toy", "--image-size", "16", "--dry-run"])
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--image-size 16 is not a toy size; choose 8 or 12" in errors[0], errors
    assert data_help().endswith(", or 'toy' (flat squares)") and "an image folder <root>/<class>/*, " in data_help()
    assert class_names("toy") == ["dark", "light"]


def test_folders_are_told_apart_by_what_they_hold(tmp_path):
    """By name first (the embedded sets), then by the detectors in order, the image folder last:
    a folder holding meta.json is a latent cache, any other folder (or path) an image folder."""
    (tmp_path / "lat").mkdir()
    (tmp_path / "lat" / "meta.json").write_text("{}")
    (tmp_path / "img" / "cat").mkdir(parents=True)
    (tmp_path / "img" / ".ipynb_checkpoints").mkdir()
    assert data_source("digits") is DATA_SOURCES["digits"]
    assert data_source("digits-canvas") is DATA_SOURCES["digits-canvas"]
    assert data_source(str(tmp_path / "lat")) is DATA_SOURCES["latents"]
    assert data_source(str(tmp_path / "img")) is DATA_SOURCES["images"]
    assert data_source(str(tmp_path / "missing")) is DATA_SOURCES["images"]   # its dataset says "not found"
    assert data_source("latents") is DATA_SOURCES["images"]   # a detected kind is not named by its key
    assert class_names(str(tmp_path / "img")) == ["cat"]      # hidden folders are no class, as in the dataset
    assert class_names("digits") == class_names("digits-canvas") == [str(i) for i in range(10)]
    assert class_names(str(tmp_path / "missing")) is None and class_names(None) is None


def test_a_detected_source_added_last_is_still_tried_before_the_image_folder(tmp_path, monkeypatch):
    (tmp_path / "zipped").mkdir()   # (tar shards are built in: data/streams.py)
    (tmp_path / "zipped" / "shard-000.zip").write_bytes(b"")
    zips = DataSource(lambda *a, **k: None, "a folder of .zip shards",
                      detect=lambda data: any(p.suffix == ".zip" for p in Path(data).glob("*")))
    monkeypatch.setitem(DATA_SOURCES, "zips", zips)
    assert data_source(str(tmp_path / "zipped")) is zips
    assert data_source(str(tmp_path)) is DATA_SOURCES["images"]
