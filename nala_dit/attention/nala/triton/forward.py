"""NaLa's forward kernels: the state pass (``_state_kernel``: ``[S | z]`` over a token range,
atomically added into one state where several ranges run; with QUERY=True the backward's
∂L/∂[S | z]), the output (``_output_kernel``: ``o = φ_qᵀS / (φ_qᵀz + ε)``, the denominator
kept) and both as one launch (``_forward_kernel``, one token range per head); each also as
its ``_split`` form for a head dim in two tiles. Launched by ``launch.py``."""

import triton
import triton.language as tl

from .features import _key_features, _key_features2, _query_features, _query_features2, _query_tile, _tanh
from .blocks import _dot, _head_offset, _load_block, _put_block, _put_vec, _row_norm2, _s_block, _store_tile


@triton.jit
def _state_range(x_base, v_base, sx_n, sx_d, sv_n, sv_d, start, end, offs_d, offs_v, d_mask, v_mask,
                 scale, power, offset, alpha, norm_eps, bh, N,
                 QUERY: tl.constexpr, COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr,
                 BV: tl.constexpr, PREC: tl.constexpr, DEN, DDEN):
    """Σ φ(x_j) w_jᵀ and Σ φ(x_j) over tokens [start, end), per half, in fp32 (see _state_kernel)."""
    acc1 = tl.zeros((BD, BV), dtype=tl.float32)
    acc2 = tl.zeros((BD, BV), dtype=tl.float32)
    z1 = tl.zeros((BD,), dtype=tl.float32)
    z2 = tl.zeros((BD,), dtype=tl.float32)
    rows = tl.cast(start, tl.int64)                    # the range's first token: int64 base offsets
    x_base += rows * sx_n
    v_base += rows * sv_n
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        offs_r = offs_n - start                        # within the range: int32 products
        x = _load_block(x_base, sx_n, sx_d, offs_r, offs_d, n_mask, d_mask)
        w = _load_block(v_base, sv_n, sv_d, offs_r, offs_v, n_mask, v_mask)
        if QUERY:
            f1, f2, _h, _n, _c, _p, _t = _query_features(x, scale, power, offset, alpha, norm_eps, COSINE, PREC)
            den = tl.load(DEN + bh * N + offs_n, mask=n_mask, other=1.0)
            d_den = tl.load(DDEN + bh * N + offs_n, mask=n_mask, other=0.0)
            w = w / den[:, None]                              # ∂L/∂num = g/den
            z1 += tl.sum(f1 * d_den[:, None], 0)
            z2 += tl.sum(f2 * d_den[:, None], 0)
        else:
            f1, f2 = _key_features(x, power, alpha, norm_eps, COSINE, PREC)
            z1 += tl.sum(f1, 0)
            z2 += tl.sum(f2, 0)
        acc1 += _dot(tl.trans(f1), w, PREC)
        acc2 += _dot(tl.trans(f2), w, PREC)
    return acc1, acc2, z1, z2


