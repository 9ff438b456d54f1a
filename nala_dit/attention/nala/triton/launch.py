"""NaLa (``docs/NALA_SPEC.md`` §2-§3) as Triton kernels, forward and backward.

The structure is that of fused bidirectional linear attention: the state is a sum over
all tokens, so the forward is two passes and the backward three, each a kernel:

1. ``_state_kernel``   φ_k(k) in registers, ``[S | z]`` halves accumulated in fp32 over a
                       token range; several ranges per head run in parallel and add their
                       sums into one zeroed fp32 state with atomic adds (no partial buffers,
                       no separate reduction launch);
2. ``_output_kernel``  φ_q(q) in registers, ``o = φ_qᵀS / (φ_qᵀz + ε)``; keeps the
                       per-token denominator (one fp32 per token) for the backward;
   ``_forward_kernel`` 1 and 2 as one launch where one token range per head suffices (N <
                       ``SHORT_TOKENS``, or B·H alone filling the GPU): the state of one value
                       tile stays in registers between the two loops and is stored once;
3. ``_dq_kernel``      ∂L/∂φ_q = (g/den) Sᵀ + (∂L/∂den) zᵀ, then ∂L/∂q through the
                       feature map; keeps ∂L/∂den (one fp32 per token);
4. ``_state_kernel``   again with queries (QUERY=True):
                       ∂L/∂[S | z] = Σ_i φ_q(q_i) [g_i/den_i | ∂L/∂den_i];
5. ``_dkv_kernel``     ∂L/∂v = φ_k ∂L/∂S, ∂L/∂φ_k = v ∂L/∂Sᵀ + ∂L/∂z, then ∂L/∂k.

Launches per call: forward 1 (short N) or 3 (``zeros``, state, output); backward 3 (short
N) or 4 (with one ``zeros``). The token ranges are 64 tokens at least, so at N ≥ 1,024 the
state passes run B·H·16 programs or more (XL/2's 16 heads: 256 at batch 1, every SM of an
H100/H200; S/2's 6 heads: 96 at batch 1, from batch 2 all 132). The atomic sums make the
state's last bits depend on the order the ranges finish in (fp32, relative ~1e-7).

``VARIANT`` (``NALA_TRITON_VARIANT=baseline``, or ``opts["variant"]``) keeps the kernels
before the rework selectable for an A/B: partial states summed by ``torch.sum``, ranges of
≥ 512 tokens, state and output as two launches, TF32 products, libdevice sin/cos/log.

Inputs and outputs are read and written through their strides (``forward_launch``,
``backward_launch``): the gated layer (``gated.py``) hands in q, k, v as views of its
qkvg projection and buffers in token layout for the output and for dq, dk, dv, and the
dkv kernel adds ∂L/∂v to what its buffer holds (``ADD_DV``: the LePE term's gradient).
dq's contiguous case keeps its own store (``DQ_STRIDED`` False), which keeps that kernel's
registers at D = 72 where they were.

What is saved for the backward: q, k, v, the state (2 × D × (D+1) per head) and the
denominator. The 2D-wide features (norm, exponent, ``|q̂|^p``, angles, cos/sin halves,
``|k|^λ``) are recomputed in registers in every pass and never written to memory. The
feature is never concatenated: its two halves each meet the state in their own ``tl.dot``
(the CPU path, ``nala/fused.py``'s ``_FusedNaLa``, writes them side by side into one scratch block per
token chunk instead, so that there each product is one GEMM).

Precision: every load is cast to fp32, features, state, normaliser and division are fp32,
and only the stores cast to the tensor's dtype (§3 "Precision"). Products of fp32 blocks
use exact fp32 (``ieee``) for fp32 inputs, so the kernels match the fp32 reference to
rounding (TF32 where torch allows it: ``set_float32_matmul_precision("high")``). For
bf16/fp16 inputs the products take bf16 operands with fp32 accumulation ("bf16": the
features and the fp32 state are cast to bf16 as they enter each ``tl.dot``; bf16 for fp16
inputs too, since bf16 has fp32's range and |k|^λ passes fp16's 65504 at |k| > 40 for
λ = 3). Measured against the fp32 reference on fp32 inputs, under the interpreter (the
same rounding, ``bf16_exact``), N = 129: relative RMS 2.8e-3 to 3.6e-3 for the output and
the gradients of q, k, v at D = 64 and 72, the output norm within 3e-4 (TF32: 3.5e-4 to
4.5e-4); inside the 1e-2 budget of half inputs, whose own rounding is 2^-9. In that mode
(and only there: fp32 inputs and the interpreter keep libdevice) sin, cos and log are the
MUFU approximations (see ``_sin``); that also removes libdevice's local-memory argument
reduction of sin/cos (LDL/STL in the SASS).

Head dims up to 128. A power of two (16/32/64/128) is one tile. Any other D runs, in the
fused variant, as two tiles (``split_tiles``): lanes [0, BA) and [BA, BA + BB), BA the
largest power of two ≤ D and BB ≥ 16 the power of two covering the rest; XL/2's 72 is
64 + 16, 80 lanes of which 8 are masked (1.11× the elementwise work, 1.23× the state's
matrix work, where padding to 128 took 1.78× and 3.16×). Two tiles and not one of 80
lanes because Triton's blocks are powers of two; two and not 64 + 8 because tl.dot needs
16. The ``*_split`` kernels compute per tile, and everything that spans the head dim
spans both: the feature map's row reductions (‖x‖, Σ ∂L/∂p, the unit-vector gradient)
add the two tiles' sums, and a state half is four blocks S[a,a], S[a,b], S[b,a], S[b,b],
so each product becomes four tile-pair products. S[b,a] is accumulated transposed
(wᵀφ: 64 rows, so wgmma; a 16-row product falls back to mma.sync), and one program covers
every value lane. The state passes hold the features of both tiles at once (16 tokens per
program); output, dq and dkv take the feature lanes in chunks of ``SPLIT_CHUNK`` (16) in a
loop, one chunk's features live at a time (registers: two programs per SM), the output
computing them once per token block (the padded kernels: once per 64-lane value tile), dq
twice and dkv three times (twice in relu_split; see their docstrings). D is a constant of the split kernels (a
compile per head dim; the state loads vectorise). The baseline variant keeps the padded
kernels (72 as 128 lanes) for the A/B, and a D whose split is no narrower than its
padding (24, 120) stays padded. Any N (masked token blocks; a zero token has zero
features, so padding adds nothing to the state).

Compiled for sm_90a (``benchmarks/triton_compile_check.py``; bf16, cosine, D = 72, 8 warps;
padded → split, before the register work below): registers, state 195 → 173, dstate
255 → 173, output 254 → 170, dq 255 → 255, dkv 202 → 255, forward 230 → 255; spills 0
except dq 16 → 28 B, dkv 0 → 52 B, forward 0 → 124 B; static SASS instructions state
2,400 → 1,232, dstate 3,024 → 1,440, output 3,392 → 2,320 (per program; the split
programs cover 16 tokens and all 72 value lanes where the padded covered 32 and 64, and
output, dq, dkv 64 tokens where they covered 32 and 16); products on wgmma everywhere
(HGMMA; mma.sync only for the 16 × 16 S[b,b] blocks) where output, dq and dkv ran 32-96
mma.sync each; MUFU.COS per token (elementwise work) state 1.0 → 0.31, output, dq, dkv
0.5 → 0.31. Then two programs per SM for every fused kernel at D = 64 and 72 (bf16 and
fp16, both directions), no spill, wgmma wherever it was: launch configs per kind of kernel
with a register cap (``_CONFIGS``, ``_SPLIT_CONFIGS``; the table of registers there) and
the feature chunks above; chosen by the compile report, not timed on a GPU.

The kernels run on CUDA and, for the tests, on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported); without a GPU,
``benchmarks/triton_compile_check.py`` compiles them for sm_90a and reports registers,
spills, shared memory, programs per SM, wgmma/mma.sync and MUFU use. The launch configs
below avoid register spills and fit two programs per SM; they have not been timed
(``benchmarks/triton_configs.py`` times them against the previous ones on a GPU).
"""

