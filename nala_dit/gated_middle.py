"""The middle of the gated attention layer (spec §4) as one autograd function that keeps little.

Between its two projections the gated layer computes

    o = attention(q, k, v) + DWConv5×5(v)         (LePE)
    y = Linear(LayerNorm(o) ⊙ SiLU(g))

Plain autograd keeps, per token and layer, the qkvg projection (4C floats: q, k, v, g),
the attention output, the LayerNorm input, the LayerNorm output, SiLU(g) and the output
projection's input: 8C floats, where DiT's softmax layer keeps 5C (q, k, v, SDPA's output
and the projection input). At 4K–16K tokens that made a NaLaDiT training step peak
25–37 % above DiT's on CPU.

``GatedMiddle`` runs ``qkvg → out`` (the output projection included) and saves only its
inputs: the qkvg views and the parameters, plus NaLa's small state ``[S | z]``
((2, B, H, D, D+1), not per token). Its backward recomputes what is cheap -- NaLa's output
from the state (one pass over the query chunks, no key pass), the LePE conv, LayerNorm
and SiLU -- then runs autograd over that short recomputed graph and the fused NaLa
backward (``nala_fused.fused_backward``). Per token it keeps 4C floats.

For other cores (ReLU / 1+ELU, softmax, RoPE, or NaLa on Triton / eager) the attention
output is an input of the function, computed by the core's own autograd graph, and the
function saves it instead (5C per token plus what the core keeps; still 3C fewer).

``gated_tail`` (§4 steps 3–4) is the one definition both this function and the plain
composition (``GatedLinearAttention(recompute=False)``, the reference) run.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .nala_fused import fused_backward, fused_output, fused_state


def gated_tail(o: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, grid: tuple[int, int] | None,
               lepe: tuple[torch.Tensor, torch.Tensor] | None = None,
               norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """§4 steps 3–4 on tokens (B, N, C): ``o + DWConv5×5(v)`` when ``lepe`` = (weight
    (C, 1, 5, 5), bias), then LayerNorm when ``norm`` = (weight, bias, eps), then
    ``⊙ SiLU(g)`` when ``g`` is given."""
    b, n, c = o.shape
    if lepe is not None:
        if grid is None or grid[0] * grid[1] != n:
            raise ValueError(f"LePE needs the token grid (h, w) with h*w == N={n}, got grid={grid}")
        v_img = v.transpose(1, 2).reshape(b, c, *grid)                  # (B, C, h, w)
        # v_img is a channels-last view, so the conv runs channels-last and its output
        # flattens back to (B, N, C) for free; but it then gives the (C, 1, 5, 5) weight a
        # channels-last gradient, strides (25, 1, 5, 1) against the parameter's (25, 25, 5, 1),
        # which DDP flags ("Grad strides do not match bucket view strides") and copies every
        # step. A (C, 25) view round trip of the weight is free forward and gives its
        # gradient the parameter's strides.
        weight = lepe[0].flatten(1).view_as(lepe[0])
        pad = lepe[0].shape[-1] // 2
        o = o + F.conv2d(v_img, weight, lepe[1], padding=pad, groups=c).flatten(2).transpose(1, 2)
    if norm is not None:
        o = F.layer_norm(o, (c,), *norm)
    if g is not None:
        o = o * F.silu(g)
    return o                                                            # (B, N, C)


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype | None]:
    if device.type not in ("cpu", "cuda"):
        return False, None
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def _autocast(device: torch.device, state: tuple[bool, torch.dtype | None]):
    """Re-enter in backward the autocast the forward ran under (as checkpointing does)."""
    if device.type not in ("cpu", "cuda"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=state[1], enabled=state[0])


class GatedMiddle(torch.autograd.Function):
    """``qkvg → Linear(gated_tail(attention + LePE))`` saving only the inputs (see the module doc).

    Inputs: ``q, k, v, g`` token views (B, N, C) of the qkvg projection (``g`` None without
    the gate; ``q``, ``k`` None when ``o_att`` is given); ``o_att`` the attention output
    (B, N, C) of a core that ran outside, or None: the fused NaLa core runs here with the
    constants ``spec["opts"]``; ``scale`` the learned per-head norm scale (H, 1, 1) or
    None (fused core only: NaLa(q/s) with s = 1 in ``opts``); the LePE, LayerNorm and
    output-projection parameters (None where the layer has none); ``spec`` the plain
    settings: heads, grid, opts, norm eps.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, o_att, scale, lepe_w, lepe_b, norm_w, norm_b, proj_w, proj_b, spec):
        b, n, c = v.shape
        state = None
        if o_att is None:
            qh, kh, vh = (_heads(t, spec["heads"]) for t in (q, k, v))
            if scale is not None:
                qh = qh / scale.to(qh.dtype)
            state = fused_state(kh, vh, spec["opts"])
            buf = v.new_empty(b, n, spec["heads"], c // spec["heads"], dtype=torch.float32)
            fused_output(qh, state, spec["opts"], out=buf.transpose(1, 2))
            o = buf.view(b, n, c).to(v.dtype)
        else:
            o = o_att
        y = gated_tail(o, v, g, spec["grid"], _pair(lepe_w, lepe_b), _norm(norm_w, norm_b, spec))
        ctx.spec, ctx.autocast = spec, _autocast_state(v.device)
        ctx.save_for_backward(q, k, v, g, o_att, scale, state, lepe_w, lepe_b, norm_w, norm_b, proj_w)
        ctx.has_proj_bias = proj_b is not None
        return F.linear(y, proj_w, proj_b)                              # (B, N, C)

    @staticmethod
    @once_differentiable  # the recomputed graph is differentiated here, not again
    def backward(ctx, d_out):
        q, k, v, g, o_att, scale, state, lepe_w, lepe_b, norm_w, norm_b, proj_w = ctx.saved_tensors
        spec = ctx.spec
        b, n, c = v.shape
        h = spec["heads"]
        fused = o_att is None
        with _autocast(v.device, ctx.autocast):
            if fused:
                qh, kh, vh = (_heads(t, h) for t in (q, k, v))
                qs = qh / scale.to(qh.dtype) if scale is not None else qh
                buf = v.new_empty(b, n, h, c // h, dtype=torch.float32)
                den = fused_output(qs, state, spec["opts"], out=buf.transpose(1, 2))[1]
                o = buf.view(b, n, c).to(v.dtype)
            else:
                o = o_att
            leaves = [t.detach().requires_grad_() if t is not None else None
                      for t in (o, v, g, lepe_w, lepe_b, norm_w, norm_b)]
            o_, v_, g_, lw_, lb_, nw_, nb_ = leaves
            with torch.enable_grad():
                y = gated_tail(o_, v_, g_, spec["grid"], _pair(lw_, lb_), _norm(nw_, nb_, spec))
            d_y, d_proj_w, d_proj_b = _linear_backward(y.detach(), proj_w, d_out, ctx.autocast)
            inputs = [t for t in leaves if t is not None]
            grads = iter(torch.autograd.grad(y, inputs, d_y, allow_unused=True))
            d_o, d_v, d_g, d_lw, d_lb, d_nw, d_nb = (next(grads) if t is not None else None for t in leaves)
            dq = dk = d_scale = None
            if fused:
                need_q = ctx.needs_input_grad[0] or ctx.needs_input_grad[5]
                d_oh = _heads(d_o.reshape(b, n, c), h)
                dqs, dkh, dvh = fused_backward(qs, kh, vh, state, den, d_oh, spec["opts"],
                                               (need_q, ctx.needs_input_grad[1], True))
                if scale is not None:
                    s = scale.to(dqs.dtype)
                    # q_s = q / s:  ∂L/∂q = ∂L/∂q_s / s,  ∂L/∂s = −Σ ∂L/∂q_s · q_s / s.
                    d_scale = (-(dqs * qs.float()).sum((0, 2, 3)).view_as(scale) / s).to(scale.dtype)
                    dqs = dqs / s
                dq = _tokens(dqs, q) if dqs is not None else None
                dk = _tokens(dkh, k) if dkh is not None else None
                d_v = _tokens(dvh, v) if d_v is None else d_v + _tokens(dvh, v)
                d_o = None
        cast = lambda t, x: None if t is None else t.to(x.dtype)
        return (dq, dk, cast(d_v, v), cast(d_g, g), cast(d_o, o_att), d_scale, d_lw, d_lb, d_nw, d_nb,
                d_proj_w, d_proj_b if ctx.has_proj_bias else None, None)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, C) → (B, H, N, D), a view."""
    b, n, c = t.shape
    return t.reshape(b, n, heads, c // heads).transpose(1, 2)


def _tokens(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) → (B, N, C) in ``like``'s dtype."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d).to(like.dtype)


def _pair(weight, bias):
    return None if weight is None else (weight, bias)


def _norm(weight, bias, spec):
    return None if spec["norm_eps"] is None else (weight, bias, spec["norm_eps"])


def _linear_backward(y, weight, d_out, autocast):
    """∂L/∂y, ∂L/∂W, ∂L/∂b of ``F.linear(y, W, b)`` as autograd computes them, in the
    autocast dtype when the forward ran under autocast (the products were taken there)."""
    dtype = autocast[1] if autocast[0] else None
    yl, wl, dl = (t if dtype is None else t.to(dtype) for t in (y, weight, d_out))
    d2 = dl.reshape(-1, dl.shape[-1])                                   # (B·N, C_out)
    d_y = (dl @ wl).to(y.dtype)
    d_w = (d2.transpose(0, 1) @ yl.reshape(-1, yl.shape[-1])).to(weight.dtype)
    return d_y, d_w, d2.sum(0).to(weight.dtype)
