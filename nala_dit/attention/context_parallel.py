"""Context parallel: one image's token grid split by rows over P processes, the layers
exchanging only what couples tokens (NaLa's small state by all-reduce, conv halos point to
point, softmax's keys and values by gather). The layout, the exchanges, why the gradients
equal one process's, and the model hook: ``README.md`` in this folder ("Context parallel").
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .config import check_parallel_world


def row_split(h: int, parts: int) -> list[int]:
    """Rows per rank of an h-row token grid over ``parts`` ranks: ⌊h/P⌋ each, the first
    ``h mod P`` ranks one more."""
    if parts < 1:
        raise ValueError(f"context parallel needs P >= 1 processes per image, got {parts}")
    if parts > h:
        raise ValueError(f"context parallel P={parts} is larger than the token grid's {h} rows: use "
                         f"--context-parallel {h} or less, or a larger image")
    return [h // parts + (i < h % parts) for i in range(parts)]


class ContextParallel:
    """The handle of this process's context-parallel group: ``size`` P ranks, this one
    ``rank``; ``group`` the torch.distributed group (None with P = 1: nothing exchanged)."""

    def __init__(self, size: int = 1, rank: int = 0, group=None, data_rank: int = 0, data_size: int = 1):
        self.size, self.rank, self.group = size, rank, group
        self.data_rank, self.data_size = data_rank, data_size

    @classmethod
    def from_world(cls, size: int) -> "ContextParallel":
        """Groups of ``size`` consecutive ranks out of the initialised default group (as
        ``accelerate launch`` / torchrun set it up). Every process must call it, in the
        same order (``new_group`` is collective)."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        check_parallel_world(size, world)
        if size == 1:
            rank = dist.get_rank() if world > 1 else 0
            return cls(1, 0, None, rank, world)
        rank = dist.get_rank()
        mine = None
        for first in range(0, world, size):
            group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                mine = group
        return cls(size, rank % size, mine, rank // size, world // size)

    def split(self, h: int, w: int) -> "ShardGrid":
        return ShardGrid(self, h, w)

    def shard(self, x: torch.Tensor, pos: torch.Tensor, grid, patch: int):
        """The model hook: this rank's rows of the latent (B, C, H, W) and of the position
        table (1, h·w, C), and the ``ShardGrid`` the blocks run on."""
        shard = self.split(*grid)
        rows = x[:, :, shard.start * patch:shard.stop * patch]
        return rows, pos[:, shard.start * shard.w:shard.stop * shard.w], shard

    def gather(self, x: torch.Tensor, shard: "ShardGrid") -> torch.Tensor:
        """The model hook: every rank's tokens (B, rows·w, F) → the whole image's (B, h·w, F)."""
        return shard.gather(x)

    def __deepcopy__(self, memo):
        return self          # a process group is shared, never copied (an EMA copy of the model)

    def __repr__(self) -> str:
        return f"ContextParallel(size={self.size}, rank={self.rank}, data {self.data_rank}/{self.data_size})"


def shard_of(grid) -> "ShardGrid | None":
    """The shard a layer runs on, or None when the grid is a whole one."""
    return grid if isinstance(grid, ShardGrid) else None


class WholeGrid:
    """The model hook without context parallel (``DiT.context_parallel``'s default): the
    whole grid on this process, nothing split or gathered."""

    def shard(self, x: torch.Tensor, pos: torch.Tensor, grid, patch: int):
        return x, pos, grid

    def gather(self, x: torch.Tensor, grid) -> torch.Tensor:
        return x

    def __repr__(self) -> str:
        return "WHOLE_GRID"


WHOLE_GRID = WholeGrid()


def enable(model, context: ContextParallel | None) -> None:
    """Run ``model`` (a ``DiT``) split by rows over ``context`` (None or P = 1: the whole grid)."""
    model.context_parallel = context if context is not None and context.size > 1 else WHOLE_GRID


class ShardGrid(tuple):
    """This rank's rows ``[start, stop)`` of an h×w token grid: unpacks as the local
    ``(rows, w)`` the layers' convs and checks use; ``h``, ``tokens`` are the whole grid's."""

    def __new__(cls, context: ContextParallel, h: int, w: int):
        counts = row_split(h, context.size)
        start = sum(counts[:context.rank])
        self = super().__new__(cls, (counts[context.rank], w))
        self.context, self.h, self.w, self.counts = context, h, w, counts
        self.start, self.stop = start, start + counts[context.rank]
        return self

    def __reduce__(self):
        return (ShardGrid, (self.context, self.h, self.w))

    @property
    def tokens(self) -> int:
        return self.h * self.w

    # --------------------------------------------------------------- collectives
    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: the sum over the group (no autograd)."""
        dist.all_reduce(t, group=self.context.group)
        return t

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the group; backward all-reduces the gradient."""
        return _AllReduceSum.apply(t, self)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens (``rows · w`` along ``dim``) → the whole grid's, rank order;
        backward: this rank's slice of the gradient summed over the group (reduce-scatter)."""
        return _GatherTokens.apply(x, self, dim)

    def halo(self, img: torch.Tensor, r: int) -> torch.Tensor:
        """(B, C, rows, w) → (B, C, rows + 2r, w): the r grid rows above and below this
        rank's (zeros past the image's edge, as a conv's zero padding). No autograd."""
        return _halo_forward(img, self, r)

    def halo_backward(self, grad: torch.Tensor, r: int) -> torch.Tensor:
        """The gradient (B, C, rows + 2r, w) of ``halo``'s output → its input's: the halo
        rows' gradients go back to the ranks that own them and are added there."""
        return _halo_backward(grad, self, r)

    def halo_rows(self, img: torch.Tensor, r: int) -> torch.Tensor:
        """``halo`` under autograd."""
        return _Halo.apply(img, self, r)

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.context.size)]
        dist.all_gather(out, t, group=self.context.group)
        return out


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, shard):
        ctx.shard = shard
        return shard.all_reduce_(t.clone())

    @staticmethod
    def backward(ctx, grad):
        return ctx.shard.all_reduce_(grad.contiguous().clone()), None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, dim):
        dim = dim % x.ndim
        ctx.shard, ctx.dim = shard, dim
        most = max(shard.counts) * shard.w
        pad = list(x.shape)
        pad[dim] = most - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad)], dim) if pad[dim] else x
        parts = shard._all_gather(padded)        # all_gather takes equal shapes: pad, then trim
        return torch.cat([p.narrow(dim, 0, n * shard.w) for p, n in zip(parts, shard.counts)], dim)

    @staticmethod
    def backward(ctx, grad):
        # Each rank needs only its own tokens' slice of the gradients summed over the group: a
        # reduce-scatter (every rank's slices padded to the most rows, as in the forward) sends
        # half of what an all-reduce of the whole gradient would.
        shard = ctx.shard
        most = max(shard.counts) * shard.w
        grad = grad.movedim(ctx.dim, 0)
        parts, at = [], 0
        for n in shard.counts:
            part = grad[at:at + n * shard.w]
            at += n * shard.w
            parts.append(torch.cat([part, part.new_zeros(most - len(part), *part.shape[1:])]) if len(part) < most else part)
        mine = grad.new_empty(most, *grad.shape[1:])
        dist.reduce_scatter_tensor(mine, torch.cat(parts).contiguous(), group=shard.context.group)
        n_mine = (shard.stop - shard.start) * shard.w
        return mine[:n_mine].movedim(0, ctx.dim), None, None


