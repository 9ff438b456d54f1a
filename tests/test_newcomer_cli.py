"""What a newcomer trips over at the command line and in YAML configs (issue 27): each
test failed before its fix."""

import time

import pytest

from nala_dit.config import resolve, shown
from nala_dit.options import TrainConfig


def _resolve_yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    cfg, _ = resolve(TrainConfig, ["--config", str(path)])
    return cfg


def _yaml_error(tmp_path, text, capsys):
    with pytest.raises(SystemExit):
        _resolve_yaml(tmp_path, text)
    return capsys.readouterr().err


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
    assert f"error: {path}: line 3: the key 'lr' is given twice (lines 1 and 3); keep one\n" in err


def _alias_bomb(levels=9) -> str:
    """The billion laughs: each level a list of 9 aliases of the one before (9**levels leaves)."""
    parts, prev = ["&a [l,l,l,l,l,l,l,l,l]"], "a"
    for name in "bcdefghijk"[: levels - 2]:
        parts.append(f"&{name} [" + ",".join(["*" + prev] * 9) + "]")
        prev = name
    return "lr: [" + ", ".join(parts) + ", [" + ",".join(["*" + prev] * 9) + "]]\n"


def test_yaml_alias_bomb_fails_fast_with_a_short_line(tmp_path, capsys):
    text = _alias_bomb()
    assert len(text) < 400
    start = time.perf_counter()
    err = _yaml_error(tmp_path, text, capsys)
    assert time.perf_counter() - start < 2  # was 16 s and a 360 MB line at this size
    assert "line 1: the alias *a of a list or mapping is refused" in err and len(err) < 400
    # an alias of a plain value is harmless and stays allowed
    assert _resolve_yaml(tmp_path, "lr: &rate 2e-3\nema-decay: 0.999\nweight-decay: *rate\n").weight_decay == 2e-3


def test_error_messages_echo_values_capped(tmp_path, capsys):
    err = _yaml_error(tmp_path, "model: [" + ", ".join(["x" * 50] * 2000) + "]\n", capsys)
    assert "model must be str, got ['xxxx" in err and len(err) < 400
    assert len(shown("y" * 10 ** 6)) <= 80 and len(shown([[list(range(10 ** 5))]] * 10 ** 3)) <= 80
    assert shown("bf16") == "'bf16'"
