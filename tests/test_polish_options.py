"""Issue 34 (newcomer polish 3), the training side: checks that come before the work they
prevent, refusals that name the flag that fits, advice that works as printed. Each test
failed before its fix."""

import pytest

import train as train_cli
from nala_dit.cli.config import resolve
from nala_dit.cli.options import TrainConfig


def dry_run_error(capsys, *argv) -> str:
    """``train.py --dry-run ARGV``: expect the parser's refusal; return its one error line."""
    with pytest.raises(SystemExit) as exc:
        train_cli.main([*argv, "--dry-run"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


# --- item 2: sample-grid options are checked with the other options, not at the first grid


@pytest.mark.parametrize("argv,message", [
    (["--sample-cfg-scale", "nan"], "--sample-cfg-scale: guidance scale must be a number from 0 (unconditional) "
                                    "to 100"),
    (["--sample-cfg-scale", "1000"], "--sample-cfg-scale: guidance scale must be a number from 0"),
    (["--sample-cfg-scale", "-1"], "--sample-cfg-scale: guidance scale must be a number from 0"),
    (["--sample-steps", "0"], "--sample-steps must be >= 1 for ddim, got 0"),
    (["--model", "NaLaSiT-T/2", "--sample-sampler", "sde-euler", "--sample-steps", "1"],
     "--sample-steps must be >= 2 for sde-euler (its last step is one of them), got 1"),
    (["--sample-steps", "2000"], "--sample-steps 2000 is more than the 1000 --diffusion-steps a ddim grid can "
                                 "take; use at most 1000"),
    (["--diffusion-steps", "0"], "--diffusion-steps must be >= 1, got 0"),
    (["--sample-cfg-scale", "2", "--class-dropout-prob", "0"],
     "--sample-cfg-scale 2.0 needs an unconditional model, but --class-dropout-prob 0.0 trains none; use "
     "--sample-cfg-scale 1 or a --class-dropout-prob above 0"),
    (["--sample-every", "-1"], "--sample-every must be >= 0 (0 = no grids), got -1"),
])
def test_grid_options_are_refused_by_dry_run(capsys, argv, message):
    assert message in dry_run_error(capsys, "--model", "NaLaDiT-T/2", *argv)


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
    from tests.test_training import TINY_RUN

    run = tmp_path / "run"
    run.mkdir()
    (run / "samples").write_text("not a folder")
    code = train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "run", "--max-steps", "2",
                                      "--sample-every", "2", "--sample-steps", "1", "--ckpt-every", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "error:" in err and "samples" in err
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["0000002"]
    assert (run / "samples").read_text() == "not a folder"  # nothing a user made is touched


# --- item 3: --init-from never drops trained tensors of a structure the student lacks


def _source_run(path, **model_kwargs):
    """A train.py-style run folder: a NaLaDiT-T/2 on 8-px digits with ``model_kwargs``."""
    import torch

    from nala_dit.training.checkpoint import save_checkpoint
    from nala_dit.cli.config import to_dict
    from nala_dit.models.dit import create_model

    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, **model_kwargs)
    cfg = TrainConfig(model="NaLaDiT-T/2", data="digits", **{k: str(v) if k == "softmax_blocks" else v
                                                              for k, v in model_kwargs.items()})
    state = dict(step=1, epoch=0, position=1, world_size=1, config=to_dict(cfg), model_config=dict(model.config))
    save_checkpoint(path / "checkpoints", model=model, ema=model, state=state,
                    optimizer=torch.optim.AdamW(model.parameters()), rng_states=[torch.get_rng_state()])
    return path


@pytest.mark.parametrize("source,student,message", [
    (dict(mlp="mix"), {}, "is a Mix-FFN model (--mlp mix): a student without it would drop its trained "
                          "depthwise convs (blocks.*.mlp.dwconv, 20,480 numbers); pass --mlp mix"),
    (dict(nala_regions=2), {}, "has 2x2 region states (--nala-regions 2): a student without them would drop "
                               "their trained mixing weights (blocks.*.attn.region_logits, 256 numbers); pass "
                               "--nala-regions 2"),
    (dict(softmax_blocks="1,3"), {}, "has softmax blocks 1,3 (--softmax-blocks 1,3), the student none: a block's "
                                     "softmax and linear layers hold different tensors; pass --softmax-blocks 1,3"),
    ({}, dict(softmax_blocks="every:2"), "has no softmax blocks, the student 1,3: a block's softmax and linear "
                                         "layers hold different tensors; pass --softmax-blocks none"),
    (dict(lepe=True), dict(lepe=False), "has trained tensors the student lacks (blocks.*.attn.lepe.bias, "
                                        "blocks.*.attn.lepe.weight: 13,312 numbers) that would be dropped; pass "
                                        "--lepe true"),
    (dict(softmax_blocks="1"), dict(softmax_blocks="3"), "has softmax blocks 1 (--softmax-blocks 1), the student 3: "
                                                         "a block's softmax and linear layers hold different tensors; "
                                                         "pass --softmax-blocks 1"),
])
def test_init_from_a_structure_the_student_lacks_is_refused_naming_the_flag(tmp_path, source, student, message):
    from nala_dit.training import convert
    from nala_dit.cli.config import to_dict
    from nala_dit.models.dit import create_model

    run = _source_run(tmp_path / "src", **source)
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, **student)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = TrainConfig(model="NaLaDiT-T/2", data="digits")
    with pytest.raises(ValueError) as err:
        convert.init_from(str(run), model, "NaLaDiT-T/2", "all-but-attention", to_dict(cfg))
    assert "\n" not in str(err.value)
    assert message in str(err.value), str(err.value)
    assert all(v.equal(before[k]) for k, v in model.state_dict().items())  # nothing was copied


