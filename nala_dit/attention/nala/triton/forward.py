"""NaLa's forward kernels: the state pass (``_state_kernel``: ``[S | z]`` over a token range,
atomically added into one state where several ranges run; with QUERY=True the backward's
∂L/∂[S | z]), the output (``_output_kernel``: ``o = φ_qᵀS / (φ_qᵀz + ε)``, the denominator
kept) and both as one launch (``_forward_kernel``, one token range per head). The head dim
runs as two tiles a = [0, BA) and b = [BA, BA + BB) (``launch.split_tiles``; README.md).
Launched by ``launch.py``."""

import triton
import triton.language as tl

from .features import _key_features, _query_features, _query_tile, _tanh
from .blocks import (_dot, _head_offset, _load_block, _load_features, _put_block, _put_features, _put_vec, _row_norm,
                     _s_block, _store_tile)


# The state [S | z] of a half is four blocks, S[a,a] (BA × BA), S[a,b], S[b,a], S[b,b]:
# every product is four products of tile pairs, each a tl.dot on power-of-two shapes. One
# program covers every value lane (no value-tile grid axis). Output, dq and dkv take the
# feature lanes in chunks of BC (``SPLIT_CHUNK``) in a loop, each chunk meeting its BC rows
# of the state blocks S[c, a] and S[c, b]; the value lanes stay the two tiles a and b.


