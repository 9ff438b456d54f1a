"""How the multi-process benchmarks start the processes that measure.

By default every measurement runs in fresh Pythons (``spawn``, or a subprocess), as the
published numbers were taken: each imports torch and the package, about 5 s of CPU, before it
measures. With ``preloaded`` (``--preloaded``, which ``--tiny`` implies) the measuring processes
are forks of one server process that imported ``PRELOAD`` once (multiprocessing's
forkserver, started on first use and reused by every later measurement of this process):
each measurement still runs in processes of its own, with a model, optimizer and process
group of their own, without the start-up. Their peak resident memory (``ru_maxrss``) is not a
fresh process's: a fork counts the server's pages only where it touches them (about 420 MiB
against a fresh process's 700 MiB at the tiny models' build), so the absolute memory columns of
a preloaded run are not comparable with a fresh run's (what a call grows by is).
"""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

# What the server imports once (torch.distributed for the gloo group, the model code).
PRELOAD = ["torch", "torch.distributed", "nala_dit.models.dit"]


def start_processes(fn, args: tuple, nprocs: int, preloaded: bool) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined; an exception in any of them is raised
    here. Fresh Pythons (``spawn``) or, with ``preloaded``, forks of the preloaded server. A
    forkserver this process already runs (with its own preload) is reused as it is."""
    import torch.multiprocessing as mp

    if preloaded:
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver" if preloaded else "spawn")
