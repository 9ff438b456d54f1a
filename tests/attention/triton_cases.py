"""The Triton NaLa kernels against the quadratic reference (NALA_SPEC.md §5).

Not collected by a plain ``pytest`` run (the name does not start with ``test_``):
Triton's interpreter must be switched on before the kernels are defined, so
``tests/attention/test_triton_kernels.py`` runs this file in a subprocess with ``TRITON_INTERPRET=1``
(CPU tensors; bf16/fp16 inputs are loaded and cast to fp32, so the interpreter takes them
too), and ``benchmarks/gpu_check.sh`` runs it on CUDA (plus the long-N and layer cases):

    TRITON_INTERPRET=1 python -m pytest -q tests/attention/triton_cases.py     # CPU, interpreter
    python -m pytest -q tests/attention/triton_cases.py                        # CUDA

Tolerances: fp32 relative RMS ≤ 1e-5 (outputs and gradients of q, k, v, s); bf16 inputs
against the fp32 reference on the same rounded inputs ≤ 1e-2 (bf16 rounding is 2^-8).
"""

import os

import pytest
import torch

from nala_dit.attention import nala_attention, nala_attention_reference
from tests.utils import assert_close, record_results, rel_rms

pytest.importorskip("triton", reason="Triton is not installed")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)

from benchmarks import baseline_nala_kernels as baseline  # noqa: E402  (the GPU A/B's kernels before the rework)
from nala_dit.attention.nala.triton import launch as triton_kernels  # noqa: E402  (after the environment check above)

DEVICE = "cpu" if INTERPRET else "cuda"
FP32_TOL = 1e-5
BF16_TOL = 1e-2
cuda_only = pytest.mark.skipif(INTERPRET, reason="CUDA only: N = 8192 is too slow for the interpreter, and impl='auto' picks Triton for CUDA tensors only")


def qkv(b=1, h=2, n=63, d=32, scale=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, h, n, d, generator=g) * scale).to(DEVICE, dtype) for _ in range(3)]


