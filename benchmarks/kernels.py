"""Kernel GPU time of one attention call at the shapes DiT trains at, against the roofline.

At each (B, H, N, D) of ``--shapes`` (default: XL/2 heads 16 × 72 and S/2 heads 6 × 64 at
256, 1,024 and 4,096 tokens, batch filling the GPU), forward and forward + backward:

* ``nala``: ``nala_attention`` (``impl="auto"``: the Triton kernels on CUDA, the kernels
  that ``NALA_TRITON_VARIANT`` selects at start (``baseline``: ``benchmarks/baseline_nala.py``),
  recorded in the JSON; the fused path on
  the CPU), checked first against ``impl="eager"`` (outputs and gradients, relative RMS,
  recorded as ``max_rel_rms_vs_eager``);
* ``sdpa_cudnn``, ``sdpa_flash``: SDPA forced onto cuDNN and FlashAttention (CUDA);
  ``sdpa`` (SDPA's own pick) on the CPU.

Each call is timed alone (``benchmarks/timing.py``: CUDA events around it after warm-up,
``gpu_ms``, beside the wall time ``wall_ms``), median of ``--repeats``, and its kernels' own
GPU time is summed from the profiler (``kernel_ms``: the host's gaps between kernels left
out), which is the time the rates below use (``timing`` names the basis: ``kernel_ms``,
else ``gpu_ms``, else ``wall_ms`` on the CPU). Beside each time:
FLOPs per call (torch's ``FlopCounterMode`` as ``count_flops`` uses it, on meta tensors:
NaLa's matrix products through ``impl="eager"``, SDPA through its math backend, 2 per
multiply-accumulate; elementwise work not counted), the bytes a call must move at least
(q, k, v read and the output written: 4 tensors forward; forward + backward adds q, k, v and
the output gradient read and dq, dk, dv written: 11), and the fraction of the H200
roofline that makes: ``max(FLOPs / peak FLOP/s, bytes / peak bandwidth) / time``, with the
peaks of the GPU the run is on (``ROOFLINES``: H200, H100; another GPU is scored against
the H200's and the JSON says so).

    python benchmarks/kernels.py --device cuda --out runs/kernels_fused.json
    NALA_TRITON_VARIANT=baseline python benchmarks/kernels.py --device cuda --out runs/kernels_baseline.json
    python benchmarks/kernels.py --smoke --out runs/kernels.json     # CPU, toy shapes, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from benchmarks.attention import DTYPES, MODES, make_inputs, run_once, sdpa_on  # noqa: E402
from benchmarks.baseline_nala import install_if_asked  # noqa: E402

VARIANT = install_if_asked()   # NALA_TRITON_VARIANT=baseline: the kernels before the rework (the A/B)
from benchmarks.timing import kernel_ms, time_calls  # noqa: E402
from nala_dit.attention import first_use_checks, nala_attention  # noqa: E402

# Dense bf16 tensor-core rate and memory bandwidth from NVIDIA's datasheets (the "with
# sparsity" figures halved): H200 SXM 989 TFLOP/s, 4.8 TB/s (nvidia.com/en-us/data-center/h200);
# H100 SXM 989, 3.35; H100 NVL 835, 3.9; H100 PCIe 756, 2.0 (nvidia.com/en-us/data-center/h100).
# The first name found in the device's name wins; another GPU is scored against the H200's.
ROOFLINES = {"H200": (989e12, 4.8e12), "H100 NVL": (835e12, 3.9e12), "H100 PCIe": (756e12, 2.0e12),
             "H100": (989e12, 3.35e12)}
H200_BF16_DENSE_FLOPS, H200_HBM_BYTES_PER_S = ROOFLINES["H200"]


def roofline_of(device_name: str) -> dict:
    """The roofline a GPU's times are scored against: its datasheet's dense bf16 rate and
    bandwidth, or the H200's (named as assumed) for a GPU not in ``ROOFLINES``."""
    for name, (flops, bandwidth) in ROOFLINES.items():
        if name in device_name:
            return dict(name=f"{name} bf16 dense", flops_per_s=flops, bytes_per_s=bandwidth)
    return dict(name=f"H200 bf16 dense (assumed: {device_name!r} is not in ROOFLINES)",
                flops_per_s=H200_BF16_DENSE_FLOPS, bytes_per_s=H200_HBM_BYTES_PER_S)
