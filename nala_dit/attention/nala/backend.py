"""``nala_attention``: which of NaLa's paths runs, and the first-use check of the Triton path.

* the readable unchunked composition (``impl="eager"``);
* ``select_nala_impl`` (what ``impl="auto"`` runs per device), ``backend`` (that choice with
  the first-use check folded in: what ``nala_attention`` and the gated layer run) and
  ``nala_attention``;
* the first-use check of the Triton kernels on CUDA (``triton_passes_check``): once per
  (device, dtype, head dim, direction) against the eager path, falling back to it with one
  warning on an error or a mismatch; under ``torch.compile`` it runs while dynamo traces
  (``_traced_check``), and the kernels run as the custom op of ``triton_op.py``.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from ..config import TRITON_MAX_HEAD_DIM, TRITON_MAX_TOKENS
from ..config import NaLaConfig
from ..functional import _check_qkv, _no_autocast, nala_features, normalized_linear_attention
from .fused import _FusedNaLa, _FusedNaLaJvp, fused_opts
from .tangent import CONTEXT_PARALLEL_REFUSAL, triton_jvp_attention, under_transform
from .triton_op import nala_triton_attention

NALA_IMPLS = ("auto", "fused", "eager", "triton")


def _nala_eager(q, k, v, config: NaLaConfig):
    """The readable composition: 2D-wide features, then the §3 linear form, autograd."""
    phi_q, phi_k = nala_features(q, k, config)
    return normalized_linear_attention(phi_q, phi_k, v, config.eps).to(v.dtype)


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

    * ``"auto"``: ``backend``'s choice for the device (fused on CPU, Triton on CUDA);
    * ``"fused"``: the CPU path (``fused.py``: token chunks, a hand-written backward);
    * ``"triton"``: the GPU kernels (``triton/``; compiled: the custom op of ``triton_op.py``);
    * ``"eager"``: the readable composition ``nala_features`` → §3, plain autograd (also
      what runs under ``torch.func.vmap``).

    ``shard`` (context parallel, ``context_parallel.ShardGrid``): q, k, v are this rank's
    tokens and the state is all-reduced over the ranks. The fused path keeps its passes;
    every other path runs the eager composition with the all-reduced state
    (``context_parallel.sharded_linear_attention``: the 2D-wide features are materialised).
    """
    _check_qkv(q, k, v)
    config = NaLaConfig.of(config, **overrides)
    if impl not in NALA_IMPLS:
        raise ValueError(f"impl must be one of {NALA_IMPLS}, got {impl!r}")
    opts, triton_opts = fused_opts(config, q.shape[-1]), kernel_opts(config, q.shape[-1])
    if torch._C._functorch.is_batchedtensor(q) and impl in ("auto", "fused", "triton"):
        impl = "eager"   # under torch.func.vmap (compiled too): the autograd functions have no batching rule
    impl = backend(q.device, q.dtype, q.shape[-1], q.shape[-2], triton_opts, impl)
    if shard is not None and under_transform(q, k, v):
        raise ValueError(CONTEXT_PARALLEL_REFUSAL)
    if shard is not None and impl != "fused":
        from ..context_parallel import sharded_linear_attention

        phi_q, phi_k = nala_features(q, k, config)
        return sharded_linear_attention(phi_q, phi_k, v, shard, config.eps).to(v.dtype)
    if impl == "triton":   # compiled: the custom op, traced whole; torch.func / forward AD: with a forward-mode rule
        kernel = (nala_triton_attention if torch.compiler.is_compiling()
                  else triton_jvp_attention if under_transform(q, k, v) else _triton_kernel)
        return kernel(q, k, v, opts["norm_scale"], triton_opts)
    if impl == "eager":
        return _nala_eager(q, k, v, config)
    if under_transform(q, k, v):   # torch.func / forward AD: the fused passes with a forward-mode rule
        return _FusedNaLaJvp.apply(q, k, v, opts, shard)[0]
    return _FusedNaLa.apply(q, k, v, opts, shard)


