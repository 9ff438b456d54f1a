"""The digits ladder: ``--data digits --image-size 16`` (the scans upscaled 2x, every 2x2
block averaging exactly to its scan pixel), fine-tuning an 8-px model there with
``--init-from``, scoring 16-px samples like 8-px ones, and the size notice of sample.py."""

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from nala_dit.cli.config import resolve
from nala_dit.cli.options import TrainConfig
from nala_dit.data.digits import digits_to_input, load_digits_split, upscale_digits
from nala_dit.cli.sizes import size_notice
from nala_dit.training.loop import build_dataset
from tests.utils import assert_names

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_page_ladder_command_resolves(capsys):
    """docs/demo.md's up-the-ladder line (not one the demo prints) is a valid train.py
    command: --dry-run resolves it (defaults < the YAML < flags) without training."""
    import train

    (line,) = [ln for ln in (ROOT / "docs" / "demo.md").read_text().splitlines()
               if ln.startswith(".venv/bin/python train.py ") and "--init-from runs/demo/NaLaDiT " in ln]
    argv = shlex.split(line)[2:]
    assert train.main(argv + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    for key in ("model: NaLaDiT-T/2", "data: digits", "image-size: 16", "pos-embed: interpolate", "max-steps: 300"):
        assert key in out


@pytest.mark.parametrize("split, count, size", [("train", 1437, 16), ("heldout", 360, 16), ("heldout", 360, 32),
                                               ("heldout", 360, 64)])
def test_upscaled_digits_area_average_back_to_the_scans(split, count, size):
    small, labels = load_digits_split(split)
    big, big_labels = load_digits_split(split, size)
    f = size // 8
    assert big.shape == (count, size, size) and big.dtype == np.uint8 and np.array_equal(labels, big_labels)
    blocks = big.astype(np.int64).reshape(count, 8, f, 8, f).sum(axis=(2, 4))
    assert np.array_equal(blocks, f * f * small.astype(np.int64))      # exact, every block of every digit
    # What the digits classifier reads (area-averaged to 8x8): bit for bit the scans.
    assert torch.equal(digits_to_input(torch.from_numpy(big)[:, None]), digits_to_input(torch.from_numpy(small)[:, None]))
    # Not nearest-neighbour copies: bilinear's detail inside the blocks.
    assert (big.reshape(count, 8, f, 8, f).max(axis=(2, 4)) != big.reshape(count, 8, f, 8, f).min(axis=(2, 4))).mean() > 0.3


def test_upscale_known_answers():
    # A horizontal ramp 0, 16, ..., 112: bilinear's x ∓ 4 inside, and at the borders the block
    # keeps its scan mean (0 stays blank; 112's block [108, 112] is moved to [110, 114]).
    ramp = np.tile((np.arange(8) * 16).astype(np.uint8), (8, 1))[None]
    row = [0, 0, 12, 20, 28, 36, 44, 52, 60, 68, 76, 84, 92, 100, 110, 114]
    assert np.array_equal(upscale_digits(ramp)[0], np.tile(row, (16, 1)))
    # One full-ink pixel on blank: a 255 block can only be 255 everywhere, and blank stays blank.
    dot = np.zeros((1, 8, 8), np.uint8)
    dot[0, 3, 4] = 255
    want = np.zeros((16, 16), np.uint8)
    want[6:8, 8:10] = 255
    assert np.array_equal(upscale_digits(dot)[0], want)
    # 101 next to 51: bilinear's block [[56.8, 66.4]] * 2 around 101 is [96.2, 105.8]; the two
    # remainders .8 take the missing 2 grey levels: 96 + 106 + 96 + 106 = 4 × 101.
    pair = np.zeros((1, 8, 8), np.uint8)
    pair[0, 3, 4], pair[0, 3, 5] = 101, 51
    assert upscale_digits(pair)[0, 6:8, 8:12].tolist() == [[96, 106, 60, 42]] * 2
    constant = np.full((2, 8, 8), 77, np.uint8)
    assert np.array_equal(upscale_digits(constant), np.full((2, 16, 16), 77, np.uint8))


def test_digits_sizes_and_errors_name_the_allowed_ones(capsys):
    ds = build_dataset(resolve(TrainConfig, ["--data", "digits", "--image-size", "16"])[0])
    assert ds.image_size == 16 and tuple(ds.images.shape) == (1437, 1, 16, 16)
    assert ds.images.min() == -1 and ds.images.max() == 1
    assert build_dataset(resolve(TrainConfig, ["--data", "digits", "--image-size", "8"])[0]).image_size == 8
    assert build_dataset(resolve(TrainConfig, ["--data", "digits"])[0]).image_size == 8
    for size in ("12", "128", "4"):
        with pytest.raises(SystemExit):
            resolve(TrainConfig, ["--data", "digits", "--image-size", size])
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1, errors
        assert_names(errors[0], f"--image-size {size} ", "not a digits size", "choose 8", "16, 32, 64",
                     "--data digits-canvas")
    with pytest.raises(ValueError) as err:
        load_digits_split("train", 24)
    assert_names(err, "--image-size 24 ", "not a digits size", "choose 8", "16, 32, 64")


def test_size_notice_names_the_size_asked_for():
    config = dict(input_size=8, patch_size=2, positions="extrapolate")
    assert size_notice(config, (8, 8), 1) is None
    square = size_notice(config, (16, 16), 1)
    assert_names(square, "sampling at 16 px", "trained 8 px", "extrapolate",
                 "(train.py --init-from RUN --image-size 16 --pos-embed interpolate)")   # a command to copy
    wide = size_notice(config, (8, 16), 1)
    assert "sampling at 8x16 px" in wide
    assert_names(wide, "Fine-tune at 16 px", "larger side",
                 "(train.py --init-from RUN --image-size 16 --pos-embed interpolate)")
    latent = size_notice(dict(input_size=32, patch_size=2), (64, 32), 8)   # a 256-px latent model, 512x256
    assert_names(latent, "sampling at 512x256 px", "trained 256 px", "--image-size 512 ")


@pytest.mark.parametrize("hw, offered", [((16, 16), True), ((8, 16), True), ((4, 4), False), ((4, 8), False)])
def test_size_notice_offers_upscale_from_only_where_it_runs(hw, offered):
    """--upscale-from starts at the trained size and only grows: below it on any side the same
    command would refuse it, so the note does not offer it."""
    note = size_notice(dict(input_size=8, patch_size=2, positions="extrapolate"), hw, 1)
    assert ("--upscale-from 8" in note) == offered, note
    assert "train.py --init-from RUN" in note


def test_fine_tune_a_digits_model_at_16_px_and_score_it(tmp_path, capsys, digits_checkpoint, digits_classifier_dir):
    """An 8-px digits run fine-tuned at 16 px (4x the tokens) from its weights; its samples
    are 16 px and score through the digits classifier like the demo's."""
    import evaluate_fid
    import sample
    import train
    from nala_dit.training import checkpoint as ckpt_lib

    # The README's command (its budget cut to 2 steps of 4 images), from a random-weights 8-px run.
    assert train.main(["--config", str(ROOT / "configs" / "digits_nala_dit.yaml"), "--init-from", str(digits_checkpoint),
                       "--image-size", "16", "--pos-embed", "interpolate", "--max-steps", "2", "--global-batch-size", "4",
                       "--lr", "1e-3", "--log-every", "1", "--ckpt-every", "2", "--results-dir", str(tmp_path),
                       "--exp-name", "up"]) == 0
    out = capsys.readouterr().out
    assert "inheritance (all)" in out
    assert_names(out, "8 → 16", "positions: interpolate", "base size 8", "grid side 4 at patch 2")
    record = json.loads((tmp_path / "up" / "init_from.json").read_text())
    assert (record["source_input_size"], record["input_size"], record["base_grid_side"]) == (8, 16, 4)
    config = ckpt_lib.open_checkpoint(tmp_path / "up").model_config
    assert (config["input_size"], config["base_size"], config["positions"]) == (16, 8, "interpolate")

    samples = tmp_path / "up.npz"
    assert sample.main(["--ckpt", str(tmp_path / "up"), "--num-samples", "20", "--steps", "2", "--batch-size", "20",
                        "--out", str(samples), "--seed", "1"]) == 0
    assert np.load(samples)["arr_0"].shape == (20, 16, 16, 1)
    common = ["--features", "digits", "--digits-classifier", str(digits_classifier_dir), "--device", "cpu"]
    ref = tmp_path / "ref.npz"
    assert evaluate_fid.main(["ref", "--dataset", "digits-heldout", "--out", str(ref), *common]) == 0
    scores = {}
    for name, path in [("samples", samples), ("real16", tmp_path / "real16.npz"), ("real8", tmp_path / "real8.npz")]:
        if name != "samples":
            images, labels = load_digits_split("heldout", int(name[4:]))
            np.savez(path, images[..., None], labels)
        assert evaluate_fid.main(["calc", "--samples", str(path), "--ref", str(ref), "--json",
                                  str(tmp_path / f"{name}.json"), *common]) == 0
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())["metrics"]
    assert 0 <= scores["samples"]["class_consistency"] <= 1 and np.isfinite(scores["samples"]["fd_digits"])
    # Known answer: the 16-px held-out digits score exactly as the 8-px ones (area-averaged back).
    assert scores["real16"] == scores["real8"] and scores["real8"]["class_consistency"] >= 0.95
