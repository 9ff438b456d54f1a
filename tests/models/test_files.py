"""Tests of `nala_dit/models/files.py`."""
import json
import time

import pytest

from nala_dit.training import checkpoint as ckpt_lib
from tests.scripts.test_sample import FAST
from tests.utils import assert_names, cli, copy_tree, count_dit_builds, one_line_error


def test_wrong_type_in_pipeline_transformer_config(pipe_dir, tmp_path, capsys):
    from nala_dit.pipelines.pipeline import load_pipeline

    bad = copy_tree(pipe_dir, tmp_path / "bad")
    config_file = bad / "transformer" / "config.json"
    for key, value, expected in (("hidden_size", "128", "an integer"), ("lepe", "yes", "true or false"),
                                 ("mlp_ratio", None, "a number")):
        config = json.loads((pipe_dir / "transformer" / "config.json").read_text())
        config_file.write_text(json.dumps({**config, key: value}))
        assert cli("--ckpt", bad, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
        assert_names(one_line_error(capsys), f"{config_file}: ", repr(key), expected, f"got {value!r}")
        with pytest.raises(ValueError, match=f"'{key}' must be {expected}"):
            load_pipeline(bad)


@pytest.mark.parametrize("name", ["transformer/config.json", "model_index.json"])
def test_deeply_nested_pipeline_json_is_one_line(pipe_dir, tmp_path, capsys, name):
    bad = copy_tree(pipe_dir, tmp_path / "bad")
    (bad / name).write_text("[" * 100_000 + "]" * 100_000)  # past the parser's recursion limit
    assert cli("--ckpt", bad, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
    err = one_line_error(capsys)
    assert err.startswith(f"error: {bad / name}: "), err
    assert_names(err, "nested too deeply", "export the pipeline again")


# 5. huge model configs: refused from the weights file's header, before building
@pytest.mark.parametrize("hidden", [8192, 65536, 10**9])
def test_huge_config_is_refused_before_building(run_dir, pipe_dir, tmp_path, capsys, monkeypatch, hidden):
    built = count_dit_builds(monkeypatch)
    run = copy_tree(run_dir, tmp_path / "run")
    state_file = ckpt_lib.find_checkpoint(run) / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state["model_config"].update(hidden_size=hidden, num_heads=2)
    state_file.write_text(json.dumps(state))
    bad = copy_tree(pipe_dir, tmp_path / "bad")
    config_file = bad / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "hidden_size": hidden}))
    start = time.perf_counter()
    for where, weights in ((run, state_file.parent / "ema.safetensors"),
                           (bad, bad / "transformer" / "diffusion_pytorch_model.safetensors")):
        assert cli("--ckpt", where, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
        err = one_line_error(capsys)
        assert_names(err, f"hidden_size implies {hidden:,}", "the weights have 128", str(weights), " parameters)")
    assert time.perf_counter() - start < 20 and hidden not in built  # nothing of that size was built


def test_config_that_fits_in_size_but_not_in_shape_names_both_counts(run_dir, tmp_path, capsys):
    run = copy_tree(run_dir, tmp_path / "run")
    state_file = ckpt_lib.find_checkpoint(run) / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state["model_config"]["gate"] = not state["model_config"]["gate"]  # an edited switch: other tensors
    state_file.write_text(json.dumps(state))
    assert cli("--ckpt", run, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
    err = one_line_error(capsys)
    assert "implies a model of" in err and "parameters," in err and "holds" in err


def test_missing_transformer_weights_are_one_line_before_building(pipe_dir, tmp_path, capsys, monkeypatch):
    """A pipeline folder without its safetensors weights (a config of 10^9 classes beside it) is
    refused before a model is built: diffusers fell back to a pickle .bin and printed three lines."""
    built = count_dit_builds(monkeypatch)
    bad = copy_tree(pipe_dir, tmp_path / "bad")
    (bad / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    config_file = bad / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "num_classes": 10**9}))
    assert cli("--ckpt", bad, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
    assert_names(one_line_error(capsys), f"{bad / 'transformer'} has no diffusion_pytorch_model.safetensors",
                 "safetensors only", "export it again")
    assert built == []
