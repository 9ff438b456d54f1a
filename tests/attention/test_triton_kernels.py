"""The Triton NaLa kernels (run from here in Triton's interpreter) and ``impl="auto"``.

The kernel cases live in ``tests/attention/triton_cases.py``. Triton reads ``TRITON_INTERPRET`` when a
kernel is defined, so setting it inside this process would be too late (and would leak
into every other test): the cases run in a subprocess with the variable set.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import nala_dit.attention.nala.backend as backend
import nala_dit.attention.nala.fused as fused
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
    odd N (1, 17, 1,025 among them), both directions, head dims 16/24/32/40/48/64/72/96/128
    (each as its two tiles; one padded tile in the GPU A/B's baseline kernels,
    ``benchmarks/baseline_nala.py``), exact zeros, strided inputs, several token ranges,
    non-default constants, a per-head norm scale; the baseline kernels too."""
    stdout = run_cases({"TRITON_INTERPRET": "1"})
    assert " passed" in stdout and "failed" not in stdout
    # Everything except the CUDA-only cases (long N, the autocast layer) ran.
    assert "43 passed" in stdout, stdout[-2000:]


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
    limit = backend.TRITON_MAX_TOKENS  # 65535 token blocks of 16
    assert select_nala_impl("cuda", 64, torch.bfloat16, True, num_tokens=limit) == "triton"
    assert select_nala_impl("cuda", 64, torch.bfloat16, True, num_tokens=limit + 1) == "eager"


