"""The Triton NaLa kernels (run from here in Triton's interpreter) and ``impl="auto"``.

The kernel cases live in ``tests/attention/triton_cases.py``. Triton reads ``TRITON_INTERPRET`` when a
kernel is defined, so setting it inside this process would be too late (and would leak
into every other test): the cases run in a subprocess with the variable set.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

import nala_dit.attention.nala as fused
from nala_dit.attention import nala_attention, select_nala_impl
from tests.utils import run_cases_file

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def run_cases(env_extra, *pytest_args):
    return run_cases_file("tests/attention/triton_cases.py", env_extra, *pytest_args)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
def test_kernels_under_the_interpreter():
    """fp32 outputs and gradients against the quadratic reference, ≤ 1e-5 relative RMS:
    odd N (1, 17, 1,025 among them), both directions, head dims 24/32/40/48/64/72/96/128
    (40, 48, 72, 96 as two tiles in the fused variant, padded in the baseline), exact zeros,
    strided inputs, several token ranges, non-default constants, a per-head norm scale;
    both kernel variants (fused and baseline)."""
    stdout = run_cases({"TRITON_INTERPRET": "1"})
    assert " passed" in stdout and "failed" not in stdout
    # Everything except the CUDA-only cases (long N, the autocast layer) ran.
    assert "41 passed" in stdout, stdout[-2000:]


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and Triton")
def test_kernels_on_cuda():
    """The same cases compiled for the GPU, plus bf16/fp16 inputs, N = 8192 with many
    token ranges against the fused path, and the gated layer under bf16 autocast."""
    stdout = run_cases({})
    assert "skipped" not in stdout, stdout[-2000:]


# ------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_and_meta_pick_the_fused_path(dtype):
    for device in ("cpu", "meta"):
        assert select_nala_impl(device, 64, dtype, has_triton=True) == "fused"
        assert select_nala_impl(device, 64, dtype, has_triton=False) == "fused"


@pytest.mark.parametrize("head_dim", [32, 64, 72, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_picks_triton(head_dim, dtype):
    assert select_nala_impl("cuda", head_dim, dtype, has_triton=True) == "triton"


def test_cuda_falls_back_to_the_unchunked_composition():
    assert select_nala_impl("cuda", 64, torch.bfloat16, has_triton=False) == "eager"
    assert select_nala_impl("cuda", 256, torch.bfloat16, has_triton=True) == "eager"   # head dim > 128
    assert select_nala_impl("cuda", 64, torch.float64, has_triton=True) == "eager"
    assert select_nala_impl("mps", 64, torch.float32, has_triton=True) == "eager"
    # more tokens than the kernels' grid takes: the composition, not an error
    limit = fused.TRITON_MAX_TOKENS  # 65535 token blocks of 16
    assert select_nala_impl("cuda", 64, torch.bfloat16, True, num_tokens=limit) == "triton"
    assert select_nala_impl("cuda", 64, torch.bfloat16, True, num_tokens=limit + 1) == "eager"


def test_auto_follows_the_selection(monkeypatch):
    """``nala_attention(impl="auto")`` runs whatever ``select_nala_impl`` names."""
    q, k, v = (torch.randn(1, 2, 17, 16) for _ in range(3))
    seen = []
    monkeypatch.setattr(fused, "select_nala_impl", lambda *a: seen.append(a) or "eager")
    out = nala_attention(q, k, v)
    assert seen == [("cpu", 16, torch.float32, fused.triton_available(), 17)]
    assert torch.equal(out, nala_attention(q, k, v, impl="eager"))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_triton_on_cpu_without_the_interpreter_is_named():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        nala_attention(q, q, q, impl="triton")


def test_chunk_sizes_per_device():
    """The fused path chunks tokens finely on a CPU (cache-sized) and hardly at all on a GPU."""
    shape = torch.Size((1, 6, 4096, 64))
    cpu = fused._token_chunks(shape, torch.device("cpu"))
    gpu = fused._token_chunks(shape, torch.device("cuda"))
    assert len(cpu) == -(-4096 // (fused._CHUNK_ELEMENTS // (6 * 64))) and len(gpu) == 1
    for chunks in (cpu, gpu):
        assert chunks[0].start == 0 and chunks[-1].stop == 4096
        assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_kernels_compile_for_hopper():
    """The CUDA compilation path, which the interpreter skips: every kernel the fused variant
    launches (bf16, cosine, D = 72 as in XL/2: the split-tile kernels, 64 + 16 lanes) lowers
    to PTX for sm_90a, passes the ptxas that Triton ships and disassembles, without a GPU
    (about 30-90 s on a cold Triton cache). What the report says is held: every product
    on wgmma (HGMMA; mma.sync only for the state's 16 × 16 S[b,b] blocks, none in output,
    dq, dkv, which took 32-96 mma.sync each with D padded to 128); sin, cos, log (the bf16
    mode's approximations), exp2, rcp, sqrt on the MUFU unit; the state passes and the
    output at ≤ 176 registers without spills (they took 195-255 padded); dq and dkv's small
    spills (28 and 52 B measured). At D = 64 the state passes in two programs per SM.
    Not yet held (issue 53): two programs per SM at D = 72 (173-255 registers at 8 warps)
    and no spills at all; ``benchmarks/triton_compile_check.py`` prints the full table."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from triton_compile_check import report

    rows = {label: r for label, warps, r in report(72, "bf16", "cosine", "fused")}
    assert list(rows) == ["forward", "state", "output", "dq", "dstate", "dkv"]
    for label, r in rows.items():
        assert r["registers"] is not None and 0 < r["registers"] <= 255, (label, r)
        assert r["programs_per_sm"] >= 1 and r["spill_bytes"] is not None, (label, r)
        assert {"SIN", "COS", "LG2", "EX2", "RCP", "SQRT"} <= set(r["mufu"]), (label, r)
        assert r["hgmma"] > 0, (label, r)                                 # wgmma everywhere
    for label in ("state", "dstate", "output"):
        assert rows[label]["registers"] <= 176 and rows[label]["spill_bytes"] == 0 and rows[label]["local"] == 0
    for label in ("output", "dq", "dkv"):
        assert rows[label]["hmma"] == 0, (label, rows[label])             # no mma.sync fallback
    for label in ("dq", "dkv"):
        assert rows[label]["spill_bytes"] <= 64, (label, rows[label])
    assert rows["forward"]["spill_bytes"] <= 128, rows["forward"]
    # S/2's head dim: the state passes fit two programs per SM (8 warps, ≤ 128 registers), no spills.
    for label, warps, r in report(64, "bf16", "cosine", "fused", labels=("state", "dstate")):
        assert r["registers"] <= 128 and r["programs_per_sm"] >= 2 and r["spill_bytes"] == 0, (label, r)
        assert r["hgmma"] > 0, (label, r)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_gated_epilogue_kernels_compile_for_hopper_without_spills():
    """The gated layer's three epilogue kernels (``triton_gated.py``) at S/2's and XL/2's
    hidden sizes, bf16, sm_90a: no register spills, no local memory, at least one program
    per SM at their warps (measured: 61-169 registers at 8 warps)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from triton_compile_check import gated_report

    for channels in (384, 1152):
        rows = gated_report(channels)
        assert [label for label, _, _ in rows] == ["epilogue", "norm_bwd", "lepe_bwd"]
        for label, warps, r in rows:
            assert r["spill_bytes"] == 0 and r["local"] == 0 and r["programs_per_sm"] >= 1, (channels, label, r)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_split_head_dim_tiles():
    """Which head dims run as two tiles (lanes [0, BA) and [BA, BA + BB), both powers of
    two, BB ≥ 16) in the fused variant: those where that is narrower than one padded tile.
    XL/2's 72 is 64 + 16 (80 lanes, not 128); powers of two and the baseline keep BD."""
    from nala_dit.attention.triton_kernels import launch_config, split_tiles

    assert split_tiles(72) == (64, 16) and split_tiles(80) == (64, 16) and split_tiles(96) == (64, 32)
    assert split_tiles(40) == (32, 16) and split_tiles(48) == (32, 16)
    for d in (16, 24, 32, 64, 100, 120, 128):                    # no narrower split: one padded tile
        assert split_tiles(d) is None, d
    cfg = launch_config(72)
    assert (cfg["BA"], cfg["BB"], cfg["BD"]) == (64, 16, 128)
    assert all(cfg[g]["NV"] == 1 for g in ("state", "out", "bwd"))    # every value lane in one program
    assert "BA" not in launch_config(72, variant="baseline") and "BA" not in launch_config(64)
    assert launch_config(72, dict(BLOCK_N=16, BV=16, num_warps=4))["bwd"] == dict(BLOCK_N=16, num_warps=4, NV=1)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_unsupported_shapes_are_named():
    from nala_dit.attention.triton_kernels import unsupported_reason

    assert unsupported_reason(torch.empty(1, 2, 8, 128, device="meta")) is None
    assert "head dim 160" in unsupported_reason(torch.empty(1, 2, 8, 160, device="meta"))
    assert "float64" in unsupported_reason(torch.empty(1, 2, 8, 64, dtype=torch.float64, device="meta"))
    assert "tokens" in unsupported_reason(torch.empty(1, 1, 65535 * 16 + 1, 64, device="meta"))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_state_pass_splits(monkeypatch):
    """Token ranges of the state passes: enough programs for the GPU's SMs, none shorter
    than MIN_SPLIT_TOKENS; the fused variant runs one range (one launch) below
    SHORT_TOKENS and gives every SM of an H100/H200 work at batch 1, N = 1,024, XL/2's 16
    heads; one range on CPU (interpreter)."""
    from nala_dit.attention import triton_kernels

    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cuda = torch.device("cuda")
    splits = triton_kernels.num_splits
    assert splits(65536, 6, 1, cuda) == 88                               # 4 × 132 programs / 6 heads
    assert splits(4096, 6, 1, cuda) == 64                                # 4096 / 64-token ranges
    assert splits(1024, 16, 1, cuda) == 16 and 16 * 16 >= 132            # batch 1, XL/2 heads: every SM
    assert splits(1024, 6, 1, cuda) == 16                                # batch 1, S/2 heads: 96 programs
    assert splits(1023, 16, 1, cuda) == 1                                # short: the single-launch forward
    assert splits(4096, 256 * 16, 2, cuda) == 1                          # B·H already fills the GPU
    assert splits(65536, 6, 1, torch.device("cpu")) == 1
    # The baseline variant (before issue 53): ranges of at least 512 tokens.
    assert splits(4096, 6, 1, cuda, "baseline") == 8
    assert splits(1024, 16, 1, cuda, "baseline") == 2
    assert splits(256, 6, 1, cuda, "baseline") == 1


# ------------------------------------------------------- first-use check and fallback


def _eager_kernel(q, k, v, norm_scale, opts):
    return fused._nala_eager_opts(q, k, v, norm_scale, opts)


def _failing_kernel(q, k, v, norm_scale, opts):
    raise RuntimeError("PTX compile failed: ptxas error (injected)\nsecond line")


def _wrong_kernel(q, k, v, norm_scale, opts):
    return _eager_kernel(q, k, v, norm_scale, opts) * 1.01          # 1 % off: above every tolerance


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """``impl="auto"`` picks "triton" on this CPU, with a fresh check cache; returns a
    function that installs the kernel the check and the calls will run."""
    monkeypatch.setattr(fused, "select_nala_impl", lambda *a: "triton")
    monkeypatch.setattr(fused, "_TRITON_CHECKS", {})
    return lambda kernel: monkeypatch.setattr(fused, "_triton_kernel", kernel)


@pytest.mark.parametrize("kernel,cause", [(_failing_kernel, "RuntimeError: PTX compile failed: ptxas error (injected)"),
                                          (_wrong_kernel, "output differs from the eager path by relative RMS 1.0e-02")])
def test_a_broken_kernel_falls_back_once(triton_on_cpu, kernel, cause):
    """A kernel that raises, or computes a wrong answer, fails the first-use check: ``auto``
    runs the eager composition instead (the same numbers), warns once per key naming the
    cause and where to report it, and never calls the kernel outside the check."""
    calls = []
    triton_on_cpu(lambda *a: calls.append(1) or kernel(*a))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 37, 16, generator=g) for _ in range(3))
    with pytest.warns(RuntimeWarning) as seen:
        first = nala_attention(q, k, v)
        second = nala_attention(q, k, v)
        other = nala_attention(q, k, v, direction="relu_split")         # another key: checked once more
    assert torch.equal(first, nala_attention(q, k, v, impl="eager")) and torch.equal(second, first)
    assert torch.equal(other, nala_attention(q, k, v, direction="relu_split", impl="eager"))
    messages = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2 and len(calls) == 2, (messages, calls)    # one check (and warning) per key
    for msg, direction in zip(messages, ("cosine", "relu_split")):
        assert "\n" not in msg and cause in msg and f"head dim 16, {direction}" in msg
        assert "impl='eager'" in msg and "benchmarks/gpu_check.sh" in msg and "issue" in msg
    assert fused._TRITON_CHECKS[("cpu", torch.float32, 16, "cosine")].startswith(cause.split(" by")[0])


def test_a_passing_kernel_is_used_without_a_warning(triton_on_cpu, recwarn):
    """A kernel that agrees with the eager path passes once and then runs every call."""
    calls = []
    triton_on_cpu(lambda *a: calls.append(1) or _eager_kernel(*a) + 0.0)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    nala_attention(q, k, v)
    nala_attention(q, k, v)
    assert len(calls) == 1 + 2 and not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert fused._TRITON_CHECKS == {("cpu", torch.float32, 8, "cosine"): None}


def test_the_check_compares_gradients_too(triton_on_cpu):
    """A kernel whose forward is right and whose backward is wrong fails on the gradient."""
    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    triton_on_cpu(lambda q, k, v, s, o: _eager_kernel(WrongGrad.apply(q), k, v, s, o))
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="dq differs from the eager path"):
        nala_attention(q, k, v)
