"""Options that do not apply to the chosen model are errors that name the option and the
models it applies to: in ``create_model``, in YAML configs and on the command line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import train as train_cli
from nala_dit.cli.config import resolve
from nala_dit.cli.options import ATTENTION_OPTIONS, TrainConfig
from tests.scripts.test_sample import FAST
from tests.utils import assert_names, cli, copy_tree, one_line, one_line_error


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


# --- every sampler's steps bounded by what it can take (check_steps), in every caller
def test_check_steps_bounds_each_sampler():
    from nala_dit.cli.options import (DIFFUSION_SAMPLERS, MAX_CONTINUOUS_STEPS, MAX_DIFFUSION_STEPS, SAMPLERS,
                                      TRANSPORT_SAMPLERS, check_steps, max_steps)

    assert [max_steps(s, 1000) for s in DIFFUSION_SAMPLERS] == [1000] * 3                  # one per timestep
    assert [max_steps(s) for s in DIFFUSION_SAMPLERS] == [MAX_DIFFUSION_STEPS] * 3         # chain not known yet
    assert len(TRANSPORT_SAMPLERS) == 6 and "meanflow" in TRANSPORT_SAMPLERS   # ODE/SDE samplers and MeanFlow's
    assert [max_steps(s, 1000) for s in TRANSPORT_SAMPLERS] == [MAX_CONTINUOUS_STEPS] * 6
    for sampler in SAMPLERS:
        most = max_steps(sampler, 250)
        assert check_steps(sampler, most, 250) == most
        with pytest.raises(ValueError) as err:
            check_steps(sampler, most + 1, 250)
        assert_names(one_line(err), f"--steps {most + 1}:", sampler, f"use at most {most}")
        with pytest.raises(ValueError, match="must be >= "):
            check_steps(sampler, 0, 250)
    with pytest.raises(ValueError, match=r"must be >= 2 for sde-euler \(its last step"):
        check_steps("sde-euler", 1)
    for bad in (2.5, "50", True, None):
        with pytest.raises(ValueError, match="whole number of steps"):
            check_steps("ddim", bad, 1000)


@pytest.mark.parametrize("argv, words", [
    (["--sample-steps", "1001"], ["--sample-steps 1001", "ddim", "the 1000 --diffusion-steps", "use at most 1000"]),
    (["--model", "NaLaSiT-T/2", "--sample-sampler", "ode-euler", "--sample-steps", "100000000"],
     ["--sample-steps 100000000", "ode-euler", "at most 10000 steps"]),
    # FID in training samples with --sample-steps too: checked with grids off
    (["--sample-every", "0", "--fid-every", "5", "--fid-ref", "r.npz", "--model", "NaLaSiT-T/2",
      "--sample-steps", "20000"], ["--sample-steps 20000", "ode-heun", "at most 10000 steps"]),
])
def test_train_refuses_sample_steps_past_the_samplers_bound(capsys, argv, words):
    assert_names(dry_run_error(capsys, *argv), *words)


@pytest.fixture(scope="module")
def sit_run(tmp_path_factory):
    from tests.scripts.test_sample import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("runs") / "sit", "NaLaSiT-T/2")


@pytest.mark.parametrize("sampler, steps, most", [("dpm-solver", 1001, 1000), ("dpm-solver", 5000, 1000),
                                                  ("ddpm", 1001, 1000), ("ode-euler", 100_000_000, 10_000),
                                                  ("sde-heun", 10_001, 10_000), ("dopri5", 10**9, 10_000)])
def test_sample_refuses_steps_past_the_samplers_bound(run_dir, sit_run, tmp_path, capsys, sampler, steps, most):
    """dpm-solver at 1001 steps gave NaN samples blamed on the weights, at 5000 an IndexError
    traceback; ode-euler took 10^8 steps: one line naming the sampler's bound, before sampling."""
    ckpt = run_dir if sampler in ("dpm-solver", "ddpm") else sit_run
    assert cli("--ckpt", ckpt, "--labels", "1", "--sampler", sampler, "--steps", steps,
               "--grid", tmp_path / "g.png") == 1
    assert_names(one_line_error(capsys), f"--steps {steps}:", sampler, f"use at most {most}")
    assert not (tmp_path / "g.png").exists()