def backend(device: torch.device, dtype: torch.dtype, head_dim: int, num_tokens: int, opts: dict,
            impl: str = "auto") -> str:
    """The path (``eager``, ``fused``, ``triton``) that ``impl`` names for inputs of this
    device, dtype, head dim and token count: ``impl`` itself unless "auto"; else
    ``select_nala_impl``'s choice, where "triton" stands only if the kernels passed their
    first-use check for this key (``triton_passes_check``), else "eager" (warned once).
    ``opts``: the kernels' options (``kernel_opts``). The one choice both
    ``nala_attention`` (per call) and the gated layer (once per device, dtype and length
    class, ``layers.GatedLinearAttention.backend``) make.

    Under ``torch.compile`` the check runs while dynamo traces (``_traced_check``: a constant
    of the graph, so the trace has no break), on real tensors, once per key and process as
    in eager mode; a head dim that the compiler keeps symbolic (``dynamic=True``) has no key
    to check, and takes the eager composition."""
    if impl != "auto":
        return impl
    impl = select_nala_impl(device.type, head_dim, dtype, triton_available(), num_tokens)
    if impl != "triton":
        return impl
    if not torch.compiler.is_compiling():
        usable = triton_passes_check(device, dtype, head_dim, opts)
    else:
        usable = (isinstance(head_dim, int) and not isinstance(head_dim, torch.SymInt)
                  and _traced_check(device, dtype, head_dim, opts["direction"]))
    return "triton" if usable else "eager"


# ------------------------------------------------------------- first-use check (CUDA)
# The Triton kernels are compiled for the GPU at hand on first use, so a compiler or driver
# problem, or a wrong result on an untested architecture, only shows there. ``impl="auto"``
# therefore runs them once per (device, dtype, head dim, direction) on a small input against
# the unchunked composition, and on an error or a mismatch falls back to that composition
# for the rest of the process, with one warning. ``_triton_kernel`` is looked up at call
# time, so tests inject a failing or a wrong kernel on a CPU.

# The check's inputs, (tokens, token ranges of the state passes): one range (the
# single-launch forward, as N < 1,024 runs on a GPU) and several (the atomic state passes
# and the output kernel, as N ≥ 1,024 runs), the token counts odd (a partial block in every
# kernel). A gated layer's strided specialisations are checked by ``layers._check_gated``.
CHECK_CASES = ((67, None), (1031, 3))
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}   # relative RMS
REPORT = ("please report it with the output of benchmarks/gpu_check.sh at the nala_dit issue "
          "tracker (GitHub issues)")
_TRITON_CHECKS: dict[tuple, str | None] = {}   # key → None (passed) or the cause of the fallback
CHECK_ERRORS: dict[tuple, float] = {}           # key → the largest relative RMS vs eager the check saw


def _triton_kernel(q, k, v, norm_scale, opts, splits=None):
    from .triton.launch import nala_attention_triton

    return nala_attention_triton(q, k, v, norm_scale, opts, splits=splits)


def device_usable(device: torch.device) -> bool:
    """Whether ``device`` still runs work: False after a sticky CUDA fault (an illegal
    address, a launch failure), after which every later CUDA call in the process fails."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:  # noqa: BLE001  (whatever the broken context raises)
        return False


def kernel_opts(config: NaLaConfig, head_dim: int) -> dict:
    """The Triton kernels' options: ``fused_opts`` less the norm scale, which they take apart."""
    return {k: v for k, v in fused_opts(config, head_dim).items() if k != "norm_scale"}


def kernel_error(device: torch.device, what: str, err: BaseException) -> str:
    """The kernel error ``err`` of a first-use check as a one-line cause; after a sticky CUDA
    fault, where the eager fallback would die too, the process ends with one line naming ``what``."""
    cause = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
    if not device_usable(device):
        raise SystemExit(f"NaLa: {what} left a sticky CUDA fault on {device} ({cause}); no later CUDA call in this "
                         f"process can run, the eager fallback included: stopping; {REPORT}")
    return cause


