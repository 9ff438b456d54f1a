"""What NaLa's query norm does inside a model: per layer and head, the distribution of
‖q‖ and of the exponent ``p = λ(τ + tanh(‖q‖/s))``, the share of saturated tokens (p
within 1 % of its supremum λ(τ + 1), where the norm no longer changes anything), and the
attention-row entropy against ‖q‖. The entropy comes from the explicit N×N weights of the
quadratic reference (small batches and token counts), or, for thousands of tokens, from
``rows`` sampled query rows per image, each row built from the feature maps against every
key (exact: the same weights, one row at a time; tested against the reference). NALA_SPEC.md
§7 explains why this matters: with s = 1 every token of a default DiT saturates.

``experiments/ablation/diagnostics.py`` is the command line; ``collect`` and the plot functions are
the library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..attention import SATURATION, GatedLinearAttention, nala_attention_reference
from ..attention import nala_features


@dataclass
class LayerStats:
    """One NaLa layer's queries on a batch: arrays are (H, B·N) per head."""

    layer: int
    q_norm: np.ndarray
    exponent: np.ndarray
    entropy: np.ndarray | None = None          # row entropy of W (nats): (H, B·N), or (H, B·R) for sampled rows
    rows: np.ndarray | None = None             # the sampled query positions (R,), None = every row
    norm_scale: list[float] = field(default_factory=list)
    max_exponent: float = 4.5
    batch: int = 1                             # images (q_norm holds B·N tokens per head)

    @property
    def entropy_q_norm(self) -> np.ndarray:
        """‖q‖ of the rows ``entropy`` covers, in the same layout."""
        if self.rows is None:
            return self.q_norm
        h = self.q_norm.shape[0]
        per_image = self.q_norm.reshape(h, -1, self.tokens)
        return per_image[:, :, self.rows].reshape(h, -1)

    @property
    def tokens(self) -> int:
        return self.q_norm.shape[1] // self.batch

    def saturated(self) -> np.ndarray:
        """Share of tokens per head whose p is within 1 % of the supremum λ(τ + 1)."""
        return (self.exponent >= self.max_exponent * (1 - SATURATION)).mean(axis=1)

    def summary(self) -> dict:
        out = dict(layer=self.layer, norm_scale=self.norm_scale,
                   q_norm_median=np.median(self.q_norm, axis=1).tolist(),
                   exponent_mean=self.exponent.mean(axis=1).tolist(),
                   exponent_std=self.exponent.std(axis=1).tolist(),
                   saturated=self.saturated().tolist())
        if self.entropy is not None:
            # Spearman-free summary: correlation of entropy with ‖q‖ per head (norm-awareness
            # means larger norms give sharper, lower-entropy rows: a negative number).
            out["entropy_mean"] = self.entropy.mean(axis=1).tolist()
            out["entropy_rows"] = "all" if self.rows is None else len(self.rows)
            out["entropy_vs_norm_corr"] = [float(np.corrcoef(n, e)[0, 1]) if n.std() > 0 and e.std() > 0 else 0.0
                                           for n, e in zip(self.entropy_q_norm, self.entropy)]
        return out


def nala_layers(model: torch.nn.Module) -> list[tuple[int, GatedLinearAttention]]:
    return [(i, b.attn) for i, b in enumerate(model.blocks)
            if isinstance(b.attn, GatedLinearAttention) and b.attn.kernel == "nala"]


