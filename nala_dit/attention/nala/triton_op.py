"""NaLa's Triton path as ``torch.library`` custom ops, so that ``torch.compile(...,
fullgraph=True)`` traces a NaLaDiT block on a GPU without a graph break (and CUDA graphs
can cover it); ``backend.nala_attention`` routes its Triton path here while compiling
(``torch.compiler.is_compiling()``), and keeps ``triton/launch.py``'s ``TritonNaLa`` in eager mode.

* ``nala_dit::nala_triton(q, k, v, scale, direction, power, offset, alpha, norm_eps, eps,
  precision) → (out, state, z, den)``: ``out`` (B, H, N, D) in v's dtype; the
  kernels' fp32 state ``(B·H, 2, D, D)``, normaliser ``(B·H, 2, D)`` and per-token
  denominator ``(B·H, N)`` are returned for the backward (not differentiable);
* ``nala_dit::nala_triton_backward(q, k, v, scale, state, z, den, grad_out, need_scale, ...)
  → (dq, dk, dv, d_scale)``, registered as the first op's backward; ``d_scale`` is the
  gradient of the per-head norm scale ``scale`` (H,) fp32 (zeros when not needed).

``custom_op`` with the launches inside its body, not ``torch.library.triton_op`` +
``wrap_triton``: ``wrap_triton`` takes compiled ``JITFunction`` kernels only, so under Triton's
interpreter (``TRITON_INTERPRET=1``, the CPU tests) dynamo runs the interpreted kernel on
fake tensors and fails ("Cannot access data pointer"), and it would need the launch code
of ``TritonNaLa`` copied here with every launch wrapped. The op's body runs that launch
code itself (``TritonNaLa.forward`` / ``backward`` with a plain context object), so the two
paths cannot drift; inductor treats the op as opaque (no fusion into the kernels), which
costs nothing here: the kernels already fuse the feature maps.

``precision`` ("" for the default) is resolved when the op runs, as
``triton/launch.py``'s ``nala_attention_triton`` resolves it (fp32
products unless ``torch.set_float32_matmul_precision("high")``), in the forward and again
in the backward. Nothing here imports Triton until an op runs.
"""
from __future__ import annotations

import torch

_OPT_NAMES = ("direction", "power", "offset", "alpha", "norm_eps", "eps", "precision")


class _Ctx:
    """What ``TritonNaLa.forward`` / ``backward`` read and write on their autograd context."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _resolved(q: torch.Tensor, opts: dict) -> dict:
    """``opts`` with the product precision filled in (``resolve_opts``)."""
    from .triton.launch import resolve_opts

    return resolve_opts(q, opts)


def _on_device(q: torch.Tensor):
    """Triton launches on the current CUDA device: make it q's (a model on a second GPU)."""
    import contextlib

    return torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext()


@torch.library.custom_op("nala_dit::nala_triton", mutates_args=())
def nala_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor, direction: str,
                power: float, offset: float, alpha: float, norm_eps: float, eps: float,
                precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .triton.launch import TritonNaLa

    # The op returns the state only: its backward recomputes the features (keep_features off).
    opts = _resolved(q, dict(zip(_OPT_NAMES, (direction, power, offset, alpha, norm_eps, eps, precision)),
                             keep_features=False))
    ctx = _Ctx()
    with _on_device(q), torch.no_grad():
        out = TritonNaLa.forward(ctx, q, k, v, scale, opts)
    state, z, den = ctx.saved_tensors[4:]
    if z.untyped_storage().data_ptr() == state.untyped_storage().data_ptr():
        z = z.clone()   # the token-range sums share one buffer; an op's outputs may not alias
    return out, state, z, den


@nala_triton.register_fake
def _(q, k, v, scale, direction, power, offset, alpha, norm_eps, eps, precision):
    b, h, n, d = q.shape
    f32 = dict(dtype=torch.float32)
    return (q.new_empty(b, h, n, d, dtype=v.dtype), q.new_empty(b * h, 2, d, d, **f32),
            q.new_empty(b * h, 2, d, **f32), q.new_empty(b * h, n, **f32))


@torch.library.custom_op("nala_dit::nala_triton_backward", mutates_args=())
def nala_triton_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                         state: torch.Tensor, z: torch.Tensor, den: torch.Tensor, grad_out: torch.Tensor,
                         need_scale: bool, direction: str, power: float, offset: float, alpha: float,
                         norm_eps: float, eps: float,
                         precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .triton.launch import TritonNaLa, launch_config, num_splits

    opts = _resolved(q, dict(zip(_OPT_NAMES, (direction, power, offset, alpha, norm_eps, eps, precision))))
    b, h, n, d = q.shape
    ctx = _Ctx()
    ctx.saved_tensors = (q, k, v, scale.float().contiguous(), state, z, den)
    ctx.opts, ctx.cfg = opts, launch_config(d)
    # the forward's token ranges: the same function of the same shapes and device
    ctx.splits = num_splits(n, b * h, ctx.cfg["state"]["NV"], q.device)
    ctx.scale_shape, ctx.needs_input_grad = scale.shape, (True, True, True, need_scale)
    with _on_device(q), torch.no_grad():
        dq, dk, dv, d_scale = TritonNaLa.backward(ctx, grad_out)[:4]
    return dq, dk, dv, d_scale if need_scale else scale.new_zeros(scale.shape, dtype=torch.float32)


@nala_triton_backward.register_fake
def _(q, k, v, scale, state, z, den, grad_out, need_scale, *opts):
    # contiguous, as the kernels write them (``empty_like`` would follow a strided q's layout)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            scale.new_empty(scale.shape, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, scale = inputs[:4]
    _, state, z, den = output
    ctx.opts = inputs[4:]
    ctx.save_for_backward(q, k, v, scale, state, z, den)
    ctx.mark_non_differentiable(state, z, den)


def _backward(ctx, grad_out, _state, _z, _den):
    q, k, v, scale, state, z, den = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(v)
    need_scale = ctx.needs_input_grad[3]
    dq, dk, dv, d_scale = nala_triton_backward(q, k, v, scale, state, z, den, grad_out, need_scale, *ctx.opts)
    return (dq, dk, dv, d_scale if need_scale else None) + (None,) * len(_OPT_NAMES)


nala_triton.register_autograd(_backward, setup_context=_setup_context)


def nala_triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm_scale, opts: dict) -> torch.Tensor:
    """The Triton path through the custom op: ``(B, H, N, D)`` in v's dtype. ``norm_scale``
    a float or a tensor with 1 or H elements (per head; its gradient flows back), ``opts``
    the §2 constants as ``triton/launch.py``'s ``nala_attention_triton`` takes them."""
    h = q.shape[1]
    if isinstance(norm_scale, torch.Tensor):
        if norm_scale.numel() not in (1, h):
            raise ValueError(f"norm_scale must have 1 or H={h} elements, got shape {tuple(norm_scale.shape)}")
        scale = norm_scale.float().reshape(-1).expand(h)
    else:
        scale = q.new_full((h,), float(norm_scale), dtype=torch.float32)
    opts = dict(opts, precision=opts.get("precision") or "")
    return nala_triton(q, k, v, scale, *(opts[name] for name in _OPT_NAMES))[0]
