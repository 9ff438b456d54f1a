"""The gated NaLa layer between its projections (spec §4 steps 2-4) on the Triton kernels:

    qkvg (B, N, 4C) ──NaLa──▶ o (B, N, C) ──epilogue──▶ LayerNorm(o + LePE(v)) ⊙ SiLU(g)

``TritonGatedMiddle``: forward NaLa's kernels and one epilogue kernel; backward
``_norm_backward``, ``_lepe_backward`` and NaLa's three kernels, into one (B, N, 4C) gradient
buffer. 4 launches forward and 15 in all with the projections, 5 / 16 at N ≥ 1,024. How it
works, what it saves and when it runs: ``README.md`` ("The gated layer") in this folder.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .launch import (atomic_state, backward_launch, feature_buffers, fit_splits, forward_launch, launch_config,
                     num_splits, state_numel)

LEPE_SIZE = 5           # the LePE kernel is 5 × 5 (``GatedAttention.lepe``)
TAPS = LEPE_SIZE * LEPE_SIZE
# The fp32 accumulator of the parameter gradients, per channel: LePE weight (25 taps, at
# c·25 + tap), then LePE bias, LayerNorm weight, LayerNorm bias (at 25C, 26C, 27C + c).
ACC_PER_CHANNEL = TAPS + 3


@triton.jit
def _lepe(V, s_n, LW, offs_t, offs_c, t_mask, c_mask, GH, GW, SIGN: tl.constexpr,
          BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Σ_taps w[c, tap] · x[token shifted by SIGN·(tap − centre), c] over the (GH, GW) grid,
    zero outside it: the 5×5 depthwise conv (SIGN = 1) or its transpose (SIGN = −1)."""
    row = offs_t // GW
    col = offs_t % GW
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for tap in tl.range(0, 25):   # not unrolled: 25 blocks of loads in flight took 140-255 registers
        r = row + SIGN * (tap // 5 - 2)
        c = col + SIGN * (tap % 5 - 2)
        ok = t_mask & (r >= 0) & (r < GH) & (c >= 0) & (c < GW)
        x = tl.load(V + (r * GW + c).to(tl.int64)[:, None] * s_n + offs_c[None, :],
                    mask=ok[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(LW + offs_c * 25 + tap, mask=c_mask, other=0.0).to(tl.float32)
        acc += x * w[None, :]
    return acc


@triton.jit
def _pre_norm(QKVG, O, LW, LB, b, offs_t, offs_c, t_mask, c_mask, N, C, GH, GW, s_b, s_n,
              BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """o + LePE(v) (bias included) for a token block, fp32."""
    mask = t_mask[:, None] & c_mask[None, :]
    y = _lepe(QKVG + b * s_b + 2 * C, s_n, LW, offs_t, offs_c, t_mask, c_mask, GH, GW, 1, BLOCK_T, BLOCK_C)
    y += tl.load(LB + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    return y + tl.load(O + (b * N + offs_t)[:, None] * C + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _normalised(QKVG, O, LW, LB, MEAN, RSTD, b, offs_t, offs_c, t_mask, c_mask, N, C, GH, GW, s_b, s_n,
                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """x̂ = (o + LePE(v) − mean) / std for a token block, from the stored statistics."""
    mask = t_mask[:, None] & c_mask[None, :]
    y = _pre_norm(QKVG, O, LW, LB, b, offs_t, offs_c, t_mask, c_mask, N, C, GH, GW, s_b, s_n, BLOCK_T, BLOCK_C)
    mean = tl.load(MEAN + b * N + offs_t, mask=t_mask, other=0.0)
    rstd = tl.load(RSTD + b * N + offs_t, mask=t_mask, other=0.0)
    return tl.where(mask, (y - mean[:, None]) * rstd[:, None], 0.0), rstd


@triton.jit
def _zero(BUF, n, BLOCK_C: tl.constexpr):
    """BUF[0:n] = 0, fp32, shared out among the grid's programs (no launch of its own)."""
    offs = tl.arange(0, BLOCK_C)
    for start in range(tl.program_id(0) * BLOCK_C, n, tl.num_programs(0) * BLOCK_C):
        tl.store(BUF + start + offs, tl.zeros((BLOCK_C,), dtype=tl.float32), mask=start + offs < n)


@triton.jit
def _epilogue_kernel(
    QKVG, O, LW, LB, NW, NB, OUT, MEAN, RSTD, ACC, ZEROED,
    N, C, GH, GW, s_b, s_n, n_acc, n_zeroed, norm_eps, t_blocks,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out = LayerNorm(o + LePE(v)) ⊙ SiLU(g) for BLOCK_T tokens × all C channels; the
    token's mean and 1/std stored; the programs zero ACC[:n_acc] and ZEROED[:n_zeroed]
    between them (the parameter gradients' accumulator, the next call's state buffer).
    Grid: (B · t_blocks,), t_blocks = ⌈N / BLOCK_T⌉ (one axis: ≤ 2³¹ − 1 programs, where a
    token axis of its own passes CUDA's 65,535 at N > 65,535 with BLOCK_T = 1). O, OUT:
    contiguous (B, N, C); QKVG: (B, N, 4C) by strides."""
    b = (tl.program_id(0) // t_blocks).to(tl.int64)
    offs_t = (tl.program_id(0) % t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_C)
    t_mask = offs_t < N
    c_mask = offs_c < C
    mask = t_mask[:, None] & c_mask[None, :]
    y = _pre_norm(QKVG, O, LW, LB, b, offs_t, offs_c, t_mask, c_mask, N, C, GH, GW, s_b, s_n, BLOCK_T, BLOCK_C)
    mean = tl.sum(y, 1) / C
    diff = tl.where(mask, y - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, 1) / C + norm_eps)
    nw = tl.load(NW + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    nb = tl.load(NB + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    normed = diff * rstd[:, None] * nw[None, :] + nb[None, :]
    g = tl.load(QKVG + b * s_b + 3 * C + offs_t.to(tl.int64)[:, None] * s_n + offs_c[None, :], mask=mask,
                other=0.0).to(tl.float32)
    out = normed * g * tl.sigmoid(g)
    tl.store(OUT + (b * N + offs_t)[:, None] * C + offs_c[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(MEAN + b * N + offs_t, mean, mask=t_mask)
    tl.store(RSTD + b * N + offs_t, rstd, mask=t_mask)
    _zero(ACC, n_acc, BLOCK_C)
    _zero(ZEROED, n_zeroed, BLOCK_C)


@triton.jit
def _norm_backward_kernel(
    QKVG, O, LW, LB, NW, NB, DOUT, MEAN, RSTD, DO, DQKVG, ACC, ZEROED,
    N, C, GH, GW, s_b, s_n, sdo_b, sdo_n, sd_b, sd_n, t_blocks, n_zeroed,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The gate's and LayerNorm's backward for a token block: ∂L/∂g into DQKVG's g columns,
    ∂L/∂o (fp32) into DO, the LayerNorm weight / bias and LePE bias gradients added to ACC
    (relaxed atomics: no memory fence; a loop over more tokens per program keeps the 25
    LePE weights live across it and spills); ZEROED[:n_zeroed] zeroed between the programs
    (NaLa's query state pass adds into it). Grid: (B · t_blocks,) as the epilogue's."""
    b = (tl.program_id(0) // t_blocks).to(tl.int64)
    offs_t = (tl.program_id(0) % t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_C)
    t_mask = offs_t < N
    c_mask = offs_c < C
    mask = t_mask[:, None] & c_mask[None, :]
    rows = offs_t.to(tl.int64)[:, None]
    x_hat, rstd = _normalised(QKVG, O, LW, LB, MEAN, RSTD, b, offs_t, offs_c, t_mask, c_mask, N, C, GH, GW,
                              s_b, s_n, BLOCK_T, BLOCK_C)
    nw = tl.load(NW + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    nb = tl.load(NB + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    g = tl.load(QKVG + b * s_b + 3 * C + rows * s_n + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    d_out = tl.load(DOUT + b * sdo_b + rows * sdo_n + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    normed = x_hat * nw[None, :] + nb[None, :]
    d_normed = d_out * g * sig
    d_g = d_out * normed * sig * (1.0 + g * (1.0 - sig))
    tl.store(DQKVG + b * sd_b + 3 * C + rows * sd_n + offs_c[None, :], d_g.to(DQKVG.dtype.element_ty), mask=mask)
    tl.atomic_add(ACC + 26 * C + offs_c, tl.sum(d_normed * x_hat, 0), mask=c_mask, sem="relaxed")
    tl.atomic_add(ACC + 27 * C + offs_c, tl.sum(d_normed, 0), mask=c_mask, sem="relaxed")
    d_hat = d_normed * nw[None, :]
    m1 = tl.sum(d_hat, 1) / C
    m2 = tl.sum(d_hat * x_hat, 1) / C
    d_o = tl.where(mask, rstd[:, None] * (d_hat - m1[:, None] - x_hat * m2[:, None]), 0.0)
    tl.store(DO + (b * N + offs_t)[:, None] * C + offs_c[None, :], d_o, mask=mask)
    tl.atomic_add(ACC + 25 * C + offs_c, tl.sum(d_o, 0), mask=c_mask, sem="relaxed")
    _zero(ZEROED, n_zeroed, BLOCK_C)


@triton.jit
def _lepe_backward_kernel(
    QKVG, LW, DO, DQKVG, ACC,
    N, C, GH, GW, s_b, s_n, sd_b, sd_n, t_ranges,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, TOKENS: tl.constexpr,
):
    """The LePE term's backward (depthwise: channels apart) for a range of TOKENS tokens and
    a block of BLOCK_C channels: ∂L/∂v = the transposed conv of ∂L/∂o into DQKVG's v
    columns (stored: NaLa's dv kernel adds its own after), and ∂L/∂w[c, tap] = Σ_t
    ∂L/∂o[t, c] · v[t + tap, c] summed over the range, then added to ACC with one relaxed
    (unfenced) atomic per channel and tap. Grid: (B · t_ranges, ⌈C / BLOCK_C⌉)."""
    b = (tl.program_id(0) // t_ranges).to(tl.int64)
    t0 = (tl.program_id(0) % t_ranges) * TOKENS
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    for t in tl.range(0, TOKENS, BLOCK_T, num_stages=1):
        offs_t = t0 + t + tl.arange(0, BLOCK_T)
        t_mask = offs_t < N
        d_v = _lepe(DO + b * N * C, C, LW, offs_t, offs_c, t_mask, c_mask, GH, GW, -1, BLOCK_T, BLOCK_C)
        tl.store(DQKVG + b * sd_b + 2 * C + offs_t.to(tl.int64)[:, None] * sd_n + offs_c[None, :],
                 d_v.to(DQKVG.dtype.element_ty), mask=t_mask[:, None] & c_mask[None, :])
    v_base = QKVG + b * s_b + 2 * C
    for tap in tl.range(0, 25):
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for t in tl.range(0, TOKENS, BLOCK_T, num_stages=1):
            offs_t = t0 + t + tl.arange(0, BLOCK_T)
            t_mask = offs_t < N
            d_o = tl.load(DO + (b * N + offs_t)[:, None] * C + offs_c[None, :],
                          mask=t_mask[:, None] & c_mask[None, :], other=0.0)
            r = offs_t // GW + (tap // 5 - 2)
            c = offs_t % GW + (tap % 5 - 2)
            ok = t_mask & (r >= 0) & (r < GH) & (c >= 0) & (c < GW)
            x = tl.load(v_base + (r * GW + c).to(tl.int64)[:, None] * s_n + offs_c[None, :],
                        mask=ok[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(d_o * x, 0)
        tl.atomic_add(ACC + offs_c * 25 + tap, acc, mask=c_mask, sem="relaxed")



# The LePE backward sums its weight's gradient over TOKENS tokens per program before one
# atomic add per channel and tap: 64× fewer atomics than one per token. It takes
# LEPE_BLOCK_C channels × LEPE_BLOCK_T tokens at a time (its taps need no other channel),
# on LEPE_WARPS warps.
TOKENS = 64
LEPE_BLOCK_C, LEPE_BLOCK_T, LEPE_WARPS = 64, 16, 4


def launch_grids(b: int, n: int, c: int) -> dict[str, tuple[int, ...]]:
    """The grid of each gated-layer kernel for (B, N, C), as the launches use them: every
    axis after the first within CUDA's 65,535, the first within 2³¹ − 1 (tokens and batch
    folded into it)."""
    block_t = _blocks(c)[0]
    ranges = triton.cdiv(n, TOKENS)
    return dict(epilogue=(b * triton.cdiv(n, block_t),), norm_backward=(b * triton.cdiv(n, block_t),),
                lepe_backward=(b * ranges, triton.cdiv(c, LEPE_BLOCK_C)))


def _blocks(c: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps): every channel of a token in one program (LayerNorm
    reduces over C), about 2,048 values per block, 8 values per thread. Compiled for sm_90a
    (``benchmarks/triton_compile_check.py --gated``, Triton 3.6 and 3.8, bf16 and fp16), at
    C = 384 (S), 1,152 (XL) and 2,240 (H) no kernel spills (48-107 registers: the LePE taps
    run as a loop, not unrolled; unrolled, their loads took 138-255 registers in fp16 and under
    Triton 3.6, one program per SM, and spilled up to 364 B)."""
    block_c = triton.next_power_of_2(c)
    block_t = max(1, min(16, 2048 // block_c))
    return block_t, block_c, max(2, min(16, block_t * block_c // 256))


class TritonGatedMiddle(torch.autograd.Function):
    """``qkvg`` (B, N, 4C) → ``LayerNorm(NaLa(q, k, v) + LePE(v)) ⊙ SiLU(g)`` (B, N, C); see
    README.md, "The gated layer". ``scale``: NaLa's norm scale, an fp32 (H,) tensor (learned: its
    gradient is returned). ``spec``: heads, grid (h, w), the LayerNorm eps and ``opts``
    (``launch.resolve_opts``'s)."""

    @staticmethod
    def forward(ctx, qkvg, scale, lepe_w, lepe_b, norm_w, norm_b, spec):
        b, n, c4 = qkvg.shape
        c, h = c4 // 4, spec["heads"]
        gh, gw = spec["grid"]
        q, k, v = (split_heads(qkvg, i, h) for i in range(3))
        opts = spec["opts"]
        cfg = launch_config(c // h)
        splits = fit_splits(num_splits(n, b * h, cfg["state"]["NV"], qkvg.device), n, qkvg)
        atomic, numel = atomic_state(n, splits, cfg), state_numel(b, h, c // h)
        o = qkvg.new_empty(b, n, c)
        features = feature_buffers(q, opts, any(ctx.needs_input_grad[:6]))
        state, z, den = forward_launch(q, k, v, scale, opts, cfg, splits, o.unflatten(-1, (h, c // h)).transpose(1, 2),
                                       features, zeroed=_take_zeroed(qkvg.device, numel) if atomic else None)
        out = qkvg.new_empty(b, n, c)
        mean, rstd = (qkvg.new_empty(b * n, dtype=torch.float32) for _ in range(2))
        grads = any(ctx.needs_input_grad[i] for i in (0, 2, 3, 4, 5))
        acc = qkvg.new_empty(ACC_PER_CHANNEL * c if grads else 1, dtype=torch.float32)
        following = qkvg.new_empty(numel if atomic else 1, dtype=torch.float32)
        block_t, block_c, warps = _blocks(c)
        _epilogue_kernel[launch_grids(b, n, c)["epilogue"]](
            qkvg, o, lepe_w, lepe_b, norm_w, norm_b, out, mean, rstd, acc, following,
            n, c, gh, gw, qkvg.stride(0), qkvg.stride(1), acc.numel() if grads else 0, numel if atomic else 0,
            spec["norm_eps"], triton.cdiv(n, block_t), BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps,
        )
        if atomic:   # zeroed by the epilogue launched above: the next several-range call's state adds into it
            _ZEROED[_stream_key(qkvg.device)] = following
        ctx.spec, ctx.cfg, ctx.splits = spec, cfg, splits
        ctx.save_for_backward(qkvg, o, scale, state, z, den, mean, rstd, acc, lepe_w, lepe_b, norm_w, norm_b,
                              *(features or ()))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        qkvg, o, scale, state, z, den, mean, rstd, acc, lepe_w, lepe_b, norm_w, norm_b, *features = ctx.saved_tensors
        spec = ctx.spec
        b, n, c4 = qkvg.shape
        c, h = c4 // 4, spec["heads"]
        gh, gw = spec["grid"]
        d_qkvg = torch.empty_like(qkvg)
        d_o = qkvg.new_empty(b, n, c, dtype=torch.float32)
        block_t, block_c, warps = _blocks(c)
        grids, ranges = launch_grids(b, n, c), triton.cdiv(n, TOKENS)
        atomic, numel = atomic_state(n, ctx.splits, ctx.cfg), state_numel(b, h, c // h)
        d_state = qkvg.new_empty(numel if atomic else 1, dtype=torch.float32)   # zeroed by the norm backward
        _norm_backward_kernel[grids["norm_backward"]](
            qkvg, o, lepe_w, lepe_b, norm_w, norm_b, d_out, mean, rstd, d_o, d_qkvg, acc, d_state,
            n, c, gh, gw, qkvg.stride(0), qkvg.stride(1), d_out.stride(0), d_out.stride(1),
            d_qkvg.stride(0), d_qkvg.stride(1), triton.cdiv(n, block_t), numel if atomic else 0,
            BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps,
        )
        _lepe_backward_kernel[grids["lepe_backward"]](
            qkvg, lepe_w, d_o, d_qkvg, acc, n, c, gh, gw, qkvg.stride(0), qkvg.stride(1),
            d_qkvg.stride(0), d_qkvg.stride(1), ranges, BLOCK_T=LEPE_BLOCK_T, BLOCK_C=LEPE_BLOCK_C, TOKENS=TOKENS,
            num_warps=LEPE_WARPS,
        )
        need_scale = ctx.needs_input_grad[1]
        q, k, v = (split_heads(qkvg, i, h) for i in range(3))
        dq, dk, dv = (split_heads(d_qkvg, i, h) for i in range(3))
        d_u = backward_launch(q, k, v, scale, state, z, den, d_o.unflatten(-1, (h, c // h)).transpose(1, 2),
                              spec["opts"], ctx.cfg, ctx.splits, dq, dk, dv, need_scale, add_dv=True,
                              features=tuple(features) or None, zeroed=d_state if atomic else None)
        d_scale = d_u.view(b, h, n).sum((0, 2)) if need_scale else None
        params = (lepe_w, lepe_b, norm_w, norm_b)
        pieces = acc.split([TAPS * c, c, c, c]) if acc.numel() > 1 else [None] * 4
        d_params = [None if piece is None else piece.view_as(p).to(p.dtype) for piece, p in zip(pieces, params)]
        return d_qkvg, d_scale, *d_params, None


# The zeroed state buffer each gated forward's epilogue leaves for the next several-range
# forward on its device and stream (README.md, "The gated layer"): one per stream, 21 MB at XL/2, batch 32.
_ZEROED: dict[tuple, torch.Tensor] = {}


def _stream_key(device: torch.device) -> tuple:
    return (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None)


def _take_zeroed(device: torch.device, numel: int) -> torch.Tensor | None:
    """The zeroed state buffer an earlier forward's epilogue left for this stream, if it has ``numel``."""
    buf = _ZEROED.pop(_stream_key(device), None)
    return buf if buf is not None and buf.numel() == numel else None


def split_heads(t: torch.Tensor, part: int, heads: int) -> torch.Tensor:
    """Columns ``part`` (0 q, 1 k, 2 v, 3 g) of a (B, N, 4C) token tensor as (B, H, N, D) heads: a view."""
    c = t.shape[-1] // 4
    return t[..., part * c:(part + 1) * c].unflatten(-1, (heads, c // heads)).transpose(1, 2)