@triton.jit
def _state_range(x_base, v_base, sx_n, sx_d, sv_n, sv_d, start, end, offs_a, offs_b, D: tl.constexpr,
                 scale, power, offset, alpha, norm_eps, bh, N,
                 QUERY: tl.constexpr, COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr,
                 BB: tl.constexpr, PREC: tl.constexpr, DEN, DDEN, F, KEEP: tl.constexpr):
    """Σ φ(x_j) w_jᵀ and Σ φ(x_j) over tokens [start, end), in fp32: per half the blocks
    S[a,a], S[a,b], S[b,a] (transposed), S[b,b] and z[a], z[b] (see _state_kernel). KEEP:
    φ_k is stored into F (keys), or φ_q loaded from it (queries: x is not read)."""
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
    if KEEP:
        f_base = F + (bh * N + rows) * (2 * D)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        offs_r = offs_n - start                        # within the range: int32 products
        wa = _load_block(v_base, sv_n, sv_d, offs_r, offs_a, n_mask, a_mask)
        wb = _load_block(v_base, sv_n, sv_d, offs_r, offs_b, n_mask, b_mask)
        if QUERY and KEEP:
            f1a, f2a = _load_features(f_base, D, offs_r, n_mask, offs_a)
            f1b, f2b = _load_features(f_base, D, offs_r, n_mask, offs_b)
        else:
            xa = _load_block(x_base, sx_n, sx_d, offs_r, offs_a, n_mask, a_mask)
            xb = _load_block(x_base, sx_n, sx_d, offs_r, offs_b, n_mask, b_mask)
            if QUERY:
                f1a, f2a, f1b, f2b, _ha, _hb, _n, _c, _p, _t = _query_features(xa, xb, scale, power, offset, alpha,
                                                                                norm_eps, COSINE, PREC)
            else:
                f1a, f2a, f1b, f2b = _key_features(xa, xb, power, alpha, norm_eps, COSINE, PREC)
                if KEEP:
                    _put_features(f_base, D, offs_r, n_mask, offs_a, f1a, f2a, PREC)
                    _put_features(f_base, D, offs_r, n_mask, offs_b, f1b, f2b, PREC)
        if QUERY:
            den = tl.load(DEN + bh * N + offs_n, mask=n_mask, other=1.0)
            d_den = tl.load(DDEN + bh * N + offs_n, mask=n_mask, other=0.0)
            wa = wa / den[:, None]
            wb = wb / den[:, None]
            z1a += tl.sum(f1a * d_den[:, None], 0)
            z2a += tl.sum(f2a * d_den[:, None], 0)
            z1b += tl.sum(f1b * d_den[:, None], 0)
            z2b += tl.sum(f2b * d_den[:, None], 0)
        else:
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
def _put_state(s_base, z_base, D, offs_a, offs_b, s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb,
                z1a, z2a, z1b, z2b, inv_n, ATOMIC: tl.constexpr):
    """Store (or atomically add) the state's blocks times 1/N into (2, D, D) and (2, D)."""
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
def _state_kernel(
    X, V, ScaleP, S_part, Z_part,
    sx_b, sx_h, sx_n, sx_d, sv_b, sv_h, sv_n, sv_d,
    H, N, D: tl.constexpr, tokens_per_split, n_splits, inv_n,
    power, offset, alpha, norm_eps,
    QUERY: tl.constexpr, COSINE: tl.constexpr,
    BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, PREC: tl.constexpr,
    DEN=None, DDEN=None, ATOMIC: tl.constexpr = False, F=None, KEEP: tl.constexpr = False,
):
    """Partial sums over one token range of Σ φ(x_j) v_jᵀ and Σ φ(x_j) w_j, per half.

    Forward (QUERY=False): x = k, v = v, w = 1 → [S | z] (times 1/N); KEEP: φ_k stored
    into F, (B·H, N, 2D).
    Backward (QUERY=True):  x = q, v = g/den, w = ∂L/∂den → ∂L/∂[S | z] (times 1/N); KEEP:
    φ_q read from F (the forward's), not computed.
    ATOMIC: every range adds its sum into one zeroed (B·H, 2, D, D) state with relaxed fp32
    atomic adds (no partial buffers, no separate sum); else one range stores it. The
    buffers are unpadded (the state is saved for the backward). Grid: (B·H, splits)."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    scale = tl.load(ScaleP + bh % H)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, N)
    s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb, z1a, z2a, z1b, z2b = _state_range(
        X + _head_offset(bh, H, sx_b, sx_h), V + _head_offset(bh, H, sv_b, sv_h), sx_n, sx_d, sv_n, sv_d,
        start, end, offs_a, offs_b, D, scale, power, offset, alpha, norm_eps, bh, N,
        QUERY, COSINE, BLOCK_N, BA, BB, PREC, DEN, DDEN, F, KEEP)
    part = bh if ATOMIC else bh * n_splits + split
    _put_state(S_part + part * 2 * D * D, Z_part + part * 2 * D, D, offs_a, offs_b,
                s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb, z1a, z2a, z1b, z2b, inv_n, ATOMIC)


@triton.jit
def _output_block(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D: tl.constexpr, s_base, z_base,
                  scale, power, offset, alpha, norm_eps, eps, COSINE: tl.constexpr, PREC: tl.constexpr,
                  BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr,
                  f_base, KEEP: tl.constexpr):
    """One token block of o = φ_qᵀ S / (φ_qᵀ z + ε), value lanes a and b, and its
    denominator. The features in chunks of BC lanes (a loop), each meeting its BC rows of
    S: one chunk's features live at a time. KEEP: φ_q stored at ``f_base`` (the rows of
    offs_n)."""
    norm, clamped = _row_norm(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D, norm_eps)
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
        if KEEP:
            _put_features(f_base, D, offs_n, n_mask, offs_c, f1, f2, PREC)
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
def _forward_kernel(
    K, V, Q, ScaleP, S, Z, O, DEN,
    sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sq_b, sq_h, sq_n, sq_d, so_b, so_h, so_n, so_d,
    H, N, D: tl.constexpr, inv_n,
    power, offset, alpha, norm_eps, eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, BLOCK_O: tl.constexpr = 64, BC: tl.constexpr = 16,
    FQ=None, FK=None, KEEP: tl.constexpr = False,
):
    """The whole forward in one launch (one token range per head: short sequences): the
    state of all N tokens, stored (for the backward), then read back block by block for
    the output (after a barrier: the program's own stores), which keeps the output loop's
    registers those of _output_kernel; the output runs on token blocks of BLOCK_O (the
    output kernel's block: wgmma needs 64 rows), the feature lanes in chunks of BC. KEEP:
    φ_k and φ_q stored into FK and FQ, (B·H, N, 2D). Grid: (B·H,)."""
    bh = tl.program_id(0).to(tl.int64)
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    scale = tl.load(ScaleP + bh % H)
    s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb, z1a, z2a, z1b, z2b = _state_range(
        K + _head_offset(bh, H, sk_b, sk_h), V + _head_offset(bh, H, sv_b, sv_h), sk_n, sk_d, sv_n, sv_d,
        0, N, offs_a, offs_b, D, scale, power, offset, alpha, norm_eps, bh, N,
        False, COSINE, BLOCK_N, BA, BB, PREC, None, None, FK, KEEP)
    s_base = S + bh * 2 * D * D
    _put_state(s_base, Z + bh * 2 * D, D, offs_a, offs_b, s1aa, s1ab, s1ba, s1bb, s2aa, s2ab, s2ba, s2bb,
                z1a, z2a, z1b, z2b, inv_n, False)
    tl.debug_barrier()
    q_base = Q + _head_offset(bh, H, sq_b, sq_h)
    o_base = O + _head_offset(bh, H, so_b, so_h)
    fq_base = FQ + bh * N * (2 * D) if KEEP else FQ
    for n0 in range(0, N, BLOCK_O):
        offs_n = n0 + tl.arange(0, BLOCK_O)
        n_mask = offs_n < N
        out_a, out_b, den = _output_block(q_base, sq_n, sq_d, offs_n, n_mask, offs_a, offs_b, D, s_base,
                                          Z + bh * 2 * D, scale, power, offset, alpha, norm_eps, eps,
                                          COSINE, PREC, BLOCK_O, BA, BB, BC, fq_base, KEEP)
        _store_tile(o_base, so_n, so_d, offs_n, offs_a, N, D, out_a)
        _store_tile(o_base, so_n, so_d, offs_n, offs_b, N, D, out_b)
        tl.store(DEN + bh * N + offs_n, den, mask=n_mask)


@triton.jit
def _output_kernel(
    Q, ScaleP, S, Z, O, DEN,
    sq_b, sq_h, sq_n, sq_d, so_b, so_h, so_n, so_d,
    H, N, D: tl.constexpr,
    power, offset, alpha, norm_eps, eps,
    COSINE: tl.constexpr, BLOCK_N: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    PREC: tl.constexpr, BC: tl.constexpr = 16, F=None, KEEP: tl.constexpr = False,
):
    """o = φ_qᵀ S / (φ_qᵀ z + ε) for one token block (§3 linear form). O is (B, H, N, D)
    through its strides; DEN is (B·H, N) fp32; KEEP: φ_q stored into F, (B·H, N, 2D).
    Grid: (B·H, token blocks)."""
    bh = tl.program_id(0).to(tl.int64)
    row0 = (tl.program_id(1) * BLOCK_N).to(tl.int64)   # the block's first token: int64 base offsets
    n_left = N - tl.program_id(1) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)             # within the block: int32 products
    offs_a = tl.arange(0, BA)
    offs_b = BA + tl.arange(0, BB)
    scale = tl.load(ScaleP + bh % H)
    out_a, out_b, den = _output_block(Q + _head_offset(bh, H, sq_b, sq_h) + row0 * sq_n, sq_n, sq_d, offs_n, offs_n < n_left,
                                       offs_a, offs_b, D, S + bh * 2 * D * D, Z + bh * 2 * D,
                                      scale, power, offset, alpha, norm_eps, eps, COSINE, PREC, BLOCK_N, BA, BB, BC,
                                      F + (bh * N + row0) * (2 * D) if KEEP else F, KEEP)
    o_base = O + _head_offset(bh, H, so_b, so_h) + row0 * so_n
    _store_tile(o_base, so_n, so_d, offs_n, offs_a, n_left, D, out_a)
    _store_tile(o_base, so_n, so_d, offs_n, offs_b, n_left, D, out_b)
    tl.store(DEN + bh * N + row0 + offs_n, den, mask=offs_n < n_left)
