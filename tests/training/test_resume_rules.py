"""One rule per training setting on resume, in one table
(``options.RESUME_RULES``): applied and announced, refused (``--allow-changes`` names it), said
by a line of its own, or not compared (how this command resumes). Every field of
``TrainConfig`` is classified; each category is tried on a real resume, and every key of the
two main categories is tried against a checkpoint's config."""

import dataclasses
import json

import pytest

import train as train_cli
from nala_dit.cli.config import to_dict
from nala_dit.cli.options import TrainConfig
from nala_dit.training.resume_rules import RESUME_RULE, RESUME_RULES
from nala_dit.training import checkpoint as ckpt_lib
from tests.utils import TINY_RUN, assert_names

FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]


def flag(name: str) -> str:
    return name.replace("_", "-")


def shown(value) -> str:
    """A value as the command line spells it (booleans true / false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def train(tmp_path, *argv) -> int:
    return train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "run", *argv])


def test_every_setting_has_exactly_one_rule():
    listed = [name for names in RESUME_RULES.values() for name in names]
    assert sorted(listed) == sorted(FIELDS), (set(FIELDS) ^ set(listed))
    assert len(listed) == len(set(listed)), "a setting under two rules"
    assert set(RESUME_RULE) == set(FIELDS)
    for name in ("ema_decay", "ema_warmup", "seed", "flip"):   # the ones that used to change silently
        assert RESUME_RULE[name] == "applied", name
    assert RESUME_RULE["class_dropout_prob"] == "refused-model"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 1-step run's checkpoint, kept unchanged (each test copies its run folder)."""
    root = tmp_path_factory.mktemp("resume-rules")
    assert train(root, "--max-steps", "1", "--ckpt-every", "1") == 0
    return root / "run"


def copy_run(checkpoint, tmp_path):
    import shutil

    shutil.copytree(checkpoint, tmp_path / "run")
    return tmp_path / "run"


def test_a_changed_ema_decay_seed_or_flip_is_applied_and_announced(checkpoint, tmp_path, capsys):
    run = copy_run(checkpoint, tmp_path)
    capsys.readouterr()
    assert train(tmp_path, "--max-steps", "2", "--resume", "auto", "--ema-decay", "0.99", "--ema-warmup", "false",
                 "--seed", "7", "--flip", "true") == 0
    out = capsys.readouterr().out
    for new, old in (("--ema-decay 0.99", "0.9999"), ("--ema-warmup false", "true"), ("--seed 7", "0"),
                     ("--flip true", "false")):
        lines = [line for line in out.splitlines() if line.startswith(f"resume: {new} ")]
        assert len(lines) == 1, out
        assert_names(lines[0], f"checkpoint's {old}")
    config = ckpt_lib.open_checkpoint(run).config   # applied: the new checkpoint records them
    assert (config["ema-decay"], config["ema-warmup"], config["seed"], config["flip"]) == (0.99, False, 7, True)
    # the same settings again: nothing to say
    assert train(tmp_path, "--max-steps", "3", "--resume", "auto", "--ema-decay", "0.99", "--ema-warmup", "false",
                 "--seed", "7", "--flip", "true") == 0
    out = capsys.readouterr().out
    assert not [line for line in out.splitlines() if "replaces the checkpoint's" in line and "max-steps" not in line]


def test_a_refused_change_names_the_key_and_the_escape(checkpoint, tmp_path, capsys):
    copy_run(checkpoint, tmp_path)
    capsys.readouterr()
    assert train(tmp_path, "--max-steps", "2", "--resume", "auto", "--class-dropout-prob", "0.2") == 1
    err = capsys.readouterr().err
    assert "class-dropout-prob: 0.1 in the checkpoint, 0.2 now" in err and \
        "--allow-changes class-dropout-prob" in err, err
    assert train(tmp_path, "--max-steps", "2", "--resume", "auto", "--class-dropout-prob", "0.2",
                 "--allow-changes", "class-dropout-prob") == 0
    assert_names(capsys.readouterr().out, "resume: class-dropout-prob", "from 0.1 to 0.2", "(--allow-changes)")


def test_not_compared_and_own_line_settings_print_no_generic_line(checkpoint, tmp_path, capsys):
    copy_run(checkpoint, tmp_path)
    capsys.readouterr()
    assert train(tmp_path, "--max-steps", "2", "--resume", "auto", "--allow-changes", "lr",
                 "--init-from", "somewhere/else") == 0
    out = capsys.readouterr().out
    assert "resume: --init-from somewhere/else is ignored" in out          # its own line
    for name in RESUME_RULES["not-compared"] + RESUME_RULES["own-line"]:
        assert f"resume: --{flag(name)} " not in out.replace("resume: --init-from somewhere/else is ignored", ""), name


