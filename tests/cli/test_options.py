"""Options that do not apply to the chosen model are errors that name the option and the
models it applies to: in ``create_model``, in YAML configs and on the command line."""

import subprocess
import sys
from pathlib import Path

import pytest

import train as train_cli
from nala_dit.cli.config import resolve
from nala_dit.cli.options import ATTENTION_OPTIONS, TrainConfig
from tests.scripts.test_sample import FAST
from tests.utils import assert_names, cli, one_line_error


def test_create_model_rejects_inapplicable_attention_options():
    from nala_dit.models.dit import create_model

    with pytest.raises(ValueError) as err:
        create_model("DiT-T/2", input_size=8, lepe=True)
    assert_names(err, "lepe applies to", "nala/relu/elu/softmax_gated", "not to DiT-T/2", "uses softmax attention",
                 "e.g. NaLaDiT-T/2")
    with pytest.raises(ValueError) as err:
        create_model("NaLaDiT-T/2", input_size=8, attention="relu", power=2.0)
    assert_names(err, "power applies to", "(nala attention)", "not to NaLaDiT-T/2", "uses relu attention")
    with pytest.raises(ValueError) as err:
        create_model("DiT-T/2", input_size=8, attention="softmax_gated", rope=True)
    assert_names(err, "rope applies to", "linear kernels", "uses softmax_gated attention")
    # The same options are fine where they apply: an override of the attention kind counts.
    assert create_model("DiT-T/2", input_size=8, attention="nala", lepe=False).config.lepe is False
    assert create_model("NaLaSiT-T/2", input_size=8, alpha=5.0).config.alpha == 5.0


@pytest.mark.parametrize("option", sorted(ATTENTION_OPTIONS))
def test_every_table_row_is_enforced_for_softmax_in_configs(option, tmp_path):
    value = {"direction": "cosine"}.get(option, "true" if option in ("lepe", "gate", "out_norm", "rope") else "2.0")
    flag = option.replace("_", "-")
    yaml = tmp_path / "c.yaml"
    yaml.write_text(f"model: SiT-T/2\n{flag}: {value}\n")
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--config", str(yaml)])
    with pytest.raises(ValueError) as err:
        TrainConfig(model="SiT-T/2", **{option: {"direction": "cosine", "rope": True}.get(option, 2.0)}).validate()
    assert_names(err, f"--{flag} applies to", "not to SiT-T/2", "e.g. NaLaSiT-T/2")


def test_objective_options_and_grid_sampler_must_fit_the_objective(capsys):
    with pytest.raises(ValueError) as err:
        TrainConfig(model="DiT-T/2", path_type="gvp").validate()
    assert_names(err, "--path-type", "DiT-T/2", "diffusion model", "SiT (transport) option")
    with pytest.raises(ValueError) as err:
        TrainConfig(model="NaLaSiT-T/2", noise_schedule="cosine").validate()
    assert_names(err, "--noise-schedule", "NaLaSiT-T/2", "DiT (diffusion) option")
    with pytest.raises(ValueError) as err:
        TrainConfig(model="SiT-T/2", sample_sampler="ddim").validate()
    assert_names(err, "--sample-sampler ddim", "SiT-T/2", "choose one of")
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--model", "DiT-T/2", "--prediction", "noise"])
    assert_names(capsys.readouterr().err, "--prediction", "DiT-T/2", "SiT (transport) option")
    TrainConfig(model="SiT-T/2", path_type="gvp", sample_sampler="sde-euler").validate()  # fits: no error


def test_default_num_workers_shares_the_cpus_of_this_process(monkeypatch):
    from nala_dit.cli.options import default_num_workers

    # (processes on this machine, CPUs this process may use) -> workers per process
    for processes, cpus, workers in ((1, 2, 2), (2, 2, 1), (3, 2, 0), (1, 1, 1), (1, 16, 4), (8, 64, 4), (4, 8, 2)):
        assert default_num_workers(processes, cpus) == workers, (processes, cpus)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)  # taskset / Slurm: 2 CPUs
    assert default_num_workers(1) == 2 and default_num_workers(2) == 1
    cfg, _ = resolve(TrainConfig, [])
    assert cfg.num_workers is None  # resolved per run; the flag still sets it
    assert resolve(TrainConfig, ["--num-workers", "3"])[0].num_workers == 3
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--num-workers", "-1"])


@pytest.mark.parametrize("scale", ["nan", "inf", "-inf", "1e30", "-1"])
def test_cfg_scale_must_be_finite_and_bounded(run_dir, tmp_path, capsys, scale):
    with pytest.raises(SystemExit) as exit_:
        cli("--ckpt", run_dir, "--labels", "1", f"--cfg-scale={scale}", "--grid", tmp_path / "g.png")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert_names(err, "guidance scale", "from 0 (unconditional) to 100", f"got '{scale}'")


@pytest.mark.parametrize("shift", ["1e300", "101", "0.001"])
def test_time_shift_is_bounded(run_dir, tmp_path, capsys, shift):
    assert cli("--ckpt", run_dir, "--labels", "1", *FAST, "--time-shift", shift, "--grid", tmp_path / "g.png") == 1
    assert_names(one_line_error(capsys), "time shift", "from 0.01 to 100", "'auto'", shift)


ROOT = Path(__file__).resolve().parents[2]


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
