"""NaLa's backward kernels: ``_dq_kernel`` (∂L/∂φ_q = (g/den) Sᵀ + (∂L/∂den) zᵀ, then ∂L/∂q
through the feature map; keeps ∂L/∂den) and ``_dkv_kernel`` (∂L/∂v = φ_k ∂L/∂S, ∂L/∂φ_k =
v ∂L/∂Sᵀ + ∂L/∂z, then ∂L/∂k), each also as its ``_split`` form; between them the state
pass with queries (``forward._state_kernel``, QUERY=True). Launched by ``launch.py``."""

import triton
import triton.language as tl

from .features import _key_features, _key_grad, _key_grad_tile, _key_tile, _lift_grad, _query_features, _query_grad, _query_grad_tile, _query_tile, _tanh, _unit_row_term
from .blocks import _dot, _head_offset, _load_block, _row_norm2, _s_block, _s_block_t, _store_tile


@triton.jit
def _dq_kernel(
    Q, G, ScaleP, S, Z, DEN, DQ, DDEN, DU,
    sq_b, sq_h, sq_n, sq_d, sg_b, sg_h, sg_n, sg_d, sdq_b, sdq_h, sdq_n, sdq_d,
    H, N, D,
    power, offset, alpha, norm_eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, PREC: tl.constexpr, NEED_DU: tl.constexpr, DQ_STRIDED: tl.constexpr = False,
):
    """∂L/∂q for one token block, and ∂L/∂den (for the state gradient).
    With num = φ_qᵀS and den = φ_qᵀz + ε: ∂L/∂num = g/den, ∂L/∂den = −(g/den)·num/den,
    ∂L/∂φ_q = (g/den) Sᵀ + (∂L/∂den) zᵀ. Grid: (B·H, token blocks)."""
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B·H·N may pass 2^31
    nb = tl.program_id(1)
    row0 = (nb * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - nb * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_d = tl.arange(0, BD)
    n_mask = offs_n < n_left
    d_mask = offs_d < D
    den = tl.load(DEN + bh * N + row0 + offs_n, mask=n_mask, other=1.0)
    g_base = G + _head_offset(bh, H, sg_b, sg_h) + row0 * sg_n
    g1 = tl.zeros((BLOCK_N, BD), dtype=tl.float32)
    g2 = tl.zeros((BLOCK_N, BD), dtype=tl.float32)
    for vt in tl.static_range(NV):
        offs_v = vt * BV + tl.arange(0, BV)
        v_mask = offs_v < D
        d_num = _load_block(g_base, sg_n, sg_d, offs_n, offs_v, n_mask, v_mask) / den[:, None]
        s_ptr = S + bh * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
        s_mask = d_mask[:, None] & v_mask[None, :]
        g1 += _dot(d_num, tl.trans(tl.load(s_ptr, mask=s_mask, other=0.0)), PREC)
        g2 += _dot(d_num, tl.trans(tl.load(s_ptr + D * D, mask=s_mask, other=0.0)), PREC)
    # The features only after the products: fewer blocks live at once (registers).
    q = _load_block(Q + _head_offset(bh, H, sq_b, sq_h) + row0 * sq_n, sq_n, sq_d, offs_n, offs_d, n_mask, d_mask)
    scale = tl.load(ScaleP + bh % H)
    f1, f2, q_hat, norm, clamped, p, t_norm = _query_features(q, scale, power, offset, alpha, norm_eps, COSINE, PREC)
    # (g/den)·num/den = φ_q · ((g/den) Sᵀ) / den: num is never formed.
    d_den = -tl.sum(f1 * g1 + f2 * g2, 1) / den
    tl.store(DDEN + bh * N + row0 + offs_n, d_den, mask=n_mask)
    z1 = tl.load(Z + bh * 2 * D + offs_d, mask=d_mask, other=0.0)
    z2 = tl.load(Z + bh * 2 * D + D + offs_d, mask=d_mask, other=0.0)
    g1 += d_den[:, None] * z1[None, :]
    g2 += d_den[:, None] * z2[None, :]
    dq, d_u = _query_grad(q, f1, f2, g1, g2, q_hat, norm, clamped, p, t_norm, scale, power, alpha,
                          norm_eps, COSINE, PREC)
    if DQ_STRIDED:   # a gated layer's token-layout gradient buffer
        dq_ptr = DQ + _head_offset(bh, H, sdq_b, sdq_h) + row0 * sdq_n + offs_n[:, None] * sdq_n + offs_d[None, :] * sdq_d
    else:            # contiguous (B, H, N, D): the strides unused, which keeps dq's registers as they were
        dq_ptr = DQ + (bh * N + row0) * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(dq_ptr, dq.to(DQ.dtype.element_ty), mask=n_mask[:, None] & d_mask[None, :])
    if NEED_DU:
        # ∂L/∂s per token: u = ‖q‖/s, ∂u/∂s = −‖q‖/s².
        tl.store(DU + bh * N + row0 + offs_n, -d_u * norm / (scale * scale), mask=n_mask)


@triton.jit
def _dkv_kernel(
    K, V, DS, DZ, DK, DV,
    sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sdk_b, sdk_h, sdk_n, sdk_d, sdv_b, sdv_h, sdv_n, sdv_d,
    H, N, D,
    power, alpha, norm_eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, PREC: tl.constexpr, ADD_DV: tl.constexpr,
):
    """∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z then ∂L/∂k, and ∂L/∂v = Σ_halves φ_k ∂L/∂S, for one
    token block (the 1/N of §3 is already in ∂L/∂[S | z]). In that order, so that the
    features and their gradient are not live in the same loop (registers).
    ``ADD_DV``: ∂L/∂v is added to what DV holds (the gated layer's LePE term), not stored.
    Grid: (B·H, token blocks)."""
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B·H·N may pass 2^31
    nb = tl.program_id(1)
    row0 = (nb * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - nb * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_d = tl.arange(0, BD)
    n_mask = offs_n < n_left
    d_mask = offs_d < D
    v_base = V + _head_offset(bh, H, sv_b, sv_h) + row0 * sv_n
    dz1 = tl.load(DZ + bh * 2 * D + offs_d, mask=d_mask, other=0.0)
    dz2 = tl.load(DZ + bh * 2 * D + D + offs_d, mask=d_mask, other=0.0)
    g1 = tl.zeros((BLOCK_N, BD), dtype=tl.float32) + dz1[None, :]
    g2 = tl.zeros((BLOCK_N, BD), dtype=tl.float32) + dz2[None, :]
    for vt in tl.static_range(NV):
        offs_v = vt * BV + tl.arange(0, BV)
        v_mask = offs_v < D
        v = _load_block(v_base, sv_n, sv_d, offs_n, offs_v, n_mask, v_mask)
        ds_ptr = DS + bh * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
        ds_mask = d_mask[:, None] & v_mask[None, :]
        g1 += _dot(v, tl.trans(tl.load(ds_ptr, mask=ds_mask, other=0.0)), PREC)
        g2 += _dot(v, tl.trans(tl.load(ds_ptr + D * D, mask=ds_mask, other=0.0)), PREC)
    k = _load_block(K + _head_offset(bh, H, sk_b, sk_h) + row0 * sk_n, sk_n, sk_d, offs_n, offs_d, n_mask, d_mask)
    f1, f2 = _key_features(k, power, alpha, norm_eps, COSINE, PREC)
    dk = _key_grad(k, f1, f2, g1, g2, power, alpha, norm_eps, COSINE)
    dk_ptr = DK + _head_offset(bh, H, sdk_b, sdk_h) + row0 * sdk_n + offs_n[:, None] * sdk_n + offs_d[None, :] * sdk_d
    tl.store(dk_ptr, dk.to(DK.dtype.element_ty), mask=n_mask[:, None] & d_mask[None, :])
    for vt in tl.static_range(NV):
        offs_v = vt * BV + tl.arange(0, BV)
        v_mask = offs_v < D
        ds_ptr = DS + bh * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
        ds_mask = d_mask[:, None] & v_mask[None, :]
        dv = _dot(f1, tl.load(ds_ptr, mask=ds_mask, other=0.0), PREC)
        dv += _dot(f2, tl.load(ds_ptr + D * D, mask=ds_mask, other=0.0), PREC)
        dv_ptr = DV + _head_offset(bh, H, sdv_b, sdv_h) + row0 * sdv_n + offs_n[:, None] * sdv_n + offs_v[None, :] * sdv_d
        dv_mask = n_mask[:, None] & v_mask[None, :]
        if ADD_DV:
            dv += tl.load(dv_ptr, mask=dv_mask, other=0.0).to(tl.float32)
        tl.store(dv_ptr, dv.to(DV.dtype.element_ty), mask=dv_mask)


@triton.jit
def _state_t_chunk(ua, ub, s_half, D, offs_c, offs_a, offs_b, PREC: tl.constexpr):
    """u Sᵀ for one state half, feature lanes offs_c (a chunk), from the value tiles (ua, ub)."""
    g = _dot(ua, _s_block_t(s_half, offs_c, offs_a, D), PREC)
    g += _dot(ub, _s_block_t(s_half, offs_c, offs_b, D), PREC)
    return g


@triton.jit
def _dq_kernel_split(
    Q, G, ScaleP, S, Z, DEN, DQ, DDEN, DU,
    sq_b, sq_h, sq_n, sq_d, sg_b, sg_h, sg_n, sg_d, sdq_b, sdq_h, sdq_n, sdq_d,
    H, N, D: tl.constexpr,
    power, offset, alpha, norm_eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, NEED_DU: tl.constexpr, DQ_STRIDED: tl.constexpr = False, BC: tl.constexpr = 16,
):
    """_dq_kernel with split tiles (DQ through its strides where DQ_STRIDED, else
    contiguous with constant strides), the feature lanes in chunks of BC (loops): one
    chunk's features and ∂L/∂φ live at a time. Two passes over the chunks. ∂L/∂q is linear
    in ∂L/∂φ = (g/den) Sᵀ + ∂L/∂den·zᵀ, so the first pass takes the row sums that need
    ∂L/∂den (∂L/∂p, Σ ∂L/∂q̂·q̂) as their (g/den) Sᵀ part plus ∂L/∂den times their zᵀ
    part, beside ∂L/∂den itself; the second computes ∂L/∂q per chunk (features and the
    products again). Grid: (B·H, token blocks)."""
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
    scale = tl.load(ScaleP + bh % H)
    norm, clamped = _row_norm2(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D, norm_eps)
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
        f1, f2, h = _query_tile(_load_block(q_base, sq_n, sq_d, offs_n, offs_c, n_mask, c_mask), clamped, p, alpha,
                                COSINE, PREC)
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
        dq_base = DQ + _head_offset(bh, H, sdq_b, sdq_h) + row0 * sdq_n
        sdq_nn = sdq_n
        sdq_dd = sdq_d
    else:
        dq_base = DQ + (bh * N + row0) * D
        sdq_nn = D
        sdq_dd = 1
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        c_mask = offs_c < D
        g1 = _state_t_chunk(ua, ub, s_base, D, offs_c, offs_a, offs_b, PREC)
        g2 = _state_t_chunk(ua, ub, s_base + D * D, D, offs_c, offs_a, offs_b, PREC)
        g1 += d_den[:, None] * tl.load(z_base + offs_c, mask=c_mask, other=0.0)[None, :]
        g2 += d_den[:, None] * tl.load(z_base + D + offs_c, mask=c_mask, other=0.0)[None, :]
        q = _load_block(q_base, sq_n, sq_d, offs_n, offs_c, n_mask, c_mask)
        f1, f2, h = _query_tile(q, clamped, p, alpha, COSINE, PREC)
        d_hat, _dp = _query_grad_tile(f1, f2, g1, g2, h, p, alpha, COSINE, PREC)
        _store_tile(dq_base, sdq_nn, sdq_dd, offs_n, offs_c, n_left, D, d_hat / clamped[:, None] + c[:, None] * q)
    if NEED_DU:
        tl.store(DU + bh * N + row0 + offs_n, -d_u * norm / (scale * scale), mask=n_mask)


@triton.jit
def _dkv_chunk(k_base, sk_n, sk_d, va, vb, ds_base, dz_base, offs_n, n_mask, offs_c, offs_a, offs_b, D, clamped,
               power, alpha, COSINE: tl.constexpr, PREC: tl.constexpr):
    """For the feature lanes offs_c (a chunk): k, φ_k's halves, x̂ (_key_tile) and
    ∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z per half, from the value tiles (va, vb)."""
    c_mask = offs_c < D
    g1 = _state_t_chunk(va, vb, ds_base, D, offs_c, offs_a, offs_b, PREC)
    g2 = _state_t_chunk(va, vb, ds_base + D * D, D, offs_c, offs_a, offs_b, PREC)
    g1 += tl.load(dz_base + offs_c, mask=c_mask, other=0.0)[None, :]
    g2 += tl.load(dz_base + D + offs_c, mask=c_mask, other=0.0)[None, :]
    k = _load_block(k_base, sk_n, sk_d, offs_n, offs_c, n_mask, c_mask)
    f1, f2, h = _key_tile(k, clamped, power, alpha, COSINE, PREC)
    return k, f1, f2, h, g1, g2


@triton.jit
def _dkv_kernel_split(
    K, V, DS, DZ, DK, DV,
    sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sdk_b, sdk_h, sdk_n, sdk_d, sdv_b, sdv_h, sdv_n, sdv_d,
    H, N, D: tl.constexpr,
    power, alpha, norm_eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, ADD_DV: tl.constexpr, BC: tl.constexpr = 16,
):
    """_dkv_kernel with split tiles (ADD_DV as there), the feature lanes in chunks of BC
    (loops): ∂L/∂v = Σ_halves φ_k ∂L/∂S over the chunks; then, in the cosine mode, Σ
    ∂L/∂k̂·k̂ (the unit vector's row term, a sum over every lane) over the chunks; then
    ∂L/∂k per chunk, with ∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z and the features again.
    Grid: (B·H, token blocks)."""
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
    if COSINE:
        norm, clamped = _row_norm2(k_base, sk_n, sk_d, offs_n, n_mask, offs_a, offs_b, D, norm_eps)
    else:
        norm = tl.zeros((BLOCK_N,), dtype=tl.float32)
        clamped = norm
    dva = tl.zeros((BLOCK_N, BA), dtype=tl.float32)
    dvb = tl.zeros((BLOCK_N, BB), dtype=tl.float32)
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        f1, f2, _h = _key_tile(_load_block(k_base, sk_n, sk_d, offs_n, offs_c, n_mask, offs_c < D), clamped, power,
                               alpha, COSINE, PREC)
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
                                              offs_a, offs_b, D, clamped, power, alpha, COSINE, PREC)
            _b_db, d_hat = _lift_grad(f1, f2, g1, g2, h, alpha, COSINE)
            dot_hat += tl.sum(d_hat * h, 1)
        c = _unit_row_term(norm, clamped, dot_hat, c, norm_eps)
    dk_base = DK + _head_offset(bh, H, sdk_b, sdk_h) + row0 * sdk_n
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        k, f1, f2, h, g1, g2 = _dkv_chunk(k_base, sk_n, sk_d, va, vb, ds_base, dz_base, offs_n, n_mask, offs_c,
                                          offs_a, offs_b, D, clamped, power, alpha, COSINE, PREC)
        part, _s = _key_grad_tile(k, f1, f2, g1, g2, h, clamped, power, alpha, COSINE)
        _store_tile(dk_base, sdk_n, sdk_d, offs_n, offs_c, n_left, D, part + c[:, None] * k)
