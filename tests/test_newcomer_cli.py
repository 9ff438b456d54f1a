"""What a newcomer trips over at the command line and in YAML configs (issue 27): each
test failed before its fix."""

import time

import pytest

from nala_dit.cli.config import resolve, shown
from nala_dit.cli.options import TrainConfig


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


# ------------------------------------------------------------ the smaller items of issue 27
def test_strength_without_upscale_from_is_an_error(capsys, tmp_path):
    import sample

    assert sample.main(["--ckpt", str(tmp_path / "none"), "--labels", "1", "--strength", "0.5",
                        "--grid", str(tmp_path / "g.png")]) == 1
    err = capsys.readouterr().err
    assert err == ("error: --strength applies to progressive upscaling only: add --upscale-from SIZE (e.g. the "
                   "trained size) with --image-size, or drop --strength\n")


@pytest.mark.parametrize("script", ["sample", "evaluate_fid"])
def test_strength_default_is_in_help(script):
    import importlib

    parser = importlib.import_module(script).build_parser()
    if script == "evaluate_fid":
        parser = next(a for a in parser._actions if a.dest == "command").choices["gen"]
    (strength,) = [a for a in parser._actions if a.dest == "strength"]
    assert strength.help.endswith("(default: 0.6)") and strength.default is None  # None: "not given"


def test_train_image_size_malformed_says_the_format(capsys):
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--image-size", "16x"])
    err = capsys.readouterr().err
    assert "argument --image-size: --image-size expects an integer, e.g. 256 (pixels per side), got '16x'" in err
    assert "<lambda>" not in err
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--lr", "fast"])
    assert "--lr expects a number, got 'fast'" in capsys.readouterr().err


def test_non_square_size_suggests_non_square_sizes():
    from nala_dit.models.grid import latent_size

    with pytest.raises(ValueError, match=r"image size 8x15 is not a multiple of VAE factor 1 × patch 2 = 2 on each "
                                         r"side; choose e.g. 8x14, 8x16$"):
        latent_size("8x15", 1, 2)
    with pytest.raises(ValueError, match=r"choose e.g. 256x256, 240x256, 256x272, 240x272$"):
        latent_size("250x260", 8, 2)
    with pytest.raises(ValueError, match=r"choose e.g. 16, 32, 48$"):  # square: as before
        latent_size(15, 8, 2)


def test_train_image_size_not_patching_evenly_is_in_pixels(tmp_path, capsys):
    from types import SimpleNamespace

    import train as train_cli
    from nala_dit.training.loop import model_space
    from tests.test_training import TINY_RUN, make_image_folder

    sd_like_vae = SimpleNamespace(config=SimpleNamespace(block_out_channels=(8, 8, 16, 16), latent_channels=4))
    with pytest.raises(ValueError, match=r"^--image-size: image size 15 is not a multiple of VAE factor 8 × patch 2 "
                                         r"= 16 on each side; choose e.g. 16, 32, 48$"):
        model_space(SimpleNamespace(image_size=15, channels=3), sd_like_vae, 2)
    assert model_space(SimpleNamespace(image_size=32, channels=3), sd_like_vae, 2) == (4, 4)
    images = make_image_folder(tmp_path / "images", per_class=1)
    assert train_cli.main(TINY_RUN + ["--data", str(images), "--image-size", "15", "--max-steps", "1",
                                      "--results-dir", str(tmp_path), "--exp-name", "odd"]) == 1
    err = capsys.readouterr().err
    assert "error: --image-size: image size 15 is not a multiple of VAE factor 1 × patch 2 = 2" in err
    assert "input_size" not in err


def test_resume_of_a_missing_step_lists_the_steps_that_exist(digits_checkpoint, tmp_path, capsys):
    import train as train_cli
    from tests.test_training import TINY_RUN

    missing = digits_checkpoint / "checkpoints" / "0000009"
    assert train_cli.main(TINY_RUN + ["--resume", str(missing), "--max-steps", "10", "--results-dir", str(tmp_path),
                                      "--exp-name", "again"]) == 1
    err = capsys.readouterr().err
    assert f"{digits_checkpoint / 'checkpoints'} holds the checkpoints of steps 5 (e.g. --resume " \
           f"{digits_checkpoint / 'checkpoints' / '0000005'})" in err, err


def test_init_from_help_names_both_uses():
    from nala_dit.cli.config import build_parser

    (action,) = [a for a in build_parser(TrainConfig)._actions if a.dest == "init_from"]
    for words in ("softmax DiT/SiT", "official .pt", "this repo's own runs, checkpoints or pipeline folders",
                  "up the ladder", "--init-from runs/demo/NaLaDiT --image-size 16 --pos-embed interpolate"):
        assert words in action.help, words


@pytest.mark.slow
def test_two_process_error_prints_once(tmp_path):
    """Every rank meets the same bad --data: one error line (rank 0), no traceback of ours;
    what follows is the launcher's own report of the exit."""
    from tests.test_training import TINY_RUN
    from tests.utils import launch

    proc = launch(tmp_path, "train.py", *TINY_RUN, "--data", tmp_path / "nope", "--results-dir", tmp_path,
                  "--max-steps", "1")
    assert proc.returncode == 1
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert errors == [f"error: data folder not found: {tmp_path / 'nope'} (--data takes digits, digits-canvas, a "
                      f"latent folder written by extract_latents.py or an image folder <root>/<class name>/<images>) "
                      f"(the launcher's ChildFailedError report that follows only repeats that the processes "
                      f"stopped)"], proc.stderr
    assert "train.py\", line" not in proc.stderr  # no traceback through our script


def test_sampling_page_documents_the_pipelines_size_arguments():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "nala_dit" / "pipelines" / "pipeline.py").read_text())
    calls = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__call__"]
    names = {a.arg for f in calls for a in f.args.args}
    assert {"height", "width", "time_shift"} <= names  # what the page describes exists
    text = (root / "docs" / "sampling.md").read_text()
    assert "height=H, width=W" in text and "time_shift=" in text
    assert 'os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")' in text


def test_a_huge_unknown_key_is_echoed_capped(tmp_path, capsys):
    err = _yaml_error(tmp_path, "k" * 1000 + ": 1\n", capsys)  # YAML allows plain keys up to 1024 characters
    assert "unknown key 'kkkk" in err and len(err) < 400


def test_init_from_a_smaller_source_names_the_model_size_to_pass(digits_checkpoint, tmp_path, capsys):
    """train.py's default preset is NaLaDiT-S/2; a T/2 source gets the --model to pass."""
    import train as train_cli

    code = train_cli.main(["--init-from", str(digits_checkpoint), "--data", "digits", "--image-size", "8",
                           "--max-steps", "1", "--num-workers", "0", "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1, err
    assert "hidden_size=128 vs 384" in err
    assert "(the source is T/2-sized: pass --model NaLaDiT-T/2, or another family at that size, or the " \
           "source run's --config)" in err