def compare(q, k, v, tol, splits=None, norm_scale=1.0, variant=None, **kw):
    """Triton kernels vs the quadratic reference on the same inputs: outputs and the
    gradients of q, k, v (and of a tensor norm scale) for a random output gradient.
    ``variant`` "baseline": the GPU A/B's kernels before the rework (``benchmarks/baseline_nala.py``)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if isinstance(norm_scale, torch.Tensor):
        leaves.append(norm_scale.detach().requires_grad_())
    opts = dict(direction="cosine", power=3.0, offset=0.5, alpha=20.0, norm_eps=1e-6, eps=1e-6)
    opts.update(kw)
    scale = leaves[3] if len(leaves) == 4 else norm_scale
    kernels = baseline if variant == "baseline" else triton_kernels
    out = kernels.nala_attention_triton(*leaves[:3], scale, opts, splits=splits)
    assert out.dtype == v.dtype and out.shape == v.shape
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = torch.autograd.grad(out.float(), leaves, g_out)

    ref_leaves = [t.detach().float().clone().requires_grad_() for t in leaves]
    if len(leaves) == 4:  # per-head s broadcast against the (B, H, N, 1) query norms
        ref_scale = ref_leaves[3].view(1, -1, 1, 1)
    else:
        ref_scale = norm_scale
    ref = nala_attention_reference(*ref_leaves[:3], norm_scale=ref_scale, **kw)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g_out)
    assert_close("output", ref, out.float(), tol)
    for name, g_ref, g in zip(["q", "k", "v", "s"], ref_grads, grads):
        assert g.dtype == leaves["qkvs".index(name)].dtype
        assert_close(f"grad {name}", g_ref, g.float(), tol)


def spy_kernels(monkeypatch, record):
    """Every kernel of ``triton_kernels.KERNELS``, and the baseline
    module's (looked up by name there), wrapped so that each launch first calls
    ``record(kernel name, launch keywords)``."""
    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **kw: record(self.kernel.__name__, kw) or self.kernel[grid](*a, **kw)

    for kind, kernel in list(triton_kernels.KERNELS.items()):
        monkeypatch.setitem(triton_kernels.KERNELS, kind, Spy(kernel))
    for name in [n for n in dir(baseline) if n.endswith(("_kernel", "_kernel_split"))]:
        monkeypatch.setattr(baseline, name, Spy(getattr(baseline, name)))


def test_kernels_are_interpreted_exactly_when_asked():
    assert triton_kernels.INTERPRETED == INTERPRET


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
@pytest.mark.parametrize("n,d", [(63, 32), (65, 72), (33, 64)])
def test_fp32_matches_reference(direction, n, d):
    compare(*qkv(n=n, d=d), FP32_TOL, direction=direction)


# The interpreter takes 20-50 s per N = 1,025 case: those run on the fused variant only.
@pytest.mark.parametrize("variant,n,d,splits", [
    *[(variant, *case) for variant in ("fused", "baseline")
      for case in ((1, 72, None), (1, 128, 1), (17, 128, None), (97, 72, 2))],
    ("fused", 1025, 72, None), ("fused", 1025, 72, 4)])
def test_odd_lengths_and_dit_head_dims(variant, n, d, splits):
    """N = 1, 17, 97, 1,025 at head dims 72 (XL/2's) and 128, the kernels and the A/B's baseline:
    one token range (the single-launch forward) and several (the in-kernel atomic reduction;
    the baseline's partial sums), against the reference.
    At N = 1 the output is v·x/(x + ε) with x = φ_q·φ_k: with ε = 1e-6 the gradients of q
    and k are ε-sized differences of terms ~10⁴ times larger, which no fp32 computation
    (the CPU fused path included: 2e-3 to 9e-3 measured) holds to 1e-5; ε = 0.5 makes them
    well-conditioned and the same 1e-5 applies."""
    compare(*qkv(h=1, n=n, d=d, seed=n + d), FP32_TOL, splits=splits, variant=variant,
            eps=0.5 if n == 1 else 1e-6)


def test_single_launch_and_atomic_paths_are_the_ones_run(monkeypatch):
    """The kernels run one forward kernel for one token range and the atomic state kernel
    (no partial buffer, no sum) for several; the A/B's baseline runs neither."""
    seen = []
    spy_kernels(monkeypatch, lambda name, kw: seen.append((name, kw.get("ATOMIC"))))
    q, k, v = qkv(n=70, d=16)
    opts = dict(direction="cosine", power=3.0, offset=0.5, alpha=20.0, norm_eps=1e-6, eps=1e-6)
    runs = {}
    for variant, splits in (("fused", None), ("fused", 3), ("baseline", 3)):
        seen.clear()
        kernels = baseline if variant == "baseline" else triton_kernels
        runs[variant, splits] = kernels.nala_attention_triton(q, k, v, 1.0, opts, splits=splits)
        runs[variant, splits, "launches"] = list(seen)
    assert runs["fused", None, "launches"] == [("_forward_kernel", None)]
    assert runs["fused", 3, "launches"] == [("_state_kernel", True), ("_output_kernel", None)]
    assert runs["baseline", 3, "launches"] == [("_state_kernel", False), ("_output_kernel", None)]
    assert_close("fused vs baseline", runs["baseline", 3], runs["fused", None], FP32_TOL)


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
@pytest.mark.parametrize("n,d,splits", [(97, 48, 2), (17, 96, None)])
def test_other_head_dims(direction, n, d, splits):
    """Head dims other than the presets' (48 = 32 + 16 with no masked lane, 96 = 64 + 32):
    exact zeros in both tiles and a zero token, so that the row reductions (norms) that
    span the tiles meet 0 too; one token range and two."""
    q, k, v = qkv(n=n, d=d, seed=d)
    q[..., ::5] = 0.0
    k[..., d - 3:] = 0.0
    q[:, :, 4] = 0.0
    k[:, :, 6] = 0.0
    compare(q, k, v, FP32_TOL, splits=splits, direction=direction)


def test_head_dims_run_as_their_tiles(monkeypatch):
    """Every launch, forward and backward, one token range and several, takes the head dim
    as the two tiles ``split_tiles`` gives: D = 64 (S/B/L presets) as 32 + 32, D = 72
    (XL) as 64 + 16; the dkv kernel among the launches."""
    seen = []
    spy_kernels(monkeypatch, lambda name, kw: seen.append((name, kw["BA"], kw["BB"])))
    opts = dict(direction="cosine", power=3.0, offset=0.5, alpha=20.0, norm_eps=1e-6, eps=1e-6)
    for d, splits, tiles in ((72, None, (64, 16)), (72, 2, (64, 16)), (64, None, (32, 32))):
        seen.clear()
        q, k, v = (t.requires_grad_() for t in qkv(h=1, n=70, d=d))
        triton_kernels.nala_attention_triton(q, k, v, 1.0, opts, splits=splits).sum().backward()
        assert seen and all((ba, bb) == tiles for _, ba, bb in seen), (d, splits, seen)
        assert "_dkv_kernel" in [name for name, *_ in seen]


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_exact_zeros(direction):
    """Zero coordinates (0^p and its gradient, both finite), whole zero tokens in q and k,
    and a head dim (24) that is not a power of two."""
    q, k, v = qkv(b=2, n=47, d=24)
    q[..., ::3] = 0.0
    k[..., 1::3] = 0.0
    q[:, :, 5] = 0.0
    k[:, :, 7] = 0.0
    compare(q, k, v, FP32_TOL, direction=direction)


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_options_splits_and_strides(direction):
    """Non-default λ, τ, s, α, ε; the state summed over 3 token ranges (a ragged last
    one); q, k, v as strided views of one (B, N, 3, H, D) projection, as the layer has."""
    b, n, h, d = 2, 161, 3, 40
    g = torch.Generator().manual_seed(3)
    qkv_proj = torch.randn(b, n, 3, h, d, generator=g).to(DEVICE)
    q, k, v = qkv_proj.permute(2, 0, 3, 1, 4)                      # each (B, H, N, D), strided
    assert not q.is_contiguous()
    compare(q, k, v, FP32_TOL, splits=3, direction=direction, power=2.5, offset=0.7,
            norm_scale=3.0, alpha=5.0, eps=1e-4)


@pytest.mark.parametrize("config,d", [(dict(BLOCK_N=16, num_warps=4), 40), (dict(BC=16, BLOCK_N=16), 72)])
def test_other_block_sizes(config, d):
    """Other block sizes (``benchmarks/triton_configs.py`` sweeps them) compute the same thing
    as the defaults (which take 64-token blocks, more than N here): token blocks of 16 in
    every kernel, and the GPU's feature chunks of 16 lanes (5 at D = 72, the last one half
    masked) with its 16-token state blocks (under the interpreter the other cases take wider
    ones, ``launch.SPLIT_CHUNK``)."""
    q, k, v = (t.requires_grad_() for t in qkv(n=45, d=d))
    opts = dict(direction="cosine", power=3.0, offset=0.5, alpha=20.0, norm_eps=1e-6, eps=1e-6)
    results = []
    for cfg in (None, config):
        out = triton_kernels.nala_attention_triton(q, k, v, 1.0, opts, config=cfg)
        results.append([out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))])
    for name, ref, got in zip(["output", "grad q", "grad k", "grad v"], *results):
        assert_close(name, ref, got, FP32_TOL)