def test_init_from_that_adds_structure_keeps_the_function_and_the_refusal_reaches_train_py(tmp_path, capsys):
    """The other way round is growth, not loss: a plain source into a Mix-FFN / 2x2-region
    student starts as the source's function (identity conv, w = 1: test_regions); and
    train.py says the refusal in one line, the flag to pass included."""
    from nala_dit.training import convert
    from nala_dit.cli.config import to_dict
    from nala_dit.models.dit import create_model

    run = _source_run(tmp_path / "plain")
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, mlp="mix", nala_regions=2)
    report = convert.init_from(str(run), model, "NaLaDiT-T/2", "all-but-attention",
                               to_dict(TrainConfig(model="NaLaDiT-T/2")))
    assert report.counts()["dropped"] == (0, 0)
    mix = _source_run(tmp_path / "mix", mlp="mix")
    code = train_cli.main(["--model", "NaLaDiT-T/2", "--init-from", str(mix), "--data", "digits", "--max-steps", "1",
                           "--num-workers", "0", "--results-dir", str(tmp_path), "--exp-name", "student"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "; pass --mlp mix" in err, err
    assert not (tmp_path / "student").exists()


# --- item 6: --nala-regions is checked before the model is built, and bounded


REGION_BOUND = "is more than 16 regions per side: the mixing weights grow as R⁴: H·R⁴ numbers per layer, 256 per " \
               "head at R = 4, 65,536 at R = 16, "


@pytest.mark.parametrize("text,value", [("1e9", "1000000000"), ("1_000", "1000"), ("100", "100")])
def test_nala_regions_out_of_bound_is_one_line_in_yaml_and_flags(tmp_path, capsys, text, value):
    (tmp_path / "c.yaml").write_text(f"model: NaLaDiT-T/2\nnala-regions: {text}\n")
    line = dry_run_error(capsys, "--config", str(tmp_path / "c.yaml"))
    assert f"nala-regions {value} {REGION_BOUND}" in line and "use 2 to 16" in line
    if text == "100":
        assert "100,000,000 at R = 100;" in dry_run_error(capsys, "--model", "NaLaDiT-T/2", "--nala-regions", "100")


def test_nala_regions_against_the_grid_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    from nala_dit.training import loop as training

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before --nala-regions was checked against the grid")

    monkeypatch.setattr(training, "build_model", no_build)
    code = train_cli.main(["--model", "NaLaDiT-T/2", "--data", "digits", "--nala-regions", "5", "--num-workers", "0",
                           "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert "error: nala-regions 5 cuts each side into 5 bands, but the token grid is 4x4: use at most 4 regions " \
           "per side at this size" in err


def test_nala_regions_in_an_edited_stored_config_is_one_line(tmp_path, capsys):
    """A run's ``state.json`` and a pipeline's ``transformer/config.json`` with R = 10⁹:
    refused before any region weight is made (10⁹⁴ · H numbers per layer)."""
    import json

    import export
    import sample
    from nala_dit.training import checkpoint as ckpt_lib
    from tests.test_sample_cli import FAST, write_checkpoint

    run = write_checkpoint(tmp_path / "run", nala_regions=2)
    pipe = tmp_path / "pipe"
    assert export.main(["checkpoint", str(run), str(pipe)]) == 0
    state_file = ckpt_lib.find_checkpoint(run) / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state["model_config"]["nala_regions"] = 10 ** 9
    state_file.write_text(json.dumps(state))
    config_file = pipe / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "nala_regions": 10 ** 9}))
    capsys.readouterr()
    for where, file in ((run, state_file), (pipe, config_file)):
        assert sample.main(["--ckpt", str(where), "--labels", "1", *FAST, "--grid", str(tmp_path / "g.png")]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert str(file) in err and f"nala-regions 1000000000 {REGION_BOUND}1.0e+36 at R = 1000000000" in err, err


# --- item 7: choice flags and list-valued YAML keys


@pytest.mark.parametrize("argv,message", [
    (["--mlp", "none"], "--mlp expects one of 'mlp', 'mix', got 'none' (every block has an MLP: 'mlp' is DiT's, the "
                        "default; 'mix' is Mix-FFN, a 3x3 depthwise conv between its linears)"),
    (["--attention", "None"], "--attention expects one of 'softmax', 'nala', 'relu', 'elu', 'softmax_gated', got "
                              "'None'"),
])
def test_none_for_a_choice_flag_names_the_choices(capsys, argv, message):
    line = dry_run_error(capsys, "--model", "NaLaDiT-T/2", *argv)
    assert message in line and "invalid choice: None" not in line


def test_pos_embed_none_is_the_choice_none():
    """``none`` is one of --pos-embed's choices (LePE only); the flag refused it as None."""
    assert resolve(TrainConfig, ["--pos-embed", "none"])[0].pos_embed == "none"
    assert resolve(TrainConfig, ["--mlp", "mix"])[0].mlp == "mix"


def test_yaml_softmax_blocks_in_the_list_form_of_stored_configs(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("model: NaLaDiT-T/2\nsoftmax-blocks: [1, 3]\nallow-changes: [lr, mlp]\n")
    cfg, _ = resolve(TrainConfig, ["--config", str(tmp_path / "c.yaml")])
    assert (cfg.softmax_blocks, cfg.allow_changes) == ("1,3", "lr,mlp")
    (tmp_path / "c.yaml").write_text("model: NaLaDiT-T/2\nsoftmax-blocks: [1, 7]\n")
    assert "softmax-blocks '1,7': block 7 does not exist in a 4-block model; use indices 0..3" in \
        dry_run_error(capsys, "--config", str(tmp_path / "c.yaml"))


def test_a_very_deep_yaml_list_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text("lr: " + "[" * 5_000 + "]" * 5_000 + "\n")  # past Python's recursion limit, as 100,000 is
    assert dry_run_error(capsys, "--config", str(path)).split(": error: ", 1)[1] == (
        f"{path}: nested too deeply to read (lists or mappings inside each other thousands of levels "
        f"deep); a config holds plain values and short lists")


# --- item 9: resume advice names only what works


def _train_main(tmp_path, *argv):
    from tests.test_training import TINY_RUN

    return train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), *argv])


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line[line.index("error:"):] for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_resume_with_a_new_structure_suggests_a_new_run_and_the_command_works(tmp_path, capsys):
    """--mlp mix on a plain run: --allow-changes cannot load the weights, so the error names
    --init-from into a new run; that command, as printed, trains."""
    import re

    from nala_dit.training import checkpoint as ckpt_lib

    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "1", "--ckpt-every", "1") == 0
    capsys.readouterr()
    ckpt = tmp_path / "run" / "checkpoints" / "0000001"
    for allow in ([], ["--allow-changes", "mlp"]):
        assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "2", "--resume", "auto", "--mlp", "mix",
                           *allow) == 1
        err = _one_error(capsys)
        assert f"checkpoint {ckpt} was trained with other settings (mlp: 'mlp' in the checkpoint, 'mix' now). Its " \
               f"weights do not fit the model these settings build (8 missing (e.g. blocks.0.mlp.dwconv.weight)), " \
               f"so this run cannot continue with them (--allow-changes cannot help): resume with the " \
               f"checkpoint's settings (--mlp mlp); or to train with the new settings, start a new run from its " \
               f"weights: drop --resume (and --allow-changes) and pass --init-from {ckpt} --exp-name run-mlp" in err
        assert "pass --allow-changes" not in err
    suggested = re.search(r"pass (--init-from \S+ --exp-name \S+)$", err).group(1).split()
    assert _train_main(tmp_path, "--max-steps", "1", "--mlp", "mix", *suggested) == 0
    assert ckpt_lib.open_checkpoint(tmp_path / "run-mlp").model_config["mlp"] == "mix"
    # the other advice works too: the checkpoint's own setting resumes
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "2", "--resume", "auto", "--mlp", "mlp") == 0


