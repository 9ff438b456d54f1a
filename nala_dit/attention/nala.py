"""``nala_attention``: NaLa in linear time, and the code path that runs it.

Top to bottom:

* the token chunking of the CPU path (``_token_chunks``);
* the chunk-wise feature lifts and their hand-written gradients (``_query_lift``,
  ``_key_lift``, ``_query_grad``, ``_key_grad``): the features are kept as their two
  cos/sin halves, never concatenated;
* ``_FusedNaLa``, the CPU autograd function that saves q, k, v, the small state
  ``[S | z]`` and the denominator only, and recomputes the features in backward;
* the readable unchunked composition (``impl="eager"``) and its ``torch.compile``;
* ``select_nala_impl`` (what ``impl="auto"`` runs per device) and ``nala_attention``;
* the first-use check of the Triton kernels on CUDA (``triton_passes_check``): once per
  (device, dtype, head dim, direction) against the eager path, falling back to it with one
  warning on an error or a mismatch; under ``torch.compile`` it runs while dynamo traces
  (``_traced_check``), and the kernels run as the custom op of ``triton_op.py``.

The Triton kernels are in ``triton_kernels.py``; the pure math and the N×N references they
are all tested against in ``functional.py``.
"""

from __future__ import annotations

import importlib.util
import math
import warnings

import torch
from torch.autograd.function import once_differentiable

from .config import TRITON_MAX_HEAD_DIM, TRITON_MAX_TOKENS
from .config import NaLaConfig
from .functional import _check_qkv, _no_autocast, nala_features, normalized_linear_attention
from .triton_op import nala_triton_attention

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


def fused_state(k: torch.Tensor, v: torch.Tensor, opts: dict, shard=None) -> torch.Tensor:
    """The §3 state on the mean scale, kept as its two feature halves ``[S | z]``:
    (2, B, H, D, D+1) fp32, one pass over the key chunks.

    ``shard`` (context parallel, ``context_parallel.ShardGrid``): k, v are this rank's
    tokens; the state is divided by the whole grid's N and summed over the ranks."""
    b, h, n, d = k.shape
    with _no_autocast(k.device):
        state = k.new_zeros(2, b, h, d, d + 1, dtype=torch.float32)
        for sl in _token_chunks(k.shape, k.device):
            phi_k = _key_lift(k[:, :, sl].float(), opts)[0]
            v1 = _with_ones(v[:, :, sl].float())                           # (B, H, C, D+1)
            for half, f in zip(state, phi_k):
                half.add_(f.transpose(-2, -1) @ v1)
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
            out = q.new_empty(b, h, n, d, dtype=torch.float32)
        den = q.new_empty(b, h, n, 1, dtype=torch.float32)
        for sl in _token_chunks(q.shape, q.device):
            f1, f2 = _query_lift(q[:, :, sl].float(), opts)[0]
            num_den = (f1 @ state[0]).add_(f2 @ state[1])                  # (B, H, C, D+1)
            torch.add(num_den[..., d:], opts["eps"], out=den[:, :, sl])
            torch.div(num_den[..., :d], den[:, :, sl], out=out[:, :, sl])
        return out, den


