"""Region states: NaLa with one key-value state per region of the token grid (R × R regions,
their states mixed per query region by learned non-negative weights ``exp(region_logits)``),
linear in N; R = 1 is plain NaLa. The construction, the initial weights and the fine-tuning
rule across R: ``README.md`` in this folder ("Region states").
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch.autograd.function import once_differentiable

from .context_parallel import shard_of
from .config import EPS, NaLaConfig, check_nala_regions
from .functional import _check_qkv, _no_autocast, nala_features, nala_similarity_reference
from .nala.fused import fused_backward, fused_opts, fused_output, fused_state
from .nala.tangent import under_transform

REGION_DECAY = 1.0    # ρ_ir = −REGION_DECAY · distance of region centres (in image sides) at initialisation


def region_bounds(size: int, regions: int) -> list[int]:
    """The R + 1 band edges of one grid side: ``⌊i·size/R⌋``, i = 0..R."""
    return [i * size // regions for i in range(regions + 1)]


def check_regions(regions: int, grid: tuple[int, int] | None, tokens: int) -> tuple[int, int]:
    """The grid (h, w) for ``regions`` per side; a ValueError naming the fix otherwise."""
    check_nala_regions(regions)   # an integer in 1..MAX_NALA_REGIONS: refused before any weight is made
    if grid is None or grid[0] * grid[1] != tokens:
        raise ValueError(f"region states need the token grid (h, w) with h*w == N={tokens}, got grid={grid}")
    h, w = grid
    if regions > min(h, w):
        raise ValueError(f"nala-regions {regions} cuts each side into {regions} bands, but the token grid is "
                         f"{h}x{w}: use at most {min(h, w)} regions per side at this size")
    return h, w


@lru_cache(maxsize=64)
def region_layout(grid: tuple[int, int], regions: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """``(order, region, sizes)`` of an h × w grid cut into R × R regions:

    * ``order`` (N,): token indices sorted by region (row-major inside each region), so the
      tokens of region r are ``order[start_r : start_r + sizes[r]]``;
    * ``region`` (N,): the region of each token in grid order;
    * ``sizes``: the token count of each region, in region order.
    """
    h, w = grid
    rows = torch.bucketize(torch.arange(h), torch.tensor(region_bounds(h, regions)[1:]), right=True)
    cols = torch.bucketize(torch.arange(w), torch.tensor(region_bounds(w, regions)[1:]), right=True)
    region = (rows[:, None] * regions + cols[None, :]).reshape(-1)
    order = torch.argsort(region, stable=True)
    sizes = tuple(torch.bincount(region, minlength=regions * regions).tolist())
    return order, region, sizes


def region_centres(regions: int) -> torch.Tensor:
    """(R², 2) centres of the regions in fractions of the image side (row, column)."""
    c = (torch.arange(regions, dtype=torch.float64) + 0.5) / regions
    return torch.stack(torch.meshgrid(c, c, indexing="ij"), -1).reshape(-1, 2)


def initial_region_logits(regions: int, heads: int) -> torch.Tensor:
    """ρ for a fresh layer, (H, R², R²) fp32: minus the distance of region centres (see module doc)."""
    c = region_centres(regions)
    rho = -REGION_DECAY * torch.cdist(c, c)
    return rho.float().expand(heads, -1, -1).clone()


def remap_region_logits(rho: torch.Tensor, regions: int) -> torch.Tensor:
    """Logits of R_old × R_old regions, (H, R_old², R_old²), for ``regions`` per side: each new
    region takes the old region holding its centre (exact when R_new is a multiple of R_old)."""
    old = math.isqrt(rho.shape[-1])
    if old * old != rho.shape[-1] or rho.shape[-2] != rho.shape[-1]:
        raise ValueError(f"region logits must be (H, R², R²), got {tuple(rho.shape)}")
    parent = (region_centres(regions) * old).floor().long().clamp_(max=old - 1)   # (R_new², 2) old (row, col)
    index = parent[:, 0] * old + parent[:, 1]
    return rho[:, index][:, :, index].clone()


def _mix(weights: torch.Tensor, per_region: torch.Tensor) -> torch.Tensor:
    """Σ_r w_ir X_r: (H, R², R²) × (B, H, R², ...) → (B, H, R², ...)."""
    b, h, r = per_region.shape[:3]
    flat = per_region.reshape(b, h, r, -1)
    return torch.einsum("hir,bhrx->bhix", weights, flat).reshape(per_region.shape)


def _by_region(x: torch.Tensor, order: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """The token slices of (B, H, N, F) per region, in region order."""
    return list(x.index_select(2, order.to(x.device)).split(sizes, dim=2))


def region_nala_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    logits: torch.Tensor,
    config: NaLaConfig | None = None,
    *,
    impl: str = "fused",
    **overrides,
) -> torch.Tensor:
    """NaLa with R × R region states mixed by ``exp(logits)`` (README.md, "Region states").

    q, k, v: (B, H, N, D) on the row-major ``grid``; ``logits``: (H, R², R²); ``config``
    (``NaLaConfig``, keyword ``overrides`` such as ``regions=2``): R and the §2 / §3
    constants. Returns (B, H, N, D) in v's dtype; features, states, mixing and division in
    fp32; no N × N tensor is formed. ``impl``: ``"fused"`` (default) runs the fused passes
    of ``nala/fused.py`` on the tokens laid out region by region (``_FusedRegionNaLa``: token
    chunks, features recomputed in backward, never stored); ``"eager"`` is plain autograd
    over NaLa's features (``nala_features``), the readable form the tests compare it with.
    """
    _check_qkv(q, k, v)
    config = NaLaConfig.of(config, **overrides)
    regions, eps = config.regions, config.eps
    b, h, n, d = q.shape
    shard = shard_of(grid)     # context parallel: q, k, v are this rank's rows of the whole grid
    check_regions(regions, grid if shard is None else (shard.h, shard.w), n if shard is None else shard.tokens)
    r2 = regions * regions
    if logits.shape != (h, r2, r2):
        raise ValueError(f"region logits must be (H, R², R²) = ({h}, {r2}, {r2}), got {tuple(logits.shape)}")
    if shard is not None:
        return _sharded_region_attention(q, k, v, shard, logits, config)
    order, _, sizes = region_layout(tuple(grid), regions)
    if impl not in ("fused", "eager"):
        raise ValueError(f"impl must be 'fused' or 'eager', got {impl!r}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, logits))
    if under_transform(q, k, v, logits):      # torch.func / forward AD: the composition has the rules
        impl, needs_grad = "eager", True
    if impl == "fused" or not needs_grad:     # without gradients (sampling) always the fused passes
        return _FusedRegionNaLa.apply(q, k, v, logits, (tuple(grid), regions), fused_opts(config, d))
    with _no_autocast(q.device):
        phi_q, phi_k = nala_features(q.float(), k.float(), config)
        v1 = torch.cat([v.float(), v.new_ones(b, h, n, 1, dtype=torch.float32)], -1)   # [v | 1]: S and z at once
        keys, values = _by_region(phi_k, order, sizes), _by_region(v1, order, sizes)
        if len(set(sizes)) == 1:    # equal regions: one batched GEMM
            states = torch.stack(keys, 2).transpose(-2, -1) @ torch.stack(values, 2)
        else:
            states = torch.stack([kr.transpose(-2, -1) @ vr for kr, vr in zip(keys, values)], 2)
        mixed = _mix(logits.float().exp(), states / n)                      # (B, H, R², 2D, D+1)
        queries = _by_region(phi_q, order, sizes)
        if len(set(sizes)) == 1:
            num_den = torch.stack(queries, 2) @ mixed                       # (B, H, R², n_r, D+1)
            num_den = num_den.flatten(2, 3)
        else:
            num_den = torch.cat([qr @ mixed[:, :, i] for i, qr in enumerate(queries)], 2)
        out = num_den[..., :d] / (num_den[..., d:] + eps)                   # region order
        return _grid_order(out, order).to(v.dtype)


def _sharded_region_attention(q, k, v, shard, logits, config: NaLaConfig) -> torch.Tensor:
    """Region states under context parallel (autograd, with or without gradients): the
    rank's keys add to the states of the regions of the whole grid its rows fall in, over
    the whole grid's N; the states are all-reduced (backward: their gradient); each local
    query reads its region's mix. Exchanged: R² states, R² × H × 2D × (D+1) numbers."""
    b, h, n, d = q.shape
    regions, eps = config.regions, config.eps
    _, region, _ = region_layout((shard.h, shard.w), regions)
    local = region[shard.start * shard.w:shard.stop * shard.w].to(q.device)      # (n,) this rank's regions
    with _no_autocast(q.device):
        phi_q, phi_k = nala_features(q.float(), k.float(), config)
        v1 = torch.cat([v.float(), v.new_ones(b, h, n, 1, dtype=torch.float32)], -1)
        index = [(local == r).nonzero().squeeze(1) for r in range(regions * regions)]
        states = torch.stack([phi_k.index_select(2, i).transpose(-2, -1) @ v1.index_select(2, i)
                              for i in index], 2)                             # (B, H, R², 2D, D+1); 0 off this rank
        mixed = _mix(logits.float().exp(), shard.all_reduce(states / shard.tokens))
        present = [r for r, i in enumerate(index) if len(i)]
        num_den = torch.cat([phi_q.index_select(2, index[r]) @ mixed[:, :, r] for r in present], 2)
        out = num_den[..., :d] / (num_den[..., d:] + eps)                   # tokens by region
        return _grid_order(out, torch.cat([index[r] for r in present])).to(v.dtype)


