"""The NaLa Triton kernels at commit b008a8e, for the GPU A/B: see ``benchmarks/baseline_nala.py``.

NaLa (``docs/NALA_SPEC.md`` §2-§3) as Triton kernels, forward and backward.

The structure is that of fused bidirectional linear attention: the state is a sum over
all tokens, so the forward is two passes and the backward three, each a kernel:

1. ``_state_kernel``   φ_k(k) in registers, ``[S | z]`` halves accumulated in fp32 over a
                       token range; several ranges per head run in parallel and add their
                       sums into one zeroed fp32 state with atomic adds (no partial buffers,
                       no separate reduction launch);
2. ``_output_kernel``  φ_q(q) in registers, ``o = φ_qᵀS / (φ_qᵀz + ε)``; keeps the
                       per-token denominator (one fp32 per token) for the backward;
   ``_forward_kernel`` 1 and 2 as one launch where one token range per head suffices (N <
                       ``SHORT_TOKENS``, or B·H alone filling the GPU): the state of one value
                       tile stays in registers between the two loops and is stored once;
3. ``_dq_kernel``      ∂L/∂φ_q = (g/den) Sᵀ + (∂L/∂den) zᵀ, then ∂L/∂q through the
                       feature map; keeps ∂L/∂den (one fp32 per token);
4. ``_state_kernel``   again with queries (QUERY=True):
                       ∂L/∂[S | z] = Σ_i φ_q(q_i) [g_i/den_i | ∂L/∂den_i];
5. ``_dkv_kernel``     ∂L/∂v = φ_k ∂L/∂S, ∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z, then ∂L/∂k.

Launches per call: forward 1 (short N) or 3 (``zeros``, state, output); backward 3 (short
N) or 4 (with one ``zeros``). The token ranges are 64 tokens at least, so at N ≥ 1,024 the
state passes run B·H·16 programs or more (XL/2's 16 heads: 256 at batch 1, every SM of an
H100/H200; S/2's 6 heads: 96 at batch 1, from batch 2 all 132). The atomic sums make the
state's last bits depend on the order the ranges finish in (fp32, relative ~1e-7).

``VARIANT`` (``NALA_TRITON_VARIANT=baseline``, or ``opts["variant"]``) keeps the kernels
before the rework selectable for an A/B: partial states summed by ``torch.sum``, ranges of
≥ 512 tokens, state and output as two launches, TF32 products, libdevice sin/cos/log.

Inputs and outputs are read and written through their strides (``forward_launch``,
``backward_launch``): the gated layer (``nala_dit/attention/nala/triton/gated.py``) hands in q, k, v as views of its
qkvg projection and buffers in token layout for the output and for dq, dk, dv, and the
dkv kernel adds ∂L/∂v to what its buffer holds (``ADD_DV``: the LePE term's gradient).
dq's contiguous case keeps its own store (``DQ_STRIDED`` False), which keeps that kernel's
registers at D = 72 where they were.

What is saved for the backward: q, k, v, the state (2 × D × (D+1) per head) and the
denominator. The 2D-wide features (norm, exponent, ``|q̂|^p``, angles, cos/sin halves,
``|k|^λ``) are recomputed in registers in every pass and never written to memory. The
feature is never concatenated: its two halves each meet the state in their own ``tl.dot``
(the CPU path, ``nala._FusedNaLa``, writes them side by side into one scratch block per
token chunk instead, so that there each product is one GEMM).

Precision: every load is cast to fp32, features, state, normaliser and division are fp32,
and only the stores cast to the tensor's dtype (§3 "Precision"). Products of fp32 blocks
use exact fp32 (``ieee``) for fp32 inputs, so the kernels match the fp32 reference to
rounding (TF32 where torch allows it: ``set_float32_matmul_precision("high")``). For
bf16/fp16 inputs the products take bf16 operands with fp32 accumulation ("bf16": the
features and the fp32 state are cast to bf16 as they enter each ``tl.dot``; bf16 for fp16
inputs too, since bf16 has fp32's range and |k|^λ passes fp16's 65504 at |k| > 40 for
λ = 3). Measured against the fp32 reference on fp32 inputs, under the interpreter (the
same rounding, ``bf16_exact``), N = 129: relative RMS 2.8e-3 to 3.6e-3 for the output and
the gradients of q, k, v at D = 64 and 72, the output norm within 3e-4 (TF32: 3.5e-4 to
4.5e-4); inside the 1e-2 budget of half inputs, whose own rounding is 2^-9. In that mode
(and only there: fp32 inputs and the interpreter keep libdevice) sin, cos and log are the
MUFU approximations (see ``_sin``); that also removes libdevice's local-memory argument
reduction of sin/cos (LDL/STL in the SASS).

Head dims up to 128. A power of two (16/32/64/128) is one tile. Any other D runs, in the
fused variant, as two tiles (``split_tiles``): lanes [0, BA) and [BA, BA + BB), BA the
largest power of two ≤ D and BB ≥ 16 the power of two covering the rest; XL/2's 72 is
64 + 16, 80 lanes of which 8 are masked (1.11× the elementwise work, 1.23× the state's
matrix work, where padding to 128 took 1.78× and 3.16×). Two tiles and not one of 80
lanes because Triton's blocks are powers of two; two and not 64 + 8 because tl.dot needs
16. The ``*_split`` kernels compute per tile, and everything that spans the head dim
spans both: the feature map's row reductions (‖x‖, Σ ∂L/∂p, the unit-vector gradient)
add the two tiles' sums, and a state half is four blocks S[a,a], S[a,b], S[b,a], S[b,b],
so each product becomes four tile-pair products. S[b,a] is accumulated transposed
(wᵀφ: 64 rows, so wgmma; a 16-row product falls back to mma.sync), and one program covers
every value lane. The state passes hold the features of both tiles at once (16 tokens per
program); output, dq and dkv take the feature lanes in chunks of ``SPLIT_CHUNK`` (16) in a
loop, one chunk's features live at a time (registers: two programs per SM), the output
computing them once per token block (the padded kernels: once per 64-lane value tile), dq
twice and dkv three times (twice in relu_split; see their docstrings). D is a constant of the split kernels (a
compile per head dim; the state loads vectorise). The baseline variant keeps the padded
kernels (72 as 128 lanes) for the A/B, and a D whose split is no narrower than its
padding (24, 120) stays padded. Any N (masked token blocks; a zero token has zero
features, so padding adds nothing to the state).

Compiled for sm_90a (``benchmarks/triton_compile_check.py``; bf16, cosine, D = 72, 8 warps;
padded → split, before the register work below): registers, state 195 → 173, dstate
255 → 173, output 254 → 170, dq 255 → 255, dkv 202 → 255, forward 230 → 255; spills 0
except dq 16 → 28 B, dkv 0 → 52 B, forward 0 → 124 B; static SASS instructions state
2,400 → 1,232, dstate 3,024 → 1,440, output 3,392 → 2,320 (per program; the split
programs cover 16 tokens and all 72 value lanes where the padded covered 32 and 64, and
output, dq, dkv 64 tokens where they covered 32 and 16); products on wgmma everywhere
(HGMMA; mma.sync only for the 16 × 16 S[b,b] blocks) where output, dq and dkv ran 32-96
mma.sync each; MUFU.COS per token (elementwise work) state 1.0 → 0.31, output, dq, dkv
0.5 → 0.31. Then two programs per SM for every fused kernel at D = 64 and 72 (bf16 and
fp16, both directions), no spill, wgmma wherever it was: launch configs per kind of kernel
with a register cap (``_CONFIGS``, ``_SPLIT_CONFIGS``; the table of registers there) and
the feature chunks above; chosen by the compile report, not timed on a GPU.

The kernels run on CUDA and, for the tests, on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported); without a GPU,
``benchmarks/triton_compile_check.py`` compiles them for sm_90a and reports registers,
spills, shared memory, programs per SM, wgmma/mma.sync and MUFU use. The launch configs
below avoid register spills and fit two programs per SM; they have not been timed
(``benchmarks/triton_configs.py`` times them against the previous ones on a GPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from nala_dit.attention.config import TRITON_MAX_HEAD_DIM as MAX_HEAD_DIM, TRITON_MAX_TOKENS


def unsupported_reason(q: torch.Tensor) -> str | None:
    """Why these kernels cannot take ``q`` (None when they can)."""
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (fp32, bf16 or fp16 only)"
    if q.shape[-2] > TRITON_MAX_TOKENS:  # token blocks of 16 run on grid axis 1 (≤ 65535)
        return f"N = {q.shape[-2]} tokens (at most {TRITON_MAX_TOKENS})"
    return None


# ------------------------------------------------------------------ feature maps (§2)


# Hardware approximations (the MUFU unit: one instruction each) for the feature map's
# sin, cos and log in the half-precision mode (PREC == "bf16") only; everything else (fp32
# inputs, the interpreter, which runs no PTX) keeps libdevice's exact functions, which
# compile to software polynomials and, for sin/cos, a local-memory argument reduction.
# PTX ISA bounds: sin/cos.approx absolute error ≤ 2^-20.5 on [-π, π] (θ here is within
# ±π/4); lg2.approx absolute error ≤ 2^-22 on [0.5, 2], relative ≤ 2^-22 elsewhere.
# bf16 keeps 8 mantissa bits (2^-9 relative rounding): the approximations are ~2^-11 of
# that. tests/attention/test_triton_approx.py measures each one's worst error on a GPU.


@triton.jit
def _sin(x, PREC: tl.constexpr):
    if PREC == "bf16":
        return tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.sin(x)


@triton.jit
def _cos(x, PREC: tl.constexpr):
    if PREC == "bf16":
        return tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.cos(x)


@triton.jit
def _log(x, PREC: tl.constexpr):
    if PREC == "bf16":
        return 0.6931471805599453 * tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                               is_pure=True, pack=1)
    else:
        return tl.log(x)


@triton.jit
def _tanh(x):
    # exp(−2|x|) ∈ (0, 1]: no overflow at any |x| (tl has no tanh on every backend).
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _abs_pow(x, p, PREC: tl.constexpr):
    """|x|^p for p > 0 as exp(p·log|x|), exactly 0 at x = 0 (never log of a signed base)."""
    ax = tl.abs(x)
    return tl.where(ax > 0, tl.exp(p * _log(tl.where(ax > 0, ax, 1.0), PREC)), 0.0)


@triton.jit
def _unit(x, norm_eps):
    norm = tl.sqrt(tl.sum(x * x, 1))                       # (BN,)
    clamped = tl.maximum(norm, norm_eps)
    return x / clamped[:, None], norm, clamped


@triton.jit
def _lift(mag, x_hat, alpha, COSINE: tl.constexpr, PREC: tl.constexpr):
    """The two halves of φ: (m cos θ, m sin θ) with θ = (π/4)·tanh(α x̂), or
    (m·1(x̂>0), m·1(x̂<0)) in the relu_split mode."""
    if COSINE:
        theta = 0.7853981633974483 * _tanh(alpha * x_hat)
        f1 = mag * _cos(theta, PREC)
        f2 = mag * _sin(theta, PREC)
    else:
        f1 = tl.where(x_hat > 0, mag, 0.0)
        f2 = tl.where(x_hat < 0, mag, 0.0)
    return f1, f2


@triton.jit
def _query_features(q, scale, power, offset, alpha, norm_eps, COSINE: tl.constexpr, PREC: tl.constexpr):
    """φ_q of §2 for a (BN, BD) fp32 block: a = |q̂|^p with p = λ(τ + tanh(‖q‖/s))."""
    q_hat, norm, clamped = _unit(q, norm_eps)
    t_norm = _tanh(norm / scale)
    p = power * (offset + t_norm)                          # (BN,)
    a = _abs_pow(q_hat, p[:, None], PREC)
    f1, f2 = _lift(a, q_hat, alpha, COSINE, PREC)
    return f1, f2, q_hat, norm, clamped, p, t_norm


@triton.jit
def _key_features(k, power, alpha, norm_eps, COSINE: tl.constexpr, PREC: tl.constexpr):
    """φ_k of §2: b = |k|^λ (norm kept), direction from k̂ = k/‖k‖."""
    b = _abs_pow(k, power, PREC)
    if COSINE:
        k_hat, norm, clamped = _unit(k, norm_eps)
        f1, f2 = _lift(b, k_hat, alpha, COSINE, PREC)
    else:
        f1, f2 = _lift(b, k, alpha, COSINE, PREC)
    return f1, f2


@triton.jit
def _lift_grad(f1, f2, g1, g2, x_hat, alpha, COSINE: tl.constexpr):
    """From the halves F = (m c, m s) and their gradient G: m·∂L/∂m = G·F, and
    ∂L/∂x̂ through θ: (G₂F₁ − G₁F₂)·(π/4)·α·(1 − tanh²(α x̂)) (0 in relu_split)."""
    m_dm = g1 * f1 + g2 * f2
    if COSINE:
        t = _tanh(alpha * x_hat)
        d_hat = (g2 * f1 - g1 * f2) * ((0.7853981633974483 * alpha) * (1.0 - t * t))
    else:
        d_hat = tl.zeros_like(m_dm)
    return m_dm, d_hat


@triton.jit
def _through_unit(x, x_hat, norm, clamped, d_hat, d_norm, norm_eps):
    """∂L/∂x for x̂ = x / max(‖x‖, ε), plus an extra ∂L/∂‖x‖ (d_norm)."""
    d_clamped = -tl.sum(d_hat * x_hat, 1) / clamped
    # max(·, ε) passes the gradient where ‖x‖ ≥ ε; ∂‖x‖/∂x = x/‖x‖, 0 at x = 0.
    d_norm = d_norm + tl.where(norm >= norm_eps, d_clamped, 0.0)
    safe = tl.where(norm == 0, 1.0, norm)
    return d_hat / clamped[:, None] + (d_norm / safe)[:, None] * x


@triton.jit
def _query_grad(q, f1, f2, g1, g2, q_hat, norm, clamped, p, t_norm, scale, power, alpha,
                norm_eps, COSINE: tl.constexpr, PREC: tl.constexpr):
    """∂L/∂q from ∂L/∂φ_q, and ∂L/∂(‖q‖/s) (for a learned s)."""
    a_da, d_hat = _lift_grad(f1, f2, g1, g2, q_hat, alpha, COSINE)
    nonzero = q_hat != 0
    safe = tl.where(nonzero, q_hat, 1.0)
    # a = |q̂|^p: ∂a/∂q̂ = p·a/q̂ and ∂a/∂p = a·log|q̂|, both 0 where q̂ = 0 (as torch.pow).
    d_hat += a_da * p[:, None] / safe
    d_p = tl.sum(tl.where(nonzero, a_da * _log(tl.abs(safe), PREC), 0.0), 1)
    d_u = d_p * power * (1.0 - t_norm * t_norm)             # ∂L/∂u, u = ‖q‖/s
    dq = _through_unit(q, q_hat, norm, clamped, d_hat, d_u / scale, norm_eps)
    return dq, d_u


@triton.jit
def _key_grad(k, f1, f2, g1, g2, power, alpha, norm_eps, COSINE: tl.constexpr):
    """∂L/∂k from ∂L/∂φ_k: b = |k|^λ gives λ·b/k (0 at k = 0), θ goes through k̂."""
    if COSINE:
        k_hat, norm, clamped = _unit(k, norm_eps)
        b_db, d_hat = _lift_grad(f1, f2, g1, g2, k_hat, alpha, COSINE)
        dk = _through_unit(k, k_hat, norm, clamped, d_hat, tl.zeros_like(norm), norm_eps)
    else:
        b_db, d_hat = _lift_grad(f1, f2, g1, g2, k, alpha, COSINE)
        dk = tl.zeros_like(k)
    return dk + b_db * power / tl.where(k != 0, k, 1.0)


# Split head dim (see "Head dims" in the module docstring): a head dim D that is not a
# power of two runs as two tiles, lanes [0, BA) and [BA, BA + BB) (BA the largest power of
# two ≤ D, BB ≥ 16 a power of two; D = 72: 64 + 16, 8 masked lanes). Elementwise work is
# per tile; a row reduction (‖x‖, Σ_d, ...) is the sum of the two tiles' sums.


@triton.jit
def _query_tile(q, clamped, p, alpha, COSINE: tl.constexpr, PREC: tl.constexpr):
    q_hat = q / clamped[:, None]
    f1, f2 = _lift(_abs_pow(q_hat, p[:, None], PREC), q_hat, alpha, COSINE, PREC)
    return f1, f2, q_hat


@triton.jit
def _query_features2(qa, qb, scale, power, offset, alpha, norm_eps, COSINE: tl.constexpr, PREC: tl.constexpr):
    """_query_features on the two tiles of a split head dim."""
    norm = tl.sqrt(tl.sum(qa * qa, 1) + tl.sum(qb * qb, 1))
    clamped = tl.maximum(norm, norm_eps)
    t_norm = _tanh(norm / scale)
    p = power * (offset + t_norm)
    f1a, f2a, ha = _query_tile(qa, clamped, p, alpha, COSINE, PREC)
    f1b, f2b, hb = _query_tile(qb, clamped, p, alpha, COSINE, PREC)
    return f1a, f2a, f1b, f2b, ha, hb, norm, clamped, p, t_norm


@triton.jit
def _key_features2(ka, kb, power, alpha, norm_eps, COSINE: tl.constexpr, PREC: tl.constexpr):
    """_key_features on the two tiles of a split head dim."""
    ba = _abs_pow(ka, power, PREC)
    bb = _abs_pow(kb, power, PREC)
    if COSINE:
        clamped = tl.maximum(tl.sqrt(tl.sum(ka * ka, 1) + tl.sum(kb * kb, 1)), norm_eps)
        f1a, f2a = _lift(ba, ka / clamped[:, None], alpha, COSINE, PREC)
        f1b, f2b = _lift(bb, kb / clamped[:, None], alpha, COSINE, PREC)
    else:
        f1a, f2a = _lift(ba, ka, alpha, COSINE, PREC)
        f1b, f2b = _lift(bb, kb, alpha, COSINE, PREC)
    return f1a, f2a, f1b, f2b


@triton.jit
def _query_grad_tile(f1, f2, g1, g2, q_hat, p, alpha, COSINE: tl.constexpr, PREC: tl.constexpr):
    """One tile of _query_grad: ∂L/∂q̂ and this tile's part of ∂L/∂p."""
    a_da, d_hat = _lift_grad(f1, f2, g1, g2, q_hat, alpha, COSINE)
    nonzero = q_hat != 0
    safe = tl.where(nonzero, q_hat, 1.0)
    d_hat += a_da * p[:, None] / safe
    d_p = tl.sum(tl.where(nonzero, a_da * _log(tl.abs(safe), PREC), 0.0), 1)
    return d_hat, d_p


