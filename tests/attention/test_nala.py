"""Every ``nala_attention`` code path against the quadratic reference (NALA_SPEC.md §5).

Outputs and gradients of q, k, v; fp32 relative RMS ≤ 1e-5 at odd sizes; bf16 inputs
(fp32 inside) against the fp32 reference on the same rounded inputs within 1e-2
(bf16 output rounding is 2^-8 ≈ 4e-3 relative).
"""

import os

import pytest
import torch

import nala_dit.attention.nala.fused as fused
from nala_dit.attention import nala_attention, nala_attention_reference
from tests.utils import assert_close

FP32_TOL = 1e-5
BF16_TOL = 1e-2
EAGER_IMPLS = ["fused", "eager"]


def qkv(b=2, h=3, n=63, d=24, scale=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, h, n, d, generator=g) * scale).to(dtype).requires_grad_() for _ in range(3)]


def compare(impl, q, k, v, tol, **kw):
    out = nala_attention(q, k, v, impl=impl, **kw)
    assert out.dtype == v.dtype
    g_out = torch.randn_like(out.float(), generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out.float(), (q, k, v), g_out)
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = nala_attention_reference(q2, k2, v2, **kw)
    ref_grads = torch.autograd.grad(ref, (q2, k2, v2), g_out)
    assert_close(f"{impl} output", ref, out.float(), tol)
    for name, g_ref, g in zip("qkv", ref_grads, grads):
        assert g.dtype == q.dtype
        assert_close(f"{impl} grad {name}", g_ref, g.float(), tol)


@pytest.mark.parametrize("impl", EAGER_IMPLS)
@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
@pytest.mark.parametrize("n,d", [(63, 24), (257, 64)])
def test_fp32_matches_reference(impl, direction, n, d):
    b, h = (2, 3) if n < 100 else (1, 2)  # the reference builds (B, H, N, N, D)
    compare(impl, *qkv(b=b, h=h, n=n, d=d), FP32_TOL, direction=direction)


def test_auto_runs_the_fused_path():
    q, k, v = qkv(n=63, d=24)
    assert torch.equal(nala_attention(q, k, v), nala_attention(q, k, v, impl="fused"))


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_fused_many_chunks_and_options(direction, monkeypatch):
    """Tiny chunks (many partial sums, a ragged last chunk) and non-default λ, τ, s, α."""
    monkeypatch.setattr(fused, "_CHUNK_ELEMENTS", 1)
    compare("fused", *qkv(b=1, h=2, n=257, d=24), FP32_TOL, direction=direction,
            power=2.5, offset=0.7, norm_scale=3.0, alpha=5.0)


@pytest.mark.parametrize("n, lengths", [(170, [170]), (171, [86, 85]), (256, [128, 128]),
                                        (1024, [147] * 6 + [142]), (4096, [164] * 24 + [160])])
def test_token_chunks_are_as_few_and_as_even_as_the_cap_allows(n, lengths):
    """DiT-S/2 heads (6 × 64): at most 2^16 // 384 = 170 tokens a chunk, in
    ceil(n / 170) chunks of near-equal length, the first the longest (the scratch's size)."""
    chunks = fused._token_chunks(torch.Size((1, 6, n, 64)), torch.device("cpu"))
    assert [c.stop - c.start for c in chunks] == lengths
    assert [c.start for c in chunks[1:]] == [c.stop for c in chunks[:-1]] and chunks[-1].stop == n


