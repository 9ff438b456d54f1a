"""Forward-mode derivatives (JVP) of NaLa: the tangent of the §3 linear form in linear time.

With φ_q, φ_k the 2D-wide feature maps (§2), ``S = mean_j φ_k(k_j) v_jᵀ`` and
``z = mean_j φ_k(k_j)``, NaLa is ``o = num / den`` with ``num = φ_qᵀS`` and
``den = φ_qᵀz + ε``. Given tangents (q̇, k̇, v̇), the feature tangents φ̇_q, φ̇_k are per
token (``torch.func.jvp`` of the feature maps), and

    Ṡ = mean_j (φ̇_k v_jᵀ + φ_k v̇_jᵀ),    ż = mean_j φ̇_k              (pass over the keys)
    ȯ = (φ̇_qᵀS + φ_qᵀṠ − o · (φ̇_qᵀz + φ_qᵀż)) / den                 (pass over the queries)

two linear passes, no N × N anything (softmax attention's tangent needs the N × N
weights or a flash-style kernel of its own). Everything here is plain torch ops, so the
tangent is itself differentiable: ``torch.func.jvp`` inside ``torch.func.grad`` (an
sCM-style loss that differentiates through the tangent) works on every path that uses it.

Which path uses what (``nala_attention``):

* ``impl="eager"``/``"compile"``: torch's own forward-mode rules over the composition;
* ``impl="fused"`` (CPU): ``nala._FusedNaLa`` keeps its fused forward and hand-written
  backward and takes its tangent from ``nala_tangent``;
* ``impl="triton"``: ``TritonNaLaJvp`` below, the kernels' forward and backward with the
  same tangent (in torch ops on the GPU, not a kernel of its own);
* the gated layer's fused middle (``recompute.GatedMiddle``, ``triton_gated.TritonGatedMiddle``)
  and region states: under a ``torch.func`` transform or forward-mode AD the layer runs its
  plain composition (the reference), whose NaLa call is one of the paths above;
* context parallel: refused (the tangent state would need its own all-reduce).

Orders: ``torch.func.jvp``, ``torch.func.grad`` / ``vjp`` of a function that calls
``torch.func.jvp`` (reverse over forward), and ``torch.autograd.forward_ad`` (there ``nala_attention`` runs the eager composition:
``dual``);
forward over reverse (a ``jvp`` of a ``grad``) on the eager composition only: the fused
and Triton backwards are once-differentiable and say so.
"""

from __future__ import annotations

import math

import torch

from .functional import _no_autocast, dual, nala_query_weights, under_transform  # noqa: F401  (re-exported)

FORWARD_OVER_REVERSE_REFUSAL = ("forward-over-reverse derivatives (torch.func.jvp of a gradient) through NaLa's fused "
                                "and Triton paths are not supported: their backward is once-differentiable; use "
                                "impl='eager', or reverse over forward (torch.func.grad of a torch.func.jvp)")
CONTEXT_PARALLEL_REFUSAL = ("forward-mode derivatives (torch.func.jvp, MeanFlow) through context-parallel NaLa "
                            "are not supported; train without --context-parallel")


