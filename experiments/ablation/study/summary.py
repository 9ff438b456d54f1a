"""Mean ± sample std over seeds, one row per (task, variant, lr, budget), and its formatting."""

from __future__ import annotations

import math

from .recipes import BANDS, KID, METRICS, RAW, VARIANTS


def _mean_std(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
    return mean, std


def summarize(cells: list[dict]) -> list[dict]:
    """One row per (task, variant, lr, budget): mean, std (ddof 1) and n over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        if "error" in c:
            continue
        for row in c["budgets"]:
            groups.setdefault((c["task"], c["variant"], c["lr"], row["budget"]), []).append(row)
    order = {v: i for i, v in enumerate(VARIANTS)}
    rows = []
    for (task, variant, lr, budget), items in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][3], kv[0][2], order.get(kv[0][1], 99))):
        row = dict(task=task, variant=variant, lr=lr, budget=budget, n=len(items))
        for m in METRICS:
            row[m], row[m + "_std"] = _mean_std([float(it[m]) for it in items])
        # Raw-weight held-out loss, the noise bands and KID: cells scored before them, or on a
        # recipe without them, lack them (n counts those that have them).
        for key in (RAW, *BANDS, KID):
            have = [float(it[key]) for it in items if key in it]
            row[key], row[key + "_std"] = _mean_std(have) if have else (math.nan, math.nan)
            row[key + "_n"] = len(have)
        rows.append(row)
    return rows


def _fmt(mean: float, std: float, digits: int) -> str:
    if math.isnan(mean):
        return "—"  # not measured at this budget (samples are drawn at the recipe's sample budgets)
    if math.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _raw_cell(row: dict, key: str = RAW, digits: int = 4) -> str:
    """The raw-weight held-out loss (or another value not every cell has: ``key``), with its own n
    when fewer cells than the row's have it."""
    n = row.get(key + "_n", 0)
    if not n:
        return "—"
    text = _fmt(row[key], row[key + "_std"], digits)
    return text if n == row["n"] else f"{text} (n = {n})"


def _bands_cell(row: dict) -> str:
    """The held-out loss in the low · mid · high noise bands (— for a row without bands)."""
    return " · ".join(_raw_cell(row, key) for key in BANDS)