@pytest.mark.parametrize("impl", ["fused", "eager"])
@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_bf16_inputs(impl, direction):
    compare(impl, *qkv(n=65, d=32, dtype=torch.bfloat16), BF16_TOL, direction=direction)


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_bf16_autocast_fused(direction):
    """Under bf16 autocast the fused path still computes in fp32 (|k|³ at |k| ≈ 100 would
    overflow fp16 and lose bf16's 8 bits): output and gradients within bf16 rounding of
    the fp32 reference on the same rounded inputs."""
    q, k, v = qkv(n=65, d=32, scale=30.0, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = nala_attention(q, k, v, direction=direction)
    assert out.dtype == torch.bfloat16
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out.float(), (q, k, v), g_out)
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = nala_attention_reference(q2, k2, v2, direction=direction)
    assert_close("autocast output", ref, out.float(), BF16_TOL)
    for name, g_ref, g in zip("qkv", torch.autograd.grad(ref, (q2, k2, v2), g_out), grads):
        assert_close(f"autocast grad {name}", g_ref, g.float(), BF16_TOL)


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
@pytest.mark.parametrize("case", ["zeros", "exact_zero_coords", "huge"])
def test_fused_finite_at_edges(direction, case):
    """0^p keeps a finite gradient (torch.pow semantics), zero tokens, |x| = 1e3."""
    q, k, v = (t.detach() for t in qkv(n=33, d=16))
    if case == "zeros":
        q, k = torch.zeros_like(q), torch.zeros_like(k)
        q[:, :, ::2] = torch.randn_like(q[:, :, ::2])
    elif case == "exact_zero_coords":
        q[..., ::3] = 0.0
        k[..., 1::3] = 0.0
    else:
        q, k, v = q * 1e3, k * 1e3, v * 1e3
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = nala_attention(q, k, v, direction=direction, impl="fused")
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    # The reference in float64 (|k|³ ≈ 1e9-1e11 at |x| = 1e3 is exact there): outputs and
    # gradients within fp32 rounding.
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = nala_attention_reference(q2, k2, v2, direction=direction)
    assert_close(f"{case} output", ref, out.double(), FP32_TOL)
    for name, g_ref, g in zip("qkv", torch.autograd.grad(ref.sum(), (q2, k2, v2)), grads):
        assert_close(f"{case} grad {name}", g_ref, g.double(), FP32_TOL)


def test_only_requested_gradients():
    """With k and v detached, only q's gradient is computed, and it is the reference's."""
    q, k, v = qkv(n=40, d=16)
    out = nala_attention(q, k.detach(), v.detach())
    (gq,) = torch.autograd.grad(out.sum(), (q,))
    q2 = q.detach().clone().requires_grad_()
    (ref,) = torch.autograd.grad(nala_attention_reference(q2, k.detach(), v.detach()).sum(), (q2,))
    assert_close("grad q", ref, gq, FP32_TOL)
    assert k.grad is None and v.grad is None


@pytest.mark.parametrize("impl", ["fused", "eager"])
def test_no_tokens_is_named(impl):
    """N = 0 was an IndexError (or a division by zero) deep in the token chunking."""
    q = torch.randn(1, 2, 0, 8)
    with pytest.raises(ValueError, match=r"no tokens \(N = 0"):
        nala_attention(q, q, q, impl=impl)


def test_unknown_impl_is_named():
    q, k, v = qkv(n=8, d=4)
    with pytest.raises(ValueError, match="impl must be one of"):
        nala_attention(q, k, v, impl="cuda")


def test_fused_path_runs_one_gemm_per_product_and_chunk(monkeypatch):
    """The features are built in place as one 2D-wide block, so every product with the
    state (or its gradient) is a single GEMM per token chunk: forward, the state and the
    output (2 per chunk); backward, ∂L/∂φ_q and the state's gradient in the query pass,
    ∂L/∂v and ∂L/∂φ_k in the key pass (4 per chunk). Keeping the cos/sin halves apart
    took two GEMMs for each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Gemms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += str(func.overloadpacket) in ("aten.bmm", "aten.baddbmm", "aten.baddbmm_", "aten.mm")
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(fused, "_CHUNK_ELEMENTS", 1)          # 64 tokens a chunk
    q, k, v = qkv(b=1, h=2, n=150, d=8)
    chunks = len(fused._token_chunks(q.shape, q.device))
    assert chunks == 3
    with Gemms() as forward:
        out = nala_attention(q, k, v, impl="fused")
    with Gemms() as backward:
        out.sum().backward()
    assert (forward.count, backward.count) == (2 * chunks, 4 * chunks)


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_float64_default_impl_is_float64(direction):
    """float64 through the public function (default impl, with and without gradients) runs
    in float64 end to end: the output and gradients within 1e-12 of the float64 quadratic
    reference (an fp32 pass inside would be ~1e-7 off), and gradcheck passes."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 19, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref = nala_attention_reference(q, k, v, direction=direction)
    out = nala_attention(q, k, v, direction=direction)                      # no requires_grad
    assert out.dtype == torch.float64
    assert_close("float64 output", ref, out, 1e-12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = nala_attention(*leaves, direction=direction)
    assert_close("float64 output (grad)", ref, out.detach(), 1e-12)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for name, got, want in zip("qkv", torch.autograd.grad(out, leaves, g_out),
                               torch.autograd.grad(nala_attention_reference(*refs, direction=direction), refs, g_out)):
        assert got.dtype == torch.float64
        assert_close(f"float64 grad {name}", want, got, 1e-11)
    small = [t[:, :1, :6, :4].clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: nala_attention(*x, direction=direction), small)