@triton.jit
def _state_kernel(
    X, V, ScaleP, S_part, Z_part,
    sx_b, sx_h, sx_n, sx_d, sv_b, sv_h, sv_n, sv_d,
    H, N, D, tokens_per_split, n_splits, inv_n,
    power, offset, alpha, norm_eps,
    QUERY: tl.constexpr, COSINE: tl.constexpr,
    BLOCK_N: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    DEN=None, DDEN=None, ATOMIC: tl.constexpr = False,
):
    """Partial sums over one token range of Σ φ(x_j) v_jᵀ and Σ φ(x_j) w_j, per half.

    Forward (QUERY=False): x = k, v = v, w = 1 → [S | z] (times 1/N).
    Backward (QUERY=True):  x = q, v = g/den, w = ∂L/∂den → ∂L/∂[S | z] (times 1/N).
    Grid: (B·H, splits, BD/BV); the z part is written by the first value tile only.
    ATOMIC: every range adds its sum into one zeroed (B·H, 2, D, D) state with fp32 atomic
    adds (no partial buffers, no separate sum); else (the baseline variant) each range
    writes its own partial state, summed afterwards by ``torch.sum``.
    """
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B·H·N may pass 2^31
    split = tl.program_id(1)
    vt = tl.program_id(2)
    x_base = X + _head_offset(bh, H, sx_b, sx_h)
    v_base = V + _head_offset(bh, H, sv_b, sv_h)
    offs_d = tl.arange(0, BD)
    offs_v = vt * BV + tl.arange(0, BV)
    d_mask = offs_d < D
    v_mask = offs_v < D
    scale = tl.load(ScaleP + bh % H)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, N)
    acc1, acc2, z1, z2 = _state_range(x_base, v_base, sx_n, sx_d, sv_n, sv_d, start, end, offs_d, offs_v,
                                      d_mask, v_mask, scale, power, offset, alpha, norm_eps, bh, N,
                                      QUERY, COSINE, BLOCK_N, BD, BV, PREC, DEN, DDEN)
    # Buffers are (B·H, [splits,] 2, D, D) and (B·H, [splits,] 2, D): unpadded, since the
    # state is saved for the backward (at D = 72 padding would store 3× the bytes).
    part = bh if ATOMIC else bh * n_splits + split
    s_ptr = S_part + part * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
    s_mask = d_mask[:, None] & v_mask[None, :]
    z_ptr = Z_part + part * 2 * D + offs_d
    first = d_mask & (vt == 0)
    # Stored already times 1/N (the mean of §3): partial sums then add up to the state.
    if ATOMIC:
        tl.atomic_add(s_ptr, acc1 * inv_n, mask=s_mask, sem="relaxed")
        tl.atomic_add(s_ptr + D * D, acc2 * inv_n, mask=s_mask, sem="relaxed")
        tl.atomic_add(z_ptr, z1 * inv_n, mask=first, sem="relaxed")
        tl.atomic_add(z_ptr + D, z2 * inv_n, mask=first, sem="relaxed")
    else:
        tl.store(s_ptr, acc1 * inv_n, mask=s_mask)
        tl.store(s_ptr + D * D, acc2 * inv_n, mask=s_mask)
        tl.store(z_ptr, z1 * inv_n, mask=first)
        tl.store(z_ptr + D, z2 * inv_n, mask=first)


@triton.jit
def _output_block(q_base, sq_n, sq_d, offs_n, n_mask, offs_d, d_mask, offs_v, v_mask, s1, s2, z1, z2,
                  scale, power, offset, alpha, norm_eps, eps, COSINE: tl.constexpr, PREC: tl.constexpr):
    """One token block of o = φ_qᵀ S / (φ_qᵀ z + ε) (a value tile of it) and its denominator."""
    q = _load_block(q_base, sq_n, sq_d, offs_n, offs_d, n_mask, d_mask)
    f1, f2, _h, _n, _c, _p, _t = _query_features(q, scale, power, offset, alpha, norm_eps, COSINE, PREC)
    num = _dot(f1, s1, PREC)
    num += _dot(f2, s2, PREC)
    den = tl.sum(f1 * z1[None, :] + f2 * z2[None, :], 1) + eps
    return num / den[:, None], den


