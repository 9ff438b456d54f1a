"""Tests of `nala_dit/cli/config.py`."""
import time

import pytest

from nala_dit.cli.config import resolve, shown
from nala_dit.cli.options import TrainConfig
from tests.utils import assert_names, dry_run_error


def _resolve_yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    cfg, _ = resolve(TrainConfig, ["--config", str(path)])
    return cfg


def _yaml_error(tmp_path, text, capsys):
    with pytest.raises(SystemExit):
        _resolve_yaml(tmp_path, text)
    return capsys.readouterr().err


def _alias_bomb(levels=9) -> str:
    """The billion laughs: each level a list of 9 aliases of the one before (9**levels leaves)."""
    parts, prev = ["&a [l,l,l,l,l,l,l,l,l]"], "a"
    for name in "bcdefghijk"[: levels - 2]:
        parts.append(f"&{name} [" + ",".join(["*" + prev] * 9) + "]")
        prev = name
    return "lr: [" + ", ".join(parts) + ", [" + ",".join(["*" + prev] * 9) + "]]\n"


@pytest.mark.parametrize("text,value", [("2e-3", 2e-3), ("1E-4", 1e-4), ("+5e-4", 5e-4), (".5e-3", 5e-4),
                                        ("3.0e-4", 3e-4), ("1e5", 1e5), ("0.001", 1e-3)])
def test_yaml_numbers_in_e_notation_are_numbers(tmp_path, text, value):
    assert _resolve_yaml(tmp_path, f"lr: {text}\n").lr == value  # YAML 1.1 read 2e-3 as the string '2e-3'


def test_yaml_integral_e_notation_for_an_int_flag(tmp_path, capsys):
    assert _resolve_yaml(tmp_path, "max-steps: 1e3\n").max_steps == 1000
    assert "max-steps must be int, got 1.5" in _yaml_error(tmp_path, "max-steps: 1.5e0\n", capsys)


def test_yaml_no_and_yes_for_a_choice_flag_are_words(tmp_path):
    assert _resolve_yaml(tmp_path, "mixed-precision: no\n").mixed_precision == "no"  # was False: "must be str"
    assert _resolve_yaml(tmp_path, "mixed-precision: bf16\n").mixed_precision == "bf16"


@pytest.mark.parametrize("text,value", [("yes", True), ("no", False), ("on", True), ("off", False),
                                        ("true", True), ("False", False)])
def test_yaml_bool_flags_still_take_yes_no(tmp_path, text, value):
    assert _resolve_yaml(tmp_path, f"lepe: {text}\n").lepe is value


def test_yaml_bool_for_an_int_flag_is_refused(tmp_path, capsys):
    err = _yaml_error(tmp_path, "max-steps: true\n", capsys)
    assert "max-steps must be int, got True" in err and "Traceback" not in err


def test_yaml_duplicate_key_is_refused_naming_it(tmp_path, capsys):
    err = _yaml_error(tmp_path, "lr: 1e-3\nmodel: DiT-T/2\nlr: 2e-3\n", capsys)
    path = tmp_path / "c.yaml"
    assert_names(err, f"error: {path}: line 3", "'lr'", "given twice", "(lines 1 and 3)", "keep one")


def test_yaml_alias_bomb_fails_fast_with_a_short_line(tmp_path, capsys):
    text = _alias_bomb()
    assert len(text) < 400
    start = time.perf_counter()
    err = _yaml_error(tmp_path, text, capsys)
    assert time.perf_counter() - start < 2  # was 16 s and a 360 MB line at this size
    assert_names(err, "line 1", "alias *a", "refused")
    assert len(err) < 400
    # an alias of a plain value is harmless and stays allowed
    assert _resolve_yaml(tmp_path, "lr: &rate 2e-3\nema-decay: 0.999\nweight-decay: *rate\n").weight_decay == 2e-3


def test_error_messages_echo_values_capped(tmp_path, capsys):
    err = _yaml_error(tmp_path, "model: [" + ", ".join(["x" * 50] * 2000) + "]\n", capsys)
    assert "model must be str, got ['xxxx" in err and len(err) < 400
    assert len(shown("y" * 10 ** 6)) <= 80 and len(shown([[list(range(10 ** 5))]] * 10 ** 3)) <= 80
    assert shown("bf16") == "'bf16'"


def test_a_huge_unknown_key_is_echoed_capped(tmp_path, capsys):
    err = _yaml_error(tmp_path, "k" * 1000 + ": 1\n", capsys)  # YAML allows plain keys up to 1024 characters
    assert "unknown key 'kkkk" in err and len(err) < 400


@pytest.mark.parametrize("argv,message", [
    (["--mlp", "none"], ("--mlp", "'mlp', 'mix'", "got 'none'", "every block has an MLP")),
    (["--attention", "None"], ("--attention", "'softmax', 'nala', 'relu', 'elu', 'softmax_gated'", "got 'None'")),
])
def test_none_for_a_choice_flag_names_the_choices(capsys, argv, message):
    line = dry_run_error(capsys, "--model", "NaLaDiT-T/2", *argv)
    assert_names(line, *message)
    assert "invalid choice: None" not in line


def test_pos_embed_none_is_the_choice_none():
    """``none`` is one of --pos-embed's choices (LePE only); the flag refused it as None."""
    assert resolve(TrainConfig, ["--pos-embed", "none"])[0].pos_embed == "none"
    assert resolve(TrainConfig, ["--mlp", "mix"])[0].mlp == "mix"


def test_yaml_softmax_blocks_in_the_list_form_of_stored_configs(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("model: NaLaDiT-T/2\nsoftmax-blocks: [1, 3]\nallow-changes: [lr, mlp]\n")
    cfg, _ = resolve(TrainConfig, ["--config", str(tmp_path / "c.yaml")])
    assert (cfg.softmax_blocks, cfg.allow_changes) == ("1,3", "lr,mlp")
    (tmp_path / "c.yaml").write_text("model: NaLaDiT-T/2\nsoftmax-blocks: [1, 7]\n")
    assert_names(dry_run_error(capsys, "--config", str(tmp_path / "c.yaml")), "softmax-blocks '1,7'", "block 7",
                 "4-block model", "use indices 0..3")


def test_a_very_deep_yaml_list_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text("lr: " + "[" * 5_000 + "]" * 5_000 + "\n")  # past Python's recursion limit, as 100,000 is
    assert_names(dry_run_error(capsys, "--config", str(path)).split(": error: ", 1)[1], f"{path}: ",
                 "nested too deeply", "plain values and short lists")


def test_every_unknown_yaml_key_is_reported_in_one_line(tmp_path, capsys):
    """Two bad keys: both in the one error line (each with its suggestion), not only the first."""
    err = [line for line in _yaml_error(tmp_path, "learning-rate: 3.0e-4\nmodel: DiT-S/2\nglobal_batch: 32\n",
                                        capsys).splitlines() if "error:" in line]
    assert len(err) == 1, err   # argparse's usage line and --help hint around it
    err = err[0]
    assert "unknown key 'learning-rate' (did you mean 'lr'?)" in err
    assert "unknown key 'global_batch' (did you mean 'global-batch-size'?)" in err
    err = _yaml_error(tmp_path, "".join(f"bad{i}: 1\n" for i in range(12)), capsys)
    assert "unknown key 'bad9'" in err and "'bad10'" not in err and "(12 unknown keys in all)" in err