def test_tf32_products_are_rounded_not_truncated():
    """The TF32 path of half inputs, on fp32 inputs so the rounding is the only error:
    within TF32 precision of the reference (measured 3.6e-4 / 4.4e-4) and unbiased --
    tensor-core truncation alone would shrink the output by 1.4e-3 (measured)."""
    q, k, v = (t.requires_grad_() for t in qkv(n=129, d=64))
    opts = dict(direction="cosine", power=3.0, offset=0.5, alpha=20.0, norm_eps=1e-6, eps=1e-6)
    out = triton_kernels.nala_attention_triton(q, k, v, 1.0, dict(opts, precision="tf32"))
    ref = nala_attention_reference(q, k, v)
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = torch.autograd.grad(out, (q, k, v), g_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g_out)
    assert_close("output", ref, out, 1e-3)
    for name, g_ref, g in zip("qkv", ref_grads, grads):
        assert_close(f"grad {name}", g_ref, g, 1e-3)
    assert abs((out.norm() / ref.norm()).item() - 1) < 1e-4, "TF32 products are biased"


@pytest.mark.parametrize("d", [64, 72])
def test_bf16_products_error(d):
    """The half-precision path's products (bf16 operands, fp32 accumulation; the fp32 state
    cast to bf16 as it enters each product), on fp32 inputs so that they are the only
    error: within the bf16 budget of the reference (measured 2.8e-3 to 3.6e-3 at D = 64
    and 72, N = 129) and nearly unbiased (output norm within 3e-4, measured), and above
    TF32's error (3.5e-4), so the rounding is really applied. ``bf16_exact`` is the
    interpreter's form of the GPU's ``bf16`` (the same operands, exact functions)."""
    q, k, v = (t.requires_grad_() for t in qkv(n=129, d=d))
    opts = dict(direction="cosine", power=3.0, offset=0.5, alpha=20.0, norm_eps=1e-6, eps=1e-6)
    precision = "bf16_exact" if INTERPRET else "bf16"
    out = triton_kernels.nala_attention_triton(q, k, v, 1.0, dict(opts, precision=precision))
    ref = nala_attention_reference(q, k, v)
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = torch.autograd.grad(out, (q, k, v), g_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g_out)
    for name, r, got in zip(["output", "grad q", "grad k", "grad v"], [ref, *ref_grads], [out, *grads]):
        assert_close(name, r, got, BF16_TOL)
        assert rel_rms(r, got) > 1e-3, f"{name}: no bf16 rounding seen"
    assert abs((out.norm() / ref.norm()).item() - 1) < 1e-3, "bf16 products are biased"


