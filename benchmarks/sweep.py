"""The model sweep: DiT against NaLaDiT at the batches people train and sample at.

Cells (``--cells SIZE:PX:BATCH,...``; default: XL/2 at 256 px batch 8/32/128, at
512 px batch 8/32, S/2 at 256 px batch 8/128), each for a training step (forward, MSE,
backward, AdamW) and a sampling forward (``no_grad``), bf16 weights and inputs, for

* ``DiT`` with SDPA forced onto cuDNN (``sdpa=cudnn``) and onto FlashAttention (``flash``)
  (on the CPU: SDPA's own pick, ``default``),
* ``NaLaDiT`` (NaLa on the Triton kernels on CUDA, ``NALA_TRITON_VARIANT=baseline``: the
  kernels before the rework, ``benchmarks/baseline_nala.py``; its
  gated layers fused, or ``--gated-layer unfused``: their plain composition),

in each of ``--modes``: ``eager``; ``default`` (``torch.compile`` through
``nala_dit.models.compile.compile_model``, as ``train.py --compile`` / ``sample.py --compile``);
``reduce-overhead`` (sampling only: inductor's CUDA graphs, as ``sample.py --cuda-graphs``).
Cells run in ``--cells`` order, each eager first (a model is built once per family, size and
resolution for its eager cells), then compiled. A compile of XL/2 takes tens of seconds on a
fresh machine, so compiled modes run only at the cells of ``--compile-cells`` (default XL/2
at 256 px, batch 32) and for DiT on one SDPA backend (the first: cuDNN); the cells left out
are not listed.

Per cell: warm-up (1 call eager, 2 compiled: the first is recorded as ``compile_s``, 3
with CUDA graphs: warm-up, capture, first replay), then ``--repeats`` calls timed alone
(``benchmarks/timing.py``: wall ms and, on CUDA, GPU ms from CUDA events), median; peak
memory on CUDA. A cell is stopped after ``--cell-cap-s`` seconds (SIGALRM) and recorded as
skipped with the reason, as is one that runs out of memory or raises; ``--budget-s``
starts no new cell after that many seconds; the JSON is rewritten after every cell.

    python benchmarks/sweep.py --device cuda --modes eager,default --out runs/model_sweep.json
    python benchmarks/sweep.py --device cuda --modes reduce-overhead --tasks sample --out runs/graphs.json
    python benchmarks/sweep.py --smoke --out runs/sweep.json     # CPU, toy model, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benchmarks.attention import DTYPES  # noqa: E402
from benchmarks.baseline_nala import install_if_asked  # noqa: E402

install_if_asked()   # NALA_TRITON_VARIANT=baseline: the kernels before the rework (the model A/B)
from benchmarks.launch import SMOKE  # noqa: E402
from benchmarks.model import make_batch, sample_step, train_step  # noqa: E402
from benchmarks.timing import time_calls  # noqa: E402
from nala_dit.attention import first_use_checks  # noqa: E402
from nala_dit.models.compile import compile_model  # noqa: E402
from nala_dit.models.dit import create_model  # noqa: E402

CELLS = "XL/2:256:8,XL/2:256:32,XL/2:256:128,XL/2:512:8,XL/2:512:32,S/2:256:8,S/2:256:128"
SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
WARMUP = {"eager": 1, "default": 2, "reduce-overhead": 3}


class CellTimeout(Exception):
    pass


@contextlib.contextmanager
def time_cap(seconds):
    """Raise CellTimeout in the main thread after ``seconds`` (0: no cap)."""
    def expire(signum, frame):
        raise CellTimeout(f"cell took > --cell-cap-s {seconds} s")
    if not seconds:
        yield
        return
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def parse_cells(text):
    cells = []
    for item in text.split(","):
        size, px, batch = item.split(":")
        cells.append((size, int(px), int(batch)))
    return cells


def variants(device):
    if device.type == "cuda":
        return [("DiT", "cudnn"), ("DiT", "flash"), ("NaLaDiT", None)]
    return [("DiT", "default"), ("NaLaDiT", None)]


def compiled(model, mode, task, backend):
    """The model compiled as the entry points compile it; ``backend`` other than inductor
    (the CPU smoke test: ``eager``, dynamo's tracing alone) goes to torch.compile directly."""
    if backend == "inductor":
        return compile_model(model, mode, in_place=task == "sample")
    return torch.compile(model, backend=backend)


def plan(args, device):
    """(cell, mode, task, family, sdpa) in the order they run: cell by cell (``--cells``
    order), each eager first, then its compiled modes if it is one of ``--compile-cells``."""
    compile_cells = None if args.compile_cells == "all" else set(parse_cells(args.compile_cells))
    for cell in parse_cells(args.cells):
        for mode in args.modes.split(","):
            if mode != "eager" and compile_cells is not None and cell not in compile_cells:
                continue
            for task in args.tasks.split(","):
                if mode == "reduce-overhead" and task == "train":
                    continue      # CUDA graphs are for sampling here
                pairs = [p for p in variants(device) if p[0] in args.families.split(",")]
                if mode != "eager":     # DiT on its first backend only: each compile costs tens of seconds
                    pairs = [pairs[0], *(p for p in pairs if p[0] != "DiT")]
                for family, sdpa in pairs:
                    yield cell, mode, task, family, sdpa


def build(family, size, latent, args, device, dtype, cache):
    """A fresh model, or for eager cells the one ``cache`` holds for (family, size, latent)
    (models of another size or resolution are dropped from it first)."""
    key = (family, size, latent)
    if cache is not None and key in cache:
        return cache[key]
    if cache is not None:
        for old in [k for k in cache if k[1:] != key[1:]]:
            del cache[old]
    torch.manual_seed(0)
    with device:
        model = create_model(f"{family}-{size}", input_size=latent, **(SMOKE if args.smoke else {}))
    if dtype != torch.float32:
        model.to(dtype)
    if args.gated_layer == "unfused":   # the gated layers' plain autograd composition (the A/B's reference)
        for module in model.modules():
            if hasattr(module, "recompute"):
                module.recompute = False
    if cache is not None:
        cache[key] = model
    return model


def run_cell(cell, family, sdpa, task, mode, args, device, dtype, cache=None):
    size, px, batch = cell
    latent = px // 8
    torch._dynamo.reset()            # every compiled cell traces afresh: no recompile limits, no stale guards
    model = build(family, size, latent, args, device, dtype, cache if mode == "eager" else None)
    try:
        return time_cell(model, family, sdpa, task, mode, batch, latent, args, device, dtype)
    finally:
        for p in model.parameters():
            p.grad = None             # a cached model keeps no gradients between cells


def time_cell(model, family, sdpa, task, mode, batch, latent, args, device, dtype):
    data = make_batch(model, batch, latent, device, dtype)
    runner = model if mode == "eager" else compiled(model, mode, task, args.compile_backend)
    if task == "train":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = lambda: train_step(runner, opt, data)  # noqa: E731
    else:
        step = lambda: sample_step(runner, data)  # noqa: E731
    backend = SDPA.get(sdpa)

    def call():
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            step()

    row = {}
    start = time.perf_counter()
    call()
    row["first_call_s"] = time.perf_counter() - start       # the compile, for compiled modes
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row.update(time_calls(call, device, args.repeats, WARMUP[mode] - 1))
    ms = row["gpu_ms"] if row["gpu_ms"] is not None else row["wall_ms"]
    row["images_per_s"] = batch / ms * 1e3
    row["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return row


def main(argv=None):
    from benchmarks.outputs import new_output  # an existing results file is refused

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--cells", default=None,
                        help="SIZE:PX:BATCH,... (default: the cells above; --smoke: S/2:64:2, compiled as well)")
    parser.add_argument("--compile-cells", default=None,
                        help="the cells compiled modes run, or all (default XL/2:256:32; --smoke: all)")
    parser.add_argument("--tasks", default="train,sample")
    parser.add_argument("--families", default="DiT,NaLaDiT", help="the models timed (the A/B cell: NaLaDiT)")
    parser.add_argument("--gated-layer", choices=("fused", "unfused"), default="fused",
                        help="NaLaDiT's gated layers: the fused middle, or their plain autograd composition")
    parser.add_argument("--modes", default="eager,default", help="eager, default (torch.compile), reduce-overhead")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cell-cap-s", type=float, default=60.0, help="stop a cell after this many seconds")
    parser.add_argument("--budget-s", type=float, default=0.0, help="start no new cell after this many seconds")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (tests: eager)")
    parser.add_argument("--smoke", action="store_true", help="CPU, fp32, a toy 2-block model at 64 px (tests)")
    parser.add_argument("--out", default="", type=new_output, help="JSON path (written after every cell)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.repeats = "cpu", "fp32", 2
        if args.cells is None:         # the toy cell stands for the real ones, compiled too
            args.cells, args.compile_cells = "S/2:64:2", "all"
        args.compile_backend = "eager" if args.compile_backend == "inductor" else args.compile_backend
    args.cells, args.compile_cells = args.cells or CELLS, args.compile_cells or "XL/2:256:32"
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if unknown := set(args.families.split(",")) - {"DiT", "NaLaDiT"}:
        parser.error(f"--families: {', '.join(sorted(unknown))} is not DiT or NaLaDiT")
    for mode in args.modes.split(","):
        if mode not in WARMUP:
            parser.error(f"--modes: {mode!r} is not one of {', '.join(WARMUP)}")
    try:
        cells = parse_cells(args.cells)
        missing = [] if args.compile_cells == "all" else [c for c in parse_cells(args.compile_cells) if c not in cells]
    except ValueError:
        parser.error("--cells / --compile-cells: expected SIZE:PX:BATCH,... (e.g. XL/2:256:32)")
    if missing:
        parser.error(f"--compile-cells {args.compile_cells}: not among --cells; add them there")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    meta = dict(
        command="python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        device=str(device), dtype=args.dtype, torch=torch.__version__, smoke=args.smoke,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine()),
        nala_triton_variant=os.environ.get("NALA_TRITON_VARIANT", "fused"), gated_layer=args.gated_layer,
        repeats=args.repeats,
        statistic="median", compile_backend=args.compile_backend, cell_cap_s=args.cell_cap_s,
        time_method="wall_ms around a synchronized call; gpu_ms: CUDA events (null on CPU); images_per_s from gpu_ms where present",
    )
    rows, start = [], time.perf_counter()
    out = Path(args.out) if args.out else None

    def write():
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(dict(meta=dict(meta, first_use_checks=first_use_checks()), rows=rows), indent=1))

    cache = {}
    try:
        for cell, mode, task, family, sdpa in plan(args, device):
            row = dict(model=f"{family}-{cell[0]}", family=family, size=cell[0], resolution=cell[1],
                       batch=cell[2], task=task, mode=mode, sdpa=sdpa)
            if args.budget_s and time.perf_counter() - start > args.budget_s:
                rows.append(dict(row, skipped=f"--budget-s {args.budget_s} s spent"))
                continue
            try:
                with time_cap(args.cell_cap_s):
                    row.update(run_cell(cell, family, sdpa, task, mode, args, device, dtype, cache), skipped=None)
            except (CellTimeout, torch.cuda.OutOfMemoryError, Exception) as err:  # noqa: BLE001
                first = str(err).splitlines()[0][:200] if str(err) else ""
                row["skipped"] = f"{type(err).__name__}: {first}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            write()
            print(f"{mode:15s} {row['model']:12s} {str(sdpa):7s} {cell[1]:4d}px b{cell[2]:<4d} {task:6s} " + (
                f"skipped: {row['skipped']}" if row["skipped"] else
                f"{row['wall_ms']:9.2f} ms wall, GPU {row['gpu_ms']} ms, first call {row['first_call_s']:.1f} s"),
                flush=True)
    except KeyboardInterrupt:  # a time limit (timeout --signal=INT): keep what was measured
        print("interrupted: reporting the results so far", flush=True)
    write()
    if out:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