SHAPES = ((64, 16, 256, 72), (16, 16, 1024, 72), (4, 16, 4096, 72),
          (64, 6, 256, 64), (16, 6, 1024, 64), (4, 6, 4096, 64))
SMOKE_SHAPES = ((2, 2, 64, 24), (1, 2, 128, 16))
TENSORS_MOVED = {"fwd": 4, "fwd+bwd": 11}


def methods_for(device):
    if device.type == "cuda":
        return {"nala": nala_attention, "sdpa_cudnn": sdpa_on(SDPBackend.CUDNN_ATTENTION),
                "sdpa_flash": sdpa_on(SDPBackend.FLASH_ATTENTION)}
    return {"nala": nala_attention, "sdpa": F.scaled_dot_product_attention}


def triton_variant():
    """The Triton kernels in use ("fused", or "baseline": ``benchmarks/baseline_nala.py``)."""
    return VARIANT


def call_flops(method, shape, mode):
    """FLOPs of one call, counted on meta tensors (no arithmetic)."""
    q, k, v = (torch.zeros(shape, device="meta", requires_grad=mode != "fwd") for _ in range(3))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        if method == "nala":
            out = nala_attention(q, k, v, impl="eager")
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        if mode != "fwd":
            out.backward(torch.ones_like(out))
    return counter.get_total_flops()