def test_learned_per_head_scale_gradient():
    """A per-head norm scale s (as a learned s = exp(ρ) gives) and its gradient."""
    s = torch.tensor([0.5, 2.0, 8.0], device=DEVICE)
    compare(*qkv(h=3, n=31, d=32, scale=0.5), FP32_TOL, norm_scale=s)


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_huge_inputs_finite(direction):
    """|x| ≈ 1e3 (|k|³ ≈ 1e9 and more): finite, and equal to the fused path (itself held to the
    float64 reference at these inputs in test_nala.py) within fp32 rounding."""
    q, k, v = (t.requires_grad_() for t in qkv(n=33, d=32, scale=1e3))
    out = nala_attention(q, k, v, direction=direction, impl="triton")
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = nala_attention(q2, k2, v2, direction=direction, impl="fused")
    assert_close("huge output", ref, out, FP32_TOL)
    for name, g_ref, g in zip("qkv", torch.autograd.grad(ref.sum(), (q2, k2, v2)), grads):
        assert_close(f"huge grad {name}", g_ref, g, FP32_TOL)


def test_impl_triton_matches_fused():
    """Through ``nala_attention``: the kernels and the CPU-style fused path agree."""
    q, k, v = qkv(n=50, d=64)
    a = nala_attention(q, k, v, impl="triton")
    b = nala_attention(q, k, v, impl="fused")
    assert_close("triton vs fused", b, a, FP32_TOL)


def test_authors_preset_matches_the_released_formula():
    """``NaLaConfig.authors()`` through the kernels (rope off: rope runs the eager numerator
    path only, never the kernels) against the released layer's formula in float64, written
    independently in test_authors.py: outputs and gradients, fp32 relative RMS ≤ 1e-5."""
    from nala_dit.attention import NaLaConfig
    from tests.attention.test_authors import released_reference

    leaves = [t.requires_grad_() for t in qkv(b=2, n=35, d=16, seed=4)]
    out = nala_attention(*leaves, NaLaConfig.authors(rope=False), impl="triton")
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    ref = released_reference(*ref_leaves, (5, 7), rope=False)
    assert_close("authors triton", ref.float(), out.cpu(), FP32_TOL)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
    for name, g_ref, g in zip("qkv", ref_grads, grads):
        assert_close(f"authors triton: grad {name}", g_ref.float(), g.cpu(), FP32_TOL)


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(direction, dtype):
    """bf16/fp16 loads and stores, and the TF32 product path they take. The kernels do no
    half-precision arithmetic (loads are cast to fp32 first), so the interpreter runs
    these too; on CUDA they also check the tensor-core products."""
    n, d = (31, 40) if INTERPRET else (257, 72)     # the interpreter is slow; the dtype path is the same
    compare(*qkv(n=n, d=d, dtype=dtype), BF16_TOL, direction=direction)


