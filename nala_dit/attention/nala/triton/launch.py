"""NaLa's Triton path: launch configs, grids, the launches, and the autograd function
``TritonNaLa``. How the kernels work (passes, tiles, precision, why these configs):
``README.md`` beside this file; the kernels are ``forward.py`` and ``backward.py``."""

from __future__ import annotations

import torch
import triton
from torch.autograd.function import once_differentiable

from ...config import TRITON_MAX_HEAD_DIM as MAX_HEAD_DIM, TRITON_MAX_TOKENS
from .backward import _dkv_kernel, _dq_kernel
from .forward import _forward_kernel, _output_kernel, _state_kernel


def unsupported_reason(q: torch.Tensor) -> str | None:
    """Why these kernels cannot take ``q`` (None when they can)."""
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (fp32, bf16 or fp16 only)"
    if q.shape[-2] > TRITON_MAX_TOKENS:  # token blocks of 16 run on grid axis 1 (≤ 65535)
        return f"N = {q.shape[-2]} tokens (at most {TRITON_MAX_TOKENS})"
    return None


# --------------------------------------------------------------------------- launcher

# Whether triton.jit built interpreter objects (TRITON_INTERPRET=1 at import time).
INTERPRETED = "Interpreted" in type(_output_kernel).__name__


# Launch configurations, one per kind of kernel: the single-launch forward ("forward"), the
# state passes ("state": forward and backward), the output ("out"), dq ("dq") and dk/dv
# ("dkv"). Each entry (BLOCK_N, num_warps, num_stages, maxnreg); num_stages None: Triton's
# default (3), maxnreg None: no register cap. Chosen by the compile report (README.md,
# "Launch configs"); the figures per kernel are in benchmarks/results/triton_launches_sm90.json.
KINDS = ("forward", "state", "out", "dq", "dkv")
_CONFIGS = dict(forward=(16, 4, None, None), state=(16, 4, None, None), out=(64, 8, None, 128),
                dq=(64, 8, None, 128), dkv=(64, 8, 1, 128))
# Feature lanes per chunk of the output, dq and dkv kernels (BC): 16 on a GPU (registers).
SPLIT_CHUNK = 16
# Under the interpreter (no registers; its time goes by block operations): chunks of BA lanes
# and 64 tokens per state block (README.md, "Launch configs").
INTERPRETER_STATE_TOKENS = 64


def split_tiles(head_dim: int) -> tuple[int, int]:
    """(BA, BB): the head dim as two tiles, lanes [0, BA) and [BA, BA + BB), both powers of
    two ≥ 16 (what tl.dot needs), BA ≥ BB, BA + BB ≥ D with the fewest padded lanes: 72 →
    (64, 16), 64 → (32, 32), 128 → (64, 64), D ≤ 32 → (16, 16)."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} outside [1, {MAX_HEAD_DIM}]")
    tiles = [(ba, bb) for ba in (16, 32, 64) for bb in (16, 32, 64) if bb <= ba and ba + bb >= head_dim]
    return min(tiles, key=sum)


def launch_config(head_dim: int, override: dict | None = None) -> dict:
    """Launch configuration per kind of kernel (``KINDS``) for a head dim: its tiles (BA, BB;
    ``split_tiles``), then ``_CONFIGS`` (one program covers every value lane: NV = 1; feature
    chunks of BC, ``SPLIT_CHUNK``). ``override``: its BLOCK_N and num_warps replace every
    kind's values (block-size sweeps), with Triton's default stages and no register cap; its
    BC the chunk; any other key is ignored."""
    override = dict(override or {})
    ba, bb = split_tiles(head_dim)
    chunk = override.pop("BC", None) or (max(SPLIT_CHUNK, ba) if INTERPRETED else SPLIT_CHUNK)
    override = {k: v for k, v in override.items() if k in ("BLOCK_N", "num_warps")}
    cfg = dict(BA=ba, BB=bb)
    for kind in KINDS:
        block_n, warps, stages, maxnreg = _CONFIGS[kind]
        if INTERPRETED and kind in ("forward", "state"):
            block_n = max(block_n, INTERPRETER_STATE_TOKENS)
        sub = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages, maxnreg=maxnreg)
        if override:
            sub.update(override, num_stages=None, maxnreg=None)
        sub["NV"] = 1
        if kind != "state":
            sub["BC"] = chunk
        cfg[kind] = sub
    return cfg


def _compile_opts(sub: dict) -> dict:
    """A kind's launch options: num_warps, and num_stages / maxnreg where set."""
    return dict(num_warps=sub["num_warps"], **{k: sub[k] for k in ("num_stages", "maxnreg") if sub.get(k)})


