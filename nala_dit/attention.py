"""Attention for diffusion transformers: NaLa, its linear baselines, and softmax.

The contract is ``shared/docs/NALA_SPEC.md`` (Meng et al., "Norm×Direction: Restoring
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

import math
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

Direction = Literal["cosine", "relu_split"]
DIRECTIONS = ("cosine", "relu_split")
ATTENTIONS = ("softmax", "nala", "relu", "elu")

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


def _no_autocast(device: torch.device) -> torch.autocast:
    """Disable autocast on the tensors' device so fp32 stays fp32 inside."""
    return torch.autocast(device_type=device.type, enabled=False)


# --------------------------------------------------------------------------- features


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
    p = power * (offset + torch.tanh(norm / norm_scale))     # (B, H, N, 1)
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
) -> torch.Tensor:
    """Norm-aware linear attention (NaLa), linear in the number of tokens N.

    q, k, v: ``(B, H, N, D)``. Returns ``(B, H, N, D)`` in v's dtype; everything inside
    runs in fp32. No N×N tensor is ever formed.
    """
    _check_qkv(q, k, v)
    phi_q, phi_k = nala_features(
        q, k, direction=direction, power=power, offset=offset,
        norm_scale=norm_scale, alpha=alpha, norm_eps=norm_eps,
    )
    return normalized_linear_attention(phi_q, phi_k, v, eps).to(v.dtype)


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
    """The gated linear-attention layer of §4, with NaLa (default) or a baseline kernel.

    1. ``[q, k, v, g] = Linear(C → 4C)(x)``   (``g`` only when ``gate``)
    2. ``o = attention(q, k, v)`` over heads
    3. ``o += DWConv5×5(v)`` on the token grid (LePE, when ``lepe``)
    4. ``o = LayerNorm(o) ⊙ SiLU(g)``         (each part switchable)
    5. ``y = Linear(C → C)(o)``
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        kernel: Literal["nala", "relu", "elu"] = "nala",
        direction: Direction = "cosine",
        power: float = POWER,
        offset: float = OFFSET,
        norm_scale: float = NORM_SCALE,
        alpha: float = ALPHA,
        eps: float = EPS,
        lepe: bool = True,
        gate: bool = True,
        out_norm: bool = True,
    ):
        super().__init__()
        _check_heads(dim, num_heads)
        if kernel not in ("nala", "relu", "elu"):
            raise ValueError(f"kernel must be one of ('nala', 'relu', 'elu'), got {kernel!r}")
        if kernel == "nala":
            _check_direction(direction)
        self.num_heads = num_heads
        self.kernel = kernel
        self.feature_kwargs = dict(direction=direction, power=power, offset=offset,
                                   norm_scale=norm_scale, alpha=alpha)
        self.eps = eps
        self.use_gate = gate
        self.qkvg = nn.Linear(dim, (4 if gate else 3) * dim)
        self.lepe = nn.Conv2d(dim, dim, 5, padding=2, groups=dim) if lepe else None
        self.out_norm = nn.LayerNorm(dim) if out_norm else None
        self.proj = nn.Linear(dim, dim)
        # Mean query exponent p of the last forward (NaLa only): the raw norm saturates
        # tanh for typical head dims, so training logs this (INTEGRATION.md).
        self.record_stats = False
        self.last_stats: dict[str, float] = {}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kernel == "nala":
            return nala_attention(q, k, v, eps=self.eps, **self.feature_kwargs)
        return linear_attention(q, k, v, kernel=self.kernel, eps=self.eps)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        b, n, c = x.shape
        h = self.num_heads
        parts = self.qkvg(x).chunk(4 if self.use_gate else 3, dim=-1)  # each (B, N, C)
        q, k, v = (t.reshape(b, n, h, c // h).transpose(1, 2) for t in parts[:3])
        if self.record_stats and self.kernel == "nala":
            with torch.no_grad():
                fk = self.feature_kwargs
                p = fk["power"] * (fk["offset"] + torch.tanh(q.float().norm(dim=-1) / fk["norm_scale"]))
                self.last_stats = {"exponent_mean": p.mean().item(), "exponent_std": p.std().item()}
        o = self.attend(q, k, v).transpose(1, 2).reshape(b, n, c)      # (B, N, C)
        if self.lepe is not None:
            if grid is None or grid[0] * grid[1] != n:
                raise ValueError(f"LePE needs the token grid (h, w) with h*w == N={n}, got grid={grid}")
            v_img = parts[2].transpose(1, 2).reshape(b, c, *grid)       # (B, C, h, w)
            o = o + self.lepe(v_img).flatten(2).transpose(1, 2)
        if self.out_norm is not None:
            o = self.out_norm(o)
        if self.use_gate:
            o = o * F.silu(parts[3])
        return self.proj(o)                                           # (B, N, C)


def build_attention(attention: str, dim: int, num_heads: int, **options) -> nn.Module:
    """The attention layer named by ``attention`` (one of ``ATTENTIONS``)."""
    if attention == "softmax":
        return SoftmaxAttention(dim, num_heads)
    if attention in ("nala", "relu", "elu"):
        return GatedLinearAttention(dim, num_heads, kernel=attention, **options)
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