def fused_backward(q, k, v, state, den, grad_out, opts, need=(True, True, True), out=(None, None, None),
                   shard=None):
    """∂L/∂(q, k, v) of the §3 linear form from the saved state and denominator, the
    features recomputed chunk by chunk. Returns (B, H, N, D) tensors, None where ``need``
    is False: fp32, or written into ``out`` (any strides and dtype; e.g. slices of the
    gradient of a fused qkv projection, so nothing is copied afterwards).

    ``den`` None: ``grad_out`` is a function ``(token slice, output chunk (B, H, C, D)) →
    its gradient``; the output and denominator are recomputed in the query pass (two small
    GEMMs per chunk, the features are lifted there anyway), so a caller that saved neither
    gets the output's gradient chunk by chunk from what follows the attention.

    ``shard`` (context parallel): the state's gradient from this rank's queries is divided
    by the whole grid's N and all-reduced between the query pass and the key pass."""
    b, h, n, d = q.shape
    need_q, need_k, need_v = need
    new = lambda x, o: o if o is not None else torch.empty_like(x, dtype=torch.float32)
    with _no_autocast(q.device):
        s_t = state[..., :d].transpose(-2, -1)                           # (2, B, H, D, D)
        z = state[..., d].unsqueeze(-2)                                  # (2, B, H, 1, D)
        d_state = torch.zeros_like(state)
        dq = new(q, out[0]) if need_q else None
        for sl in _token_chunks(q.shape, q.device):
            qc = q[:, :, sl].float()
            phi_q, parts = _query_lift(qc, opts)
            if den is None:   # as fused_output, op for op
                num_den = (phi_q[0] @ state[0]).add_(phi_q[1] @ state[1])     # (B, H, C, D+1)
                dd = torch.add(num_den[..., d:], opts["eps"])
                g_out = grad_out(sl, torch.div(num_den[..., :d], dd))
            else:
                dd, g_out = den[:, :, sl], grad_out[:, :, sl]
            d_num = g_out.float() / dd                                   # (B, H, C, D)
            d_phi = [d_num @ s_t[0], d_num @ s_t[1]]                     # halves of ∂L/∂φ_q
            # ∂L/∂den = −Σ g·o/den, and g·num = den·(φ_q · d_num Sᵀ).
            dot = torch.addcmul(phi_q[0] * d_phi[0], phi_q[1], d_phi[1])
            d_den = dot.sum(-1, keepdim=True).div_(dd).neg_()
            d_nd = torch.cat([d_num, d_den], -1)
            for half, f in zip(d_state, phi_q):
                half.add_(f.transpose(-2, -1) @ d_nd)
            if need_q:
                for g, zh in zip(d_phi, z):
                    g.addcmul_(d_den, zh)
                dq[:, :, sl] = _query_grad(qc, phi_q, d_phi, parts, opts)
        if shard is None:
            d_state.div_(n)
        else:
            shard.all_reduce_(d_state.div_(shard.tokens))
        dk = new(k, out[1]) if need_k else None
        dv = new(v, out[2]) if need_v else None
        if need_k or need_v:
            for sl in _token_chunks(k.shape, k.device):
                kc = k[:, :, sl].float()
                phi_k, parts = _key_lift(kc, opts)
                if need_v:
                    dv[:, :, sl] = (phi_k[0] @ d_state[0, ..., :d]).add_(phi_k[1] @ d_state[1, ..., :d])
                if need_k:
                    v1 = _with_ones(v[:, :, sl].float())
                    d_phi = [v1 @ half.transpose(-2, -1) for half in d_state]
                    dk[:, :, sl] = _key_grad(kc, phi_k, d_phi, parts, opts)
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