@pytest.mark.parametrize("d,direction,n,splits", [(64, "cosine", 70, None), (72, "relu_split", 97, 2)])
def test_kept_features_match_recomputed_ones(monkeypatch, d, direction, n, splits):
    """bf16 inputs: the forward's stored φ_q and φ_k (``keep_features``, the default) against
    the recomputing backward (``keep_features=False``), one token range and two (the atomic
    state passes, which store and read φ range by range). The products see the same bf16
    features either way, so the output and ∂L/∂v agree to fp32 rounding; ∂L/∂q and ∂L/∂k
    take the chain rule's elementwise terms from the rounded φ (2.4e-3 to 2.9e-3 apart,
    measured); both within the bf16 budget of the fp32 reference. Under ``torch.no_grad`` no
    features are written (no backward will read them)."""
    kept = record_results(monkeypatch, triton_kernels, "feature_buffers", lambda out: out is not None)
    leaves = [t.requires_grad_() for t in qkv(n=n, d=d, seed=d, dtype=torch.bfloat16)]
    g_out = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    opts = dict(direction=direction, power=3.0, offset=0.5, alpha=20.0, norm_eps=1e-6, eps=1e-6)
    runs = {}
    for keep in (True, False):
        out = triton_kernels.nala_attention_triton(*leaves, 1.0, dict(opts, keep_features=keep), splits=splits)
        runs[keep] = [out.float(), *(g.float() for g in torch.autograd.grad(out.float(), leaves, g_out))]
    with torch.no_grad():
        out = triton_kernels.nala_attention_triton(*leaves, 1.0, opts, splits=splits)
    assert_close("output under no_grad", runs[True][0], out.float(), FP32_TOL)
    assert kept == [True, False, False]
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = nala_attention_reference(*ref_leaves, direction=direction)
    ref_all = [ref, *torch.autograd.grad(ref, ref_leaves, g_out)]
    for i, name in enumerate(["output", "grad q", "grad k", "grad v"]):
        tol = FP32_TOL if name in ("output", "grad v") else BF16_TOL
        assert_close(f"kept vs recomputed {name}", runs[False][i], runs[True][i], tol)
        for keep in (True, False):
            assert_close(f"{name} (keep_features={keep})", ref_all[i], runs[keep][i], BF16_TOL)


@cuda_only
@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_long_sequence_many_splits(direction):
    """N = 8192 with the default split count (from the SM count) against the fused path
    (the quadratic reference would need an (N, N, D) tensor)."""
    q, k, v = (t.requires_grad_() for t in qkv(b=2, h=4, n=8192, d=64))
    outs, grads = [], []
    for impl in ("triton", "fused"):
        out = nala_attention(q, k, v, direction=direction, impl=impl)
        outs.append(out)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    assert_close("output", outs[1], outs[0], FP32_TOL)
    for name, g_ref, g in zip("qkv", grads[1], grads[0]):
        assert_close(f"grad {name}", g_ref, g, FP32_TOL)


@cuda_only
def test_auto_picks_triton_in_a_bf16_autocast_layer():
    """The gated layer on CUDA under bf16 autocast: impl='auto' runs the kernels, and the
    output and parameter gradients match the same layer in fp32 on the CPU (the fused path)
    within 3e-2 relative RMS, the bf16 tolerance of the kernels' own first-use check."""
    from nala_dit.attention import GatedLinearAttention

    torch.manual_seed(0)
    layer = GatedLinearAttention(144, 2).to(DEVICE)
    x = torch.randn(2, 64, 144, device=DEVICE)
    calls = []
    original = triton_kernels.nala_attention_triton
    try:
        triton_kernels.nala_attention_triton = lambda *a, **kw: calls.append(1) or original(*a, **kw)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x, grid=(8, 8))
    finally:
        triton_kernels.nala_attention_triton = original
    assert calls, "impl='auto' did not run the Triton kernels on CUDA"
    y.float().sum().backward()
    assert torch.isfinite(y).all()
    cpu = GatedLinearAttention(144, 2)
    cpu.load_state_dict({k: t.cpu() for k, t in layer.state_dict().items()})
    y_ref = cpu(x.cpu(), grid=(8, 8))
    y_ref.sum().backward()
    assert_close("bf16 layer output", y_ref, y.float().cpu(), 3e-2)
    for (name, p), p_ref in zip(layer.named_parameters(), cpu.parameters()):
        assert (p.grad is None) == (p_ref.grad is None), name
        if p_ref.grad is not None:
            assert_close(f"bf16 layer grad {name}", p_ref.grad, p.grad.float().cpu(), 3e-2)