def rel_rms(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_against_eager(inputs, grad):
    """Largest relative RMS of NaLa's output and q, k, v gradients against impl='eager'."""
    got, ref = [], []
    for impl, into in ((None, got), ("eager", ref)):
        for t in inputs:
            t.grad = None
        out = nala_attention(*inputs) if impl is None else nala_attention(*inputs, impl=impl)
        out.backward(grad)
        into += [out.detach()] + [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    return max(rel_rms(a, b) for a, b in zip(got, ref))


def roofline(flops, nbytes, ms, peak):
    """(floor ms, floor / measured) of a call against ``peak`` (``roofline_of``)."""
    floor_ms = 1e3 * max(flops / peak["flops_per_s"], nbytes / peak["bytes_per_s"])
    return floor_ms, (floor_ms / ms if ms else None)


def measure_shape(shape, device, dtype, methods, args):
    batch, heads, n, d = shape
    ns = argparse.Namespace(batch=batch, heads=heads, head_dim=d)
    rows = []
    for mode in MODES:
        inputs, grad = make_inputs(n, ns, device, dtype, mode == "fwd+bwd")
        check = check_against_eager(inputs, grad) if mode == "fwd+bwd" else None
        for name, fn in methods.items():
            row = dict(method=name, mode=mode, batch=batch, heads=heads, tokens=n, head_dim=d)
            try:
                timing = time_calls(lambda: run_once(fn, inputs, grad, mode), device, args.repeats, args.warmup)
                timing["kernel_ms"] = kernel_ms(lambda: run_once(fn, inputs, grad, mode), device)
            except Exception as err:  # noqa: BLE001  (a backend refusing the shape, out of memory)
                rows.append(dict(row, skipped=f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            basis = next(k for k in ("kernel_ms", "gpu_ms", "wall_ms") if timing[k] is not None)
            ms = timing[basis]
            flops = call_flops("nala" if name == "nala" else "sdpa", shape, mode)
            nbytes = TENSORS_MOVED[mode] * batch * heads * n * d * inputs[0].element_size()
            floor_ms, fraction = roofline(flops, nbytes, ms, args.roofline)
            rows.append(dict(row, **timing, timing=basis,
                             flops=flops, bytes=nbytes, tflop_per_s=flops / ms / 1e9,
                             roofline_ms=floor_ms, roofline_fraction=fraction,
                             us_per_1k_token_heads=1e3 * ms / (batch * heads * n / 1e3),
                             max_rel_rms_vs_eager=check if name == "nala" else None, skipped=None))
        base = "sdpa_cudnn" if "sdpa_cudnn" in methods else "sdpa"
        times = {r["method"]: r for r in rows if r["mode"] == mode and not r["skipped"]}
        if "nala" in times and base in times:
            key = times["nala"]["timing"]
            times["nala"][f"nala/{base}"] = times["nala"][key] / times[base][key]
        for r in rows:
            if r["mode"] == mode:
                print(f"{str(shape):20s} {mode:8s} {r['method']:11s} " + (
                    f"skipped: {r['skipped']}" if r["skipped"] else
                    f"{r['wall_ms']:.3f} ms wall, GPU {r['gpu_ms']} ms, kernels {r['kernel_ms']} ms, {100 * r['roofline_fraction']:.1f}% of roofline"),
                    flush=True)
    return rows


def main(argv=None):
    from benchmarks.outputs import new_output  # an existing results file is refused

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--shapes", default="", help="B,H,N,D;B,H,N,D... (default: the six above)")
    parser.add_argument("--methods", default="", help="comma-separated subset (e.g. nala for the A/B's second run)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=0.0, help="start no new shape after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="CPU, fp32, toy shapes, two repeats (tests)")
    parser.add_argument("--out", default="", type=new_output, help="JSON path (written after every shape)")
    args = parser.parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES
    except ValueError:
        shapes = [()]
    if any(len(shape) != 4 or min(shape) < 1 for shape in shapes):
        parser.error(f"--shapes {args.shapes!r}: expected B,H,N,D;B,H,N,D... of positive integers, e.g. 4,16,4096,72")
    if args.smoke:
        args.device, args.dtype, args.repeats, args.warmup, shapes = "cpu", "fp32", 2, 1, SMOKE_SHAPES
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    methods = methods_for(device)
    if args.methods:
        unknown = [m for m in args.methods.split(",") if m not in methods]
        if unknown:
            parser.error(f"--methods: {', '.join(unknown)} not among {', '.join(methods)} on {device.type}")
        methods = {m: methods[m] for m in args.methods.split(",")}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    args.roofline = roofline_of(device_name)
    meta = dict(
        command="python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        device=str(device), dtype=args.dtype, torch=torch.__version__, smoke=args.smoke, device_name=device_name,
        nala_triton_variant=triton_variant() if device.type == "cuda" else None,
        nala_triton_variant_env=os.environ.get("NALA_TRITON_VARIANT"),
        repeats=args.repeats, warmup=args.warmup, statistic="median", methods=list(methods),
        roofline=args.roofline,
        flops_method="FlopCounterMode on meta tensors: NaLa impl='eager', SDPA math backend; matmuls only",
        bytes_method="q, k, v read + output written (fwd: 4 tensors); fwd+bwd adds q, k, v, dout read and dq, dk, dv written (11)",
    )
    rows, start = [], time.perf_counter()
    out = Path(args.out) if args.out else None
    try:
        for shape in shapes:
            if args.budget_s and time.perf_counter() - start > args.budget_s:
                rows += [dict(method=m, mode=mode, batch=shape[0], heads=shape[1], tokens=shape[2], head_dim=shape[3],
                              skipped=f"--budget-s {args.budget_s} s spent") for m in methods for mode in MODES]
                continue
            rows += measure_shape(shape, device, dtype, methods, args)
            if out:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(dict(meta=dict(meta, first_use_checks=first_use_checks()), rows=rows), indent=1))
    except KeyboardInterrupt:  # a time limit (timeout --signal=INT): keep what was measured
        print("interrupted: reporting the results so far", flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(meta=dict(meta, first_use_checks=first_use_checks()), rows=rows), indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
