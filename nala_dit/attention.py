"""Attention for diffusion transformers: NaLa, its linear baselines, and softmax.

The contract is ``docs/NALA_SPEC.md`` (Meng et al., "Norm×Direction: Restoring
the Missing Query Norm in Vision Linear Attention", arXiv 2506.21137). Section numbers
below (§2, §3, §4) refer to it.

Two layers of code live here:

* a functional core of pure functions over ``(B, H, N, D)`` tensors that own no
  parameters -- ``nala_attention`` (linear time) next to ``nala_attention_reference``
  (explicit N×N weights, for tests), the ReLU / 1+ELU linear baselines with their
  references, and SDPA softmax;
* ``nn.Module`` layers that own the projections and pick a function:
  ``SoftmaxAttention`` (DiT's own, with the official parameter names ``qkv``/``proj``)
  and ``GatedLinearAttention`` (the gated NaLa layer of §4; also hosts the baselines).

Every feature map, the key-value state ``S``, the normaliser ``z`` and the division run
in fp32 whatever the autocast dtype: ``|k|^3`` overflows fp16 at |k| > 40 and
``|q̂|^p`` underflows it (§3, "Precision").
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .options import (  # the names live with the CLI options (torch-free)
    ATTENTIONS, DIRECTIONS, LINEAR_KERNELS, TRITON_MAX_HEAD_DIM, TRITON_MAX_TOKENS, parse_norm_scale,
)

Direction = Literal["cosine", "relu_split"]

# Spec §2 / §3 defaults.
POWER = 3.0          # λ
OFFSET = 0.5         # τ
NORM_SCALE = 1.0     # s
ALPHA = 20.0         # α
NORM_EPS = 1e-6      # ε_n
EPS = 1e-6           # ε_z


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shape checks with messages that name the argument (not a deep matmul error)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(
                f"{name} must be a 4-D tensor (B, H, N, D), got shape {tuple(t.shape)}"
            )
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape (B, H, N, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v must share (B, H, N) with k, got v {tuple(v.shape)} and k {tuple(k.shape)}"
        )


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


def _fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


def _no_autocast(device: torch.device):
    """Disable autocast on the tensors' device so fp32 stays fp32 inside.

    Meta tensors (shape-only runs such as FLOP counting) have no autocast to disable.
    """
    if device.type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


# --------------------------------------------------------------------------- features


def nala_exponent(norm: torch.Tensor, power: float = POWER, offset: float = OFFSET,
                  norm_scale: float = NORM_SCALE) -> torch.Tensor:
    """The per-token exponent ``p = λ(τ + tanh(‖q‖/s))`` of §2, in ``[λτ, λ(τ+1))``."""
    return power * (offset + torch.tanh(norm / norm_scale))


def nala_query_weights(
    q: torch.Tensor,
    power: float = POWER,
    offset: float = OFFSET,
    norm_scale: float = NORM_SCALE,
    norm_eps: float = NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The norm-aware query magnitude of §2.

    Returns ``(a, q_hat, p)``: ``a = |q̂|^p`` (B, H, N, D), the unit direction ``q̂``
    and the per-token exponent ``p = λ(τ + tanh(‖q‖/s))`` (B, H, N, 1). A larger query
    norm gives a larger exponent, which concentrates ``a`` on the dominant coordinates
    and so sharpens the attention row: the norm acts as an inverse temperature.
    """
    norm = q.norm(dim=-1, keepdim=True)                      # (B, H, N, 1)
    q_hat = q / norm.clamp_min(norm_eps)
    p = nala_exponent(norm, power, offset, norm_scale)       # (B, H, N, 1)
    # torch.pow keeps 0^p and its gradients finite (unlike exp(p·log x)).
    a = q_hat.abs().pow(p)                                   # (B, H, N, D), in [0, 1]
    return a, q_hat, p


