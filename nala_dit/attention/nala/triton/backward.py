"""NaLa's backward kernels: ``_dq_kernel`` (∂L/∂φ_q = (g/den) Sᵀ + (∂L/∂den) zᵀ, then ∂L/∂q
through the feature map; keeps ∂L/∂den) and ``_dkv_kernel`` (∂L/∂v = φ_k ∂L/∂S, ∂L/∂φ_k =
v ∂L/∂Sᵀ + ∂L/∂z, then ∂L/∂k); between them the state pass with queries
(``forward._state_kernel``, QUERY=True). The head dim as two tiles and the feature lanes
in chunks, as in ``forward.py``. Launched by ``launch.py``."""

import triton
import triton.language as tl

from .features import _key_grad_tile, _key_tile, _lift_grad, _query_grad_tile, _query_tile, _tanh, _unit_row_term
from .blocks import _dot, _head_offset, _load_block, _load_features, _row_norm, _s_block, _s_block_t, _store_tile


@triton.jit
def _state_t_chunk(ua, ub, s_half, D, offs_c, offs_a, offs_b, PREC: tl.constexpr):
    """u Sᵀ for one state half, feature lanes offs_c (a chunk), from the value tiles (ua, ub)."""
    g = _dot(ua, _s_block_t(s_half, offs_c, offs_a, D), PREC)
    g += _dot(ub, _s_block_t(s_half, offs_c, offs_b, D), PREC)
    return g


@triton.jit
def _query_chunk(q, clamped, p, alpha, f_base, offs_n, n_mask, offs_c, D: tl.constexpr, COSINE: tl.constexpr,
                 PREC: tl.constexpr, KEEP: tl.constexpr):
    """φ_q's halves on a chunk of lanes, and q̂ there: read from the forward's (KEEP) or computed."""
    if KEEP:
        f1, f2 = _load_features(f_base, D, offs_n, n_mask, offs_c)
        h = q / clamped[:, None]
    else:
        f1, f2, h = _query_tile(q, clamped, p, alpha, COSINE, PREC)
    return f1, f2, h


@triton.jit
def _key_chunk(k, clamped, power, alpha, f_base, offs_n, n_mask, offs_c, D: tl.constexpr, COSINE: tl.constexpr,
               PREC: tl.constexpr, KEEP: tl.constexpr):
    """φ_k's halves on a chunk of lanes, and x̂ there (k̂, or k in relu_split): read (KEEP) or computed."""
    if KEEP:
        f1, f2 = _load_features(f_base, D, offs_n, n_mask, offs_c)
        if COSINE:
            h = k / clamped[:, None]
        else:
            h = k
    else:
        f1, f2, h = _key_tile(k, clamped, power, alpha, COSINE, PREC)
    return f1, f2, h