@torch.no_grad()
def collect(model, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, entropy: bool = True,
            rows: int | None = None, seed: int = 0) -> list[LayerStats]:
    """Run ``model(x, t, y)`` once and record every NaLa layer's queries.

    ``entropy`` with ``rows=None`` builds the N×N weights of the quadratic reference per
    layer (memory B·H·N²·D floats: small batches and token counts only). ``rows=R`` < N
    takes R query positions (seeded, the same in every image) and builds just those rows
    of W from the feature maps against all N keys (memory B·H·R·N).
    """
    layers = nala_layers(model)
    if not layers:
        raise ValueError("the model has no NaLa attention layer (attention='nala'); nothing to diagnose")
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for i, layer in layers:
        def hook(module, args, i=i):
            x_in = args[0]
            b, n, c = x_in.shape
            h = module.num_heads
            parts = module.qkvg(x_in).chunk(4 if module.use_gate else 3, dim=-1)
            q, k = (p.reshape(b, n, h, c // h).transpose(1, 2).float() for p in parts[:2])
            captured[i] = (q, k, parts[2].reshape(b, n, h, c // h).transpose(1, 2).float())
        hooks.append(layer.register_forward_pre_hook(hook))
    try:
        model(x, t, y)
    finally:
        for hk in hooks:
            hk.remove()
    out = []
    for i, layer in layers:
        q, k, v = captured[i]
        s = layer.norm_scale()
        s_heads = (s.flatten().tolist() if isinstance(s, torch.Tensor) else [float(s)] * layer.num_heads)
        p = layer.exponent(q)                                          # (B, H, N)
        c = layer.config
        stats = LayerStats(i, _per_head(q.norm(dim=-1)), _per_head(p), norm_scale=s_heads,
                           max_exponent=c.power * (c.offset + 1.0), batch=q.shape[0])
        if entropy:
            q_in = q / s if isinstance(s, torch.Tensor) else q        # NaLa(q/s, 1) == NaLa(q, s)
            kw = dict(direction=c.direction, power=c.power, offset=c.offset, alpha=c.alpha, norm_eps=c.norm_eps,
                      norm_scale=1.0 if isinstance(s, torch.Tensor) else s)
            n = q.shape[2]
            if rows is None or rows >= n:
                _, w = nala_attention_reference(q_in, k, v, eps=c.eps, return_weights=True, **kw)
            else:
                picked = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:rows].sort().values
                stats.rows = picked.numpy()
                w = sampled_rows(q_in, k, picked, eps=c.eps, **kw)
            w = w.clamp_min(1e-30)
            stats.entropy = _per_head(-(w * w.log()).sum(-1))
        out.append(stats)
    return out


def sampled_rows(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, eps: float, **feature_kwargs) -> torch.Tensor:
    """Rows ``rows`` of NaLa's normalised weights W, (B, H, R, N): §3's
    ``W_ij = sim(i, j) / (Σ_j sim(i, j) + N·ε)`` with ``sim = φ_q(q_i)·φ_k(k_j)``."""
    phi_q, phi_k = nala_features(q[:, :, rows], k, **feature_kwargs)   # per-token maps: rows first
    sim = phi_q @ phi_k.transpose(-2, -1)
    return sim / (sim.sum(dim=-1, keepdim=True) + k.shape[2] * eps)


def _per_head(x: torch.Tensor) -> np.ndarray:
    """(B, H, N) → (H, B·N) float64 numpy."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).double().cpu().numpy()


def plot_distributions(stats: list[LayerStats], path, title: str = "") -> None:
    """One row per layer: histograms of ‖q‖ and of p, one colour per head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(stats), 2, figsize=(8, 1.9 * len(stats) + 0.6), dpi=90, squeeze=False)
    for row, st in zip(axes, stats):
        for h in range(st.q_norm.shape[0]):
            row[0].hist(st.q_norm[h], bins=40, histtype="step", label=f"head {h}")
            row[1].hist(st.exponent[h], bins=40, histtype="step")
        row[0].set_ylabel(f"layer {st.layer}")
        row[1].axvline(st.max_exponent * (1 - SATURATION), color="k", lw=0.8, ls="--")
        row[1].text(0.02, 0.85, f"saturated {st.saturated().mean():.0%}", transform=row[1].transAxes, fontsize=8)
    axes[-1][0].set_xlabel("‖q‖ per token")
    axes[-1][1].set_xlabel("exponent p  (dashed: 1 % below the maximum)")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_entropy(stats: list[LayerStats], path, title: str = "", bins: int = 12) -> None:
    """Mean attention-row entropy in bins of ‖q‖ (one line per head, one panel per layer),
    with the uniform row's entropy log N for scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(stats))
    rows = math.ceil(len(stats) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 2.5 * rows + 0.5), dpi=90, squeeze=False)
    for ax, st in zip(axes.flat, stats):
        for h in range(st.q_norm.shape[0]):
            centers, means = binned(st.entropy_q_norm[h], st.entropy[h], bins)
            ax.plot(centers, means, marker=".", lw=1)
        ax.set_title(f"layer {st.layer}", fontsize=8)
        ax.set_xlabel("‖q‖", fontsize=8)
    axes[0][0].set_ylabel("row entropy (nats)")
    for ax in axes.flat[len(stats):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def binned(x: np.ndarray, y: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Means of y in equal-count bins of x (bins without points dropped)."""
    edges = np.quantile(x, np.linspace(0, 1, bins + 1))
    idx = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, bins - 1)
    keep = [b for b in range(bins) if (idx == b).any()]
    return (np.array([x[idx == b].mean() for b in keep]), np.array([y[idx == b].mean() for b in keep]))