@triton.jit
def _forward_kernel(
    K, V, Q, ScaleP, S, Z, O, DEN,
    sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sq_b, sq_h, sq_n, sq_d, so_b, so_h, so_n, so_d,
    H, N, D, inv_n,
    power, offset, alpha, norm_eps, eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """The whole forward in one launch (one token range per head: short sequences, or
    B·H alone filling the GPU): the state of all N tokens for one value tile, kept in
    registers, stored once (for the backward), then the output of every token block.
    Grid: (B·H, BD/BV)."""
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B·H·N may pass 2^31
    vt = tl.program_id(1)
    offs_d = tl.arange(0, BD)
    offs_v = vt * BV + tl.arange(0, BV)
    d_mask = offs_d < D
    v_mask = offs_v < D
    scale = tl.load(ScaleP + bh % H)
    acc1, acc2, z1, z2 = _state_range(K + _head_offset(bh, H, sk_b, sk_h), V + _head_offset(bh, H, sv_b, sv_h),
                                      sk_n, sk_d, sv_n, sv_d, 0, N, offs_d, offs_v, d_mask, v_mask,
                                      scale, power, offset, alpha, norm_eps, bh, N,
                                      False, COSINE, BLOCK_N, BD, BV, PREC, None, None)
    s1 = acc1 * inv_n
    s2 = acc2 * inv_n
    z1 = z1 * inv_n
    z2 = z2 * inv_n
    s_ptr = S + bh * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
    s_mask = d_mask[:, None] & v_mask[None, :]
    tl.store(s_ptr, s1, mask=s_mask)
    tl.store(s_ptr + D * D, s2, mask=s_mask)
    first = d_mask & (vt == 0)
    tl.store(Z + bh * 2 * D + offs_d, z1, mask=first)
    tl.store(Z + bh * 2 * D + D + offs_d, z2, mask=first)
    q_base = Q + _head_offset(bh, H, sq_b, sq_h)
    o_base = O + _head_offset(bh, H, so_b, so_h)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        out, den = _output_block(q_base, sq_n, sq_d, offs_n, n_mask, offs_d, d_mask, offs_v, v_mask,
                                 s1, s2, z1, z2, scale, power, offset, alpha, norm_eps, eps, COSINE, PREC)
        o_ptr = o_base + offs_n[:, None] * so_n + offs_v[None, :] * so_d
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=n_mask[:, None] & v_mask[None, :])
        tl.store(DEN + bh * N + offs_n, den, mask=n_mask & (vt == 0))


