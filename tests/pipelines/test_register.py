"""Tests of `nala_dit/pipelines/register.py`: diffusers' own `DiffusionPipeline.from_pretrained(folder)`
opens our folders after `nala_dit.register_with_diffusers()`, `import nala_dit` changes nothing of
diffusers, and nothing of diffusers is wrapped or replaced."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import nala_dit
from nala_dit.pipelines.pipeline import NaLaDiTPipeline, NaLaSiTPipeline, pipeline_for
from nala_dit.pipelines.register import add_to_diffusers
from tests.pipelines.test_pipeline import NAMES, run, tiny
from tests.utils import DEEP, ROOT, assert_names, count_dit_builds, one_line

SAMPLERS = {NaLaDiTPipeline: "ddim", NaLaSiTPipeline: "ode-euler"}
nala_dit.register_with_diffusers()   # for the generic loader below (a fresh process without it: test_a_folder_loads_...)


def copy_of(folder: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(folder, dst)
    return dst


def generic(folder, **kwargs):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(str(folder), **kwargs)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One saved folder per pipeline class."""
    root = tmp_path_factory.mktemp("register")
    out = {}
    for name in ("NaLaDiT-T/2", "NaLaSiT-T/2"):
        pipe = pipeline_for(tiny(name), id2label=NAMES)
        out[type(pipe)] = root / name.replace("/", "-")
        pipe.save_pretrained(out[type(pipe)])
    return out


# --- diffusers' public behaviour on our folders --------------------------------------------
@pytest.mark.parametrize("cls", [NaLaDiTPipeline, NaLaSiTPipeline])
def test_generic_loader_gives_our_class_and_its_pixels(folders, cls):
    loaded = generic(folders[cls])
    assert type(loaded) is cls
    expected = run(cls.from_pretrained(str(folders[cls])), sampler=SAMPLERS[cls])
    np.testing.assert_array_equal(run(loaded, sampler=SAMPLERS[cls]), expected)


@pytest.mark.parametrize("cls", [NaLaDiTPipeline, NaLaSiTPipeline])
def test_save_pretrained_round_trip_through_the_generic_loader(folders, cls, tmp_path):
    """A generically loaded pipeline saves the same model_index.json and weights, and the copy
    loads generically to the same pixels."""
    first = generic(folders[cls])
    first.save_pretrained(tmp_path / "copy")
    saved = json.loads((tmp_path / "copy" / "model_index.json").read_text())
    assert saved.pop("_name_or_path") == str(folders[cls])   # diffusers records where it loaded from
    assert saved == json.loads((folders[cls] / "model_index.json").read_text())
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (tmp_path / "copy" / weights).read_bytes() == (folders[cls] / weights).read_bytes()
    again = generic(tmp_path / "copy")
    assert type(again) is cls
    np.testing.assert_array_equal(run(again, sampler=SAMPLERS[cls]), run(first, sampler=SAMPLERS[cls]))


@pytest.mark.parametrize("cls", [NaLaDiTPipeline, NaLaSiTPipeline])
def test_torch_dtype_and_to_through_the_generic_loader(folders, cls):
    """torch_dtype= and dtype= give bf16 weights and exactly the images the class's own
    from_pretrained gives with them; .to(torch.bfloat16) on an fp32 load rounds the same
    weights the same way (the same images); .to("cpu") returns the pipeline itself."""
    kw = dict(sampler=SAMPLERS[cls], output_type="latent")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # diffusers' torch_dtype deprecation
        old_name = generic(folders[cls], torch_dtype=torch.bfloat16)
    new_name = generic(folders[cls], dtype=torch.bfloat16)
    expected = run(cls.from_pretrained(str(folders[cls]), dtype=torch.bfloat16), **kw)
    fp32 = generic(folders[cls])
    assert fp32.transformer.dtype == torch.float32
    assert fp32.to("cpu") is fp32
    moved = fp32.to(torch.bfloat16)
    for pipe in (old_name, new_name, moved):
        assert type(pipe) is cls and pipe.transformer.dtype == torch.bfloat16
        torch.testing.assert_close(run(pipe, **kw), expected, rtol=0, atol=0)


