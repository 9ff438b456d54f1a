"""NaLa's feature maps (§2) as ``@triton.jit`` helpers, and their gradients: φ_q and φ_k of
a block of tokens in registers (norm, exponent ``|q̂|^p``, angle θ = (π/4)·tanh(α x̂), the
cos/sin halves, ``|k|^λ``) for a head dim in two tiles (``launch.split_tiles``) or a chunk
of lanes (``_query_tile``, ...), and the backward through them. The MUFU approximations
of sin, cos, log and θ's tanh are taken in the half-precision mode only."""

import triton
import triton.language as tl


# ------------------------------------------------------------------ feature maps (§2)


# The MUFU approximations (sin, cos, lg2, θ's tanh) in the half-precision mode only, and why
# their errors fit bf16's budget: README.md, "Precision".


@triton.jit
def _sin(x, PREC: tl.constexpr):
    if PREC == "bf16":
        return tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.sin(x)


@triton.jit
def _cos(x, PREC: tl.constexpr):
    if PREC == "bf16":
        return tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.cos(x)


@triton.jit
def _log(x, PREC: tl.constexpr):
    if PREC == "bf16":
        return 0.6931471805599453 * tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                               is_pure=True, pack=1)
    else:
        return tl.log(x)


@triton.jit
def _tanh(x, PREC: tl.constexpr):
    if PREC == "bf16":
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        # exp(−2|x|) ∈ (0, 1]: no overflow at any |x| (tl has no tanh on every backend).
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)


@triton.jit
def _abs_pow(x, p, PREC: tl.constexpr):
    """|x|^p for p > 0 as exp(p·log|x|), exactly 0 at x = 0 (never log of a signed base)."""
    ax = tl.abs(x)
    return tl.where(ax > 0, tl.exp(p * _log(tl.where(ax > 0, ax, 1.0), PREC)), 0.0)


@triton.jit
def _lift(mag, x_hat, alpha, COSINE: tl.constexpr, PREC: tl.constexpr):
    """The two halves of φ: (m cos θ, m sin θ) with θ = (π/4)·tanh(α x̂), or
    (m·1(x̂>0), m·1(x̂<0)) in the relu_split mode."""
    if COSINE:
        theta = 0.7853981633974483 * _tanh(alpha * x_hat, PREC)
        f1 = mag * _cos(theta, PREC)
        f2 = mag * _sin(theta, PREC)
    else:
        f1 = tl.where(x_hat > 0, mag, 0.0)
        f2 = tl.where(x_hat < 0, mag, 0.0)
    return f1, f2


@triton.jit
def _lift_grad(f1, f2, g1, g2, x_hat, alpha, COSINE: tl.constexpr):
    """From the halves F = (m c, m s) and their gradient G: m·∂L/∂m = G·F, and
    ∂L/∂x̂ through θ: (G₂F₁ − G₁F₂)·(π/4)·α·(1 − tanh²(α x̂)) (0 in relu_split)."""
    m_dm = g1 * f1 + g2 * f2
    if COSINE:
        t = _tanh(alpha * x_hat, "ieee")
        d_hat = (g2 * f1 - g1 * f2) * ((0.7853981633974483 * alpha) * (1.0 - t * t))
    else:
        d_hat = tl.zeros_like(m_dm)
    return m_dm, d_hat


# The head dim runs as two tiles, lanes [0, BA) and [BA, BA + BB) (``launch.split_tiles``;
# D = 72: 64 + 16, 8 masked lanes): elementwise work is per tile (or per chunk of lanes); a
# row reduction (‖x‖, Σ_d, ...) is the sum of the tiles' sums.


@triton.jit
def _query_tile(q, clamped, p, alpha, COSINE: tl.constexpr, PREC: tl.constexpr):
    q_hat = q / clamped[:, None]
    f1, f2 = _lift(_abs_pow(q_hat, p[:, None], PREC), q_hat, alpha, COSINE, PREC)
    return f1, f2, q_hat