def _halo_plan(shard: ShardGrid, r: int):
    return _plan(tuple(shard.counts), shard.context.rank, shard.h, r)


@functools.lru_cache(maxsize=None)
def _plan(counts: tuple, me: int, h: int, r: int):
    """Who sends which rows for an r-row halo: ``(needs, gives)``. ``needs[s]`` lists
    (halo slot 0…2r−1, r above then r below; row in rank s's block) for the rows this rank
    takes from rank s; ``gives[s]`` the rows of this rank's block that rank s takes, in the
    order s lists them. Slots past the image's edge are absent (they stay zero). Only
    neighbours appear unless a block is thinner than r rows. Computed once per grid split
    (every layer and step of a run asks for the same one)."""
    starts = [sum(counts[:s]) for s in range(len(counts))]

    def needs_of(start: int, stop: int) -> dict[int, list[tuple[int, int]]]:
        out: dict[int, list[tuple[int, int]]] = {}
        for i in range(2 * r):
            g = start - r + i if i < r else stop + i - r                # global row
            if 0 <= g < h:
                s = max(j for j, a in enumerate(starts) if a <= g)
                out.setdefault(s, []).append((i, g - starts[s]))
        return out

    needs = needs_of(starts[me], starts[me] + counts[me])             # never itself: halo rows lie outside its block
    gives = {}
    for s in range(len(counts)):
        if s != me:
            theirs = needs_of(starts[s], starts[s] + counts[s]).get(me, [])
            if theirs:
                gives[s] = [row for _, row in theirs]
    return needs, gives


