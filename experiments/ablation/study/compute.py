"""Compute: time to a common held-out loss and held-out loss at equal compute (step times from
the isolated timing run)."""

from __future__ import annotations

import math

from .flops import FLOPS_VARIANTS, flops_polynomial, training_flops
from .recipes import STUDY_TASKS, TASK_TITLES, TASKS, VARIANTS, _tasks
from .summary import _fmt
from .timing import TIMING_FILE

def _timed_rows(rows: list[dict], step_s: dict):
    """Per task with a timing: (task, its rows at the default lr with a held-out loss and a
    timed variant, those variants in ``VARIANTS`` order)."""
    for task in _tasks(r["task"] for r in rows):
        lr = TASKS[task]["lr"]
        mine = [r for r in rows if r["task"] == task and r["lr"] == lr and r["variant"] in step_s.get(task, {})
                and not math.isnan(r["heldout_loss"])]
        variants = sorted({r["variant"] for r in mine}, key=list(VARIANTS).index)
        if variants:
            yield task, mine, variants


def time_to_loss(rows: list[dict], step_s: dict) -> list[dict]:
    """Per task: the held-out loss every variant reaches (the largest of the variants' best
    mean losses), each variant's first budget at or below it and that budget's compute time
    (budget × isolated median step time), with the factor over the fastest variant. Only
    variants with a timing and the default lr; a variant never at the target is omitted."""
    out = []
    for task, mine, variants in _timed_rows(rows, step_s):
        best = {v: min(r["heldout_loss"] for r in mine if r["variant"] == v) for v in variants}
        target = max(best.values())
        found = []
        for v in variants:
            hit = min(r["budget"] for r in mine if r["variant"] == v and r["heldout_loss"] <= target)
            n = next(r["n"] for r in mine if r["variant"] == v and r["budget"] == hit)
            found.append(dict(task=task, variant=v, target=target, budget=hit, n=n,
                              step_s=step_s[task][v], time_s=hit * step_s[task][v]))
        fastest = min(f["time_s"] for f in found)
        for f in sorted(found, key=lambda f: f["time_s"]):
            out.append(dict(f, factor=f["time_s"] / fastest))
    return out


def equal_compute(rows: list[dict], step_s: dict, reference: str | None = None) -> list[dict]:
    """Per task: held-out loss at equal compute. The compute is the cheapest variant's whole
    run (its last budget × its isolated median step time), or with ``reference`` that
    variant's whole run (tasks without it are left out); each variant affords
    ``steps`` = compute / its step time. Only budgets are measured, so each variant gets the
    budgets around its ``steps``: ``below`` (the largest at or under it) and ``above`` (the
    next); a loss that falls with training puts the variant's loss at equal compute between
    them. No interpolation."""
    out = []
    for task, mine, variants in _timed_rows(rows, step_s):
        cost = {v: max(r["budget"] for r in mine if r["variant"] == v) * step_s[task][v] for v in variants}
        if reference is not None and reference not in cost:
            continue
        limit = cost[reference] if reference is not None else min(cost.values())
        for v in sorted(variants, key=lambda v: step_s[task][v]):
            steps = int(limit / step_s[task][v] * (1 + 1e-9))
            by_budget = sorted((r for r in mine if r["variant"] == v), key=lambda r: r["budget"])
            below = [r for r in by_budget if r["budget"] <= steps]
            above = [r for r in by_budget if r["budget"] > steps]
            exact = bool(below) and below[-1]["budget"] == steps       # a measured budget: nothing to bracket
            out.append(dict(task=task, variant=v, compute_s=limit, step_s=step_s[task][v], steps=steps,
                            below=_bracket(below[-1]) if below else None,
                            above=_bracket(above[0]) if above and not exact else None))
    return out


def _bracket(row: dict) -> dict:
    return dict(budget=row["budget"], n=row["n"], heldout_loss=row["heldout_loss"],
                heldout_loss_std=row["heldout_loss_std"])


def _equal_compute_lines(found: list[dict]) -> list[str]:
    lines = ["| variant | step time (s) | steps in that compute | held-out loss at the budgets around it |",
             "|---|---|---|---|"]
    for f in found:
        around = [f"{b['budget']} steps: {_fmt(b['heldout_loss'], b['heldout_loss_std'], 4)} (n = {b['n']})"
                  for b in (f["below"], f["above"]) if b]
        if f["below"] is None:
            around.insert(0, "none measured below")
        lines.append(f"| {f['variant']} | {f['step_s']:.3f} | {f['steps']} | {' · '.join(around)} |")
    return lines


