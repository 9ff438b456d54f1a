"""The host's cost per launched op, and how many ops a gated layer, a block and a model launch.

At the batches people sample and train at, both models wait on the host, which
issues one kernel per op. This script measures the two factors of that time:

* **host cost per op**: ``--launches`` tiny in-place adds (``x.add_(1)`` on a one-element
  tensor) issued back to back, timed as one call (``benchmarks/timing.py``): wall µs per op
  is what the host spends issuing one; GPU µs per op (CUDA events) what the GPU spends,
  idle gaps included;
* **ops launched** by one gated attention layer (NaLa's gated layer against softmax
  attention), one block (NaLaDiT's against DiT's) and a whole model (``--size`` at
  ``--resolution``), forward under ``no_grad`` (sampling) and forward + backward from a
  given output gradient (no loss, no optimizer), counted as
  ``tests/attention/test_launches.py`` counts: every aten op that reaches the dispatcher, views and bare allocations (``empty``)
  excluded (``aten_ops``). Triton kernels are not aten ops; on CUDA the profiler also
  counts the kernels the GPU ran (``gpu_kernels``; ``null`` on the CPU).

``host_ms_per_call`` = ``aten_ops`` × wall µs per op: the host time of one call if every
op cost what a tiny add costs, the floor of a launch-bound call.

    python benchmarks/launch.py --device cuda --dtype bf16 --size XL/2 --out runs/launch.json
    python benchmarks/launch.py --smoke --out runs/launch.json     # CPU, toy sizes, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.attention import DTYPES  # noqa: E402
from benchmarks.timing import device_events, timed_call  # noqa: E402
from nala_dit.attention.layers import build_attention, first_use_checks  # noqa: E402
from nala_dit.models.dit import create_model  # noqa: E402

ALLOCATIONS = {"aten.empty", "aten.new_empty", "aten.empty_strided"}
# The toy sizes of --smoke (model.py --tiny's width), and the layer's for the real run.
SMOKE = dict(depth=2, hidden_size=64, num_heads=2)


class CountOps(TorchDispatchMode):
    """Non-view aten ops, bare allocations left out (as tests/attention/test_launches.py)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and str(func.overloadpacket) not in ALLOCATIONS:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def host_cost(device, launches, repeats):
    """Median wall and GPU µs per tiny launched op."""
    x = torch.zeros(1, device=device)

    def burst():
        for _ in range(launches):
            x.add_(1.0)

    burst()
    walls, gpus = [], []
    for _ in range(repeats):
        wall, gpu = timed_call(burst, device)
        walls.append(1e6 * wall / launches)
        gpus.append(None if gpu is None else 1e3 * gpu / launches)
    return dict(launches=launches, repeats=repeats, wall_us_per_op=statistics.median(walls),
                gpu_us_per_op=None if gpus[0] is None else statistics.median(gpus))


