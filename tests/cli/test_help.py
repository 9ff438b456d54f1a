"""``train.py --help`` is short (the common flags, a pointer to the rest) and
``--help-all`` lists every flag in sections, as PyTorch's and diffusers' scripts do; neither loads
torch (tests/test_structure.py runs both as subprocesses)."""

import dataclasses

import pytest

import train as train_cli
from nala_dit.cli.options import HELP_COMMON, HELP_SECTIONS, TrainConfig


def help_text(capsys, flag: str) -> str:
    with pytest.raises(SystemExit) as stop:
        train_cli.main([flag])
    assert stop.value.code == 0
    return capsys.readouterr().out


def test_help_is_short_and_names_the_full_listing(capsys):
    text = help_text(capsys, "--help")
    lines = text.splitlines()
    assert len(lines) <= 80, len(lines)
    assert lines[0].startswith("usage: ") and len(lines[0]) <= 80 and "NaLaDiT-S/2,NaLaDiT-S/4" not in text
    assert "--help-all" in text and "every option" in text
    for name in HELP_COMMON:
        assert f"--{name.replace('_', '-')}" in text, name
    for rare in ("--repa-projector-dim", "--distill-sigma-weight", "--nala-regions", "--inception-weights"):
        assert rare not in text, rare
    assert help_text(capsys, "-h") == text


def test_help_all_lists_every_flag_in_sections(capsys):
    text = help_text(capsys, "--help-all")
    for field in dataclasses.fields(TrainConfig):
        assert f"--{field.name.replace('_', '-')} " in text or f"--{field.name.replace('_', '-')}\n" in text, field.name
    positions = [text.index(f"\n{title}:\n") for title, _ in HELP_SECTIONS]
    assert positions == sorted(positions)
    # each flag sits in its section: the first flag of a section after the section's title
    for title, first in HELP_SECTIONS:
        assert text.index(f"\n{title}:\n") < text.index(f"  --{first.replace('_', '-')}"), title
    assert text.splitlines()[0].endswith("[--config FILE.yaml] [options]")


def test_sections_cover_every_field_in_order():
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    firsts = [first for _, first in HELP_SECTIONS]
    assert firsts[0] == names[0] and [names.index(f) for f in firsts] == sorted(names.index(f) for f in firsts)
    assert set(HELP_COMMON) <= set(names)


def test_an_argument_error_points_at_both_helps(capsys):
    with pytest.raises(SystemExit):
        train_cli.main(["--max-step", "3"])
    err = capsys.readouterr().err
    assert "did you mean --max-steps?" in err and "--help" in err and "--help-all" in err


def test_sample_help_is_short_and_help_all_lists_every_flag(capsys):
    """sample.py shares train.py's split: --help the common flags and a pointer, --help-all all."""
    import sample

    def shown(flag):
        with pytest.raises(SystemExit) as stop:
            sample.main([flag])
        assert stop.value.code == 0
        return capsys.readouterr().out

    common, every = shown("--help"), shown("--help-all")
    assert len(common.splitlines()) <= 80 and common.splitlines()[0].endswith(" --ckpt CKPT [options]")
    assert "--help-all` lists every option" in " ".join(common.split()) and "YAML" not in common
    for name in sample.HELP_COMMON:
        assert f"--{name.replace('_', '-')} " in common, name
    flags = sample.build_parser().flags()
    assert len(flags) > len(sample.HELP_COMMON) + 10
    for flag in flags:
        assert f"{flag} " in every or f"{flag}\n" in every, flag
    for rare in ("--atol", "--vae-tile-size", "--keep-parts", "--guide-channels"):
        assert rare not in common, rare