from __future__ import annotations

import os

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
# split one (``_SPLIT_CONFIGS``); num_stages None: Triton's default (3), maxnreg None: no
# register cap (else ptxas's ``.maxnreg``: where a kernel's live values fit under it, ptxas
# keeps fewer values in flight instead of spilling; the compile test holds that none spills).
# BV < BD: the output and forward kernels take the value tiles on a grid axis (φ computed
# once per tile), dq and dkv loop over them in the program.
#
# The fused variant's entries were chosen by the compile report
# (``benchmarks/triton_compile_check.py``: ptxas of Triton 3.8, sm_90a, bf16/fp16, no GPU),
# not by timing: every kernel at D = 64 and 72 reaches two programs per SM (8 warps at ≤ 128
# registers, or 4 warps at ≤ 255) with no spill, wgmma (HGMMA) wherever it ran before.
# ``_PREVIOUS_CONFIGS`` / ``_PREVIOUS_SPLIT_CONFIGS`` are the entries before that (one
# program per SM at D = 64 and 72), reachable as ``launch_config(d, {"table": "previous"})``
# for ``benchmarks/triton_configs.py``'s GPU sweep, which times both.
# D = 64 (8 warps, registers before → after): forward at BLOCK_N 32 capped to 128 (141 →
# 128; 4 warps: 231, 64 tokens spill); output capped to 128 (155 → 128, still wgmma; BV 32
# would reach 99 but compute φ twice, BLOCK_N 32 80 but on mma.sync); dq and dkv on 16
# tokens (196 → 109, 248 → 110; both were and stay mma.sync: with 64 tokens, wgmma, they
# spill 56-812 B even when capped); dkv with BV 32 (64 keeps more of ∂L/∂S loaded: 175).
# fp32 inputs with exact FMA products (the reference-precision default) spill 0.3-18 KB at
# D ≥ 64 (not a target); with torch.set_float32_matmul_precision("high") they take the TF32
# path. At D = 72 padded (BD 128: the baseline) no block size tried reaches 128 registers
# (140-255); the fused variant splits 72 (``_SPLIT_CONFIGS``).
KINDS = ("forward", "state", "out", "dq", "dkv")
_PREVIOUS_CONFIGS = {
    # BD: (BLOCK_N, BV, warps) for the state passes (forward too), the output, dq and dkv
    16: ((64, 16, 4), (64, 16, 4), (32, 16, 4)),
    32: ((64, 32, 4), (64, 32, 4), (32, 32, 8)),
    64: ((32, 64, 8), (64, 64, 8), (32, 64, 8)),
    128: ((32, 64, 8), (32, 128, 8), (16, 32, 8)),
}
# The baseline variant's table (before the rework), for the A/B.
_BASELINE_CONFIGS = {**_PREVIOUS_CONFIGS, 64: ((64, 64, 8), (64, 64, 8), (32, 64, 8))}


