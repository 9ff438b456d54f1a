"""The attention layers of a diffusion transformer: softmax (DiT's) and the gated layer (§4).

The ``nn.Module`` layers that own the projections and pick a function:
``SoftmaxAttention`` (DiT's own, official parameter names ``qkv``/``proj``), the gated
layer of §4 (``GatedAttention``: qkvg projection, LePE, LayerNorm, gate, output
projection) with its two kernels -- ``GatedLinearAttention`` (NaLa, ReLU, 1+ELU) and
``SoftmaxGatedAttention`` (SDPA softmax) -- and ``build_attention``. Every setting of the
gated layer is one ``NaLaConfig`` (``config.py``); the functions the layers call live beside
them in this package (``functional.py``, ``nala/``, ``regions.py``, ``recompute.py``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from .context_parallel import gathered_softmax, shard_of, sharded_linear_attention
from .config import ATTENTIONS, LINEAR_KERNELS, TRITON_MAX_TOKENS, NaLaConfig
from .functional import (
    kernel_features, linear_attention, nala_exponent, nala_features, rope_angles, rope_linear_attention,
    saturated_fraction, softmax_attention,
)
from .nala.backend import CHECK_TOLERANCE, check_once, fused_opts, kernel_error, kernel_opts, nala_attention
from .nala.backend import backend as nala_backend, relative_rms
from .recompute import GatedMiddle, gated_tail
from .nala.tangent import under_transform
from .regions import initial_region_logits, region_nala_attention


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


class GatedAttention(nn.Module):
    """The gated attention layer of §4 around a kernel (``attend``, given by the subclass):

    1. ``[q, k, v, g] = Linear(C → 4C)(x)``   (``g`` only when ``config.gate``)
    2. ``o = attend(q, k, v)`` over heads
    3. ``o += DWConv5×5(v)`` on the token grid (LePE, when ``config.lepe``)
    4. ``o = LayerNorm(o) ⊙ SiLU(g)``         (``config.out_norm``, ``config.gate``)
    5. ``y = Linear(C → C)(o)``

    Parameters: ``qkvg``, ``lepe``, ``out_norm``, ``proj`` (state-dict keys
    ``blocks.{i}.attn.<name>``), the same for every kernel, so an ablation can tell the kernel
    from the extras. ``config``: a ``NaLaConfig``; keyword ``overrides`` change single settings
    (``GatedLinearAttention(dim, heads, lepe=False)``).

    ``recompute`` (default): steps 2–5 run as one autograd function (``GatedMiddle``) that
    keeps only the qkvg projection (and NaLa's small state, or a non-fused core's output)
    for backward and recomputes LePE, LayerNorm, SiLU and, on the fused CPU path, NaLa's
    output; same gradients, 4–5 instead of 8 activations of width C per token.
    ``recompute=False`` is the plain autograd composition (the reference).
    """

    KERNELS: tuple[str, ...] = ()   # the kernels a subclass runs

    def __init__(self, dim: int, num_heads: int, config: NaLaConfig | None = None, *, recompute: bool = True,
                 **overrides):
        super().__init__()
        _check_heads(dim, num_heads)
        self.config = config = NaLaConfig.of(config, **overrides)
        if config.kernel not in self.KERNELS:
            raise ValueError(f"{type(self).__name__} runs the kernels {self.KERNELS}, got kernel={config.kernel!r}")
        self.num_heads = num_heads
        self.recompute = recompute
        self.qkvg = nn.Linear(dim, (4 if config.gate else 3) * dim)
        self.lepe = nn.Conv2d(dim, dim, 5, padding=2, groups=dim) if config.lepe else None
        self.out_norm = nn.LayerNorm(dim) if config.out_norm else None
        self.proj = nn.Linear(dim, dim)
        # Statistics of the query exponent p of the last forward (NaLa only), logged by
        # training: with s = 1 the raw norm saturates tanh for typical head dims. Recorded as
        # one tensor (no .item() in the forward: a compiled step has no graph break there),
        # read as floats by ``last_stats`` outside it.
        self.record_stats = False
        self._stats: torch.Tensor | None = None

    STATS = ("exponent_mean", "exponent_std", "saturated")

    @property
    def last_stats(self) -> dict[str, float]:
        """The statistics ``observe`` recorded in the last forward with ``record_stats``, as
        floats ({} before any)."""
        if self._stats is None:
            return {}
        return dict(zip(self.STATS, self._stats.tolist()))

    @property
    def kernel(self) -> str:
        return self.config.kernel

    @property
    def use_gate(self) -> bool:
        return self.config.gate

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               grid: tuple[int, int] | None = None) -> torch.Tensor:
        """Step 2: the kernel on (B, H, N, D) heads; ``grid`` may be a context-parallel shard."""
        raise NotImplementedError

    def observe(self, q: torch.Tensor) -> None:
        """Called with the queries of every forward (``record_stats``: the subclass's statistics)."""

    def middle(self, qkvg: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid) -> torch.Tensor:
        """Steps 2-5 under ``recompute``: the kernel under autograd, then LePE, LayerNorm, gate
        and projection as ``GatedMiddle``, which saves the kernel's output. A subclass runs
        more of it inside one function where its kernel allows (``GatedLinearAttention``)."""
        o = self.attend(q, k, v, grid).transpose(1, 2).flatten(2)                 # (B, N, C)
        return self._gated_middle(qkvg, grid, o=o)

    def _gated_middle(self, qkvg: torch.Tensor, grid, o=None, opts=None, scale=None) -> torch.Tensor:
        """``GatedMiddle`` from qkvg with the kernel's output ``o``, or (``opts``) with NaLa's
        fused passes inside it (its state saved, the output recomputed)."""
        parts = qkvg.chunk(4 if self.use_gate else 3, dim=-1)
        spec = dict(heads=self.num_heads, grid=grid, parts=len(parts), opts=opts,
                    norm_eps=None if self.out_norm is None else self.out_norm.eps)
        lepe = (self.lepe.weight, self.lepe.bias) if self.lepe is not None else (None, None)
        norm = (self.out_norm.weight, self.out_norm.bias) if self.out_norm is not None else (None, None)
        inputs = (qkvg, None, None, None) if o is None else (None, parts[2], parts[3] if self.use_gate else None, o)
        return GatedMiddle.apply(*inputs, scale, *lepe, *norm, self.proj.weight, self.proj.bias, spec)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        b, n, c = x.shape
        h = self.num_heads
        qkvg = self.qkvg(x)                                            # (B, N, 4C or 3C)
        parts = qkvg.chunk(4 if self.use_gate else 3, dim=-1)          # each (B, N, C)
        q, k, v = (t.reshape(b, n, h, c // h).transpose(1, 2) for t in parts[:3])
        self.observe(q)
        if self.lepe is not None and (grid is None or grid[0] * grid[1] != n):
            raise ValueError(f"LePE needs the token grid (h, w) with h*w == N={n}, got grid={grid}")
        if not self.recompute or torch.compiler.is_compiling() or under_transform(x):
            # The plain composition: autograd keeps every intermediate (the reference). Under
            # torch.compile too: GatedMiddle's backward (torch.autograd.grad) would break the
            # graph. NaLa runs as in eager mode (the fused autograd function on the CPU, which
            # dynamo traces; the custom op of ``nala/triton_op.py`` on CUDA), and the compiler
            # picks what to recompute. Under torch.func transforms and forward AD too: the fused middles have
            # no forward-mode rule, the composition's pieces do (NaLa's: ``nala/tangent.py``).
            o = self.attend(q, k, v, grid).transpose(1, 2).reshape(b, n, c)      # (B, N, C)
            lepe = None if self.lepe is None else (self.lepe.weight, self.lepe.bias)
            norm = None if self.out_norm is None else (self.out_norm.weight, self.out_norm.bias, self.out_norm.eps)
            o = gated_tail(o, parts[2], parts[3] if self.use_gate else None, grid, lepe, norm)
            return self.proj(o)                                       # (B, N, C)
        return self.middle(qkvg, q, k, v, grid)


class GatedLinearAttention(GatedAttention):
    """The gated layer with a linear kernel: NaLa (default), or the ReLU / 1+ELU baselines
    with the same §3 normalisation.

    NaLa's ``norm_scale`` s (spec §7) is a positive float (1 = the paper), ``"sqrt_d"``
    (s = √D) or ``"learned"``: one s = exp(ρ) per head in the parameter
    ``log_norm_scale`` (state-dict key ``blocks.{i}.attn.log_norm_scale``, shape (H,)),
    initialised by ``reset_norm_scale`` and kept out of weight decay by the trainer.
    Since q enters NaLa only through ‖q‖ and q̂ = q/‖q‖, a scale s is applied as
    ``NaLa(q/s)`` with s = 1: every code path (fused, Triton, eager) runs unchanged and
    autograd differentiates through the division.

    ``rope``: the numerator-only 2-D rotary embedding of §7 on the token grid
    (``rope_linear_attention``; needs an even head dim and the grid), its angles in
    ``config.rope_layout`` (``rope_angles``; "released" = the authors' code).

    ``regions`` R (NaLa only; default 1 = one global state): R × R region states mixed per
    query region by the learned non-negative weights ``exp(region_logits)`` (parameter
    ``blocks.{i}.attn.region_logits``, (H, R², R²); ``regions.py``). R = 1 has no such
    parameter and runs plain NaLa, bit for bit.

    ``keep_features`` (default True): on the Triton path with bf16 / fp16 inputs NaLa's
    kernels store φ_q and φ_k (2 · 2D bf16 per token and head) for the backward instead of
    recomputing them there; False trades that memory for the recomputation
    (``nala/triton/README.md``, "Kept features").
    """

    KERNELS = LINEAR_KERNELS

    def __init__(self, dim: int, num_heads: int, config: NaLaConfig | None = None, *, recompute: bool = True,
                 keep_features: bool = True, **overrides):
        super().__init__(dim, num_heads, config, recompute=recompute, **overrides)
        self.keep_features = keep_features
        config = self.config
        head_dim = dim // num_heads
        if config.rope and head_dim % 2:
            raise ValueError(f"rope needs an even head dim (the 2·D NaLa features form channel pairs, half per "
                             f"grid axis), got head dim {head_dim} = {dim}/{num_heads}; use rope=False or "
                             f"an even head dim")
        if config.rope:   # the layout's width rule, checked at build rather than at the first forward
            zeros = torch.zeros(1, 1, 1, head_dim)
            width = (nala_features(zeros, zeros, config)[0] if config.kernel == "nala"
                     else kernel_features(zeros, config.kernel)).shape[-1]
            need = 8 if config.rope_layout == "released" else 4
            if width % need:
                raise ValueError(f"rope_layout {config.rope_layout!r} needs a feature width divisible by {need}, got "
                                 f"{width} (head dim {head_dim} = {dim}/{num_heads}); use "
                                 + ("rope_layout='halves' or " if need == 8 else "")
                                 + "a head dim divisible by 4, or rope=False")
        # NaLa's learned norm scale (the baselines have no norm scale to learn)
        self.learned_scale = config.kernel == "nala" and config.norm_scale == "learned"
        if self.learned_scale:
            self.log_norm_scale = nn.Parameter(torch.zeros(num_heads))
            self.reset_norm_scale()
        if config.regions > 1:
            self.region_logits = nn.Parameter(initial_region_logits(config.regions, num_heads))
        self._backends: dict = {}       # (device, dtype, N ≤ TRITON_MAX_TOKENS) → (NaLa's path, runs the gated kernels)
        self._triton_specs: dict = {}   # triton_middle's per-(device, dtype) options and scale

    @torch.no_grad()
    def reset_norm_scale(self) -> None:
        """Learned scale: s_h = the RMS of ‖q‖ over unit-variance white inputs, i.e. the
        Frobenius norm of head h's query rows of ``qkvg`` (bias included), so ‖q‖/s ≈ 1
        at initialisation, where tanh is steep. A DiT block feeds LayerNorm'd tokens
        (unit variance), so this holds for the real inputs; call again after re-initialising
        ``qkvg`` (``DiT.initialize_weights`` does)."""
        if not self.learned_scale:
            return
        c = self.proj.in_features
        h = self.num_heads
        w = self.qkvg.weight[:c].reshape(h, c // h, c)
        b = self.qkvg.bias[:c].reshape(h, c // h)
        rms = (w.square().sum((1, 2)) + b.square().sum(1)).sqrt()
        self.log_norm_scale.copy_(rms.clamp_min(1e-6).log())

    def norm_scale(self) -> torch.Tensor | float:
        """The scale s in use: a float, or (learned) a (H, 1, 1) tensor, one per head."""
        if self.learned_scale:
            return self.log_norm_scale.exp().view(-1, 1, 1)
        return self.config.norm_scale_for(self.proj.in_features // self.num_heads)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               grid: tuple[int, int] | None = None) -> torch.Tensor:
        config, shard = self.config, shard_of(grid)   # context parallel: q, k, v are this rank's rows
        if self.learned_scale:
            q = q / self.norm_scale().to(q.dtype)     # NaLa(q/s, s=1) == NaLa(q, s); see the class doc
        if config.regions > 1:
            return region_nala_attention(q, k, v, grid, self.region_logits, config)
        if not config.rope:
            if config.kernel == "nala":
                return nala_attention(q, k, v, config, impl=self.backend(q)[0], shard=shard)
            if shard is not None:
                return sharded_linear_attention(kernel_features(q, config.kernel), kernel_features(k, config.kernel),
                                                v, shard, config.eps).to(v.dtype)
            return linear_attention(q, k, v, kernel=config.kernel, eps=config.eps)
        if shard is not None:
            raise ValueError("rope does not run under context parallel (its angles are per token of one grid): "
                             "use --context-parallel 1 or a model without rope")
        if grid is None or grid[0] * grid[1] != q.shape[-2]:
            raise ValueError(f"rope needs the token grid (h, w) with h*w == N={q.shape[-2]}, got grid={grid}")
        if config.kernel == "nala":
            phi_q, phi_k = nala_features(q, k, config)
        else:
            phi_q, phi_k = kernel_features(q, config.kernel), kernel_features(k, config.kernel)
        angles = rope_angles(grid, phi_q.shape[-1], device=q.device, layout=config.rope_layout)
        return rope_linear_attention(phi_q, phi_k, v, angles, config.eps).to(v.dtype)

    def exponent(self, q: torch.Tensor) -> torch.Tensor:
        """NaLa's per-token exponent p for queries (B, H, N, D): (B, H, N)."""
        s = self.norm_scale()
        s = s.squeeze(-1) if isinstance(s, torch.Tensor) else s
        return nala_exponent(q.float().norm(dim=-1) / s, self.config.power, self.config.offset, 1.0)

    def observe(self, q: torch.Tensor) -> None:
        if self.record_stats and self.config.kernel == "nala":
            with torch.no_grad():
                p = self.exponent(q)
                self._stats = torch.stack([p.mean(), p.std(), saturated_fraction(p, self.config.power,
                                                                                 self.config.offset)]).detach()

    def backend(self, q: torch.Tensor) -> tuple[str, bool]:
        """NaLa's path for queries like q (B, H, N, D) and whether the gated kernels
        (``TritonGatedMiddle``) run steps 2-4: chosen once per (device, dtype, N ≤
        ``TRITON_MAX_TOKENS``) by ``nala.backend.backend`` (its Triton first-use check
        included) and kept; the gated kernels pass their own check
        (``gated_triton_passes_check``) and need the full §4 layer (LePE, gate, LayerNorm).
        Under ``torch.compile`` and ``torch.func`` transforms, where checks cannot run,
        ("auto", False): ``nala_attention`` chooses per trace or call."""
        if torch.compiler.is_compiling() or under_transform(q):
            return "auto", False
        key = (q.device, q.dtype, q.shape[-2] <= TRITON_MAX_TOKENS)
        if key not in self._backends:
            config = self.config
            impl = nala_backend(q.device, q.dtype, q.shape[-1], q.shape[-2], kernel_opts(config, q.shape[-1]))
            gated = (impl == "triton" and config.lepe and config.gate and config.out_norm
                     and gated_triton_passes_check(q.device, q.dtype, self.proj.in_features, self.num_heads, config))
            self._backends[key] = impl, gated
        return self._backends[key]

    def middle(self, qkvg: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid) -> torch.Tensor:
        """NaLa on Triton: steps 2-4 in ``TritonGatedMiddle`` (2 + 5 launches between the
        projections); on the fused CPU path: NaLa's passes inside ``GatedMiddle`` (its small
        state saved, not its output); else the base class's."""
        config = self.config
        if config.kernel != "nala" or config.rope or config.regions > 1:
            return super().middle(qkvg, q, k, v, grid)
        impl, gated = self.backend(q)
        if gated and shard_of(grid) is None:
            return self.proj(self.triton_middle(qkvg, grid))
        if impl == "fused":
            return self._gated_middle(qkvg, grid, opts=fused_opts(config, q.shape[-1]),
                                      scale=self.norm_scale() if self.learned_scale else None)
        return super().middle(qkvg, q, k, v, grid)

    def triton_middle(self, qkvg: torch.Tensor, grid) -> torch.Tensor:
        """Steps 2-4 as ``nala/triton/gated.py``'s ``TritonGatedMiddle``."""
        from .nala.triton.gated import TritonGatedMiddle, split_heads
        from .nala.triton.launch import resolve_opts

        config, c, h = self.config, self.proj.in_features, self.num_heads
        # Built once per layer, device and dtype: the resolved options and the constant norm scale.
        key = (qkvg.device, qkvg.dtype, torch.get_float32_matmul_precision(), self.keep_features)
        if key not in self._triton_specs:
            opts = dict(kernel_opts(config, c // h), keep_features=self.keep_features)
            scale = None if self.learned_scale else torch.full((h,), float(config.norm_scale_for(c // h)),
                                                                device=qkvg.device)
            self._triton_specs[key] = (dict(heads=h, norm_eps=self.out_norm.eps,
                                            opts=resolve_opts(split_heads(qkvg, 0, h), opts)), scale)
        spec, scale = self._triton_specs[key]
        if not torch.is_grad_enabled():   # no backward will run (sampling): NaLa keeps no features
            spec = dict(spec, opts=dict(spec["opts"], keep_features=False))
        if self.learned_scale:
            scale = self.log_norm_scale.float().exp()
        with torch.cuda.device(qkvg.device) if qkvg.device.type == "cuda" else contextlib.nullcontext():
            return TritonGatedMiddle.apply(qkvg, scale, self.lepe.weight, self.lepe.bias, self.out_norm.weight,
                                           self.out_norm.bias, dict(spec, grid=tuple(grid)))


_GATED_CHECKS: dict[tuple, str | None] = {}   # key → None (passed) or the cause of the fallback
GATED_CHECK_ERRORS: dict[tuple, float] = {}    # key → the largest relative RMS vs the plain composition
# The token grids of the gated layer's check: 15 tokens (one token range, the single-launch
# forward) and, on CUDA, 1,056 (several ranges: the atomic state passes and the output
# kernel, as N ≥ 1,024 runs). Both run the gated specialisations: q, k, v as strided views of
# qkvg, an fp32 output gradient, dq into the strided buffer (DQ_STRIDED), dv added to the LePE
# term's (ADD_DV). Under the interpreter (CPU) the short grid only: its programs run in Python.
GATED_CHECK_GRIDS = ((3, 5), (32, 33))


def gated_triton_passes_check(device: torch.device, dtype: torch.dtype, dim: int, heads: int,
                              config: NaLaConfig) -> bool:
    """Whether the gated layer's Triton path (``nala/triton/gated.py``) passed its first-use
    check for this key (run once per process; a failure warns once and the layer keeps
    ``GatedMiddle`` over the NaLa call): a fresh layer of this width on a seeded 3 × 5 grid,
    output and input gradient against its plain composition (``recompute=False``) on each
    of ``GATED_CHECK_GRIDS``."""
    return check_once(_GATED_CHECKS, (str(device), dtype, dim, heads, config),
                      lambda: _check_gated(device, dtype, dim, heads, config),
                      f"the gated layer's Triton kernels failed their first-use check on {device} ({dtype}, width "
                      f"{dim}, {heads} heads)",
                      "the layer runs NaLa's kernels with the unfused LePE/LayerNorm/gate")


def first_use_checks() -> list[dict]:
    """Every first-use check of the Triton paths this process ran, as JSON-able rows: the
    NaLa kernels per (device, dtype, head dim, direction) and the gated layer's per (device,
    dtype, width, heads), each with ``result`` "passed" or the cause of its fallback and the
    largest relative RMS against the eager reference it measured (``max_rel_rms``). The GPU
    benchmarks write it into their JSON, so a run whose kernels fell back to the eager
    composition says so beside its times (``benchmarks/tables.py`` puts it above the tables)."""
    from .nala import backend as nala

    rows = [dict(path="NaLa kernels", device=key[0], dtype=str(key[1]).removeprefix("torch."), head_dim=key[2],
                 direction=key[3], result=cause or "passed", max_rel_rms=nala.CHECK_ERRORS.get(key))
            for key, cause in nala._TRITON_CHECKS.items()]
    rows += [dict(path="gated layer kernels", device=key[0], dtype=str(key[1]).removeprefix("torch."), width=key[2],
                  heads=key[3], result=cause or "passed", max_rel_rms=GATED_CHECK_ERRORS.get(key))
             for key, cause in _GATED_CHECKS.items()]
    return rows


def _check_gated(device, dtype, dim, heads, config) -> str | None:
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        fused = GatedLinearAttention(dim, heads, config).to(device)
        plain = GatedLinearAttention(dim, heads, config, recompute=False).to(device)
        plain.load_state_dict(fused.state_dict())
    tol, worst = CHECK_TOLERANCE.get(dtype, 1e-4), 0.0
    for grid in GATED_CHECK_GRIDS if device.type == "cuda" else GATED_CHECK_GRIDS[:1]:
        x = torch.randn(1, grid[0] * grid[1], dim, generator=torch.Generator().manual_seed(grid[1])).to(device)

        def run(layer):
            leaf = x.clone().requires_grad_()
            with torch.enable_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                out = layer(leaf, grid)
                out.float().square().sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)   # a kernel's fault shows here, inside the check
            return out.detach().float(), leaf.grad

        try:
            got = run(fused)
        except Exception as err:  # a compile or launch error: whatever the kernels raise
            return kernel_error(device, f"the gated layer's first-use check ({grid[0]} × {grid[1]} tokens, {dtype}, "
                                        f"width {dim}, {heads} heads)", err)
        for name, g, r in zip(("output", "input gradient"), got, run(plain)):
            err = relative_rms(g, r)
            if not err <= tol:   # also catches NaN
                return (f"{name} differs from the plain composition by relative RMS {err:.1e} (> {tol:.0e}) on "
                        f"{grid[0]} × {grid[1]} tokens")
            worst = max(worst, err)
    GATED_CHECK_ERRORS[(str(device), dtype, dim, heads, config)] = worst
    return None


class SoftmaxGatedAttention(GatedAttention):
    """The gated layer with SDPA softmax as its kernel (the model's ``softmax_gated``): the
    ablation that tells the kernel from the extras (qkvg, LePE, LayerNorm, gate). Under
    context parallel its queries attend over every rank's keys and values."""

    KERNELS = ("softmax",)

    def __init__(self, dim: int, num_heads: int, config: NaLaConfig | None = None, *, recompute: bool = True,
                 **overrides):
        super().__init__(dim, num_heads, config, recompute=recompute, **{"kernel": "softmax", **overrides})

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               grid: tuple[int, int] | None = None) -> torch.Tensor:
        shard = shard_of(grid)
        return softmax_attention(q, k, v) if shard is None else gathered_softmax(q, k, v, shard)


def build_attention(attention: str, dim: int, num_heads: int, config: NaLaConfig | None = None,
                    **overrides) -> nn.Module:
    """The attention layer named by ``attention`` (one of ``ATTENTIONS``) with the gated
    layer's settings ``config`` (and keyword ``overrides``); the kernel follows ``attention``."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if attention == "softmax":
        return SoftmaxAttention(dim, num_heads)
    if attention == "softmax_gated":
        return SoftmaxGatedAttention(dim, num_heads, config, **overrides)
    return GatedLinearAttention(dim, num_heads, config, kernel=attention, **overrides)
