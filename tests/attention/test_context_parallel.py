"""Context parallel (nala_dit/attention/context_parallel.py): one image's rows over P processes.

Real multi-process runs (gloo; processes forked from a preloaded server, tests/ranks.py): every case runs in one pair of
processes (a module fixture), each rank computing the one-process reference itself, and the
test asserts each case's differences. Replicated leaves (parameters, the input) are compared
as DDP sees them: the mean of the ranks' gradients (see the module doc).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nala_dit.attention.context_parallel import (
    ContextParallel,
    ShardGrid,
    exchanged_numbers,
    row_split,
)
from tests.ranks import run_ranks, spawn
from tests.utils import TINY, assert_names, free_port, launch, one_line

TOL = 1e-5     # relative to the reference's largest magnitude (fp32, sums in another order)
SCALE = 0.1   # weights' std: at 0.3 the fp32 one-process gradients themselves differ from fp64 by 3e-5


def test_row_split_gives_the_first_ranks_one_row_more():
    assert row_split(7, 2) == [4, 3]
    assert row_split(8, 2) == [4, 4]
    assert row_split(10, 4) == [3, 3, 2, 2]
    assert row_split(3, 3) == [1, 1, 1]


def test_more_ranks_than_rows_is_a_one_line_error():
    with pytest.raises(ValueError) as err:
        row_split(4, 5)
    assert_names(one_line(err), "P=5", "4 rows", "--context-parallel 4 or less", "a larger image")


def test_p_not_dividing_the_world_is_a_one_line_error():
    with pytest.raises(ValueError) as err:
        ContextParallel.from_world(2)
    assert_names(one_line(err), "--context-parallel 2", "number of processes (1)", "--num_processes")


def test_shard_grid_unpacks_as_the_local_rows():
    shard = ShardGrid(ContextParallel(2, 1), 7, 3)
    assert tuple(shard) == (3, 3) and (shard.start, shard.stop, shard.tokens) == (4, 7, 21)


def test_exchanged_numbers_closed_forms():
    # XL/2: 16 heads, D = 72: state 16·144·73 = 168,192 numbers, halo to the one neighbour
    # 2 rows · 128 · 1152 at 16K tokens
    assert exchanged_numbers("nala", 16384, 1152, 16) == 168_192 + 2 * 128 * 1152
    assert exchanged_numbers("softmax", 16384, 1152, 16) == 2 * 8192 * 1152


def _spread(model, seed):
    """Every weight random (the adaLN-Zero init makes the output and most gradients 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * SCALE)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _model_case(cp, spec, results):
    from nala_dit.attention.context_parallel import enable
    from nala_dit.models.dit import DiT

    name, options, latent = spec
    checkpointing = options.pop("checkpointing", False)
    recompute = options.pop("recompute", True)
    model = DiT(**{**TINY, "input_size": 8, **options}).eval()
    for block in model.blocks:
        if hasattr(block.attn, "recompute"):
            block.attn.recompute = recompute      # False: the plain autograd composition
    _spread(model, 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, *latent, generator=g)
    t = torch.tensor([3.0, 700.0])
    y = torch.tensor([1, 10])
    up = torch.randn(2, model.out_channels, *latent, generator=g)

    def run(m):
        xi = x.clone().requires_grad_()
        out = m(xi, t, y)
        (out * up).mean().backward()
        return out.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    ref = run(model)
    split = copy.deepcopy(model)
    split.zero_grad(set_to_none=True)
    if checkpointing:
        split.enable_gradient_checkpointing()
    enable(split, cp)
    got = run(split)
    with torch.no_grad():                    # sampling: the paths without autograd
        sampled = split(x, t, y)
    mean = lambda t: (dist.all_reduce(t := t.clone()), t / cp.size)[1]
    assert set(got[2]) == set(ref[2]), name
    # Each parameter's gradient on its own scale, floored at 1 % of the largest entry of the
    # model's gradient: a tensor far below it (the learned norm scale, ~1e-7, a sum of terms
    # that cancel) has an fp32 floor above 1e-5 of itself in the one-process run alone.
    floor = 1e-2 * max(g.abs().max() for g in ref[2].values())
    param = lambda a, b: ((a - b).abs().max() / torch.maximum(b.abs().max(), floor)).item()
    results[name] = dict(out=_rel(got[0], ref[0]), no_grad_out=_rel(sampled, ref[0]),
                         input_grad=_rel(mean(got[1]), ref[1]),
                         param_grad=max(param(mean(got[2][n]), ref[2][n]) for n in ref[2]))


