"""Does NaLa help? A seeded ablation grid trained through ``train.py``.

The study's code, one module per concern (``experiments/ablation/run.py`` is its command line;
``experiments/ablation/results/`` holds the committed cells and tables, ``README.md`` beside it the
record): ``recipes`` (tasks, variants, names), ``scoring`` (a checkpoint's scores), ``cells`` (the
per-cell JSON store), ``runner`` (one cell, the grid), ``timing`` (isolated step times),
``summary`` (mean ± std over seeds), ``contrasts`` (the 2 x 2's per-seed contrasts), ``compute``
(time to loss, equal compute), ``flops`` (training FLOPs per image at a user's model size),
``tables`` (the markdown, the page block, the curves), ``pages`` (a page's generated blocks,
filled in place) and ``cli``. Imports point down that list's dependencies, never in a circle.

Every *cell* is one (task, variant, seed, lr): one ``train.py`` run to the largest
budget, with a checkpoint at every budget. The learning rate is constant, so the
checkpoint at step S is exactly an S-step run: one training run gives every budget.
Each checkpoint's EMA weights are then scored:

* class-consistency and Fréchet distance in the digits classifier's feature space
  (balanced labelled samples, the demo's sampler and guidance);
* held-out loss: the training objective on the held-out split with fixed timesteps and
  noise (the same draws for every model);
* training loss: mean of the logged loss over the last 100 steps before the budget;
* training time: the summed logged step times up to the budget (no checkpoint/eval).

A cell writes one small JSON (``<out>/cells/<task>/<variant>/seed<k>_lr<lr>.json``);
finished cells are skipped on a rerun, interrupted runs resume from their last
checkpoint, and the table is rebuilt from whatever JSONs exist (``n`` per cell shown).

    python experiments/ablation/run.py run --out runs/ablation --jobs 2            # the grid
    python experiments/ablation/run.py run --out runs/ablation --tasks digits --variants softmax,nala
    python experiments/ablation/run.py table --out experiments/ablation/results \\
        --md experiments/ablation/results/RESULTS.md --page experiments/ablation/README.md
    python experiments/ablation/run.py run --quick --out /tmp/ablation_quick       # smoke (digits + a 64-px canvas)

The canvas ladder (``--tasks canvas64,canvas128``: 1,024 and 4,096 tokens, the same picture as
the 256-token ``canvas``) is sized for about 8 core-hours from scratch; its step times come
from one isolated timing run, so the table can rank time to a held-out loss
(experiments/ablation/ladder.md has the commands and the recipe's arithmetic):

    python experiments/ablation/run.py timing --out runs/ablation --tasks canvas64,canvas128 --variants ladder
    python experiments/ablation/run.py run --out runs/ablation --tasks canvas64,canvas128 --variants ladder \\
        --sweep-lrs "" --jobs 2

The 2 x 2 study (``study64``, ``study128``: held-out loss with the EMA warm-up) and its samples
protocol (``samples8`` -> ``samples16`` -> ``samples32`` -> ``samples64``: whole-frame digits up the
ladder, each rung a cell fine-tuned from the previous one; asking for ``samples64`` runs the lower
rungs first) are in experiments/ablation/README.md, with their commands.

The names below are the study's API (imported on first use, so ``--help`` loads no torch).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENTRY = ROOT / "experiments" / "ablation" / "run.py"   # the command line; a cell runs as `ENTRY cell ...`
RESULTS = ROOT / "experiments" / "ablation" / "results"  # the committed cells, tables and timing
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

from nala_dit._lazy import lazy_exports  # noqa: E402

_NAMES = {
    "cells": ("cell_done", "cell_path", "load_cells", "write_json"),
    "cli": ("main",),
    "compute": ("equal_compute", "steps_to_reference", "time_to_loss"),
    "contrasts": ("contrast_rows",),
    "flops": ("flops_block", "flops_polynomial", "forward_flops", "training_flops"),
    "pages": ("README_END", "README_START", "fill_readme"),
    "recipes": ("BANDS", "DESCRIPTIONS", "GATED_SOFTMAX", "HELDOUT_REPEATS", "LADDER_TASKS", "LADDER_VARIANTS",
                "METRICS", "QUICK", "QUICK_LADDER", "QUICK_SEEDS", "QUICK_TASKS", "QUICK_VARIANTS", "RAW",
                "REMEDY_VARIANTS", "SAMPLES_TASKS", "STUDY_TASKS", "TASK_TITLES", "TASKS", "TWO_BY_TWO",
                "VARIANT_GROUPS", "VARIANTS", "cell_name", "data_flags", "is_canvas", "lr_tag", "recipe_flags",
                "task_recipe"),
    "runner": ("cell_main", "grid", "run_cell", "run_main"),
    "scoring": ("band_edges", "classifier_view", "evaluate_checkpoint", "heldout_loss", "heldout_losses",
                "heldout_set", "log_summary", "reference", "train_log"),
    "summary": ("summarize",),
    "tables": ("plot_curves", "readme_block", "render_table", "write_table"),
    "timing": ("QUICK_TIMING", "TIMING_FILE", "load_timing", "timing_main"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, {name: module for module, names in _NAMES.items()
                                                         for name in names})