def _by_kind(state, out, bwd):
    """A three-group entry (state, output, dq/dkv) as one entry per kind, no cap."""
    return dict(forward=(*state, None, None), state=(*state, None, None), out=(*out, None, None),
                dq=(*bwd, None, None), dkv=(*bwd, None, None))


_CONFIGS = {bd: _by_kind(*groups) for bd, groups in _PREVIOUS_CONFIGS.items()}
_CONFIGS[64] = dict(forward=(32, 64, 8, None, 128), state=(32, 64, 8, None, None), out=(64, 64, 8, None, 128),
                    dq=(16, 64, 8, None, None), dkv=(16, 32, 8, None, None))


# Split head dims (fused variant): (BLOCK_N, num_warps, num_stages, maxnreg) per kind; one
# program covers every value lane (NV = 1). The output, dq, dkv (and the forward's output
# loop) take the feature lanes in chunks of ``SPLIT_CHUNK`` (see _output_block2). D = 72 (64
# + 16), bf16, sm_90a, registers before → after: the state passes at 16 tokens on 4 warps
# (173 on 8 → 234 / 244 on 4: two programs; on 8 warps capped at 128 they spill 116 B);
# output, dq, dkv on 64 tokens (wgmma), 8 warps, capped at 128 (170 → 128, 255 + 28 B spill
# → 128, 255 + 52 B → 128; dkv with num_stages 1: 20-36 B spill with 2 or 3); uncapped the
# chunked kernels take 159 / 175 / 140 (on 4 warps 195 / 255 / 191), the unchunked ones
# spilled at any cap and on 4 warps. The forward on 4 warps, 16 tokens per state block and
# 64 per output block: 255 + 124 B spill and 126 KB of shared memory (one program by either)
# → 237, no spill, 26 KB. At D = 72 the previous entries run the chunked kernels too: the
# kernels before them are the baseline variant's (padded) or git's (76bcfee). Other split
# dims share the entries (not tuned: no preset uses them): D = 40 fits two programs with no
# spill; D = 96 (64 + 32) too, but spills 100 B in dstate (0 before, on 8 warps), 16 B in dq
# and 20 B in dkv (376 and 184 B before) and 0 in the forward (136 B before).
_PREVIOUS_SPLIT_CONFIGS = dict(forward=(16, 8, None, None), state=(16, 8, None, None), out=(64, 8, None, None),
                               dq=(64, 8, None, None), dkv=(64, 8, None, None))
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


