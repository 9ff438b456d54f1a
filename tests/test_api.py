"""The public API: what ``nala_dit`` and each sub-package export is pinned here, and every
name resolves to the object defined where the package says. Modules behind these names may
move; these names may not (change this list only on purpose)."""

import importlib
import subprocess
import sys

import pytest

API = {
    "nala_dit": [
        "DiT", "DiTPipelineTransformer", "GatedLinearAttention", "GaussianDiffusion", "MODELS",
        "NaLaDiTPipeline", "NaLaSiTPipeline", "SampleSettings", "SoftmaxAttention", "Transport",
        "cfg_model_fn", "count_flops", "count_params", "create_model", "ddim_sample", "ddpm_sample",
        "evaluate_samples", "frechet_distance", "generate", "inception_score", "load_source",
        "nala_attention", "nala_attention_reference", "nala_features", "ode_sample", "precision_recall",
        "register_with_diffusers", "sample_batch", "sde_sample",
    ],
    "nala_dit.models": ["DiT", "DiTBlock", "MODELS", "TokenGrid", "compile_model", "count_flops", "count_params", "create_model"],
    "nala_dit.diffusion": ["GaussianDiffusion", "SampleSettings", "Transport", "cfg_model_fn", "ddim_sample",
                           "ddpm_sample", "decode", "likelihood", "ode_sample", "sample_batch", "sde_sample"],
    "nala_dit.data": ["DigitsDataset", "ImageFolderDataset", "LatentDataset", "LatentNorm", "extract_latents",
                      "load_vae"],
    "nala_dit.training": ["TrainStep", "load_model", "open_checkpoint", "save_checkpoint", "train", "update_ema"],
    "nala_dit.evaluation": ["build_extractor", "evaluate_samples", "frechet_distance", "inception_score", "kid",
                            "make_reference", "precision_recall"],
    "nala_dit.pipelines": ["DiTPipelineTransformer", "NaLaDiTPipeline", "NaLaSiTPipeline", "load_pipeline",
                           "load_source", "mass_sample", "register_with_diffusers"],
}


@pytest.mark.parametrize("package", sorted(API))
def test_public_names_are_pinned_and_resolve(package):
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(API[package])
    for name in module.__all__:
        obj = getattr(module, name)
        if callable(obj):   # classes and functions (MODELS is a dict of constructors)
            assert obj.__name__ == name, f"{package}.{name} is {obj!r}"
            assert obj.__module__.startswith("nala_dit."), f"{package}.{name} comes from {obj.__module__}"
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name


def test_top_level_names_are_the_sub_packages_objects():
    import nala_dit
    from nala_dit import diffusion, models, pipelines

    assert nala_dit.create_model is models.create_model
    assert nala_dit.GaussianDiffusion is diffusion.GaussianDiffusion
    assert nala_dit.NaLaDiTPipeline is pipelines.NaLaDiTPipeline
    from nala_dit.diffusion.generate import generate

    assert nala_dit.generate is generate


def test_importing_the_package_loads_no_torch():
    code = "import sys, nala_dit, nala_dit.cli.options; print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _without_wait_policy() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}


def test_importing_the_package_before_torch_sets_a_passive_wait_policy():
    """OpenMP reads OMP_WAIT_POLICY when torch loads: ``import nala_dit`` first sets PASSIVE
    (docs/performance.md, Threads), a value the user set is kept, and after torch nothing is set."""
    code = "import os, nala_dit; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = _without_wait_policy()
    run = lambda code, env: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: E731
                                           check=True, env=env).stdout.strip()
    assert run(code, env) == "PASSIVE"
    assert run(code, {**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
    assert run("import torch; " + code, env) == "None"


WARNS = """
import warnings
{first}
from nala_dit.models.dit import create_model
from nala_dit.pipelines.pipeline import pipeline_for
pipe = pipeline_for(create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10))
seen = []
for threads in (1, 2, 2):
    torch.set_num_threads(threads)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe([1], num_inference_steps=1, generator=0, output_type="np")
    seen.append([str(w.message) for w in caught if w.category is RuntimeWarning])
print(seen)
"""


@pytest.mark.parametrize("first,warned", [("import torch, nala_dit", True), ("import nala_dit, torch", False)])
def test_a_pipeline_warns_once_when_torch_came_first(first, warned):
    """torch imported first (OMP_WAIT_POLICY unset): the first call with more than one thread
    warns, once, naming the fix; nothing with one thread (nothing spins), nothing when
    nala_dit came first."""
    import ast

    out = subprocess.run([sys.executable, "-c", WARNS.format(first=first)], capture_output=True, text=True,
                         env=_without_wait_policy(), timeout=300)
    assert out.returncode == 0, out.stderr
    one, two, again = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert one == [] and again == []
    if not warned:
        assert two == []
        return
    assert len(two) == 1, two
    for words in ("imported before nala_dit", "OMP_WAIT_POLICY=PASSIVE", "Import nala_dit before torch",
                  "torch.set_num_threads(1)", "docs/performance.md"):
        assert words in two[0], (words, two[0])