@pytest.mark.parametrize("source,now,own,reason", [
    (["--mlp", "mix"], ["--mlp", "mlp"], "--mlp mix", "is a Mix-FFN model (--mlp mix): a student without it would "
                                                      "drop its trained depthwise convs"),
    (["--nala-regions", "2"], ["--nala-regions", "1"], "--nala-regions 2", "has 2x2 region states"),
    ([], ["--softmax-blocks", "1"], "--softmax-blocks none", "has no softmax blocks, the student 1"),
])
def test_resume_advice_never_suggests_what_fails(tmp_path, capsys, source, now, own, reason):
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "1", "--ckpt-every", "1", *source) == 0
    capsys.readouterr()
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "2", "--resume", "auto", *now) == 1
    err = _one_error(capsys)
    assert f"resume with the checkpoint's settings ({own}); or a new run cannot start from its weights either" in err
    assert reason in err and "--allow-changes " not in err.replace("(--allow-changes cannot help)", "")
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "2", "--resume", "auto", *own.split()) == 0


# --- item 12 (training): what a resume across context-parallel sizes gives; the first line names the hybrid


def test_resume_across_context_parallel_sizes_says_fp32_close(tmp_path, capsys):
    """A 1-process run's checkpoint, its config edited as a --context-parallel 2 run's would
    be (world size 1 either way: one data-parallel group), resumed in one process."""
    import json

    from nala_dit.training import checkpoint as ckpt_lib

    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "1", "--ckpt-every", "1") == 0
    state_file = ckpt_lib.find_checkpoint(tmp_path / "run") / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state["config"]["context-parallel"] = 2
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "2", "--resume", "auto") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "context-parallel" in line]
    assert lines == ["resume: the checkpoint was trained with --context-parallel 2, this run uses 1: it continues "
                     "fp32-close to an uninterrupted run, not bit for bit (the split adds in another order; 2 "
                     "processes against 1: 1.3e-6 apart after 3 steps, docs/highres.md)"]
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "3", "--resume", "auto") == 0
    assert "context-parallel" not in capsys.readouterr().out  # same size: nothing to say


def test_start_line_names_the_softmax_blocks(tmp_path, capsys):
    from nala_dit.models.dit import create_model
    from nala_dit.training.loop import attention_path

    hybrid = dict(create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10,
                               softmax_blocks="1,3").config)
    assert attention_path(hybrid, "cpu", "no") == "nala (fused) with softmax in blocks 1, 3 (--softmax-blocks 1,3)"
    assert attention_path(dict(hybrid, softmax_blocks=None), "cpu", "no") == "nala (fused)"
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "1", "--softmax-blocks", "every:2") == 0
    start = [line for line in capsys.readouterr().out.splitlines() if line.startswith("start:")]
    assert start == ["start: 1 process on 1× cpu, global batch 8 (8 per process, grad-accum 1), precision no, "
                     "attention nala (fused) with softmax in blocks 1, 3 (--softmax-blocks 1,3)"]