def in_forward_mode(*tensors) -> bool:
    """Whether a forward-mode derivative is being taken now: a ``torch.func.jvp`` on the
    transform stack, or one of ``tensors`` with a ``forward_ad`` tangent."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return dual(*tensors) or any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


def _features(q: torch.Tensor, k: torch.Tensor, opts: dict, norm_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """``nala_features`` with the §2 constants as ``opts`` and a norm scale that may be a
    per-head tensor (H, 1, 1) (the Triton path's learned s); inputs fp32 or float64."""
    a, q_hat, _ = nala_query_weights(q, opts["power"], opts["offset"], norm_scale, opts["norm_eps"])
    b = k.abs().pow(opts["power"])
    if opts["direction"] == "cosine":
        k_hat = k / k.norm(dim=-1, keepdim=True).clamp_min(opts["norm_eps"])
        theta_q = (math.pi / 4) * torch.tanh(opts["alpha"] * q_hat)
        theta_k = (math.pi / 4) * torch.tanh(opts["alpha"] * k_hat)
        return (torch.cat([a * torch.cos(theta_q), a * torch.sin(theta_q)], -1),
                torch.cat([b * torch.cos(theta_k), b * torch.sin(theta_k)], -1))
    return torch.cat([a * (q_hat > 0), a * (q_hat < 0)], -1), torch.cat([b * (k > 0), b * (k < 0)], -1)


def nala_tangent(q, k, v, tangents, opts: dict, norm_scale=None, shard=None) -> torch.Tensor:
    """The tangent ȯ of ``nala_attention(q, k, v)`` for input tangents ``(q̇, k̇, v̇)`` (None:
    zero), in v's dtype; computed in fp32 (float64 for float64 inputs). ``opts`` as
    ``nala.fused_opts`` builds them; ``norm_scale`` overrides ``opts["norm_scale"]`` (a float
    or a per-head (H,) tensor)."""
    if shard is not None:
        raise ValueError(CONTEXT_PARALLEL_REFUSAL)
    dq, dk, dv = tangents
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = opts["norm_scale"] if norm_scale is None else norm_scale
    if isinstance(scale, torch.Tensor):
        scale = scale.to(acc).reshape(-1, 1, 1)
    with _no_autocast(q.device):
        q, k, v = (t.to(acc) for t in (q, k, v))
        zero = lambda t, like: torch.zeros_like(like) if t is None else t.to(acc)
        dq, dk = zero(dq, q), zero(dk, k)
        (phi_q, phi_k), (dphi_q, dphi_k) = torch.func.jvp(lambda a, b: _features(a, b, opts, scale), (q, k), (dq, dk))
        n = k.shape[-2]
        # pass over the keys: [S | z] and its tangent, each one GEMM against [v | 1]
        v1 = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1)                 # (B, H, N, D+1)
        state = phi_k.mT @ v1 / n                                              # (B, H, 2D, D+1)
        d_state = dphi_k.mT @ v1
        if tangents[2] is not None:
            d_state = d_state + torch.nn.functional.pad(phi_k.mT @ tangents[2].to(acc), (0, 1))
        d_state = d_state / n
        # pass over the queries
        d = v.shape[-1]
        num_den = phi_q @ state
        d_num_den = dphi_q @ state + phi_q @ d_state
        den = num_den[..., d:] + opts["eps"]
        out = num_den[..., :d] / den
        return ((d_num_den[..., :d] - out * d_num_den[..., d:]) / den).to(tangents[2].dtype if tangents[2] is not None
                                                                          else v.dtype)


class TritonNaLaJvp(torch.autograd.Function):
    """The Triton kernels (``triton_kernels.TritonNaLa``'s forward and backward, run with a
    plain context object as ``triton_op.py`` does) with a forward-mode rule
    (``nala_tangent``): what ``nala_attention`` runs on the Triton path under a transform."""

    @staticmethod
    def forward(q, k, v, scale, opts):
        from .triton_kernels import TritonNaLa
        from .triton_op import _Ctx

        ctx = _Ctx()
        with torch.no_grad():
            out = TritonNaLa.forward(ctx, q, k, v, scale, opts)
        return (out, *ctx.saved_tensors[3:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, scale, ctx.opts = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(q, k, v, *output[1:])
        ctx.save_for_forward(q, k, v, scale)
        ctx.scale_shape = scale.shape

    @staticmethod
    def backward(ctx, grad_out, *_):
        from .triton_kernels import TritonNaLa, launch_config, num_splits
        from .triton_op import _Ctx

        if in_forward_mode(grad_out):
            raise ValueError(FORWARD_OVER_REVERSE_REFUSAL)
        q = ctx.saved_tensors[0]
        b, h, n, d = q.shape
        kernel = _Ctx()
        # under torch.func.grad of a jvp, the saved tensors are wrappers of an exited level:
        # the kernels need their storage (this backward is not differentiated further)
        kernel.saved_tensors = tuple(_plain(t) for t in ctx.saved_tensors)
        kernel.needs_input_grad = ctx.needs_input_grad
        kernel.opts, kernel.cfg, kernel.scale_shape = ctx.opts, launch_config(d, None, ctx.opts["variant"]), ctx.scale_shape
        # the forward's token ranges: the same function of the same shapes and device
        kernel.splits = num_splits(n, b * h, kernel.cfg["state"]["NV"], q.device, ctx.opts["variant"])
        from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

        with torch.no_grad(), temporarily_clear_interpreter_stack():   # plain buffers for the kernels
            return TritonNaLa.backward(kernel, _plain(grad_out).contiguous())[:4] + (None,)

    @staticmethod
    def jvp(ctx, dq, dk, dv, _scale, _opts):
        # the scale is a constant here (``triton_jvp_attention`` builds it from a float)
        q, k, v, scale = ctx.saved_tensors
        return nala_tangent(q, k, v, (dq, dk, dv), ctx.opts, norm_scale=scale), None, None, None, None


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its ``torch.func`` wrappers."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def triton_jvp_attention(q, k, v, norm_scale: float, opts: dict) -> torch.Tensor:
    """The Triton path with its forward-mode rule (``TritonNaLaJvp``); ``norm_scale`` a float,
    ``opts`` as ``triton_kernels.nala_attention_triton`` takes them."""
    from .triton_kernels import resolve_opts

    scale = torch.full((q.shape[1],), float(norm_scale), device=q.device)
    return TritonNaLaJvp.apply(q, k, v, scale, resolve_opts(q, opts))[0]
