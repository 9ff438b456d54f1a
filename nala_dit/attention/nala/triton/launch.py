"""NaLa's Triton path: launch configs, grids, the launches, and the autograd function.

The kernels (``forward.py``, ``backward.py``, their helpers ``features.py`` and
``blocks.py``) follow fused bidirectional linear attention: the state is a sum over all
tokens, so the forward is two passes and the backward three, each a kernel:

1. ``state``    φ_k(k) in registers, ``[S | z]`` halves accumulated in fp32 over a token
                range; several ranges per head run in parallel and add their sums into one
                zeroed fp32 state with atomic adds (no partial buffers, no reduction launch);
2. ``output``   φ_q(q) in registers, ``o = φ_qᵀS / (φ_qᵀz + ε)``; keeps the per-token
                denominator (one fp32 per token) for the backward;
   ``forward``  1 and 2 as one launch where one token range per head suffices (N <
                ``SHORT_TOKENS``): the state of one value tile stays in registers between
                the two loops and is stored once;
3. ``dq``       ∂L/∂φ_q = (g/den) Sᵀ + (∂L/∂den) zᵀ, then ∂L/∂q through the feature map;
                keeps ∂L/∂den (one fp32 per token);
4. ``state``    again with queries (QUERY=True): ∂L/∂[S | z] = Σ_i φ_q(q_i) [g_i/den_i | ∂L/∂den_i];
5. ``dkv``      ∂L/∂v = φ_k ∂L/∂S, ∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z, then ∂L/∂k.

``KERNELS`` maps each kind to its two forms: padded (the head dim as one power-of-two tile)
and split (``split_tiles``: a D that is no power of two as two tiles, XL/2's 72 as 64 + 16,
80 lanes of which 8 are masked, where padding to 128 took 1.78× the elementwise and 3.16×
the matrix work; a state half is then four tile-pair blocks). Launches per call: forward 1
(short N) or 3 (``zeros``, state, output); backward 3 (short N) or 4 (with one ``zeros``).
Token ranges are ≥ 64 tokens, so at N ≥ 1,024 the state passes run B·H·16 programs or more.
The atomic sums make the state's last bits depend on the order the ranges finish in (fp32,
relative ~1e-7).

Inputs and outputs are read and written through their strides (``forward_launch``,
``backward_launch``): the gated layer (``gated.py``) hands in q, k, v as views of its qkvg
projection and buffers in token layout for the output and for dq, dk, dv, and the dkv kernel
adds ∂L/∂v to what its buffer holds (``ADD_DV``: the LePE term's gradient).

Saved for the backward: q, k, v, the state (2 × D × (D+1) per head) and the denominator;
the 2D-wide features are recomputed in registers in every pass, never written to memory.

Precision: loads are cast to fp32; features, state, normaliser and division are fp32; only
stores cast to the tensor's dtype (spec §3 "Precision"). Products (``blocks._dot``): exact
fp32 (``ieee``) for fp32 inputs, TF32 where torch allows it
(``set_float32_matmul_precision("high")``); bf16 operands with fp32 accumulation for bf16 /
fp16 inputs, where sin, cos and log are also the MUFU approximations (``features._sin``);
the interpreter gets the same rounding with exact functions (``bf16_exact``). Measured
against the fp32 reference (interpreter, N = 129, D = 64 and 72): relative RMS 2.8e-3 to
3.6e-3 for the output and the gradients, inside the 1e-2 budget of half inputs.

The kernels run on CUDA and, for the tests, on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported). The launch configs
(``_CONFIGS``, ``_SPLIT_CONFIGS``) were chosen by the compile report
(``benchmarks/triton_compile_check.py``: registers, spills, programs per SM for sm_90a, no
GPU; its figures in ``benchmarks/results/triton_launches_sm90.json``), not timed on a GPU.
The kernels before that work are ``benchmarks/baseline_nala/`` (the A/B).
"""

from __future__ import annotations

import torch
import triton
from torch.autograd.function import once_differentiable

from ...config import TRITON_MAX_HEAD_DIM as MAX_HEAD_DIM, TRITON_MAX_TOKENS
from .backward import _dkv_kernel, _dkv_kernel_split, _dq_kernel, _dq_kernel_split
from .forward import (_forward_kernel, _forward_kernel_split, _output_kernel, _output_kernel_split, _state_kernel,
                      _state_kernel_split)


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