def _halo_case(cp, h, w, r, results):
    g = torch.Generator().manual_seed(2)
    img, up = torch.randn(2, 3, h, w, generator=g), torch.randn(2, 3, h, w, generator=g)
    weight = torch.randn(3, 1, 2 * r + 1, 2 * r + 1, generator=g)
    full = img.clone().requires_grad_()
    ref = F.conv2d(full, weight, padding=r, groups=3)
    (ref * up).sum().backward()
    shard = cp.split(h, w)
    local = img[:, :, shard.start:shard.stop].clone().requires_grad_()
    out = F.conv2d(shard.halo_rows(local, r), weight, padding=(0, r), groups=3)
    (out * up[:, :, shard.start:shard.stop]).sum().backward()   # the ranks' losses partition the sum
    rows = slice(shard.start, shard.stop)
    results[f"halo {h}x{w} r={r}"] = dict(out=_rel(out, ref[:, :, rows].detach()),
                                          input_grad=_rel(local.grad, full.grad[:, :, rows]))


def _gather_case(cp, results):
    shard = cp.split(5, 3)
    x = torch.arange(2 * 15 * 4, dtype=torch.float32).view(2, 15, 4)
    local = x[:, shard.start * 3:shard.stop * 3].clone().requires_grad_()
    full = shard.gather(local)
    full.backward(torch.ones_like(full) * (cp.rank + 1))          # all-reduced: 1 + 2 + … + P everywhere
    state = shard.all_reduce(local.sum(1, keepdim=True))
    total = cp.size * (cp.size + 1) / 2
    results["gather"] = dict(out=_rel(full.detach(), x), input_grad=_rel(local.grad, torch.full_like(local, total)),
                             all_reduce=_rel(state.detach(), x.sum(1, keepdim=True)))


NALA = dict(attention="nala")
MODEL_CASES = [
    ("NaLaDiT 8x8", NALA, (8, 8)),
    ("NaLaDiT 14x14 (7 rows)", NALA, (14, 14)),
    ("NaLaDiT 10x6 (5x3 grid)", NALA, (10, 6)),
    ("NaLaSiT 10x6", dict(attention="nala", learn_sigma=False, objective="transport"), (10, 6)),
    ("NaLaDiT no recompute 10x6", dict(attention="nala", recompute=False), (10, 6)),
    ("NaLaDiT checkpointing 10x6", dict(attention="nala", checkpointing=True), (10, 6)),
    ("NaLaDiT learned scale 10x6", dict(attention="nala", norm_scale="learned"), (10, 6)),
    ("hybrid softmax_blocks 14x14", dict(attention="nala", softmax_blocks=[1]), (14, 14)),
    ("DiT 10x6", dict(attention="softmax"), (10, 6)),
    ("DiT 14x14", dict(attention="softmax"), (14, 14)),
    ("softmax_gated 10x6", dict(attention="softmax_gated"), (10, 6)),
    ("relu 10x6", dict(attention="relu"), (10, 6)),
    ("region states R=2 10x6", dict(attention="nala", nala_regions=2), (10, 6)),
    ("region states R=3 14x14", dict(attention="nala", nala_regions=3), (14, 14)),
    ("Mix-FFN 10x6", dict(attention="nala", mlp="mix"), (10, 6)),
    ("Mix-FFN DiT 14x14", dict(attention="softmax", mlp="mix"), (14, 14)),
]


