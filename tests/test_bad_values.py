"""Issue 45, items 4 and 6: a bad EMA decay, learning rate or clipping bound is refused in one
line at parse time (``--dry-run`` included), and ``--val-samples`` above the held-out split is
said, naming both numbers."""

import subprocess
import sys
from pathlib import Path

import pytest

import train as train_cli

ROOT = Path(__file__).resolve().parents[1]


def dry_run_error(capsys, *argv) -> str:
    """The ``error:`` line of ``train.py ... --dry-run`` (exit status 2, nothing else wrong)."""
    with pytest.raises(SystemExit) as stop:
        train_cli.main([*argv, "--dry-run"])
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("value", ["2", "nan", "inf", "-0.5", "1.0001"])
def test_ema_decay_outside_zero_to_one_is_refused(capsys, value):
    line = dry_run_error(capsys, "--ema-decay", value)
    assert "--ema-decay" in line and "from 0 to 1" in line and f"got {float(value)}" in line, line


def test_ema_decay_edges_are_accepted(capsys):
    for value in ("0", "1", "0.9999"):
        assert train_cli.main(["--ema-decay", value, "--dry-run"]) == 0
    assert "ema-decay: 1.0" not in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1e-4", "nan", "inf", "-inf"])
def test_lr_not_a_finite_non_negative_number_is_refused(capsys, value):
    line = dry_run_error(capsys, "--lr", value)
    assert "--lr" in line and "finite" in line and ">= 0" in line and f"got {float(value)}" in line, line
    assert "Invalid learning rate" not in line


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_max_grad_norm_nan_is_not_no_clipping(capsys, value):
    line = dry_run_error(capsys, "--max-grad-norm", value)
    assert "--max-grad-norm" in line and "finite" in line and "0 = no clipping" in line, line
    assert f"got {float(value)}" in line, line


def test_the_same_checks_hold_in_yaml(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("ema-decay: .nan\n")
    assert "--ema-decay" in dry_run_error(capsys, "--config", str(config))
    config.write_text("lr: .inf\n")
    assert "--lr" in dry_run_error(capsys, "--config", str(config))


def test_the_refusal_loads_no_torch():
    probe = ("import sys, train\ntry:\n    train.main(['--lr', 'nan', '--dry-run'])\nexcept SystemExit:\n    pass\n"
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr


def test_val_samples_above_the_heldout_split_is_said_with_both_numbers(tmp_path, capsys):
    from nala_dit.data.datasets import DigitsDataset
    from tests.test_training import TINY_RUN

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