def nala_features(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    direction: Direction = "cosine",
    power: float = POWER,
    offset: float = OFFSET,
    norm_scale: float = NORM_SCALE,
    alpha: float = ALPHA,
    norm_eps: float = NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two NaLa feature maps ``(φ_q(q), φ_k(k))``, each ``(B, H, N, 2D)`` in fp32.

    ``φ_q(q_i)·φ_k(k_j)`` is the non-negative similarity of §2:
    ``Σ_m a_im b_jm cos(θ_im − θ_jm)`` in the cosine mode, and the same-sign products
    in the ``relu_split`` mode (its α → ∞ limit).
    """
    _check_direction(direction)
    with _no_autocast(q.device):
        q, k = _fp32(q, k)
        a, q_hat, _ = nala_query_weights(q, power, offset, norm_scale, norm_eps)
        b = k.abs().pow(power)                                # (B, H, N, D), norm kept
        if direction == "cosine":
            k_hat = k / k.norm(dim=-1, keepdim=True).clamp_min(norm_eps)
            theta_q = (math.pi / 4) * torch.tanh(alpha * q_hat)  # in (−π/4, π/4)
            theta_k = (math.pi / 4) * torch.tanh(alpha * k_hat)
            phi_q = torch.cat([a * torch.cos(theta_q), a * torch.sin(theta_q)], dim=-1)
            phi_k = torch.cat([b * torch.cos(theta_k), b * torch.sin(theta_k)], dim=-1)
        else:
            # |x|^p restricted to one sign: the base is never negative.
            phi_q = torch.cat([a * (q_hat > 0), a * (q_hat < 0)], dim=-1)
            phi_k = torch.cat([b * (k > 0), b * (k < 0)], dim=-1)
    return phi_q, phi_k


def kernel_features(x: torch.Tensor, kernel: Literal["relu", "elu"]) -> torch.Tensor:
    """Classic linear-attention feature maps (fp32): ReLU, or 1 + ELU (Katharopoulos 2020)."""
    with _no_autocast(x.device):
        x = x.float()
        if kernel == "relu":
            return F.relu(x)
        if kernel == "elu":
            return F.elu(x) + 1.0
    raise ValueError(f"kernel must be 'relu' or 'elu', got {kernel!r}")


# --------------------------------------------------------------- normalised attention


def normalized_linear_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """§3, linear form: ``o_i = φ_q(q_i)ᵀS / (φ_q(q_i)ᵀz + ε)`` in fp32, O(N) memory.

    ``S = (1/N) Σ_j φ_k(k_j) v_jᵀ`` and ``z = (1/N) Σ_j φ_k(k_j)``; the 1/N keeps the
    state on the mean scale so ``ε`` means the same thing at every resolution.
    """
    n = phi_k.shape[-2]
    with _no_autocast(v.device):
        v32 = v.float()
        state = phi_k.transpose(-2, -1) @ v32 / n                  # (B, H, F, D)
        z = phi_k.mean(dim=-2, keepdim=True)                       # (B, H, 1, F)
        num = phi_q @ state                                        # (B, H, N, D)
        den = (phi_q * z).sum(dim=-1, keepdim=True) + eps          # (B, H, N, 1)
        return num / den


def normalized_attention_reference(
    sim: torch.Tensor, v: torch.Tensor, eps: float = EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """§3, quadratic form: ``W = sim / (Σ_j sim + N·ε)``, ``o = W v``. Returns (o, W)."""
    n = sim.shape[-1]
    weights = sim / (sim.sum(dim=-1, keepdim=True) + n * eps)     # (B, H, N, N)
    return weights @ v.float(), weights


NALA_IMPLS = ("auto", "fused", "eager", "compile", "triton")

# Tokens are processed in chunks of about this many elements per (B, H, C, D) slice:
# the feature maps are per token, so chunking bounds their temporaries (O(chunk), not
# O(N)) and keeps each elementwise pass inside the cache. On a GPU small chunks only
# multiply kernel launches, so there a chunk is most or all of the sequence.
_CHUNK_ELEMENTS = 2**18
_CHUNK_ELEMENTS_GPU = 2**25


def _token_chunks(shape: torch.Size, device: torch.device) -> list[slice]:
    b, h, n, d = shape
    elements = _CHUNK_ELEMENTS if device.type in ("cpu", "meta") else _CHUNK_ELEMENTS_GPU
    size = max(64, elements // max(1, b * h * d))
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


Halves = tuple[torch.Tensor, torch.Tensor]


def _lift(theta: torch.Tensor | None, mag: torch.Tensor, x: torch.Tensor) -> Halves:
    """The two halves of a §2 feature map, each contiguous (B, H, C, D):
    ``(mag ⊙ cos θ, mag ⊙ sin θ)`` (cosine) or ``(mag ⊙ 1(x>0), mag ⊙ 1(x<0))``
    (relu_split). ``torch.cat`` of them is the 2D-wide feature; it is never built:
    each product with the state is two GEMMs into one output instead."""
    if theta is None:
        first = mag * (x > 0)
        # mag − mag·1(x>0) = mag·1(x<0): at x = 0 the magnitude is 0^p = 0 anyway.
        return first, mag.sub_(first)
    sin = torch.sin(theta)
    # |θ| < π/4, so cos θ = √(1 − sin²θ) ≥ 1/√2 has no cancellation, and a square root
    # costs far less than a second transcendental.
    cos = (sin * sin).neg_().add_(1.0).sqrt_()
    return cos.mul_(mag), sin.mul_(mag)


def _angle(x_hat: torch.Tensor, alpha: float) -> torch.Tensor:
    """θ = (π/4)·tanh(α x̂) of §2, via tanh(u) = 2σ(2u) − 1 (σ is several times cheaper
    than tanh on CPU); the absolute error stays at fp32 rounding."""
    return torch.sigmoid(x_hat * (2 * alpha)).mul_(math.pi / 2).sub_(math.pi / 4)


def _unit(x: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)     # (B, H, C, 1)
    clamped = norm.clamp_min(norm_eps)
    return x / clamped, norm, clamped


def _query_lift(q: torch.Tensor, o: dict) -> tuple[Halves, tuple]:
    """φ_q of §2 for a chunk of fp32 queries, and what the backward needs."""
    q_hat, norm, clamped = _unit(q, o["norm_eps"])
    p = o["power"] * (o["offset"] + torch.tanh(norm / o["norm_scale"]))   # (B, H, C, 1)
    # a = |q̂|^p as exp(p·log|q̂|): log 0 = −inf gives exactly 0 here, and this forward
    # is never differentiated by autograd -- _query_grad handles q̂ = 0 explicitly.
    a = q_hat.abs().log_().mul_(p).exp_()
    theta = _angle(q_hat, o["alpha"]) if o["direction"] == "cosine" else None
    return _lift(theta, a, q_hat), (q_hat, norm, clamped, p, theta)


def _key_lift(k: torch.Tensor, o: dict) -> tuple[Halves, tuple]:
    """φ_k of §2 for a chunk of fp32 keys, and what the backward needs."""
    b = k.abs().pow_(o["power"])                                  # norm kept
    theta = k_hat = norm = clamped = None
    if o["direction"] == "cosine":
        k_hat, norm, clamped = _unit(k, o["norm_eps"])
        theta = _angle(k_hat, o["alpha"])
    return _lift(theta, b, k), (k_hat, norm, clamped, theta)


def _lift_grads(feat: Halves, grad: Halves, theta: torch.Tensor | None, alpha: float):
    """Backward of ``_lift`` from the features themselves (cos, sin, mag are not kept).

    With ``F = (m c, m s)`` and its gradient ``G = (G₁, G₂)``:
    ``m·∂L/∂m = G₁F₁ + G₂F₂`` and ``∂L/∂θ = G₂F₁ − G₁F₂``. Returns
    ``(m·∂L/∂m, ∂L/∂x̂ through θ, or None)``.
    """
    m_dm = torch.addcmul(grad[0] * feat[0], grad[1], feat[1])
    if theta is None:
        return m_dm, None
    d_theta = torch.addcmul(grad[1] * feat[0], grad[0], feat[1], value=-1.0)
    # θ = (π/4)·tanh(α x̂): dθ/dx̂ = (π/4)·α·(1 − tanh²), with tanh = (4/π)·θ.
    t = theta * (4 / math.pi)
    return m_dm, d_theta.mul_((1 - t * t).mul_(math.pi / 4 * alpha))


def _through_unit(x, x_hat, norm, clamped, d_hat, d_norm, norm_eps):
    """Gradient wrt x of ``x̂ = x / max(‖x‖, ε)`` plus an extra ``∂L/∂‖x‖``."""
    d_clamped = -(d_hat * x_hat).sum(-1, keepdim=True) / clamped
    # clamp_min passes the gradient where ‖x‖ ≥ ε; ‖x‖ has gradient x/‖x‖, 0 at x = 0.
    d_norm = d_norm + torch.where(norm >= norm_eps, d_clamped, 0.0)
    return (d_hat / clamped).addcmul_(d_norm / norm.masked_fill(norm == 0, 1.0), x)


def _query_grad(q, feat, grad, parts, o):
    q_hat, norm, clamped, p, theta = parts
    a_da, d_hat = _lift_grads(feat, grad, theta, o["alpha"])
    # a = |q̂|^p:  ∂a/∂q̂ = p·a/q̂ and ∂a/∂p = a·log|q̂|, both 0 where q̂ = 0 (as torch.pow).
    d_a_hat = a_da * p / q_hat.masked_fill(q_hat == 0, 1.0)
    d_hat = d_a_hat if d_hat is None else d_hat.add_(d_a_hat)
    d_p = torch.special.xlogy(a_da, q_hat.abs()).sum(-1, keepdim=True)
    tanh_n = p / o["power"] - o["offset"]                         # tanh(‖q‖/s)
    d_norm = d_p * (o["power"] / o["norm_scale"]) * (1 - tanh_n * tanh_n)
    return _through_unit(q, q_hat, norm, clamped, d_hat, d_norm, o["norm_eps"])


def _key_grad(k, feat, grad, parts, o):
    k_hat, norm, clamped, theta = parts
    b_db, d_hat = _lift_grads(feat, grad, theta, o["alpha"])
    # b = |k|^λ: ∂b/∂k = λ·b/k, 0 at k = 0.
    d_k = b_db.mul_(o["power"]).div_(k.masked_fill(k == 0, 1.0))
    if d_hat is None:
        return d_k
    return d_k.add_(_through_unit(k, k_hat, norm, clamped, d_hat, torch.zeros_like(norm), o["norm_eps"]))


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """``[v, 1]``: one GEMM then yields both the state S and the normaliser z (§3)."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


class _FusedNaLa(torch.autograd.Function):
    """§3 linear form in token chunks. The state is kept as its two halves
    ``[S | z]`` (each D × (D+1), one per feature half). The backward saves q, k, v, the
    state and the per-token denominator only, and recomputes the features."""

    @staticmethod
    def forward(ctx, q, k, v, opts):
        with _no_autocast(q.device):
            b, h, n, d = q.shape
            state = q.new_zeros(2, b, h, d, d + 1, dtype=torch.float32)    # [S | z] halves
            for sl in _token_chunks(q.shape, q.device):
                phi_k = _key_lift(k[:, :, sl].float(), opts)[0]
                v1 = _with_ones(v[:, :, sl].float())                       # (B, H, C, D+1)
                for half, f in zip(state, phi_k):
                    half.add_(f.transpose(-2, -1) @ v1)
            state.div_(n)
            out = q.new_empty(b, h, n, d, dtype=torch.float32)
            den = q.new_empty(b, h, n, 1, dtype=torch.float32)
            for sl in _token_chunks(q.shape, q.device):
                f1, f2 = _query_lift(q[:, :, sl].float(), opts)[0]
                num_den = (f1 @ state[0]).add_(f2 @ state[1])              # (B, H, C, D+1)
                torch.add(num_den[..., d:], opts["eps"], out=den[:, :, sl])
                torch.div(num_den[..., :d], den[:, :, sl], out=out[:, :, sl])
        ctx.opts = opts
        ctx.save_for_backward(q, k, v, state, den)
        return out.to(v.dtype)

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiated
    def backward(ctx, grad_out):
        q, k, v, state, den = ctx.saved_tensors
        o = ctx.opts
        b, h, n, d = q.shape
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        with _no_autocast(q.device):
            s_t = state[..., :d].transpose(-2, -1)                       # (2, B, H, D, D)
            z = state[..., d].unsqueeze(-2)                              # (2, B, H, 1, D)
            d_state = torch.zeros_like(state)
            dq = torch.empty_like(q, dtype=torch.float32) if need_q else None
            for sl in _token_chunks(q.shape, q.device):
                qc = q[:, :, sl].float()
                phi_q, parts = _query_lift(qc, o)
                dd = den[:, :, sl]
                d_num = grad_out[:, :, sl].float() / dd                  # (B, H, C, D)
                d_phi = [d_num @ s_t[0], d_num @ s_t[1]]                 # halves of ∂L/∂φ_q
                # ∂L/∂den = −Σ g·o/den, and g·num = den·(φ_q · d_num Sᵀ).
                dot = torch.addcmul(phi_q[0] * d_phi[0], phi_q[1], d_phi[1])
                d_den = dot.sum(-1, keepdim=True).div_(dd).neg_()
                d_nd = torch.cat([d_num, d_den], -1)
                for half, f in zip(d_state, phi_q):
                    half.add_(f.transpose(-2, -1) @ d_nd)
                if need_q:
                    for g, zh in zip(d_phi, z):
                        g.addcmul_(d_den, zh)
                    dq[:, :, sl] = _query_grad(qc, phi_q, d_phi, parts, o)
            d_state.div_(n)
            dk = torch.empty_like(k, dtype=torch.float32) if need_k else None
            dv = torch.empty_like(v, dtype=torch.float32) if need_v else None
            if need_k or need_v:
                for sl in _token_chunks(k.shape, k.device):
                    kc = k[:, :, sl].float()
                    phi_k, parts = _key_lift(kc, o)
                    if need_v:
                        dv[:, :, sl] = (phi_k[0] @ d_state[0, ..., :d]).add_(phi_k[1] @ d_state[1, ..., :d])
                    if need_k:
                        v1 = _with_ones(v[:, :, sl].float())
                        d_phi = [v1 @ half.transpose(-2, -1) for half in d_state]
                        dk[:, :, sl] = _key_grad(kc, phi_k, d_phi, parts, o)
        cast = lambda g, x: None if g is None else g.to(x.dtype)
        return cast(dq, q), cast(dk, k), cast(dv, v), None


def _nala_eager(q, k, v, direction, power, offset, norm_scale, alpha, norm_eps, eps):
    """The readable composition: 2D-wide features, then the §3 linear form, autograd."""
    phi_q, phi_k = nala_features(
        q, k, direction=direction, power=power, offset=offset,
        norm_scale=norm_scale, alpha=alpha, norm_eps=norm_eps,
    )
    return normalized_linear_attention(phi_q, phi_k, v, eps).to(v.dtype)


_compiled_eager = None


def _nala_compiled(*args):
    """``torch.compile`` of the eager composition (inductor fuses the feature maps);
    built lazily, since compiling takes tens of seconds on a CPU."""
    global _compiled_eager
    if _compiled_eager is None:
        _compiled_eager = torch.compile(_nala_eager, dynamic=True)
    return _compiled_eager(*args)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_nala_impl(device_type: str, head_dim: int, dtype: torch.dtype, has_triton: bool,
                     num_tokens: int = 0) -> str:
    """The code path ``impl="auto"`` runs; a pure function of what it is given.

    CPU (and meta, for FLOP counting): the token-chunked fused path. CUDA: the Triton
    kernels when Triton is installed and takes the shape (head dim ≤ 128, N ≤
    ``TRITON_MAX_TOKENS``; fp32/bf16/fp16), else the unchunked composition (``"eager"``:
    a few large kernels). ``torch.compile`` is never picked: on CUDA it needs Triton too,
    which would have run the kernels.
    """
    if device_type in ("cpu", "meta"):
        return "fused"
    if (device_type == "cuda" and has_triton and head_dim <= TRITON_MAX_HEAD_DIM
            and num_tokens <= TRITON_MAX_TOKENS
            and dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return "triton"
    return "eager"


def nala_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    direction: Direction = "cosine",
    power: float = POWER,
    offset: float = OFFSET,
    norm_scale: float = NORM_SCALE,
    alpha: float = ALPHA,
    norm_eps: float = NORM_EPS,
    eps: float = EPS,
    impl: str = "auto",
) -> torch.Tensor:
    """Norm-aware linear attention (NaLa), linear in the number of tokens N.

    q, k, v: ``(B, H, N, D)``. Returns ``(B, H, N, D)`` in v's dtype; everything inside
    runs in fp32. No N×N tensor is ever formed. ``impl`` picks the code path, all with
    the same numbers up to fp32 rounding:

    * ``"auto"``: ``select_nala_impl`` for the tensors' device (fused on CPU, Triton on
      CUDA);
    * ``"fused"``: token-chunked features kept as their cos/sin halves (no
      concatenation; two GEMMs per product), ``[S | z]`` from the same GEMM, and a
      hand-written backward that saves only q, k, v, the small state and the
      denominator (features are recomputed);
    * ``"triton"``: the same algorithm as GPU kernels (``nala_dit/triton_nala.py``), the
      features computed in registers;
    * ``"eager"``: the readable composition ``nala_features`` → §3, plain autograd;
    * ``"compile"``: ``torch.compile`` of the eager composition (opt-in; slow to build).
    """
    _check_qkv(q, k, v)
    _check_direction(direction)
    if impl not in NALA_IMPLS:
        raise ValueError(f"impl must be one of {NALA_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = select_nala_impl(q.device.type, q.shape[-1], q.dtype, triton_available(), q.shape[-2])
    if impl == "triton":
        from nala_dit.triton_nala import nala_attention_triton

        return nala_attention_triton(q, k, v, norm_scale, dict(
            direction=direction, power=float(power), offset=float(offset), alpha=float(alpha),
            norm_eps=float(norm_eps), eps=float(eps)))
    if impl == "eager":
        return _nala_eager(q, k, v, direction, power, offset, norm_scale, alpha, norm_eps, eps)
    if impl == "compile":
        return _nala_compiled(q, k, v, direction, power, offset, norm_scale, alpha, norm_eps, eps)
    opts = dict(direction=direction, power=float(power), offset=float(offset),
                norm_scale=float(norm_scale), alpha=float(alpha), norm_eps=float(norm_eps),
                eps=float(eps))
    return _FusedNaLa.apply(q, k, v, opts)


def nala_similarity_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    direction: Direction = "cosine",
    power: float = POWER,
    offset: float = OFFSET,
    norm_scale: float = NORM_SCALE,
    alpha: float = ALPHA,
    norm_eps: float = NORM_EPS,
) -> torch.Tensor:
    """``sim(i, j)`` of §2 written straight from its definition, (B, H, N, N).

    Deliberately independent of ``nala_features``: it sums ``a_im b_jm cos(θ_im − θ_jm)``
    over an explicit (N, N, D) tensor instead of using the 2D-wide feature lift.
    """
    _check_direction(direction)
    q, k = _fp32(q, k)
    a, q_hat, _ = nala_query_weights(q, power, offset, norm_scale, norm_eps)
    b = k.abs().pow(power)
    pair = a.unsqueeze(-2) * b.unsqueeze(-3)                        # (B, H, N, N, D)
    if direction == "cosine":
        k_hat = k / k.norm(dim=-1, keepdim=True).clamp_min(norm_eps)
        theta_q = (math.pi / 4) * torch.tanh(alpha * q_hat)
        theta_k = (math.pi / 4) * torch.tanh(alpha * k_hat)
        pair = pair * torch.cos(theta_q.unsqueeze(-2) - theta_k.unsqueeze(-3))
    else:
        same_sign = (torch.sign(q_hat).unsqueeze(-2) * torch.sign(k).unsqueeze(-3)) > 0
        pair = pair * same_sign
    return pair.sum(dim=-1)


def nala_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    eps: float = EPS,
    return_weights: bool = False,
    **feature_kwargs,
):
    """Quadratic NaLa with the explicit attention matrix ``W`` (tests only)."""
    _check_qkv(q, k, v)
    with _no_autocast(q.device):
        sim = nala_similarity_reference(q, k, **feature_kwargs)
        out, weights = normalized_attention_reference(sim, v, eps)
    out = out.to(v.dtype)
    return (out, weights) if return_weights else out


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kernel: Literal["relu", "elu"] = "relu",
    eps: float = EPS,
) -> torch.Tensor:
    """Kernel linear attention baseline (ReLU or 1+ELU) with the §3 normalisation."""
    _check_qkv(q, k, v)
    out = normalized_linear_attention(kernel_features(q, kernel), kernel_features(k, kernel), v, eps)
    return out.to(v.dtype)


