"""Compile, before any timed stage, every Triton specialisation the GPU check launches.

Triton compiles a kernel the first time a process launches it with a new specialisation
(its constexprs, dtypes, and which integer arguments are divisible by 16) and keeps the
binary in its on-disk cache, where every later process of the machine finds it. The timed
stages of ``benchmarks/gpu_check.sh`` would otherwise pay those compiles inside their
measurements (about 50 specialisations, seconds each). This script launches each once:

* NaLaDiT's gated attention layer (``GatedLinearAttention``, the fused middle) at the widths
  and head counts of the sizes timed (S: 384 / 6 heads of 64, XL: 1,152 / 16 heads of 72), at
  the token counts of 256, 512 and 1,024 px (256, 1,024 and 4,096 tokens: one token range
  and several), forward and forward + backward in the timed dtype;
* NaLa alone (``nala_attention``) at the head dims of ``benchmarks/kernels.py``'s shapes.

Each launch also runs the kernels' first-use checks, whose rows (``first_use_checks``) and
the seconds each item took are written to ``--out`` after every item.

    python benchmarks/warmup.py --device cuda --dtype bf16 --out runs/warmup.json
    python benchmarks/warmup.py --smoke --out runs/warmup.json     # CPU, toy sizes, seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402

from benchmarks.attention import DTYPES  # noqa: E402
from nala_dit.attention import first_use_checks, nala_attention  # noqa: E402
from nala_dit.attention.layers import GatedLinearAttention  # noqa: E402

LAYERS = ((384, 6), (1152, 16))          # (width, heads): S and XL
TOKENS = (256, 1024, 4096)               # 256, 512, 1,024 px with patch 2 of an f8 latent
SMOKE_LAYERS, SMOKE_TOKENS = ((64, 2),), (16, 36)   # square token grids, as the model has


def items(layers, tokens):
    """(kind, width or head dim, heads, tokens) in the order they run: the layers first (what the
    model stages launch), then NaLa alone at each layer's head dim and token count."""
    for width, heads in layers:
        for n in tokens:
            yield "gated layer", width, heads, n
    for width, heads in layers:
        for n in tokens:
            yield "nala", width // heads, heads, n


def launch(kind, size, heads, n, device, dtype):
    """One forward and one forward + backward of the item, on zero-mean random inputs."""
    torch.manual_seed(0)
    if kind == "gated layer":
        layer = GatedLinearAttention(size, heads).to(device, dtype)
        x = torch.randn(1, n, size, device=device, dtype=dtype, requires_grad=True)
        grid = (round(n**0.5),) * 2                # LePE's token grid: the model's square latents
        with torch.no_grad():
            layer(x, grid)
        layer(x, grid).float().square().mean().backward()
        return
    q, k, v = (torch.randn(1, heads, n, size, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        nala_attention(q, k, v)
    nala_attention(q, k, v).float().square().mean().backward()


def main(argv=None):
    from benchmarks.outputs import new_output  # an existing results file is refused

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--smoke", action="store_true", help="CPU, fp32, a toy width and token counts (tests)")
    parser.add_argument("--out", default="", type=new_output, help="JSON path (written after every item)")
    args = parser.parse_args(argv)
    layers, tokens = (SMOKE_LAYERS, SMOKE_TOKENS) if args.smoke else (LAYERS, TOKENS)
    if args.smoke:
        args.device, args.dtype = "cpu", "fp32"
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    meta = dict(device=str(device), dtype=args.dtype, torch=torch.__version__, smoke=args.smoke,
                device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine())
    rows, out = [], Path(args.out) if args.out else None
    for kind, size, heads, n in items(layers, tokens):
        start = time.perf_counter()
        launch(kind, size, heads, n, device, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rows.append(dict(kind=kind, size=size, heads=heads, tokens=n, seconds=round(time.perf_counter() - start, 3)))
        print(f"warm-up {kind} {size} x {heads} heads at {n} tokens: {rows[-1]['seconds']} s", flush=True)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(dict(meta=dict(meta, first_use_checks=first_use_checks()), rows=rows), indent=1))
    failed = [r for r in first_use_checks() if r["result"] != "passed"]
    for row in failed:
        print(f"warm-up: first-use check FAILED ({row['path']}): {row['result']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