def test_a_folder_loads_generically_after_registering_and_our_routes_without(folders, tmp_path):
    """Fresh processes. Without registering, though nala_dit and our class are imported: diffusers
    is unchanged, the generic loader stops at the documented one line (docs/troubleshooting.md),
    and our class's from_pretrained and diffusers' custom_pipeline door (the folder's
    nala_dit_pipeline.py) load the folder; after `nala_dit.register_with_diffusers()` the generic
    loader does. The README's order (`import nala_dit` loads neither torch nor diffusers, then the
    call) loads both classes, whose images are the in-process pipelines' pixels."""
    code = """
import os, sys
folders = sys.argv[2:]
if sys.argv[1] == "without":
    import diffusers
    from diffusers import DiffusionPipeline
    import nala_dit
    from nala_dit import NaLaDiTPipeline
    print("changed:", [n for n in ("NaLaDiTPipeline", "NaLaSiTPipeline") if n in vars(diffusers)])
    try:
        DiffusionPipeline.from_pretrained(folders[0])
    except AttributeError as err:
        print("error:", f"{type(err).__name__}: {err}")
    print("own:", type(NaLaDiTPipeline.from_pretrained(folders[0])).__name__)
    custom = DiffusionPipeline.from_pretrained(folders[0], custom_pipeline="nala_dit_pipeline", trust_remote_code=True)
    print("custom:", type(custom).__module__, type(custom).__name__)
    print("registered:", nala_dit.register_with_diffusers())
else:
    import nala_dit
    assert "diffusers" not in sys.modules and "torch" not in sys.modules
    from diffusers import DiffusionPipeline
    nala_dit.register_with_diffusers()
for i, folder in enumerate(folders):
    pipe = DiffusionPipeline.from_pretrained(folder)
    print(type(pipe).__module__, type(pipe).__name__)
    if sys.argv[1] == "readme":
        import numpy as np
        pipe.set_progress_bar_config(disable=True)
        images = pipe([1, "tabby_cat", 0], num_inference_steps=2, generator=7, output_type="np").images
        np.save(os.path.join(os.environ["IMAGES"], f"{i}.npy"), images)
"""
    documented = "AttributeError: module diffusers has no attribute NaLaDiTPipeline"
    assert f"`{documented}`" in (ROOT / "docs" / "troubleshooting.md").read_text()
    both = [str(folders[NaLaDiTPipeline]), str(folders[NaLaSiTPipeline])]
    names = ["nala_dit.pipelines.pipeline NaLaDiTPipeline", "nala_dit.pipelines.pipeline NaLaSiTPipeline"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "IMAGES": str(tmp_path),
           "HF_MODULES_CACHE": str(tmp_path / "modules")}   # custom_pipeline's copy: not the user's cache
    without = ["changed: []", f"error: {documented}", "own: NaLaDiTPipeline", f"custom: {names[0]}",
               "registered: True", names[0]]
    for order, expected in [("without", without), ("readme", names)]:
        args = both[:1] if order == "without" else both
        proc = subprocess.run([sys.executable, "-c", code, order, *args], capture_output=True, text=True,
                              timeout=300, cwd=ROOT, env=env)
        assert proc.returncode == 0, (order, proc.stderr[-2000:])
        assert proc.stdout.splitlines() == expected, (order, proc.stdout)
    for i, cls in enumerate((NaLaDiTPipeline, NaLaSiTPipeline)):    # the arguments of test_pipeline.run
        np.testing.assert_array_equal(np.load(tmp_path / f"{i}.npy"), run(cls.from_pretrained(both[i])))


def test_nothing_of_diffusers_is_wrapped_or_replaced():
    """Registering leaves DiffusionPipeline.from_pretrained, diffusers' module dict of lazy names
    and sys.meta_path as diffusers made them; only the two class names are added."""
    import diffusers
    from diffusers import DiffusionPipeline
    from diffusers.pipelines import pipeline_utils

    func, chain = DiffusionPipeline.__dict__["from_pretrained"].__func__, []
    while func is not None:   # diffusers' own decorator (huggingface_hub's validate_hf_hub_args), then its code
        chain.append(func.__code__.co_filename)
        func = getattr(func, "__wrapped__", None)
    assert chain[-1] == pipeline_utils.__file__ and not any("nala_dit" in file for file in chain), chain
    assert type(diffusers._objects) is dict and "NaLaDiTPipeline" not in diffusers._objects
    assert not any(type(f).__module__.startswith("nala_dit") for f in sys.meta_path)
    assert diffusers.NaLaDiTPipeline is NaLaDiTPipeline and diffusers.NaLaSiTPipeline is NaLaSiTPipeline


@pytest.mark.parametrize("change", ["resolves-otherwise", "moved"])
def test_add_to_diffusers_warns_in_one_line_when_diffusers_resolves_names_otherwise(monkeypatch, change):
    import diffusers
    from diffusers.pipelines import pipeline_loading_utils

    if change == "moved":
        monkeypatch.delattr(pipeline_loading_utils, "_get_pipeline_class")
    else:
        monkeypatch.setattr(pipeline_loading_utils, "_get_pipeline_class", lambda cls, config: cls)
    with pytest.warns(RuntimeWarning) as caught:
        assert add_to_diffusers(NaLaDiTPipeline, NaLaSiTPipeline) is False
    text = one_line(caught[0].message)
    assert_names(text, f"diffusers {diffusers.__version__}", "NaLaDiTPipeline", "NaLaSiTPipeline", "_class_name",
                 "DiffusionPipeline.from_pretrained", "NaLaSiTPipeline.from_pretrained(folder)", "pyproject.toml")
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert add_to_diffusers(NaLaDiTPipeline, NaLaSiTPipeline) is True


