"""The seeded ablation study's command line: ``python benchmarks/ablation.py run|table|timing``.

The code lives in the package ``benchmarks/study/`` (one module per concern; its docstring has
the usage). ``benchmarks/ablation/`` beside this file is the study's committed results folder
(cells/, table.json, timing.json, RESULTS.md), not code, which is why the package has another
name. This module re-exports the package's names, so ``import benchmarks.ablation as ablation``
keeps working.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

from benchmarks.study import ENTRY, ROOT  # noqa: E402,F401
from benchmarks.study.cells import cell_done, cell_path, load_cells, write_json  # noqa: E402,F401
from benchmarks.study.cli import main  # noqa: E402,F401
from benchmarks.study.compute import equal_compute, time_to_loss  # noqa: E402,F401
from benchmarks.study.recipes import (  # noqa: E402,F401
    BANDS, DESCRIPTIONS, GATED_SOFTMAX, HELDOUT_REPEATS, LADDER_TASKS, LADDER_VARIANTS, METRICS, QUICK, QUICK_LADDER,
    QUICK_SEEDS, QUICK_TASKS, QUICK_VARIANTS, RAW, REMEDY_VARIANTS, STUDY_TASKS, TASK_TITLES, TASKS, TWO_BY_TWO,
    VARIANT_GROUPS, VARIANTS, cell_name, data_flags, is_canvas, lr_tag, recipe_flags, task_recipe,
)
from benchmarks.study.runner import cell_main, grid, run_cell, run_main  # noqa: E402,F401
from benchmarks.study.scoring import (  # noqa: E402,F401
    band_edges, classifier_view, evaluate_checkpoint, heldout_loss, heldout_losses, heldout_set, log_summary, reference,
    train_log,
)
from benchmarks.study.summary import _fmt, _mean_std, _raw_cell, summarize  # noqa: E402,F401
from benchmarks.study.tables import (  # noqa: E402,F401
    README_END, README_START, fill_readme, plot_curves, readme_block, render_table, write_table,
)
from benchmarks.study.timing import QUICK_TIMING, TIMING_FILE, load_timing, timing_main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
