"""The attention layers of a diffusion transformer: softmax (DiT's) and gated NaLa (§4).

The ``nn.Module`` layers that own the projections and pick a function:
``SoftmaxAttention`` (DiT's own, official parameter names ``qkv``/``proj``),
``GatedLinearAttention`` (the gated NaLa layer of §4; also hosts the baselines) and
``build_attention``. The functions they call live beside them in this package
(``functional.py``, ``nala.py``, ``recompute.py``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn as nn

from ..models.context_parallel import gathered_softmax, shard_of, sharded_linear_attention
from ..cli.options import LINEAR_KERNELS, ATTENTIONS, parse_norm_scale
from .functional import (
    ALPHA, EPS, NORM_SCALE, OFFSET, POWER, Direction, _check_direction, kernel_features, linear_attention,
    nala_exponent, nala_features, rope_angles, rope_linear_attention, saturated_share, softmax_attention,
)
from .nala import fused_opts, nala_attention, select_nala_impl, triton_available
from .recompute import GatedMiddle, gated_tail
from .regions import check_regions, initial_region_logits, region_nala_attention


def _check_heads(dim: int, num_heads: int) -> None:
    if num_heads < 1 or dim % num_heads != 0:
        raise ValueError(
            f"num_heads={num_heads} must divide the hidden size dim={dim} "
            f"(choose num_heads among {[h for h in range(1, dim + 1) if dim % h == 0][:12]}...)"
        )


class SoftmaxAttention(nn.Module):
    """DiT's softmax self-attention, with the official checkpoint names ``qkv`` and ``proj``."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        _check_heads(dim, num_heads)
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                       # each (B, H, N, D)
        # context parallel (grid a ShardGrid): this rank's queries over every rank's k, v
        o = softmax_attention(q, k, v) if shard_of(grid) is None else gathered_softmax(q, k, v, grid)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))       # (B, N, C)


