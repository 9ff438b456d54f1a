"""Forward-mode derivatives (JVP) of NaLa: the tangent of the §3 linear form in two linear
passes (``nala_tangent``), and ``TritonNaLaJvp``, the Triton path with it. The derivation,
which path takes its tangent from where, and the orders each supports: ``README.md`` in this
folder ("Forward-mode derivatives").
"""

from __future__ import annotations

import math

import torch

from .chunks import token_chunks
from ..functional import _no_autocast, dual, nala_query_weights, under_transform  # noqa: F401  (re-exported)

FORWARD_OVER_REVERSE_REFUSAL = ("forward-over-reverse derivatives (torch.func.jvp of a gradient) through NaLa's fused "
                                "and Triton paths are not supported: their backward is once-differentiable; use "
                                "impl='eager', or reverse over forward (torch.func.grad of a torch.func.jvp)")
_TINY = torch.finfo(torch.float32).tiny     # the smallest normal fp32
CONTEXT_PARALLEL_REFUSAL = ("forward-mode derivatives (torch.func.jvp, MeanFlow) through context-parallel NaLa "
                            "are not supported; train without --context-parallel")


def in_forward_mode(*tensors) -> bool:
    """Whether a forward-mode derivative is being taken now: a ``torch.func.jvp`` on the
    transform stack, or one of ``tensors`` with a ``forward_ad`` tangent."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return dual(*tensors) or any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


def _query_features(q: torch.Tensor, opts: dict, norm_scale) -> torch.Tensor:
    """φ_q of §2 (``nala_features``) with the constants as ``opts`` and a norm scale that may be
    a per-head tensor (H, 1, 1) (the Triton path's learned s); fp32 or float64."""
    a, q_hat, _ = nala_query_weights(q, opts["power"], opts["offset"], norm_scale, opts["norm_eps"])
    if opts["direction"] == "cosine":
        theta = (math.pi / 4) * torch.tanh(opts["alpha"] * q_hat)
        return torch.cat([a * torch.cos(theta), a * torch.sin(theta)], -1)
    return torch.cat([a * (q_hat > 0), a * (q_hat < 0)], -1)


def _key_features(k: torch.Tensor, opts: dict) -> torch.Tensor:
    """φ_k of §2 (``nala_features``), fp32 or float64."""
    b = k.abs().pow(opts["power"])
    if opts["direction"] == "cosine":
        theta = (math.pi / 4) * torch.tanh(opts["alpha"] * (k / k.norm(dim=-1, keepdim=True).clamp_min(opts["norm_eps"])))
        return torch.cat([b * torch.cos(theta), b * torch.sin(theta)], -1)
    return torch.cat([b * (k > 0), b * (k < 0)], -1)


def _safe(x: torch.Tensor) -> torch.Tensor:
    """x with |x| raised to the smallest normal fp32: a divisor for ∂|x|^λ/∂x = λ|x|^λ/x, whose
    numerator is exactly 0 where x is (as ``fused._safe_divisor``)."""
    return torch.copysign(x.abs().clamp_min(_TINY), x)


def _unit_tangent(x, dx, eps: float):
    """(‖x‖, x̂ = x / max(‖x‖, ε), the tangents of ‖x‖ and of x̂)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    inv = 1 / norm.clamp_min(eps)
    d_norm = (x * dx).sum(-1, keepdim=True) / norm.clamp_min(_TINY)
    x_hat = x * inv
    return norm, x_hat, d_norm, (dx - x_hat * (d_norm * (norm >= eps))) * inv


def _lift_tangent(mag, d_mag, x_hat, dx_hat, opts: dict):
    """(φ, φ̇) of a §2 lift from the magnitude and the unit direction with their tangents:
    ``[m cos θ, m sin θ]``, θ = (π/4) tanh(α x̂) (cosine), or ``[m·1(x̂>0), m·1(x̂<0)]``."""
    if opts["direction"] != "cosine":
        pos, neg = x_hat > 0, x_hat < 0
        return torch.cat([mag * pos, mag * neg], -1), torch.cat([d_mag * pos, d_mag * neg], -1)
    t = torch.tanh(opts["alpha"] * x_hat)
    d_theta = (math.pi / 4 * opts["alpha"]) * (1 - t * t) * dx_hat
    cos, sin = torch.cos((math.pi / 4) * t), torch.sin((math.pi / 4) * t)
    m_cos, m_sin = mag * cos, mag * sin
    return torch.cat([m_cos, m_sin], -1), torch.cat([d_mag * cos - m_sin * d_theta, d_mag * sin + m_cos * d_theta], -1)


def _query_tangent(q, dq, opts: dict, norm_scale):
    """(φ_q, φ̇_q), written out (what ``torch.func.jvp`` of ``_query_features`` gives, float64-equal,
    in fewer passes): a = |q̂|^p with p = λ(τ + tanh(‖q‖/s)), ȧ = a·ṗ·log|q̂| + p·(a/q̂)·q̂̇."""
    norm, q_hat, d_norm, dq_hat = _unit_tangent(q, dq, opts["norm_eps"])
    th = torch.tanh(norm / norm_scale)
    p = opts["power"] * (opts["offset"] + th)
    dp = (opts["power"] / norm_scale) * (1 - th * th) * d_norm
    mag = q_hat.abs()
    a = mag.pow(p)
    da = a * mag.clamp_min(_TINY).log() * dp + p * (a / _safe(q_hat)) * dq_hat
    return _lift_tangent(a, da, q_hat, dq_hat, opts)


def _key_tangent(k, dk, opts: dict):
    """(φ_k, φ̇_k), written out: b = |k|^λ, ḃ = λ·(b/k)·k̇, the direction from k̂."""
    b = k.abs().pow(opts["power"])
    db = opts["power"] * (b / _safe(k)) * dk
    if opts["direction"] != "cosine":
        return _lift_tangent(b, db, k, dk, opts)
    _, k_hat, _, dk_hat = _unit_tangent(k, dk, opts["norm_eps"])
    return _lift_tangent(b, db, k_hat, dk_hat, opts)


def nala_tangent(q, k, v, tangents, opts: dict, norm_scale=None, shard=None, chunks=None) -> torch.Tensor:
    """The tangent ȯ of ``nala_attention(q, k, v)`` for input tangents ``(q̇, k̇, v̇)`` (None:
    zero), in v's dtype; computed in fp32 (float64 for float64 inputs), in the fused path's
    token ``chunks`` (default ``chunks.token_chunks``: each chunk's features and their tangents
    stay in cache). ``opts`` as ``fused.fused_opts`` builds them; ``norm_scale`` overrides
    ``opts["norm_scale"]`` (a float or a per-head (H,) tensor)."""
    if shard is not None:
        raise ValueError(CONTEXT_PARALLEL_REFUSAL)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = opts["norm_scale"] if norm_scale is None else norm_scale
    if isinstance(scale, torch.Tensor):
        scale = scale.to(acc).reshape(-1, 1, 1)
    out_dtype = v.dtype if tangents[2] is None else tangents[2].dtype
    with _no_autocast(q.device):
        q, k, v = (t.to(acc) for t in (q, k, v))
        dq, dk, dv = (None if t is None else t.to(acc) for t in tangents)
        n, d = k.shape[-2], v.shape[-1]
        chunks = token_chunks(q.shape, q.device) if chunks is None else chunks
        rows = lambda x, sl: x[:, :, sl]                                       # noqa: E731
        # pass over the keys: [S | z] and its tangent, each one GEMM against [v | 1]
        state = d_state = 0
        for sl in chunks:
            kc = rows(k, sl)
            v1 = torch.nn.functional.pad(rows(v, sl), (0, 1), value=1.0)       # (B, H, c, D+1)
            if dk is None:
                phi_k = _key_features(kc, opts)
            else:
                phi_k, dphi_k = _key_tangent(kc, rows(dk, sl), opts)
                d_state = d_state + dphi_k.mT @ v1
            state = state + phi_k.mT @ v1
            if dv is not None:
                d_state = d_state + torch.nn.functional.pad(phi_k.mT @ rows(dv, sl), (0, 1))
        state, d_state = state / n, d_state / n
        # pass over the queries: ȯ = (φ̇_qᵀS + φ_qᵀṠ − o·(φ̇_qᵀz + φ_qᵀż)) / den
        outs = []
        for sl in chunks:
            qc = rows(q, sl)
            if dq is None:
                phi_q = _query_features(qc, opts, scale)
                d_num_den = phi_q @ d_state if torch.is_tensor(d_state) else torch.zeros_like(phi_q @ state)
            else:
                phi_q, dphi_q = _query_tangent(qc, rows(dq, sl), opts, scale)
                d_num_den = dphi_q @ state + (phi_q @ d_state if torch.is_tensor(d_state) else 0)
            num_den = phi_q @ state
            den = num_den[..., d:] + opts["eps"]
            outs.append((d_num_den[..., :d] - num_den[..., :d] / den * d_num_den[..., d:]) / den)
        return torch.cat(outs, 2).to(out_dtype)


class TritonNaLaJvp(torch.autograd.Function):
    """The Triton kernels (``triton/launch.py``'s ``TritonNaLa``'s forward and backward, run with a
    plain context object as ``triton_op.py`` does) with a forward-mode rule
    (``nala_tangent``): what ``nala_attention`` runs on the Triton path under a transform."""

    @staticmethod
    def forward(q, k, v, scale, opts):
        from .triton.launch import TritonNaLa
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
        from .triton.launch import TritonNaLa, launch_config, num_splits
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
        kernel.opts, kernel.cfg, kernel.scale_shape = ctx.opts, launch_config(d), ctx.scale_shape
        # the forward's token ranges: the same function of the same shapes and device
        kernel.splits = num_splits(n, b * h, kernel.cfg["state"]["NV"], q.device)
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
    ``opts`` as ``triton/launch.py``'s ``nala_attention_triton`` takes them."""
    from .triton.launch import resolve_opts

    scale = torch.full((q.shape[1],), float(norm_scale), device=q.device)
    # the forward's outputs are its saved state only: the backward recomputes the features
    return TritonNaLaJvp.apply(q, k, v, scale, resolve_opts(q, dict(opts, keep_features=False)))[0]
