"""Issue 45 items 1, 2, 3 and 15: no file a user did not trust runs code, every way into a
pipeline folder runs the same folder checks, and diffusers' idioms (a list of generators,
``dtype=``) work as diffusers documents them."""

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import nala_dit  # noqa: F401  (teaches diffusers our pipeline names)
from nala_dit.pipelines.pipeline import CUSTOM_PIPELINES, NaLaDiTPipeline, pipeline_for
from tests.test_pipeline import NAMES, run, tiny
from tests.test_repa import tiny_dinov2  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
DEEP = "[" * 100_000 + "]" * 100_000   # past the JSON parser's recursion limit


def one_line(err) -> str:
    text = str(err.value) if hasattr(err, "value") else str(err)
    assert "\n" not in text, text
    return text


@pytest.fixture(scope="module")
def pipe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trusted") / "pipe"
    pipeline_for(tiny("NaLaDiT-T/2"), id2label=NAMES, sampler="ddim").save_pretrained(folder)
    return folder


def copy_of(folder: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(folder, dst)
    return dst


# --- item 1: the trusted-code route ------------------------------------------------------
def test_sampling_doc_gives_the_safe_routes_first_and_says_what_trust_remote_code_runs():
    text = (ROOT / "docs" / "sampling.md").read_text()
    first_trust = text.index("trust_remote_code=True")
    assert text.index("NaLaDiTPipeline.from_pretrained(") < first_trust
    assert text.index('DiffusionPipeline.from_pretrained("exported/nala-dit-s2")') < first_trust
    # what it runs, and that an installed nala_dit never needs it
    assert "`trust_remote_code=True` runs" in text and "nala_dit_pipeline.py" in text
    assert "never needed" in text


def test_the_shipped_custom_pipeline_file_is_only_a_docstring_and_the_import(pipe_folder):
    for cls, module in CUSTOM_PIPELINES.items():
        source = (pipe_folder / f"{module}.py") if cls == "NaLaDiTPipeline" else None
        if source is None:
            folder = pipe_folder.parent / "sit"
            if not folder.exists():
                pipeline_for(tiny("NaLaSiT-T/2"), id2label=NAMES).save_pretrained(folder)
            source = folder / f"{module}.py"
        tree = ast.parse(source.read_text())
        assert len(tree.body) == 2, ast.dump(tree)
        doc, imp = tree.body
        assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
        assert isinstance(imp, ast.ImportFrom) and imp.module == "nala_dit" and imp.level == 0
        assert [(a.name, a.asname) for a in imp.names] == [(cls, None)]
        # the docstring points to the route that runs no file of the folder
        assert "import nala_dit" in doc.value.value and "without running" in doc.value.value


# --- item 2: REPA encoder weights are safetensors or nothing ------------------------------
class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.pt", "model.pth", "model.ckpt",
                                     "../model.safetensors"])
def test_repa_index_naming_a_non_safetensors_file_is_refused_before_transformers(tiny_dinov2, tmp_path,  # noqa: F811
                                                                                monkeypatch, weights):
    from transformers import Dinov2Model

    from nala_dit.training import repa

    called = []
    monkeypatch.setattr(Dinov2Model, "from_pretrained", classmethod(lambda cls, *a, **k: called.append(a)))
    folder = tmp_path / "enc"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_dinov2 / "config.json").read_text())
    marker = tmp_path / "ran"
    torch.save({"x": Payload(marker)}, tmp_path / "payload")
    target = (folder / weights)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes((tmp_path / "payload").read_bytes())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"embeddings.cls_token": weights, "layernorm.weight": weights}}))
    with pytest.raises(ValueError) as err:
        repa.load_encoder(folder)
    text = one_line(err)
    assert f"--repa-encoder {folder}" in text and repr(weights) in text and "safetensors" in text
    assert not called and not marker.exists()


