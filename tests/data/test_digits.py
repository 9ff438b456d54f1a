"""The embedded digits: the scans and the frozen split against scikit-learn's own functions, then
the canvas ladder (32 / 64 / 128 px): the same picture at every size, scored the same way."""


import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nala_dit.cli.config import resolve
from nala_dit.cli.options import TrainConfig
from nala_dit.data.digits import (
    CANVAS_SIZES,
    canvas_crop,
    load_canvas_split,
    load_digits_split,
    make_canvas,
)
from tests.utils import ROOT, assert_names, one_line


def test_scans_and_split_are_sklearns_without_importing_it():
    """The bundled file read directly equals ``load_digits()``, and the frozen held-out indices
    are ``train_test_split``'s stratified 20 % at random_state 0; a fresh process that loads a
    split never imports scikit-learn."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from nala_dit.data import digits

    bunch = load_digits()
    scans, targets = digits._scans()
    assert np.array_equal(scans, bunch.images) and np.array_equal(targets, bunch.target)
    train_idx, heldout_idx = train_test_split(np.arange(len(bunch.target)), test_size=digits.HELDOUT_FRACTION,
                                              random_state=digits.SPLIT_SEED, stratify=bunch.target)
    assert np.array_equal(digits._split_indices()[0], np.sort(train_idx))
    assert np.array_equal(digits._split_indices()[1], np.sort(heldout_idx))
    images, labels = load_digits_split("heldout")
    assert np.array_equal(images, np.round(bunch.images[np.sort(heldout_idx)] * (255 / 16)).astype(np.uint8))
    assert np.array_equal(labels, bunch.target[np.sort(heldout_idx)])
    code = ("import sys; from nala_dit.data.digits import load_digits_split; load_digits_split('train'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def heldout():
    """The held-out canvases at every size: {size: (canvases, labels, offsets)}."""
    return {size: load_canvas_split("heldout", size=size) for size in CANVAS_SIZES}


@pytest.mark.parametrize("size", [64, 128])
def test_larger_canvas_holds_the_same_digit_at_the_scaled_place(heldout, size):
    a, labels, offsets = heldout[size]
    b, labels_b, offsets_b = load_canvas_split("heldout", size=size)
    assert np.array_equal(a, b) and np.array_equal(labels, labels_b) and np.array_equal(offsets, offsets_b)
    digits, digit_labels = load_digits_split("heldout")
    assert a.shape == (360, size, size) and a.dtype == np.uint8
    assert np.array_equal(labels, digit_labels)                             # label = the pasted digit
    scale = size // 32
    assert np.array_equal(offsets, heldout[32][2] * scale)                  # the same relative place
    # Known answer: the digit upscaled (bilinear) to size/2 at its offset, 0 elsewhere.
    side = size // 2
    big = F.interpolate(torch.from_numpy(digits).float()[:, None], size=(side, side), mode="bilinear",
                        align_corners=False)[:, 0].round().numpy().astype(np.uint8)
    for k in (0, 1, 359):
        r, c = offsets[k]
        assert np.array_equal(a[k, r:r + side, c:c + side], big[k])
        rest = a[k].copy()
        rest[r:r + side, c:c + side] = 0
        assert rest.max() == 0
    train, train_labels, train_offsets = load_canvas_split("train", size=size)
    assert len(train) == 4 * 1437 and np.array_equal(train_labels, load_canvas_split("train")[1])
    assert np.array_equal(train_offsets, load_canvas_split("train")[2] * scale)


@pytest.mark.parametrize("big,small", [(64, 32), (128, 32), (128, 64)])
def test_area_downsampling_a_larger_canvas_gives_the_smaller_one(heldout, big, small):
    """Bilinear samples at side 2m average (2x2) to the samples at side m exactly, so the two
    uint8 canvases differ only by their rounding: at most 1 grey level (of 255)."""
    down = F.avg_pool2d(torch.from_numpy(heldout[big][0]).double()[:, None], big // small)[:, 0].numpy()
    diff = np.abs(down - heldout[small][0])
    assert diff.max() <= 1.0
    assert diff.mean() < 0.25          # mostly exact: the bound is the rounding, not the picture


@pytest.mark.parametrize("size", CANVAS_SIZES)
def test_solid_digit_has_an_ink_box_of_half_the_canvas_and_is_cropped_whole(size):
    block = np.full((1, 8, 8), 200, np.uint8)      # a solid digit: one window holds all its ink
    canvas, _, offsets = make_canvas(block, np.array([3]), seed=0, copies=5, size=size)
    assert len({tuple(o) for o in offsets}) == 5
    for k, (r, c) in enumerate(offsets):
        rows, cols = np.nonzero(canvas[k])
        assert (rows.min(), cols.min()) == (r, c)
        assert rows.max() - rows.min() + 1 == cols.max() - cols.min() + 1 == size // 2
    crops = canvas_crop(canvas[..., None])
    assert crops.shape == (5, 8, 8, 1)
    assert all(np.array_equal(c[..., 0], block[0]) for c in crops)  # a window off by one pixel holds 0s


def test_crop_takes_the_same_window_of_the_same_picture_at_every_size(heldout):
    """The scored 8x8 view of a held-out canvas is the same at 32, 64 and 128 px: both are area
    means of one bilinear surface, each rounded to uint8 twice, so within 2 grey levels; and the
    window holds all of the digit's ink (>= 99.9 %) at every size."""
    crop32 = canvas_crop(heldout[32][0][..., None]).astype(int)
    for size in (64, 128):
        crop = canvas_crop(heldout[size][0][..., None]).astype(int)
        assert np.abs(crop - crop32).max() <= 2, size
    for size in CANVAS_SIZES:
        canvases = heldout[size][0].astype(np.float64)
        crop = canvas_crop(heldout[size][0][..., None])[..., 0].astype(np.float64)
        window_ink = crop.sum((1, 2)) * (size // 16) ** 2           # each crop pixel = (S/16)² pixels
        assert np.all(window_ink >= 0.999 * canvases.sum((1, 2)) - 0.5 * (size // 16) ** 2 * 64), size


def test_canvas_crop_rejects_other_sizes():
    for shape in [(1, 8, 8, 1), (1, 48, 48, 1), (1, 64, 32, 1), (1, 64, 64, 3)]:
        with pytest.raises(ValueError, match="expected canvases"):
            canvas_crop(np.zeros(shape, np.uint8))
    with pytest.raises(ValueError) as err:
        make_canvas(np.zeros((1, 8, 8), np.uint8), np.array([0]), seed=0, size=48)
    assert_names(err, "--image-size 48", "digits-canvas size", "choose one of 32, 64, 128")


def test_image_size_is_the_canvas_side_and_errors_name_the_fix(capsys):
    from nala_dit.training.loop import build_dataset

    assert TrainConfig().image_size is None                      # the data's own size
    cfg, _ = resolve(TrainConfig, ["--data", "digits-canvas", "--image-size", "64"])
    ds = build_dataset(cfg)
    assert ds.image_size == 64 and tuple(ds.images.shape) == (4 * 1437, 1, 64, 64)
    assert ds.images.min() == -1 and ds.images.max() <= 1
    assert build_dataset(resolve(TrainConfig, ["--data", "digits-canvas"])[0]).image_size == 32
    for argv, words in [(["--data", "digits-canvas", "--image-size", "48"],
                         ("--image-size 48", "digits-canvas size", "choose one of 32, 64, 128")),
                        (["--data", "digits", "--image-size", "128"],
                         ("--image-size 128", "not a digits size", "choose 8", "16, 32, 64", "--data digits-canvas")),
                        (["--data", "digits", "--image-size", "256"], ("old default 256", "set image-size: null")),
                        (["--data", "digits-canvas", "--image-size", "256"],
                         ("256", "digits-canvas size", "choose one of 32, 64, 128", "a config saved before"))]:
        with pytest.raises(SystemExit):
            resolve(TrainConfig, argv)
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1, errors
        assert_names(errors[0], *words)


def test_bad_digits_classifier_info_names_its_file(digits_classifier_dir, tmp_path):
    import shutil

    from nala_dit.data.digits import CLASSIFIER_INFO, load_digits_classifier

    folder = shutil.copytree(digits_classifier_dir, tmp_path / "clf")
    (folder / CLASSIFIER_INFO).write_text("{oops")
    with pytest.raises(ValueError) as err:
        load_digits_classifier(folder)
    assert str(folder / CLASSIFIER_INFO) in one_line(err)


def test_a_file_given_as_the_classifier_folder_is_named(tmp_path):
    from nala_dit.data.digits import load_digits_classifier

    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(ValueError, match="is a file: --digits-classifier takes a folder"):
        load_digits_classifier(path)
    assert path.read_text() == "mine"   # untouched
