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


# --- FID during training: what it samples with, what scored it, progress, a missing reference ---

def test_training_fid_samples_as_the_grid_names_its_network_and_shows_progress(tmp_path, capsys,
                                                                               digits_classifier_dir):
    """A DiT run with --sample-sampler unset: FID samples with the grid's DDIM (the same scores as
    `evaluate_fid.py gen --sampler ddim`, not DDPM's), log.jsonl names the network (fid_network,
    fid_network_sha256 = the classifier file's sha256), the progress line shows it briefly, and the
    sampling prints its progress (samples done / total)."""
    import hashlib
    import json

    import evaluate_fid
    from nala_dit.evaluation import metrics
    from tests.utils import TINY_RUN

    ref = tmp_path / "digits.npz"
    metrics.make_reference(ref, dataset="digits-heldout", features="digits", digits_classifier_dir=digits_classifier_dir)
    assert train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "run", "--max-steps", "1",
                                      "--fid-every", "1", "--fid-ref", str(ref), "--fid-samples", "10",
                                      "--sample-steps", "3", "--digits-classifier", str(digits_classifier_dir)]) == 0
    captured = capsys.readouterr()
    assert "FID: 10 EMA samples: 10/10 img (100%)" in captured.err, captured.err
    row = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])
    sha = hashlib.sha256((digits_classifier_dir / "model.safetensors").read_bytes()).hexdigest()
    assert row["fid_network_sha256"] == sha and row["fid_network"] == "digits-classifier (model.safetensors)"
    assert f"net={sha[:8]}" in captured.err + captured.out
    out = tmp_path / "gen.json"
    assert evaluate_fid.main(["gen", "--ckpt", str(tmp_path / "run"), "--ref", str(ref), "--num-samples", "10",
                              "--sampler", "ddim", "--steps", "3", "--device", "cpu", "--digits-classifier",
                              str(digits_classifier_dir), "--json", str(out)]) == 0
    scores = json.loads(out.read_text())["metrics"]
    assert {k: row[f"fid/{k}"] for k in scores} == pytest.approx(scores, rel=1e-5)


def test_a_missing_fid_reference_says_how_to_make_it(tmp_path, capsys):
    from tests.utils import TINY_RUN

    missing = tmp_path / "ref.npz"
    assert train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--max-steps", "1", "--fid-every", "1",
                                      "--fid-ref", str(missing)]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert_names(err.splitlines()[-1], f"--fid-ref {missing} not found", "evaluate_fid.py ref", "--fid-every 0")
