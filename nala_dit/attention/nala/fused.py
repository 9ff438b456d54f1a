"""NaLa's fused CPU path (``impl="fused"``): the §3 linear form in token chunks, with a
hand-written backward.

Top to bottom:

* the token chunking (``_token_chunks``, chunks of about 2^16 elements: each elementwise
  pass stays in the core's L2 cache) and its per-pass scratch (``_Scratch``);
* the chunk-wise feature lifts and their hand-written gradients (``_query_lift``,
  ``_key_lift``, ``_query_grad``, ``_key_grad``): the per-token constants (norm, exponent)
  for all tokens at once (``_token_scales``), the cos/sin halves written in place into
  one 2D-wide scratch block, so each product with the state is one GEMM;
* the passes ``fused_state``, ``fused_output``, ``fused_backward`` (also what the gated
  layer's ``recompute.GatedMiddle``, region states and context parallel call);
* ``_FusedNaLa``, the autograd function that saves q, k, v, the small state ``[S | z]``
  and the denominator only, and recomputes the features in backward; ``_FusedNaLaJvp``,
  the same with a forward-mode rule (``tangent.py``);
* ``fused_opts``: the §2 / §3 constants as these passes and the Triton kernels take them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from ..config import NaLaConfig
from ..functional import _no_autocast
from .chunks import CHUNK_ELEMENTS, CHUNK_ELEMENTS_GPU, token_chunks
from .tangent import FORWARD_OVER_REVERSE_REFUSAL, in_forward_mode, nala_tangent

# Tokens are processed in chunks of about this many elements per (B, H, C, D) slice:
# the feature maps are per token, so chunking bounds their temporaries (O(chunk), not
# O(N)) and keeps each elementwise pass inside the core's L2 cache (a dozen chunk-sized
# temporaries are alive at once). On a GPU small chunks only multiply kernel launches,
# so there a chunk is most or all of the sequence.
_CHUNK_ELEMENTS = CHUNK_ELEMENTS
_CHUNK_ELEMENTS_GPU = CHUNK_ELEMENTS_GPU

_TINY = torch.finfo(torch.float32).tiny     # the smallest normal fp32
_LOG_FLOOR = -104.0                         # below log of the smallest fp32 denormal (−103.3)
_ONE = torch.tensor(1.0)                    # a 0-dim operand (it broadcasts on any device)
_FAST_POWERS = (0.5, 1.0, 2.0, 3.0)         # exponents torch.pow evaluates without log/exp
_CONSTANTS: dict[tuple, torch.Tensor] = {}  # more 0-dim operands, by value and dtype (``_constant``)


def _acc(x: torch.Tensor) -> torch.dtype:
    """The dtype the fused passes compute in: fp32, or float64 for float64 inputs (so a
    float64 reference and gradcheck see no fp32 rounding)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _constant(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim operand (as ``_ONE``) in ``like``'s compute dtype (``_acc``), made once per
    value and dtype (under ``torch.compile``, like ``like``'s ``new_full``)."""
    if torch.compiler.is_compiling():
        return like.new_full((), value)
    key = (value, _acc(like))
    if key not in _CONSTANTS:
        if len(_CONSTANTS) > 64:
            _CONSTANTS.clear()
        _CONSTANTS[key] = torch.tensor(value, dtype=key[1])
    return _CONSTANTS[key]


def _token_chunks(shape: torch.Size, device: torch.device) -> list[slice]:
    """``chunks.token_chunks`` at this module's ``_CHUNK_ELEMENTS`` (tests and
    benchmarks/cpu_path.py set them here)."""
    return token_chunks(shape, device, _CHUNK_ELEMENTS, _CHUNK_ELEMENTS_GPU)


class _Block(NamedTuple):
    """Views of a (B, H, c, W) scratch block: itself, as (B·H, c, W), and its columns
    ``[:D]`` and ``[D:]`` (the feature halves, or ``[num | den]``)."""
    x: torch.Tensor
    bh: torch.Tensor
    halves: tuple[torch.Tensor, torch.Tensor]


class _Scratch:
    """One pass's scratch, reused by every token chunk: (B, H, C, W) fp32 blocks of the
    given widths (the 2D-wide features, their gradient, ``[y | 1]`` or ``[∂L/∂num | ∂L/∂den]``:
    one GEMM against it yields a product with y and a token sum together, §3's S and z),
    and their views for a chunk of c tokens (built once per length: a pass has two at most)."""

    def __init__(self, x: torch.Tensor, size: int, *widths: int):
        b, h, _, self.d = x.shape
        self.blocks = [x.new_empty(b, h, size, w, dtype=_acc(x)) for w in widths]
        self.cache = {}

    def __call__(self, c: int) -> list[_Block]:
        if c not in self.cache:
            d, views = self.d, []
            for block in self.blocks:
                x = block.narrow(2, 0, c)
                bh = x.flatten(0, 1)
                views.append(_Block(x, bh, (x[..., :d], x[..., d:])))
            self.cache[c] = views
        return self.cache[c]


def _abs_pow(mag: torch.Tensor, power: float, keep: bool) -> torch.Tensor:
    """``mag^power`` for ``mag ≥ 0`` (in place unless ``keep``): torch.pow where it has a
    fast form, else exp(λ·log mag) (log 0 = −inf gives exactly 0 for λ > 0), several times
    faster than torch.pow's general exponent on the CPU."""
    if power in _FAST_POWERS or power <= 0:
        return torch.pow(mag, power) if keep else mag.pow_(power)
    return (torch.log(mag) if keep else mag.log_()).mul_(power).exp_()


def _lift(theta: torch.Tensor | None, mag: torch.Tensor, x: torch.Tensor, halves, keep: bool = True) -> None:
    """The two halves of a §2 feature map written into ``halves`` (the D-wide halves of
    the (B, H, C, 2D) feature): ``mag ⊙ cos θ, mag ⊙ sin θ`` (cosine) or ``mag ⊙ 1(x>0),
    mag ⊙ 1(x<0)`` (relu_split). The 2D-wide feature is built in place, so each product
    with the state is one GEMM. ``keep`` False: θ may be overwritten."""
    f1, f2 = halves
    if theta is None:
        # 1(x>0) as max(sign x, 0): float ops, several times faster than a bool mask.
        _into(f1, torch.mul, mag, torch.sign(x).clamp_min_(0.0))
        # mag − mag·1(x>0) = mag·1(x<0): at x = 0 the magnitude is 0^p = 0 anyway.
        _into(f2, torch.sub, mag, f1)
        return
    sin = torch.sin(theta) if keep else theta.sin_()   # not into the strided half: slower
    # |θ| < π/4, so cos θ = √(1 − sin²θ) ≥ 1/√2 has no cancellation, and a square root
    # costs less than a second transcendental.
    cos = torch.addcmul(_ONE, sin, sin, value=-1.0).sqrt_()
    _into(f1, torch.mul, cos, mag)
    _into(f2, torch.mul, sin, mag)


def _into(out: torch.Tensor, fn, *args, **kwargs) -> torch.Tensor:
    """``fn(*args, **kwargs, out=out)``: the result written straight into a strided view
    (under ``torch.compile``, which traces no ``out=`` into a strided tensor, as a copy)."""
    if torch.compiler.is_compiling():
        return out.copy_(fn(*args, **kwargs))
    return fn(*args, **kwargs, out=out)


def _angle(x: torch.Tensor, scale, inplace: bool = False) -> torch.Tensor:
    """θ = (π/4)·tanh(α x̂) of §2 from ``x`` and ``scale``: α for x = x̂, or the
    per-token α/max(‖x‖, ε) that folds the normalisation in (``inplace``: into x)."""
    return (x.mul_(scale) if inplace else torch.mul(x, scale)).tanh_().mul_(math.pi / 4)


def _token_scales(x: torch.Tensor, o: dict, query: bool, grad: bool) -> dict:
    """Per-token constants of a lift for all N tokens at once, each (B, H, N, 1) (one op
    each, not one per chunk): for queries ``inv`` = 1/max(‖x‖, ε) and the exponent ``p`` =
    λ(τ + tanh(‖x‖/s)), for cosine keys ``alpha_inv`` = α·inv. With ``grad``, also what the
    backward of the normalisation needs (``_through_unit``)."""
    if not query and o["direction"] != "cosine":
        return {}                                                   # relu_split keys: no norm
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=_acc(x))
    inv = norm.clamp_min(o["norm_eps"]).reciprocal_()
    if query:
        tanh_n = torch.tanh(norm / o["norm_scale"])
        t = {"inv": inv, "p": torch.add(tanh_n, o["offset"]).mul_(o["power"])}
    else:
        t = {"alpha_inv": inv * o["alpha"]}
    if grad:
        # x̂ = x·inv: ∂L/∂x = ∂L/∂x̂·inv + x·(∂L/∂‖x‖)/‖x‖, where max(‖x‖, ε) passes
        # −inv²·Σ ∂L/∂x̂·x to ‖x‖ where ‖x‖ ≥ ε, and ‖x‖ has gradient x/‖x‖ (0 at x = 0).
        norm_safe = norm.masked_fill(norm == 0, 1.0)
        t["inv"] = inv
        t["unit"] = (inv * inv).neg_().mul_(norm >= o["norm_eps"]).div_(norm_safe)
        if query:   # ∂p/∂‖x‖ = (λ/s)·(1 − tanh²(‖x‖/s))
            t["dp_dnorm"] = torch.addcmul(_ONE, tanh_n, tanh_n, value=-1.0).mul_(
                o["power"] / o["norm_scale"]).div_(norm_safe)
    return t


def _rows(x: torch.Tensor, start: int, c: int) -> torch.Tensor:
    """Tokens ``start`` to ``start + c`` of a (B, H, N, D) tensor, in fp32 or float64
    (``_acc``; a view when it is)."""
    x = x.narrow(2, start, c)
    return x if x.dtype == _acc(x) else x.float()


def _narrow(t: dict, start: int, c: int) -> dict:
    """The token constants of one chunk (views)."""
    return {key: val.narrow(2, start, c) for key, val in t.items()}


def _query_lift(q: torch.Tensor, t: dict, o: dict, halves, keep: bool = False) -> tuple | None:
    """φ_q of §2 for a chunk of fp32 queries (its token constants ``t``), written into
    ``halves``; with ``keep``, what ``_query_grad`` needs."""
    q_hat = q * t["inv"]
    # a = |q̂|^p as exp(p·log|q̂|): log 0 = −inf gives exactly 0 here, and this forward
    # is never differentiated by autograd -- _query_grad handles q̂ = 0 explicitly.
    mag = q_hat.abs()
    log_mag = torch.log(mag) if keep else mag.log_()
    a = torch.mul(log_mag, t["p"]).exp_() if keep else log_mag.mul_(t["p"]).exp_()
    theta = _angle(q_hat, o["alpha"], inplace=True) if o["direction"] == "cosine" else None   # q̂ is spent
    _lift(theta, a, q_hat, halves, keep)
    return (mag, log_mag, theta) if keep else None


def _key_lift(k: torch.Tensor, t: dict, o: dict, halves, keep: bool = False) -> tuple | None:
    """φ_k of §2 for a chunk of fp32 keys (its token constants ``t``), written into
    ``halves``; with ``keep``, what ``_key_grad`` needs."""
    mag = k.abs()
    b = _abs_pow(mag, o["power"], keep)                           # norm kept
    theta = _angle(k, t["alpha_inv"]) if o["direction"] == "cosine" else None   # α·k̂ in one pass
    _lift(theta, b, k, halves, keep)
    return (mag, theta) if keep else None


def _lift_grads(halves, grad, theta: torch.Tensor | None, alpha: float):
    """Backward of ``_lift`` from the features themselves (cos, sin, mag are not kept).

    With ``F = (m c, m s)`` (``halves``) and its gradient ``G = (G₁, G₂)`` (``grad``):
    ``m·∂L/∂m = G₁F₁ + G₂F₂`` and ``∂L/∂θ = G₂F₁ − G₁F₂``. Returns
    ``(m·∂L/∂m, ∂L/∂x̂ through θ, or None)``.
    """
    (f1, f2), (g1, g2) = halves, grad
    m_dm = torch.mul(g1, f1).addcmul_(g2, f2)
    if theta is None:
        return m_dm, None
    d_theta = torch.mul(g2, f1).addcmul_(g1, f2, value=-1.0)
    # θ = (π/4)·tanh(α x̂): dθ/dx̂ = (π/4)·α·(1 − tanh²), with tanh = (4/π)·θ.
    scale = math.pi / 4 * alpha
    return m_dm, d_theta.mul_(torch.addcmul(_constant(scale, theta), theta, theta, value=-16 / math.pi**2 * scale))


def _safe_divisor(mag: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x with |x| raised to the smallest normal fp32 (``mag``: |x| or a positive multiple,
    overwritten): a divisor for ``∂/∂x |x|^λ = λ·|x|^λ/x``, whose numerator is exactly 0
    where x is."""
    return torch.copysign(mag.clamp_min_(_TINY), x)


def _through_unit(x, t, d_hat, d_norm=None):
    """Gradient wrt x of ``x̂ = x · inv`` (``_token_scales``), plus an extra
    ``∂L/∂‖x‖ / ‖x‖`` (or None), but for the last step: returns ``(a, coef)`` with the
    gradient ``a + x·coef``. ``d_hat`` is overwritten."""
    coef = (d_hat * x).sum(-1, keepdim=True).mul_(t["unit"])
    if d_norm is not None:
        coef.add_(d_norm)
    return d_hat.mul_(t["inv"]), coef


def _query_grad(q, halves, grad, t, parts, o, out):
    """∂L/∂q of a chunk into ``out`` from the gradient ``grad`` of its features' halves."""
    mag, log_mag, theta = parts
    a_da, d_hat = _lift_grads(halves, grad, theta, o["alpha"])
    # a = |q̂|^p: ∂a/∂p = a·log|q̂| and ∂a/∂q̂ = p·a/q̂, both 0 where q̂ = 0 (as torch.pow):
    # a·∂L/∂a is exactly 0 there, so a finite log and a nonzero divisor give that 0.
    d_p = torch.mul(a_da, log_mag.clamp_min_(_LOG_FLOOR)).sum(-1, keepdim=True)
    a_da.mul_(t["p"])
    divisor = _safe_divisor(mag, q)                               # |q̂| with q's sign
    d_hat = a_da.div_(divisor) if d_hat is None else d_hat.addcdiv_(a_da, divisor)
    d_hat, coef = _through_unit(q, t, d_hat, d_p.mul_(t["dp_dnorm"]))
    _into(out, torch.addcmul, d_hat, q, coef)


def _key_grad(k, halves, grad, t, parts, o, out):
    """∂L/∂k of a chunk into ``out`` from the gradient ``grad`` of its features' halves."""
    mag, theta = parts
    b_db, d_hat = _lift_grads(halves, grad, theta, o["alpha"])
    # b = |k|^λ: ∂b/∂k = λ·b/k, 0 at k = 0 (b·∂L/∂b is exactly 0 there).
    divisor = _safe_divisor(mag, k)
    if d_hat is None:
        _into(out, torch.div, b_db.mul_(o["power"]), divisor)
        return
    d_hat, coef = _through_unit(k, t, d_hat)
    _into(out, torch.addcdiv, d_hat.addcmul_(k, coef), b_db, divisor, value=o["power"])


def _bh(x: torch.Tensor) -> torch.Tensor | None:
    """(B, H, C, F) as a (B·H, C, F) view, or None where the strides do not allow one."""
    return x.flatten(0, 1) if x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1) else None


def _joined(state: torch.Tensor) -> torch.Tensor:
    """A state kept as halves (2, B, H, D, D+1) as one (B·H, 2D, D+1) matrix (a small copy)."""
    two, b, h, d, e = state.shape
    return state.permute(1, 2, 0, 3, 4).reshape(b * h, two * d, e)


def fused_state(k: torch.Tensor, v: torch.Tensor, opts: dict, shard=None) -> torch.Tensor:
    """The §3 state on the mean scale, kept as its two feature halves ``[S | z]``:
    (2, B, H, D, D+1) fp32, one pass over the key chunks.

    ``shard`` (context parallel, ``context_parallel.ShardGrid``): k, v are this rank's
    tokens; the state is divided by the whole grid's N and summed over the ranks."""
    b, h, n, d = k.shape
    with _no_autocast(k.device):
        s_acc = k.new_zeros(b * h, 2 * d, d, dtype=_acc(k))               # Σ φ_k vᵀ
        z_acc = k.new_zeros(b * h, 2 * d, dtype=_acc(k))                  # Σ φ_k
        tokens = _token_scales(k, opts, query=False, grad=False)
        chunks = _token_chunks(k.shape, k.device)
        scratch = _Scratch(k, chunks[0].stop, 2 * d)
        for sl in chunks:
            c = sl.stop - sl.start
            feat, = scratch(c)
            _key_lift(_rows(k, sl.start, c), _narrow(tokens, sl.start, c), opts, feat.halves)
            # [S | z] as one GEMM against [v | 1] costs more than S (D columns, the
            # GEMM's own width) and a token sum.
            s_acc.baddbmm_(feat.bh.mT, _rows(v, sl.start, c).flatten(0, 1))
            z_acc.add_(feat.bh.sum(1))
        state = k.new_empty(2, b, h, d, d + 1, dtype=_acc(k))
        state[..., :d] = s_acc.view(b, h, 2, d, d).permute(2, 0, 1, 3, 4)
        state[..., d] = z_acc.view(b, h, 2, d).permute(2, 0, 1, 3)
        if shard is None:
            return state.div_(n)
        return shard.all_reduce_(state.div_(shard.tokens))


def fused_output(q: torch.Tensor, state: torch.Tensor, opts: dict,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``o = φ_q(q)ᵀS / (φ_q(q)ᵀz + ε)`` from the state, one pass over the query chunks.

    Returns ``(out, den)`` in fp32: (B, H, N, D) and (B, H, N, 1). ``out`` may be given,
    any strides (e.g. a (B, N, H, D) buffer seen as (B, H, N, D), so the layer's token
    layout needs no copy)."""
    b, h, n, d = q.shape
    with _no_autocast(q.device):
        if out is None:
            out = q.new_empty(b, h, n, d, dtype=_acc(q))
        den = q.new_empty(b, h, n, 1, dtype=_acc(q))
        joined = _joined(state)                                           # (B·H, 2D, D+1)
        tokens = _token_scales(q, opts, query=True, grad=False)
        chunks = _token_chunks(q.shape, q.device)
        scratch = _Scratch(q, chunks[0].stop, 2 * d, d + 1)
        for sl in chunks:
            c = sl.stop - sl.start
            feat, num_den = scratch(c)
            _query_lift(_rows(q, sl.start, c), _narrow(tokens, sl.start, c), opts, feat.halves)
            _into(num_den.bh, torch.bmm, feat.bh, joined)
            num, den_c = num_den.halves
            den_c = _into(den.narrow(2, sl.start, c), torch.add, den_c, opts["eps"])
            _into(out.narrow(2, sl.start, c), torch.div, num, den_c)
        return out, den


def fused_backward(q, k, v, state, den, grad_out, opts, need=(True, True, True), out=(None, None, None),
                   shard=None):
    """∂L/∂(q, k, v) of the §3 linear form from the saved state and denominator, the
    features recomputed chunk by chunk. Returns (B, H, N, D) tensors, None where ``need``
    is False: fp32, or written into ``out`` (any strides and dtype; e.g. slices of the
    gradient of a fused qkv projection, so nothing is copied afterwards).

    ``den`` None: ``grad_out`` is a function ``(token slice, output chunk (B, H, C, D)) →
    its gradient``; the output and denominator are recomputed in the query pass (one small
    GEMM per chunk, the features are lifted there anyway), so a caller that saved neither
    gets the output's gradient chunk by chunk from what follows the attention.

    ``shard`` (context parallel): the state's gradient from this rank's queries is divided
    by the whole grid's N and all-reduced between the query pass and the key pass."""
    b, h, n, d = q.shape
    need_q, need_k, need_v = need
    new = lambda x, o: o if o is not None else torch.empty_like(x, dtype=_acc(x))
    with _no_autocast(q.device):
        joined = _joined(state)                                          # (B·H, 2D, D+1): [S | z]
        s_t, z = joined[..., :d].mT, joined[..., d].unsqueeze(1)         # (B·H, D, 2D), (B·H, 1, 2D)
        d_joined = q.new_zeros(b * h, 2 * d, d + 1, dtype=_acc(q))        # ∂L/∂[S | z], N times
        dq = new(q, out[0]) if need_q else None
        tokens = _token_scales(q, opts, query=True, grad=need_q)
        chunks = _token_chunks(q.shape, q.device)
        scratch = _Scratch(q, chunks[0].stop, 2 * d, 2 * d, d + 1)
        for sl in chunks:
            c = sl.stop - sl.start
            feat, d_feat, nd = scratch(c)          # features, their gradient, [∂L/∂num | ∂L/∂den]
            qc, t = _rows(q, sl.start, c), _narrow(tokens, sl.start, c)
            parts = _query_lift(qc, t, opts, feat.halves, keep=need_q)
            d_num, d_den = nd.halves
            if den is None:   # as fused_output, op for op
                num_den = torch.bmm(feat.bh, joined).view(b, h, c, d + 1)
                dd = torch.add(num_den[..., d:], opts["eps"])
                g_out = grad_out(sl, torch.div(num_den[..., :d], dd)).to(_acc(q))
            else:
                dd, g_out = den.narrow(2, sl.start, c), grad_out.narrow(2, sl.start, c)
            _into(d_num, torch.div, g_out, dd)
            # d_num Sᵀ, then ∂L/∂den = −Σ g·o/den with g·num = den·(φ_q · d_num Sᵀ).
            _into(d_feat.bh, torch.bmm, nd.bh[..., :d], s_t)
            _into(d_den, torch.div, (feat.x * d_feat.x).sum(-1, keepdim=True), dd).neg_()
            d_joined.baddbmm_(feat.bh.mT, nd.bh)
            if need_q:
                d_feat.bh.addcmul_(nd.bh[..., d:], z)                       # + ∂L/∂den zᵀ
                _query_grad(qc, feat.halves, d_feat.halves, t, parts, opts, dq.narrow(2, sl.start, c))
        if shard is None:
            d_joined.div_(n)
        else:   # the ranks reduce the state's halves (2, B, H, D, D+1)
            d_state = d_joined.view(b, h, 2, d, d + 1).permute(2, 0, 1, 3, 4).contiguous()
            d_joined = _joined(shard.all_reduce_(d_state.div_(shard.tokens)))
        dk = new(k, out[1]) if need_k else None
        dv = new(v, out[2]) if need_v else None
        if need_k or need_v:
            d_s, d_joined_t = d_joined[..., :d], d_joined.mT
            tokens = _token_scales(k, opts, query=False, grad=need_k)
            scratch.blocks[2][..., d] = 1.0                              # the third block is [v | 1] now
            dv_bh = None if dv is None else _bh(dv)
            for sl in chunks:
                c = sl.stop - sl.start
                feat, d_feat, v1 = scratch(c)
                kc, t = _rows(k, sl.start, c), _narrow(tokens, sl.start, c)
                parts = _key_lift(kc, t, opts, feat.halves, keep=need_k)
                if need_v:
                    if dv_bh is not None:
                        _into(dv_bh.narrow(1, sl.start, c), torch.bmm, feat.bh, d_s)
                    else:
                        dv[:, :, sl] = torch.bmm(feat.bh, d_s).view(b, h, c, d)
                if need_k:
                    v1.halves[0].copy_(v.narrow(2, sl.start, c))
                    _into(d_feat.bh, torch.bmm, v1.bh, d_joined_t)
                    _key_grad(kc, feat.halves, d_feat.halves, t, parts, opts, dk.narrow(2, sl.start, c))
    return dq, dk, dv


class _FusedNaLa(torch.autograd.Function):
    """§3 linear form in token chunks. The state is kept as its two halves
    ``[S | z]`` (each D × (D+1), one per feature half). The backward saves q, k, v, the
    state and the per-token denominator only, and recomputes the features."""

    @staticmethod
    def forward(ctx, q, k, v, opts, shard=None):
        state = fused_state(k, v, opts, shard)
        out, den = fused_output(q, state, opts)
        ctx.opts, ctx.shard = opts, shard
        ctx.save_for_backward(q, k, v, state, den)
        return out.to(v.dtype)

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiated
    def backward(ctx, grad_out):
        q, k, v, state, den = ctx.saved_tensors
        dq, dk, dv = fused_backward(q, k, v, state, den, grad_out, ctx.opts, ctx.needs_input_grad[:3],
                                    shard=ctx.shard)
        cast = lambda g, x: None if g is None else g.to(x.dtype)
        return cast(dq, q), cast(dk, k), cast(dv, v), None, None


class _FusedNaLaJvp(torch.autograd.Function):
    """``_FusedNaLa`` with a forward-mode rule, what the fused path runs under ``torch.func``
    transforms and forward AD (``tangent.under_transform``): the same passes and backward, and
    the tangent from ``tangent.nala_tangent`` (two linear passes in differentiable torch ops, so
    ``torch.func.jvp`` inside ``torch.func.grad`` works). A separate class: dynamo cannot trace an
    autograd function with a jvp rule, and ``_FusedNaLa`` stays in compiled graphs. Returns the
    output, state and denominator."""

    @staticmethod
    def forward(q, k, v, opts, shard=None):
        state = fused_state(k, v, opts, shard)
        out, den = fused_output(q, state, opts)
        return out.to(v.dtype), state, den

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.opts, ctx.shard = inputs
        _, state, den = output
        ctx.mark_non_differentiable(state, den)
        ctx.save_for_backward(q, k, v, state, den)
        ctx.save_for_forward(q, k, v)

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiated
    def backward(ctx, grad_out, _state, _den):
        if in_forward_mode(grad_out):
            raise ValueError(FORWARD_OVER_REVERSE_REFUSAL)
        return _FusedNaLa.backward(ctx, grad_out)

    @staticmethod
    def jvp(ctx, dq, dk, dv, _opts, _shard):
        q, k, v = ctx.saved_tensors
        return nala_tangent(q, k, v, (dq, dk, dv), ctx.opts, shard=ctx.shard,
                            chunks=_token_chunks(q.shape, q.device)), None, None


def fused_opts(config: NaLaConfig, head_dim: int) -> dict:
    """The §2 / §3 constants of ``config`` as the fused passes and the Triton kernels take
    them: plain floats, the norm scale resolved for ``head_dim`` (``NaLaConfig.norm_scale_for``)."""
    return dict(direction=config.direction, power=float(config.power), offset=float(config.offset),
                norm_scale=config.norm_scale_for(head_dim), alpha=float(config.alpha),
                norm_eps=float(config.norm_eps), eps=float(config.eps))