@lru_cache(maxsize=64)
def _padded_layout(grid: tuple[int, int], regions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gather, scatter)`` for the region-major padded layout (B, H·R², m, D), m the largest
    region: ``gather`` (R² · m,) picks grid tokens region by region, index N (an appended zero
    token) where a region is shorter than m; ``scatter`` (N,) is each grid token's place in it."""
    order, _, sizes = region_layout(grid, regions)
    m, n = max(sizes), len(order)
    gather = torch.full((len(sizes), m), n, dtype=torch.long)
    scatter = torch.empty(n, dtype=torch.long)
    start = 0
    for r, size in enumerate(sizes):
        tokens = order[start:start + size]
        gather[r, :size] = tokens
        scatter[tokens] = r * m + torch.arange(size)
        start += size
    return gather.reshape(-1), scatter


class _Mixer:
    """What the fused passes call between their key and query halves (the protocol of
    ``context_parallel.ShardGrid``: ``tokens`` and an in-place ``all_reduce_``), used here to
    mix region states. Forward: the R² region sums over N → ``M_i = Σ_r w_ir S_r`` (S kept).
    Backward: ∂L/∂M (over N) → ∂L/∂S_r = Σ_i w_ir ∂L/∂M_i for the key pass (∂L/∂M kept)."""

    def __init__(self, weights: torch.Tensor, tokens: int, backward: bool):
        self.weights, self.tokens, self.backward = weights, tokens, backward
        self.kept = None

    def all_reduce_(self, state: torch.Tensor) -> torch.Tensor:
        h, r2 = self.weights.shape[:2]
        two, b = state.shape[:2]
        per_region = state.view(two, b, h, r2, *state.shape[3:])
        self.kept = per_region.clone()
        pattern = "hir,tbhixy->tbhrxy" if self.backward else "hir,tbhrxy->tbhixy"
        per_region.copy_(torch.einsum(pattern, self.weights, self.kept))
        return state