def test_auto_follows_the_selection(monkeypatch):
    """``nala_attention(impl="auto")`` runs whatever ``select_nala_impl`` names."""
    q, k, v = (torch.randn(1, 2, 17, 16) for _ in range(3))
    seen = []
    monkeypatch.setattr(backend, "select_nala_impl", lambda *a: seen.append(a) or "eager")
    out = nala_attention(q, k, v)
    assert seen == [("cpu", 16, torch.float32, backend.triton_available(), 17)]
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
    launches, at the presets' head dims (64: S, B, L, tiles of 32 + 32; 72: XL, 64 + 16),
    bf16 and fp16, cosine, lowers to PTX for sm_90a, passes the ptxas that Triton ships and
    disassembles, without a GPU (about 1-3 min on a cold Triton cache). What the report says
    is held: two programs per SM (registers, allocated per warp, and shared memory; 8 warps
    at ≤ 128 registers, 4 warps at ≤ 255) with no spill and no local memory; output, dq and
    dkv on wgmma (HGMMA) only, no mma.sync; the state passes on wgmma at D = 72 (mma.sync for
    the 16 × 16 S[b,b] blocks) and on mma.sync alone at D = 64 (32-row tiles: wgmma needs
    64); sin, cos, log (the half-precision mode's approximations), exp2, rcp, sqrt on the
    MUFU unit. ``benchmarks/triton_compile_check.py`` prints the table."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from triton_compile_check import report

    mma_sync = {64: {"state", "dstate"}, 72: set()}      # kernels without wgmma
    for d in (64, 72):
        for dtype in ("bf16", "fp16"):
            rows = {label: r for label, warps, r in report(d, dtype, "cosine", "fused")}
            assert list(rows) == ["forward", "state", "output", "dq", "dstate", "dkv"]
            for label, r in rows.items():
                case = (d, dtype, label, r)
                assert r["programs_per_sm"] >= 2 and r["spill_bytes"] == 0 and r["local"] == 0, case
                assert {"SIN", "COS", "LG2", "EX2", "RCP", "SQRT"} <= set(r["mufu"]), case
                assert (r["hgmma"] > 0) == (label not in mma_sync[d]), case
            for label in ("output", "dq", "dkv"):
                assert rows[label]["hmma"] == 0, (d, dtype, label, rows[label])     # no mma.sync fallback


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_features_are_kept_for_bf16_products_only():
    """``keep_features`` (default on) keeps φ_q and φ_k where the products are bf16 (bf16 and
    fp16 inputs, the interpreter's ``bf16_exact``), never for fp32 inputs (TF32 or exact
    products); the buffers are (B·H, N, 2D) bf16, for fp16 inputs too."""
    from nala_dit.attention.nala.triton.launch import feature_buffers, keeps_features

    for precision, keep in (("bf16", True), ("bf16_exact", True), ("tf32", False), ("ieee", False)):
        assert keeps_features(dict(precision=precision)) is keep
        assert keeps_features(dict(precision=precision, keep_features=False)) is False
    q = torch.empty(2, 3, 5, 72, dtype=torch.float16)
    phi_q, phi_k = feature_buffers(q, dict(precision="bf16"))
    assert phi_q.shape == phi_k.shape == (6, 5, 144) and phi_q.dtype == phi_k.dtype == torch.bfloat16
    assert feature_buffers(q, dict(precision="bf16", keep_features=False)) is None
    assert feature_buffers(q, dict(precision="bf16"), backward=False) is None      # no gradient: none written
    assert feature_buffers(q.float(), dict(precision="tf32")) is None


def test_kept_features_evaluate_fewer_feature_maps():
    """The committed compile report (``benchmarks/results/triton_launches_sm90.json``, sm_90a,
    bf16) has both backward forms: the gated layer's launches keep the features (the default),
    NaLa alone is launched without feature buffers and recomputes them. Counted there, per
    kernel and width (S/2 and XL/2), in MUFU operations: the recomputing dq, query state pass
    and dkv evaluate the feature map (sin, cos, log, exp); with kept features the query state
    pass evaluates nothing of it, dkv only tanh(α k̂) (exp), dq tanh and log|q̂| but no sin or
    cos and fewer log and exp; the forward kernels, which store them, evaluate φ."""
    rows = json.loads((ROOT / "benchmarks" / "results" / "triton_launches_sm90.json").read_text())["rows"]
    feature_ops = {"SIN", "COS", "LG2", "EX2"}

    def row(width, who, n, kernel, query=None):
        found = [r for r in rows if r["width"] == width and r["dtype"] == "bf16"
                 and r["specialisation"].split()[:3] == [who, f"N={n}:", kernel]
                 and (query is None or f"QUERY={query}" in r["specialisation"])]
        assert len(found) == 1, (width, who, n, kernel, found)
        return found[0]["mufu"]

    for width in (384, 1152):
        recomputed = {k: row(width, "NaLa", 256, f"_{k}_kernel") for k in ("dq", "dkv")}
        kept = {k: row(width, "gated", 256, f"_{k}_kernel") for k in ("dq", "dkv")}
        for n in (256, 1056):
            recomputed[f"dstate {n}"] = row(width, "NaLa", n, "_state_kernel", query=1)
            kept[f"dstate {n}"] = row(width, "gated", n, "_state_kernel", query=1)
        for name, mufu in recomputed.items():
            assert feature_ops <= set(mufu), (width, name, mufu)
        for n in (256, 1056):
            assert not feature_ops & set(kept[f"dstate {n}"]), (width, n, kept)
        assert not {"SIN", "COS", "LG2"} & set(kept["dkv"]) and kept["dkv"]["EX2"] > 0, (width, kept["dkv"])
        assert not {"SIN", "COS"} & set(kept["dq"]), (width, kept["dq"])
        for op in ("LG2", "EX2"):
            assert 0 < kept["dq"][op] < recomputed["dq"][op], (width, op, kept["dq"], recomputed["dq"])
        assert feature_ops <= set(row(width, "gated", 256, "_forward_kernel")), width
        assert feature_ops <= set(row(width, "gated", 1056, "_output_kernel")), width


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_programs_per_sm():
    """The compile report's occupancy arithmetic (sm_90): registers allocated per warp in
    units of 256 (per thread: a multiple of 8), 64 K per SM; shared memory 228 KB per SM
    with 1 KB reserved per program, at most 227 KB per program; 64 warps, 32 programs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from triton_compile_check import occupancy

    def programs(regs, warps, shared=0):
        return occupancy(regs, warps, shared)["programs_per_sm"]

    assert programs(128, 8) == 2 and programs(129, 8) == 1          # 129 → 136 per thread: 15 warps
    assert programs(255, 4) == 2 and programs(168, 4) == 3
    assert programs(170, 4) == 2                                     # 176 per thread: 11 warps, not 12
    assert programs(32, 4) == 16 and programs(16, 1) == 32           # warp slots, then program slots
    assert programs(64, 4, 113 * 1024) == 2 and programs(64, 4, 114 * 1024) == 1   # (114 + 1) KB × 2 > 228 KB
    assert occupancy(255, 8, 126 * 1024) == dict(programs_by_registers=1, programs_by_shared=1, programs_per_sm=1)
    assert programs(64, 4, 228 * 1024) == 0 and programs(256, 1) == 0   # cannot launch


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_gated_epilogue_kernels_compile_for_hopper_without_spills():
    """The gated layer's three epilogue kernels (``nala/triton/gated.py``) at S/2's and XL/2's
    hidden sizes, bf16 and fp16, sm_90a: no register spills, no local memory, at least two
    programs per SM (measured: 48-96 registers; with the LePE taps unrolled fp16 took 138-255
    registers, one program per SM, and spilled up to 364 B)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from triton_compile_check import gated_report

    for channels, dtype in ((384, "bf16"), (1152, "bf16"), (1152, "fp16")):
        rows = gated_report(channels, dtype)
        assert [label for label, _, _ in rows] == ["epilogue", "norm_bwd", "lepe_bwd"]
        for label, warps, r in rows:
            assert r["spill_bytes"] == 0 and r["local"] == 0 and r["programs_per_sm"] >= 2, (channels, dtype, label, r)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_head_dim_tiles():
    """Every head dim runs as two tiles (lanes [0, BA) and [BA, BA + BB), both powers of two
    ≥ 16, BA ≥ BB) with the fewest padded lanes: XL/2's 72 as 64 + 16 (80 lanes, not 128),
    the S/B/L presets' 64 as 32 + 32; every value lane in one program."""
    from nala_dit.attention.nala.triton.launch import KINDS, launch_config, split_tiles

    expected = {1: (16, 16), 16: (16, 16), 24: (16, 16), 32: (16, 16), 33: (32, 16), 40: (32, 16), 48: (32, 16),
                49: (32, 32), 64: (32, 32), 65: (64, 16), 72: (64, 16), 80: (64, 16), 88: (64, 32), 96: (64, 32),
                100: (64, 64), 112: (64, 64), 120: (64, 64), 128: (64, 64)}
    assert {d: split_tiles(d) for d in expected} == expected
    for d in range(1, 129):                        # the fewest lanes among all admissible pairs
        ba, bb = split_tiles(d)
        pairs = [(a, b) for a in (16, 32, 64, 128) for b in (16, 32, 64, 128) if b <= a and a + b >= d]
        assert ba >= bb and ba + bb >= d and ba + bb == min(a + b for a, b in pairs), d
    with pytest.raises(ValueError, match="head dim 129"):
        split_tiles(129)
    cfg = launch_config(72)
    assert (cfg["BA"], cfg["BB"]) == (64, 16)
    assert all(cfg[kind]["NV"] == 1 for kind in KINDS)                    # every value lane in one program
    assert launch_config(72, dict(BLOCK_N=16, BV=16, num_warps=4))["dq"] == dict(
        BLOCK_N=16, num_warps=4, num_stages=None, maxnreg=None, NV=1, BC=16)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_previous_launch_configs_stay_reachable():
    """The launch configs before the two-programs-per-SM work, for the GPU sweep's A/B: the
    baseline kernel module (``benchmarks/baseline_nala_kernels.py``) gives them as
    ``{"table": "previous"}`` (no register cap, Triton's stages) and its baseline variant's
    unchanged; the package's own configs differ from the previous ones."""
    from benchmarks import baseline_nala_kernels as old
    from nala_dit.attention.nala.triton.launch import KINDS, launch_config

    def entries(cfg, keys=("BLOCK_N", "BV", "num_warps", "num_stages", "maxnreg")):
        return {kind: tuple(cfg[kind].get(k) for k in keys) for kind in KINDS}

    before = {64: ((32, 64, 8), (32, 64, 8), (64, 64, 8), (32, 64, 8), (32, 64, 8)),
              72: ((16, None, 8), (16, None, 8), (64, None, 8), (64, None, 8), (64, None, 8))}
    for d, rows in before.items():
        assert entries(old.launch_config(d, {"table": "previous"}, "fused")) == {
            kind: (*row, None, None) for kind, row in zip(KINDS, rows)}, d
        assert entries(launch_config(d)) != entries(old.launch_config(d, {"table": "previous"}, "fused")), d
    baseline = {64: (64, 64, 8), 72: (32, 64, 8)}                        # state passes; D = 72 padded to 128
    for d, row in baseline.items():
        cfg = old.launch_config(d)
        assert entries(cfg)["state"] == (*row, None, None) and entries(cfg)["forward"] == entries(cfg)["state"]
        assert all(cfg[kind]["maxnreg"] is None and cfg[kind]["num_stages"] is None for kind in KINDS)
    # The GPU sweep's row for them, as docs/performance.md's table shows it.
    from benchmarks.tables import block_tables

    data = dict(shape=dict(batch=4, heads=16, tokens=4096), dtype="bf16", mode="fwd+bwd", variant="fused", rows=[
        dict(head_dim=72, default={}, ms=2.0), dict(head_dim=72, table="previous", ms=3.0),
        dict(head_dim=72, BLOCK_N=32, BV=32, num_warps=4, ms=1.0)])
    assert block_tables(data)[4:7] == ["| default (launch_config) |  |  | 2.000 | 1.00 |",
                                       "| previous (launch_config) |  |  | 3.000 | 1.50 |",
                                       "| 32 | 32 | 4 | 1.000 | 0.50 |"]


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_unsupported_shapes_are_named():
    from nala_dit.attention.nala.triton.launch import unsupported_reason

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
    from nala_dit.attention.nala.triton import launch as triton_kernels

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
    # The A/B's baseline kernels (before the rework): ranges of at least 512 tokens.
    from benchmarks import baseline_nala_kernels as baseline

    assert baseline.num_splits(4096, 6, 1, cuda) == 8
    assert baseline.num_splits(1024, 16, 1, cuda) == 2
    assert baseline.num_splits(256, 6, 1, cuda) == 1


# ------------------------------------------------------- first-use check and fallback


def _eager_kernel(q, k, v, norm_scale, opts, splits=None):
    return backend._nala_eager_opts(q, k, v, norm_scale, opts)


def _failing_kernel(q, k, v, norm_scale, opts, splits=None):
    raise RuntimeError("PTX compile failed: ptxas error (injected)\nsecond line")


def _wrong_kernel(q, k, v, norm_scale, opts, splits=None):
    return _eager_kernel(q, k, v, norm_scale, opts) * 1.01          # 1 % off: above every tolerance


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """``impl="auto"`` picks "triton" on this CPU, with a fresh check cache; returns a
    function that installs the kernel the check and the calls will run."""
    monkeypatch.setattr(backend, "select_nala_impl", lambda *a: "triton")
    monkeypatch.setattr(backend, "_TRITON_CHECKS", {})
    monkeypatch.setattr(backend, "CHECK_ERRORS", {})
    return lambda kernel: monkeypatch.setattr(backend, "_triton_kernel", kernel)


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
    assert backend._TRITON_CHECKS[("cpu", torch.float32, 16, "cosine")].startswith(cause.split(" by")[0])


def test_first_use_checks_report_each_key_with_its_result(triton_on_cpu, monkeypatch, recwarn):
    """What the GPU benchmarks write beside their times: one row per checked key, "passed" or
    the cause of the fallback (the gated layer's checks too, none here)."""
    from nala_dit.attention import layers

    monkeypatch.setattr(layers, "_GATED_CHECKS", {})
    assert layers.first_use_checks() == []
    triton_on_cpu(_eager_kernel)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    nala_attention(q, k, v)
    triton_on_cpu(_failing_kernel)
    nala_attention(q, k, v, direction="relu_split")
    assert layers.first_use_checks() == [
        dict(path="NaLa kernels", device="cpu", dtype="float32", head_dim=8, direction="cosine", result="passed",
             max_rel_rms=0.0),
        dict(path="NaLa kernels", device="cpu", dtype="float32", head_dim=8, direction="relu_split",
             result="RuntimeError: PTX compile failed: ptxas error (injected)", max_rel_rms=None)]


def test_a_passing_kernel_is_used_without_a_warning(triton_on_cpu, recwarn):
    """A kernel that agrees with the eager path passes once and then runs every call."""
    calls = []
    triton_on_cpu(lambda *a: calls.append(1) or _eager_kernel(*a) + 0.0)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    nala_attention(q, k, v)
    nala_attention(q, k, v)
    checks = len(backend.CHECK_CASES)
    assert len(calls) == checks + 2 and not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert backend._TRITON_CHECKS == {("cpu", torch.float32, 8, "cosine"): None}


def test_the_check_runs_one_and_several_token_ranges(triton_on_cpu, recwarn):
    """The check runs what a GPU launches: N < 1,024 in one token range (the single-launch
    forward) and N ≥ 1,024 in several (the atomic state passes, the output kernel); each
    token count odd. The largest relative RMS it saw is kept; a kernel wrong only on the
    long case (a several-range bug) fails the check there."""
    seen = []
    triton_on_cpu(lambda q, k, v, s, o, splits=None: seen.append((q.shape[-2], splits)) or _eager_kernel(q, k, v, s, o))
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    nala_attention(q, k, v)
    assert seen[:2] == [(67, None), (1031, 3)] and all(n % 2 for n, _ in seen[:2])
    assert backend.CHECK_ERRORS[("cpu", torch.float32, 8, "cosine")] <= 1e-6

    def wrong_when_split(q, k, v, s, o, splits=None):
        out = _eager_kernel(q, k, v, s, o)
        return out * 1.01 if splits else out
    triton_on_cpu(wrong_when_split)
    with pytest.warns(RuntimeWarning, match=r"output differs from the eager path by relative RMS 1.0e-02 \(> 1e-04\) "
                                            r"at N = 1031"):
        nala_attention(q, k, v, direction="relu_split")


def test_a_sticky_cuda_fault_ends_the_process_with_one_line(triton_on_cpu, monkeypatch):
    """A kernel error after which the device runs nothing more (a sticky CUDA fault) would
    kill the eager fallback too: the check ends the process with one line naming what ran
    (no traceback: SystemExit with the message). A device that still works falls back."""
    triton_on_cpu(lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("CUDA error: an illegal memory access was "
                                                                      "encountered\nmore")))
    monkeypatch.setattr(backend, "device_usable", lambda device: False)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    with pytest.raises(SystemExit) as ended:
        nala_attention(q, k, v)
    msg = str(ended.value)
    assert "\n" not in msg and "sticky CUDA fault" in msg and "an illegal memory access" in msg
    assert "first-use check (N = 67, one token range, torch.float32, head dim 8, cosine)" in msg
    monkeypatch.setattr(backend, "device_usable", lambda device: True)
    monkeypatch.setattr(backend, "_TRITON_CHECKS", {})
    with pytest.warns(RuntimeWarning, match="illegal memory access"):
        assert torch.equal(nala_attention(q, k, v), nala_attention(q, k, v, impl="eager"))