# Launch configurations, one per kind of kernel (``KINDS``): the single-launch forward
# ("forward"), the state passes ("state": forward and backward), the output ("out"), dq
# ("dq") and dk/dv ("dkv"). Each entry (BLOCK_N, BV, num_warps, num_stages, maxnreg) for a
# padded head dim BD (power of two), or (BLOCK_N, num_warps, num_stages, maxnreg) for a
# split one (``_SPLIT_CONFIGS``, one program covering every value lane); num_stages None:
# Triton's default (3), maxnreg None: no register cap (else ptxas's ``.maxnreg``; the
# compile test holds that none spills). BV < BD: the output and forward kernels take the
# value tiles on a grid axis (φ computed once per tile), dq and dkv loop over them. D = 64
# and 72 reach two programs per SM with no spill (bf16/fp16, sm_90a); fp32 inputs with
# exact products spill at D ≥ 64 (not a target). Output, dq and dkv of a split dim take the
# feature lanes in chunks of ``SPLIT_CHUNK``.
KINDS = ("forward", "state", "out", "dq", "dkv")


def _by_kind(state, out, bwd):
    """A three-group entry (state, output, dq/dkv) as one entry per kind, no cap."""
    return dict(forward=(*state, None, None), state=(*state, None, None), out=(*out, None, None),
                dq=(*bwd, None, None), dkv=(*bwd, None, None))


_CONFIGS = {  # BD: (BLOCK_N, BV, warps) for the state passes (forward too), the output, dq and dkv
    16: _by_kind((64, 16, 4), (64, 16, 4), (32, 16, 4)),
    32: _by_kind((64, 32, 4), (64, 32, 4), (32, 32, 8)),
    64: dict(forward=(32, 64, 8, None, 128), state=(32, 64, 8, None, None), out=(64, 64, 8, None, 128),
             dq=(16, 64, 8, None, 128), dkv=(16, 32, 8, None, None)),
    128: _by_kind((32, 64, 8), (32, 128, 8), (16, 32, 8)),
}
_SPLIT_CONFIGS = dict(forward=(16, 4, None, None), state=(16, 4, None, None), out=(64, 8, None, 128),
                      dq=(64, 8, None, 128), dkv=(64, 8, 1, 128))
SPLIT_CHUNK = 16


def split_tiles(head_dim: int) -> tuple[int, int] | None:
    """(BA, BB) for a head dim that runs as two tiles, lanes [0, BA) and [BA, BA + BB):
    BA the largest power of two ≤ D, BB the power of two (≥ 16, what tl.dot needs) that
    covers the rest; None where that is no narrower than one padded tile (powers of two,
    D < 32, D just under a power of two such as 120)."""
    if head_dim < 32:
        return None
    ba = 1 << (head_dim.bit_length() - 1)
    bb = max(16, triton.next_power_of_2(head_dim - ba)) if head_dim > ba else 0
    return (ba, bb) if bb and ba + bb < triton.next_power_of_2(head_dim) else None


def launch_config(head_dim: int, override: dict | None = None) -> dict:
    """Launch configuration per kind of kernel (``KINDS``) for a head dim: BD is D padded to
    a power of two (≥ 16, what tl.dot needs), then ``_CONFIGS``; a D that ``split_tiles``
    splits runs as two tiles (BA, BB; ``_SPLIT_CONFIGS``, one value tile, feature chunks of
    BC). ``override``: its BLOCK_N, BV, num_warps replace every kind's values (block-size
    sweeps; BV is unused where split), with Triton's default stages and no register cap."""
    override = dict(override or {})
    bd = max(16, triton.next_power_of_2(head_dim))
    cfg = dict(BD=bd)
    tiles = split_tiles(head_dim)
    if tiles:
        cfg.update(BA=tiles[0], BB=tiles[1])
        for kind in KINDS:
            block_n, warps, stages, maxnreg = _SPLIT_CONFIGS[kind]
            sub = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages, maxnreg=maxnreg)
            if override:
                sub.update({k: v for k, v in override.items() if k != "BV"}, num_stages=None, maxnreg=None)
            sub["NV"] = 1
            if kind != "state":
                sub["BC"] = SPLIT_CHUNK
            cfg[kind] = sub
        return cfg
    for kind in KINDS:
        block_n, bv, warps, stages, maxnreg = _CONFIGS[bd][kind]
        sub = dict(BLOCK_N=block_n, BV=bv, num_warps=warps, num_stages=stages, maxnreg=maxnreg)
        if override:
            sub.update(override, num_stages=None, maxnreg=None)
        sub["NV"] = bd // sub["BV"]
        cfg[kind] = sub
    return cfg


def _compile_opts(sub: dict) -> dict:
    """A kind's launch options: num_warps, and num_stages / maxnreg where set."""
    return dict(num_warps=sub["num_warps"], **{k: sub[k] for k in ("num_stages", "maxnreg") if sub.get(k)})


# Fewest tokens per range of the state passes: ranges add into one state, so a range can
# be one token block (64): N = 1,024 gives 16 ranges per head, B·H·16 programs (H = 16: 256).
MIN_SPLIT_TOKENS = 64
# Below this many tokens the forward is one launch (state + output in one program per
# head and value tile) whatever the GPU's size: the call is launch-bound there.
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


