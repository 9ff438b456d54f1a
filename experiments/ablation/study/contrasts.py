"""The 2 × 2's contrasts, seed by seed: what Mix-FFN does for each attention, the interaction,
and NaLa against softmax with and without the conv.

Seed k of every variant shares the data order and the noise draws, and with the identity
Mix-FFN rule (``--mix-init identity``) a Mix-FFN model starts with exactly its plain twin's
weights. So each contrast is computed within a seed, d_k = Σ sign · value(variant, k), and
reported as the mean ± sample std of d_k over the seeds that have every variant it needs. A
difference is marked as claimed (✔) only with n ≥ 3 seeds and |mean| > 2 · std: the study's
rule for saying one variant beats another.
"""

from __future__ import annotations

import math

from .recipes import BANDS, KID, RAW, SAMPLES_TASKS, STUDY_TASKS, TASKS
from .summary import _mean_std

# (label, ((variant, sign), ...)): the value of a contrast in one seed is Σ sign · metric.
CONTRASTS = (
    ("Mix-FFN's change, softmax", (("softmax_mix", 1), ("softmax", -1))),
    ("Mix-FFN's change, NaLa", (("nala_mix", 1), ("nala", -1))),
    ("interaction: NaLa's change − softmax's", (("nala_mix", 1), ("nala", -1), ("softmax_mix", -1), ("softmax", 1))),
    ("NaLa + Mix-FFN − softmax + Mix-FFN", (("nala_mix", 1), ("softmax_mix", -1))),
    ("NaLa − softmax (DiT's MLP)", (("nala", 1), ("softmax", -1))),
    ("Mix-FFN's change, gated softmax", (("softmax_gated_mix", 1), ("softmax_gated", -1))),
    ("NaLa + Mix-FFN − gated softmax + Mix-FFN", (("nala_mix", 1), ("softmax_gated_mix", -1))),
)
# (metric, column header) of the loss study's contrasts, and of the samples protocol's
CONTRAST_METRICS = ("heldout_loss", *BANDS, RAW)
CONTRAST_HEADERS = ("held-out loss", "low noise", "mid noise", "high noise", "raw weights")
SAMPLE_METRICS = ("class_consistency", "frechet_distance", KID, "heldout_loss")
SAMPLE_HEADERS = ("class-consistency ↑", "Fréchet distance ↓", "KID ↓", "held-out loss ↓")
LOSS_NOTE = ("Held-out loss differences (lower is better, so a negative change is a gain), mean ± std over seeds "
             "of the per-seed difference; ✔ = n ≥ 3 and |mean| > 2 · std, the study's rule for a claim "
             "(experiments/ablation/study/contrasts.py).")
SAMPLE_NOTE = ("Differences of the sample scores (class-consistency: higher is better; the others: lower is "
               "better), mean ± std over seeds of the per-seed difference; ✔ = n ≥ 3 and |mean| > 2 · std, the "
               "study's rule for a claim (experiments/ablation/study/contrasts.py).")
MIN_SEEDS = 3


def _values(cells: list[dict], task: str, budget: int, metric: str) -> dict[tuple[str, int], float]:
    """{(variant, seed): metric at ``budget``} of the task's finished cells at its own lr."""
    lr = TASKS[task]["lr"]
    out = {}
    for c in cells:
        if "error" in c or c["task"] != task or c["lr"] != lr:
            continue
        for row in c["budgets"]:
            if row["budget"] == budget and metric in row and not math.isnan(float(row[metric])):
                out[(c["variant"], c["seed"])] = float(row[metric])
    return out


def contrast(values: dict[tuple[str, int], float], terms) -> dict:
    """Mean, std (ddof 1), n and the seeds of one contrast over the seeds that have every term."""
    seeds = sorted({s for _, s in values})
    seeds = [s for s in seeds if all((v, s) in values for v, _ in terms)]
    diffs = [sum(sign * values[(v, s)] for v, sign in terms) for s in seeds]
    if not diffs:
        return dict(n=0, mean=math.nan, std=math.nan, seeds=[], claimed=False)
    mean, std = _mean_std(diffs)
    claimed = len(diffs) >= MIN_SEEDS and abs(mean) > 2 * std
    return dict(n=len(diffs), mean=mean, std=std, seeds=seeds, claimed=claimed)


def contrast_rows(cells: list[dict], task: str, budget: int, metrics=CONTRAST_METRICS) -> list[dict]:
    """One row per contrast with at least one seed on ``metrics[0]``: {label, metric: contrast(...)}."""
    values = {m: _values(cells, task, budget, m) for m in metrics}
    rows = []
    for label, terms in CONTRASTS:
        row = dict(label=label, **{m: contrast(values[m], terms) for m in metrics})
        if row[metrics[0]]["n"]:
            rows.append(row)
    return rows


def _cell(c: dict) -> str:
    if not c["n"]:
        return "—"
    if c["n"] == 1:
        return f"{c['mean']:+.4f} (n 1)"
    return f"{c['mean']:+.4f} ± {c['std']:.4f} (n {c['n']})" + (" ✔" if c["claimed"] else "")


def contrast_sections(cells: list[dict], heading) -> list[str]:
    """Markdown: per study task and budget, the contrasts of the held-out losses; per rung of the
    samples protocol and budget, the contrasts of the sample scores."""
    lines = []
    for tasks, metrics, headers, note in ((STUDY_TASKS, CONTRAST_METRICS, CONTRAST_HEADERS, LOSS_NOTE),
                                          (SAMPLES_TASKS, SAMPLE_METRICS, SAMPLE_HEADERS, SAMPLE_NOTE)):
        for task in tasks:
            done = [c for c in cells if c["task"] == task and "error" not in c]
            for budget in sorted({r["budget"] for c in done for r in c["budgets"]}):
                rows = contrast_rows(cells, task, budget, metrics)
                if not rows:
                    continue
                lines += [heading(f"{task}, {budget} steps: the 2 × 2's contrasts, seed by seed"), "", note, "",
                          "| contrast | " + " | ".join(headers) + " |", "|---|" + "---|" * len(headers)]
                lines += [f"| {r['label']} | " + " | ".join(_cell(r[m]) for m in metrics) + " |" for r in rows]
                lines.append("")
    return lines