@triton.jit
def _query_features(qa, qb, scale, power, offset, alpha, norm_eps, COSINE: tl.constexpr, PREC: tl.constexpr):
    """φ_q of §2 on the two tiles of a (BN, D) fp32 block: a = |q̂|^p with p = λ(τ + tanh(‖q‖/s))."""
    norm = tl.sqrt(tl.sum(qa * qa, 1) + tl.sum(qb * qb, 1))
    clamped = tl.maximum(norm, norm_eps)
    t_norm = _tanh(norm / scale, "ieee")
    p = power * (offset + t_norm)
    f1a, f2a, ha = _query_tile(qa, clamped, p, alpha, COSINE, PREC)
    f1b, f2b, hb = _query_tile(qb, clamped, p, alpha, COSINE, PREC)
    return f1a, f2a, f1b, f2b, ha, hb, norm, clamped, p, t_norm


@triton.jit
def _key_features(ka, kb, power, alpha, norm_eps, COSINE: tl.constexpr, PREC: tl.constexpr):
    """φ_k of §2 on the two tiles: b = |k|^λ (norm kept), direction from k̂ = k/‖k‖."""
    ba = _abs_pow(ka, power, PREC)
    bb = _abs_pow(kb, power, PREC)
    if COSINE:
        clamped = tl.maximum(tl.sqrt(tl.sum(ka * ka, 1) + tl.sum(kb * kb, 1)), norm_eps)
        f1a, f2a = _lift(ba, ka / clamped[:, None], alpha, COSINE, PREC)
        f1b, f2b = _lift(bb, kb / clamped[:, None], alpha, COSINE, PREC)
    else:
        f1a, f2a = _lift(ba, ka, alpha, COSINE, PREC)
        f1b, f2b = _lift(bb, kb, alpha, COSINE, PREC)
    return f1a, f2a, f1b, f2b


@triton.jit
def _query_grad_tile(f1, f2, g1, g2, q_hat, p, alpha, COSINE: tl.constexpr, PREC: tl.constexpr):
    """One tile of _query_grad: ∂L/∂q̂ and this tile's part of ∂L/∂p."""
    a_da, d_hat = _lift_grad(f1, f2, g1, g2, q_hat, alpha, COSINE)
    nonzero = q_hat != 0
    safe = tl.where(nonzero, q_hat, 1.0)
    d_hat += a_da * p[:, None] / safe
    d_p = tl.sum(tl.where(nonzero, a_da * _log(tl.abs(safe), PREC), 0.0), 1)
    return d_hat, d_p


@triton.jit
def _key_tile(k, clamped, power, alpha, COSINE: tl.constexpr, PREC: tl.constexpr):
    """φ_k on a chunk of lanes: b = |k|^λ, the direction from k̂ = k / max(‖k‖, ε) (cosine;
    ``clamped`` spans every lane) or from k (relu_split); also that x̂ (k̂ or k)."""
    b = _abs_pow(k, power, PREC)
    if COSINE:
        h = k / clamped[:, None]
    else:
        h = k
    f1, f2 = _lift(b, h, alpha, COSINE, PREC)
    return f1, f2, h


@triton.jit
def _key_grad_tile(k, f1, f2, g1, g2, h, clamped, power, alpha, COSINE: tl.constexpr):
    """∂L/∂k on a chunk of lanes but the unit vector's row term (c·k, see _unit_row_term):
    λ·b·∂L/∂b / k, plus ∂L/∂k̂ / max(‖k‖, ε) in the cosine mode; and Σ ∂L/∂k̂·k̂ over the chunk."""
    b_db, d_hat = _lift_grad(f1, f2, g1, g2, h, alpha, COSINE)
    part = b_db * power / tl.where(k != 0, k, 1.0)
    if COSINE:
        part += d_hat / clamped[:, None]
    return part, tl.sum(d_hat * h, 1)


@triton.jit
def _unit_row_term(norm, clamped, dot_hat, d_norm, norm_eps):
    """c in ∂L/∂x = ∂L/∂x̂ / max(‖x‖, ε) + c·x for x̂ = x / max(‖x‖, ε), from Σ_d ∂L/∂x̂·x̂
    over every lane and an extra ∂L/∂‖x‖: max(·, ε) passes the gradient where ‖x‖ ≥ ε;
    ∂‖x‖/∂x = x/‖x‖, 0 at x = 0."""
    d_norm = d_norm + tl.where(norm >= norm_eps, -dot_hat / clamped, 0.0)
    return d_norm / tl.where(norm == 0, 1.0, norm)