@triton.jit
def _dq_kernel(
    Q, G, ScaleP, S, Z, DEN, DQ, DDEN, DU,
    sq_b, sq_h, sq_n, sq_d, sg_b, sg_h, sg_n, sg_d, sdq_b, sdq_h, sdq_n, sdq_d,
    H, N, D: tl.constexpr,
    power, offset, alpha, norm_eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, NEED_DU: tl.constexpr, DQ_STRIDED: tl.constexpr = False, BC: tl.constexpr = 16,
    F=None, KEEP: tl.constexpr = False,
):
    """∂L/∂q for one token block, and ∂L/∂den (for the state gradient). With num = φ_qᵀS
    and den = φ_qᵀz + ε: ∂L/∂num = g/den, ∂L/∂den = −(g/den)·num/den, ∂L/∂φ_q = (g/den) Sᵀ
    + (∂L/∂den) zᵀ. DQ through its strides where DQ_STRIDED, else contiguous. The feature
    lanes in chunks of BC: one chunk's features and ∂L/∂φ live at a time, in two passes. ∂L/∂q
    is linear in ∂L/∂φ = (g/den) Sᵀ + ∂L/∂den·zᵀ, so the first pass takes the row sums that need
    ∂L/∂den (∂L/∂p, Σ ∂L/∂q̂·q̂) as their (g/den) Sᵀ part plus ∂L/∂den times their zᵀ
    part, beside ∂L/∂den itself; the second computes ∂L/∂q per chunk (features and the
    products again). KEEP: φ_q read from F (the forward's, (B·H, N, 2D)); what the chain
    rule adds (the norm, the exponent, tanh(α q̂), log|q̂|) computed here. Grid: (B·H, blocks)."""
    bh = tl.program_id(0).to(tl.int64)
    row0 = (tl.program_id(1) * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - tl.program_id(1) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    n_mask = offs_n < n_left
    den = tl.load(DEN + bh * N + row0 + offs_n, mask=n_mask, other=1.0)
    g_base = G + _head_offset(bh, H, sg_b, sg_h) + row0 * sg_n
    ua = _load_block(g_base, sg_n, sg_d, offs_n, offs_a, n_mask, offs_a < D) / den[:, None]
    ub = _load_block(g_base, sg_n, sg_d, offs_n, offs_b, n_mask, offs_b < D) / den[:, None]
    s_base = S + bh * 2 * D * D
    z_base = Z + bh * 2 * D
    q_base = Q + _head_offset(bh, H, sq_b, sq_h) + row0 * sq_n
    f_base = F + (bh * N + row0) * (2 * D) if KEEP else F
    scale = tl.load(ScaleP + bh % H)
    norm, clamped = _row_norm(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D, norm_eps)
    t_norm = _tanh(norm / scale, "ieee")
    p = power * (offset + t_norm)
    sum_fg = tl.zeros((BLOCK_N,), dtype=tl.float32)     # Σ φ·((g/den) Sᵀ)
    dp_g = tl.zeros((BLOCK_N,), dtype=tl.float32)       # ∂L/∂p, (g/den) Sᵀ part
    dp_z = tl.zeros((BLOCK_N,), dtype=tl.float32)       # ∂L/∂p per unit ∂L/∂den
    dot_g = tl.zeros((BLOCK_N,), dtype=tl.float32)      # Σ ∂L/∂q̂·q̂, the same two parts
    dot_z = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        c_mask = offs_c < D
        g1 = _state_t_chunk(ua, ub, s_base, D, offs_c, offs_a, offs_b, PREC)
        g2 = _state_t_chunk(ua, ub, s_base + D * D, D, offs_c, offs_a, offs_b, PREC)
        f1, f2, h = _query_chunk(_load_block(q_base, sq_n, sq_d, offs_n, offs_c, n_mask, c_mask), clamped, p, alpha,
                                 f_base, offs_n, n_mask, offs_c, D, COSINE, PREC, KEEP)
        sum_fg += tl.sum(f1 * g1 + f2 * g2, 1)
        d_hat, d_p = _query_grad_tile(f1, f2, g1, g2, h, p, alpha, COSINE, PREC)
        dp_g += d_p
        dot_g += tl.sum(d_hat * h, 1)
        z1 = tl.zeros_like(g1) + tl.load(z_base + offs_c, mask=c_mask, other=0.0)[None, :]
        z2 = tl.zeros_like(g2) + tl.load(z_base + D + offs_c, mask=c_mask, other=0.0)[None, :]
        d_hat, d_p = _query_grad_tile(f1, f2, z1, z2, h, p, alpha, COSINE, PREC)
        dp_z += d_p
        dot_z += tl.sum(d_hat * h, 1)
    # (g/den)·num/den = φ_q · ((g/den) Sᵀ) / den: num is never formed.
    d_den = -sum_fg / den
    tl.store(DDEN + bh * N + row0 + offs_n, d_den, mask=n_mask)
    d_u = (dp_g + d_den * dp_z) * power * (1.0 - t_norm * t_norm)
    c = _unit_row_term(norm, clamped, dot_g + d_den * dot_z, d_u / scale, norm_eps)
    if DQ_STRIDED:
        dq_base, sdq_nn, sdq_dd = DQ + _head_offset(bh, H, sdq_b, sdq_h) + row0 * sdq_n, sdq_n, sdq_d
    else:
        dq_base, sdq_nn, sdq_dd = DQ + (bh * N + row0) * D, D, 1
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        c_mask = offs_c < D
        g1 = _state_t_chunk(ua, ub, s_base, D, offs_c, offs_a, offs_b, PREC)
        g2 = _state_t_chunk(ua, ub, s_base + D * D, D, offs_c, offs_a, offs_b, PREC)
        g1 += d_den[:, None] * tl.load(z_base + offs_c, mask=c_mask, other=0.0)[None, :]
        g2 += d_den[:, None] * tl.load(z_base + D + offs_c, mask=c_mask, other=0.0)[None, :]
        q = _load_block(q_base, sq_n, sq_d, offs_n, offs_c, n_mask, c_mask)
        f1, f2, h = _query_chunk(q, clamped, p, alpha, f_base, offs_n, n_mask, offs_c, D, COSINE, PREC, KEEP)
        d_hat, _dp = _query_grad_tile(f1, f2, g1, g2, h, p, alpha, COSINE, PREC)
        _store_tile(dq_base, sdq_nn, sdq_dd, offs_n, offs_c, n_left, D, d_hat / clamped[:, None] + c[:, None] * q)
    if NEED_DU:
        tl.store(DU + bh * N + row0 + offs_n, -d_u * norm / (scale * scale), mask=n_mask)


@triton.jit
def _dkv_chunk(k_base, sk_n, sk_d, va, vb, ds_base, dz_base, offs_n, n_mask, offs_c, offs_a, offs_b, D: tl.constexpr,
               clamped, power, alpha, f_base, COSINE: tl.constexpr, PREC: tl.constexpr, KEEP: tl.constexpr):
    """For the feature lanes offs_c (a chunk): k, φ_k's halves, x̂ (_key_chunk) and
    ∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z per half, from the value tiles (va, vb)."""
    c_mask = offs_c < D
    g1 = _state_t_chunk(va, vb, ds_base, D, offs_c, offs_a, offs_b, PREC)
    g2 = _state_t_chunk(va, vb, ds_base + D * D, D, offs_c, offs_a, offs_b, PREC)
    g1 += tl.load(dz_base + offs_c, mask=c_mask, other=0.0)[None, :]
    g2 += tl.load(dz_base + D + offs_c, mask=c_mask, other=0.0)[None, :]
    k = _load_block(k_base, sk_n, sk_d, offs_n, offs_c, n_mask, c_mask)
    f1, f2, h = _key_chunk(k, clamped, power, alpha, f_base, offs_n, n_mask, offs_c, D, COSINE, PREC, KEEP)
    return k, f1, f2, h, g1, g2


@triton.jit
def _dkv_kernel(
    K, V, DS, DZ, DK, DV,
    sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sdk_b, sdk_h, sdk_n, sdk_d, sdv_b, sdv_h, sdv_n, sdv_d,
    H, N, D: tl.constexpr,
    power, alpha, norm_eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, ADD_DV: tl.constexpr, BC: tl.constexpr = 16, F=None, KEEP: tl.constexpr = False,
):
    """∂L/∂v = Σ_halves φ_k ∂L/∂S and ∂L/∂k (through ∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z) for one
    token block (the 1/N of §3 is already in ∂L/∂[S | z]); ``ADD_DV``: ∂L/∂v is added to
    what DV holds (the gated layer's LePE term), not stored. The feature lanes in chunks
    of BC (loops): ∂L/∂v over the chunks; then, in the cosine mode, Σ
    ∂L/∂k̂·k̂ (the unit vector's row term, a sum over every lane) over the chunks; then
    ∂L/∂k per chunk, with ∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z and the features again. KEEP: φ_k
    read from F (the forward's, (B·H, N, 2D)); what the chain rule adds (the norm, tanh(α k̂))
    computed here. Grid: (B·H, token blocks)."""
    bh = tl.program_id(0).to(tl.int64)
    row0 = (tl.program_id(1) * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - tl.program_id(1) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    n_mask = offs_n < n_left
    k_base = K + _head_offset(bh, H, sk_b, sk_h) + row0 * sk_n
    ds_base = DS + bh * 2 * D * D
    ds2 = ds_base + D * D
    dz_base = DZ + bh * 2 * D
    f_base = F + (bh * N + row0) * (2 * D) if KEEP else F
    if COSINE:
        norm, clamped = _row_norm(k_base, sk_n, sk_d, offs_n, n_mask, offs_a, offs_b, D, norm_eps)
    else:
        norm = tl.zeros((BLOCK_N,), dtype=tl.float32)
        clamped = norm
    dva = tl.zeros((BLOCK_N, BA), dtype=tl.float32)
    dvb = tl.zeros((BLOCK_N, BB), dtype=tl.float32)
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        if KEEP:
            f1, f2 = _load_features(f_base, D, offs_n, n_mask, offs_c)
        else:
            f1, f2, _h = _key_tile(_load_block(k_base, sk_n, sk_d, offs_n, offs_c, n_mask, offs_c < D), clamped,
                                   power, alpha, COSINE, PREC)
        dva += _dot(f1, _s_block(ds_base, offs_c, offs_a, D), PREC)
        dva += _dot(f2, _s_block(ds2, offs_c, offs_a, D), PREC)
        dvb += _dot(f1, _s_block(ds_base, offs_c, offs_b, D), PREC)
        dvb += _dot(f2, _s_block(ds2, offs_c, offs_b, D), PREC)
    dv_base = DV + _head_offset(bh, H, sdv_b, sdv_h) + row0 * sdv_n
    _store_tile(dv_base, sdv_n, sdv_d, offs_n, offs_a, n_left, D, dva, ADD_DV)
    _store_tile(dv_base, sdv_n, sdv_d, offs_n, offs_b, n_left, D, dvb, ADD_DV)
    v_base = V + _head_offset(bh, H, sv_b, sv_h) + row0 * sv_n
    va = _load_block(v_base, sv_n, sv_d, offs_n, offs_a, n_mask, offs_a < D)
    vb = _load_block(v_base, sv_n, sv_d, offs_n, offs_b, n_mask, offs_b < D)
    c = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if COSINE:
        dot_hat = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for c0 in range(0, D, BC):
            offs_c = c0 + tl.arange(0, BC)
            k, f1, f2, h, g1, g2 = _dkv_chunk(k_base, sk_n, sk_d, va, vb, ds_base, dz_base, offs_n, n_mask, offs_c,
                                              offs_a, offs_b, D, clamped, power, alpha, f_base, COSINE, PREC, KEEP)
            _b_db, d_hat = _lift_grad(f1, f2, g1, g2, h, alpha, COSINE)
            dot_hat += tl.sum(d_hat * h, 1)
        c = _unit_row_term(norm, clamped, dot_hat, c, norm_eps)
    dk_base = DK + _head_offset(bh, H, sdk_b, sdk_h) + row0 * sdk_n
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        k, f1, f2, h, g1, g2 = _dkv_chunk(k_base, sk_n, sk_d, va, vb, ds_base, dz_base, offs_n, n_mask, offs_c,
                                          offs_a, offs_b, D, clamped, power, alpha, f_base, COSINE, PREC, KEEP)
        part, _s = _key_grad_tile(k, f1, f2, g1, g2, h, clamped, power, alpha, COSINE)
        _store_tile(dk_base, sdk_n, sdk_d, offs_n, offs_c, n_left, D, part + c[:, None] * k)