class _FusedRegionNaLa(torch.autograd.Function):
    """Region states on the fused passes: q, k, v laid out region by region and padded with
    zero tokens to the largest region, (B, H·R², m, D), so every region is a "head" of
    ``fused_state`` / ``fused_output`` / ``fused_backward`` and ``_Mixer`` mixes between their
    halves. A zero token has zero features: it adds nothing to a state, and its output
    (and so its gradient) is dropped. Saved: the padded q, k, v, the R² states, the mixed
    states and the denominator; the features are recomputed in backward."""

    @staticmethod
    def forward(ctx, q, k, v, logits, layout, opts):
        b, h, n, d = q.shape
        gather, scatter = (t.to(q.device) for t in _padded_layout(*layout))
        r2 = layout[1] ** 2

        def padded(t):   # (B, H, N, D) -> (B, H·R², m, D)
            t = torch.cat([t, t.new_zeros(b, h, 1, d)], 2).index_select(2, gather)
            return t.reshape(b, h * r2, -1, d)

        qp, kp, vp = padded(q), padded(k), padded(v)
        weights = logits.detach().float().exp()
        mixer = _Mixer(weights, n, backward=False)
        with _no_autocast(q.device):
            mixed = fused_state(kp, vp, opts, shard=mixer)            # (2, B, H·R², D, D+1)
            out, den = fused_output(qp, mixed, opts)
        ctx.save_for_backward(qp, kp, vp, mixed, den, mixer.kept, weights, scatter)
        ctx.opts, ctx.shape = opts, (b, h, n, d, r2)
        return out.reshape(b, h, -1, d).index_select(2, scatter).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        qp, kp, vp, mixed, den, states, weights, scatter = ctx.saved_tensors
        b, h, n, d, r2 = ctx.shape
        m = qp.shape[2]
        g = grad_out.new_zeros(b, h, r2 * m, d)
        g[:, :, scatter] = grad_out
        mixer = _Mixer(weights, n, backward=True)
        need = ctx.needs_input_grad
        with _no_autocast(grad_out.device):
            dq, dk, dv = fused_backward(qp, kp, vp, mixed, den, g.reshape(b, h * r2, m, d).float(), ctx.opts,
                                        need[:3], shard=mixer)
            d_mixed = mixer.kept                                          # ∂L/∂M_i / N, (2, B, H, R², D, D+1)
            d_logits = None
            if need[3]:
                d_w = torch.einsum("tbhixy,tbhrxy->hir", d_mixed, states) * n
                d_logits = d_w * weights

        def unpadded(t, like):
            return None if t is None else t.reshape(b, h, r2 * m, d).index_select(2, scatter).to(like.dtype)

        return unpadded(dq, grad_out), unpadded(dk, grad_out), unpadded(dv, grad_out), d_logits, None, None


def _grid_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Tokens of (B, H, N, F) in region order back to grid order."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return x.index_select(2, inverse.to(x.device))


def region_attention_reference(q, k, v, grid, regions, logits, *, eps: float = EPS, **feature_kwargs):
    """The explicit N × N form (tests only): ``W_ij = w[reg(i), reg(j)] · sim(i, j)``, with
    ``sim`` written from its definition (``nala_similarity_reference``, independent of the
    feature lift), normalised per row with ``N·ε`` as in spec §3. Runs in fp64 for fp64 inputs."""
    n = q.shape[-2]
    check_regions(regions, grid, n)
    _, region, _ = region_layout(tuple(grid), regions)
    region = region.to(q.device)
    sim = nala_similarity_reference(q, k, **feature_kwargs)                 # (B, H, N, N)
    w = logits.to(sim.dtype).exp()[:, region][:, :, region]                 # (H, N, N)
    sim = sim * w
    weights = sim / (sim.sum(-1, keepdim=True) + n * eps)
    return weights @ v.to(sim.dtype)