@triton.jit
def _key_tile(k, clamped, power, alpha, COSINE: tl.constexpr, PREC: tl.constexpr):
    """φ_k on a chunk of lanes: b = |k|^λ, the direction from k̂ = k / max(‖k‖, ε) (cosine;
    ``clamped`` spans every lane) or from k (relu_split); also that x̂ (k̂ or k)."""
    b = _abs_pow(k, power, PREC)
    if COSINE:
        h = k / clamped[:, None]
    else:
        h = k
    f1, f2 = _lift(b, h, alpha, COSINE, PREC)
    return f1, f2, h


@triton.jit
def _key_grad_tile(k, f1, f2, g1, g2, h, clamped, power, alpha, COSINE: tl.constexpr):
    """∂L/∂k on a chunk of lanes but the unit vector's row term (c·k, see _unit_row_term):
    λ·b·∂L/∂b / k, plus ∂L/∂k̂ / max(‖k‖, ε) in the cosine mode; and Σ ∂L/∂k̂·k̂ over the chunk."""
    b_db, d_hat = _lift_grad(f1, f2, g1, g2, h, alpha, COSINE)
    part = b_db * power / tl.where(k != 0, k, 1.0)
    if COSINE:
        part += d_hat / clamped[:, None]
    return part, tl.sum(d_hat * h, 1)


@triton.jit
def _unit_row_term(norm, clamped, dot_hat, d_norm, norm_eps):
    """c in ∂L/∂x = ∂L/∂x̂ / max(‖x‖, ε) + c·x for x̂ = x / max(‖x‖, ε) (as _through_unit),
    from Σ_d ∂L/∂x̂·x̂ over every lane and an extra ∂L/∂‖x‖."""
    d_norm = d_norm + tl.where(norm >= norm_eps, -dot_hat / clamped, 0.0)
    return d_norm / tl.where(norm == 0, 1.0, norm)


# ---------------------------------------------------------------------------- kernels


