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
backward (``nala/fused.py``'s ``fused_backward``). Per token it keeps 4C floats.

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

from .context_parallel import shard_of
from .nala.fused import fused_backward, fused_output, fused_state


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
        if shard_of(grid) is not None:   # context parallel: the neighbours' rows, padding only along w
            v_img, pad = shard_of(grid).halo_rows(v_img, pad), (0, pad)
        o = o + F.conv2d(v_img, weight, lepe[1], padding=pad, groups=c).flatten(2).transpose(1, 2)
    return norm_gate(o, g, norm)


def norm_gate(o: torch.Tensor, g: torch.Tensor | None,
              norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """§4 step 4 on tokens (B, N, C): LayerNorm when ``norm`` = (weight, bias, eps), then
    ``⊙ SiLU(g)`` when ``g`` is given."""
    if norm is not None:
        o = F.layer_norm(o, (o.shape[-1],), *norm)
    if g is not None:
        o = o * F.silu(g)
    return o


def _image(t: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Tokens (B, N, C) → a contiguous image (B, C, h, w): on a CPU the depthwise 5×5 conv
    runs about 9× faster on it than on the channels-last view ``gated_tail`` uses."""
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], *grid).contiguous()


def _lepe(v: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid) -> torch.Tensor:
    """DWConv5×5(v) as tokens (B, N, C) (a transposed view of the contiguous output)."""
    img, pad = _lepe_input(_image(v, grid), weight, grid)
    out = F.conv2d(img, weight, bias, padding=pad, groups=v.shape[-1])
    return out.flatten(2).transpose(1, 2)


def _lepe_input(img: torch.Tensor, weight: torch.Tensor, grid):
    """The conv's input and padding: under context parallel the image with ⌊k/2⌋ halo rows
    of the neighbours (``ShardGrid.halo``) and zero padding along w only."""
    pad = weight.shape[-1] // 2
    if shard_of(grid) is None:
        return img, (pad, pad)
    return shard_of(grid).halo(img, pad), (0, pad)


def _lepe_backward(d_o: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, has_bias: bool, grid, autocast):
    """∂L/∂v (B, N, C), ∂L/∂weight, ∂L/∂bias of ``_lepe`` for the gradient ``d_o`` of its output."""
    dtype = autocast[1] if autocast[0] and v.device.type in ("cpu", "cuda") else None
    img, pads = _lepe_input(_image(v, grid), weight, grid)
    img, w, d_img = (t if dtype is None else t.to(dtype) for t in (img, weight, _image(d_o, grid)))
    c = v.shape[-1]
    cpu = v.device.type == "cpu"
    d_v, d_w, d_b = torch.ops.aten.convolution_backward(
        d_img, img, w, [c] if has_bias else None, [1, 1], list(pads), [1, 1], False, [0, 0], c,
        [True, not cpu, has_bias and not cpu])
    if cpu:
        # convolution_backward's weight and bias paths are ~20× slower on a CPU than its input
        # path. The weight gradient is a depthwise conv of the input with the output gradient
        # as its (h, w) kernel, one group per (sample, channel): the same sums.
        b = img.shape[0]
        d_w = F.conv2d(img.reshape(1, b * c, *img.shape[-2:]), d_img.reshape(b * c, 1, *grid), padding=pads,
                       groups=b * c).view(b, c, 1, *weight.shape[-2:]).sum(0)
        d_b = d_img.sum((0, 2, 3)) if has_bias else None
    if shard_of(grid) is not None:     # the halo rows' gradients go back to their ranks
        d_v = shard_of(grid).halo_backward(d_v, weight.shape[-1] // 2)
    d_v = d_v.flatten(2).transpose(1, 2).to(v.dtype)
    return d_v, d_w.to(weight.dtype), None if d_b is None else d_b.to(weight.dtype)


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

    Either ``qkvg`` (B, N, 3C or 4C), the projection's output, and the fused NaLa core
    runs here with the constants ``spec["opts"]`` (``scale``: the learned per-head norm
    scale (H, 1, 1) or None, applied as NaLa(q/s) with s = 1 in ``opts``); or ``v``, ``g``
    (token views (B, N, C) of the projection) and ``o_att`` (B, N, C), the output of a core
    that ran outside under autograd. ``g`` None: no gate. Then the LePE, LayerNorm and
    output-projection parameters (None where the layer has none) and ``spec``, the plain
    settings: heads, grid, norm eps, opts.
    """

    @staticmethod
    def forward(ctx, qkvg, v, g, o_att, scale, lepe_w, lepe_b, norm_w, norm_b, proj_w, proj_b, spec):
        state = None
        if qkvg is not None:
            q, k, v, g = _split(qkvg, spec)
            qs = _heads(q, spec["heads"])
            if scale is not None:
                qs = qs / scale.to(qs.dtype)
            state = fused_state(_heads(k, spec["heads"]), _heads(v, spec["heads"]), spec["opts"],
                                shard_of(spec["grid"]))
            o = _fused_tokens(qs, state, spec)[0]
        else:
            o = o_att
        if lepe_w is not None:
            o = o + _lepe(v, lepe_w, lepe_b, spec["grid"])
        y = norm_gate(o, g, _norm(norm_w, norm_b, spec))
        ctx.spec, ctx.autocast = spec, _autocast_state(y.device)
        ctx.has_proj_bias = proj_b is not None
        if qkvg is not None:
            ctx.save_for_backward(qkvg, scale, state, lepe_w, lepe_b, norm_w, norm_b, proj_w)
        else:
            ctx.save_for_backward(v, g, o_att, lepe_w, lepe_b, norm_w, norm_b, proj_w)
        ctx.fused = qkvg is not None
        return F.linear(y, proj_w, proj_b)                              # (B, N, C)

    @staticmethod
    @once_differentiable  # the recomputed graph is differentiated here, not again
    def backward(ctx, d_out):
        spec, autocast = ctx.spec, ctx.autocast
        h = spec["heads"]
        d_qkvg = d_scale = d_o_att = d_v = d_g = d_lw = d_lb = None
        with _autocast(d_out.device, autocast):
            if ctx.fused:
                qkvg, scale, state, lepe_w, lepe_b, norm_w, norm_b, proj_w = ctx.saved_tensors
                q, k, v, g = _split(qkvg, spec)
            else:
                v, g, o, lepe_w, lepe_b, norm_w, norm_b, proj_w = ctx.saved_tensors
            lepe_tok = _lepe(v, lepe_w, lepe_b, spec["grid"]) if lepe_w is not None else None
            tail = lambda o, sl: _tail_backward(o, None if g is None else g[:, sl],
                                                None if lepe_tok is None else lepe_tok[:, sl],
                                                norm_w, norm_b, proj_w, d_out[:, sl], spec, autocast)
            if not ctx.fused:
                d_o, d_g, *param_grads = tail(o, slice(None))
                d_o_att = d_o
            else:
                # NaLa's output is recomputed chunk by chunk inside its own backward's query
                # pass; each chunk's gradient comes from LayerNorm, gate and projection of that
                # chunk. Every gradient lands in one (B, N, 3C or 4C) buffer: no copies, no cat.
                d_qkvg = torch.empty_like(qkvg)
                dq, dk, dv, dg = _split(d_qkvg, spec)
                d_o = torch.empty_like(v) if lepe_w is not None else None     # LePE's output grad
                param_grads = []

                def chunk_grad(sl, o_chunk):                     # o_chunk (B, H, C', D) fp32
                    with _autocast(d_out.device, autocast):
                        bb, _, cn, d = o_chunk.shape
                        o_tok = o_chunk.transpose(1, 2).reshape(bb, cn, h * d).to(v.dtype)
                        d_oc, d_gc, *grads = tail(o_tok, sl)
                    param_grads[:] = grads if not param_grads else [
                        a if b is None else a + b for a, b in zip(param_grads, grads)]
                    if dg is not None:
                        dg[:, sl] = d_gc
                    if d_o is not None:
                        d_o[:, sl] = d_oc
                    return _heads(d_oc, h)

                qs = _heads(q, h)
                if scale is not None:
                    qs = qs / scale.to(qs.dtype)
                fused_backward(qs, _heads(k, h), _heads(v, h), state, None, chunk_grad, spec["opts"],
                               out=(_heads(dq, h), _heads(dk, h), _heads(dv, h)), shard=shard_of(spec["grid"]))
            del lepe_tok
            if lepe_w is not None:
                d_v, d_lw, d_lb = _lepe_backward(d_o, v, lepe_w, lepe_b is not None, spec["grid"], autocast)
                if ctx.fused:
                    dv.add_(d_v)
                    d_v = None
            if ctx.fused and scale is not None:
                dq = _heads(dq, h)
                s = scale.to(dq.dtype)
                # q_s = q / s:  ∂L/∂q = ∂L/∂q_s / s,  ∂L/∂s = −Σ ∂L/∂q_s · q_s / s.
                d_scale = (-(dq * qs).sum((0, 2, 3)).view_as(scale) / s).to(scale.dtype)
                dq.div_(s)
        d_nw, d_nb, d_proj_w, d_proj_b = param_grads
        cast = lambda t, x: None if t is None else t.to(x.dtype)
        return (d_qkvg, cast(d_v, v), cast(d_g, g), d_o_att, d_scale, d_lw, d_lb, d_nw, d_nb,
                d_proj_w, d_proj_b if ctx.has_proj_bias else None, None)


def _tail_backward(o, g, lepe_tok, norm_w, norm_b, proj_w, d_out, spec, autocast):
    """For one token range: the gradients of ``Linear(norm_gate(o + lepe_tok, g))`` given
    ``d_out``, as (∂o, ∂g, ∂norm weight, ∂norm bias, ∂proj weight, ∂proj bias). LayerNorm and
    the gate are rebuilt with autograd from detached leaves (a short graph)."""
    if lepe_tok is not None:
        o = o + lepe_tok                                  # LePE's output gradient is o's
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (o, g, norm_w, norm_b)]
    with torch.enable_grad():
        y = norm_gate(leaves[0], leaves[1], _norm(*leaves[2:], spec))
    d_y, d_proj_w, d_proj_b = _linear_backward(y.detach(), proj_w, d_out, autocast)
    grads = iter(torch.autograd.grad(y, [t for t in leaves if t is not None], d_y, allow_unused=True))
    return (*(next(grads) if t is not None else None for t in leaves), d_proj_w, d_proj_b)


def _split(qkvg: torch.Tensor, spec: dict):
    """(q, k, v, g) token views (B, N, C) of the projection; g None without the gate."""
    parts = qkvg.chunk(spec["parts"], dim=-1)
    return (*parts, None) if spec["parts"] == 3 else parts


def _fused_tokens(qs: torch.Tensor, state: torch.Tensor, spec: dict):
    """NaLa's output from the state, written straight into the token layout (B, N, C),
    and the denominator (B, H, N, 1)."""
    b, h, n, d = qs.shape
    buf = qs.new_empty(b, n, h, d, dtype=torch.float32)
    den = fused_output(qs, state, spec["opts"], out=buf.transpose(1, 2))[1]
    return buf.view(b, n, h * d).to(qs.dtype), den


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, C) → (B, H, N, D), a view."""
    b, n, c = t.shape
    return t.reshape(b, n, heads, c // heads).transpose(1, 2)


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
