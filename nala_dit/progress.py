"""The one progress display of every CLI (torch-free).

On a terminal it is a tqdm bar. Redirected to a file (SLURM, ``nohup``, CI) a bar writes a
carriage-return redraw many times a second, tens of KB for a short run, so there it is a
plain line instead, printed when the count passes each tenth of the total and otherwise
at least and at most once every ``interval`` seconds (default 10, at the next update): a run of
any length writes about 10 lines plus six a minute, and a log never goes quiet for long. A transient bar (``leave=False``: the per-batch sampler
steps under a bar over images) prints nothing off a terminal.

``restart_rate(bar)``: the rate and ETA from here on leave out what came before (a first
step that compiled the model), the elapsed time still counts it.

``watch_progress(callback)``: every bar made inside the block, in this thread, also reports
``(desc, n, total)`` to ``callback`` at each update, disabled and transient bars too (the
web demo's progress bar, ``app.py``, follows ``sample.py``'s bars this way).
"""

from __future__ import annotations

import contextlib
import operator
import sys
import threading
import time

# Seconds between plain lines that fall between two tenths of the total (or without a total).
PLAIN_INTERVAL = 10.0


def progress_bar(iterable=None, *, total=None, desc: str = "", unit: str = "it", initial: int = 0,
                 disable: bool = False, leave: bool = True, file=None, interval: float = PLAIN_INTERVAL):
    """A tqdm bar on a terminal, else ``PlainProgress``; either offers ``update``,
    ``set_postfix``, ``close``, ``with`` and iteration (as tqdm)."""
    file = sys.stderr if file is None else file
    if total is None and iterable is not None:
        total = operator.length_hint(iterable) or None  # reversed(range(T)) has no len, only a hint
    if _is_terminal(file):
        from tqdm.auto import tqdm

        bar = tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, disable=disable, leave=leave,
                   file=file, dynamic_ncols=True)
    else:
        bar = PlainProgress(iterable, total=total, desc=desc, unit=unit, initial=initial,
                            disable=disable or not leave, file=file, interval=interval)
    watchers = getattr(_watching, "callbacks", None)
    return _Watched(bar, tuple(watchers), desc, initial, total) if watchers else bar


def restart_rate(bar) -> None:
    """Rate and ETA of ``bar`` (any ``progress_bar``) from now on: the work done so far, and its
    time, leave them (``train.py --compile``: the first step's compilation is no step time)."""
    bar = getattr(bar, "bar", bar)   # a _Watched bar's own
    if isinstance(bar, PlainProgress):
        bar.rate_start, bar.rate_n = bar.clock(), bar.n
    elif not getattr(bar, "disable", True):   # tqdm: its smoothed rate restarts, as tqdm's own reset() does
        from tqdm.std import EMA

        bar._ema_dn, bar._ema_dt = EMA(bar.smoothing), EMA(bar.smoothing)
        bar.last_print_t, bar.last_print_n = bar._time(), bar.n


_watching = threading.local()


@contextlib.contextmanager
def watch_progress(callback):
    """Inside the block, every bar of this thread also calls ``callback(desc, n, total)``:
    once when it starts and at each update (see the module doc)."""
    callbacks = getattr(_watching, "callbacks", None)
    if callbacks is None:
        callbacks = _watching.callbacks = []
    callbacks.append(callback)
    try:
        yield
    finally:
        callbacks.remove(callback)


class _Watched:
    """A bar that also reports its count to the ``watch_progress`` callbacks."""

    def __init__(self, bar, callbacks, desc, initial, total):
        self.bar, self.callbacks = bar, callbacks
        self.desc, self.n, self.total = desc, initial, total
        self._report()

    def _report(self) -> None:
        for callback in self.callbacks:
            callback(self.desc, self.n, self.total)

    def update(self, n: int = 1) -> None:
        self.bar.update(n)
        self.n += n
        self._report()

    def set_postfix(self, **values) -> None:
        self.bar.set_postfix(**values)

    def close(self) -> None:
        self.bar.close()

    def __iter__(self):
        for item in self.bar:   # the bar counts its own items; this counts them for the callbacks
            yield item
            self.n += 1
            self._report()

    def __enter__(self) -> "_Watched":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def _is_terminal(file) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class PlainProgress:
    """Progress as whole lines at a bounded rate (see the module doc). ``clock`` is
    ``time.monotonic`` unless a test passes its own."""

    def __init__(self, iterable=None, *, total=None, desc="", unit="it", initial=0, disable=False, file=None,
                 interval=PLAIN_INTERVAL, clock=time.monotonic):
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n = initial
        self.disable, self.file, self.interval, self.clock = disable, file or sys.stderr, interval, clock
        self.postfix = ""
        self.start = self.last_time = self.rate_start = clock()
        self.rate_n = initial   # the rate counts from here (restart_rate moves both)
        self.tenth = self._tenths(initial)  # tenths of the total already reached
        self.printed_n = initial
        self.closed = False

    def _tenths(self, n: int) -> int:
        return 10 * n // self.total if self.total else 0

    def update(self, n: int = 1) -> None:
        if self.disable:
            return
        self.n += n
        now = self.clock()
        tenth = self._tenths(self.n)
        if tenth > self.tenth or now - self.last_time >= self.interval:
            self.tenth = tenth
            self._print(now)

    def set_postfix(self, **values) -> None:
        """Shown on the next line (as tqdm's postfix, without forcing a line)."""
        self.postfix = " ".join(f"{k}={v}" for k, v in values.items())

    def _print(self, now: float) -> None:
        elapsed = now - self.start
        done = f"{self.n}/{self.total} {self.unit} ({100 * self.n // self.total}%)" if self.total \
            else f"{self.n} {self.unit}"
        parts = [f"{self.desc}: {done}" if self.desc else done, f"{_clock(elapsed)} elapsed"]
        rate = (self.n - self.rate_n) / (now - self.rate_start) if now > self.rate_start else 0.0
        if rate > 0:
            parts.append(f"{rate:.3g} {self.unit}/s")
            if self.total and self.n < self.total:
                parts.append(f"eta {_clock((self.total - self.n) / rate)}")
        if self.postfix:
            parts.append(self.postfix)
        print(", ".join(parts), file=self.file, flush=True)
        self.last_time, self.printed_n = now, self.n

    def close(self) -> None:
        """A last line when work was done since the previous one (an interrupted run says where it stopped)."""
        if self.closed:
            return
        self.closed = True
        if not self.disable and self.n != self.printed_n:
            self._print(self.clock())

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