def _swap(shard: ShardGrid, outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor]) -> None:
    """Point to point: send ``outgoing[s]`` to rank s, fill ``incoming[s]`` from it."""
    group = shard.context.group
    ops = [dist.P2POp(dist.isend, t.contiguous(), group=group, group_peer=s) for s, t in outgoing.items()]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=s) for s, t in incoming.items()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _halo_forward(img, shard, r):
    if r == 0:
        return img
    needs, gives = _halo_plan(shard, r)
    halo = img.new_zeros(*img.shape[:-2], 2 * r, img.shape[-1])          # zero past the image's edge
    incoming = {s: img.new_empty(*img.shape[:-2], len(rows), img.shape[-1]) for s, rows in needs.items()}
    _swap(shard, {s: img[..., rows, :] for s, rows in gives.items()}, incoming)
    for s, rows in needs.items():
        halo[..., [i for i, _ in rows], :] = incoming[s]
    return torch.cat([halo[..., :r, :], img, halo[..., r:, :]], dim=-2)


def _halo_backward(grad, shard, r):
    if r == 0:
        return grad
    n = grad.shape[-2] - 2 * r
    needs, gives = _halo_plan(shard, r)
    halo = torch.cat([grad[..., :r, :], grad[..., n + r:, :]], dim=-2)  # the halo slots' gradients
    d_img = grad[..., r:r + n, :].clone()
    incoming = {s: grad.new_empty(*grad.shape[:-2], len(rows), grad.shape[-1]) for s, rows in gives.items()}
    _swap(shard, {s: halo[..., [i for i, _ in rows], :] for s, rows in needs.items()}, incoming)
    for s, rows in gives.items():
        d_img.index_add_(-2, torch.tensor(rows, device=grad.device), incoming[s])
    return d_img


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, img, shard, r):
        ctx.shard, ctx.r = shard, r
        return _halo_forward(img, shard, r)

    @staticmethod
    def backward(ctx, grad):
        return _halo_backward(grad.contiguous(), ctx.shard, ctx.r), None, None


# ------------------------------------------------------------------ layer pieces
def sharded_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, shard: ShardGrid,
                             eps: float) -> torch.Tensor:
    """``functional.normalized_linear_attention`` with the state of all ranks' keys:
    ``S``, ``z`` of the local keys over the global N, all-reduced (autograd). The eager
    path under context parallel (NaLa off the fused CPU path, the ReLU / 1+ELU baselines)."""
    from .functional import _no_autocast

    with _no_autocast(v.device):
        state = shard.all_reduce(phi_k.transpose(-2, -1) @ v.float() / shard.tokens)     # (B, H, F, D)
        z = shard.all_reduce(phi_k.sum(dim=-2, keepdim=True) / shard.tokens)             # (B, H, 1, F)
        num = phi_q @ state
        den = (phi_q * z).sum(dim=-1, keepdim=True) + eps
        return num / den


def gathered_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ShardGrid) -> torch.Tensor:
    """Softmax attention of this rank's queries over every rank's keys and values
    (q, k, v (B, H, rows·w, D); k and v gathered in one exchange)."""
    kv = shard.gather(torch.stack([k, v]), dim=3)                      # (2, B, H, N, D)
    return torch.nn.functional.scaled_dot_product_attention(q, kv[0], kv[1])


def exchanged_numbers(kind: str, tokens: int, hidden: int, heads: int, rows: int | None = None,
                      width: int | None = None, kernel: int = 5) -> int:
    """Numbers one rank sends per layer forward (P = 2, one sample): NaLa's state
    ``H · 2D · (D + 1)`` plus a LePE halo of ⌊k/2⌋ rows of width ``width`` and C channels
    to its one neighbour (``width`` default √tokens); softmax's K/V gather: this rank's
    half of 2 · N · C."""
    d = hidden // heads
    width = width or int(round(tokens ** 0.5))
    if kind == "nala":
        return heads * 2 * d * (d + 1) + (kernel // 2) * width * hidden
    if kind == "softmax":
        return 2 * (tokens // 2) * hidden
    raise ValueError(f"kind must be 'nala' or 'softmax', got {kind!r}")
