"""Compile the NaLa Triton kernels for a GPU architecture without a GPU, and print the
registers and spills ptxas reports.

Triton lowers a kernel to PTX without a driver, and its wheel carries ``ptxas``; so the
CUDA compilation path (which Triton's interpreter skips) can be checked on any machine,
and block sizes can be chosen so that no kernel spills registers (``_CONFIGS`` in
``nala_dit/attention/triton_kernels.py`` was). It says nothing about speed.

    python benchmarks/triton_compile_check.py                        # every variant, sm_90
    python benchmarks/triton_compile_check.py --head-dims 72 --dtypes bf16 --directions cosine
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nala_dit.attention import triton_kernels as tn  # noqa: E402

FLOAT_ARGS = {"power", "offset", "alpha", "norm_eps", "eps", "inv_n"}
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def kernel_variants(head_dim: int, dtype: str, direction: str):
    """(label, kernel, pointer types, constexprs, num_warps) for every launch of one call."""
    cfg = tn.launch_config(head_dim)
    st, out, bwd = cfg["state"], cfg["out"], cfg["bwd"]
    p, f = f"*{dtype}", "*fp32"
    base = dict(COSINE=direction == "cosine", BD=cfg["BD"], PREC="ieee" if dtype == "fp32" else "tf32")
    st_c = dict(base, BLOCK_N=st["BLOCK_N"], BV=st["BV"])
    out_c = dict(base, BLOCK_N=out["BLOCK_N"], BV=out["BV"])
    bwd_c = dict(base, BLOCK_N=bwd["BLOCK_N"], BV=bwd["BV"], NV=bwd["NV"])
    return [
        ("state", tn._state_kernel, dict(X=p, V=p, ScaleP=f, S_part=f, Z_part=f),
         dict(st_c, QUERY=False, DEN=None, DDEN=None), st["num_warps"]),
        ("output", tn._output_kernel, dict(Q=p, ScaleP=f, S=f, Z=f, O=p, DEN=f), out_c, out["num_warps"]),
        ("dq", tn._dq_kernel, dict(Q=p, G=p, ScaleP=f, S=f, Z=f, DEN=f, DQ=p, DDEN=f, DU=f),
         dict(bwd_c, NEED_DU=False), bwd["num_warps"]),
        ("dstate", tn._state_kernel, dict(X=p, V=p, ScaleP=f, S_part=f, Z_part=f, DEN=f, DDEN=f),
         dict(st_c, QUERY=True), st["num_warps"]),
        ("dkv", tn._dkv_kernel, dict(K=p, V=p, DS=f, DZ=f, DK=p, DV=p), bwd_c, bwd["num_warps"]),
    ]


def compile_kernel(kernel, pointers: dict, constexprs: dict, num_warps: int, arch: int) -> str:
    """Compile to PTX for ``sm_<arch>`` and return ptxas's resource line."""
    signature = {name: "constexpr" if name in constexprs else pointers.get(name) or
                 ("fp32" if name in FLOAT_ARGS else "i32") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        Path(ptx).write_text(compiled.asm["ptx"])
        proc = subprocess.run([str(PTXAS), f"-arch=sm_{arch}a" if arch == 90 else f"-arch=sm_{arch}", "-v", ptx,
                               "-o", os.devnull], capture_output=True, text=True, check=True)
    return proc.stderr


def resources(ptxas_output: str) -> dict:
    regs = re.search(r"Used (\d+) registers", ptxas_output)
    spill = re.search(r"(\d+) bytes spill stores", ptxas_output)
    return dict(registers=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="32,64,72,128", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--dtypes", default="bf16,fp32", type=lambda s: s.split(","))
    parser.add_argument("--directions", default="cosine,relu_split", type=lambda s: s.split(","))
    parser.add_argument("--arch", type=int, default=90, help="compute capability ×10 (90: H100/H200)")
    args = parser.parse_args(argv)
    if tn.INTERPRETED:
        parser.error("unset TRITON_INTERPRET: the interpreter builds no compilable kernels")
    failures = 0
    for d in args.head_dims:
        for dtype in args.dtypes:
            for direction in args.directions:
                for label, kernel, pointers, constexprs, warps in kernel_variants(d, dtype, direction):
                    name = f"D={d:<4d}{dtype:5s}{direction:11s}{label:7s}"
                    try:
                        r = resources(compile_kernel(kernel, pointers, constexprs, warps, args.arch))
                        print(f"{name} warps {warps}  registers {r['registers']:>3}  spills {r['spill_bytes']} B", flush=True)
                    except Exception as err:  # noqa: BLE001  (report every failing variant)
                        failures += 1
                        print(f"{name} FAILED {type(err).__name__}: {str(err)[:2000]}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