# Every kernel a launch runs, by kind: (its padded form, its split form). Launches look the
# kernel up here when they run, so a test can wrap an entry.
KERNELS = {
    "state": (_state_kernel, _state_kernel_split),
    "forward": (_forward_kernel, _forward_kernel_split),
    "output": (_output_kernel, _output_kernel_split),
    "dq": (_dq_kernel, _dq_kernel_split),
    "dkv": (_dkv_kernel, _dkv_kernel_split),
}


def _kernel_for(kind: str, cfg: dict):
    """The kernel of ``kind`` (a key of ``KERNELS``) for a launch config: its split form
    where the head dim is split."""
    return KERNELS[kind]["BA" in cfg]


def _tile_args(cfg: dict, group: str, nv: bool = False) -> dict:
    """The head-dim constexprs of a kernel: BA, BB (split) or BD, BV (and NV)."""
    if "BA" in cfg:
        return dict(BA=cfg["BA"], BB=cfg["BB"], **({"BC": cfg[group]["BC"]} if "BC" in cfg[group] else {}))
    args = dict(BD=cfg["BD"], BV=cfg[group]["BV"])
    if nv:
        args["NV"] = cfg[group]["NV"]
    return args


def _ranges(n: int, splits: int, block_n: int) -> tuple[int, int]:
    """(tokens per range, ranges) of a state pass asked for ``splits`` ranges: whole blocks each."""
    per_split = triton.cdiv(triton.cdiv(n, splits), block_n) * block_n
    return per_split, triton.cdiv(n, per_split)


def launch_grids(b: int, h: int, n: int, cfg: dict, splits: int) -> dict[str, tuple]:
    """The grid of each NaLa kernel for (B, H, N) heads, ``launch_config``'s ``cfg`` and
    ``splits`` token ranges, as the launches use them: ``forward`` (the single launch, where
    it runs), ``state`` (both state passes), ``output``, ``dq``, ``dkv``. Axes after the first
    stay within CUDA's 65,535 up to ``TRITON_MAX_TOKENS`` (token blocks of ≥ 16)."""
    grids = dict(state=(b * h, _ranges(n, splits, cfg["state"]["BLOCK_N"])[1], cfg["state"]["NV"]),
                 output=(b * h, triton.cdiv(n, cfg["out"]["BLOCK_N"]), cfg["out"]["NV"]),
                 dq=(b * h, triton.cdiv(n, cfg["dq"]["BLOCK_N"])), dkv=(b * h, triton.cdiv(n, cfg["dkv"]["BLOCK_N"])))
    if splits == 1:
        grids["forward"] = (b * h, cfg["forward"]["NV"])
    return grids


def _state_pass(x, w, scale, opts, cfg, splits, query, den=None, d_den=None):
    """Launch the state kernel over ``splits`` token ranges, which add their sums atomically
    into one zeroed state (one range writes it). Returns ``(S, z)``: (B·H, 2, D, D) and
    (B·H, 2, D), fp32, means over the N tokens."""
    b, h, n, d = x.shape
    st = cfg["state"]
    block_n = st["BLOCK_N"]
    per_split, splits = _ranges(n, splits, block_n)                     # whole blocks
    atomic = splits > 1
    # One buffer holds both, S then z, each contiguous: zeroed (one launch) where ranges add.
    buf = (x.new_zeros if atomic else x.new_empty)(b * h * 2 * d * (d + 1), dtype=torch.float32)
    s_part = buf[:b * h * 2 * d * d].view(b * h, 2, d, d)
    z_part = buf[b * h * 2 * d * d:].view(b * h, 2, d)
    _kernel_for("state", cfg)[(b * h, splits, st["NV"])](   # launch_grids' "state"
        x, w, scale, s_part, z_part, *_strides(x), *_strides(w),
        h, n, d, per_split, splits, 1.0 / n,
        opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"],
        QUERY=query, COSINE=opts["direction"] == "cosine",
        BLOCK_N=block_n, **_tile_args(cfg, "state"), PREC=opts["precision"],
        DEN=den, DDEN=d_den, ATOMIC=atomic, **_compile_opts(st),
    )
    return s_part, z_part


