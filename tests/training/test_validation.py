"""Tests of `nala_dit/training/validation.py`."""

import pytest

import train as train_cli
from nala_dit.cli.config import resolve
from nala_dit.cli.options import TrainConfig
from tests.utils import assert_names, dry_run_error


@pytest.mark.parametrize("argv,words", [
    (["--sample-cfg-scale", "nan"], ("--sample-cfg-scale", "from 0 (unconditional) to 100", "got nan")),
    (["--sample-cfg-scale", "1000"], ("--sample-cfg-scale", "from 0 (unconditional) to 100", "got 1000.0")),
    (["--sample-cfg-scale", "-1"], ("--sample-cfg-scale", "from 0 (unconditional) to 100", "got -1.0")),
    (["--sample-steps", "0"], ("--sample-steps", ">= 1 for ddim", "got 0")),
    (["--model", "NaLaSiT-T/2", "--sample-sampler", "sde-euler", "--sample-steps", "1"],
     ("--sample-steps", ">= 2 for sde-euler", "got 1")),
    (["--sample-steps", "2000"], ("--sample-steps 2000", "1000 --diffusion-steps", "use at most 1000")),
    (["--diffusion-steps", "0"], ("--diffusion-steps", ">= 1", "got 0")),
    (["--sample-cfg-scale", "2", "--class-dropout-prob", "0"],
     ("--sample-cfg-scale 2.0", "unconditional model", "--class-dropout-prob 0.0", "--sample-cfg-scale 1",
      "--class-dropout-prob above 0")),
    (["--sample-every", "-1"], ("--sample-every", ">= 0", "got -1")),
])
def test_grid_options_are_refused_by_dry_run(capsys, argv, words):
    assert_names(dry_run_error(capsys, "--model", "NaLaDiT-T/2", *argv), *words)


def test_grid_options_that_fit_pass_and_nothing_is_checked_when_grids_are_off(capsys):
    cfg, _ = resolve(TrainConfig, ["--model", "NaLaSiT-T/2", "--sample-sampler", "sde-euler", "--sample-steps", "2",
                                   "--sample-cfg-scale", "4"])
    assert (cfg.sample_steps, cfg.sample_cfg_scale) == (2, 4.0)
    cfg, _ = resolve(TrainConfig, ["--model", "NaLaDiT-T/2", "--sample-steps", "1000", "--sample-cfg-scale", "0"])
    assert cfg.sample_steps == 1000
    # a config that switches grids off may leave their options at anything
    cfg, _ = resolve(TrainConfig, ["--sample-every", "0", "--sample-steps", "0", "--sample-cfg-scale", "1000"])
    assert cfg.sample_every == 0


def test_a_grid_that_fails_loses_no_steps(tmp_path, capsys):
    """The step's checkpoint is written before its grid is drawn: here the grid cannot be
    saved (``samples`` is a file, a real OSError) and the step-2 checkpoint is there."""
    from nala_dit.training.checkpoint import list_checkpoints
    from tests.utils import TINY_RUN

    run = tmp_path / "run"
    run.mkdir()
    (run / "samples").write_text("not a folder")
    code = train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "run", "--max-steps", "2",
                                      "--sample-every", "2", "--sample-steps", "1", "--ckpt-every", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "error:" in err and "samples" in err
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["0000002"]
    assert (run / "samples").read_text() == "not a folder"  # nothing a user made is touched


def test_val_samples_above_the_heldout_split_is_said_with_both_numbers(tmp_path, capsys):
    from nala_dit.data.datasets import DigitsDataset
    from tests.utils import TINY_RUN

    size = len(DigitsDataset("heldout"))
    assert train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--max-steps", "1", "--val-every", "1",
                                      "--val-samples", "100000"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "--val-samples" in line]
    assert len(lines) == 1, out
    assert "100000" in lines[0] and str(size) in lines[0] and "held-out" in lines[0], lines[0]
    # at or below the split's size: nothing to say
    assert train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "small", "--max-steps", "1",
                                      "--val-every", "1", "--val-samples", str(size)]) == 0
    assert "--val-samples" not in capsys.readouterr().out