def _nala_eager(q, k, v, config: NaLaConfig):
    """The readable composition: 2D-wide features, then the §3 linear form, autograd."""
    phi_q, phi_k = nala_features(q, k, config)
    return normalized_linear_attention(phi_q, phi_k, v, config.eps).to(v.dtype)


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
    config: NaLaConfig | None = None,
    *,
    impl: str = "auto",
    shard=None,
    **overrides,
) -> torch.Tensor:
    """Norm-aware linear attention (NaLa), linear in the number of tokens N.

    q, k, v: ``(B, H, N, D)``. Returns ``(B, H, N, D)`` in v's dtype; everything inside
    runs in fp32. No N×N tensor is ever formed. ``config`` (``NaLaConfig``) holds the
    direction map and the §2 / §3 constants; keyword ``overrides`` change single ones
    (``nala_attention(q, k, v, direction="relu_split", power=2.5)``). ``impl`` picks the
    code path, all with the same numbers up to fp32 rounding:

    * ``"auto"``: ``select_nala_impl`` for the tensors' device (fused on CPU, Triton on
      CUDA; the eager composition under ``torch.func.vmap``);
    * ``"fused"``: token-chunked features kept as their cos/sin halves (no
      concatenation; two GEMMs per product), ``[S | z]`` from the same GEMM, and a
      hand-written backward that saves only q, k, v, the small state and the
      denominator (features are recomputed);
    * ``"triton"``: the same algorithm as GPU kernels (``nala_dit/attention/triton_kernels.py``), the
      features computed in registers; under ``torch.compile`` as the custom op
      ``nala_dit::nala_triton`` (``triton_op.py``), so the graph does not break there;
    * ``"eager"``: the readable composition ``nala_features`` → §3, plain autograd;
    * ``"compile"``: ``torch.compile`` of the eager composition (opt-in; slow to build).

    ``shard`` (context parallel, ``context_parallel.ShardGrid``): q, k, v are this rank's
    tokens and the state is all-reduced over the ranks. The fused path keeps its passes;
    every other path runs the eager composition with the all-reduced state
    (``context_parallel.sharded_linear_attention``: the 2D-wide features are materialised).
    """
    _check_qkv(q, k, v)
    config = NaLaConfig.of(config, **overrides)
    if impl not in NALA_IMPLS:
        raise ValueError(f"impl must be one of {NALA_IMPLS}, got {impl!r}")
    opts = fused_opts(config, q.shape[-1])
    triton_opts = {k: v for k, v in opts.items() if k != "norm_scale"}   # the kernels take s apart
    if impl == "auto":
        impl = select_nala_impl(q.device.type, q.shape[-1], q.dtype, triton_available(), q.shape[-2])
        if torch._C._functorch.is_batchedtensor(q):  # under torch.func.vmap (compiled too): the fused and
            impl = "eager"                           # Triton autograd functions have no batching rule
        if shard is not None and impl != "fused":
            impl = "eager"
        if impl == "triton" and not _triton_usable(q, triton_opts):
            impl = "eager"
    if impl == "triton":
        if torch.compiler.is_compiling():   # the custom op: traced whole, no graph break
            return nala_triton_attention(q, k, v, opts["norm_scale"], triton_opts)
        return _triton_kernel(q, k, v, opts["norm_scale"], triton_opts)
    if shard is not None and impl != "fused":
        from .context_parallel import sharded_linear_attention

        phi_q, phi_k = nala_features(q, k, config)
        return sharded_linear_attention(phi_q, phi_k, v, shard, config.eps).to(v.dtype)
    if impl == "eager":
        return _nala_eager(q, k, v, config)
    if impl == "compile":
        return _nala_compiled(q, k, v, config)
    return _FusedNaLa.apply(q, k, v, opts, shard)


def fused_opts(config: NaLaConfig, head_dim: int) -> dict:
    """The §2 / §3 constants of ``config`` as the fused passes and the Triton kernels take
    them: plain floats, the norm scale resolved for ``head_dim`` (``NaLaConfig.norm_scale_for``)."""
    return dict(direction=config.direction, power=float(config.power), offset=float(config.offset),
                norm_scale=config.norm_scale_for(head_dim), alpha=float(config.alpha),
                norm_eps=float(config.norm_eps), eps=float(config.eps))


# ------------------------------------------------------------- first-use check (CUDA)
# The Triton kernels are compiled for the GPU at hand on first use, so a compiler or driver
# problem, or a wrong result on an untested architecture, only shows there. ``impl="auto"``
# therefore runs them once per (device, dtype, head dim, direction) on a small input against
# the unchunked composition, and on an error or a mismatch falls back to that composition
# for the rest of the process, with one warning. ``_triton_kernel`` is looked up at call
# time, so tests inject a failing or a wrong kernel on a CPU.