def relative_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got − ref‖ / ‖ref‖ in float64; NaN stays NaN (``not err <= tol`` catches it)."""
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_once(checks: dict, key: tuple, check, what: str, fallback: str) -> bool:
    """Whether ``check()`` (None, or the cause of a fallback) passed for ``key``: run once per
    process into ``checks`` (the key reads as passed meanwhile: the gated check runs a layer on
    the path it checks); a failure warns once: ``what`` failed, the cause, the ``fallback``."""
    if key not in checks:
        checks[key] = None
        checks[key] = cause = check()
        if cause is not None:
            warnings.warn(f"NaLa: {what}: {cause}; {fallback} for the rest of this "
                          f"process; {REPORT}", RuntimeWarning, stacklevel=3)
    return checks[key] is None


@torch._dynamo.assume_constant_result
def _traced_check(device, dtype, head_dim, direction) -> bool:
    """dynamo runs this at trace time (not traced into) and keeps its result as a constant.
    Its arguments must be constants, so the check runs with the default §2 constants of
    ``direction`` (the cache key has none of them; ``dynamic=True`` makes the layer's
    floats symbolic)."""
    return triton_passes_check(device, dtype, head_dim, kernel_opts(NaLaConfig(direction=direction), head_dim))


@torch.compiler.disable
def triton_passes_check(device: torch.device, dtype: torch.dtype, head_dim: int, opts: dict) -> bool:
    """Whether the Triton kernels passed their first-use check for this key (run once, cached)."""
    return check_once(_TRITON_CHECKS, (str(device), dtype, head_dim, opts["direction"]),
                      lambda: _check_triton(device, dtype, head_dim, opts),
                      f"the Triton kernels failed their first-use check on {device} ({dtype}, head dim {head_dim}, "
                      f"{opts['direction']})",
                      "using impl='eager'")


def _check_triton(device, dtype, head_dim, opts) -> str | None:
    """Outputs and gradients of ``_triton_kernel`` against ``_nala_eager`` on seeded
    (1, 2, N, head_dim) inputs, one per ``CHECK_CASES`` entry; None when every relative RMS
    is within ``CHECK_TOLERANCE`` (the largest is kept in ``CHECK_ERRORS``), else the cause
    in a few words. A kernel error that leaves the device unusable ends the process
    (``kernel_error``)."""
    key = (str(device), dtype, head_dim, opts["direction"])
    tol = CHECK_TOLERANCE.get(dtype, 1e-4)
    worst = 0.0
    for n, splits in CHECK_CASES:
        g = torch.Generator().manual_seed(n)
        q, k, v, grad = (torch.randn(1, 2, n, head_dim, generator=g).to(device, dtype) for _ in range(4))

        def run(fn, *extra):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad(), _no_autocast(device):
                out = fn(*leaves, 1.0, opts, *extra)
                out.backward(grad)
            if device.type == "cuda":
                torch.cuda.synchronize(device)   # a kernel's fault shows here, inside the check
            return [out.detach()] + [t.grad for t in leaves]

        ranges = "one token range" if splits is None else f"{splits} token ranges"
        try:
            got_all = run(_triton_kernel, splits)
        except Exception as err:  # a compile or launch error: whatever the kernels raise
            return kernel_error(device, f"the NaLa kernels' first-use check (N = {n}, {ranges}, {dtype}, head dim "
                                        f"{head_dim}, {opts['direction']})", err)
        ref_all = run(_nala_eager_opts)
        for name, got, ref in zip(("output", "dq", "dk", "dv"), got_all, ref_all):
            if got is None:
                return f"no gradient {name} from the kernels"
            err = relative_rms(got, ref)
            if not err <= tol:   # also catches NaN
                return f"{name} differs from the eager path by relative RMS {err:.1e} (> {tol:.0e}) at N = {n}"
            worst = max(worst, err)
        CHECK_ERRORS[key] = worst
    return None


def _nala_eager_opts(q, k, v, norm_scale, opts):
    return _nala_eager(q, k, v, NaLaConfig(**opts, norm_scale=norm_scale))