def test_the_check_compares_gradients_too(triton_on_cpu):
    """A kernel whose forward is right and whose backward is wrong fails on the gradient."""
    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    triton_on_cpu(lambda q, k, v, s, o, splits=None: _eager_kernel(WrongGrad.apply(q), k, v, s, o))
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="dq differs from the eager path"):
        nala_attention(q, k, v)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_grids_fit_cuda_at_every_supported_length():
    """Every grid one gated layer launches (NaLa's kernels and the epilogue's, as the launches
    compute them) at XL/2's, G/2's and H/2's widths up to the longest N the kernels take: axes
    after the first ≤ 65,535 (CUDA's limit; the epilogue's token axis was N at widths above
    1,024, so 4096 px failed), the first ≤ 2³¹ − 1; and the element offsets that the kernels
    form in int64 do pass 2³¹ there (the gated stride 4C)."""
    from nala_dit.attention.nala.triton import gated as tg
    from nala_dit.attention.nala.triton import launch as tk
    from nala_dit.attention.config import TRITON_MAX_TOKENS

    assert TRITON_MAX_TOKENS == 1_048_560
    for c, heads in ((1152, 16), (1408, 16), (2240, 20)):
        cfg = tk.launch_config(c // heads)
        for n in (65_536, TRITON_MAX_TOKENS):
            for b in (1, 32):
                grids = dict(tg.launch_grids(b, n, c))
                for splits in (1, n // tk.MIN_SPLIT_TOKENS):
                    grids.update({f"{k} ({splits} ranges)": g for k, g in tk.launch_grids(b, heads, n, cfg, splits).items()})
                for name, grid in grids.items():
                    assert grid[0] <= 2**31 - 1 and all(axis <= 65_535 for axis in grid[1:]), (c, n, b, name, grid)
                    assert all(axis >= 1 for axis in grid), (c, n, b, name, grid)
        # the epilogue covers every token of every batch element once: B · ⌈N / BLOCK_T⌉ programs
        block_t = tg._blocks(c)[0]
        assert block_t == 1 and tg.launch_grids(3, 65_536, c)["epilogue"] == (3 * 65_536,)
        assert tg.launch_grids(3, 65_536, c)["lepe_backward"] == (3 * 1024, -(-c // tg.LEPE_BLOCK_C))
        assert (TRITON_MAX_TOKENS - 1) * 4 * c > 2**31 - 1        # why the token offsets are int64


def test_the_gated_check_covers_several_ranges_and_ends_on_a_sticky_fault(monkeypatch):
    """The gated layer's first-use check: on CUDA a second grid of ≥ 1,024 tokens (several
    token ranges); a kernel error with the device still usable is a fallback cause, one that
    leaves it unusable ends the process in one line naming the check (injected on this CPU)."""
    from nala_dit.attention import layers
    from nala_dit.attention.config import NaLaConfig

    (h0, w0), (h1, w1) = layers.GATED_CHECK_GRIDS
    assert h0 * w0 < 1024 <= h1 * w1
    monkeypatch.setattr(layers.GatedLinearAttention, "backend", lambda self, q: ("triton", True))
    monkeypatch.setattr(layers.GatedLinearAttention, "triton_middle",
                        lambda self, qkvg, grid: (_ for _ in ()).throw(RuntimeError("CUDA error: unspecified launch "
                                                                                     "failure\nmore")))
    cpu = torch.device("cpu")
    assert layers._check_gated(cpu, torch.float32, 32, 2, NaLaConfig()) == \
        "RuntimeError: CUDA error: unspecified launch failure"
    monkeypatch.setattr(backend, "device_usable", lambda device: False)
    with pytest.raises(SystemExit) as ended:
        layers._check_gated(cpu, torch.float32, 32, 2, NaLaConfig())
    msg = str(ended.value)
    assert "\n" not in msg and "sticky CUDA fault" in msg and "unspecified launch failure" in msg
    assert "the gated layer's first-use check (3 × 5 tokens, torch.float32, width 32, 2 heads)" in msg


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_every_launched_specialisation_compiles_without_fenced_atomics():
    """Every kernel specialisation an XL/2 training step launches (NaLa alone and the gated
    layer, N = 256 in one token range and N = 1,056 in several, bf16), compiled for sm_90a
    through the real launch functions with the real shapes and strides (a stand-in driver,
    no GPU): the strided q/k/v, DQ_STRIDED, ADD_DV, fp32 output-gradient and atomic
    state-pass variants all among them; none with a fenced atomic (PTX: no membar, no
    acq_rel/acquire/release atom or red, as Triton's default sem gave the LePE and norm
    backward: 200 acq_rel atomics in the LePE backward at C = 1,152) and no MEMBAR in SASS;
    every one at ≥ 2 programs per SM with no spill (measured: 46-255 registers). About 2-4
    min of compiling on a cold Triton cache."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from triton_compile_check import launched_report, run_launches, stand_in_launches

    with stand_in_launches() as launched:
        run_launches(launched, 1152, 16)
    rows = dict(launched_report(launched))
    kernels = {label.split(": ")[1].split()[0] for label in rows}
    assert kernels == {"_forward_kernel", "_state_kernel", "_output_kernel", "_dq_kernel",
                       "_dkv_kernel", "_epilogue_kernel", "_norm_backward_kernel", "_lepe_backward_kernel"}
    text = "\n".join(rows)
    for variant in ("DQ_STRIDED=1", "DQ_STRIDED=0", "ADD_DV=1", "ADD_DV=0", "QUERY=0 ATOMIC=1", "QUERY=1 ATOMIC=1",
                    "G fp32", "gated N=1056: _output_kernel", "NaLa N=256: _forward_kernel"):
        assert variant in text, (variant, text)
    for label, r in rows.items():
        assert r["ptx_fenced"] == 0 and r["membar"] == 0, (label, r)
        assert r["spill_bytes"] == 0 and r["local"] == 0 and r["programs_per_sm"] >= 2, (label, r)
        assert (r["ptx_atomics"] > 0) == ("ATOMIC=1" in label or "backward_kernel" in label), (label, r)


@pytest.mark.parametrize("forced", [None, "eager"])
def test_each_layer_chooses_once_per_key(monkeypatch, forced):
    """A tiny NaLaDiT (3 gated NaLa layers): the first forward + backward calls the selection
    exactly once per layer, the second none (each layer keeps its choice); a new dtype
    (bf16 autocast) is a new key, once more per layer. Each layer runs what the selection
    named for its key: ``fused`` on this CPU, or a forced ``eager`` (and then the numbers of
    the same gradients), never choosing again inside ``nala_attention``."""
    import nala_dit.attention.recompute as recompute
    from nala_dit.attention.layers import GatedLinearAttention
    from nala_dit.models.dit import DiT

    seen = []
    select = backend.select_nala_impl
    monkeypatch.setattr(backend, "select_nala_impl", lambda *a: seen.append(a) or (forced or select(*a)))
    torch.manual_seed(0)
    model = DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=3, num_heads=2, num_classes=4,
                attention="nala")
    layers = [m for m in model.modules() if isinstance(m, GatedLinearAttention)]
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3.0, 500.0]), torch.tensor([0, 3])

    def step():
        model.zero_grad()
        model(x, t, y).square().mean().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    grads = step()
    assert len(layers) == 3 and seen == [("cpu", 16, torch.float32, backend.triton_available(), 16)] * 3
    name = forced or select("cpu", 16, torch.float32, backend.triton_available(), 16)
    assert name == ("eager" if forced else "fused")
    assert [layer._backends for layer in layers] == [{(torch.device("cpu"), torch.float32, True): (name, False)}] * 3
    step()
    assert len(seen) == 3                                   # the second step chooses nothing
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step()
    assert len(seen) == 6 and seen[3:] == [("cpu", 16, torch.bfloat16, backend.triton_available(), 16)] * 3
    runs, fused_runs = [], []   # the layers run what they chose: the eager composition, or the fused passes
    eager, fused_state = backend._nala_eager, recompute.fused_state
    monkeypatch.setattr(backend, "_nala_eager", lambda *a: runs.append(1) or eager(*a))
    monkeypatch.setattr(recompute, "fused_state", lambda *a: fused_runs.append(1) or fused_state(*a))
    torch.testing.assert_close(step(), grads, rtol=1e-5, atol=1e-7)
    assert (len(runs), len(fused_runs)) == ((3, 0) if forced else (0, 3))