@triton.jit
def _output_kernel(
    Q, ScaleP, S, Z, O, DEN,
    sq_b, sq_h, sq_n, sq_d, so_b, so_h, so_n, so_d,
    H, N, D,
    power, offset, alpha, norm_eps, eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """o = φ_qᵀ S / (φ_qᵀ z + ε) for one token block and one value tile (§3 linear form).
    Grid: (B·H, token blocks, BD/BV). O is (B, H, N, D) through its strides; DEN is (B·H, N) fp32."""
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B·H·N may pass 2^31
    nb = tl.program_id(1)
    vt = tl.program_id(2)
    row0 = (nb * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - nb * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_d = tl.arange(0, BD)
    offs_v = vt * BV + tl.arange(0, BV)
    n_mask = offs_n < n_left
    v_mask = offs_v < D
    d_mask = offs_d < D
    scale = tl.load(ScaleP + bh % H)
    s_ptr = S + bh * 2 * D * D + offs_d[:, None] * D + offs_v[None, :]
    s_mask = d_mask[:, None] & v_mask[None, :]
    s1 = tl.load(s_ptr, mask=s_mask, other=0.0)
    s2 = tl.load(s_ptr + D * D, mask=s_mask, other=0.0)
    z1 = tl.load(Z + bh * 2 * D + offs_d, mask=d_mask, other=0.0)
    z2 = tl.load(Z + bh * 2 * D + D + offs_d, mask=d_mask, other=0.0)
    out, den = _output_block(Q + _head_offset(bh, H, sq_b, sq_h) + row0 * sq_n, sq_n, sq_d, offs_n, n_mask, offs_d, d_mask,
                             offs_v, v_mask, s1, s2, z1, z2, scale, power, offset, alpha, norm_eps, eps,
                             COSINE, PREC)
    o_ptr = O + _head_offset(bh, H, so_b, so_h) + row0 * so_n + offs_n[:, None] * so_n + offs_v[None, :] * so_d
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=n_mask[:, None] & v_mask[None, :])
    tl.store(DEN + bh * N + row0 + offs_n, den, mask=n_mask & (vt == 0))


# ------------------------------------------------------------- split head dim kernels
# The same five kernels for a head dim split into tiles a = [0, BA) and b = [BA, BA + BB)
# (fused variant only; power-of-two dims and the baseline run the kernels above). The
# state [S | z] of a half is four blocks, S[a,a] (BA × BA), S[a,b], S[b,a], S[b,b]: every
# product of the kernels above becomes four products of tile pairs, each a tl.dot on
# power-of-two shapes. One program covers every value lane (no value-tile grid axis).
# Output, dq and dkv take the feature lanes in chunks of BC (``SPLIT_CHUNK``) in a loop,
# each chunk meeting its BC rows of the state blocks S[c, a] and S[c, b] (a product split
# along the feature lanes); the value lanes stay the two tiles a and b.


@triton.jit
def _state_range2(x_base, v_base, sx_n, sx_d, sv_n, sv_d, start, end, offs_a, offs_b, D,
                  scale, power, offset, alpha, norm_eps, bh, N,
                  QUERY: tl.constexpr, COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr,
                  BB: tl.constexpr, PREC: tl.constexpr, DEN, DDEN):
    """_state_range with split tiles: per half the blocks S[a,a], S[a,b], S[b,a], S[b,b]
    and z[a], z[b]."""
    s1aa = tl.zeros((BA, BA), dtype=tl.float32)
    s1ab = tl.zeros((BA, BB), dtype=tl.float32)
    s1ba = tl.zeros((BA, BB), dtype=tl.float32)  # transposed
    s1bb = tl.zeros((BB, BB), dtype=tl.float32)
    s2aa = tl.zeros((BA, BA), dtype=tl.float32)
    s2ab = tl.zeros((BA, BB), dtype=tl.float32)
    s2ba = tl.zeros((BA, BB), dtype=tl.float32)
    s2bb = tl.zeros((BB, BB), dtype=tl.float32)
    z1a = tl.zeros((BA,), dtype=tl.float32)
    z2a = tl.zeros((BA,), dtype=tl.float32)
    z1b = tl.zeros((BB,), dtype=tl.float32)
    z2b = tl.zeros((BB,), dtype=tl.float32)
    a_mask = offs_a < D
    b_mask = offs_b < D
    rows = tl.cast(start, tl.int64)                    # the range's first token: int64 base offsets
    x_base += rows * sx_n
    v_base += rows * sv_n
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        offs_r = offs_n - start                        # within the range: int32 products
        xa = _load_block(x_base, sx_n, sx_d, offs_r, offs_a, n_mask, a_mask)
        xb = _load_block(x_base, sx_n, sx_d, offs_r, offs_b, n_mask, b_mask)
        wa = _load_block(v_base, sv_n, sv_d, offs_r, offs_a, n_mask, a_mask)
        wb = _load_block(v_base, sv_n, sv_d, offs_r, offs_b, n_mask, b_mask)
        if QUERY:
            f1a, f2a, f1b, f2b, _ha, _hb, _n, _c, _p, _t = _query_features2(xa, xb, scale, power, offset, alpha,
                                                                            norm_eps, COSINE, PREC)
            den = tl.load(DEN + bh * N + offs_n, mask=n_mask, other=1.0)
            d_den = tl.load(DDEN + bh * N + offs_n, mask=n_mask, other=0.0)
            wa = wa / den[:, None]
            wb = wb / den[:, None]
            z1a += tl.sum(f1a * d_den[:, None], 0)
            z2a += tl.sum(f2a * d_den[:, None], 0)
            z1b += tl.sum(f1b * d_den[:, None], 0)
            z2b += tl.sum(f2b * d_den[:, None], 0)
        else:
            f1a, f2a, f1b, f2b = _key_features2(xa, xb, power, alpha, norm_eps, COSINE, PREC)
            z1a += tl.sum(f1a, 0)
            z2a += tl.sum(f2a, 0)
            z1b += tl.sum(f1b, 0)
            z2b += tl.sum(f2b, 0)
        s1aa += _dot(tl.trans(f1a), wa, PREC)
        s1ab += _dot(tl.trans(f1a), wb, PREC)
        s1ba += _dot(tl.trans(wa), f1b, PREC)          # S[b,a]ᵀ: M = BA rows (wgmma)
        s1bb += _dot(tl.trans(f1b), wb, PREC)
        s2aa += _dot(tl.trans(f2a), wa, PREC)
        s2ab += _dot(tl.trans(f2a), wb, PREC)
        s2ba += _dot(tl.trans(wa), f2b, PREC)
        s2bb += _dot(tl.trans(f2b), wb, PREC)
    return s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb, z1a, z2a, z1b, z2b


@triton.jit
def _put_state2(s_base, z_base, D, offs_a, offs_b, s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb,
                z1a, z2a, z1b, z2b, inv_n, ATOMIC: tl.constexpr):
    """Store (or atomically add) the split state times 1/N into (2, D, D) and (2, D)."""
    _put_block(s_base, offs_a, offs_a, D, s1aa * inv_n, ATOMIC)
    _put_block(s_base, offs_a, offs_b, D, s1ab * inv_n, ATOMIC)
    _put_block(s_base, offs_b, offs_a, D, tl.trans(s1ba * inv_n), ATOMIC)
    _put_block(s_base, offs_b, offs_b, D, s1bb * inv_n, ATOMIC)
    _put_block(s_base + D * D, offs_a, offs_a, D, s2aa * inv_n, ATOMIC)
    _put_block(s_base + D * D, offs_a, offs_b, D, s2ab * inv_n, ATOMIC)
    _put_block(s_base + D * D, offs_b, offs_a, D, tl.trans(s2ba * inv_n), ATOMIC)
    _put_block(s_base + D * D, offs_b, offs_b, D, s2bb * inv_n, ATOMIC)
    _put_vec(z_base, offs_a, D, z1a * inv_n, ATOMIC)
    _put_vec(z_base, offs_b, D, z1b * inv_n, ATOMIC)
    _put_vec(z_base + D, offs_a, D, z2a * inv_n, ATOMIC)
    _put_vec(z_base + D, offs_b, D, z2b * inv_n, ATOMIC)


@triton.jit
def _state_kernel_split(
    X, V, ScaleP, S_part, Z_part,
    sx_b, sx_h, sx_n, sx_d, sv_b, sv_h, sv_n, sv_d,
    H, N, D: tl.constexpr, tokens_per_split, n_splits, inv_n,
    power, offset, alpha, norm_eps,
    QUERY: tl.constexpr, COSINE: tl.constexpr,
    BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, PREC: tl.constexpr,
    DEN=None, DDEN=None, ATOMIC: tl.constexpr = False,
):
    """_state_kernel with split tiles. Grid: (B·H, splits)."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    scale = tl.load(ScaleP + bh % H)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, N)
    s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb, z1a, z2a, z1b, z2b = _state_range2(
        X + _head_offset(bh, H, sx_b, sx_h), V + _head_offset(bh, H, sv_b, sv_h), sx_n, sx_d, sv_n, sv_d,
        start, end, offs_a, offs_b, D, scale, power, offset, alpha, norm_eps, bh, N,
        QUERY, COSINE, BLOCK_N, BA, BB, PREC, DEN, DDEN)
    part = bh if ATOMIC else bh * n_splits + split
    _put_state2(S_part + part * 2 * D * D, Z_part + part * 2 * D, D, offs_a, offs_b,
                s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb, z1a, z2a, z1b, z2b, inv_n, ATOMIC)


@triton.jit
def _output_block2(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D, s_base, z_base,
                   scale, power, offset, alpha, norm_eps, eps, COSINE: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr):
    """_output_block with split tiles: the output's value lanes a and b, and the denominator.
    The features in chunks of BC lanes (a loop), each meeting its BC rows of S: one
    chunk's features live at a time."""
    norm, clamped = _row_norm2(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D, norm_eps)
    p = power * (offset + _tanh(norm / scale, "ieee"))
    s2 = s_base + D * D
    num_a = tl.zeros((BLOCK_N, BA), dtype=tl.float32)
    num_b = tl.zeros((BLOCK_N, BB), dtype=tl.float32)
    den = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c0 in range(0, D, BC):
        offs_c = c0 + tl.arange(0, BC)
        c_mask = offs_c < D
        f1, f2, _h = _query_tile(_load_block(q_base, sq_n, sq_d, offs_n, offs_c, n_mask, c_mask), clamped, p, alpha,
                                 COSINE, PREC)
        num_a += _dot(f1, _s_block(s_base, offs_c, offs_a, D), PREC)
        num_a += _dot(f2, _s_block(s2, offs_c, offs_a, D), PREC)
        num_b += _dot(f1, _s_block(s_base, offs_c, offs_b, D), PREC)
        num_b += _dot(f2, _s_block(s2, offs_c, offs_b, D), PREC)
        z1 = tl.load(z_base + offs_c, mask=c_mask, other=0.0)
        z2 = tl.load(z_base + D + offs_c, mask=c_mask, other=0.0)
        den += tl.sum(f1 * z1[None, :] + f2 * z2[None, :], 1)
    den += eps
    return num_a / den[:, None], num_b / den[:, None], den


@triton.jit
def _forward_kernel_split(
    K, V, Q, ScaleP, S, Z, O, DEN,
    sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sq_b, sq_h, sq_n, sq_d, so_b, so_h, so_n, so_d,
    H, N, D: tl.constexpr, inv_n,
    power, offset, alpha, norm_eps, eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, BLOCK_O: tl.constexpr = 64, BC: tl.constexpr = 16,
):
    """_forward_kernel with split tiles. The state is stored, then read back block by
    block for the output (after a barrier: the program's own stores), which keeps the
    output loop's registers those of _output_kernel_split; the output runs on token blocks
    of BLOCK_O (the output kernel's block: wgmma needs 64 rows), the feature lanes in
    chunks of BC. Grid: (B·H,)."""
    bh = tl.program_id(0).to(tl.int64)
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    scale = tl.load(ScaleP + bh % H)
    s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb, z1a, z2a, z1b, z2b = _state_range2(
        K + _head_offset(bh, H, sk_b, sk_h), V + _head_offset(bh, H, sv_b, sv_h), sk_n, sk_d, sv_n, sv_d,
        0, N, offs_a, offs_b, D, scale, power, offset, alpha, norm_eps, bh, N,
        False, COSINE, BLOCK_N, BA, BB, PREC, None, None)
    s_base = S + bh * 2 * D * D
    _put_state2(s_base, Z + bh * 2 * D, D, offs_a, offs_b, s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb,
                z1a, z2a, z1b, z2b, inv_n, False)
    tl.debug_barrier()
    q_base = Q + _head_offset(bh, H, sq_b, sq_h)
    o_base = O + _head_offset(bh, H, so_b, so_h)
    for n0 in range(0, N, BLOCK_O):
        offs_n = n0 + tl.arange(0, BLOCK_O)
        n_mask = offs_n < N
        out_a, out_b, den = _output_block2(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D, s_base,
                                           Z + bh * 2 * D, scale, power, offset, alpha, norm_eps, eps,
                                           COSINE, PREC, BLOCK_O, BA, BB, BC)
        _store_tile(o_base, so_n, so_d, offs_n, offs_a, N, D, out_a)
        _store_tile(o_base, so_n, so_d, offs_n, offs_b, N, D, out_b)
        tl.store(DEN + bh * N + offs_n, den, mask=n_mask)


@triton.jit
def _output_kernel_split(
    Q, ScaleP, S, Z, O, DEN,
    sq_b, sq_h, sq_n, sq_d, so_b, so_h, so_n, so_d,
    H, N, D: tl.constexpr,
    power, offset, alpha, norm_eps, eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, BC: tl.constexpr = 16,
):
    """_output_kernel with split tiles. Grid: (B·H, token blocks)."""
    bh = tl.program_id(0).to(tl.int64)
    row0 = (tl.program_id(1) * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - tl.program_id(1) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    scale = tl.load(ScaleP + bh % H)
    out_a, out_b, den = _output_block2(Q + _head_offset(bh, H, sq_b, sq_h) + row0 * sq_n, sq_n, sq_d, offs_n, offs_n < n_left,
                                       offs_a, offs_b, D, S + bh * 2 * D * D, Z + bh * 2 * D,
                                       scale, power, offset, alpha, norm_eps, eps, COSINE, PREC, BLOCK_N, BA, BB, BC)
    o_base = O + _head_offset(bh, H, so_b, so_h) + row0 * so_n
    _store_tile(o_base, so_n, so_d, offs_n, offs_a, n_left, D, out_a)
    _store_tile(o_base, so_n, so_d, offs_n, offs_b, n_left, D, out_b)
    tl.store(DEN + bh * N + row0 + offs_n, den, mask=offs_n < n_left)