def _timing_sections(rows: list[dict], step_s: dict, heading) -> list[str]:
    """The time-to-loss and equal-compute tables of every task with a timing."""
    lines = []
    found, equal = time_to_loss(rows, step_s), equal_compute(rows, step_s)
    at_softmax = equal_compute(rows, step_s, reference="softmax")
    for task in _tasks(f["task"] for f in found):
        mine = [f for f in found if f["task"] == task]
        same = [f for f in equal if f["task"] == task]
        title = TASK_TITLES.get(task, task)
        lines += [heading(f"{title}: time to held-out loss {mine[0]['target']:.4f}"), "",
                  "The target is the loss every variant reaches (the largest of their best means); compute time "
                  f"= the first budget at or below it × the median step time of the isolated timing run "
                  f"({TIMING_FILE}: one thread, all variants back to back).", ""]
        lines += _time_to_loss_lines(mine) + [""]
        lines += [heading(f"{title}: held-out loss at equal compute ({same[0]['compute_s']:.0f} s)"), "",
                  "The compute is the cheapest variant's whole run. Each variant affords compute / step time "
                  "steps; only budgets are measured, so the table gives the budgets around that count (a loss "
                  "that falls with training lies between them; no interpolation).", ""]
        lines += _equal_compute_lines(same) + [""]
        theirs = [f for f in at_softmax if f["task"] == task]
        if theirs and theirs[0]["compute_s"] != same[0]["compute_s"]:
            lines += [heading(f"{title}: held-out loss at plain softmax's compute ({theirs[0]['compute_s']:.0f} s)"), "",
                      "The compute is plain softmax's whole run: what the other variants do with the seconds "
                      "softmax trains for (a variant run to fewer steps shows its last budget).", ""]
            lines += _equal_compute_lines(theirs) + [""]
    return lines


def _time_to_loss_lines(found: list[dict]) -> list[str]:
    lines = ["| variant | n | first budget at the target | step time (s) | compute time (s) | × fastest |",
             "|---|---|---|---|---|---|"]
    for f in found:
        lines.append(f"| {f['variant']} | {f['n']} | {f['budget']} | {f['step_s']:.3f} | {f['time_s']:.1f} | "
                     f"{f['factor']:.2f} |")
    return lines


REFERENCE = "softmax_mix"   # the 2 x 2's control: DiT's softmax layer with the same Mix-FFN


def steps_to_reference(rows: list[dict], reference: str = REFERENCE) -> list[dict]:
    """Per study task holding the reference's cells: the target is the reference's mean held-out
    loss at its last budget; for each variant (default lr), the first budget whose mean is at or
    below it (None: not reached within its budgets), and what that costs in training FLOPs:
    budget × batch × training FLOPs per image of T/2 at the task's tokens (``flops.py``; None for
    a variant outside the 2 x 2)."""
    out = []
    for task in [t for t in STUDY_TASKS if any(r["task"] == t and r["variant"] == reference for r in rows)]:
        recipe = TASKS[task]
        mine = [r for r in rows if r["task"] == task and r["lr"] == recipe["lr"] and not math.isnan(r["heldout_loss"])]
        last = max(r["budget"] for r in mine if r["variant"] == reference)
        target = next(r["heldout_loss"] for r in mine if r["variant"] == reference and r["budget"] == last)
        tokens = (recipe["image_size"] // 2) ** 2
        for v in sorted({r["variant"] for r in mine}, key=list(VARIANTS).index):
            hits = sorted(r["budget"] for r in mine if r["variant"] == v and r["heldout_loss"] <= target)
            budget = hits[0] if hits else None
            n = next(r["n"] for r in mine if r["variant"] == v and r["budget"] == (budget or max(
                b["budget"] for b in mine if b["variant"] == v)))
            per_image = training_flops(flops_polynomial("T/2", v), tokens) if v in FLOPS_VARIANTS else None
            flops = budget * recipe["batch"] * per_image if budget and per_image else None
            out.append(dict(task=task, variant=v, target=target, reference_budget=last, budget=budget, n=n,
                            training_flops=flops))
    return out


def _reference_sections(rows: list[dict], heading) -> list[str]:
    """The steps-to-reference tables of the study tasks (none before the reference has cells)."""
    found = steps_to_reference(rows)
    lines = []
    for task in _tasks(f["task"] for f in found):
        mine = [f for f in found if f["task"] == task]
        ref = next(f for f in mine if f["variant"] == REFERENCE)
        lines += [heading(f"{TASK_TITLES.get(task, task)}: steps to softmax + Mix-FFN's {ref['reference_budget']}-step "
                          f"held-out loss {ref['target']:.4f}"), "",
                  "The first budget at or below it, and its training FLOPs (budget × batch × T/2's training FLOPs "
                  "per image at this size, `experiments/ablation/run.py flops`).", "",
                  "| variant | n | first budget at the target | training FLOPs | × softmax + Mix-FFN's |", "|---|---|---|---|---|"]
        for f in mine:
            flops = f"{f['training_flops']:.3g}" if f["training_flops"] else "—"
            ratio = f"{f['training_flops'] / ref['training_flops']:.2f}" if f["training_flops"] and ref["training_flops"] \
                else "—"
            budget = f["budget"] if f["budget"] else "not reached"
            lines.append(f"| {f['variant']} | {f['n']} | {budget} | {flops} | {ratio} |")
        lines.append("")
    return lines