@triton.jit
def _round_tf32(x):
    """fp32 rounded to the nearest TF32 value (10 mantissa bits; ties away from zero).
    Tensor cores truncate the 13 low bits instead, which would shrink every product
    by 2^-11 on average: a bias the fp32 normaliser (a plain sum) would not share."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _round_bf16(x):
    """fp32 rounded to the nearest bf16 value, kept in fp32 (ties away from zero): the
    interpreter's stand-in for bf16 operands (its bf16 ``tl.dot`` is wrong, Triton 3.8).
    A product of two bf16 values is exact in fp32, so an fp32 dot of rounded operands
    equals the tensor cores' bf16 dot up to the order of the fp32 additions."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x8000) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """``a @ b`` of fp32 blocks with an fp32 accumulator: exact fp32 ("ieee"), TF32
    tensor cores on rounded operands ("tf32"), bf16 tensor cores ("bf16"), or bf16-rounded
    operands in an exact fp32 product ("bf16_exact": the same numbers, interpreter-safe)."""
    if PREC == "tf32":
        return tl.dot(_round_tf32(a), _round_tf32(b), input_precision="tf32")
    elif PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16_exact":
        return tl.dot(_round_bf16(a), _round_bf16(b), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _load_block(ptr, stride_n, stride_d, offs_n, offs_d, n_mask, d_mask):
    """A (BN, BD) block of a (N, D) slice, masked to 0, in fp32."""
    x = tl.load(ptr + offs_n[:, None] * stride_n + offs_d[None, :] * stride_d,
                mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _head_offset(bh, H, stride_b, stride_h):
    return (bh // H) * stride_b + (bh % H) * stride_h  # bh is int64 (see the kernels)


@triton.jit
def _state_range(x_base, v_base, sx_n, sx_d, sv_n, sv_d, start, end, offs_d, offs_v, d_mask, v_mask,
                 scale, power, offset, alpha, norm_eps, bh, N,
                 QUERY: tl.constexpr, COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr,
                 BV: tl.constexpr, PREC: tl.constexpr, DEN, DDEN):
    """Σ φ(x_j) w_jᵀ and Σ φ(x_j) over tokens [start, end), per half, in fp32 (see _state_kernel)."""
    acc1 = tl.zeros((BD, BV), dtype=tl.float32)
    acc2 = tl.zeros((BD, BV), dtype=tl.float32)
    z1 = tl.zeros((BD,), dtype=tl.float32)
    z2 = tl.zeros((BD,), dtype=tl.float32)
    rows = tl.cast(start, tl.int64)                    # the range's first token: int64 base offsets
    x_base += rows * sx_n
    v_base += rows * sv_n
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        offs_r = offs_n - start                        # within the range: int32 products
        x = _load_block(x_base, sx_n, sx_d, offs_r, offs_d, n_mask, d_mask)
        w = _load_block(v_base, sv_n, sv_d, offs_r, offs_v, n_mask, v_mask)
        if QUERY:
            f1, f2, _h, _n, _c, _p, _t = _query_features(x, scale, power, offset, alpha, norm_eps, COSINE, PREC)
            den = tl.load(DEN + bh * N + offs_n, mask=n_mask, other=1.0)
            d_den = tl.load(DDEN + bh * N + offs_n, mask=n_mask, other=0.0)
            w = w / den[:, None]                              # ∂L/∂num = g/den
            z1 += tl.sum(f1 * d_den[:, None], 0)
            z2 += tl.sum(f2 * d_den[:, None], 0)
        else:
            f1, f2 = _key_features(x, power, alpha, norm_eps, COSINE, PREC)
            z1 += tl.sum(f1, 0)
            z2 += tl.sum(f2, 0)
        acc1 += _dot(tl.trans(f1), w, PREC)
        acc2 += _dot(tl.trans(f2), w, PREC)
    return acc1, acc2, z1, z2


@triton.jit
def _state_kernel(
    X, V, ScaleP, S_part, Z_part,
    sx_b, sx_h, sx_n, sx_d, sv_b, sv_h, sv_n, sv_d,
    H, N, D, tokens_per_split, n_splits, inv_n,
    power, offset, alpha, norm_eps,
    QUERY: tl.constexpr, COSINE: tl.constexpr,
    BLOCK_N: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    DEN=None, DDEN=None, ATOMIC: tl.constexpr = False,
):
    """Partial sums over one token range of Σ φ(x_j) v_jᵀ and Σ φ(x_j) w_j, per half.

    Forward (QUERY=False): x = k, v = v, w = 1 → [S | z] (times 1/N).
    Backward (QUERY=True):  x = q, v = g/den, w = ∂L/∂den → ∂L/∂[S | z] (times 1/N).
    Grid: (B·H, splits, BD/BV); the z part is written by the first value tile only.
    ATOMIC: every range adds its sum into one zeroed (B·H, 2, D, D) state with fp32 atomic
    adds (no partial buffers, no separate sum); else (the baseline variant) each range
    writes its own partial state, summed afterwards by ``torch.sum``.
    """
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B·H·N may pass 2^31
    split = tl.program_id(1)
    vt = tl.program_id(2)
    x_base = X + _head_offset(bh, H, sx_b, sx_h)
    v_base = V + _head_offset(bh, H, sv_b, sv_h)
    offs_d = tl.arange(0, BD)
    offs_v = vt * BV + tl.arange(0, BV)
    d_mask = offs_d < D
    v_mask = offs_v < D
    scale = tl.load(ScaleP + bh % H)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, N)
    acc1, acc2, z1, z2 = _state_range(x_base, v_base, sx_n, sx_d, sv_n, sv_d, start, end, offs_d, offs_v,
                                      d_mask, v_mask, scale, power, offset, alpha, norm_eps, bh, N,
                                      QUERY, COSINE, BLOCK_N, BD, BV, PREC, DEN, DDEN)
    # Buffers are (B·H, [splits,] 2, D, D) and (B·H, [splits,] 2, D): unpadded, since the
    # state is saved for the backward (at D = 72 padding would store 3× the bytes).
    part = bh if ATOMIC else bh * n_splits + split
    s_ptr = S_part + part * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
    s_mask = d_mask[:, None] & v_mask[None, :]
    z_ptr = Z_part + part * 2 * D + offs_d
    first = d_mask & (vt == 0)
    # Stored already times 1/N (the mean of §3): partial sums then add up to the state.
    if ATOMIC:
        tl.atomic_add(s_ptr, acc1 * inv_n, mask=s_mask, sem="relaxed")
        tl.atomic_add(s_ptr + D * D, acc2 * inv_n, mask=s_mask, sem="relaxed")
        tl.atomic_add(z_ptr, z1 * inv_n, mask=first, sem="relaxed")
        tl.atomic_add(z_ptr + D, z2 * inv_n, mask=first, sem="relaxed")
    else:
        tl.store(s_ptr, acc1 * inv_n, mask=s_mask)
        tl.store(s_ptr + D * D, acc2 * inv_n, mask=s_mask)
        tl.store(z_ptr, z1 * inv_n, mask=first)
        tl.store(z_ptr + D, z2 * inv_n, mask=first)


@triton.jit
def _output_block(q_base, sq_n, sq_d, offs_n, n_mask, offs_d, d_mask, offs_v, v_mask, s1, s2, z1, z2,
                  scale, power, offset, alpha, norm_eps, eps, COSINE: tl.constexpr, PREC: tl.constexpr):
    """One token block of o = φ_qᵀ S / (φ_qᵀ z + ε) (a value tile of it) and its denominator."""
    q = _load_block(q_base, sq_n, sq_d, offs_n, offs_d, n_mask, d_mask)
    f1, f2, _h, _n, _c, _p, _t = _query_features(q, scale, power, offset, alpha, norm_eps, COSINE, PREC)
    num = _dot(f1, s1, PREC)
    num += _dot(f2, s2, PREC)
    den = tl.sum(f1 * z1[None, :] + f2 * z2[None, :], 1) + eps
    return num / den[:, None], den


@triton.jit
def _forward_kernel(
    K, V, Q, ScaleP, S, Z, O, DEN,
    sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sq_b, sq_h, sq_n, sq_d, so_b, so_h, so_n, so_d,
    H, N, D, inv_n,
    power, offset, alpha, norm_eps, eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """The whole forward in one launch (one token range per head: short sequences, or
    B·H alone filling the GPU): the state of all N tokens for one value tile, kept in
    registers, stored once (for the backward), then the output of every token block.
    Grid: (B·H, BD/BV)."""
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B·H·N may pass 2^31
    vt = tl.program_id(1)
    offs_d = tl.arange(0, BD)
    offs_v = vt * BV + tl.arange(0, BV)
    d_mask = offs_d < D
    v_mask = offs_v < D
    scale = tl.load(ScaleP + bh % H)
    acc1, acc2, z1, z2 = _state_range(K + _head_offset(bh, H, sk_b, sk_h), V + _head_offset(bh, H, sv_b, sv_h),
                                      sk_n, sk_d, sv_n, sv_d, 0, N, offs_d, offs_v, d_mask, v_mask,
                                      scale, power, offset, alpha, norm_eps, bh, N,
                                      False, COSINE, BLOCK_N, BD, BV, PREC, None, None)
    s1 = acc1 * inv_n
    s2 = acc2 * inv_n
    z1 = z1 * inv_n
    z2 = z2 * inv_n
    s_ptr = S + bh * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
    s_mask = d_mask[:, None] & v_mask[None, :]
    tl.store(s_ptr, s1, mask=s_mask)
    tl.store(s_ptr + D * D, s2, mask=s_mask)
    first = d_mask & (vt == 0)
    tl.store(Z + bh * 2 * D + offs_d, z1, mask=first)
    tl.store(Z + bh * 2 * D + D + offs_d, z2, mask=first)
    q_base = Q + _head_offset(bh, H, sq_b, sq_h)
    o_base = O + _head_offset(bh, H, so_b, so_h)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        out, den = _output_block(q_base, sq_n, sq_d, offs_n, n_mask, offs_d, d_mask, offs_v, v_mask,
                                 s1, s2, z1, z2, scale, power, offset, alpha, norm_eps, eps, COSINE, PREC)
        o_ptr = o_base + offs_n[:, None] * so_n + offs_v[None, :] * so_d
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=n_mask[:, None] & v_mask[None, :])
        tl.store(DEN + bh * N + offs_n, den, mask=n_mask & (vt == 0))


@triton.jit
def _output_kernel(
    Q, ScaleP, S, Z, O, DEN,
    sq_b, sq_h, sq_n, sq_d, so_b, so_h, so_n, so_d,
    H, N, D,
    power, offset, alpha, norm_eps, eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """o = φ_qᵀ S / (φ_qᵀ z + ε) for one token block and one value tile (§3 linear form).
    Grid: (B·H, token blocks, BD/BV). O is (B, H, N, D) through its strides; DEN is (B·H, N) fp32."""
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B·H·N may pass 2^31
    nb = tl.program_id(1)
    vt = tl.program_id(2)
    row0 = (nb * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - nb * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_d = tl.arange(0, BD)
    offs_v = vt * BV + tl.arange(0, BV)
    n_mask = offs_n < n_left
    v_mask = offs_v < D
    d_mask = offs_d < D
    scale = tl.load(ScaleP + bh % H)
    s_ptr = S + bh * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
    s_mask = d_mask[:, None] & v_mask[None, :]
    s1 = tl.load(s_ptr, mask=s_mask, other=0.0)
    s2 = tl.load(s_ptr + D * D, mask=s_mask, other=0.0)
    z1 = tl.load(Z + bh * 2 * D + offs_d, mask=d_mask, other=0.0)
    z2 = tl.load(Z + bh * 2 * D + D + offs_d, mask=d_mask, other=0.0)
    out, den = _output_block(Q + _head_offset(bh, H, sq_b, sq_h) + row0 * sq_n, sq_n, sq_d, offs_n, n_mask, offs_d, d_mask,
                             offs_v, v_mask, s1, s2, z1, z2, scale, power, offset, alpha, norm_eps, eps,
                             COSINE, PREC)
    o_ptr = O + _head_offset(bh, H, so_b, so_h) + row0 * so_n + offs_n[:, None] * so_n + offs_v[None, :] * so_d
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=n_mask[:, None] & v_mask[None, :])
    tl.store(DEN + bh * N + row0 + offs_n, den, mask=n_mask & (vt == 0))


@triton.jit
def _dq_kernel(
    Q, G, ScaleP, S, Z, DEN, DQ, DDEN, DU,
    sq_b, sq_h, sq_n, sq_d, sg_b, sg_h, sg_n, sg_d, sdq_b, sdq_h, sdq_n, sdq_d,
    H, N, D,
    power, offset, alpha, norm_eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, PREC: tl.constexpr, NEED_DU: tl.constexpr, DQ_STRIDED: tl.constexpr = False,
):
    """∂L/∂q for one token block, and ∂L/∂den (for the state gradient).
    With num = φ_qᵀS and den = φ_qᵀz + ε: ∂L/∂num = g/den, ∂L/∂den = −(g/den)·num/den,
    ∂L/∂φ_q = (g/den) Sᵀ + (∂L/∂den) zᵀ. Grid: (B·H, token blocks)."""
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B·H·N may pass 2^31
    nb = tl.program_id(1)
    row0 = (nb * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - nb * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_d = tl.arange(0, BD)
    n_mask = offs_n < n_left
    d_mask = offs_d < D
    den = tl.load(DEN + bh * N + row0 + offs_n, mask=n_mask, other=1.0)
    g_base = G + _head_offset(bh, H, sg_b, sg_h) + row0 * sg_n
    g1 = tl.zeros((BLOCK_N, BD), dtype=tl.float32)
    g2 = tl.zeros((BLOCK_N, BD), dtype=tl.float32)
    for vt in tl.static_range(NV):
        offs_v = vt * BV + tl.arange(0, BV)
        v_mask = offs_v < D
        d_num = _load_block(g_base, sg_n, sg_d, offs_n, offs_v, n_mask, v_mask) / den[:, None]
        s_ptr = S + bh * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
        s_mask = d_mask[:, None] & v_mask[None, :]
        g1 += _dot(d_num, tl.trans(tl.load(s_ptr, mask=s_mask, other=0.0)), PREC)
        g2 += _dot(d_num, tl.trans(tl.load(s_ptr + D * D, mask=s_mask, other=0.0)), PREC)
    # The features only after the products: fewer blocks live at once (registers).
    q = _load_block(Q + _head_offset(bh, H, sq_b, sq_h) + row0 * sq_n, sq_n, sq_d, offs_n, offs_d, n_mask, d_mask)
    scale = tl.load(ScaleP + bh % H)
    f1, f2, q_hat, norm, clamped, p, t_norm = _query_features(q, scale, power, offset, alpha, norm_eps, COSINE, PREC)
    # (g/den)·num/den = φ_q · ((g/den) Sᵀ) / den: num is never formed.
    d_den = -tl.sum(f1 * g1 + f2 * g2, 1) / den
    tl.store(DDEN + bh * N + row0 + offs_n, d_den, mask=n_mask)
    z1 = tl.load(Z + bh * 2 * D + offs_d, mask=d_mask, other=0.0)
    z2 = tl.load(Z + bh * 2 * D + D + offs_d, mask=d_mask, other=0.0)
    g1 += d_den[:, None] * z1[None, :]
    g2 += d_den[:, None] * z2[None, :]
    dq, d_u = _query_grad(q, f1, f2, g1, g2, q_hat, norm, clamped, p, t_norm, scale, power, alpha,
                          norm_eps, COSINE, PREC)
    if DQ_STRIDED:   # a gated layer's token-layout gradient buffer
        dq_ptr = DQ + _head_offset(bh, H, sdq_b, sdq_h) + row0 * sdq_n + offs_n[:, None] * sdq_n + offs_d[None, :] * sdq_d
    else:            # contiguous (B, H, N, D): the strides unused, which keeps dq's registers as they were
        dq_ptr = DQ + (bh * N + row0) * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(dq_ptr, dq.to(DQ.dtype.element_ty), mask=n_mask[:, None] & d_mask[None, :])
    if NEED_DU:
        # ∂L/∂s per token: u = ‖q‖/s, ∂u/∂s = −‖q‖/s².
        tl.store(DU + bh * N + row0 + offs_n, -d_u * norm / (scale * scale), mask=n_mask)


@triton.jit
def _dkv_kernel(
    K, V, DS, DZ, DK, DV,
    sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sdk_b, sdk_h, sdk_n, sdk_d, sdv_b, sdv_h, sdv_n, sdv_d,
    H, N, D,
    power, alpha, norm_eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, PREC: tl.constexpr, ADD_DV: tl.constexpr,
):
    """∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z then ∂L/∂k, and ∂L/∂v = Σ_halves φ_k ∂L/∂S, for one
    token block (the 1/N of §3 is already in ∂L/∂[S | z]). In that order, so that the
    features and their gradient are not live in the same loop (registers).
    ``ADD_DV``: ∂L/∂v is added to what DV holds (the gated layer's LePE term), not stored.
    Grid: (B·H, token blocks)."""
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B·H·N may pass 2^31
    nb = tl.program_id(1)
    row0 = (nb * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - nb * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_d = tl.arange(0, BD)
    n_mask = offs_n < n_left
    d_mask = offs_d < D
    v_base = V + _head_offset(bh, H, sv_b, sv_h) + row0 * sv_n
    dz1 = tl.load(DZ + bh * 2 * D + offs_d, mask=d_mask, other=0.0)
    dz2 = tl.load(DZ + bh * 2 * D + D + offs_d, mask=d_mask, other=0.0)
    g1 = tl.zeros((BLOCK_N, BD), dtype=tl.float32) + dz1[None, :]
    g2 = tl.zeros((BLOCK_N, BD), dtype=tl.float32) + dz2[None, :]
    for vt in tl.static_range(NV):
        offs_v = vt * BV + tl.arange(0, BV)
        v_mask = offs_v < D
        v = _load_block(v_base, sv_n, sv_d, offs_n, offs_v, n_mask, v_mask)
        ds_ptr = DS + bh * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
        ds_mask = d_mask[:, None] & v_mask[None, :]
        g1 += _dot(v, tl.trans(tl.load(ds_ptr, mask=ds_mask, other=0.0)), PREC)
        g2 += _dot(v, tl.trans(tl.load(ds_ptr + D * D, mask=ds_mask, other=0.0)), PREC)
    k = _load_block(K + _head_offset(bh, H, sk_b, sk_h) + row0 * sk_n, sk_n, sk_d, offs_n, offs_d, n_mask, d_mask)
    f1, f2 = _key_features(k, power, alpha, norm_eps, COSINE, PREC)
    dk = _key_grad(k, f1, f2, g1, g2, power, alpha, norm_eps, COSINE)
    dk_ptr = DK + _head_offset(bh, H, sdk_b, sdk_h) + row0 * sdk_n + offs_n[:, None] * sdk_n + offs_d[None, :] * sdk_d
    tl.store(dk_ptr, dk.to(DK.dtype.element_ty), mask=n_mask[:, None] & d_mask[None, :])
    for vt in tl.static_range(NV):
        offs_v = vt * BV + tl.arange(0, BV)
        v_mask = offs_v < D
        ds_ptr = DS + bh * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
        ds_mask = d_mask[:, None] & v_mask[None, :]
        dv = _dot(f1, tl.load(ds_ptr, mask=ds_mask, other=0.0), PREC)
        dv += _dot(f2, tl.load(ds_ptr + D * D, mask=ds_mask, other=0.0), PREC)
        dv_ptr = DV + _head_offset(bh, H, sdv_b, sdv_h) + row0 * sdv_n + offs_n[:, None] * sdv_n + offs_v[None, :] * sdv_d
        dv_mask = n_mask[:, None] & v_mask[None, :]
        if ADD_DV:
            dv += tl.load(dv_ptr, mask=dv_mask, other=0.0).to(tl.float32)
        tl.store(dv_ptr, dv.to(DV.dtype.element_ty), mask=dv_mask)


# ------------------------------------------------------------- split head dim kernels
# The same five kernels for a head dim split into tiles a = [0, BA) and b = [BA, BA + BB)
# (fused variant only; power-of-two dims and the baseline run the kernels above). The
# state [S | z] of a half is four blocks, S[a,a] (BA × BA), S[a,b], S[b,a], S[b,b]: every
# product of the kernels above becomes four products of tile pairs, each a tl.dot on
# power-of-two shapes. One program covers every value lane (no value-tile grid axis).
# Output, dq and dkv take the feature lanes in chunks of BC (``SPLIT_CHUNK``) in a loop,
# each chunk meeting its BC rows of the state blocks S[c, a] and S[c, b] (a product split
# along the feature lanes); the value lanes stay the two tiles a and b.


@triton.jit
def _s_block(base, offs_r, offs_c, D):
    """One (rows, cols) block of a (D, D) state half, 0 outside D."""
    return tl.load(base + offs_r[:, None] * D + offs_c[None, :],
                   mask=(offs_r < D)[:, None] & (offs_c < D)[None, :], other=0.0)


@triton.jit
def _s_block_t(base, offs_r, offs_c, D):
    """The transpose of _s_block, loaded as such (no layout conversion in registers)."""
    return tl.load(base + offs_r[None, :] * D + offs_c[:, None],
                   mask=(offs_r < D)[None, :] & (offs_c < D)[:, None], other=0.0)


@triton.jit
def _put_block(base, offs_r, offs_c, D, x, ATOMIC: tl.constexpr):
    ptr = base + offs_r[:, None] * D + offs_c[None, :]
    mask = (offs_r < D)[:, None] & (offs_c < D)[None, :]
    if ATOMIC:
        tl.atomic_add(ptr, x, mask=mask, sem="relaxed")
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _put_vec(base, offs, D, x, ATOMIC: tl.constexpr):
    if ATOMIC:
        tl.atomic_add(base + offs, x, mask=offs < D, sem="relaxed")
    else:
        tl.store(base + offs, x, mask=offs < D)


@triton.jit
def _state_range2(x_base, v_base, sx_n, sx_d, sv_n, sv_d, start, end, offs_a, offs_b, D,
                  scale, power, offset, alpha, norm_eps, bh, N,
                  QUERY: tl.constexpr, COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr,
                  BB: tl.constexpr, PREC: tl.constexpr, DEN, DDEN):
    """_state_range with split tiles: per half the blocks S[a,a], S[a,b], S[b,a], S[b,b]
    and z[a], z[b]."""
    s1aa = tl.zeros((BA, BA), dtype=tl.float32)
    s1ab = tl.zeros((BA, BB), dtype=tl.float32)
    s1ba = tl.zeros((BA, BB), dtype=tl.float32)  # transposed
    s1bb = tl.zeros((BB, BB), dtype=tl.float32)
    s2aa = tl.zeros((BA, BA), dtype=tl.float32)
    s2ab = tl.zeros((BA, BB), dtype=tl.float32)
    s2ba = tl.zeros((BA, BB), dtype=tl.float32)
    s2bb = tl.zeros((BB, BB), dtype=tl.float32)
    z1a = tl.zeros((BA,), dtype=tl.float32)
    z2a = tl.zeros((BA,), dtype=tl.float32)
    z1b = tl.zeros((BB,), dtype=tl.float32)
    z2b = tl.zeros((BB,), dtype=tl.float32)
    a_mask = offs_a < D
    b_mask = offs_b < D
    rows = tl.cast(start, tl.int64)                    # the range's first token: int64 base offsets
    x_base += rows * sx_n
    v_base += rows * sv_n
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        offs_r = offs_n - start                        # within the range: int32 products
        xa = _load_block(x_base, sx_n, sx_d, offs_r, offs_a, n_mask, a_mask)
        xb = _load_block(x_base, sx_n, sx_d, offs_r, offs_b, n_mask, b_mask)
        wa = _load_block(v_base, sv_n, sv_d, offs_r, offs_a, n_mask, a_mask)
        wb = _load_block(v_base, sv_n, sv_d, offs_r, offs_b, n_mask, b_mask)
        if QUERY:
            f1a, f2a, f1b, f2b, _ha, _hb, _n, _c, _p, _t = _query_features2(xa, xb, scale, power, offset, alpha,
                                                                            norm_eps, COSINE, PREC)
            den = tl.load(DEN + bh * N + offs_n, mask=n_mask, other=1.0)
            d_den = tl.load(DDEN + bh * N + offs_n, mask=n_mask, other=0.0)
            wa = wa / den[:, None]
            wb = wb / den[:, None]
            z1a += tl.sum(f1a * d_den[:, None], 0)
            z2a += tl.sum(f2a * d_den[:, None], 0)
            z1b += tl.sum(f1b * d_den[:, None], 0)
            z2b += tl.sum(f2b * d_den[:, None], 0)
        else:
            f1a, f2a, f1b, f2b = _key_features2(xa, xb, power, alpha, norm_eps, COSINE, PREC)
            z1a += tl.sum(f1a, 0)
            z2a += tl.sum(f2a, 0)
            z1b += tl.sum(f1b, 0)
            z2b += tl.sum(f2b, 0)
        s1aa += _dot(tl.trans(f1a), wa, PREC)
        s1ab += _dot(tl.trans(f1a), wb, PREC)
        s1ba += _dot(tl.trans(wa), f1b, PREC)          # S[b,a]ᵀ: M = BA rows (wgmma)
        s1bb += _dot(tl.trans(f1b), wb, PREC)
        s2aa += _dot(tl.trans(f2a), wa, PREC)
        s2ab += _dot(tl.trans(f2a), wb, PREC)
        s2ba += _dot(tl.trans(wa), f2b, PREC)
        s2bb += _dot(tl.trans(f2b), wb, PREC)
    return s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb, z1a, z2a, z1b, z2b


@triton.jit
def _put_state2(s_base, z_base, D, offs_a, offs_b, s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb,
                z1a, z2a, z1b, z2b, inv_n, ATOMIC: tl.constexpr):
    """Store (or atomically add) the split state times 1/N into (2, D, D) and (2, D)."""
    _put_block(s_base, offs_a, offs_a, D, s1aa * inv_n, ATOMIC)
    _put_block(s_base, offs_a, offs_b, D, s1ab * inv_n, ATOMIC)
    _put_block(s_base, offs_b, offs_a, D, tl.trans(s1ba * inv_n), ATOMIC)
    _put_block(s_base, offs_b, offs_b, D, s1bb * inv_n, ATOMIC)
    _put_block(s_base + D * D, offs_a, offs_a, D, s2aa * inv_n, ATOMIC)
    _put_block(s_base + D * D, offs_a, offs_b, D, s2ab * inv_n, ATOMIC)
    _put_block(s_base + D * D, offs_b, offs_a, D, tl.trans(s2ba * inv_n), ATOMIC)
    _put_block(s_base + D * D, offs_b, offs_b, D, s2bb * inv_n, ATOMIC)
    _put_vec(z_base, offs_a, D, z1a * inv_n, ATOMIC)
    _put_vec(z_base, offs_b, D, z1b * inv_n, ATOMIC)
    _put_vec(z_base + D, offs_a, D, z2a * inv_n, ATOMIC)
    _put_vec(z_base + D, offs_b, D, z2b * inv_n, ATOMIC)


@triton.jit
def _state_kernel_split(
    X, V, ScaleP, S_part, Z_part,
    sx_b, sx_h, sx_n, sx_d, sv_b, sv_h, sv_n, sv_d,
    H, N, D: tl.constexpr, tokens_per_split, n_splits, inv_n,
    power, offset, alpha, norm_eps,
    QUERY: tl.constexpr, COSINE: tl.constexpr,
    BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, PREC: tl.constexpr,
    DEN=None, DDEN=None, ATOMIC: tl.constexpr = False,
):
    """_state_kernel with split tiles. Grid: (B·H, splits)."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    scale = tl.load(ScaleP + bh % H)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, N)
    s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb, z1a, z2a, z1b, z2b = _state_range2(
        X + _head_offset(bh, H, sx_b, sx_h), V + _head_offset(bh, H, sv_b, sv_h), sx_n, sx_d, sv_n, sv_d,
        start, end, offs_a, offs_b, D, scale, power, offset, alpha, norm_eps, bh, N,
        QUERY, COSINE, BLOCK_N, BA, BB, PREC, DEN, DDEN)
    part = bh if ATOMIC else bh * n_splits + split
    _put_state2(S_part + part * 2 * D * D, Z_part + part * 2 * D, D, offs_a, offs_b,
                s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb, z1a, z2a, z1b, z2b, inv_n, ATOMIC)


@triton.jit
def _row_norm2(base, s_n, s_d, offs_n, n_mask, offs_a, offs_b, D, norm_eps):
    """‖x‖ over both tiles of a (BN, D) slice, and max(‖x‖, ε)."""
    xa = _load_block(base, s_n, s_d, offs_n, offs_a, n_mask, offs_a < D)
    xb = _load_block(base, s_n, s_d, offs_n, offs_b, n_mask, offs_b < D)
    norm = tl.sqrt(tl.sum(xa * xa, 1) + tl.sum(xb * xb, 1))
    return norm, tl.maximum(norm, norm_eps)


@triton.jit
def _output_block2(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D, s_base, z_base,
                   scale, power, offset, alpha, norm_eps, eps, COSINE: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr):
    """_output_block with split tiles: the output's value lanes a and b, and the denominator.
    The features in chunks of BC lanes (a loop), each meeting its BC rows of S: one
    chunk's features live at a time."""
    norm, clamped = _row_norm2(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D, norm_eps)
    p = power * (offset + _tanh(norm / scale))
    s2 = s_base + D * D
    num_a = tl.zeros((BLOCK_N, BA), dtype=tl.float32)
    num_b = tl.zeros((BLOCK_N, BB), dtype=tl.float32)
    den = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        c_mask = offs_c < D
        f1, f2, _h = _query_tile(_load_block(q_base, sq_n, sq_d, offs_n, offs_c, n_mask, c_mask), clamped, p, alpha,
                                 COSINE, PREC)
        num_a += _dot(f1, _s_block(s_base, offs_c, offs_a, D), PREC)
        num_a += _dot(f2, _s_block(s2, offs_c, offs_a, D), PREC)
        num_b += _dot(f1, _s_block(s_base, offs_c, offs_b, D), PREC)
        num_b += _dot(f2, _s_block(s2, offs_c, offs_b, D), PREC)
        z1 = tl.load(z_base + offs_c, mask=c_mask, other=0.0)
        z2 = tl.load(z_base + D + offs_c, mask=c_mask, other=0.0)
        den += tl.sum(f1 * z1[None, :] + f2 * z2[None, :], 1)
    den += eps
    return num_a / den[:, None], num_b / den[:, None], den


@triton.jit
def _store_tile(base, s_n, s_d, offs_n, offs_d, N, D, x, ADD: tl.constexpr = False):
    """A (BN, tile) block into an (N, D) slice with strides (s_n, s_d); ADD: added to
    what the slice holds."""
    ptr = base + offs_n[:, None] * s_n + offs_d[None, :] * s_d
    mask = (offs_n < N)[:, None] & (offs_d < D)[None, :]
    if ADD:
        x += tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _forward_kernel_split(
    K, V, Q, ScaleP, S, Z, O, DEN,
    sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sq_b, sq_h, sq_n, sq_d, so_b, so_h, so_n, so_d,
    H, N, D: tl.constexpr, inv_n,
    power, offset, alpha, norm_eps, eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, BLOCK_O: tl.constexpr = 64, BC: tl.constexpr = 16,
):
    """_forward_kernel with split tiles. The state is stored, then read back block by
    block for the output (after a barrier: the program's own stores), which keeps the
    output loop's registers those of _output_kernel_split; the output runs on token blocks
    of BLOCK_O (the output kernel's block: wgmma needs 64 rows), the feature lanes in
    chunks of BC. Grid: (B·H,)."""
    bh = tl.program_id(0).to(tl.int64)
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    scale = tl.load(ScaleP + bh % H)
    s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb, z1a, z2a, z1b, z2b = _state_range2(
        K + _head_offset(bh, H, sk_b, sk_h), V + _head_offset(bh, H, sv_b, sv_h), sk_n, sk_d, sv_n, sv_d,
        0, N, offs_a, offs_b, D, scale, power, offset, alpha, norm_eps, bh, N,
        False, COSINE, BLOCK_N, BA, BB, PREC, None, None)
    s_base = S + bh * 2 * D * D
    _put_state2(s_base, Z + bh * 2 * D, D, offs_a, offs_b, s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb,
                z1a, z2a, z1b, z2b, inv_n, False)
    tl.debug_barrier()
    q_base = Q + _head_offset(bh, H, sq_b, sq_h)
    o_base = O + _head_offset(bh, H, so_b, so_h)
    for n0 in range(0, N, BLOCK_O):
        offs_n = n0 + tl.arange(0, BLOCK_O)
        n_mask = offs_n < N
        out_a, out_b, den = _output_block2(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D, s_base,
                                           Z + bh * 2 * D, scale, power, offset, alpha, norm_eps, eps,
                                           COSINE, PREC, BLOCK_O, BA, BB, BC)
        _store_tile(o_base, so_n, so_d, offs_n, offs_a, N, D, out_a)
        _store_tile(o_base, so_n, so_d, offs_n, offs_b, N, D, out_b)
        tl.store(DEN + bh * N + offs_n, den, mask=n_mask)


@triton.jit
def _output_kernel_split(
    Q, ScaleP, S, Z, O, DEN,
    sq_b, sq_h, sq_n, sq_d, so_b, so_h, so_n, so_d,
    H, N, D: tl.constexpr,
    power, offset, alpha, norm_eps, eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, BC: tl.constexpr = 16,
):
    """_output_kernel with split tiles. Grid: (B·H, token blocks)."""
    bh = tl.program_id(0).to(tl.int64)
    row0 = (tl.program_id(1) * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - tl.program_id(1) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    scale = tl.load(ScaleP + bh % H)
    out_a, out_b, den = _output_block2(Q + _head_offset(bh, H, sq_b, sq_h) + row0 * sq_n, sq_n, sq_d, offs_n, offs_n < n_left,
                                       offs_a, offs_b, D, S + bh * 2 * D * D, Z + bh * 2 * D,
                                       scale, power, offset, alpha, norm_eps, eps, COSINE, PREC, BLOCK_N, BA, BB, BC)
    o_base = O + _head_offset(bh, H, so_b, so_h) + row0 * so_n
    _store_tile(o_base, so_n, so_d, offs_n, offs_a, n_left, D, out_a)
    _store_tile(o_base, so_n, so_d, offs_n, offs_b, n_left, D, out_b)
    tl.store(DEN + bh * N + row0 + offs_n, den, mask=offs_n < n_left)


@triton.jit
def _state_t_chunk(ua, ub, s_half, D, offs_c, offs_a, offs_b, PREC: tl.constexpr):
    """u Sᵀ for one state half, feature lanes offs_c (a chunk), from the value tiles (ua, ub)."""
    g = _dot(ua, _s_block_t(s_half, offs_c, offs_a, D), PREC)
    g += _dot(ub, _s_block_t(s_half, offs_c, offs_b, D), PREC)
    return g


@triton.jit
def _dq_kernel_split(
    Q, G, ScaleP, S, Z, DEN, DQ, DDEN, DU,
    sq_b, sq_h, sq_n, sq_d, sg_b, sg_h, sg_n, sg_d, sdq_b, sdq_h, sdq_n, sdq_d,
    H, N, D: tl.constexpr,
    power, offset, alpha, norm_eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, NEED_DU: tl.constexpr, DQ_STRIDED: tl.constexpr = False, BC: tl.constexpr = 16,
):
    """_dq_kernel with split tiles (DQ through its strides where DQ_STRIDED, else
    contiguous with constant strides), the feature lanes in chunks of BC (loops): one
    chunk's features and ∂L/∂φ live at a time. Two passes over the chunks. ∂L/∂q is linear
    in ∂L/∂φ = (g/den) Sᵀ + ∂L/∂den·zᵀ, so the first pass takes the row sums that need
    ∂L/∂den (∂L/∂p, Σ ∂L/∂q̂·q̂) as their (g/den) Sᵀ part plus ∂L/∂den times their zᵀ
    part, beside ∂L/∂den itself; the second computes ∂L/∂q per chunk (features and the
    products again). Grid: (B·H, token blocks)."""
    bh = tl.program_id(0).to(tl.int64)
    row0 = (tl.program_id(1) * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - tl.program_id(1) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    n_mask = offs_n < n_left
    den = tl.load(DEN + bh * N + row0 + offs_n, mask=n_mask, other=1.0)
    g_base = G + _head_offset(bh, H, sg_b, sg_h) + row0 * sg_n
    ua = _load_block(g_base, sg_n, sg_d, offs_n, offs_a, n_mask, offs_a < D) / den[:, None]
    ub = _load_block(g_base, sg_n, sg_d, offs_n, offs_b, n_mask, offs_b < D) / den[:, None]
    s_base = S + bh * 2 * D * D
    z_base = Z + bh * 2 * D
    q_base = Q + _head_offset(bh, H, sq_b, sq_h) + row0 * sq_n
    scale = tl.load(ScaleP + bh % H)
    norm, clamped = _row_norm2(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D, norm_eps)
    t_norm = _tanh(norm / scale)
    p = power * (offset + t_norm)
    sum_fg = tl.zeros((BLOCK_N,), dtype=tl.float32)     # Σ φ·((g/den) Sᵀ)
    dp_g = tl.zeros((BLOCK_N,), dtype=tl.float32)       # ∂L/∂p, (g/den) Sᵀ part
    dp_z = tl.zeros((BLOCK_N,), dtype=tl.float32)       # ∂L/∂p per unit ∂L/∂den
    dot_g = tl.zeros((BLOCK_N,), dtype=tl.float32)      # Σ ∂L/∂q̂·q̂, the same two parts
    dot_z = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        c_mask = offs_c < D
        g1 = _state_t_chunk(ua, ub, s_base, D, offs_c, offs_a, offs_b, PREC)
        g2 = _state_t_chunk(ua, ub, s_base + D * D, D, offs_c, offs_a, offs_b, PREC)
        f1, f2, h = _query_tile(_load_block(q_base, sq_n, sq_d, offs_n, offs_c, n_mask, c_mask), clamped, p, alpha,
                                COSINE, PREC)
        sum_fg += tl.sum(f1 * g1 + f2 * g2, 1)
        d_hat, d_p = _query_grad_tile(f1, f2, g1, g2, h, p, alpha, COSINE, PREC)
        dp_g += d_p
        dot_g += tl.sum(d_hat * h, 1)
        z1 = tl.zeros_like(g1) + tl.load(z_base + offs_c, mask=c_mask, other=0.0)[None, :]
        z2 = tl.zeros_like(g2) + tl.load(z_base + D + offs_c, mask=c_mask, other=0.0)[None, :]
        d_hat, d_p = _query_grad_tile(f1, f2, z1, z2, h, p, alpha, COSINE, PREC)
        dp_z += d_p
        dot_z += tl.sum(d_hat * h, 1)
    # (g/den)·num/den = φ_q · ((g/den) Sᵀ) / den: num is never formed.
    d_den = -sum_fg / den
    tl.store(DDEN + bh * N + row0 + offs_n, d_den, mask=n_mask)
    d_u = (dp_g + d_den * dp_z) * power * (1.0 - t_norm * t_norm)
    c = _unit_row_term(norm, clamped, dot_g + d_den * dot_z, d_u / scale, norm_eps)
    if DQ_STRIDED:
        dq_base = DQ + _head_offset(bh, H, sdq_b, sdq_h) + row0 * sdq_n
        sdq_nn = sdq_n
        sdq_dd = sdq_d
    else:
        dq_base = DQ + (bh * N + row0) * D
        sdq_nn = D
        sdq_dd = 1
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        c_mask = offs_c < D
        g1 = _state_t_chunk(ua, ub, s_base, D, offs_c, offs_a, offs_b, PREC)
        g2 = _state_t_chunk(ua, ub, s_base + D * D, D, offs_c, offs_a, offs_b, PREC)
        g1 += d_den[:, None] * tl.load(z_base + offs_c, mask=c_mask, other=0.0)[None, :]
        g2 += d_den[:, None] * tl.load(z_base + D + offs_c, mask=c_mask, other=0.0)[None, :]
        q = _load_block(q_base, sq_n, sq_d, offs_n, offs_c, n_mask, c_mask)
        f1, f2, h = _query_tile(q, clamped, p, alpha, COSINE, PREC)
        d_hat, _dp = _query_grad_tile(f1, f2, g1, g2, h, p, alpha, COSINE, PREC)
        _store_tile(dq_base, sdq_nn, sdq_dd, offs_n, offs_c, n_left, D, d_hat / clamped[:, None] + c[:, None] * q)
    if NEED_DU:
        tl.store(DU + bh * N + row0 + offs_n, -d_u * norm / (scale * scale), mask=n_mask)


@triton.jit
def _dkv_chunk(k_base, sk_n, sk_d, va, vb, ds_base, dz_base, offs_n, n_mask, offs_c, offs_a, offs_b, D, clamped,
               power, alpha, COSINE: tl.constexpr, PREC: tl.constexpr):
    """For the feature lanes offs_c (a chunk): k, φ_k's halves, x̂ (_key_tile) and
    ∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z per half, from the value tiles (va, vb)."""
    c_mask = offs_c < D
    g1 = _state_t_chunk(va, vb, ds_base, D, offs_c, offs_a, offs_b, PREC)
    g2 = _state_t_chunk(va, vb, ds_base + D * D, D, offs_c, offs_a, offs_b, PREC)
    g1 += tl.load(dz_base + offs_c, mask=c_mask, other=0.0)[None, :]
    g2 += tl.load(dz_base + D + offs_c, mask=c_mask, other=0.0)[None, :]
    k = _load_block(k_base, sk_n, sk_d, offs_n, offs_c, n_mask, c_mask)
    f1, f2, h = _key_tile(k, clamped, power, alpha, COSINE, PREC)
    return k, f1, f2, h, g1, g2


@triton.jit
def _dkv_kernel_split(
    K, V, DS, DZ, DK, DV,
    sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sdk_b, sdk_h, sdk_n, sdk_d, sdv_b, sdv_h, sdv_n, sdv_d,
    H, N, D: tl.constexpr,
    power, alpha, norm_eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, ADD_DV: tl.constexpr, BC: tl.constexpr = 16,
):
    """_dkv_kernel with split tiles (ADD_DV as there), the feature lanes in chunks of BC
    (loops): ∂L/∂v = Σ_halves φ_k ∂L/∂S over the chunks; then, in the cosine mode, Σ
    ∂L/∂k̂·k̂ (the unit vector's row term, a sum over every lane) over the chunks; then
    ∂L/∂k per chunk, with ∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z and the features again.
    Grid: (B·H, token blocks)."""
    bh = tl.program_id(0).to(tl.int64)
    row0 = (tl.program_id(1) * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - tl.program_id(1) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    n_mask = offs_n < n_left
    k_base = K + _head_offset(bh, H, sk_b, sk_h) + row0 * sk_n
    ds_base = DS + bh * 2 * D * D
    ds2 = ds_base + D * D
    dz_base = DZ + bh * 2 * D
    if COSINE:
        norm, clamped = _row_norm2(k_base, sk_n, sk_d, offs_n, n_mask, offs_a, offs_b, D, norm_eps)
    else:
        norm = tl.zeros((BLOCK_N,), dtype=tl.float32)
        clamped = norm
    dva = tl.zeros((BLOCK_N, BA), dtype=tl.float32)
    dvb = tl.zeros((BLOCK_N, BB), dtype=tl.float32)
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        f1, f2, _h = _key_tile(_load_block(k_base, sk_n, sk_d, offs_n, offs_c, n_mask, offs_c < D), clamped, power,
                               alpha, COSINE, PREC)
        dva += _dot(f1, _s_block(ds_base, offs_c, offs_a, D), PREC)
        dva += _dot(f2, _s_block(ds2, offs_c, offs_a, D), PREC)
        dvb += _dot(f1, _s_block(ds_base, offs_c, offs_b, D), PREC)
        dvb += _dot(f2, _s_block(ds2, offs_c, offs_b, D), PREC)
    dv_base = DV + _head_offset(bh, H, sdv_b, sdv_h) + row0 * sdv_n
    _store_tile(dv_base, sdv_n, sdv_d, offs_n, offs_a, n_left, D, dva, ADD_DV)
    _store_tile(dv_base, sdv_n, sdv_d, offs_n, offs_b, n_left, D, dvb, ADD_DV)
    v_base = V + _head_offset(bh, H, sv_b, sv_h) + row0 * sv_n
    va = _load_block(v_base, sv_n, sv_d, offs_n, offs_a, n_mask, offs_a < D)
    vb = _load_block(v_base, sv_n, sv_d, offs_n, offs_b, n_mask, offs_b < D)
    c = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if COSINE:
        dot_hat = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for c0 in range(0, D, BC):
            offs_c = c0 + tl.arange(0, BC)
            k, f1, f2, h, g1, g2 = _dkv_chunk(k_base, sk_n, sk_d, va, vb, ds_base, dz_base, offs_n, n_mask, offs_c,
                                              offs_a, offs_b, D, clamped, power, alpha, COSINE, PREC)
            _b_db, d_hat = _lift_grad(f1, f2, g1, g2, h, alpha, COSINE)
            dot_hat += tl.sum(d_hat * h, 1)
        c = _unit_row_term(norm, clamped, dot_hat, c, norm_eps)
    dk_base = DK + _head_offset(bh, H, sdk_b, sdk_h) + row0 * sdk_n
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        k, f1, f2, h, g1, g2 = _dkv_chunk(k_base, sk_n, sk_d, va, vb, ds_base, dz_base, offs_n, n_mask, offs_c,
                                          offs_a, offs_b, D, clamped, power, alpha, COSINE, PREC)
        part, _s = _key_grad_tile(k, f1, f2, g1, g2, h, clamped, power, alpha, COSINE)
        _store_tile(dk_base, sdk_n, sdk_d, offs_n, offs_c, n_left, D, part + c[:, None] * k)


# --------------------------------------------------------------------------- launcher

# Whether triton.jit built interpreter objects (TRITON_INTERPRET=1 at import time).
INTERPRETED = "Interpreted" in type(_output_kernel).__name__


# Launch configurations, one per kind of kernel (``KINDS``): the single-launch forward
# ("forward"), the state passes ("state": forward and backward), the output ("out"), dq
# ("dq") and dk/dv ("dkv"). Each entry (BLOCK_N, BV, num_warps, num_stages, maxnreg) for a
# padded head dim BD (power of two), or (BLOCK_N, num_warps, num_stages, maxnreg) for a
# split one (``_SPLIT_CONFIGS``); num_stages None: Triton's default (3), maxnreg None: no
# register cap (else ptxas's ``.maxnreg``: where a kernel's live values fit under it, ptxas
# keeps fewer values in flight instead of spilling; the compile test holds that none spills).
# BV < BD: the output and forward kernels take the value tiles on a grid axis (φ computed
# once per tile), dq and dkv loop over them in the program.
#
# The fused variant's entries were chosen by the compile report
# (``benchmarks/triton_compile_check.py``: ptxas of Triton 3.8, sm_90a, bf16/fp16, no GPU),
# not by timing: every kernel at D = 64 and 72 reaches two programs per SM (8 warps at ≤ 128
# registers, or 4 warps at ≤ 255) with no spill, wgmma (HGMMA) wherever it ran before.
# ``_PREVIOUS_CONFIGS`` / ``_PREVIOUS_SPLIT_CONFIGS`` are the entries before that (one
# program per SM at D = 64 and 72), reachable as ``launch_config(d, {"table": "previous"})``
# for ``benchmarks/triton_configs.py``'s GPU sweep, which times both.
# D = 64 (8 warps, registers before → after): forward at BLOCK_N 32 capped to 128 (141 →
# 128; 4 warps: 231, 64 tokens spill); output capped to 128 (155 → 128, still wgmma; BV 32
# would reach 99 but compute φ twice, BLOCK_N 32 80 but on mma.sync); dq and dkv on 16
# tokens (196 → 109, 248 → 110; both were and stay mma.sync: with 64 tokens, wgmma, they
# spill 56-812 B even when capped); dkv with BV 32 (64 keeps more of ∂L/∂S loaded: 175).
# fp32 inputs with exact FMA products (the reference-precision default) spill 0.3-18 KB at
# D ≥ 64 (not a target); with torch.set_float32_matmul_precision("high") they take the TF32
# path. At D = 72 padded (BD 128: the baseline) no block size tried reaches 128 registers
# (140-255); the fused variant splits 72 (``_SPLIT_CONFIGS``).
KINDS = ("forward", "state", "out", "dq", "dkv")
_PREVIOUS_CONFIGS = {
    # BD: (BLOCK_N, BV, warps) for the state passes (forward too), the output, dq and dkv
    16: ((64, 16, 4), (64, 16, 4), (32, 16, 4)),
    32: ((64, 32, 4), (64, 32, 4), (32, 32, 8)),
    64: ((32, 64, 8), (64, 64, 8), (32, 64, 8)),
    128: ((32, 64, 8), (32, 128, 8), (16, 32, 8)),
}
# The baseline variant's table (before the rework), for the A/B.
_BASELINE_CONFIGS = {**_PREVIOUS_CONFIGS, 64: ((64, 64, 8), (64, 64, 8), (32, 64, 8))}


def _by_kind(state, out, bwd):
    """A three-group entry (state, output, dq/dkv) as one entry per kind, no cap."""
    return dict(forward=(*state, None, None), state=(*state, None, None), out=(*out, None, None),
                dq=(*bwd, None, None), dkv=(*bwd, None, None))


_CONFIGS = {bd: _by_kind(*groups) for bd, groups in _PREVIOUS_CONFIGS.items()}
_CONFIGS[64] = dict(forward=(32, 64, 8, None, 128), state=(32, 64, 8, None, None), out=(64, 64, 8, None, 128),
                    dq=(16, 64, 8, None, None), dkv=(16, 32, 8, None, None))


# Split head dims (fused variant): (BLOCK_N, num_warps, num_stages, maxnreg) per kind; one
# program covers every value lane (NV = 1). The output, dq, dkv (and the forward's output
# loop) take the feature lanes in chunks of ``SPLIT_CHUNK`` (see _output_block2). D = 72 (64
# + 16), bf16, sm_90a, registers before → after: the state passes at 16 tokens on 4 warps
# (173 on 8 → 234 / 244 on 4: two programs; on 8 warps capped at 128 they spill 116 B);
# output, dq, dkv on 64 tokens (wgmma), 8 warps, capped at 128 (170 → 128, 255 + 28 B spill
# → 128, 255 + 52 B → 128; dkv with num_stages 1: 20-36 B spill with 2 or 3); uncapped the
# chunked kernels take 159 / 175 / 140 (on 4 warps 195 / 255 / 191), the unchunked ones
# spilled at any cap and on 4 warps. The forward on 4 warps, 16 tokens per state block and
# 64 per output block: 255 + 124 B spill and 126 KB of shared memory (one program by either)
# → 237, no spill, 26 KB. At D = 72 the previous entries run the chunked kernels too: the
# kernels before them are the baseline variant's (padded) or git's (76bcfee). Other split
# dims share the entries (not tuned: no preset uses them): D = 40 fits two programs with no
# spill; D = 96 (64 + 32) too, but spills 100 B in dstate (0 before, on 8 warps), 16 B in dq
# and 20 B in dkv (376 and 184 B before) and 0 in the forward (136 B before).
_PREVIOUS_SPLIT_CONFIGS = dict(forward=(16, 8, None, None), state=(16, 8, None, None), out=(64, 8, None, None),
                               dq=(64, 8, None, None), dkv=(64, 8, None, None))
_SPLIT_CONFIGS = dict(forward=(16, 4, None, None), state=(16, 4, None, None), out=(64, 8, None, 128),
                      dq=(64, 8, None, 128), dkv=(64, 8, 1, 128))
SPLIT_CHUNK = 16


def split_tiles(head_dim: int) -> tuple[int, int] | None:
    """(BA, BB) for a head dim that runs as two tiles, lanes [0, BA) and [BA, BA + BB):
    BA the largest power of two ≤ D, BB the power of two (≥ 16, what tl.dot needs) that
    covers the rest; None where that is no narrower than one padded tile (powers of two,
    D < 32, D just under a power of two such as 120)."""
    if head_dim < 32:
        return None
    ba = 1 << (head_dim.bit_length() - 1)
    bb = max(16, triton.next_power_of_2(head_dim - ba)) if head_dim > ba else 0
    return (ba, bb) if bb and ba + bb < triton.next_power_of_2(head_dim) else None


def launch_config(head_dim: int, override: dict | None = None, variant: str = "baseline") -> dict:
    """Launch configuration per kind of kernel (``KINDS``) for a head dim: BD is D padded to
    a power of two (≥ 16, what tl.dot needs), then ``_CONFIGS``; in the fused variant a D
    that ``split_tiles`` splits runs as two tiles (BA, BB; ``_SPLIT_CONFIGS``, one value
    tile, feature chunks of BC). ``override``: {"table": "previous"} takes the entries from
    before the register work (``_PREVIOUS_CONFIGS``); otherwise its BLOCK_N, BV,
    num_warps replace every kind's values (block-size sweeps; BV is unused where split),
    with Triton's default stages and no register cap."""
    override = dict(override or {})
    previous = override.pop("table", None) == "previous"
    bd = max(16, triton.next_power_of_2(head_dim))
    cfg = dict(BD=bd)
    tiles = split_tiles(head_dim) if variant == "fused" else None
    if tiles:
        cfg.update(BA=tiles[0], BB=tiles[1])
        table = _PREVIOUS_SPLIT_CONFIGS if previous else _SPLIT_CONFIGS
        for kind in KINDS:
            block_n, warps, stages, maxnreg = table[kind]
            sub = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages, maxnreg=maxnreg)
            if override:
                sub.update({k: v for k, v in override.items() if k != "BV"}, num_stages=None, maxnreg=None)
            sub["NV"] = 1
            if kind != "state":
                sub["BC"] = SPLIT_CHUNK
            cfg[kind] = sub
        return cfg
    if variant == "baseline":
        table = _by_kind(*_BASELINE_CONFIGS[bd])
    else:
        table = _by_kind(*_PREVIOUS_CONFIGS[bd]) if previous else _CONFIGS[bd]
    for kind in KINDS:
        block_n, bv, warps, stages, maxnreg = table[kind]
        sub = dict(BLOCK_N=block_n, BV=bv, num_warps=warps, num_stages=stages, maxnreg=maxnreg)
        if override:
            sub.update(override, num_stages=None, maxnreg=None)
        sub["NV"] = bd // sub["BV"]
        cfg[kind] = sub
    return cfg


def _compile_opts(sub: dict) -> dict:
    """A kind's launch options: num_warps, and num_stages / maxnreg where set."""
    return dict(num_warps=sub["num_warps"], **{k: sub[k] for k in ("num_stages", "maxnreg") if sub.get(k)})


# Which kernels run: "fused" (the default) reduces the partial states inside the state
# kernel with fp32 atomic adds into one zeroed state, runs the whole forward as one launch
# where one token range per head suffices, and splits the tokens into ranges of
# MIN_SPLIT_TOKENS["fused"] so that the state passes give every SM work from batch 1 at
# N ≥ 1,024; "baseline" is the code before the rework (partial states summed by separate
# ``torch.sum`` launches, ranges ≥ 512 tokens, state and output as two launches), kept for
# an A/B in one GPU run. Read once, at import: NALA_TRITON_VARIANT=baseline; a call can
# also name it in ``opts["variant"]``.
VARIANTS = ("fused", "baseline")
VARIANT = "baseline"
if VARIANT not in VARIANTS:
    raise ValueError(f"NALA_TRITON_VARIANT={VARIANT!r}: expected one of {', '.join(VARIANTS)}")

# Fewest tokens per range of the state passes. Baseline: each range wrote a partial state
# of 2·D·(D+1) fp32 per head, so ranges of ≥ 512 tokens kept the partials small (at most
# D/128 of one bf16 input's bytes). Fused: ranges add into one state, so a range can be one
# token block (64): N = 1,024 gives 16 ranges per head, B·H·16 programs (H = 16: 256).
MIN_SPLIT_TOKENS = {"fused": 64, "baseline": 512}
# Below this many tokens the forward is one launch (state + output in one program per
# head and value tile) whatever the GPU's size: the call is launch-bound there.
SHORT_TOKENS = 1024


def _programs_target(device: torch.device) -> int:
    """How many programs the state passes aim for: about 4 per SM on CUDA; 1 elsewhere (the
    interpreter runs programs one after another: fewest is fastest). The compile report's
    stand-in driver sets it for the GPU it compiles for."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def num_splits(n_tokens: int, n_heads_total: int, n_vtiles: int, device: torch.device,
               variant: str = "baseline") -> int:
    """Token ranges per head for the two state passes: enough programs to fill the GPU
    (about 4 per SM; B·H alone is often a few dozen), no range under MIN_SPLIT_TOKENS;
    one range (the single-launch forward) below SHORT_TOKENS in the fused variant."""
    target = _programs_target(device)
    if variant == "fused" and n_tokens < SHORT_TOKENS:
        return 1
    want = -(-target // (n_heads_total * n_vtiles))
    return max(1, min(want, n_tokens // MIN_SPLIT_TOKENS[variant]))


def fit_splits(splits: int, n: int, *tensors: torch.Tensor) -> int:
    """``splits`` raised where needed so that no token range spans 2^30 elements of any
    tensor's token stride: the state passes offset each range's base in int64 and the
    tokens within it in int32 (a gated layer's stride 4C passes 2^31 at N·4C, at XL/2's
    C = 1,152 from 466K tokens); one range is also what picks the single-launch forward,
    whose offsets are int32."""
    stride = max(max(abs(t.stride(-2)), t.shape[-1]) for t in tensors)
    return max(splits, triton.cdiv(n * stride, 2**30))


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())


def _kernel_for(name: str, cfg: dict):
    """The kernel ``name`` for a launch config: its ``_split`` form where the head dim is
    split (looked up at call time, so that tests can wrap either)."""
    return globals()[name + "_split" if "BA" in cfg else name]


def _tile_args(cfg: dict, group: str, nv: bool = False) -> dict:
    """The head-dim constexprs of a kernel: BA, BB (split) or BD, BV (and NV)."""
    if "BA" in cfg:
        return dict(BA=cfg["BA"], BB=cfg["BB"], **({"BC": cfg[group]["BC"]} if "BC" in cfg[group] else {}))
    args = dict(BD=cfg["BD"], BV=cfg[group]["BV"])
    if nv:
        args["NV"] = cfg[group]["NV"]
    return args


def _ranges(n: int, splits: int, block_n: int) -> tuple[int, int]:
    """(tokens per range, ranges) of a state pass asked for ``splits`` ranges: whole blocks each."""
    per_split = triton.cdiv(triton.cdiv(n, splits), block_n) * block_n
    return per_split, triton.cdiv(n, per_split)


def launch_grids(b: int, h: int, n: int, cfg: dict, splits: int, variant: str = "baseline") -> dict[str, tuple]:
    """The grid of each NaLa kernel for (B, H, N) heads, ``launch_config``'s ``cfg`` and
    ``splits`` token ranges, as the launches use them: ``forward`` (the single launch, where
    it runs), ``state`` (both state passes), ``output``, ``dq``, ``dkv``. Axes after the first
    stay within CUDA's 65,535 up to ``TRITON_MAX_TOKENS`` (token blocks of ≥ 16)."""
    grids = dict(state=(b * h, _ranges(n, splits, cfg["state"]["BLOCK_N"])[1], cfg["state"]["NV"]),
                 output=(b * h, triton.cdiv(n, cfg["out"]["BLOCK_N"]), cfg["out"]["NV"]),
                 dq=(b * h, triton.cdiv(n, cfg["dq"]["BLOCK_N"])), dkv=(b * h, triton.cdiv(n, cfg["dkv"]["BLOCK_N"])))
    if variant == "fused" and splits == 1:
        grids["forward"] = (b * h, cfg["forward"]["NV"])
    return grids


def _state_pass(x, w, scale, opts, cfg, splits, query, den=None, d_den=None):
    """Launch ``_state_kernel`` over ``splits`` token ranges and reduce the ranges: in the
    kernel (atomic adds, fused variant) or by ``torch.sum`` (baseline). Returns ``(S, z)``:
    (B·H, 2, D, D) and (B·H, 2, D), fp32, means over the N tokens."""
    b, h, n, d = x.shape
    st = cfg["state"]
    block_n = st["BLOCK_N"]
    per_split, splits = _ranges(n, splits, block_n)                     # whole blocks
    atomic = opts["variant"] == "fused" and splits > 1
    if atomic:
        # One zeroed buffer (one launch) holds both: S then z, each contiguous.
        buf = x.new_zeros(b * h * 2 * d * (d + 1), dtype=torch.float32)
        s_part = buf[:b * h * 2 * d * d].view(b * h, 2, d, d)
        z_part = buf[b * h * 2 * d * d:].view(b * h, 2, d)
    else:
        s_part = x.new_empty(b * h, splits, 2, d, d, dtype=torch.float32)
        z_part = x.new_empty(b * h, splits, 2, d, dtype=torch.float32)
    _kernel_for("_state_kernel", cfg)[(b * h, splits, st["NV"])](   # launch_grids' "state"
        x, w, scale, s_part, z_part, *_strides(x), *_strides(w),
        h, n, d, per_split, splits, 1.0 / n,
        opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"],
        QUERY=query, COSINE=opts["direction"] == "cosine",
        BLOCK_N=block_n, **_tile_args(cfg, "state"), PREC=opts["precision"],
        DEN=den, DDEN=d_den, ATOMIC=atomic, **_compile_opts(st),
    )
    if atomic:
        return s_part, z_part
    # Baseline: a deterministic sum over the ranges; one range needs no extra kernel.
    if splits == 1:
        return s_part[:, 0], z_part[:, 0]
    return s_part.sum(1), z_part.sum(1)


def forward_launch(q, k, v, scale32, opts: dict, cfg: dict, splits: int, out: torch.Tensor):
    """The forward's launches: ``out`` (B, H, N, D), any strides (a gated layer passes its
    token-layout buffer), gets NaLa's output. Returns what the backward needs: the state
    ``(S, z)`` and the denominator, fp32."""
    b, h, n, d = q.shape
    den = torch.empty(b * h, n, device=q.device, dtype=torch.float32)
    cosine = opts["direction"] == "cosine"
    if opts["variant"] == "fused" and splits == 1:
        # One launch: state and output per (head, value tile); the state kept for the backward.
        state = torch.empty(b * h, 2, d, d, device=q.device, dtype=torch.float32)
        z = torch.empty(b * h, 2, d, device=q.device, dtype=torch.float32)
        fc = cfg["forward"]
        _kernel_for("_forward_kernel", cfg)[launch_grids(b, h, n, cfg, splits)["forward"]](
            k, v, q, scale32, state, z, out, den, *_strides(k), *_strides(v), *_strides(q), *_strides(out),
            h, n, d, 1.0 / n, opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"], opts["eps"],
            COSINE=cosine, BLOCK_N=fc["BLOCK_N"], **_tile_args(cfg, "forward"), PREC=opts["precision"],
            **_compile_opts(fc), **({"BLOCK_O": cfg["out"]["BLOCK_N"]} if "BA" in cfg else {}),
        )
        return state, z, den
    state, z = _state_pass(k, v, scale32, opts, cfg, splits, query=False)
    oc = cfg["out"]
    _kernel_for("_output_kernel", cfg)[launch_grids(b, h, n, cfg, splits, opts["variant"])["output"]](
        q, scale32, state, z, out, den, *_strides(q), *_strides(out), h, n, d,
        opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"], opts["eps"],
        COSINE=cosine, BLOCK_N=oc["BLOCK_N"], **_tile_args(cfg, "out"),
        PREC=opts["precision"], **_compile_opts(oc),
    )
    return state, z, den


def backward_launch(q, k, v, scale32, state, z, den, grad_out, opts: dict, cfg: dict, splits: int,
                    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, need_scale: bool = False,
                    add_dv: bool = False):
    """The backward's launches into ``dq``, ``dk``, ``dv`` (B, H, N, D), any strides; with
    ``add_dv`` ∂L/∂v is added to what ``dv`` holds. Returns ∂L/∂s per token, (B·H, N), when
    ``need_scale``, else None."""
    b, h, n, d = q.shape
    cosine = opts["direction"] == "cosine"
    d_den = torch.empty(b * h, n, device=q.device, dtype=torch.float32)
    d_u = torch.empty(b * h, n, device=q.device, dtype=torch.float32) if need_scale else d_den
    dqc, dkvc = cfg["dq"], cfg["dkv"]
    grids = launch_grids(b, h, n, cfg, splits, opts["variant"])
    _kernel_for("_dq_kernel", cfg)[grids["dq"]](
        q, grad_out, scale32, state, z, den, dq, d_den, d_u,
        *_strides(q), *_strides(grad_out), *_strides(dq), h, n, d,
        opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"],
        COSINE=cosine, BLOCK_N=dqc["BLOCK_N"], **_tile_args(cfg, "dq", nv=True),
        PREC=opts["precision"], NEED_DU=need_scale, DQ_STRIDED=not dq.is_contiguous(), **_compile_opts(dqc),
    )
    d_state, d_z = _state_pass(q, grad_out, scale32, opts, cfg, splits, query=True, den=den, d_den=d_den)
    _kernel_for("_dkv_kernel", cfg)[grids["dkv"]](
        k, v, d_state, d_z, dk, dv, *_strides(k), *_strides(v), *_strides(dk), *_strides(dv), h, n, d,
        opts["power"], opts["alpha"], opts["norm_eps"],
        COSINE=cosine, BLOCK_N=dkvc["BLOCK_N"], **_tile_args(cfg, "dkv", nv=True),
        PREC=opts["precision"], ADD_DV=add_dv, **_compile_opts(dkvc),
    )
    return d_u if need_scale else None


class TritonNaLa(torch.autograd.Function):
    """``nala_attention`` on the Triton kernels above (same contract as
    ``nala._FusedNaLa``). ``scale`` is the norm scale s as an fp32 (H,) tensor; its
    gradient is returned when it requires one (a learned per-head s)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, opts, splits=None, config=None):
        b, h, n, d = q.shape
        variant = opts["variant"]
        cfg = launch_config(d, config, variant)
        if splits is None:
            splits = num_splits(n, b * h, cfg["state"]["NV"], q.device, variant)
        splits = fit_splits(splits, n, q, k, v)
        scale32 = scale.detach().to(device=q.device, dtype=torch.float32).contiguous()
        out = torch.empty(b, h, n, d, device=q.device, dtype=v.dtype)
        state, z, den = forward_launch(q, k, v, scale32, opts, cfg, splits, out)
        ctx.opts, ctx.cfg, ctx.splits = opts, cfg, splits
        ctx.scale_shape = scale.shape
        ctx.save_for_backward(q, k, v, scale32, state, z, den)
        return out

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable
    def backward(ctx, grad_out):
        q, k, v, scale32, state, z, den = ctx.saved_tensors
        b, h, n, d = q.shape
        need_scale = ctx.needs_input_grad[3]
        dq, dk, dv = (torch.empty(b, h, n, d, device=q.device, dtype=t.dtype) for t in (q, k, v))
        d_u = backward_launch(q, k, v, scale32, state, z, den, grad_out, ctx.opts, ctx.cfg, ctx.splits,
                              dq, dk, dv, need_scale)
        d_scale = None
        if need_scale:
            d_scale = d_u.view(b, h, n).sum((0, 2)).reshape(ctx.scale_shape)
        return dq, dk, dv, d_scale, None, None, None


def resolve_opts(q: torch.Tensor, opts: dict) -> dict:
    """``opts`` (the §2 constants) checked against ``q`` and completed with the kernel
    ``variant`` and the products' ``precision`` (where not given), as every caller of the
    kernels takes them."""
    if q.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"impl='triton' needs CUDA tensors, got {q.device.type} (on CPU use impl='fused', "
                         "or set TRITON_INTERPRET=1 before importing nala_dit.attention.triton_kernels to run the "
                         "kernels in Triton's interpreter)")
    reason = unsupported_reason(q)
    if reason:
        raise ValueError(f"impl='triton' does not support {reason}; use impl='fused' or 'eager'")
    # Exact fp32 products for fp32 inputs (matches the reference to rounding) unless torch
    # is allowed TF32 for fp32 matmuls (torch.set_float32_matmul_precision("high")); TF32
    # tensor cores for half inputs, whose output rounding (2^-8 for bf16) dominates anyway.
    # The fused variant gives half inputs bf16 operands (fp16 inputs too: bf16 has fp32's
    # range, and |k|^λ passes fp16's 65504 at |k| > 40 for λ = 3) and, on a GPU, the MUFU
    # approximations; under the interpreter the same rounding with exact functions.
    variant = opts.get("variant") or VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    exact = q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    half = "bf16_exact" if INTERPRETED else "bf16"
    precision = opts.get("precision") or ("ieee" if exact else
                                          "tf32" if q.dtype == torch.float32 or variant == "baseline" else half)
    return dict(opts, precision=precision, variant=variant)


# torch.compile'd models treat this call as opaque (a graph break): dynamo would otherwise
# trace the launch code (device queries, Python-side block arithmetic) into the graph.
@torch.compiler.disable
def nala_attention_triton(q, k, v, norm_scale, opts: dict, splits: int | None = None,
                          config: dict | None = None) -> torch.Tensor:
    """Run the kernels: ``norm_scale`` a float or a tensor with 1 or H elements (per head);
    ``opts`` the §2 constants as ``nala._FusedNaLa`` takes them. ``splits`` overrides
    the number of token ranges of the state passes (tests), ``config`` (BLOCK_N, BV,
    num_warps) the block sizes of every kernel (block-size sweeps), or {"table":
    "previous"} the launch configs before the register work (``launch_config``)."""
    opts = resolve_opts(q, opts)
    h = q.shape[1]
    if isinstance(norm_scale, torch.Tensor):
        if norm_scale.numel() not in (1, h):
            raise ValueError(f"norm_scale must have 1 or H={h} elements, got shape {tuple(norm_scale.shape)}")
        scale = norm_scale if norm_scale.numel() == h else norm_scale.expand(h)
        scale = scale.reshape(h)
    else:
        scale = torch.full((h,), float(norm_scale), device=q.device)
    if q.device.type == "cuda":
        # Triton launches on the current device; make it q's (a model on a second GPU).
        with torch.cuda.device(q.device):
            return TritonNaLa.apply(q, k, v, scale, opts, splits, config)
    return TritonNaLa.apply(q, k, v, scale, opts, splits, config)
