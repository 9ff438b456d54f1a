"""NaLa's math as pure functions over ``(B, H, N, D)`` tensors: no parameters, no state.

The contract is ``docs/NALA_SPEC.md`` (Meng et al., "Norm×Direction: Restoring
the Missing Query Norm in Vision Linear Attention", arXiv 2506.21137). Section numbers
below (§2, §3, §7) refer to it. Top to bottom:

* the argument checks every path shares (the §2 / §3 constants and ``NaLaConfig``, which
  carries them to every function here, are in ``config.py``);
* the feature maps: ``nala_exponent``, ``nala_query_weights``, ``nala_features`` (the
  2D-wide lift) and the ReLU / 1+ELU ``kernel_features``;
* the §3 normalised attention, linear (``normalized_linear_attention``) and quadratic
  (``normalized_attention_reference``);
* the explicit N×N references (tests only): ``nala_similarity_reference``,
  ``nala_attention_reference``, ``linear_attention_reference``,
  ``softmax_attention_reference``, next to the baselines ``linear_attention`` and SDPA
  ``softmax_attention``;
* the numerator-only rotary embedding of §7 (``rope_angles``, ``apply_rope``,
  ``rope_linear_attention`` and its quadratic reference);
* ``saturated_share``: how many tokens sit where the exponent no longer moves.

The fast NaLa paths (``nala_attention``: fused CPU autograd, Triton, eager, compile) are
in ``nala/``; the layers in ``layers.py``.

Every feature map, the key-value state ``S``, the normaliser ``z`` and the division run
in fp32 whatever the autocast dtype: ``|k|^3`` overflows fp16 at |k| > 40 and
``|q̂|^p`` underflows it (§3, "Precision").
"""

from __future__ import annotations

import contextlib
import math
from typing import Literal

import torch
import torch.nn.functional as F

from .config import ALPHA, EPS, NORM_EPS, NORM_SCALE, OFFSET, POWER, ROPE_LAYOUTS, NaLaConfig, check_direction

Direction = Literal["cosine", "relu_split"]


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
    if k.shape[2] == 0:
        raise ValueError(f"q, k, v hold no tokens (N = 0, shape {tuple(k.shape)}): the normalisation over the "
                         "keys needs at least one")


def _fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """At least fp32, one dtype for all: half precision is lifted to fp32, and if any is
    float64 all are (so a float64 reference and gradcheck see no fp32 rounding)."""
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return [t.to(dtype) for t in tensors]


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
    q: torch.Tensor, k: torch.Tensor, config: NaLaConfig | None = None, **overrides
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two NaLa feature maps ``(φ_q(q), φ_k(k))``, each ``(B, H, N, 2D)`` in fp32
    (float64 for float64 inputs).

    ``config`` (``NaLaConfig``; keyword ``overrides`` such as ``direction="relu_split"``)
    gives the direction map and the §2 constants. ``φ_q(q_i)·φ_k(k_j)`` is the non-negative
    similarity of §2: ``Σ_m a_im b_jm cos(θ_im − θ_jm)`` in the cosine mode, and the
    same-sign products in the ``relu_split`` mode (its α → ∞ limit).
    """
    c = NaLaConfig.of(config, **overrides)
    with _no_autocast(q.device):
        q, k = _fp32(q, k)
        a, q_hat, _ = nala_query_weights(q, c.power, c.offset, c.norm_scale_for(q.shape[-1]), c.norm_eps)
        b = k.abs().pow(c.power)                              # (B, H, N, D), norm kept
        if c.direction == "cosine":
            k_hat = k / k.norm(dim=-1, keepdim=True).clamp_min(c.norm_eps)
            theta_q = (math.pi / 4) * torch.tanh(c.alpha * q_hat)  # in (−π/4, π/4)
            theta_k = (math.pi / 4) * torch.tanh(c.alpha * k_hat)
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
        phi_q, phi_k, v32 = _fp32(phi_q, phi_k, v)
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
    return weights @ v.to(weights.dtype), weights   # fp32, or fp64 with an fp64 sim



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
    fp32, or fp64 for fp64 inputs (the region-state reference runs in fp64).
    """
    check_direction(direction)
    q, k = (t.to(torch.promote_types(t.dtype, torch.float32)) for t in (q, k))
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
    """DiT's attention: scaled dot-product softmax through the fused SDPA kernels; under a
    ``torch.func`` transform or forward-mode AD the explicit ``softmax(q kᵀ/√D) v`` (SDPA's
    fused CPU and flash kernels have no forward-mode rule: a JVP needs the N × N weights)."""
    _check_qkv(q, k, v)
    if under_transform(q, k, v):
        return softmax_attention_reference(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)


