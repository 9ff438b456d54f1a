"""Stopping a run on a cluster's signal: SIGTERM (a preemption, ``scancel``, Slurm's time
limit) or SIGUSR1 (``sbatch --signal=USR1@120``, sent before the limit).

While ``train`` runs, ``StopSignals`` replaces the default action of these signals (which
would end the process at once, losing every step since the last checkpoint) by a note of
the first one received. The step in progress finishes; the flag travels on the collective
every step already makes (``step.shared_verdicts``: the skip decision's gather, so no
collective is added), so every process of a launch sees the request at the same step,
even when the signal reached only one of them; then every process writes the step's
checkpoint (``Run.save``, atomic) and ``train`` raises ``Preempted``, which ``train.py``
turns into one line and exit status ``PREEMPTED_EXIT`` (75, ``EX_TEMPFAIL``: "try again").
A second signal while the checkpoint is written is only counted: the save is never cut,
and a SIGKILL after the grace time finds the previous checkpoint intact (``checkpoint.py``
renames a finished folder into place). Ctrl-C stays an immediate ``KeyboardInterrupt``.
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The exit status of a run stopped by a signal after writing its checkpoint: sysexits.h's
# EX_TEMPFAIL ("a temporary failure: try again"), documented for a requeue (docs/training.md).
PREEMPTED_EXIT = 75


class Preempted(KeyboardInterrupt):
    """SIGTERM or SIGUSR1 stopped every process of the launch at the same step, its checkpoint
    written; the message says which signal, the step and how to continue. ``cli.parse.run_main``
    prints it as one line and returns ``exit_code``; the processes stopped together, so they
    leave their process group together (``together``)."""

    exit_code = PREEMPTED_EXIT
    together = True


class StopSignals:
    """``with StopSignals() as stop:`` notes SIGTERM / SIGUSR1 instead of dying; ``stop.name``
    is the first signal's name (None: none came), ``stop.count`` how many came. The previous
    handlers are back on exit. Outside the main thread (where Python cannot set handlers)
    it notes nothing and the signals keep their actions."""

    def __init__(self):
        self.name: str | None = None
        self.count = 0
        self._previous: dict = {}

    def _note(self, signum, frame) -> None:
        self.count += 1
        if self.name is None:
            self.name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.name is not None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