# Another valid value of every setting under the two main rules (a type the field takes).
OTHER = {"data": "digits-canvas", "image_size": 16, "flip": False, "skip_corrupt": True, "check_data": True,
         "num_workers": 2, "t_sampling": "logit-normal", "t_mean": 0.5, "t_std": 0.5, "global_batch_size": 16,
         "grad_accum": 2, "lr": 2e-4, "warmup_steps": 10, "weight_decay": 0.01, "adam_beta2": 0.95,
         "max_grad_norm": 1.0, "max_nan_steps": 3, "ema_decay": 0.99, "ema_warmup": False, "max_steps": 7,
         "mixed_precision": "bf16", "grad_checkpointing": True, "compile": True, "threads": 2, "seed": 3,
         "results_dir": "elsewhere", "exp_name": "other", "log_every": 5, "ckpt_every": 5, "keep_last": 2,
         "sample_every": 5, "sample_sampler": "ddpm", "sample_steps": 10, "sample_cfg_scale": 2.0,
         "report_to": "none", "val_every": 5, "val_data": "held", "val_samples": 8, "fid_every": 5,
         "fid_ref": "ref.npz", "fid_samples": 8, "fid_features": "digits", "inception_weights": "w.pth",
         "allow_unknown_inception_weights": True,
         "digits_classifier": "clf", "repa_weight": 1.0, "mf_ratio": 0.5, "mf_t_mean": 0.0, "mf_t_std": 2.0,
         "mf_adaptive_p": 0.5, "mf_adaptive_c": 0.01, "mf_cfg_omega": 2.0, "mf_cfg_kappa": 0.5,
         # refused, compared in the training config
         "noise_schedule": "cosine", "diffusion_steps": 500, "path_type": "gvp", "prediction": "noise",
         "loss_weight": "velocity", "train_eps": 1e-3, "sample_eps": 1e-3, "time_shift": "2.0", "vae": "other-vae",
         "teacher": "runs/teacher", "distill_weight": 1.0, "distill_sigma_weight": 0.1, "repa_encoder": "dino",
         "repa_depth": 2, "repa_projector_dim": 16}


def stored_checkpoint(tmp_path, **stored):
    """A checkpoint object whose training config is ``stored`` over TrainConfig's resolved defaults."""
    cfg = TrainConfig(model="NaLaDiT-T/2", data="digits")
    cfg.validate()
    config = {**to_dict(cfg), **stored}
    return ckpt_lib.Checkpoint(tmp_path, dict(config=config, model_config={"objective": "diffusion"})), cfg


@pytest.mark.parametrize("name", RESUME_RULES["applied"])
def test_every_applied_setting_is_announced(tmp_path, name):
    from nala_dit.training.resume import resume_announcements

    ckpt, cfg = stored_checkpoint(tmp_path)
    assert resume_announcements(ckpt, cfg) == []
    setattr(cfg, name, OTHER[name])
    lines = resume_announcements(ckpt, cfg)
    assert len(lines) == 1 and lines[0].startswith(f"resume: --{flag(name)} {shown(OTHER[name])} "), lines
    assert_names(lines[0], "checkpoint's")


@pytest.mark.parametrize("name", RESUME_RULES["refused"])
def test_every_refused_setting_is_a_change(tmp_path, name):
    """Against a checkpoint of the resolved defaults (a teacher, an encoder where the key belongs
    to them; SiT's keys on a transport model): the changed key is in ``config_changes``."""
    group = dict(teacher="runs/t") if "distill" in name else {"repa-encoder": "dino"} if name.startswith("repa_") \
        and name != "repa_encoder" else {}
    objective = "transport" if name in ("path_type", "prediction", "loss_weight", "train_eps", "sample_eps") \
        else "diffusion"
    ckpt, cfg = stored_checkpoint(tmp_path, **group)
    ckpt.state["model_config"] = {"objective": objective}
    now = {**ckpt.config, flag(name): OTHER[name]}
    changes = ckpt_lib.config_changes(ckpt, now, {"objective": objective})
    assert list(changes) == [flag(name)], (name, changes)


def test_every_model_setting_reaches_the_model_config(tmp_path):
    """The settings refused through the model config: each changes the model these settings build,
    so ``config_changes`` names it."""
    from nala_dit.training.loop import build_model

    other = {"model": "NaLaDiT-T/4", "attention": "relu", "direction": "relu_split", "lepe": False, "gate": False,
             "out_norm": False, "power": 2.0, "offset": 0.25, "norm_scale": 2.0, "alpha": 10.0, "rope": True,
             "rope_layout": "released",
             "nala_regions": 2, "pos_embed": "interpolate", "softmax_blocks": "1", "mlp": "mix",
             "mix_init": "identity", "class_dropout_prob": 0.2, "image_size": 16, "num_classes": 5,
             "mean_flow": True}
    assert sorted(other) == sorted(RESUME_RULES["refused-model"])
    base = TrainConfig(model="NaLaDiT-T/2", data="digits")
    base.validate()
    model = build_model(base, 10, 1, 8)
    ckpt = ckpt_lib.Checkpoint(tmp_path, dict(config=to_dict(base), model_config=dict(model.config)))
    for name, value in other.items():
        cfg = dataclasses.replace(base, **{name: value}, **({"mlp": "mix"} if name == "mix_init" else {}))
        if name == "mean_flow":   # a transport model's setting: against a NaLaSiT checkpoint
            sit = dataclasses.replace(base, model="NaLaSiT-T/2")
            ckpt = ckpt_lib.Checkpoint(tmp_path, dict(config=to_dict(sit), model_config=dict(
                build_model(sit, 10, 1, 8).config)))
            cfg = dataclasses.replace(sit, mean_flow=True)
        changed = build_model(cfg, value if name == "num_classes" else 10, 1, value if name == "image_size" else 8)
        assert ckpt_lib.config_changes(ckpt, to_dict(cfg), dict(changed.config)), name


def test_the_rule_table_is_json_plain_data():
    json.dumps(RESUME_RULES)
