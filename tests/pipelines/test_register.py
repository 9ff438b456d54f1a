"""Tests of `nala_dit/pipelines/register.py`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nala_dit  # noqa: F401  (teaches diffusers our pipeline names)
from nala_dit.pipelines.pipeline import CUSTOM_PIPELINES, NaLaDiTPipeline
from tests.pipelines.test_pipeline import run
from tests.utils import DEEP, ROOT, assert_names, count_dit_builds, one_line


def copy_of(folder: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(folder, dst)
    return dst


# --- item 3: DiffusionPipeline.from_pretrained runs the folder checks ---------------------
def generic(folder, **kwargs):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(str(folder), **kwargs)


@pytest.mark.parametrize("name", ["model_index.json", "transformer/config.json"])
def test_generic_loader_refuses_deep_json_in_one_line(pipe_folder, tmp_path, name):
    bad = copy_of(pipe_folder, tmp_path / "bad")
    (bad / name).write_text(DEEP)
    with pytest.raises(ValueError) as err:
        generic(bad)
    assert f"{bad / name}: nested too deeply" in one_line(err) and "export the pipeline again" in one_line(err)


def test_generic_loader_refuses_a_list_model_index_in_one_line(pipe_folder, tmp_path):
    bad = copy_of(pipe_folder, tmp_path / "bad")
    (bad / "model_index.json").write_text("[1, 2]")
    with pytest.raises(ValueError) as err:
        generic(bad)
    assert f"{bad / 'model_index.json'}" in one_line(err) and "JSON object" in one_line(err)


@pytest.mark.parametrize("value", [["NaLaDiTPipeline"], {"a": 1}, 3])
def test_a_class_name_that_is_no_string_is_one_line_on_every_route(pipe_folder, tmp_path, capsys, value):
    """A list-valued _class_name was a TypeError (unhashable type) through the generic loader."""
    import sample

    bad = copy_of(pipe_folder, tmp_path / "bad")
    index = json.loads((bad / "model_index.json").read_text())
    (bad / "model_index.json").write_text(json.dumps({**index, "_class_name": value}))
    for load in (lambda: generic(bad), lambda: NaLaDiTPipeline.from_pretrained(str(bad))):
        with pytest.raises(ValueError) as err:
            load()
        assert_names(one_line(err), f"{bad / 'model_index.json'}: _class_name must be a string", "export")
    assert sample.main(["--ckpt", str(bad), "--labels", "1", "--steps", "2", "--grid", str(tmp_path / "g.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "_class_name" in err, err


@pytest.mark.parametrize("route", ["generic", "custom_pipeline", "class"])
def test_every_route_refuses_a_huge_hidden_size_before_building(pipe_folder, tmp_path, monkeypatch, route):
    import diffusers.utils.dynamic_modules_utils as dynamic


    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    built = count_dit_builds(monkeypatch)
    bad = copy_of(pipe_folder, tmp_path / "bad")
    config_file = bad / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "hidden_size": 65536}))
    load = {"generic": lambda: generic(bad),
            "custom_pipeline": lambda: generic(bad, custom_pipeline=CUSTOM_PIPELINES["NaLaDiTPipeline"],
                                               trust_remote_code=True),
            "class": lambda: NaLaDiTPipeline.from_pretrained(str(bad))}[route]
    with pytest.raises(ValueError) as err:
        load()
    assert_names(one_line(err), "hidden_size implies 65,536", "the weights have 128")
    assert 65536 not in built


@pytest.mark.slow
def test_generic_loader_checks_when_diffusers_was_imported_first(pipe_folder, tmp_path):
    bad = copy_of(pipe_folder, tmp_path / "bad")
    (bad / "model_index.json").write_text(DEEP)
    code = ("import sys\nfrom diffusers import DiffusionPipeline\nimport diffusers.pipelines.pipeline_utils\n"
            "import nala_dit\ntry:\n    DiffusionPipeline.from_pretrained(sys.argv[1])\n"
            "except ValueError as err:\n    print('refused:', err)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"refused: {bad / 'model_index.json'}: nested too deeply" in proc.stdout


def test_a_good_folder_still_loads_through_every_route(pipe_folder):
    expected = run(NaLaDiTPipeline.from_pretrained(str(pipe_folder)), sampler="ddim")
    np.testing.assert_array_equal(run(generic(pipe_folder), sampler="ddim"), expected)