def launch_config(head_dim: int, override: dict | None = None, variant: str = "fused") -> dict:
    """Launch configuration per kind of kernel (``KINDS``) for a head dim: BD is D padded to
    a power of two (≥ 16, what tl.dot needs), then ``_CONFIGS``; in the fused variant a D
    that ``split_tiles`` splits runs as two tiles (BA, BB; ``_SPLIT_CONFIGS``, one value
    tile, feature chunks of BC). ``override``: {"table": "previous"} takes the entries from
    before the register work (``_PREVIOUS_CONFIGS``); otherwise its BLOCK_N, BV,
    num_warps replace every kind's values (block-size sweeps; BV is unused where split),
    with Triton's default stages and no register cap."""
    override = dict(override or {})
    previous = override.pop("table", None) == "previous"
    bd = max(16, triton.next_power_of_2(head_dim))
    cfg = dict(BD=bd)
    tiles = split_tiles(head_dim) if variant == "fused" else None
    if tiles:
        cfg.update(BA=tiles[0], BB=tiles[1])
        table = _PREVIOUS_SPLIT_CONFIGS if previous else _SPLIT_CONFIGS
        for kind in KINDS:
            block_n, warps, stages, maxnreg = table[kind]
            sub = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages, maxnreg=maxnreg)
            if override:
                sub.update({k: v for k, v in override.items() if k != "BV"}, num_stages=None, maxnreg=None)
            sub["NV"] = 1
            if kind != "state":
                sub["BC"] = SPLIT_CHUNK
            cfg[kind] = sub
        return cfg
    if variant == "baseline":
        table = _by_kind(*_BASELINE_CONFIGS[bd])
    else:
        table = _by_kind(*_PREVIOUS_CONFIGS[bd]) if previous else _CONFIGS[bd]
    for kind in KINDS:
        block_n, bv, warps, stages, maxnreg = table[kind]
        sub = dict(BLOCK_N=block_n, BV=bv, num_warps=warps, num_stages=stages, maxnreg=maxnreg)
        if override:
            sub.update(override, num_stages=None, maxnreg=None)
        sub["NV"] = bd // sub["BV"]
        cfg[kind] = sub
    return cfg


def _compile_opts(sub: dict) -> dict:
    """A kind's launch options: num_warps, and num_stages / maxnreg where set."""
    return dict(num_warps=sub["num_warps"], **{k: sub[k] for k in ("num_stages", "maxnreg") if sub.get(k)})