# --- our routes check the folder first; the generic route is diffusers' own ---------------
@pytest.mark.parametrize("name", ["model_index.json", "transformer/config.json"])
def test_our_loader_refuses_deep_json_in_one_line(pipe_folder, tmp_path, name):
    bad = copy_of(pipe_folder, tmp_path / "bad")
    (bad / name).write_text(DEEP)
    with pytest.raises(ValueError) as err:
        NaLaDiTPipeline.from_pretrained(str(bad))
    assert f"{bad / name}: nested too deeply" in one_line(err) and "export the pipeline again" in one_line(err)


def test_our_loader_refuses_a_list_model_index_in_one_line(pipe_folder, tmp_path):
    bad = copy_of(pipe_folder, tmp_path / "bad")
    (bad / "model_index.json").write_text("[1, 2]")
    with pytest.raises(ValueError) as err:
        NaLaDiTPipeline.from_pretrained(str(bad))
    assert f"{bad / 'model_index.json'}" in one_line(err) and "JSON object" in one_line(err)


@pytest.mark.parametrize("value", [["NaLaDiTPipeline"], {"a": 1}, 3])
def test_a_class_name_that_is_no_string_is_one_line_on_our_routes(pipe_folder, tmp_path, capsys, value):
    import sample

    bad = copy_of(pipe_folder, tmp_path / "bad")
    index = json.loads((bad / "model_index.json").read_text())
    (bad / "model_index.json").write_text(json.dumps({**index, "_class_name": value}))
    with pytest.raises(ValueError) as err:
        NaLaDiTPipeline.from_pretrained(str(bad))
    assert_names(one_line(err), f"{bad / 'model_index.json'}: _class_name must be a string", "export")
    assert sample.main(["--ckpt", str(bad), "--labels", "1", "--steps", "2", "--grid", str(tmp_path / "g.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "_class_name" in err, err


@pytest.mark.parametrize("case", ["one name too many", "a list", "a list name", "an object name", "id past the end"])
def test_a_pipeline_folder_s_class_names_are_checked_on_every_route(pipe_folder, tmp_path, capsys, case):
    """``sample.py`` / ``app.py`` read the folder's files themselves (``load_pipeline_folder``)
    and check ``id2label`` with the pipeline's own check: a fourth name for a 3-class model
    would have sent ``--labels c3`` to the null class (unconditional) without a word."""
    import sample

    bad = copy_of(pipe_folder, tmp_path / "bad")
    index = json.loads((bad / "model_index.json").read_text())
    names = {str(i): name for i, name in NAMES.items()}
    index["id2label"] = {"one name too many": {**names, "3": "c3"}, "a list": list(names.values()),
                         "a list name": {**names, "1": ["golden", "retriever"]},
                         "an object name": {**names, "2": {"a": 1}},
                         "id past the end": {"0": names["0"], "1": names["1"], "7": "c7"}}[case]
    (bad / "model_index.json").write_text(json.dumps(index))
    label = "c3" if case == "one name too many" else "c7" if case == "id past the end" else "1"
    assert sample.main(["--ckpt", str(bad), "--labels", label, "--steps", "2", "--grid", str(tmp_path / "g.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert_names(err, f"{bad / 'model_index.json'}: id2label", "export the pipeline again")
    assert not (tmp_path / "g.png").exists()
    with pytest.raises(ValueError) as same:   # the pipeline's own route: the same check
        NaLaDiTPipeline.from_pretrained(str(bad))
    assert err.split("id2label", 1)[1].split(";")[0] in one_line(same)


def test_our_loader_refuses_a_huge_hidden_size_before_building(pipe_folder, tmp_path, monkeypatch):
    built = count_dit_builds(monkeypatch)
    bad = copy_of(pipe_folder, tmp_path / "bad")
    config_file = bad / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "hidden_size": 65536}))
    with pytest.raises(ValueError) as err:
        NaLaDiTPipeline.from_pretrained(str(bad))
    assert_names(one_line(err), "hidden_size implies 65,536", "the weights have 128")
    assert 65536 not in built


def test_the_generic_loader_refuses_a_huge_hidden_size_before_building(pipe_folder, tmp_path, monkeypatch):
    """diffusers' own route checks the transformer too: it calls ``DiT.from_pretrained``, which
    runs ``check_transformer_folder`` before diffusers builds a model (64 GiB at 65,536 wide)."""
    built = count_dit_builds(monkeypatch)
    bad = copy_of(pipe_folder, tmp_path / "bad")
    config_file = bad / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "hidden_size": 65536}))
    with pytest.raises(ValueError) as err:
        generic(bad)
    assert_names(one_line(err), f"{config_file} does not describe", "hidden_size implies 65,536",
                 "the weights have 128")
    assert 65536 not in built


def test_the_generic_loader_refuses_non_finite_weights(pipe_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = copy_of(pipe_folder, tmp_path / "bad")
    weights = bad / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    state["final_layer.linear.weight"][0, 0] = float("nan")
    save_file(state, weights)
    with pytest.raises(ValueError) as err:
        generic(bad)
    assert_names(one_line(err), str(bad / "transformer"), "final_layer.linear.weight")