def under_transform(*tensors) -> bool:
    """Whether any of ``tensors`` is seen through a ``torch.func`` transform (jvp, grad,
    vjp, ...) or carries a forward-mode tangent (``torch.autograd.forward_ad``): then the
    layers run their plain compositions and the attention a path with a forward-mode rule
    (``nala/tangent.py``). False while ``torch.compile`` traces (the compiled graph keeps its paths)."""
    if torch.compiler.is_compiling():
        return False
    return any(isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t)
               for t in tensors) or dual(*tensors)


def dual(*tensors) -> bool:
    """Whether any of ``tensors`` carries a ``torch.autograd.forward_ad`` tangent."""
    from torch.autograd import forward_ad

    if forward_ad._current_level < 0:
        return False
    return any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def softmax_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_weights: bool = False
):
    """Explicit ``softmax(q kᵀ/√D) v`` (the "math" path), for tests and benchmarks."""
    _check_qkv(q, k, v)
    weights = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)
    out = weights @ v
    return (out, weights) if return_weights else out


# ------------------------------------------------------------------ rotary (numerator)
# A 2-D rotary position embedding on the numerator only (spec §7), as the NaLa authors'
# released code adds it: o_i = [R_i φ_q(q_i)]ᵀ Σ_j [R_j φ_k(k_j)] v_jᵀ / [φ_q(q_i)ᵀ Σ_j φ_k(k_j) + Nε]
# (both sides on the 1/N mean scale). The denominator keeps the unrotated, non-negative
# features, so it stays positive; the numerator gains relative position, since
# (R_i a)·(R_j b) depends on i − j only. The F = 2D feature channels form F/2 pairs
# (2m, 2m+1), each turned by one angle. Two angle layouts (``ROPE_LAYOUTS``):
#
# * ``"halves"`` (this repository's, the default): the first F/4 pairs turn with the
#   token's row, the last F/4 with its column, at frequencies base^(−m/(F/4)), m < F/4.
# * ``"released"`` (ZacharyMeng/NaLaFormer's ``RoPE`` + ``theta_shift``): D/4 frequencies
#   base^(−m/(D/4 − 1)) (``linspace(0, 1, D/4)``), rows then columns give a D-wide
#   rotation, applied to each D-wide half of the 2D-wide feature separately; per pair:
#   [rows | cols | rows | cols], D/4 pairs each.

ROPE_BASE = 10000.0