def test_the_chain_bound_is_the_models_own(tmp_path, capsys):
    """A DiT trained with 100 timesteps takes at most 100 ddim steps (sample.py, after loading)."""
    from tests.scripts.test_sample import write_checkpoint

    run = write_checkpoint(tmp_path / "short")
    state_file = next((run / "checkpoints").glob("*/state.json"))
    state = json.loads(state_file.read_text())
    state["config"]["diffusion-steps"] = 100
    state_file.write_text(json.dumps(state))
    assert cli("--ckpt", run, "--labels", "1", "--sampler", "ddim", "--steps", 101, "--grid", tmp_path / "g.png") == 1
    assert_names(one_line_error(capsys), "--steps 101:", "ddim", "the model's 100 training timesteps")
    assert cli("--ckpt", run, "--labels", "1", "--sampler", "ddim", "--steps", 100, "--grid", tmp_path / "g.png") == 0


def test_max_nfe_is_bounded(sit_run, tmp_path, capsys):
    assert cli("--ckpt", sit_run, "--labels", "1", "--sampler", "dopri5", "--max-nfe", 10**9,
               "--grid", tmp_path / "g.png") == 1
    assert_names(one_line_error(capsys), "--max-nfe", "from 1 to 10,000", "got 1000000000")


def test_the_web_page_refuses_what_sample_refuses(sit_run):
    """app.py's requests go through sample.py's checks: ode-euler with 10^8 steps is one line."""
    import app

    args = app.build_parser().parse_args(["--ckpt", str(sit_run)])
    demo = app.Demo(args, app.load(args))
    status, grid, *_ = demo.generate(["1"], 1, "ode-euler", 100_000_000, 1, 0, None)
    assert grid is None
    assert_names(status, "error: --steps 100000000:", "ode-euler", "at most 10000 steps")


def test_pipelines_refuse_num_inference_steps_past_the_bound(pipe_dir, tmp_path):
    from nala_dit.pipelines.pipeline import load_pipeline

    pipe = load_pipeline(pipe_dir)
    for sampler in ("dpm-solver", "scheduler", "ddpm"):
        with pytest.raises(ValueError) as err:
            pipe([1], sampler=sampler, num_inference_steps=1001, generator=0)
        assert_names(one_line(err), "num_inference_steps 1001:", "1000", "use at most 1000")
    # a stored count past the bound: refused on loading
    index = copy_tree(pipe_dir, tmp_path / "p") / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "sampler": "ddim", "num_inference_steps": 5000}))
    with pytest.raises(ValueError) as err:
        load_pipeline(tmp_path / "p")
    assert_names(one_line(err), "num_inference_steps 5000:", "ddim", "use at most 1000")


# --- crafted diffusion chains refused before any allocation (check_diffusion_steps)
@pytest.mark.parametrize("value", ["10000000000", "0", "10001"])
def test_train_refuses_a_diffusion_chain_past_the_bound(capsys, value):
    assert_names(dry_run_error(capsys, "--diffusion-steps", value), "--diffusion-steps", ">= 1 and <= 10,000",
                 f"got {value}")