CHECK_TOKENS = 67                         # odd: a partial token block in every kernel
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}   # relative RMS
REPORT = ("please report it with the output of benchmarks/gpu_check.sh at the nala_dit issue "
          "tracker (GitHub issues)")
_TRITON_CHECKS: dict[tuple, str | None] = {}   # key → None (passed) or the cause of the fallback


def _triton_kernel(q, k, v, norm_scale, opts):
    from .triton_kernels import nala_attention_triton

    return nala_attention_triton(q, k, v, norm_scale, opts)


def _triton_usable(q: torch.Tensor, opts: dict) -> bool:
    """``triton_passes_check`` for q's key. Under ``torch.compile`` the check runs while
    dynamo traces (``_traced_check``: a constant of the graph, so the trace has no break),
    on real tensors, once per key and process as in eager mode; a head dim that the
    compiler keeps symbolic (``dynamic=True``) has no key to check, and takes the eager
    composition."""
    if not torch.compiler.is_compiling():
        return triton_passes_check(q.device, q.dtype, q.shape[-1], opts)
    head_dim = q.shape[-1]
    if not isinstance(head_dim, int) or isinstance(head_dim, torch.SymInt):
        return False
    return _traced_check(q.device, q.dtype, head_dim, opts["direction"])


@torch._dynamo.assume_constant_result
def _traced_check(device, dtype, head_dim, direction) -> bool:
    """dynamo runs this at trace time (not traced into) and keeps its result as a constant.
    Its arguments must be constants, so the check runs with the default §2 constants of
    ``direction`` (the cache key has none of them; ``dynamic=True`` makes the layer's
    floats symbolic)."""
    opts = {k: v for k, v in fused_opts(NaLaConfig(direction=direction), head_dim).items() if k != "norm_scale"}
    return triton_passes_check(device, dtype, head_dim, opts)


@torch.compiler.disable
def triton_passes_check(device: torch.device, dtype: torch.dtype, head_dim: int, opts: dict) -> bool:
    """Whether the Triton kernels passed their first-use check for this key (run once, cached)."""
    key = (str(device), dtype, head_dim, opts["direction"])
    if key not in _TRITON_CHECKS:
        _TRITON_CHECKS[key] = cause = _check_triton(device, dtype, head_dim, opts)
        if cause is not None:
            warnings.warn(f"NaLa: the Triton kernels failed their first-use check on {device} ({dtype}, head dim "
                          f"{head_dim}, {opts['direction']}): {cause}; using impl='eager' for the rest of this "
                          f"process; {REPORT}", RuntimeWarning, stacklevel=3)
    return _TRITON_CHECKS[key] is None


def _check_triton(device, dtype, head_dim, opts) -> str | None:
    """Outputs and gradients of ``_triton_kernel`` against ``_nala_eager`` on a seeded
    (1, 2, 67, head_dim) input; None when they agree, else the cause in a few words."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, CHECK_TOKENS, head_dim, generator=g).to(device, dtype) for _ in range(4))
    tol = CHECK_TOLERANCE.get(dtype, 1e-4)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad(), _no_autocast(device):
            out = fn(*leaves, 1.0, opts)
            out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    try:
        got_all = run(_triton_kernel)
    except Exception as err:  # a compile or launch error: whatever the kernels raise
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return f"{type(err).__name__}: {first}"
    ref_all = run(_nala_eager_opts)
    for name, got, ref in zip(("output", "dq", "dk", "dv"), got_all, ref_all):
        if got is None:
            return f"no gradient {name} from the kernels"
        ref, got = ref.double(), got.double()
        err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if not err <= tol:   # also catches NaN
            return f"{name} differs from the eager path by relative RMS {err:.1e} (> {tol:.0e})"
    return None


def _nala_eager_opts(q, k, v, norm_scale, opts):
    return _nala_eager(q, k, v, NaLaConfig(**opts, norm_scale=norm_scale))
