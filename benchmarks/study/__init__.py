"""Does NaLa help? A seeded ablation grid trained through ``train.py``.

The study's code, one module per concern (``benchmarks/ablation.py`` is its command line):
``recipes`` (tasks, variants, names), ``scoring`` (a checkpoint's scores), ``cells`` (the
per-cell JSON store), ``runner`` (one cell, the grid), ``timing`` (isolated step times),
``summary`` (mean ± std over seeds), ``compute`` (time to loss, equal compute), ``flops``
(training FLOPs per image at a user's model size), ``tables`` (the markdown, the page block,
the curves) and ``cli``.

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

    python benchmarks/ablation.py run --out runs/ablation --jobs 2            # the grid
    python benchmarks/ablation.py run --out runs/ablation --tasks digits --variants softmax,nala
    python benchmarks/ablation.py table --out runs/ablation --md benchmarks/ablation/RESULTS.md --page docs/ablation.md
    python benchmarks/ablation.py run --quick --out /tmp/ablation_quick       # smoke (digits + a 64-px canvas)

The canvas ladder (``--tasks canvas64,canvas128``: 1,024 and 4,096 tokens, the same picture as
the 256-token ``canvas``) is sized for about 8 core-hours from scratch; its step times come
from one isolated timing run, so the table can rank time to a held-out loss
(docs/ablation_ladder.md has the commands and the recipe's arithmetic):

    python benchmarks/ablation.py timing --out runs/ablation --tasks canvas64,canvas128 --variants ladder
    python benchmarks/ablation.py run --out runs/ablation --tasks canvas64,canvas128 --variants ladder \\
        --sweep-lrs "" --jobs 2

The 2 x 2 study (``study64``, ``study128``: held-out loss with the EMA warm-up) and its samples
protocol (``samples8`` -> ``samples16`` -> ``samples32`` -> ``samples64``: whole-frame digits up the
ladder, each rung a cell fine-tuned from the previous one; asking for ``samples64`` runs the lower
rungs first) are on docs/ablation.md, with their commands.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "benchmarks" / "ablation.py"      # the command line; a cell runs as `ENTRY cell ...`
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)