def test_an_edited_checkpoint_chain_is_one_line(run_dir, tmp_path, capsys):
    run = copy_tree(run_dir, tmp_path / "run")
    state_file = next((run / "checkpoints").glob("*/state.json"))
    state = json.loads(state_file.read_text())
    state["config"]["diffusion-steps"] = 10**10
    state_file.write_text(json.dumps(state))
    assert cli("--ckpt", run, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
    assert_names(one_line_error(capsys), f"{state_file}: diffusion-steps", ">= 1 and <= 10,000", "got 10000000000",
                 "edited or damaged")


@pytest.mark.parametrize("edit", ["scheduler", "objective"])
def test_an_edited_pipeline_chain_is_refused_before_diffusers_builds_it(pipe_dir, tmp_path, edit):
    """scheduler_config.json's num_train_timesteps 10^12 asks diffusers for 7.28 TiB; model_index.json's
    objective_config the same of ours. Our loader checks first (diffusers' own DiffusionPipeline.from_pretrained
    is left as diffusers made it: docs/sampling.md)."""
    from nala_dit.pipelines.pipeline import NaLaDiTPipeline

    folder = copy_tree(pipe_dir, tmp_path / "p")
    if edit == "scheduler":
        file, where = folder / "scheduler" / "scheduler_config.json", "'num_train_timesteps'"
        file.write_text(json.dumps({**json.loads(file.read_text()), "num_train_timesteps": 10**12}))
    else:
        file, where = folder / "model_index.json", "objective_config 'diffusion-steps'"
        index = json.loads(file.read_text())
        file.write_text(json.dumps({**index, "objective_config": {**index["objective_config"],
                                                                  "diffusion-steps": 10**12}}))
    with pytest.raises(ValueError) as err:
        NaLaDiTPipeline.from_pretrained(str(folder))
    assert_names(one_line(err), f"{file}: {where}", ">= 1 and <= 10,000", "got 1000000000000", "export the pipeline")


# --- --class-dropout-prob is a probability in [0, 1)
@pytest.mark.parametrize("value", ["1.5", "nan", "-0.1", "1", "inf"])
def test_class_dropout_outside_zero_to_one_is_refused(capsys, value):
    assert_names(dry_run_error(capsys, "--class-dropout-prob", value), "--class-dropout-prob", "[0, 1)",
                 f"got {float(value)}")


def test_class_dropout_edges_are_accepted():
    for value in ("0", "0.1", "0.999"):
        assert train_cli.main(["--class-dropout-prob", value, "--dry-run"]) == 0


def test_a_checkpoint_with_class_dropout_past_one_is_refused(run_dir, pipe_dir, tmp_path, capsys):
    """sample.py and export.py took a model_config with class_dropout_prob 1.5 (never saw a label)."""
    import export

    run = copy_tree(run_dir, tmp_path / "run")
    state_file = next((run / "checkpoints").glob("*/state.json"))
    state = json.loads(state_file.read_text())
    state["model_config"]["class_dropout_prob"] = 1.5
    state_file.write_text(json.dumps(state))
    pipe = copy_tree(pipe_dir, tmp_path / "pipe")
    config_file = pipe / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "class_dropout_prob": 1.5}))
    for where, file in ((run, state_file), (pipe, config_file)):
        assert cli("--ckpt", where, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
        assert_names(one_line_error(capsys), f"{file}: 'class_dropout_prob'", "[0, 1)", "got 1.5")
    assert export.main(["checkpoint", str(run), str(tmp_path / "out")]) == 1
    assert_names(capsys.readouterr().err, f"{state_file}: 'class_dropout_prob'", "got 1.5")


# --- a negative seed is one line naming --seed (was numpy's "expected non-negative integer")
@pytest.mark.parametrize("value", ["-1", str(2**32)])
def test_train_seed_outside_numpys_range_is_refused(capsys, value):
    assert_names(dry_run_error(capsys, "--seed", value), "--seed", "from 0 to 2**32 - 1", f"got {value}")


def test_sample_seed_below_zero_names_the_flag(capsys):
    import sample

    with pytest.raises(SystemExit) as stop:
        sample.main(["--ckpt", "nowhere", "--seed", "-1"])
    assert stop.value.code == 2
    assert "argument --seed: must be a whole number >= 0, got -1" in capsys.readouterr().err


def test_pipeline_int_generator_below_zero_is_one_line():
    from nala_dit.diffusion.generate import seed_from

    with pytest.raises(ValueError, match=r"^generator: an int seed must be >= 0, got -3$"):
        seed_from(-3)
    assert seed_from(0) == 0 and seed_from(2**40) == 2**40