# Which kernels run: "fused" (the default) reduces the partial states inside the state
# kernel with fp32 atomic adds into one zeroed state, runs the whole forward as one launch
# where one token range per head suffices, and splits the tokens into ranges of
# MIN_SPLIT_TOKENS["fused"] so that the state passes give every SM work from batch 1 at
# N ≥ 1,024; "baseline" is the code before the rework (partial states summed by separate
# ``torch.sum`` launches, ranges ≥ 512 tokens, state and output as two launches), kept for
# an A/B in one GPU run. Read once, at import: NALA_TRITON_VARIANT=baseline; a call can
# also name it in ``opts["variant"]``.
VARIANTS = ("fused", "baseline")
VARIANT = os.environ.get("NALA_TRITON_VARIANT", "fused")
if VARIANT not in VARIANTS:
    raise ValueError(f"NALA_TRITON_VARIANT={VARIANT!r}: expected one of {', '.join(VARIANTS)}")

# Fewest tokens per range of the state passes. Baseline: each range wrote a partial state
# of 2·D·(D+1) fp32 per head, so ranges of ≥ 512 tokens kept the partials small (at most
# D/128 of one bf16 input's bytes). Fused: ranges add into one state, so a range can be one
# token block (64): N = 1,024 gives 16 ranges per head, B·H·16 programs (H = 16: 256).
MIN_SPLIT_TOKENS = {"fused": 64, "baseline": 512}
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


