"""The cost of a MeanFlow training step against the plain transport step (SiT's velocity loss).

For each model (``--models NaLaSiT-T/2,SiT-T/2``), on the embedded digits' shape (8 × 8
pixels, 1 channel, 10 classes) unless ``--input-size`` / ``--channels`` say otherwise, one
training step (loss, backward, AdamW step) of the same model with ``Transport`` and with
``MeanFlow`` (``diffusion/meanflow.py``: one ``torch.func.jvp`` per step; the paper's
defaults), back to back, repeat after repeat (round robin), so machine noise hits both alike.
Reports the median wall time of each and their ratio (``meanflow/transport``).

    python benchmarks/meanflow_step.py --threads 1 --out benchmarks/results/meanflow_step_cpu.json
    python benchmarks/meanflow_step.py --tiny --out runs/meanflow_step.json     # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402

from benchmarks.outputs import new_output  # noqa: E402
from nala_dit.diffusion.meanflow import MeanFlow  # noqa: E402
from nala_dit.diffusion.transport import Transport  # noqa: E402
from nala_dit.models.dit import create_model  # noqa: E402


def step(model, opt, objective, x, y, seed):
    opt.zero_grad(set_to_none=True)
    loss = objective.training_losses(model, x, y, generator=torch.Generator().manual_seed(seed))["loss"].mean()
    loss.backward()
    opt.step()


def benchmark(args) -> list[dict]:
    rows = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = create_model(name, input_size=args.input_size, in_channels=args.channels, num_classes=10,
                             mean_flow=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch, args.channels, args.input_size, args.input_size, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        objectives = {"transport": Transport(), "meanflow": MeanFlow(null_label=10, drop_prob=0.1)}
        times = {key: [] for key in objectives}
        for rep in range(args.warmup + args.repeats):
            for key, objective in objectives.items():
                start = time.perf_counter()
                step(model, opt, objective, x, y, rep)
                if rep >= args.warmup:
                    times[key].append(time.perf_counter() - start)
        med = {key: statistics.median(ts) for key, ts in times.items()}
        rows.append(dict(model=name, batch=args.batch, input_size=args.input_size, transport_ms=1e3 * med["transport"],
                         meanflow_ms=1e3 * med["meanflow"], ratio=med["meanflow"] / med["transport"]))
        print(f"{name}: transport {rows[-1]['transport_ms']:.1f} ms, meanflow {rows[-1]['meanflow_ms']:.1f} ms, "
              f"ratio {rows[-1]['ratio']:.2f}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="NaLaSiT-T/2,SiT-T/2")
    parser.add_argument("--input-size", type=int, default=8)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--tiny", action="store_true", help="batch 4, one repeat (tests)")
    parser.add_argument("--out", default="", type=new_output, help="JSON path")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.batch, args.repeats, args.warmup = 4, 1, 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = benchmark(args)
    meta = dict(command="python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
                device="cpu", device_name=platform.processor() or platform.machine(),
                cpu_capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads(),
                torch=torch.__version__, repeats=args.repeats, statistic="median wall time of a step",
                load_average=[load, os.getloadavg()[0] if hasattr(os, "getloadavg") else None])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