# Fewest tokens per range of the state passes: ranges add into one state, so a range can
# be one token block (64): N = 1,024 gives 16 ranges per head, B·H·16 programs (H = 16: 256).
MIN_SPLIT_TOKENS = 64
# Below this many tokens the forward is one launch (state + output in one program per
# head) whatever the GPU's size: the call is launch-bound there.
SHORT_TOKENS = 1024


def _programs_target(device: torch.device) -> int:
    """How many programs the state passes aim for: about 4 per SM on CUDA; 1 elsewhere (the
    interpreter runs programs one after another: fewest is fastest). The compile report's
    stand-in driver sets it for the GPU it compiles for."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def num_splits(n_tokens: int, n_heads_total: int, n_vtiles: int, device: torch.device) -> int:
    """Token ranges per head for the two state passes: enough programs to fill the GPU
    (about 4 per SM; B·H alone is often a few dozen), no range under MIN_SPLIT_TOKENS;
    one range (the single-launch forward) below SHORT_TOKENS."""
    target = _programs_target(device)
    if n_tokens < SHORT_TOKENS:
        return 1
    want = -(-target // (n_heads_total * n_vtiles))
    return max(1, min(want, n_tokens // MIN_SPLIT_TOKENS))


def fit_splits(splits: int, n: int, *tensors: torch.Tensor) -> int:
    """``splits`` raised where needed so that no token range spans 2^30 elements of any
    tensor's token stride: the state passes offset each range's base in int64 and the
    tokens within it in int32 (a gated layer's stride 4C passes 2^31 at N·4C, at XL/2's
    C = 1,152 from 466K tokens); one range is also what picks the single-launch forward,
    whose offsets are int32."""
    stride = max(max(abs(t.stride(-2)), t.shape[-1]) for t in tensors)
    return max(splits, triton.cdiv(n * stride, 2**30))


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())


# Every kernel a launch runs, by kind. Launches look the kernel up here when they run, so a
# test can wrap an entry.
KERNELS = dict(state=_state_kernel, forward=_forward_kernel, output=_output_kernel, dq=_dq_kernel, dkv=_dkv_kernel)


def _kernel_for(kind: str, cfg: dict):
    """The kernel of ``kind`` (a key of ``KERNELS``); ``cfg`` (``launch_config``'s) picks none."""
    return KERNELS[kind]


def _tile_args(cfg: dict, group: str, nv: bool = False, keep: bool = False) -> dict:
    """The constexprs that shape a kernel of ``group`` (a kind): its tiles BA, BB, its
    feature chunk BC (where it takes chunks) and KEEP (``keep``: the features kept, stored
    by the forward kernels and read by the backward ones; off by default, as the compile
    report's per-head-dim rows compile them). ``nv`` is for the compile report's calls: no
    kernel takes NV."""
    return dict(BA=cfg["BA"], BB=cfg["BB"], **({"BC": cfg[group]["BC"]} if "BC" in cfg[group] else {}), KEEP=keep)


def _ranges(n: int, splits: int, block_n: int) -> tuple[int, int]:
    """(tokens per range, ranges) of a state pass asked for ``splits`` ranges: whole blocks each."""
    per_split = triton.cdiv(triton.cdiv(n, splits), block_n) * block_n
    return per_split, triton.cdiv(n, per_split)


def launch_grids(b: int, h: int, n: int, cfg: dict, splits: int) -> dict[str, tuple]:
    """The grid of each NaLa kernel for (B, H, N) heads, ``launch_config``'s ``cfg`` and
    ``splits`` token ranges, as the launches use them: ``forward`` (the single launch, where
    it runs), ``state`` (both state passes), ``output``, ``dq``, ``dkv``. Axes after the first
    stay within CUDA's 65,535 up to ``TRITON_MAX_TOKENS`` (token blocks of ≥ 16)."""
    grids = dict(state=(b * h, _ranges(n, splits, cfg["state"]["BLOCK_N"])[1]),
                 output=(b * h, triton.cdiv(n, cfg["out"]["BLOCK_N"])),
                 dq=(b * h, triton.cdiv(n, cfg["dq"]["BLOCK_N"])), dkv=(b * h, triton.cdiv(n, cfg["dkv"]["BLOCK_N"])))
    if splits == 1:
        grids["forward"] = (b * h,)
    return grids


def atomic_state(n: int, splits: int, cfg: dict) -> bool:
    """Whether the state passes add several token ranges into a zeroed buffer."""
    return _ranges(n, splits, cfg["state"]["BLOCK_N"])[1] > 1


def state_numel(b: int, h: int, d: int) -> int:
    """fp32 numbers of one state pass's buffer: ``[S | z]`` halves of every head."""
    return b * h * 2 * d * (d + 1)


def _state_pass(x, w, scale, opts, cfg, splits, query, den=None, d_den=None, zeroed=None,
                features=None):
    """Launch the state kernel over ``splits`` token ranges, which add their sums atomically
    into one zeroed state (one range writes it). Returns ``(S, z)``: (B·H, 2, D, D) and
    (B·H, 2, D), fp32, means over the N tokens. ``zeroed``: a buffer of ``state_numel``
    that an earlier launch zeroed (the gated layer's epilogue kernels), else one is zeroed here.
    ``features``: φ of x's tokens, (B·H, N, 2D), written (keys) or read (queries)."""
    b, h, n, d = x.shape
    st = cfg["state"]
    block_n = st["BLOCK_N"]
    per_split, splits = _ranges(n, splits, block_n)                     # whole blocks
    atomic = splits > 1
    # One buffer holds both, S then z, each contiguous: zeroed (one launch) where ranges add.
    buf = (x.new_empty(state_numel(b, h, d), dtype=torch.float32) if not atomic else
           zeroed if zeroed is not None else x.new_zeros(state_numel(b, h, d), dtype=torch.float32))
    s_part = buf[:b * h * 2 * d * d].view(b * h, 2, d, d)
    z_part = buf[b * h * 2 * d * d:].view(b * h, 2, d)
    _kernel_for("state", cfg)[(b * h, splits)](   # launch_grids' "state"
        x, w, scale, s_part, z_part, *_strides(x), *_strides(w),
        h, n, d, per_split, splits, 1.0 / n,
        opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"],
        QUERY=query, COSINE=opts["direction"] == "cosine",
        BLOCK_N=block_n, **_tile_args(cfg, "state", keep=features is not None), PREC=opts["precision"],
        DEN=den, DDEN=d_den, ATOMIC=atomic, F=features, **_compile_opts(st),
    )
    return s_part, z_part


def forward_launch(q, k, v, scale32, opts: dict, cfg: dict, splits: int, out: torch.Tensor,
                   features: tuple[torch.Tensor, torch.Tensor] | None = None, zeroed=None):
    """The forward's launches: ``out`` (B, H, N, D), any strides (a gated layer passes its
    token-layout buffer), gets NaLa's output. Returns what the backward needs: the state
    ``(S, z)`` and the denominator, fp32. ``features``: buffers (φ_q, φ_k) of
    ``feature_buffers`` that the kernels fill (kept for the backward), or None; ``zeroed``:
    as ``_state_pass``'s."""
    b, h, n, d = q.shape
    den = torch.empty(b * h, n, device=q.device, dtype=torch.float32)
    cosine = opts["direction"] == "cosine"
    phi_q, phi_k = features if features is not None else (None, None)
    if splits == 1:
        # One launch: state and output per head; the state kept for the backward.
        state = torch.empty(b * h, 2, d, d, device=q.device, dtype=torch.float32)
        z = torch.empty(b * h, 2, d, device=q.device, dtype=torch.float32)
        fc = cfg["forward"]
        _kernel_for("forward", cfg)[launch_grids(b, h, n, cfg, splits)["forward"]](
            k, v, q, scale32, state, z, out, den, *_strides(k), *_strides(v), *_strides(q), *_strides(out),
            h, n, d, 1.0 / n, opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"], opts["eps"],
            COSINE=cosine, BLOCK_N=fc["BLOCK_N"], **_tile_args(cfg, "forward", keep=features is not None),
            PREC=opts["precision"], BLOCK_O=cfg["out"]["BLOCK_N"], FQ=phi_q, FK=phi_k, **_compile_opts(fc),
        )
        return state, z, den
    state, z = _state_pass(k, v, scale32, opts, cfg, splits, query=False, features=phi_k, zeroed=zeroed)
    oc = cfg["out"]
    _kernel_for("output", cfg)[launch_grids(b, h, n, cfg, splits)["output"]](
        q, scale32, state, z, out, den, *_strides(q), *_strides(out), h, n, d,
        opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"], opts["eps"],
        COSINE=cosine, BLOCK_N=oc["BLOCK_N"], **_tile_args(cfg, "out", keep=features is not None),
        PREC=opts["precision"], F=phi_q, **_compile_opts(oc),
    )
    return state, z, den


def backward_launch(q, k, v, scale32, state, z, den, grad_out, opts: dict, cfg: dict, splits: int,
                    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, need_scale: bool = False,
                    add_dv: bool = False, features: tuple[torch.Tensor, torch.Tensor] | None = None,
                    zeroed=None):
    """The backward's launches into ``dq``, ``dk``, ``dv`` (B, H, N, D), any strides; with
    ``add_dv`` ∂L/∂v is added to what ``dv`` holds. Returns ∂L/∂s per token, (B·H, N), when
    ``need_scale``, else None. ``features``: the forward's (φ_q, φ_k), read instead of
    computed (only the chain rule's parts are), or None (recomputed)."""
    b, h, n, d = q.shape
    phi_q, phi_k = features if features is not None else (None, None)
    keep = features is not None
    cosine = opts["direction"] == "cosine"
    d_den = torch.empty(b * h, n, device=q.device, dtype=torch.float32)
    d_u = torch.empty(b * h, n, device=q.device, dtype=torch.float32) if need_scale else d_den
    dqc, dkvc = cfg["dq"], cfg["dkv"]
    grids = launch_grids(b, h, n, cfg, splits)
    _kernel_for("dq", cfg)[grids["dq"]](
        q, grad_out, scale32, state, z, den, dq, d_den, d_u,
        *_strides(q), *_strides(grad_out), *_strides(dq), h, n, d,
        opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"],
        COSINE=cosine, BLOCK_N=dqc["BLOCK_N"], **_tile_args(cfg, "dq", keep=keep),
        PREC=opts["precision"], NEED_DU=need_scale, DQ_STRIDED=not dq.is_contiguous(), F=phi_q,
        **_compile_opts(dqc),
    )
    d_state, d_z = _state_pass(q, grad_out, scale32, opts, cfg, splits, query=True, den=den, d_den=d_den,
                               features=phi_q, zeroed=zeroed)
    _kernel_for("dkv", cfg)[grids["dkv"]](
        k, v, d_state, d_z, dk, dv, *_strides(k), *_strides(v), *_strides(dk), *_strides(dv), h, n, d,
        opts["power"], opts["alpha"], opts["norm_eps"],
        COSINE=cosine, BLOCK_N=dkvc["BLOCK_N"], **_tile_args(cfg, "dkv", keep=keep),
        PREC=opts["precision"], ADD_DV=add_dv, F=phi_k, **_compile_opts(dkvc),
    )
    return d_u if need_scale else None


# Products whose operands are bf16 (bf16 and fp16 inputs; "bf16_exact" is the interpreter's
# form): the features enter every product as bf16, so a bf16 copy of them is all the
# products need. Kept, they cost 2 · 2D · 2 B per token and head (XL/2, 256 px, batch 32:
# 2.0 GiB per step) and save the backward's 6 of 8 evaluations of φ; switch them off
# (opts["keep_features"] = False) where activation memory limits the batch: README.md,
# "Kept features".
HALF_PRECISIONS = ("bf16", "bf16_exact")


def keeps_features(opts: dict) -> bool:
    """Whether a call with these (resolved) options keeps the features: ``keep_features``
    (default True) and bf16 products. See README.md, "Kept features"."""
    return bool(opts.get("keep_features", True)) and opts["precision"] in HALF_PRECISIONS


def feature_buffers(q: torch.Tensor, opts: dict, backward: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(φ_q, φ_k) buffers, (B·H, N, 2D) bf16 each (halves [cos | sin]), where the call keeps
    the features (``keeps_features``) and a backward will run (``backward``: a call without
    gradients writes none; under ``torch.no_grad`` the callers switch ``keep_features``
    off), else None. bf16 for fp16 inputs too: φ_k =
    |k|^λ·(…) passes fp16's range at |k| > 40 (λ = 3), and the products round φ to bf16 anyway."""
    if not (backward and keeps_features(opts)):
        return None
    b, h, n, d = q.shape
    return tuple(torch.empty(b * h, n, 2 * d, device=q.device, dtype=torch.bfloat16) for _ in range(2))


class TritonNaLa(torch.autograd.Function):
    """``nala_attention`` on the Triton kernels above (same contract as
    ``nala/fused.py``'s ``_FusedNaLa``). ``scale`` is the norm scale s as an fp32 (H,) tensor; its
    gradient is returned when it requires one (a learned per-head s)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, opts, splits=None, config=None):
        b, h, n, d = q.shape
        cfg = launch_config(d, config)
        if splits is None:
            splits = num_splits(n, b * h, cfg["state"]["NV"], q.device)
        splits = fit_splits(splits, n, q, k, v)
        scale32 = scale.detach().to(device=q.device, dtype=torch.float32).contiguous()
        out = torch.empty(b, h, n, d, device=q.device, dtype=v.dtype)
        # (a plain context, the custom op's or the forward-mode path's, keeps none: see README.md)
        features = feature_buffers(q, opts, any(getattr(ctx, "needs_input_grad", (False,))[:4]))
        state, z, den = forward_launch(q, k, v, scale32, opts, cfg, splits, out, features)
        ctx.opts, ctx.cfg, ctx.splits = opts, cfg, splits
        ctx.scale_shape = scale.shape
        ctx.save_for_backward(q, k, v, scale32, state, z, den, *(features or ()))
        return out

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable
    def backward(ctx, grad_out):
        q, k, v, scale32, state, z, den, *features = ctx.saved_tensors
        b, h, n, d = q.shape
        need_scale = ctx.needs_input_grad[3]
        dq, dk, dv = (torch.empty(b, h, n, d, device=q.device, dtype=t.dtype) for t in (q, k, v))
        d_u = backward_launch(q, k, v, scale32, state, z, den, grad_out, ctx.opts, ctx.cfg, ctx.splits,
                              dq, dk, dv, need_scale, features=tuple(features) or None)
        d_scale = None
        if need_scale:
            d_scale = d_u.view(b, h, n).sum((0, 2)).reshape(ctx.scale_shape)
        return dq, dk, dv, d_scale, None, None, None


def resolve_opts(q: torch.Tensor, opts: dict) -> dict:
    """``opts`` (the §2 constants) checked against ``q`` and completed with the products'
    ``precision`` (where not given), as every caller of the kernels takes them."""
    if q.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"impl='triton' needs CUDA tensors, got {q.device.type} (on CPU use impl='fused', "
                         "or set TRITON_INTERPRET=1 before importing nala_dit.attention.nala.triton.launch to run the "
                         "kernels in Triton's interpreter)")
    reason = unsupported_reason(q)
    if reason:
        raise ValueError(f"impl='triton' does not support {reason}; use impl='fused' or 'eager'")
    # Exact fp32 products for fp32 inputs (matches the reference to rounding) unless torch
    # is allowed TF32 for fp32 matmuls (torch.set_float32_matmul_precision("high")); TF32
    # tensor cores for half inputs, whose output rounding (2^-8 for bf16) dominates anyway.
    # Half inputs get bf16 operands (fp16 inputs too: bf16 has fp32's range, and |k|^λ
    # passes fp16's 65504 at |k| > 40 for λ = 3) and, on a GPU, the MUFU approximations;
    # under the interpreter the same rounding with exact functions.
    exact = q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    half = "bf16_exact" if INTERPRETED else "bf16"
    precision = opts.get("precision") or ("ieee" if exact else "tf32" if q.dtype == torch.float32 else half)
    return dict(opts, precision=precision)


# torch.compile'd models treat this call as opaque (a graph break): dynamo would otherwise
# trace the launch code (device queries, Python-side block arithmetic) into the graph.
@torch.compiler.disable
def nala_attention_triton(q, k, v, norm_scale, opts: dict, splits: int | None = None,
                          config: dict | None = None) -> torch.Tensor:
    """Run the kernels: ``norm_scale`` a float or a tensor with 1 or H elements (per head);
    ``opts`` the §2 constants as ``nala/fused.py``'s ``_FusedNaLa`` takes them, and
    optionally ``keep_features`` (default True: bf16 / fp16 inputs store φ_q and φ_k for the
    backward; False recomputes them, ``keeps_features``). ``splits`` overrides
    the number of token ranges of the state passes (tests), ``config`` (BLOCK_N,
    num_warps) the block sizes of every kernel (block-size sweeps, ``launch_config``)."""
    opts = resolve_opts(q, opts)
    if not torch.is_grad_enabled():   # no backward will run (sampling): no features to keep
        opts["keep_features"] = False
    h = q.shape[1]
    if isinstance(norm_scale, torch.Tensor):
        if norm_scale.numel() not in (1, h):
            raise ValueError(f"norm_scale must have 1 or H={h} elements, got shape {tuple(norm_scale.shape)}")
        scale = norm_scale if norm_scale.numel() == h else norm_scale.expand(h)
        scale = scale.reshape(h)
    else:
        scale = torch.full((h,), float(norm_scale), device=q.device)
    if q.device.type == "cuda":
        # Triton launches on the current device; make it q's (a model on a second GPU).
        with torch.cuda.device(q.device):
            return TritonNaLa.apply(q, k, v, scale, opts, splits, config)
    return TritonNaLa.apply(q, k, v, scale, opts, splits, config)