def linear_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kernel: Literal["relu", "elu"] = "relu",
    eps: float = EPS,
    return_weights: bool = False,
):
    """Quadratic form of ``linear_attention`` with the explicit weights (tests only)."""
    _check_qkv(q, k, v)
    with _no_autocast(q.device):
        sim = kernel_features(q, kernel) @ kernel_features(k, kernel).transpose(-2, -1)
        out, weights = normalized_attention_reference(sim, v, eps)
    out = out.to(v.dtype)
    return (out, weights) if return_weights else out


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """DiT's attention: scaled dot-product softmax through the fused SDPA kernels."""
    _check_qkv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)


def softmax_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_weights: bool = False
):
    """Explicit ``softmax(q kᵀ/√D) v`` (the "math" path), for tests and benchmarks."""
    _check_qkv(q, k, v)
    weights = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)
    out = weights @ v
    return (out, weights) if return_weights else out


# ------------------------------------------------------------------ rotary (numerator)
# The NaLa authors' released code adds a 2-D rotary position embedding to the numerator
# only (spec §7): o_i = [R_i φ_q(q_i)]ᵀ Σ_j [R_j φ_k(k_j)] v_jᵀ / [φ_q(q_i)ᵀ Σ_j φ_k(k_j) + Nε]
# (both sides on the 1/N mean scale). The denominator keeps the unrotated, non-negative
# features, so it stays positive; the numerator gains relative position, since
# (R_i a)·(R_j b) depends on i − j only. The F feature channels form F/2 pairs (2m, 2m+1);
# the first F/4 pairs turn with the token's row, the last F/4 with its column, at
# frequencies base^(−m/(F/4)) (their RoPE on a (h, w) grid).