def _eager_case(cp, results):
    """NaLa off the fused path (what Triton falls back to under context parallel)."""
    from nala_dit.attention import nala_attention

    g = torch.Generator().manual_seed(3)
    q, k, v, up = (torch.randn(1, 2, 15, 8, generator=g) for _ in range(4))
    shard = cp.split(5, 3)
    rows = slice(shard.start * 3, shard.stop * 3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = nala_attention(*leaves, impl="eager")
    (ref * up).sum().backward()
    for impl in ("eager", "fused"):
        loc = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
        out = nala_attention(*loc, impl=impl, shard=shard)
        (out * up[:, :, rows]).sum().backward()
        results[f"nala_attention {impl}"] = dict(
            out=_rel(out.detach(), ref[:, :, rows].detach()),
            input_grad=max(_rel(a.grad, b.grad[:, :, rows]) for a, b in zip(loc, leaves)))


def _pipeline_case(cp, results, folder):
    """The pipelines take the split as documented: ``enable(pipe.transformer, context)`` on
    every process, each calling the pipeline alike, gives every process the same images."""
    import numpy as np

    from nala_dit.attention.context_parallel import enable
    from nala_dit.pipelines.pipeline import pipeline_from_checkpoint
    from tests.scripts.test_sample import write_checkpoint

    torch.manual_seed(0)                       # the model's init: the same weights on every rank
    pipe = pipeline_from_checkpoint(write_checkpoint(Path(folder) / f"rank{cp.rank}" / "dit"))
    pipe.set_progress_bar_config(disable=True)
    call = lambda: np.stack([np.asarray(img, dtype=np.float32) for img in pipe(
        [2, 5], sampler="ddim", num_inference_steps=2, guidance_scale=1.5, generator=0, height=10, width=6).images])
    ref = call()
    enable(pipe.transformer, cp)
    got = call()
    assert ref.max() > ref.min()               # not a constant image
    results["pipeline"] = dict(uint8_images=float(np.abs(got - ref).max()))


def _worker(rank, size, port, path, models=True):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        cp = ContextParallel.from_world(size)
        results = {}
        _gather_case(cp, results)
        for h, w, r in ((7, 4, 2), (3, 5, 2), (8, 3, 1), (4, 3, 2)):
            _halo_case(cp, h, w, r, results)
        _eager_case(cp, results)
        for name, options, latent in MODEL_CASES if models else ():
            _model_case(cp, (name, dict(options), latent), results)
        if models:
            _pipeline_case(cp, results, os.path.dirname(path))
        all_results = [None] * size
        dist.all_gather_object(all_results, results)
        if rank == 0:
            torch.save(all_results, path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("cp") / "results.pt"
    spawn(_worker, (2, free_port(), str(path)), nprocs=2)
    return torch.load(path, weights_only=True)


PIECES = ["gather", "halo 7x4 r=2", "halo 3x5 r=2", "halo 8x3 r=1", "halo 4x3 r=2", "nala_attention eager",
          "nala_attention fused"]
CASES = PIECES + [c[0] for c in MODEL_CASES] + ["pipeline"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_processes_equal_one(two_ranks, case):
    for rank, results in enumerate(two_ranks):
        for what, err in results[case].items():
            print(case, rank, what, f"{err:.1e}")
            assert err <= TOL, (case, rank, what, err)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """P = 3: rows 2, 1, 1 of a 4-row grid, so a halo of 2 rows spans two ranks."""
    path = tmp_path_factory.mktemp("cp3") / "results.pt"
    spawn(_worker, (3, free_port(), str(path), False), nprocs=3)
    return torch.load(path, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", PIECES)
def test_three_processes_equal_one(three_ranks, case):
    for rank, results in enumerate(three_ranks):
        for what, err in results[case].items():
            assert err <= TOL, (case, rank, what, err)


# ------------------------------------------------------------------ train.py
CP_RUN = ["--model", "NaLaDiT-T/2", "--data", "digits", "--global-batch-size", "4", "--num-workers", "0",
          "--sample-every", "0", "--log-every", "1", "--flip", "false", "--max-steps", "3", "--ckpt-every", "3",
          "--lr", "1e-3"]


@pytest.mark.slow
def test_train_with_context_parallel_2_gives_the_one_process_weights_and_resumes_bitwise(tmp_path):
    from safetensors.torch import load_file

    import train as train_cli
    from nala_dit.training import checkpoint as ckpt_lib

    proc = run_ranks(tmp_path, "train.py", *CP_RUN, "--context-parallel", "2", "--results-dir", str(tmp_path),
                     "--exp-name", "cp2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_names(proc.stdout, "context parallel: 2 processes per image", "4 token rows split as [2, 2]",
                 "1 data-parallel group of 4 images")
    assert train_cli.main(CP_RUN + ["--results-dir", str(tmp_path), "--exp-name", "one"]) == 0
    split, one = (load_file(str(ckpt_lib.open_checkpoint(tmp_path / name).path / "model.safetensors"))
                  for name in ("cp2", "one"))
    assert set(split) == set(one)
    errors = {key: (split[key] - one[key]).abs().max().item() for key in one}
    print(f"largest weight difference after 3 steps: {max(errors.values()):.1e}")
    for key, err in errors.items():
        assert err <= TOL, (key, err)
    # the steps moved the weights: the adaLN-Zero output layer starts at exactly 0
    assert one["final_layer.linear.weight"].abs().max() > 1e-3

    # stopped after step 2 (its last checkpoint), resumed to 3: bit for bit the straight run
    for steps, extra in (("2", []), ("3", ["--resume", "auto"])):
        proc = run_ranks(tmp_path, "train.py", *CP_RUN, "--context-parallel", "2", "--results-dir", str(tmp_path),
                         "--exp-name", "resumed", "--max-steps", steps, "--ckpt-every", "2", *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (ckpt_lib.open_checkpoint(tmp_path / name) for name in ("cp2", "resumed"))
    assert a.step == b.step == 3
    for which in ("model", "ema"):
        wa, wb = a.weights(which), b.weights(which)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), which


@pytest.mark.slow
def test_context_parallel_not_dividing_the_processes_is_a_one_line_error(tmp_path):
    proc = launch(tmp_path, "train.py", *CP_RUN, "--context-parallel", "3", "--results-dir", str(tmp_path))
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # once (rank 0), then the note of cli.report_error on what the launcher prints after it
    assert len(errors) == 1
    assert errors[0].startswith("error: --context-parallel 3 "), errors[0]
    assert_names(errors[0], "number of processes (2)", "multiple of 3 processes", "--num_processes N", "divisor of 2",
                 "ChildFailedError")



# ------------------------------------------------------------------ sample.py
@pytest.mark.slow
def test_sample_with_context_parallel_2_writes_the_one_process_npz(tmp_path):
    import json
    from pathlib import Path

    import numpy as np

    import sample as sample_cli
    from tests.scripts.test_sample import write_checkpoint

    run_dir = write_checkpoint(tmp_path / "runs" / "dit")
    common = ["--ckpt", str(run_dir), "--num-samples", "6", "--seed", "3", "--sampler", "ddim", "--steps", "2",
              "--batch-size", "2", "--shard-size", "2", "--image-size", "10x6"]   # a 5x3 token grid
    assert sample_cli.main(common + ["--out", str(tmp_path / "one.npz")]) == 0
    proc = run_ranks(tmp_path, "sample.py", *common, "--context-parallel", "2", "--out", str(tmp_path / "cp.npz"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(tmp_path / "one.npz") as one, np.load(tmp_path / "cp.npz") as cp:
        assert one["arr_0"].shape == (6, 10, 6, 1)
        np.testing.assert_array_equal(cp["arr_0"], one["arr_0"])
        np.testing.assert_array_equal(cp["arr_1"], one["arr_1"])
    meta = json.loads(Path(f"{tmp_path / 'cp.npz'}.json").read_text())
    assert meta["world_size"] == 1 and meta["context_parallel"] == 2


def test_sample_context_parallel_without_out_is_a_one_line_error(tmp_path, capsys):
    import sample as sample_cli

    assert sample_cli.main(["--ckpt", str(tmp_path), "--labels", "1", "--grid", str(tmp_path / "g.png"),
                            "--context-parallel", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert_names(err, "--context-parallel 2", "mass sampling", "--out samples.npz", "drop it for --grid / --out-dir")


@pytest.mark.slow
def test_evaluate_gen_with_context_parallel_2_gives_the_one_process_scores(tmp_path, digits_checkpoint,
                                                                           digits_classifier_dir):
    import json

    import evaluate_fid

    classifier = ["--digits-classifier", str(digits_classifier_dir), "--device", "cpu"]
    stats = tmp_path / "digits.npz"
    assert evaluate_fid.main(["ref", "--dataset", "digits-heldout", "--features", "digits", "--out", str(stats),
                              *classifier]) == 0
    gen = ["gen", "--ckpt", str(digits_checkpoint), "--ref", str(stats), "--num-samples", "12", "--sampler", "ddim",
           "--steps", "2", "--batch-size", "4", *classifier]
    assert evaluate_fid.main(gen + ["--json", str(tmp_path / "one.json")]) == 0
    proc = run_ranks(tmp_path, "evaluate_fid.py", *gen, "--context-parallel", "2", "--json", str(tmp_path / "cp.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, cp = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "cp"))
    assert cp["metrics"] == one["metrics"] and cp["num_samples"] == 12


@pytest.mark.slow
def test_context_parallel_under_a_cpu_launch_of_one_process_is_the_launch_error(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts one process: the launch mistake is
    named (with the command that works) before --context-parallel 2 could fail on it."""
    proc = launch(tmp_path, "train.py", *CP_RUN, "--context-parallel", "2", "--results-dir", tmp_path, cpu_flag=True)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert_names(errors[0], "error: accelerate launch", "asked for 2 processes", "started one", "--multi_gpu",
                 "ACCELERATE_USE_CPU=1", "--num_processes 2")
