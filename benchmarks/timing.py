"""Timing of one call, in one place for every benchmark: wall time and, on CUDA, GPU time.

``timed_call(fn, device)`` synchronizes, runs ``fn`` once and synchronizes again; it returns
the wall time (seconds, what the host waited: launch overhead included) and, on CUDA, the
GPU time in milliseconds between two CUDA events recorded around the call on the current
stream (what the GPU spent from the first kernel's queueing point to the last one's end;
with the host slower than the kernels, the GPU idles in between and the two agree). On the
CPU the GPU time is ``None`` (``null`` in the JSON). Warm-up calls are the caller's:
``timed_call`` times exactly one call.

Where the host issues kernels more slowly than the GPU runs them (small calls), the event
time includes the GPU's idle gaps between kernels. ``kernel_ms`` leaves them out: the sum
of the durations of the GPU-side events (kernels, copies, fills) that ``torch.profiler``
saw during a call, per call, which is what the kernels themselves cost.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn, device: torch.device) -> tuple[float, float | None]:
    """(wall seconds, GPU milliseconds or None) of one call of ``fn``."""
    sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start, None
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    begin.record()
    fn()
    end.record()
    sync(device)
    return time.perf_counter() - start, begin.elapsed_time(end)


def median_or_none(values):
    """Median of a list whose entries are all numbers, else None (GPU times on the CPU)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def time_calls(fn, device: torch.device, repeats: int, warmup: int = 1) -> dict:
    """``warmup`` untimed calls, then ``repeats`` timed ones: median and least wall ms, median GPU ms."""
    for _ in range(warmup):
        fn()
    walls, gpus = [], []
    for _ in range(repeats):
        wall, gpu = timed_call(fn, device)
        walls.append(1e3 * wall)
        gpus.append(gpu)
    return dict(wall_ms=statistics.median(walls), wall_min_ms=min(walls), gpu_ms=median_or_none(gpus))


def device_events(prof):
    """The GPU-side events (kernels, copies, fills) of a finished ``torch.profiler`` run."""
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def kernel_ms(fn, device: torch.device, calls: int = 3) -> float | None:
    """Summed duration of the GPU events of one call of ``fn`` (mean of ``calls``), ms; None on the CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    return sum(e.time_range.elapsed_us() for e in device_events(prof)) / calls / 1e3
