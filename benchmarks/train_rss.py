"""Peak resident memory (RSS) of one training step, NaLaDiT against DiT, each in a fresh process.

The storage tracker of ``benchmarks/highres.py`` counts tensors; this counts what the
operating system sees (``ru_maxrss``): tensors plus the allocator's caching and
fragmentation and the scratch memory of C++ kernels. One step = forward, MSE, backward
(no optimizer), batch 1, fp32, one thread, random weights. Models alternate, repeat after
repeat, so a drifting machine hits them alike; the table reports medians.

    python benchmarks/train_rss.py --latent 128 --repeats 3 --out benchmarks/results/train_rss_cpu.json
    python benchmarks/train_rss.py --tiny                       # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import child_env, passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

VARIANTS = {  # name: (preset, recompute)
    "DiT": ("DiT-S/2", True),
    "NaLaDiT": ("NaLaDiT-S/2", True),
    "NaLaDiT (recompute=False)": ("NaLaDiT-S/2", False),
}


def one_step(preset: str, latent: int, recompute: bool) -> dict:
    """Runs in the child: RSS after building the model and at the end of one step (MiB)."""
    import resource

    import torch

    from nala_dit.models.dit import create_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731  (KiB on Linux)
    model = create_model(preset, input_size=latent)
    for block in model.blocks:
        if hasattr(block.attn, "recompute"):
            block.attn.recompute = recompute
    built = rss()
    x = torch.randn(1, model.in_channels, latent, latent)
    model(x, torch.tensor([500.0]), torch.tensor([1])).pow(2).mean().backward()
    return dict(built_mib=round(built, 1), peak_mib=round(rss(), 1))


def main(argv=None) -> int:
    from benchmarks.outputs import new_output  # an existing results file is refused

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latent", type=int, default=128, help="latent side (128 = 1024 px = 4,096 tokens)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="latent 16, one repeat")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each step (the table's numbers: 1)")
    p.add_argument("--out", type=new_output)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(one_step(args.child[0], int(args.child[1]), args.child[2] == "1")))
        return 0
    latent, repeats = (16, 1) if args.tiny else (args.latent, args.repeats)
    if latent < 2 or latent % 2 or repeats < 1:
        p.error("--latent must be an even number >= 2 and --repeats >= 1")
    env = child_env(ROOT, OMP_NUM_THREADS=str(args.threads))
    runs = {name: [] for name in VARIANTS}
    load = os.getloadavg()
    for _ in range(repeats):
        for name, (preset, recompute) in VARIANTS.items():
            out = subprocess.run([sys.executable, __file__, "--child", preset, str(latent), str(int(recompute))],
                                 env=env, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    rows = {}
    for name, items in runs.items():
        peak = statistics.median(r["peak_mib"] for r in items)
        added = statistics.median(r["peak_mib"] - r["built_mib"] for r in items)
        rows[name] = dict(runs=items, median_peak_mib=peak, median_step_mib=added)
    dit = rows["DiT"]
    print(f"latent {latent} ({(latent // 2) ** 2:,} tokens), {repeats} repeats, load {load[0]:.1f} → "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'model':28s} {'peak RSS MiB':>13s} {'× DiT':>7s} {'step adds MiB':>14s} {'× DiT':>7s}")
    for name, r in rows.items():
        r.update(peak_ratio=r["median_peak_mib"] / dit["median_peak_mib"],
                 step_ratio=r["median_step_mib"] / dit["median_step_mib"])
        print(f"{name:28s} {r['median_peak_mib']:13.1f} {r['peak_ratio']:7.3f} {r['median_step_mib']:14.1f} "
              f"{r['step_ratio']:7.3f}")
    if args.out:
        meta = dict(latent=latent, tokens=(latent // 2) ** 2, repeats=repeats, loadavg_start=load,
                    loadavg_end=os.getloadavg(), threads=args.threads, tiny=args.tiny)
        args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
