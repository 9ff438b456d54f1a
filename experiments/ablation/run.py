"""The seeded ablation's command line: ``python experiments/ablation/run.py run|table|timing|flops``.

The code is the package ``experiments/ablation/study/`` (one module per concern; its docstring
has the usage, ``--help`` prints it). ``results/`` beside this file holds the committed cells,
tables, timing and FLOPs counts; ``README.md`` is the study's record, whose generated blocks
``table --page`` and ``flops --page`` rewrite.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

from experiments.ablation.study.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