ROPE_BASE = 10000.0


def rope_angles(grid: tuple[int, int], features: int, base: float = ROPE_BASE,
                device=None) -> torch.Tensor:
    """Rotation angle of every (token, channel pair): ``(h·w, features/2)`` in fp32.

    ``features`` (the feature width F) must be a multiple of 4: half of the pairs rotate
    with the row index, half with the column index.
    """
    if features % 4:
        raise ValueError(f"rope needs a feature width divisible by 4 (even head dim), got {features}")
    h, w = grid
    k = features // 4
    freqs = base ** (-torch.arange(k, dtype=torch.float32, device=device) / k)          # (F/4,)
    rows, cols = torch.meshgrid(torch.arange(h, dtype=torch.float32, device=device),
                                torch.arange(w, dtype=torch.float32, device=device), indexing="ij")
    return torch.cat([rows.reshape(-1, 1) * freqs, cols.reshape(-1, 1) * freqs], dim=-1)  # (N, F/2)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair (2m, 2m+1) of ``x`` (..., N, F) by ``angles`` (N, F/2)."""
    pairs = x.unflatten(-1, (-1, 2))                                                   # (..., N, F/2, 2)
    cos, sin = torch.cos(angles), torch.sin(angles)
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def rope_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                          angles: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Linear attention with rotated features in the numerator only (spec §7), fp32, O(N)."""
    n = phi_k.shape[-2]
    with _no_autocast(v.device):
        v32 = v.float()
        state = apply_rope(phi_k, angles).transpose(-2, -1) @ v32 / n          # (B, H, F, D)
        num = apply_rope(phi_q, angles) @ state                                # (B, H, N, D)
        den = (phi_q * phi_k.mean(dim=-2, keepdim=True)).sum(-1, keepdim=True) + eps
        return num / den


def rope_attention_reference(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                             grid: tuple[int, int], eps: float = EPS, base: float = ROPE_BASE):
    """Quadratic form of ``rope_linear_attention`` (tests only), written independently:
    rotation as complex multiplication, ``W_ij = Re⟨R_i φ_q(q_i), R_j φ_k(k_j)⟩ /
    (Σ_j' φ_q(q_i)·φ_k(k_j') + Nε)``. Returns (o, W); rows of W need not be non-negative."""
    h, w = grid
    f = phi_q.shape[-1]
    k = f // 4
    freqs = 1.0 / base ** (torch.arange(k, dtype=torch.float64) / k)
    pos = [(r, c) for r in range(h) for c in range(w)]
    theta = torch.tensor([[r * fr for fr in freqs] + [c * fr for fr in freqs] for r, c in pos])   # (N, F/2)
    rot = torch.polar(torch.ones_like(theta), theta).to(torch.complex64)
    cq = torch.view_as_complex(phi_q.float().reshape(*phi_q.shape[:-1], f // 2, 2).contiguous()) * rot
    ck = torch.view_as_complex(phi_k.float().reshape(*phi_k.shape[:-1], f // 2, 2).contiguous()) * rot
    # Re(a·conj(b)) summed over pairs is the real dot product of the rotated vectors.
    num = (cq.unsqueeze(-2) * ck.unsqueeze(-3).conj()).real.sum(-1)          # (B, H, N, N)
    n = phi_k.shape[-2]
    den = (phi_q.float() @ phi_k.float().transpose(-2, -1)).sum(-1, keepdim=True) + n * eps
    weights = num / den
    return weights @ v.float(), weights


# ---------------------------------------------------------------------------- layers


def _check_heads(dim: int, num_heads: int) -> None:
    if num_heads < 1 or dim % num_heads != 0:
        raise ValueError(
            f"num_heads={num_heads} must divide the hidden size dim={dim} "
            f"(choose num_heads among {[h for h in range(1, dim + 1) if dim % h == 0][:12]}...)"
        )


class SoftmaxAttention(nn.Module):
    """DiT's softmax self-attention, with the official checkpoint names ``qkv`` and ``proj``."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        _check_heads(dim, num_heads)
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                       # each (B, H, N, D)
        o = softmax_attention(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))       # (B, N, C)