def num_splits(n_tokens: int, n_heads_total: int, n_vtiles: int, device: torch.device,
               variant: str = "fused") -> int:
    """Token ranges per head for the two state passes: enough programs to fill the GPU
    (about 4 per SM; B·H alone is often a few dozen), no range under MIN_SPLIT_TOKENS;
    one range (the single-launch forward) below SHORT_TOKENS in the fused variant."""
    target = _programs_target(device)
    if variant == "fused" and n_tokens < SHORT_TOKENS:
        return 1
    want = -(-target // (n_heads_total * n_vtiles))
    return max(1, min(want, n_tokens // MIN_SPLIT_TOKENS[variant]))


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


def launch_grids(b: int, h: int, n: int, cfg: dict, splits: int, variant: str = "fused") -> dict[str, tuple]:
    """The grid of each NaLa kernel for (B, H, N) heads, ``launch_config``'s ``cfg`` and
    ``splits`` token ranges, as the launches use them: ``forward`` (the single launch, where
    it runs), ``state`` (both state passes), ``output``, ``dq``, ``dkv``. Axes after the first
    stay within CUDA's 65,535 up to ``TRITON_MAX_TOKENS`` (token blocks of ≥ 16)."""
    grids = dict(state=(b * h, _ranges(n, splits, cfg["state"]["BLOCK_N"])[1], cfg["state"]["NV"]),
                 output=(b * h, triton.cdiv(n, cfg["out"]["BLOCK_N"]), cfg["out"]["NV"]),
                 dq=(b * h, triton.cdiv(n, cfg["dq"]["BLOCK_N"])), dkv=(b * h, triton.cdiv(n, cfg["dkv"]["BLOCK_N"])))
    if variant == "fused" and splits == 1:
        grids["forward"] = (b * h, cfg["forward"]["NV"])
    return grids


def _state_pass(x, w, scale, opts, cfg, splits, query, den=None, d_den=None):
    """Launch ``_state_kernel`` over ``splits`` token ranges and reduce the ranges: in the
    kernel (atomic adds, fused variant) or by ``torch.sum`` (baseline). Returns ``(S, z)``:
    (B·H, 2, D, D) and (B·H, 2, D), fp32, means over the N tokens."""
    b, h, n, d = x.shape
    st = cfg["state"]
    block_n = st["BLOCK_N"]
    per_split, splits = _ranges(n, splits, block_n)                     # whole blocks
    atomic = opts["variant"] == "fused" and splits > 1
    if atomic:
        # One zeroed buffer (one launch) holds both: S then z, each contiguous.
        buf = x.new_zeros(b * h * 2 * d * (d + 1), dtype=torch.float32)
        s_part = buf[:b * h * 2 * d * d].view(b * h, 2, d, d)
        z_part = buf[b * h * 2 * d * d:].view(b * h, 2, d)
    else:
        s_part = x.new_empty(b * h, splits, 2, d, d, dtype=torch.float32)
        z_part = x.new_empty(b * h, splits, 2, d, dtype=torch.float32)
    _kernel_for("state", cfg)[(b * h, splits, st["NV"])](   # launch_grids' "state"
        x, w, scale, s_part, z_part, *_strides(x), *_strides(w),
        h, n, d, per_split, splits, 1.0 / n,
        opts["power"], opts["offset"], opts["alpha"], opts["norm_eps"],
        QUERY=query, COSINE=opts["direction"] == "cosine",
        BLOCK_N=block_n, **_tile_args(cfg, "state"), PREC=opts["precision"],
        DEN=den, DDEN=d_den, ATOMIC=atomic, **_compile_opts(st),
    )
    if atomic:
        return s_part, z_part
    # Baseline: a deterministic sum over the ranges; one range needs no extra kernel.
    if splits == 1:
        return s_part[:, 0], z_part[:, 0]
    return s_part.sum(1), z_part.sum(1)


def forward_launch(q, k, v, scale32, opts: dict, cfg: dict, splits: int, out: torch.Tensor):
    """The forward's launches: ``out`` (B, H, N, D), any strides (a gated layer passes its
    token-layout buffer), gets NaLa's output. Returns what the backward needs: the state
    ``(S, z)`` and the denominator, fp32."""
    b, h, n, d = q.shape
    den = torch.empty(b * h, n, device=q.device, dtype=torch.float32)
    cosine = opts["direction"] == "cosine"
    if opts["variant"] == "fused" and splits == 1:
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
    _kernel_for("output", cfg)[launch_grids(b, h, n, cfg, splits, opts["variant"])["output"]](
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
    grids = launch_grids(b, h, n, cfg, splits, opts["variant"])
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
        variant = opts["variant"]
        cfg = launch_config(d, config, variant)
        if splits is None:
            splits = num_splits(n, b * h, cfg["state"]["NV"], q.device, variant)
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
    """``opts`` (the §2 constants) checked against ``q`` and completed with the kernel
    ``variant`` and the products' ``precision`` (where not given), as every caller of the
    kernels takes them."""
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
    # The fused variant gives half inputs bf16 operands (fp16 inputs too: bf16 has fp32's
    # range, and |k|^λ passes fp16's 65504 at |k| > 40 for λ = 3) and, on a GPU, the MUFU
    # approximations; under the interpreter the same rounding with exact functions.
    variant = opts.get("variant") or VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    exact = q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    half = "bf16_exact" if INTERPRETED else "bf16"
    precision = opts.get("precision") or ("ieee" if exact else
                                          "tf32" if q.dtype == torch.float32 or variant == "baseline" else half)
    return dict(opts, precision=precision, variant=variant)


# torch.compile'd models treat this call as opaque (a graph break): dynamo would otherwise
# trace the launch code (device queries, Python-side block arithmetic) into the graph.
@torch.compiler.disable
def nala_attention_triton(q, k, v, norm_scale, opts: dict, splits: int | None = None,
                          config: dict | None = None) -> torch.Tensor:
    """Run the kernels: ``norm_scale`` a float or a tensor with 1 or H elements (per head);
    ``opts`` the §2 constants as ``nala/fused.py``'s ``_FusedNaLa`` takes them. ``splits`` overrides
    the number of token ranges of the state passes (tests), ``config`` (BLOCK_N, BV,
    num_warps) the block sizes of every kernel (block-size sweeps), or {"table":
    "previous"} the launch configs before the register work (``launch_config``)."""
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