def forward_launch(q, k, v, scale32, opts: dict, cfg: dict, splits: int, out: torch.Tensor):
    """The forward's launches: ``out`` (B, H, N, D), any strides (a gated layer passes its
    token-layout buffer), gets NaLa's output. Returns what the backward needs: the state
    ``(S, z)`` and the denominator, fp32."""
    b, h, n, d = q.shape
    den = torch.empty(b * h, n, device=q.device, dtype=torch.float32)
    cosine = opts["direction"] == "cosine"
    if splits == 1:
        # One launch: state and output per (head, value tile); the state kept for the backward.
        state = torch.empty(b * h, 2, d, d, device=q.device, dtype=torch.float32)
        z = torch.empty(b * h, 2, d, device=q.device, dtype=torch.float32)
        fc = cfg["forward"]
        _kernel_for("forward", cfg)[launch_grids(b, h, n, cfg, splits)["forward"]](
            k, v, q, scale32, state, z, out, den, *_strides(k), *_strides(v), *_strides(q), *_strides(out),
            h, n, d, 1.0 / n, opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"], opts["eps"],
            COSINE=cosine, BLOCK_N=fc["BLOCK_N"], **_tile_args(cfg, "forward"), PREC=opts["precision"],
            **_compile_opts(fc), **({"BLOCK_O": cfg["out"]["BLOCK_N"]} if "BA" in cfg else {}),
        )
        return state, z, den
    state, z = _state_pass(k, v, scale32, opts, cfg, splits, query=False)
    oc = cfg["out"]
    _kernel_for("output", cfg)[launch_grids(b, h, n, cfg, splits)["output"]](
        q, scale32, state, z, out, den, *_strides(q), *_strides(out), h, n, d,
        opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"], opts["eps"],
        COSINE=cosine, BLOCK_N=oc["BLOCK_N"], **_tile_args(cfg, "out"),
        PREC=opts["precision"], **_compile_opts(oc),
    )
    return state, z, den


def backward_launch(q, k, v, scale32, state, z, den, grad_out, opts: dict, cfg: dict, splits: int,
                    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, need_scale: bool = False,
                    add_dv: bool = False):
    """The backward's launches into ``dq``, ``dk``, ``dv`` (B, H, N, D), any strides; with
    ``add_dv`` ∂L/∂v is added to what ``dv`` holds. Returns ∂L/∂s per token, (B·H, N), when
    ``need_scale``, else None."""
    b, h, n, d = q.shape
    cosine = opts["direction"] == "cosine"
    d_den = torch.empty(b * h, n, device=q.device, dtype=torch.float32)
    d_u = torch.empty(b * h, n, device=q.device, dtype=torch.float32) if need_scale else d_den
    dqc, dkvc = cfg["dq"], cfg["dkv"]
    grids = launch_grids(b, h, n, cfg, splits)
    _kernel_for("dq", cfg)[grids["dq"]](
        q, grad_out, scale32, state, z, den, dq, d_den, d_u,
        *_strides(q), *_strides(grad_out), *_strides(dq), h, n, d,
        opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"],
        COSINE=cosine, BLOCK_N=dqc["BLOCK_N"], **_tile_args(cfg, "dq", nv=True),
        PREC=opts["precision"], NEED_DU=need_scale, DQ_STRIDED=not dq.is_contiguous(), **_compile_opts(dqc),
    )
    d_state, d_z = _state_pass(q, grad_out, scale32, opts, cfg, splits, query=True, den=den, d_den=d_den)
    _kernel_for("dkv", cfg)[grids["dkv"]](
        k, v, d_state, d_z, dk, dv, *_strides(k), *_strides(v), *_strides(dk), *_strides(dv), h, n, d,
        opts["power"], opts["alpha"], opts["norm_eps"],
        COSINE=cosine, BLOCK_N=dkvc["BLOCK_N"], **_tile_args(cfg, "dkv", nv=True),
        PREC=opts["precision"], ADD_DV=add_dv, **_compile_opts(dkvc),
    )
    return d_u if need_scale else None


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
        state, z, den = forward_launch(q, k, v, scale32, opts, cfg, splits, out)
        ctx.opts, ctx.cfg, ctx.splits = opts, cfg, splits
        ctx.scale_shape = scale.shape
        ctx.save_for_backward(q, k, v, scale32, state, z, den)
        return out

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable
    def backward(ctx, grad_out):
        q, k, v, scale32, state, z, den = ctx.saved_tensors
        b, h, n, d = q.shape
        need_scale = ctx.needs_input_grad[3]
        dq, dk, dv = (torch.empty(b, h, n, d, device=q.device, dtype=t.dtype) for t in (q, k, v))
        d_u = backward_launch(q, k, v, scale32, state, z, den, grad_out, ctx.opts, ctx.cfg, ctx.splits,
                              dq, dk, dv, need_scale)
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
    ``opts`` the §2 constants as ``nala/fused.py``'s ``_FusedNaLa`` takes them. ``splits`` overrides
    the number of token ranges of the state passes (tests), ``config`` (BLOCK_N, BV,
    num_warps) the block sizes of every kernel (block-size sweeps, ``launch_config``)."""
    opts = resolve_opts(q, opts)
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