def rope_angles(grid: tuple[int, int], features: int, base: float = ROPE_BASE,
                device=None, layout: str = "halves") -> torch.Tensor:
    """Rotation angle of every (token, channel pair): ``(h·w, features/2)`` in fp32.

    ``features`` (the feature width F) must be a multiple of 4: half of the pairs rotate
    with the row position, half with the column position, in the ``layout`` of
    ``ROPE_LAYOUTS`` (see above). Positions follow the grid's
    ``positions`` policy when ``grid`` is a ``grid.TokenGrid`` (index × base / side for
    ``interpolate``, no rotation for ``none``), integer indices for a plain (h, w).
    """
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {layout!r}")
    if features % 4:
        raise ValueError(f"rope needs a feature width divisible by 4 (even head dim), got {features}")
    if layout == "released" and features % 8:
        raise ValueError(f"rope_layout 'released' needs a head dim divisible by 4 (D/4 frequencies), got "
                         f"feature width {features} (head dim {features // 2}); use rope_layout 'halves'")
    h, w = grid
    scale = grid.position_scale() if hasattr(grid, "position_scale") else (1.0, 1.0)
    if scale is None:
        scale = (0.0, 0.0)  # positions "none": every angle 0, the identity rotation
    rows, cols = torch.meshgrid(torch.arange(h, dtype=torch.float32, device=device) * scale[0],
                                torch.arange(w, dtype=torch.float32, device=device) * scale[1], indexing="ij")
    rows, cols = rows.reshape(-1, 1), cols.reshape(-1, 1)
    if layout == "released":
        freqs = 1.0 / base ** torch.linspace(0, 1, features // 8, dtype=torch.float32, device=device)  # (D/4,)
        half = torch.cat([rows * freqs, cols * freqs], dim=-1)                                      # (N, D/2)
        return torch.cat([half, half], dim=-1)                                                      # (N, F/2)
    k = features // 4
    freqs = base ** (-torch.arange(k, dtype=torch.float32, device=device) / k)          # (F/4,)
    return torch.cat([rows * freqs, cols * freqs], dim=-1)  # (N, F/2)


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
                             grid: tuple[int, int], eps: float = EPS, base: float = ROPE_BASE,
                             layout: str = "halves"):
    """Quadratic form of ``rope_linear_attention`` (tests only), written independently:
    rotation as complex multiplication, ``W_ij = Re⟨R_i φ_q(q_i), R_j φ_k(k_j)⟩ /
    (Σ_j' φ_q(q_i)·φ_k(k_j') + Nε)``. Returns (o, W); rows of W need not be non-negative."""
    h, w = grid
    f = phi_q.shape[-1]
    pos = [(r, c) for r in range(h) for c in range(w)]
    if layout == "released":   # per D-wide half: D/4 row pairs, D/4 column pairs, base^(-m/(D/4-1))
        k = f // 8
        freqs = [base ** (-(m / (k - 1) if k > 1 else 0.0)) for m in range(k)]
        theta = torch.tensor([2 * ([r * fr for fr in freqs] + [c * fr for fr in freqs]) for r, c in pos])
    else:
        k = f // 4
        freqs = 1.0 / base ** (torch.arange(k, dtype=torch.float64) / k)
        theta = torch.tensor([[r * fr for fr in freqs] + [c * fr for fr in freqs] for r, c in pos])   # (N, F/2)
    rot = torch.polar(torch.ones_like(theta), theta).to(torch.complex64)
    cq = torch.view_as_complex(phi_q.float().reshape(*phi_q.shape[:-1], f // 2, 2).contiguous()) * rot
    ck = torch.view_as_complex(phi_k.float().reshape(*phi_k.shape[:-1], f // 2, 2).contiguous()) * rot
    # Re(a·conj(b)) summed over pairs is the real dot product of the rotated vectors.
    num = (cq.unsqueeze(-2) * ck.unsqueeze(-3).conj()).real.sum(-1)          # (B, H, N, N)
    n = phi_k.shape[-2]
    den = (phi_q.float() @ phi_k.float().transpose(-2, -1)).sum(-1, keepdim=True) + n * eps
    weights = num / den
    return weights @ v.to(weights.dtype), weights   # fp32, or fp64 with an fp64 sim


SATURATION = 0.01  # a token is "saturated" when its exponent is within 1 % of the maximum


def saturated_share(p: torch.Tensor, power: float = POWER, offset: float = OFFSET) -> float:
    """Share of exponents within 1 % of their supremum λ(τ + 1): tokens for which the
    query norm no longer changes anything (tanh is flat there)."""
    return saturated_fraction(p, power, offset).item()


def saturated_fraction(p: torch.Tensor, power: float = POWER, offset: float = OFFSET) -> torch.Tensor:
    """``saturated_share`` as a 0-dim tensor: no host sync, so ``torch.compile`` traces it."""
    top = power * (offset + 1.0)
    return (p >= top * (1 - SATURATION)).float().mean()

