"""Backfill the raw-weight held-out loss of ablation cells scored before it was recorded.

``experiments/ablation/run.py`` scores every budget's checkpoint twice on the held-out split: its EMA
weights (``heldout_loss``) and, since the canvas ladder, its raw weights
(``heldout_loss_raw``). Ten cells of ``experiments/ablation/results/cells/`` were trained by a run of an
earlier version (commit 9ad5a28), which scored the EMA weights only. A cell keeps its final
checkpoint (``<out>/work/runs/<task>/<variant>/seed<k>_lr<lr>/checkpoints/``); this script
scores that checkpoint's raw weights with the very function a fresh cell uses
(``ablation.evaluate_checkpoint``, no sampling), writes the number into the budget row of the
checkpoint's step, and notes it in the cell (``"backfilled"``). Those cells' JSONs say so.

It checks first that the checkpoint is the one the cell scored: the EMA held-out loss it
computes must equal the cell's stored ``heldout_loss`` (relative 1e-6; it is deterministic),
else the cell is left alone and the mismatch named.

    python experiments/ablation/backfill.py --out runs/ablation                   # every cell that lacks it
    python experiments/ablation/backfill.py --out runs/ablation --cells canvas64/nala_mix/seed1_lr2e-3

A budget whose checkpoint is gone (``run.py`` keeps only the final one) cannot be
backfilled; its raw loss stays absent (the tables show "–"). To reproduce a backfilled number
from scratch, rerun the cell with ``experiments/ablation/run.py run`` (same task, variant, seed and lr, into a
fresh ``--out``): today's version records ``heldout_loss_raw`` at every budget itself.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)



def note(cell: dict, budgets: list[int]) -> str:
    """The cell's ``"backfilled"`` line: which budgets, and the command that makes them."""
    from experiments.ablation import study as ablation

    name = ablation.cell_name(cell["task"], cell["variant"], cell["seed"], cell["lr"])
    command = f"python experiments/ablation/backfill.py --out OUT --cells {name}"
    if len(budgets) == 1:
        return (f"heldout_loss_raw at budget {budgets[0]}, from the cell's kept final checkpoint: {command} "
                f"(a fresh `experiments/ablation/run.py run` of the cell records it itself)")
    return (f"heldout_loss_raw at budgets {', '.join(map(str, budgets))}, each from the final checkpoint kept while "
            f"that budget was the cell's last: {command} (a fresh `experiments/ablation/run.py run` of the cell records them itself)")


def backfill_cell(out: Path, cell_file: Path) -> list[int]:
    """Fill ``heldout_loss_raw`` of ``cell_file``'s rows whose checkpoint is kept under
    ``out/work/runs``; returns the budgets filled ([] when nothing was missing or kept)."""
    from experiments.ablation import study as ablation
    from nala_dit.training.checkpoint import list_checkpoints, open_checkpoint

    cell = json.loads(cell_file.read_text())
    name = ablation.cell_name(cell["task"], cell["variant"], cell["seed"], cell["lr"])
    rows = {row["budget"]: row for row in cell["budgets"]}
    filled = []
    for ckpt in list_checkpoints(out / "work" / "runs" / name / "checkpoints"):
        row = rows.get(open_checkpoint(ckpt).step)
        if row is None or row.get(ablation.RAW) is not None:
            continue
        scores = ablation.evaluate_checkpoint(cell["task"], ckpt, cell["recipe"], None, None, sample=False)
        if not math.isclose(scores["heldout_loss"], row["heldout_loss"], rel_tol=1e-6):
            raise ValueError(f"{ckpt} is not the checkpoint {cell_file} scored at step {row['budget']}: its EMA "
                             f"held-out loss is {scores['heldout_loss']!r}, the cell's {row['heldout_loss']!r}; "
                             f"nothing was written")
        row[ablation.RAW] = scores["heldout_loss_raw"]
        filled.append(row["budget"])
    if filled:
        before = re.match(r"heldout_loss_raw at budgets? ([\d, ]+)[,:]", cell.get("backfilled", ""))
        earlier = [int(b) for b in before.group(1).replace(",", " ").split()] if before else []
        cell["backfilled"] = note(cell, sorted(set(earlier) | set(filled)))
        ablation.write_json(cell_file, cell)
    return filled


def main(argv=None) -> int:
    from nala_dit.cli.parse import ArgumentParser

    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the ablation's output folder (cells/ and work/)")
    parser.add_argument("--cells", help="comma-separated cell names (task/variant/seed<k>_lr<lr>); default all")
    args = parser.parse_args(argv)
    cells = sorted((args.out / "cells").rglob("*.json")) if not args.cells else \
        [args.out / "cells" / f"{c.strip()}.json" for c in args.cells.split(",") if c.strip()]
    for cell_file in cells:
        if not cell_file.is_file():
            print(f"error: no cell {cell_file}", file=sys.stderr)
            return 1
        try:
            filled = backfill_cell(args.out, cell_file)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        if filled:
            print(f"{cell_file}: heldout_loss_raw backfilled at budget {', '.join(map(str, filled))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