class GatedLinearAttention(nn.Module):
    """The gated attention layer of §4, with NaLa (default), a linear baseline or softmax.

    1. ``[q, k, v, g] = Linear(C → 4C)(x)``   (``g`` only when ``gate``)
    2. ``o = attention(q, k, v)`` over heads  (``kernel``: nala, relu, elu or softmax)
    3. ``o += DWConv5×5(v)`` on the token grid (LePE, when ``lepe``)
    4. ``o = LayerNorm(o) ⊙ SiLU(g)``         (each part switchable)
    5. ``y = Linear(C → C)(o)``

    ``kernel="softmax"`` ("softmax_gated") is SDPA softmax inside the same layer, so an
    ablation can tell the kernel from the extras (qkvg, LePE, LayerNorm, gate).

    NaLa's ``norm_scale`` s (spec §7) is a positive float (1 = the paper), ``"sqrt_d"``
    (s = √D) or ``"learned"``: one s = exp(ρ) per head in the parameter
    ``log_norm_scale`` (state-dict key ``blocks.{i}.attn.log_norm_scale``, shape (H,)),
    initialised by ``reset_norm_scale`` and kept out of weight decay by the trainer.
    Since q enters NaLa only through ‖q‖ and q̂ = q/‖q‖, a scale s is applied as
    ``NaLa(q/s)`` with s = 1: every code path (fused, Triton, eager) runs unchanged and
    autograd differentiates through the division.

    ``rope`` (linear kernels only): the numerator-only 2-D rotary embedding of §7 on the
    token grid (``rope_linear_attention``; needs an even head dim and the grid).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        kernel: Literal["nala", "relu", "elu", "softmax"] = "nala",
        direction: Direction = "cosine",
        power: float = POWER,
        offset: float = OFFSET,
        norm_scale: float | str = NORM_SCALE,
        alpha: float = ALPHA,
        eps: float = EPS,
        lepe: bool = True,
        gate: bool = True,
        out_norm: bool = True,
        rope: bool = False,
    ):
        super().__init__()
        _check_heads(dim, num_heads)
        kernels = LINEAR_KERNELS + ("softmax",)
        if kernel not in kernels:
            raise ValueError(f"kernel must be one of {kernels}, got {kernel!r}")
        if kernel == "nala":
            _check_direction(direction)
        head_dim = dim // num_heads
        norm_scale = parse_norm_scale(norm_scale)
        if rope and kernel not in LINEAR_KERNELS:
            raise ValueError(f"rope applies to the linear kernels {LINEAR_KERNELS} (numerator-only rotary "
                             f"embedding), not to kernel={kernel!r}; use rope=False")
        if rope and head_dim % 2:
            raise ValueError(f"rope needs an even head dim (the 2·D NaLa features form channel pairs, half per "
                             f"grid axis), got head dim {head_dim} = {dim}/{num_heads}; use rope=False or "
                             f"an even head dim")
        self.num_heads = num_heads
        self.kernel = kernel
        self.norm_scale_mode = norm_scale if isinstance(norm_scale, str) else "fixed"
        fixed = {"sqrt_d": math.sqrt(head_dim), "learned": 1.0}.get(norm_scale, norm_scale)
        self.feature_kwargs = dict(direction=direction, power=power, offset=offset,
                                   norm_scale=fixed, alpha=alpha)
        self.eps = eps
        self.use_gate = gate
        self.rope = rope
        self.qkvg = nn.Linear(dim, (4 if gate else 3) * dim)
        self.lepe = nn.Conv2d(dim, dim, 5, padding=2, groups=dim) if lepe else None
        self.out_norm = nn.LayerNorm(dim) if out_norm else None
        self.proj = nn.Linear(dim, dim)
        if self.norm_scale_mode == "learned":
            self.log_norm_scale = nn.Parameter(torch.zeros(num_heads))
            self.reset_norm_scale()
        # Statistics of the query exponent p of the last forward (NaLa only), logged by
        # training: with s = 1 the raw norm saturates tanh for typical head dims.
        self.record_stats = False
        self.last_stats: dict[str, float] = {}

    @torch.no_grad()
    def reset_norm_scale(self) -> None:
        """Learned scale: s_h = the RMS of ‖q‖ over unit-variance white inputs, i.e. the
        Frobenius norm of head h's query rows of ``qkvg`` (bias included), so ‖q‖/s ≈ 1
        at initialisation, where tanh is steep. A DiT block feeds LayerNorm'd tokens
        (unit variance), so this holds for the real inputs; call again after re-initialising
        ``qkvg`` (``DiT.initialize_weights`` does)."""
        if self.norm_scale_mode != "learned":
            return
        c = self.proj.in_features
        h = self.num_heads
        w = self.qkvg.weight[:c].reshape(h, c // h, c)
        b = self.qkvg.bias[:c].reshape(h, c // h)
        rms = (w.square().sum((1, 2)) + b.square().sum(1)).sqrt()
        self.log_norm_scale.copy_(rms.clamp_min(1e-6).log())

    def norm_scale(self) -> torch.Tensor | float:
        """The scale s in use: a float, or (learned) a (H, 1, 1) tensor, one per head."""
        if self.norm_scale_mode == "learned":
            return self.log_norm_scale.exp().view(-1, 1, 1)
        return self.feature_kwargs["norm_scale"]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               grid: tuple[int, int] | None = None) -> torch.Tensor:
        if self.kernel == "softmax":
            return softmax_attention(q, k, v)
        if self.kernel == "nala" and self.norm_scale_mode == "learned":
            q = q / self.norm_scale().to(q.dtype)     # NaLa(q/s, s=1) == NaLa(q, s); see the class doc
        if not self.rope:
            if self.kernel == "nala":
                return nala_attention(q, k, v, eps=self.eps, **self.feature_kwargs)
            return linear_attention(q, k, v, kernel=self.kernel, eps=self.eps)
        if grid is None or grid[0] * grid[1] != q.shape[-2]:
            raise ValueError(f"rope needs the token grid (h, w) with h*w == N={q.shape[-2]}, got grid={grid}")
        if self.kernel == "nala":
            phi_q, phi_k = nala_features(q, k, **self.feature_kwargs)
        else:
            phi_q, phi_k = kernel_features(q, self.kernel), kernel_features(k, self.kernel)
        angles = rope_angles(grid, phi_q.shape[-1], device=q.device)
        return rope_linear_attention(phi_q, phi_k, v, angles, self.eps).to(v.dtype)

    def exponent(self, q: torch.Tensor) -> torch.Tensor:
        """NaLa's per-token exponent p for queries (B, H, N, D): (B, H, N)."""
        fk = self.feature_kwargs
        s = self.norm_scale()
        s = s.squeeze(-1) if isinstance(s, torch.Tensor) else s
        return nala_exponent(q.float().norm(dim=-1) / s, fk["power"], fk["offset"], 1.0)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        b, n, c = x.shape
        h = self.num_heads
        parts = self.qkvg(x).chunk(4 if self.use_gate else 3, dim=-1)  # each (B, N, C)
        q, k, v = (t.reshape(b, n, h, c // h).transpose(1, 2) for t in parts[:3])
        if self.record_stats and self.kernel == "nala":
            with torch.no_grad():
                p = self.exponent(q)
                self.last_stats = {"exponent_mean": p.mean().item(), "exponent_std": p.std().item(),
                                   "saturated": saturated_share(p, self.feature_kwargs["power"],
                                                                self.feature_kwargs["offset"])}
        o = self.attend(q, k, v, grid).transpose(1, 2).reshape(b, n, c)      # (B, N, C)
        if self.lepe is not None:
            if grid is None or grid[0] * grid[1] != n:
                raise ValueError(f"LePE needs the token grid (h, w) with h*w == N={n}, got grid={grid}")
            v_img = parts[2].transpose(1, 2).reshape(b, c, *grid)       # (B, C, h, w)
            # v_img is a channels-last view, so the conv runs channels-last and its output
            # flattens back to (B, N, C) for free; but it then gives the (C, 1, 5, 5) weight a
            # channels-last gradient, strides (25, 1, 5, 1) against the parameter's (25, 25, 5, 1),
            # which DDP flags ("Grad strides do not match bucket view strides") and copies every
            # step. A (C, 25) view round trip of the weight is free forward and gives its
            # gradient the parameter's strides.
            weight = self.lepe.weight.flatten(1).view_as(self.lepe.weight)
            lepe = F.conv2d(v_img, weight, self.lepe.bias, padding=self.lepe.padding, groups=c)
            o = o + lepe.flatten(2).transpose(1, 2)
        if self.out_norm is not None:
            o = self.out_norm(o)
        if self.use_gate:
            o = o * F.silu(parts[3])
        return self.proj(o)                                           # (B, N, C)


SATURATION = 0.01  # a token is "saturated" when its exponent is within 1 % of the maximum


def saturated_share(p: torch.Tensor, power: float = POWER, offset: float = OFFSET) -> float:
    """Share of exponents within 1 % of their supremum λ(τ + 1): tokens for which the
    query norm no longer changes anything (tanh is flat there)."""
    top = power * (offset + 1.0)
    return (p >= top * (1 - SATURATION)).float().mean().item()


def build_attention(attention: str, dim: int, num_heads: int, **options) -> nn.Module:
    """The attention layer named by ``attention`` (one of ``ATTENTIONS``)."""
    if attention == "softmax":
        return SoftmaxAttention(dim, num_heads)
    if attention in LINEAR_KERNELS:
        return GatedLinearAttention(dim, num_heads, kernel=attention, **options)
    if attention == "softmax_gated":
        return GatedLinearAttention(dim, num_heads, kernel="softmax", **options)
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
