"""Time the NaLa Triton kernels under other block sizes than ``launch_config`` picks.

The defaults in ``nala_dit/attention/nala/triton/launch.py`` were chosen from the compile report
(``triton_compile_check.py``: no spills, two programs per SM), without timing anything; the
row ``table: previous`` times the configs from before that choice (``launch_config``'s
``{"table": "previous"}``) beside them. This sweep (forward +
backward, bf16 inputs, one (B, H, N, D) per head dim) says whether another (BLOCK_N,
num_warps) is faster; each configuration's output and gradients are checked against the
defaults' first, so a configuration that computes something else is reported, not timed.
On CUDA the time is ``triton.testing.do_bench``'s (CUDA events, median); ``--smoke`` runs the
same loop on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, fp32, a toy shape,
one alternative, wall time) so the path is exercised without a GPU.

    python benchmarks/triton_configs.py --out runs/triton_configs.json --budget-s 60
    python benchmarks/triton_configs.py --head-dims 72 --out runs/triton_configs_d72.json
    python benchmarks/triton_configs.py --variant baseline     # the kernels before the rework
    TRITON_INTERPRET=1 python benchmarks/triton_configs.py --smoke --out runs/triton_configs.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402

from benchmarks.timing import time_calls  # noqa: E402
from nala_dit.attention.nala.triton import launch as triton_kernels  # noqa: E402
from tests.utils import rel_rms  # noqa: E402

OPTS = dict(direction="cosine", power=3.0, offset=0.5, alpha=20.0, norm_eps=1e-6, eps=1e-6)


def candidates(head_dim):
    cfg = triton_kernels.launch_config(head_dim)
    lanes = cfg["BA"] + cfg["BB"]                # the head dim's two tiles
    out = []
    for block_n in (32, 64, 128):
        for warps in (4, 8):
            if block_n * lanes > 64 * 128:      # (BLOCK_N × lanes) blocks past 8K elements spill
                continue
            out.append(dict(BLOCK_N=block_n, num_warps=warps))
    return out


def bench(fn, device):
    """Milliseconds per call: do_bench (CUDA events) on the GPU, median wall time on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=30)
    return time_calls(fn, device, repeats=2)["wall_ms"]


def fwd_bwd(q, k, v, grad, config, variant="fused"):
    """One forward + backward: the package's kernels, or (``variant`` "baseline", or the launch
    configs before the register work, ``{"table": "previous"}``) the kernel module before the
    rework (``benchmarks/baseline_nala.py``)."""
    for t in (q, k, v):
        t.grad = None
    if variant == "baseline" or (config or {}).get("table") == "previous":
        from benchmarks import baseline_nala_kernels as old

        out = old.nala_attention_triton(q, k, v, 1.0, dict(OPTS, variant=variant), config=config)
    else:
        out = triton_kernels.nala_attention_triton(q, k, v, 1.0, OPTS, config=config)
    out.backward(grad)
    return [out.detach().float()] + [t.grad.float() for t in (q, k, v)]


def main(argv=None):
    from benchmarks.outputs import new_output  # an existing results file is refused

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,72", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budget-s", type=float, default=0.0, help="stop after this many seconds (0: no limit)")
    parser.add_argument("--out", default="runs/triton_configs.json", type=new_output)
    parser.add_argument("--variant", default=os.environ.get("NALA_TRITON_VARIANT", "fused"),
                        choices=("fused", "baseline"),
                        help="the kernels to sweep: the package's, or the baseline (benchmarks/baseline_nala.py); "
                             "default: NALA_TRITON_VARIANT, else fused")
    parser.add_argument("--max-configs", type=int, default=0, help="alternatives tried per head dim (0: all)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU under TRITON_INTERPRET=1: fp32, B=H=1, 40 tokens, one alternative (tests)")
    args = parser.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.bfloat16
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.exit(2, "error: --smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1\n")
        device, dtype = torch.device("cpu"), torch.float32
        args.batch, args.heads, args.tokens, args.max_configs = 1, 1, 40, 1
    start, rows = time.perf_counter(), []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for d in args.head_dims:
        g = torch.Generator().manual_seed(0)
        shape = (args.batch, args.heads, args.tokens, d)
        q, k, v, grad = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = fwd_bwd(q, k, v, grad, None, args.variant)
        # None: the per-kernel defaults of launch_config; the others apply to every kernel.
        alternatives = candidates(d)[:args.max_configs] if args.max_configs else candidates(d)
        if not args.smoke:   # the per-kernel configs before the two-programs-per-SM work, first
            alternatives.insert(0, dict(table="previous"))
        for config in [None, *alternatives]:
            default = (triton_kernels.launch_config(d) if args.variant == "fused" else
                       __import__("benchmarks.baseline_nala_kernels", fromlist=["x"]).launch_config(d, None, "baseline"))
            label = dict(config or dict(default=default))
            if args.budget_s and time.perf_counter() - start > args.budget_s:
                rows.append(dict(head_dim=d, **label, skipped="budget spent"))
                continue
            row = dict(head_dim=d, **label)
            try:
                got = fwd_bwd(q, k, v, grad, config, args.variant)
                row["max_rel_rms_vs_default"] = max(rel_rms(a, b) for a, b in zip(ref, got))
                if row["max_rel_rms_vs_default"] > 1e-2:
                    row["skipped"] = "differs from the default configuration"
                else:
                    row["ms"] = bench(lambda: fwd_bwd(q, k, v, grad, config, args.variant), device)
            except Exception as err:  # noqa: BLE001  (out of resources: shared memory, registers)
                row["skipped"] = f"{type(err).__name__}: {str(err)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            # Written after every row: a stage killed at its time limit keeps what it measured.
            out.write_text(json.dumps(dict(shape=dict(batch=args.batch, heads=args.heads, tokens=args.tokens),
                                           dtype=str(dtype).removeprefix("torch."), device=str(device), mode="fwd+bwd",
                                           variant=args.variant, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