def test_repa_index_that_is_not_an_index_is_one_line(tiny_dinov2, tmp_path):  # noqa: F811
    from nala_dit.training import repa

    folder = tmp_path / "enc"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_dinov2 / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    for content, words in ((DEEP, "nested too deeply"), ("[1]", "weight_map"), ('{"weight_map": [1]}', "weight_map"),
                           ('{"weight_map": {"a": "gone.safetensors"}}', "missing")):
        index.write_text(content)
        with pytest.raises((ValueError, FileNotFoundError)) as err:
            repa.load_encoder(folder)
        assert str(index) in one_line(err) or "gone.safetensors" in one_line(err)
        assert words in one_line(err)


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


@pytest.mark.parametrize("route", ["generic", "custom_pipeline", "class"])
def test_every_route_refuses_a_huge_hidden_size_before_building(pipe_folder, tmp_path, monkeypatch, route):
    import diffusers.utils.dynamic_modules_utils as dynamic

    from nala_dit.models import dit as models

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    built = []
    real_init = models.DiT.__init__

    @functools.wraps(real_init)
    def counting_init(self, *args, **kwargs):
        built.append(kwargs.get("hidden_size"))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(models.DiT, "__init__", counting_init)
    bad = copy_of(pipe_folder, tmp_path / "bad")
    config_file = bad / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "hidden_size": 65536}))
    load = {"generic": lambda: generic(bad),
            "custom_pipeline": lambda: generic(bad, custom_pipeline=CUSTOM_PIPELINES["NaLaDiTPipeline"],
                                               trust_remote_code=True),
            "class": lambda: NaLaDiTPipeline.from_pretrained(str(bad))}[route]
    with pytest.raises(ValueError) as err:
        load()
    assert "hidden_size implies 65,536 where the weights have 128" in one_line(err)
    assert 65536 not in built


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


# --- item 15: diffusers idioms ------------------------------------------------------------
def test_a_list_of_generators_gives_image_i_the_single_call_of_generator_i():
    pipe = pipeline_for(tiny("NaLaDiT-T/2"), id2label=NAMES)            # ddpm: stochastic inside the loop too
    labels, seeds = [1, 2, 0], [3, 4, 5]
    together = run(pipe, class_labels=labels, sampler="ddpm",
                   generator=[torch.Generator().manual_seed(s) for s in seeds])
    for i, (label, seed) in enumerate(zip(labels, seeds)):
        alone = run(pipe, class_labels=[label], sampler="ddpm", generator=torch.Generator().manual_seed(seed))
        np.testing.assert_array_equal(together[i], alone[0])
    # a list of int seeds follows the same rule
    ints = run(pipe, class_labels=labels, sampler="ddpm", generator=[7, 8, 9])
    np.testing.assert_array_equal(ints[1], run(pipe, class_labels=[2], sampler="ddpm", generator=8)[0])
    with pytest.raises(ValueError) as err:
        run(pipe, class_labels=labels, generator=[torch.Generator().manual_seed(0)] * 2)
    assert "2 generators" in one_line(err) and "3 images" in one_line(err)


def test_guidance_default_is_sample_py_and_the_docstring_says_why():
    import inspect

    import sample

    default = inspect.signature(NaLaDiTPipeline.__call__).parameters["guidance_scale"].default
    assert default == 1.0 == sample.build_parser().parse_args(["--ckpt", "x"]).cfg_scale
    doc = NaLaDiTPipeline.__call__.__doc__
    assert "DiTPipeline" in doc and "4.0" in doc and "sample.py" in doc


def test_docs_use_dtype_not_the_deprecated_torch_dtype():
    text = (ROOT / "docs" / "sampling.md").read_text()
    assert "torch_dtype=" not in text and "dtype=torch.bfloat16" in text
    source = (ROOT / "nala_dit" / "pipelines" / "pipeline.py").read_text()
    assert "torch_dtype=torch.bfloat16" not in source
