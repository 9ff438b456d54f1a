"""The ``@triton.jit`` helpers every NaLa kernel shares: rounding and products of fp32 blocks
in each precision (``_dot``), masked loads and stores of token blocks, a head's offset, the
blocks of a state half (``_s_block``, ``_put_block``) and the kept features
(``_put_features``, ``_load_features``)."""

import triton
import triton.language as tl


@triton.jit
def _round_tf32(x):
    """fp32 rounded to the nearest TF32 value (10 mantissa bits; ties away from zero).
    Tensor cores truncate the 13 low bits instead, which would shrink every product
    by 2^-11 on average: a bias the fp32 normaliser (a plain sum) would not share."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _round_bf16(x):
    """fp32 rounded to the nearest bf16 value, kept in fp32 (ties away from zero): the
    interpreter's stand-in for bf16 operands (its bf16 ``tl.dot`` is wrong, Triton 3.8).
    A product of two bf16 values is exact in fp32, so an fp32 dot of rounded operands
    equals the tensor cores' bf16 dot up to the order of the fp32 additions."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x8000) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """``a @ b`` of fp32 blocks with an fp32 accumulator: exact fp32 ("ieee"), TF32
    tensor cores on rounded operands ("tf32"), bf16 tensor cores ("bf16"), or bf16-rounded
    operands in an exact fp32 product ("bf16_exact": the same numbers, interpreter-safe)."""
    if PREC == "tf32":
        return tl.dot(_round_tf32(a), _round_tf32(b), input_precision="tf32")
    elif PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16_exact":
        return tl.dot(_round_bf16(a), _round_bf16(b), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _load_block(ptr, stride_n, stride_d, offs_n, offs_d, n_mask, d_mask):
    """A (BN, BD) block of a (N, D) slice, masked to 0, in fp32."""
    x = tl.load(ptr + offs_n[:, None] * stride_n + offs_d[None, :] * stride_d,
                mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _head_offset(bh, H, stride_b, stride_h):
    return (bh // H) * stride_b + (bh % H) * stride_h  # bh is int64 (see the kernels)


@triton.jit
def _s_block(base, offs_r, offs_c, D):
    """One (rows, cols) block of a (D, D) state half, 0 outside D."""
    return tl.load(base + offs_r[:, None] * D + offs_c[None, :],
                   mask=(offs_r < D)[:, None] & (offs_c < D)[None, :], other=0.0)


@triton.jit
def _s_block_t(base, offs_r, offs_c, D):
    """The transpose of _s_block, loaded as such (no layout conversion in registers)."""
    return tl.load(base + offs_r[None, :] * D + offs_c[:, None],
                   mask=(offs_r < D)[None, :] & (offs_c < D)[:, None], other=0.0)


@triton.jit
def _put_block(base, offs_r, offs_c, D, x, ATOMIC: tl.constexpr):
    ptr = base + offs_r[:, None] * D + offs_c[None, :]
    mask = (offs_r < D)[:, None] & (offs_c < D)[None, :]
    if ATOMIC:
        tl.atomic_add(ptr, x, mask=mask, sem="relaxed")
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _put_vec(base, offs, D, x, ATOMIC: tl.constexpr):
    if ATOMIC:
        tl.atomic_add(base + offs, x, mask=offs < D, sem="relaxed")
    else:
        tl.store(base + offs, x, mask=offs < D)


@triton.jit
def _row_norm(base, s_n, s_d, offs_n, n_mask, offs_a, offs_b, D, norm_eps):
    """‖x‖ over both tiles of a (BN, D) slice, and max(‖x‖, ε)."""
    xa = _load_block(base, s_n, s_d, offs_n, offs_a, n_mask, offs_a < D)
    xb = _load_block(base, s_n, s_d, offs_n, offs_b, n_mask, offs_b < D)
    norm = tl.sqrt(tl.sum(xa * xa, 1) + tl.sum(xb * xb, 1))
    return norm, tl.maximum(norm, norm_eps)


@triton.jit
def _store_tile(base, s_n, s_d, offs_n, offs_d, N, D, x, ADD: tl.constexpr = False):
    """A (BN, tile) block into an (N, D) slice with strides (s_n, s_d); ADD: added to
    what the slice holds."""
    ptr = base + offs_n[:, None] * s_n + offs_d[None, :] * s_d
    mask = (offs_n < N)[:, None] & (offs_d < D)[None, :]
    if ADD:
        x += tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _put_features(f_base, D: tl.constexpr, offs_n, n_mask, offs_c, f1, f2, PREC: tl.constexpr):
    """A token block's φ halves on lanes offs_c into a (N, 2D) bf16 feature row buffer (f1
    at [0, D), f2 at [D, 2D)); ``f_base`` points at the block's first token. Rounded as
    ``_dot`` rounds its operands in ``PREC`` (the interpreter's cast would truncate), so
    the products see the same numbers stored or not."""
    if PREC == "bf16_exact":
        f1 = _round_bf16(f1)
        f2 = _round_bf16(f2)
    ptr = f_base + offs_n[:, None] * (2 * D) + offs_c[None, :]
    mask = n_mask[:, None] & (offs_c < D)[None, :]
    tl.store(ptr, f1.to(f_base.dtype.element_ty), mask=mask)
    tl.store(ptr + D, f2.to(f_base.dtype.element_ty), mask=mask)


@triton.jit
def _load_features(f_base, D: tl.constexpr, offs_n, n_mask, offs_c):
    """_put_features' halves back, fp32 (0 outside N and D)."""
    ptr = f_base + offs_n[:, None] * (2 * D) + offs_c[None, :]
    mask = n_mask[:, None] & (offs_c < D)[None, :]
    f1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    f2 = tl.load(ptr + D, mask=mask, other=0.0).to(tl.float32)
    return f1, f2
