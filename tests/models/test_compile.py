"""``nala_dit.models.compile``: ``sample.py --compile`` / ``--cuda-graphs``,
the NaLa pipelines' ``compile()`` and ``train.py --compile`` all go through
``compile_model``. On this CPU the compiled model (inductor) gives the eager images, and
``--cuda-graphs`` says in one line that it runs without CUDA graphs. One tiny model (one
block) is compiled for real, once per process: the second compile of the same graph is an
inductor cache hit (the first takes about 30 s on one core, the rest a few seconds)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch._dynamo.utils import counters

import sample
from nala_dit.models.compile import NO_CUDA_NOTE, compile_model
from tests.utils import cli

FAST = ["--sampler", "ddim", "--steps", "2", "--labels", "1,7", "--per-label", "3", "--seed", "5"]


@pytest.fixture(scope="module")
def one_block_run(tmp_path_factory):
    from tests.scripts.test_sample import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("runs") / "one-block", depth=1)


def test_compile_model_modes():
    with pytest.raises(ValueError, match="compile mode must be one of default, reduce-overhead, got 'max'"):
        compile_model(torch.nn.Linear(2, 2), "max")
    model = torch.nn.Linear(2, 2)
    assert compile_model(model) is model and model._compiled_call_impl is not None
    wrapper = compile_model(model := torch.nn.Linear(2, 2), in_place=False)   # train.py: the step's wrapper
    assert wrapper is not model and wrapper._orig_mod is model and model._compiled_call_impl is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the note is for machines without CUDA")
def test_sample_cuda_graphs_without_cuda_writes_the_eager_grid(one_block_run, tmp_path, capsys):
    assert cli("--ckpt", one_block_run, *FAST, "--grid", tmp_path / "eager.png") == 0
    capsys.readouterr()
    torch._dynamo.reset()
    assert cli("--ckpt", one_block_run, *FAST, "--grid", tmp_path / "graphs.png", "--cuda-graphs") == 0
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "CUDA graphs" in line] == [NO_CUDA_NOTE], err
    eager, graphs = (np.asarray(Image.open(tmp_path / name)) for name in ("eager.png", "graphs.png"))
    assert eager.shape == (2 * 10 + 2, 3 * 10 + 2)
    np.testing.assert_array_equal(graphs, eager)


def test_sample_flags_pick_the_mode(monkeypatch, capsys):
    """--compile: mode default; --cuda-graphs: reduce-overhead; neither: no compile. A compiled
    model's first batch is announced with its cost before it runs (minutes on a CPU)."""
    from nala_dit.models.compile import compile_note

    modes = []
    monkeypatch.setattr("nala_dit.models.compile.compile_model", lambda model, mode: modes.append(mode))
    capsys.readouterr()
    for flags in ([], ["--compile"], ["--cuda-graphs"], ["--compile", "--cuda-graphs"]):
        args = sample.build_parser().parse_args(["--ckpt", "x", *flags])
        sample.compiled(SimpleNamespace(model=None), args)
    assert modes == ["default", "reduce-overhead", "reduce-overhead"]
    assert capsys.readouterr().err.splitlines() == [compile_note("batch")] * 3
    assert compile_note("batch").startswith("compiling the model (torch.compile): the first batch takes it, on a CPU ")


def test_train_compile_goes_through_compile_model(monkeypatch):
    """train.py --compile: the step calls ``compile_model``'s wrapper (the module stays eager)."""
    import copy

    from accelerate import Accelerator

    from nala_dit.models.dit import create_model
    from nala_dit.training import build
    from nala_dit.training.config import TrainConfig
    from nala_dit.training.run import Placement, Weights

    calls = []
    monkeypatch.setattr(build, "compile_model", lambda model, **kw: calls.append(kw) or model)
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, depth=1)
    optimizer = torch.optim.AdamW(model.parameters())
    for compile in (False, True):
        cfg = TrainConfig(model="NaLaDiT-T/2", data="digits", compile=compile)
        build.step_model(cfg, Placement(Accelerator(cpu=True), None, None, 4), Weights(model, copy.deepcopy(model)),
                         optimizer)
    assert calls == [dict(in_place=False)]


def test_train_compile_announces_the_first_step_and_leaves_it_out_of_the_eta(tmp_path, monkeypatch, capsys):
    """train.py --compile says before step 1 that it compiles (and what that costs), and the
    progress bar's rate restarts after that step: the ETA is the steps' own."""
    from nala_dit.models.compile import compile_note
    from nala_dit.training import build, loop
    from tests.training.test_loop import run_train

    monkeypatch.setattr(build, "compile_model", lambda model, **kw: model)   # the compile itself: elsewhere
    restarted = []
    monkeypatch.setattr(loop, "restart_rate", lambda bar: restarted.append(getattr(bar, "n", None)))
    capsys.readouterr()
    run_train(tmp_path, "--max-steps", "2", "--compile", "true")
    out = capsys.readouterr().out
    assert f"{compile_note('step')}; the rate and ETA leave it out" in out.splitlines(), out
    assert restarted == [1]   # after the first step, once


def test_compiled_pipeline_gives_the_eager_images(one_block_run, capsys):
    """``pipe.compile(mode=...)``: the transformer compiled in place; 2 ddim steps give the
    eager images within 1e-5 (the graph of the sample.py test above: an inductor cache hit)."""
    from nala_dit.pipelines.pipeline import pipeline_from_checkpoint

    pipe = pipeline_from_checkpoint(one_block_run)
    pipe.set_progress_bar_config(disable=True)
    run = lambda: pipe([1, 1, 1, 7, 7, 7], sampler="ddim", num_inference_steps=2, generator=5, output_type="np").images
    eager = run()
    torch._dynamo.reset()
    capsys.readouterr()
    assert pipe.compile(mode="reduce-overhead") is pipe and pipe.transformer._compiled_call_impl is not None
    if not torch.cuda.is_available():
        assert capsys.readouterr().err.strip() == NO_CUDA_NOTE
    compiled = run()
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert eager.shape == (6, 8, 8, 1)
    np.testing.assert_allclose(compiled, eager, rtol=0, atol=1e-5)
