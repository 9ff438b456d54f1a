"""NaLa's fused CPU path as a ``torch.library`` custom op, so ``torch.compile(...,
fullgraph=True)`` traces a whole NaLaDiT block without a graph break.

A Python ``autograd.Function`` with a dict of options (``fused._FusedNaLa``) is opaque to
dynamo's tracing of the backward and carries non-tensor state; here the same passes
(``fused_state`` → ``fused_output``; ``fused_backward``) are two ops with plain scalar
arguments, each with a fake (meta) implementation for tracing, and the backward registered
with ``register_autograd``:

* ``nala_dit::nala_fused(q, k, v, direction, power, offset, norm_scale, alpha, norm_eps, eps)
  → (out, state, den)``: ``out`` in v's dtype; the small fp32 state ``(2, B, H, D, D+1)`` and
  denominator ``(B, H, N, 1)`` are returned for the backward (not differentiable);
* ``nala_dit::nala_fused_backward(q, k, v, state, den, grad_out, ...) → (dq, dk, dv)``.

``nala_fused_attention(q, k, v, opts)`` is the call (``opts`` as ``fused.fused_opts``
builds them): what ``nala_attention`` runs on the fused path while dynamo traces, so the
graph holds one opaque op per NaLa call, not the token chunks' hundreds of ops. In eager
mode ``nala_attention`` runs ``fused._FusedNaLa`` (the same passes); context parallel
(``shard``: its all-reduce is not an op) and forward-mode transforms stay on the autograd
functions.
"""
from __future__ import annotations

import torch

from ..config import DIRECTIONS
from ..functional import _check_qkv
from .fused import fused_backward, fused_output, fused_state

_OPT_NAMES = ("direction", "power", "offset", "norm_scale", "alpha", "norm_eps", "eps")


def _check_args(q, k, v, direction: str) -> None:
    """What the passes take, checked by the op and by its fake alike (a traced graph must not
    accept what the eager call refuses): a known direction (any other string would run the
    relu_split lift), q and k of one shape, v of their (B, H, N) and head dim (the state is
    D x (D + 1))."""
    if direction not in DIRECTIONS:
        raise ValueError(f"nala_dit::nala_fused: direction must be one of {DIRECTIONS}, got {direction!r}")
    _check_qkv(q, k, v)
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"nala_dit::nala_fused: v's head dim must be q's (the fused state is D x (D + 1)), got v "
                         f"{tuple(v.shape)} and q {tuple(q.shape)}")


def _opts(direction, power, offset, norm_scale, alpha, norm_eps, eps) -> dict:
    return dict(direction=direction, power=power, offset=offset, norm_scale=norm_scale,
                alpha=alpha, norm_eps=norm_eps, eps=eps)


@torch.library.custom_op("nala_dit::nala_fused", mutates_args=())
def nala_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, direction: str, power: float,
               offset: float, norm_scale: float, alpha: float, norm_eps: float,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_args(q, k, v, direction)
    opts = _opts(direction, power, offset, norm_scale, alpha, norm_eps, eps)
    state = fused_state(k, v, opts)
    out, den = fused_output(q, state, opts)
    return out.to(v.dtype), state, den


@nala_fused.register_fake
def _(q, k, v, direction, power, offset, norm_scale, alpha, norm_eps, eps):
    _check_args(q, k, v, direction)
    b, h, n, d = q.shape
    out = q.new_empty(b, h, n, v.shape[-1], dtype=v.dtype)
    state = q.new_empty(2, b, h, d, v.shape[-1] + 1, dtype=torch.float32)
    den = q.new_empty(b, h, n, 1, dtype=torch.float32)
    return out, state, den


@torch.library.custom_op("nala_dit::nala_fused_backward", mutates_args=())
def nala_fused_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                        den: torch.Tensor, grad_out: torch.Tensor, direction: str, power: float,
                        offset: float, norm_scale: float, alpha: float, norm_eps: float,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_args(q, k, v, direction)
    opts = _opts(direction, power, offset, norm_scale, alpha, norm_eps, eps)
    dq, dk, dv = fused_backward(q, k, v, state, den, grad_out.contiguous(), opts)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@nala_fused_backward.register_fake
def _(q, k, v, state, den, grad_out, direction, power, offset, norm_scale, alpha, norm_eps, eps):
    _check_args(q, k, v, direction)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    _, state, den = output
    ctx.scalars = inputs[3:]
    ctx.save_for_backward(q, k, v, state, den)
    ctx.mark_non_differentiable(state, den)


def _backward(ctx, grad_out, _grad_state, _grad_den):
    q, k, v, state, den = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(v)
    dq, dk, dv = nala_fused_backward(q, k, v, state, den, grad_out, *ctx.scalars)
    return (dq, dk, dv) + (None,) * len(_OPT_NAMES)


nala_fused.register_autograd(_backward, setup_context=_setup_context)


def nala_fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: dict) -> torch.Tensor:
    """The fused path through the custom op: ``(B, H, N, D)`` in v's dtype."""
    return nala_fused(q, k, v, *(opts[name] for name in _OPT_NAMES))[0]
