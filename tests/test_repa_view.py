"""Issue 45 item 16: what REPA costs, said with a measured ratio; the progress line shows the
diffusion loss and the alignment apart under REPA; ``sample.py --grid-scale N`` enlarges a
grid of tiny (8-px) images for viewing, by nearest neighbour."""

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import sample
from nala_dit.training.tracking import progress_values
from tests.test_sample_cli import FAST, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_progress_shows_the_diffusion_loss_and_the_alignment_apart():
    combined = dict(loss=-0.35, images_per_sec=100.0, loss_simple=0.1, loss_align=-0.9, align_cos=0.9)
    shown = progress_values(combined)
    assert shown["loss"] == "0.1000" and shown["cos"] == "0.900"     # not the combined (negative) 0.1 - 0.45
    plain = progress_values(dict(loss=0.25, images_per_sec=100.0))
    assert plain["loss"] == "0.2500" and "cos" not in plain


def test_training_md_gives_the_measured_repa_cost_and_the_progress_fields():
    text = (ROOT / "docs" / "training.md").read_text()
    section = text[text.index("## Representation alignment (REPA)"):]
    section = section[:section.index("\n## ", 10)]
    assert re.search(r"measured[^.]*\d(\.\d+)?× (the|a) step", section), "the measured ratio at T/2"
    assert "XL/2" in section and "encoder" in section
    assert "`cos`" in section and "diffusion loss" in section


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("runs") / "dit")


def test_grid_scale_enlarges_the_saved_grid_by_nearest_neighbour(run_dir, tmp_path):
    args = ["--ckpt", str(run_dir), "--labels", "1,7", "--per-label", "3", *FAST]
    assert sample.main(args + ["--grid", str(tmp_path / "1.png")]) == 0
    assert sample.main(args + ["--grid", str(tmp_path / "4.png"), "--grid-scale", "4"]) == 0
    small, big = np.asarray(Image.open(tmp_path / "1.png")), np.asarray(Image.open(tmp_path / "4.png"))
    assert big.shape == (small.shape[0] * 4, small.shape[1] * 4)
    np.testing.assert_array_equal(big, small.repeat(4, 0).repeat(4, 1))


@pytest.mark.parametrize("scale", ["0", "-2", "1.5", "65"])
def test_grid_scale_is_checked_in_one_line(run_dir, tmp_path, capsys, scale):
    with pytest.raises(SystemExit) as exit_code:
        sample.main(["--ckpt", str(run_dir), "--labels", "1", *FAST, "--grid", str(tmp_path / "g.png"),
                     "--grid-scale", scale])
    assert exit_code.value.code == 2
    err = next(line for line in capsys.readouterr().err.splitlines() if "error:" in line)
    assert "--grid-scale" in err and "1 to 64" in err
    assert not (tmp_path / "g.png").exists()


def test_an_enlarged_grid_too_large_is_refused_before_sampling(run_dir, tmp_path, capsys):
    assert sample.main(["--ckpt", str(run_dir), "--num-samples", "1000", *FAST, "--grid", str(tmp_path / "g.png"),
                        "--grid-scale", "64"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--grid-scale 64" in err and "megapixels" in err
