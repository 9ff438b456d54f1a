"""Per-kernel profile of one gated NaLa layer and one NaLaDiT block against softmax (DiT).

``torch.profiler`` over ``--steps`` calls after two warm-up calls, forward (no_grad) and
forward + backward, for the attention layer alone (NaLa's gated layer against DiT's
softmax attention) and for one block of ``--size`` (NaLaDiT's against DiT's) at
``--resolution`` px and ``--batch``. On CUDA each GPU kernel the profiler saw (CUDA
activity) is summed by name: GPU µs per call, launches per call and its share of the
GPU time; the ``--top`` largest go into the JSON. On the CPU (``--smoke``) the same table
holds the aten ops by self CPU time, so the path is exercised without a GPU.

    python benchmarks/kernel_profile.py --device cuda --dtype bf16 --size XL/2 --batch 32 --out runs/profile.json
    python benchmarks/kernel_profile.py --smoke --out runs/profile.json     # CPU, toy sizes, seconds
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.attention import DTYPES  # noqa: E402
from benchmarks.launch import family_subjects, subject_parser  # noqa: E402
from benchmarks.timing import device_events, sync  # noqa: E402
from nala_dit.attention import first_use_checks  # noqa: E402


def kernel_table(prof, device, steps):
    """{name: [launches, µs]} per call: GPU kernels on CUDA, aten ops by self CPU time on the CPU."""
    table = defaultdict(lambda: [0.0, 0.0])
    if device.type == "cuda":
        for e in device_events(prof):
            table[e.name][0] += 1 / steps
            table[e.name][1] += e.time_range.elapsed_us() / steps
    else:
        for e in prof.key_averages():
            if e.key.startswith("aten::") and e.self_cpu_time_total > 0:
                table[e.key][0] += e.count / steps
                table[e.key][1] += e.self_cpu_time_total / steps
    return table


def profiled(fn, device, steps, top):
    for _ in range(2):
        fn()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    table = kernel_table(prof, device, steps)
    total = sum(us for _, us in table.values())
    ranked = sorted(table.items(), key=lambda kv: -kv[1][1])
    return dict(total_us_per_call=total, kernels_per_call=sum(n for n, _ in table.values()),
                top=[dict(name=name[:160], launches_per_call=n, us_per_call=us, share=us / total if total else None)
                     for name, (n, us) in ranked[:top]])


def subjects(args, device, dtype):
    for family, attention in (("NaLaDiT", "nala"), ("DiT", "softmax")):
        model, layer, x, c, grid, _ = family_subjects(family, attention, args, device, dtype, depth=1)
        block = model.blocks[0]
        yield ("gated layer" if family == "NaLaDiT" else "attention layer"), family, layer, lambda m=layer: m(x, grid)
        yield "block", family, block, lambda m=block: m(x, c, grid)


def main(argv=None):
    parser = subject_parser(__doc__, batch=32)
    parser.add_argument("--steps", type=int, default=3, help="profiled calls (after two warm-up calls)")
    parser.add_argument("--top", type=int, default=12, help="kernels kept per profile")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.size, args.resolution, args.batch, args.steps = "cpu", "fp32", "S/2", 64, 2, 1
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    rows = []
    try:
        for what, family, module, call in subjects(args, device, dtype):
            def train(module=module, call=call):
                for p in module.parameters():
                    p.grad = None
                call().float().square().mean().backward()

            def sample(call=call):
                with torch.no_grad():
                    call()

            for mode, fn in (("fwd", sample), ("fwd+bwd", train)):
                rows.append(dict(what=what, family=family, mode=mode, **profiled(fn, device, args.steps, args.top)))
                r = rows[-1]
                print(f"{what:16s} {family:8s} {mode:8s} {r['total_us_per_call']:10.1f} us, "
                      f"{r['kernels_per_call']:.0f} kernels; top: {r['top'][0]['name'][:60] if r['top'] else '-'}", flush=True)
    except KeyboardInterrupt:  # a time limit (timeout --signal=INT): keep what was measured
        print("interrupted: reporting the results so far", flush=True)
    meta = dict(
        command="python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        device=str(device), dtype=args.dtype, torch=torch.__version__, smoke=args.smoke,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine()),
        size=args.size, resolution=args.resolution, batch=args.batch, steps=args.steps,
        nala_triton_variant=os.environ.get("NALA_TRITON_VARIANT", "fused"),
        unit="GPU kernels by GPU time (CUDA)" if device.type == "cuda" else "aten ops by self CPU time (CPU)",
    )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(meta=dict(meta, first_use_checks=first_use_checks()), rows=rows), indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