class GatedLinearAttention(nn.Module):
    """The gated attention layer of §4, with NaLa (default), a linear baseline or softmax.

    1. ``[q, k, v, g] = Linear(C → 4C)(x)``   (``g`` only when ``gate``)
    2. ``o = attention(q, k, v)`` over heads  (``kernel``: nala, relu, elu or softmax)
    3. ``o += DWConv5×5(v)`` on the token grid (LePE, when ``lepe``)
    4. ``o = LayerNorm(o) ⊙ SiLU(g)``         (each part switchable)
    5. ``y = Linear(C → C)(o)``

    ``kernel="softmax"`` ("softmax_gated") is SDPA softmax inside the same layer, so an
    ablation can tell the kernel from the extras (qkvg, LePE, LayerNorm, gate).

    NaLa's ``norm_scale`` s (spec §7) is a positive float (1 = the paper), ``"sqrt_d"``
    (s = √D) or ``"learned"``: one s = exp(ρ) per head in the parameter
    ``log_norm_scale`` (state-dict key ``blocks.{i}.attn.log_norm_scale``, shape (H,)),
    initialised by ``reset_norm_scale`` and kept out of weight decay by the trainer.
    Since q enters NaLa only through ‖q‖ and q̂ = q/‖q‖, a scale s is applied as
    ``NaLa(q/s)`` with s = 1: every code path (fused, Triton, eager) runs unchanged and
    autograd differentiates through the division.

    ``rope`` (linear kernels only): the numerator-only 2-D rotary embedding of §7 on the
    token grid (``rope_linear_attention``; needs an even head dim and the grid).

    ``regions`` R (NaLa only; default 1 = one global state): R × R region states mixed per
    query region by the learned non-negative weights ``exp(region_logits)`` (parameter
    ``blocks.{i}.attn.region_logits``, (H, R², R²); ``regions.py``). R = 1 has no such
    parameter and runs plain NaLa, bit for bit.

    ``recompute`` (default): steps 2–5 run as one autograd function (``GatedMiddle``) that
    keeps only the qkvg projection (and NaLa's small state, or a non-fused core's output)
    for backward and recomputes LePE, LayerNorm, SiLU and, on the fused CPU path, NaLa's
    output; same gradients, 4–5 instead of 8 activations of width C per token.
    ``recompute=False`` is the plain autograd composition (the reference).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        kernel: Literal["nala", "relu", "elu", "softmax"] = "nala",
        direction: Direction = "cosine",
        power: float = POWER,
        offset: float = OFFSET,
        norm_scale: float | str = NORM_SCALE,
        alpha: float = ALPHA,
        eps: float = EPS,
        lepe: bool = True,
        gate: bool = True,
        out_norm: bool = True,
        rope: bool = False,
        regions: int = 1,
        recompute: bool = True,
    ):
        super().__init__()
        _check_heads(dim, num_heads)
        kernels = LINEAR_KERNELS + ("softmax",)
        if kernel not in kernels:
            raise ValueError(f"kernel must be one of {kernels}, got {kernel!r}")
        if kernel == "nala":
            _check_direction(direction)
        head_dim = dim // num_heads
        norm_scale = parse_norm_scale(norm_scale)
        if rope and kernel not in LINEAR_KERNELS:
            raise ValueError(f"rope applies to the linear kernels {LINEAR_KERNELS} (numerator-only rotary "
                             f"embedding), not to kernel={kernel!r}; use rope=False")
        if rope and head_dim % 2:
            raise ValueError(f"rope needs an even head dim (the 2·D NaLa features form channel pairs, half per "
                             f"grid axis), got head dim {head_dim} = {dim}/{num_heads}; use rope=False or "
                             f"an even head dim")
        if regions != 1 and kernel != "nala":
            raise ValueError(f"region states (nala-regions {regions}) apply to NaLa, not to kernel={kernel!r}; "
                             f"use regions=1")
        if regions != 1 and rope:
            raise ValueError("region states and rope do not combine (both rewrite NaLa's state); use one of them")
        check_regions(regions, (regions, regions), regions * regions)   # the value itself: an integer >= 1
        self.num_heads = num_heads
        self.kernel = kernel
        self.regions = regions
        self.norm_scale_mode = norm_scale if isinstance(norm_scale, str) else "fixed"
        fixed = {"sqrt_d": math.sqrt(head_dim), "learned": 1.0}.get(norm_scale, norm_scale)
        self.feature_kwargs = dict(direction=direction, power=power, offset=offset,
                                   norm_scale=fixed, alpha=alpha)
        self.eps = eps
        self.use_gate = gate
        self.rope = rope
        self.recompute = recompute
        self.qkvg = nn.Linear(dim, (4 if gate else 3) * dim)
        self.lepe = nn.Conv2d(dim, dim, 5, padding=2, groups=dim) if lepe else None
        self.out_norm = nn.LayerNorm(dim) if out_norm else None
        self.proj = nn.Linear(dim, dim)
        if self.norm_scale_mode == "learned":
            self.log_norm_scale = nn.Parameter(torch.zeros(num_heads))
            self.reset_norm_scale()
        if regions > 1:
            self.region_logits = nn.Parameter(initial_region_logits(regions, num_heads))
        # Statistics of the query exponent p of the last forward (NaLa only), logged by
        # training: with s = 1 the raw norm saturates tanh for typical head dims.
        self.record_stats = False
        self.last_stats: dict[str, float] = {}

    @torch.no_grad()
    def reset_norm_scale(self) -> None:
        """Learned scale: s_h = the RMS of ‖q‖ over unit-variance white inputs, i.e. the
        Frobenius norm of head h's query rows of ``qkvg`` (bias included), so ‖q‖/s ≈ 1
        at initialisation, where tanh is steep. A DiT block feeds LayerNorm'd tokens
        (unit variance), so this holds for the real inputs; call again after re-initialising
        ``qkvg`` (``DiT.initialize_weights`` does)."""
        if self.norm_scale_mode != "learned":
            return
        c = self.proj.in_features
        h = self.num_heads
        w = self.qkvg.weight[:c].reshape(h, c // h, c)
        b = self.qkvg.bias[:c].reshape(h, c // h)
        rms = (w.square().sum((1, 2)) + b.square().sum(1)).sqrt()
        self.log_norm_scale.copy_(rms.clamp_min(1e-6).log())

    def norm_scale(self) -> torch.Tensor | float:
        """The scale s in use: a float, or (learned) a (H, 1, 1) tensor, one per head."""
        if self.norm_scale_mode == "learned":
            return self.log_norm_scale.exp().view(-1, 1, 1)
        return self.feature_kwargs["norm_scale"]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               grid: tuple[int, int] | None = None) -> torch.Tensor:
        shard = shard_of(grid)   # context parallel: q, k, v are this rank's rows of the grid
        if self.kernel == "softmax":
            return softmax_attention(q, k, v) if shard is None else gathered_softmax(q, k, v, shard)
        if self.kernel == "nala" and self.norm_scale_mode == "learned":
            q = q / self.norm_scale().to(q.dtype)     # NaLa(q/s, s=1) == NaLa(q, s); see the class doc
        if self.regions > 1:
            return region_nala_attention(q, k, v, grid, self.regions, self.region_logits, eps=self.eps,
                                         **self.feature_kwargs)
        if not self.rope:
            if self.kernel == "nala":
                return nala_attention(q, k, v, eps=self.eps, **self.feature_kwargs, shard=shard)
            if shard is not None:
                return sharded_linear_attention(kernel_features(q, self.kernel), kernel_features(k, self.kernel),
                                                v, shard, self.eps).to(v.dtype)
            return linear_attention(q, k, v, kernel=self.kernel, eps=self.eps)
        if shard is not None:
            raise ValueError("rope does not run under context parallel (its angles are per token of one grid): "
                             "use --context-parallel 1 or a model without rope")
        if grid is None or grid[0] * grid[1] != q.shape[-2]:
            raise ValueError(f"rope needs the token grid (h, w) with h*w == N={q.shape[-2]}, got grid={grid}")
        if self.kernel == "nala":
            phi_q, phi_k = nala_features(q, k, **self.feature_kwargs)
        else:
            phi_q, phi_k = kernel_features(q, self.kernel), kernel_features(k, self.kernel)
        angles = rope_angles(grid, phi_q.shape[-1], device=q.device)
        return rope_linear_attention(phi_q, phi_k, v, angles, self.eps).to(v.dtype)

    def exponent(self, q: torch.Tensor) -> torch.Tensor:
        """NaLa's per-token exponent p for queries (B, H, N, D): (B, H, N)."""
        fk = self.feature_kwargs
        s = self.norm_scale()
        s = s.squeeze(-1) if isinstance(s, torch.Tensor) else s
        return nala_exponent(q.float().norm(dim=-1) / s, fk["power"], fk["offset"], 1.0)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        b, n, c = x.shape
        h = self.num_heads
        qkvg = self.qkvg(x)                                            # (B, N, 4C or 3C)
        parts = qkvg.chunk(4 if self.use_gate else 3, dim=-1)          # each (B, N, C)
        q, k, v = (t.reshape(b, n, h, c // h).transpose(1, 2) for t in parts[:3])
        if self.record_stats and self.kernel == "nala":
            with torch.no_grad():
                p = self.exponent(q)
                self.last_stats = {"exponent_mean": p.mean().item(), "exponent_std": p.std().item(),
                                   "saturated": saturated_share(p, self.feature_kwargs["power"],
                                                                self.feature_kwargs["offset"])}
        if self.lepe is not None and (grid is None or grid[0] * grid[1] != n):
            raise ValueError(f"LePE needs the token grid (h, w) with h*w == N={n}, got grid={grid}")
        g = parts[3] if self.use_gate else None
        lepe = (self.lepe.weight, self.lepe.bias) if self.lepe is not None else (None, None)
        norm = (self.out_norm.weight, self.out_norm.bias) if self.out_norm is not None else (None, None)
        if not self.recompute:
            # The plain composition: autograd keeps every intermediate (the reference).
            o = self.attend(q, k, v, grid).transpose(1, 2).reshape(b, n, c)      # (B, N, C)
            norm = None if self.out_norm is None else (*norm, self.out_norm.eps)
            o = gated_tail(o, parts[2], g, grid, None if self.lepe is None else lepe, norm)
            return self.proj(o)                                       # (B, N, C)
        spec = dict(heads=h, grid=grid, parts=len(parts),
                    norm_eps=None if self.out_norm is None else self.out_norm.eps)
        if self._fused_core(q):
            spec["opts"] = fused_opts(eps=self.eps, **self.feature_kwargs)
            scale = self.norm_scale() if self.norm_scale_mode == "learned" else None
            return GatedMiddle.apply(qkvg, None, None, None, scale, *lepe, *norm,
                                     self.proj.weight, self.proj.bias, spec)
        o = self.attend(q, k, v, grid).transpose(1, 2).reshape(b, n, c)          # (B, N, C)
        return GatedMiddle.apply(None, parts[2], g, o, None, *lepe, *norm,
                                 self.proj.weight, self.proj.bias, spec)

    def _fused_core(self, q: torch.Tensor) -> bool:
        """Whether NaLa runs inside ``GatedMiddle`` (the fused CPU path, its state saved)."""
        return (self.kernel == "nala" and not self.rope and self.regions == 1
                and select_nala_impl(q.device.type, q.shape[-1], q.dtype, triton_available(),
                                     q.shape[-2]) == "fused")


def build_attention(attention: str, dim: int, num_heads: int, **options) -> nn.Module:
    """The attention layer named by ``attention`` (one of ``ATTENTIONS``)."""
    if attention == "softmax":
        return SoftmaxAttention(dim, num_heads)
    if attention in LINEAR_KERNELS:
        return GatedLinearAttention(dim, num_heads, kernel=attention, **options)
    if attention == "softmax_gated":
        return GatedLinearAttention(dim, num_heads, kernel="softmax", **options)
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