def gpu_kernels(fn, device):
    """Kernels the GPU ran during ``fn`` (the profiler's CUDA events), None on the CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return len(device_events(prof))


def count(fn, device):
    fn()                                          # warm-up: first-use checks, lazy buffers
    with CountOps() as counter:
        fn()
    return dict(aten_ops=counter.ops, gpu_kernels=gpu_kernels(fn, device))


def family_subjects(family, attention, args, device, dtype, depth=None):
    """The ``family`` model of ``--size`` at ``--resolution`` (``depth`` blocks if given), a fresh
    attention layer of its width, block inputs ``x``, ``c`` and the token grid, and a generator
    for more inputs (shared with ``kernel_profile.py``)."""
    latent = args.resolution // 8
    overrides = dict(SMOKE if args.smoke else {}, **({"depth": depth} if depth else {}))
    torch.manual_seed(0)
    with device:
        model = create_model(f"{family}-{args.size}", input_size=latent, **overrides)
        layer = build_attention(attention, model.config.hidden_size, model.config.num_heads)
    if dtype != torch.float32:
        model.to(dtype)
        layer.to(dtype)
    hidden, side = model.config.hidden_size, latent // model.config.patch_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, side * side, hidden, generator=g).to(device, dtype)
    c = torch.randn(args.batch, hidden, generator=g).to(device, dtype)
    return model, layer, x, c, (side, side), g


def subjects(args, device, dtype):
    """(what, family, forward, forward+backward) for the layer, the block and the model."""
    latent = args.resolution // 8
    for family, attention in (("NaLaDiT", "nala"), ("DiT", "softmax")):
        model, layer, x, c, grid, g = family_subjects(family, attention, args, device, dtype)
        block = model.blocks[0]
        images = torch.randn(args.batch, model.in_channels, latent, latent, generator=g).to(device, dtype)
        t = torch.randint(0, 1000, (args.batch,), generator=g).float().to(device)
        y = torch.randint(0, model.config.num_classes, (args.batch,), generator=g).to(device)

        def train(call):
            grad = []            # the output gradient, made by the warm-up call: not counted

            def step():
                for p in [*model.parameters(), *layer.parameters()]:
                    p.grad = None            # so every counted call sets the gradients afresh
                out = call()
                if not grad:
                    grad.append(torch.ones_like(out))
                out.backward(grad[0])
            return step

        def sample(call):
            def forward():
                with torch.no_grad():
                    call()
            return forward

        for what, call in (("gated layer" if family == "NaLaDiT" else "attention layer", lambda: layer(x, grid)),
                           ("block", lambda: block(x, c, grid)),
                           (f"model {args.size} {args.resolution}px", lambda: model(images, t, y))):
            yield what, family, attention, sample(call), train(call)


def subject_parser(doc, batch):
    """The options of the scripts that build a layer, a block and a model (this one, kernel_profile.py)."""
    from benchmarks.outputs import new_output  # an existing results file is refused

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--size", default="XL/2")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--smoke", action="store_true", help="CPU, toy model and sizes (tests)")
    parser.add_argument("--out", default="", type=new_output, help="JSON path")
    return parser


def main(argv=None):
    parser = subject_parser(__doc__, batch=8)
    parser.add_argument("--launches", type=int, default=2000, help="tiny ops per timed burst")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.size, args.resolution = "cpu", "fp32", "S/2", 64
        args.batch, args.launches, args.repeats = 2, 50, 2
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    meta = dict(
        command="python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        device=str(device), dtype=args.dtype, torch=torch.__version__, smoke=args.smoke,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine()),
        size=args.size, resolution=args.resolution, batch=args.batch,
        nala_triton_variant=os.environ.get("NALA_TRITON_VARIANT", "fused"),
        counting="aten ops: TorchDispatchMode, views and empty/new_empty/empty_strided excluded; gpu_kernels: "
                 "torch.profiler CUDA events (null on CPU); fwd+bwd = forward + backward from a given output "
                 "gradient (no loss, no optimizer)",
    )
    out = Path(args.out) if args.out else None
    host, rows = None, []

    def write():                       # after every subject: a stage stopped at its limit keeps them
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(dict(meta=dict(meta, first_use_checks=first_use_checks()), host=host, counts=rows), indent=1))

    try:
        host = host_cost(device, args.launches, args.repeats)
        print(f"host cost per op: {host['wall_us_per_op']:.2f} us wall, GPU {host['gpu_us_per_op']} us", flush=True)
        write()
        for what, family, attention, sample, train in subjects(args, device, dtype):
            for mode, fn in (("fwd", sample), ("fwd+bwd", train)):
                counted = count(fn, device)
                rows.append(dict(what=what, family=family, attention=attention, mode=mode, **counted,
                                 host_ms_per_call=counted["aten_ops"] * host["wall_us_per_op"] / 1e3))
                write()
                print(f"{what:22s} {family:8s} {mode:8s} aten ops {counted['aten_ops']:6d} "
                      f"GPU kernels {counted['gpu_kernels']}", flush=True)
    except KeyboardInterrupt:  # a time limit (timeout --signal=INT): keep what was measured
        print("interrupted: reporting the results so far", flush=True)
    write()
    if out:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
