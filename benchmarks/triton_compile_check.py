"""Compile the NaLa Triton kernels for a GPU architecture without a GPU, and print per
kernel what ptxas and the SASS say: registers per thread, spill bytes, the shared memory
Triton gives a program, programs per SM (what the register file, the shared memory and the
warp slots allow together, ``occupancy``), the matrix instructions (``HGMMA``: Hopper's wgmma; ``HMMA``: the
older mma.sync) and the special-function unit's operations (``MUFU.SIN``, ``MUFU.EX2``, ...;
sin/cos/log missing from that list run as software polynomials on the FMA pipes).

Triton lowers a kernel to PTX without a driver, and its wheel carries ``ptxas``; so the
CUDA compilation path (which Triton's interpreter skips) can be checked on any machine,
and block sizes can be chosen so that no kernel spills registers (``_CONFIGS`` in
``nala_dit/attention/nala/triton/launch.py`` was). It says nothing about speed.

    python benchmarks/triton_compile_check.py                        # every variant, sm_90
    python benchmarks/triton_compile_check.py --head-dims 72 --dtypes bf16 --directions cosine
    python benchmarks/triton_compile_check.py --variant baseline     # the kernels before the rework
    python benchmarks/triton_compile_check.py --previous             # the launch configs before two programs per SM
    python benchmarks/triton_compile_check.py --gated 384,1152       # the gated layer's epilogue kernels

Under the GPU machines' Triton (3.6; the venv's is newer), with that wheel's own ptxas and
nvdisasm (the ``--out`` JSON's meta names the three versions):

    bash benchmarks/triton_version_env.sh 3.6.0       # once: runs/triton-3.6.0/site
    PYTHONPATH=runs/triton-3.6.0/site python benchmarks/triton_compile_check.py --launches 384/6,1152/16

``tests/attention/test_triton_kernels.py`` (``test_kernels_compile_for_hopper``) runs it for
head dim 72 (bf16, cosine) and holds what its docstring lists (wgmma, the MUFU operations, no
local-memory traffic but dq's small spill).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchmarks.outputs import new_output  # noqa: E402  (an existing results file is refused)
from nala_dit.attention.nala.triton import launch as tn  # noqa: E402

FLOAT_ARGS = {"power", "offset", "alpha", "norm_eps", "eps", "inv_n"}
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
NVDISASM = PTXAS.with_name("nvdisasm")


# What one SM holds (sm_90, H100/H200; CUDA programming guide, compute capability 9.0,
# and the occupancy calculator's constants): 64 K 32-bit registers, allocated per warp in
# units of 256 (a thread's count rounded up to a multiple of 8; at most 255 per thread);
# 228 KB of shared memory, at most 227 KB per program, plus 1 KB the driver reserves for
# every resident program; 64 warps; 32 programs. So two programs of 8 warps need ≤ 128
# registers, two of 4 warps ≤ 255 (and each ≤ 113 KB of shared memory).
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256               # per warp
SHARED_PER_SM = 228 * 1024
SHARED_PER_PROGRAM = 227 * 1024
SHARED_RESERVED = 1024            # per resident program
WARPS_PER_SM = 64
PROGRAMS_PER_SM = 32


def occupancy(registers: int, num_warps: int, shared_bytes: int = 0) -> dict:
    """Programs per SM of a kernel with ``registers`` per thread, ``num_warps`` warps and
    ``shared_bytes`` of shared memory: by registers, by shared memory, and the resulting
    ``programs_per_sm`` (the least of those and the warp and program slots; 0: cannot launch)."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_regs = (REGISTERS_PER_SM // per_warp) // num_warps if registers <= 255 else 0
    by_shared = SHARED_PER_SM // (shared_bytes + SHARED_RESERVED) if shared_bytes <= SHARED_PER_PROGRAM else 0
    return dict(programs_by_registers=by_regs, programs_by_shared=by_shared,
                programs_per_sm=min(by_regs, by_shared, WARPS_PER_SM // num_warps, PROGRAMS_PER_SM))


def kernel_variants(head_dim: int, dtype: str, direction: str, variant: str = "fused", config: dict | None = None):
    """(label, kernel, pointer types, constexprs, launch config) for every kernel one call of
    ``variant`` can launch (the fused variant: the single-launch forward, or the atomic
    state pass + output; the baseline: the partial-sum state pass + output); ``config`` as
    ``launch_config``'s override (``{"table": "previous"}``: the entries before the
    register work). The launch config is the kind's entry: num_warps, num_stages, maxnreg.
    The baseline and the previous configs are the kernel module before the rework's
    (``benchmarks/baseline_nala.py``)."""
    if variant == "baseline" or config:
        from benchmarks import baseline_nala_kernels as old

        cfg = old.launch_config(head_dim, config, variant=variant)
        k = lambda kind: old._kernel_for(f"_{kind}_kernel", cfg)  # noqa: E731  (its kernels by name)
    else:
        cfg = tn.launch_config(head_dim)
        k = lambda kind: tn._kernel_for(kind, cfg)  # noqa: E731  (the split forms where D is split)
    fw, st, out, dq, dkv = (cfg[kind] for kind in tn.KINDS)
    p, f = f"*{dtype}", "*fp32"
    half = "bf16" if variant == "fused" else "tf32"
    base = dict(COSINE=direction == "cosine", PREC="ieee" if dtype == "fp32" else half)
    if "BA" in cfg:
        base["D"] = head_dim     # the split kernels take D as a constant (vectorised state loads)
    st_c = dict(base, BLOCK_N=st["BLOCK_N"], **tn._tile_args(cfg, "state"), ATOMIC=variant == "fused")
    fused = [("forward", k("forward"), dict(K=p, V=p, Q=p, ScaleP=f, S=f, Z=f, O=p, DEN=f),
              dict(base, BLOCK_N=fw["BLOCK_N"], **tn._tile_args(cfg, "forward"),
                   **({"BLOCK_O": out["BLOCK_N"]} if "BA" in cfg else {})), fw)] \
        if variant == "fused" else []
    return fused + [
        ("state", k("state"), dict(X=p, V=p, ScaleP=f, S_part=f, Z_part=f),
         dict(st_c, QUERY=False, DEN=None, DDEN=None), st),
        ("output", k("output"), dict(Q=p, ScaleP=f, S=f, Z=f, O=p, DEN=f),
         dict(base, BLOCK_N=out["BLOCK_N"], **tn._tile_args(cfg, "out")), out),
        ("dq", k("dq"), dict(Q=p, G=p, ScaleP=f, S=f, Z=f, DEN=f, DQ=p, DDEN=f, DU=f),
         dict(base, BLOCK_N=dq["BLOCK_N"], **tn._tile_args(cfg, "dq", nv=True), NEED_DU=False, DQ_STRIDED=False), dq),
        ("dstate", k("state"), dict(X=p, V=p, ScaleP=f, S_part=f, Z_part=f, DEN=f, DDEN=f),
         dict(st_c, QUERY=True), st),
        ("dkv", k("dkv"), dict(K=p, V=p, DS=f, DZ=f, DK=p, DV=p),
         dict(base, BLOCK_N=dkv["BLOCK_N"], **tn._tile_args(cfg, "dkv", nv=True), ADD_DV=False), dkv),
    ]


def gated_variants(channels: int, dtype: str):
    """(label, kernel, pointer types, constexprs, num_warps) for the gated layer's epilogue
    kernels (``nala_dit/attention/nala/triton/gated.py``) at hidden size ``channels``."""
    from nala_dit.attention.nala.triton import gated as tg

    block_t, block_c, warps = tg._blocks(channels)
    p, f = f"*{dtype}", "*fp32"
    blocks = dict(BLOCK_T=block_t, BLOCK_C=block_c)
    params = dict(LW=f, LB=f, NW=f, NB=f)
    return [
        ("epilogue", tg._epilogue_kernel, dict(QKVG=p, O=p, OUT=p, MEAN=f, RSTD=f, ACC=f, ZEROED=f, **params),
         blocks, warps),
        ("norm_bwd", tg._norm_backward_kernel, dict(QKVG=p, O=p, DOUT=p, MEAN=f, RSTD=f, DO=f, DQKVG=p, ACC=f,
                                                    ZEROED=f, **params), blocks, warps),
        ("lepe_bwd", tg._lepe_backward_kernel, dict(QKVG=p, LW=f, DO=f, DQKVG=p, ACC=f),
         dict(BLOCK_T=tg.LEPE_BLOCK_T, BLOCK_C=tg.LEPE_BLOCK_C, TOKENS=tg.TOKENS), tg.LEPE_WARPS),
    ]


def gated_report(channels: int, dtype: str = "bf16", arch: int = 90) -> list[tuple[str, int, dict]]:
    """One row per epilogue kernel of the gated layer: (label, num_warps, resources)."""
    return [(label, warps, resources(*compile_kernel(kernel, pointers, constexprs, warps, arch), warps))
            for label, kernel, pointers, constexprs, warps in gated_variants(channels, dtype)]


def compile_kernel(kernel, pointers: dict, constexprs: dict, num_warps: int, arch: int,
                   num_stages: int | None = None, maxnreg: int | None = None) -> tuple[str, str]:
    """Compile for ``sm_<arch>`` (sm_90a for 90); return the resource report (ptxas's, then a
    line with the shared memory Triton gives each program: dynamic, so ptxas does not see it)
    and the SASS. ``num_stages`` / ``maxnreg``: Triton's options (None: its default, no cap)."""
    signature = {name: "constexpr" if name in constexprs else pointers.get(name) or
                 ("fp32" if name in FLOAT_ARGS else "i32") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32),
                              options=tn._compile_opts(dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)))
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        Path(ptx).write_text(compiled.asm["ptx"])
        proc = subprocess.run([str(PTXAS), f"-arch=sm_{arch}a" if arch == 90 else f"-arch=sm_{arch}", "-v", ptx,
                               "-o", cubin], capture_output=True, text=True, check=True)
        sass = subprocess.run([str(NVDISASM), cubin], capture_output=True, text=True, check=True).stdout
    return proc.stderr + f"\nTriton shared memory: {compiled.metadata.shared} bytes\n", sass


def resources(ptxas_output: str, sass: str = "", num_warps: int = 0) -> dict:
    """Registers, spill bytes, shared memory, programs per SM (``occupancy``; with
    ``num_warps``), and SASS instruction counts: HGMMA (wgmma), HMMA (mma.sync), each MUFU
    operation, local loads/stores (LDL/STL)."""
    regs = re.search(r"Used (\d+) registers", ptxas_output)
    spill = re.search(r"(\d+) bytes spill stores", ptxas_output)
    shared = re.search(r"Triton shared memory: (\d+) bytes", ptxas_output)
    ops = collections.Counter(m.group(1) for m in re.finditer(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)",
                                                           sass, re.M))
    r = dict(registers=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None,
             shared_bytes=int(shared.group(1)) if shared else 0)
    if num_warps and r["registers"]:
        r.update(occupancy(r["registers"], num_warps, r["shared_bytes"]))
    r["hgmma"] = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    r["hmma"] = sum(n for op, n in ops.items() if op.startswith("HMMA"))
    r["mufu"] = dict(sorted((op.split(".", 1)[1], n) for op, n in ops.items() if op.startswith("MUFU.")))
    r["local"] = sum(n for op, n in ops.items() if op.split(".")[0] in ("LDL", "STL"))
    # Global atomics: ATOMG (returns the old value), REDG (reduction, no return); a fenced
    # one (acq_rel, Triton's default sem) comes with MEMBAR.ALL.GPU (and CCTL.IVALL) around
    # it, a relaxed one is a lone REDG (its .STRONG.GPU is the scope, not a fence). MEMBAR
    # counts the GPU- and system-scope ones only: MEMBAR.ALL.CTA beside FENCE.VIEW.ASYNC is
    # wgmma's shared-memory proxy fence.
    r["atomics"] = sum(n for op, n in ops.items() if op.split(".")[0] in ("ATOMG", "RED", "REDG", "ATOM"))
    r["membar"] = sum(n for op, n in ops.items() if op.startswith("MEMBAR") and not op.endswith(".CTA"))
    r["instructions"] = sum(ops.values())
    return r


def compile_launch(kernel, pointers: dict, constexprs: dict, launch: dict, arch: int) -> dict:
    """``resources`` of a kernel compiled with a launch config (a ``launch_config`` kind's
    entry), which the row also names (num_warps, num_stages, maxnreg)."""
    r = resources(*compile_kernel(kernel, pointers, constexprs, launch["num_warps"], arch, launch.get("num_stages"),
                                  launch.get("maxnreg")), launch["num_warps"])
    return dict(r, num_stages=launch.get("num_stages"), maxnreg=launch.get("maxnreg"))


def report(head_dim: int, dtype: str, direction: str, variant: str = "fused", arch: int = 90, labels=None,
           config: dict | None = None):
    """One row per kernel (those named in ``labels``, default all): (label, num_warps, resources);
    ``config`` as ``kernel_variants``'."""
    rows = []
    for label, kernel, pointers, constexprs, launch in kernel_variants(head_dim, dtype, direction, variant, config):
        if labels is not None and label not in labels:
            continue
        rows.append((label, launch["num_warps"], compile_launch(kernel, pointers, constexprs, launch, arch)))
    return rows


# ------------------------------------------------ through the launches, as a GPU run sees them


class StandInDriver:
    """What a Triton launch asks its driver, answered without a GPU: device 0, stream 0 and
    the target to compile for."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def stand_in_launches(arch: int = 90, sms: int = 132):
    """Inside, every Triton launch compiles its kernel for ``sm_<arch>`` exactly as the launch
    specialises it (argument dtypes, 16-byte-aligned pointers, integers equal to 1 such as a
    unit stride, or divisible by 16), and records it instead of running it; the state passes
    split the tokens as on a GPU of ``sms`` SMs. Yields the list of ``(kernel name, grid,
    CompiledKernel)``. The launch code runs on CPU tensors of the real shapes and strides."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    launched, touched = [], set()
    run, previous, target = JITFunction.run, driver._active, tn._programs_target

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        touched.add(self)
        launched.append((self.fn.__name__, tuple(grid), kernel))
        return kernel

    driver.set_active(StandInDriver(arch))
    JITFunction.run = compile_only
    tn._programs_target = lambda device: 4 * sms
    try:
        yield launched
    finally:
        JITFunction.run, driver._active, tn._programs_target = run, previous, target
        for jit in touched:                  # nothing compiled here is taken for a real device 0
            jit.device_caches.pop(0, None)


def run_launches(launched: list, channels: int, heads: int, dtype: str = "bf16", lengths=(256, 1056),
                 learned: bool = True):
    """One training step's Triton launches of a gated NaLa layer of width ``channels`` and of
    NaLa alone (``TritonNaLa``'s launches), forward and backward, at each of ``lengths`` tokens
    (below 1,024: the single-launch forward; from 1,024: the atomic state passes and the output
    kernel), through the real launch functions (inside ``stand_in_launches``, whose list is
    ``launched``: each entry's name gets the layer and N it ran for)."""
    import torch

    from nala_dit.attention.config import NaLaConfig
    from nala_dit.attention.nala.fused import fused_opts
    from nala_dit.attention.nala.triton.gated import TritonGatedMiddle

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    d = channels // heads
    opts = {k: v for k, v in fused_opts(NaLaConfig(), d).items() if k != "norm_scale"}
    opts.update(precision="ieee" if dtype == "fp32" else "bf16")   # resolve_opts on a GPU
    for n in lengths:
        gh = int(n ** 0.5)
        grid = (gh, n // gh)
        assert grid[0] * grid[1] == n, f"{n} tokens are no near-square grid"
        b = 2
        # NaLa alone: (B, H, N, D) contiguous, as TritonNaLa allocates them
        q, k, v, g = (torch.randn(b, heads, n, d).to(dt) for _ in range(4))
        cfg = tn.launch_config(d)
        splits = tn.fit_splits(tn.num_splits(n, b * heads, cfg["state"]["NV"], torch.device("cuda")), n, q, k, v)
        scale = torch.ones(heads)
        out = torch.empty_like(q)
        first = len(launched)
        state, z, den = tn.forward_launch(q, k, v, scale, opts, cfg, splits, out)
        tn.backward_launch(q, k, v, scale, state, z, den, g, opts, cfg, splits, *(torch.empty_like(q) for _ in range(3)),
                           need_scale=learned)
        mid = len(launched)
        # the gated layer: q, k, v, g strided views of one (B, N, 4C) projection
        qkvg = torch.randn(b, n, 4 * channels).to(dt).requires_grad_()
        params = [torch.randn(channels, 1, 5, 5), torch.randn(channels), torch.randn(channels), torch.randn(channels)]
        params = [p.requires_grad_() for p in params]
        spec = dict(heads=heads, norm_eps=1e-6, opts=opts, grid=grid)
        y = TritonGatedMiddle.apply(qkvg, torch.ones(heads, requires_grad=learned), *params, spec)
        y.backward(torch.randn(y.shape).to(dt))
        for i in range(first, len(launched)):
            name, grid, kernel = launched[i]
            launched[i] = (f"{'NaLa' if i < mid else 'gated'} N={n}: {name}", grid, kernel)


SPECIALISING = ("QUERY", "ATOMIC", "NEED_DU", "DQ_STRIDED", "ADD_DV", "KEEP")


def launched_report(launched, arch: int = 90) -> list[tuple[str, dict]]:
    """One row per distinct compiled specialisation among ``launched``
    (``stand_in_launches``): a label (kernel, the constexprs that tell its variants apart,
    a float32 gradient input where it is one) and ``resources`` of its PTX assembled by
    ptxas, plus the PTX's own counts: ``ptx_atomics`` (atom/red), ``ptx_fenced`` (membar,
    fence.sc / fence.acq_rel, and acquire/release atomics: Triton's default sem)."""
    rows, seen = [], set()
    for name, _grid, kernel in launched:
        if kernel.hash in seen:
            continue
        seen.add(kernel.hash)
        names = kernel.src.fn.arg_names
        consts = {names[key[0]]: value for key, value in kernel.src.constants.items()}
        tags = [f"{k}={int(consts[k])}" for k in SPECIALISING if k in consts]
        tags += [f"{arg} {kernel.src.signature[arg].lstrip('*')}" for arg in ("G", "DO") if
                 kernel.src.signature.get(arg) == "*fp32"]
        ptx = kernel.asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            path, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
            Path(path).write_text(ptx)
            proc = subprocess.run([str(PTXAS), f"-arch=sm_{arch}a" if arch == 90 else f"-arch=sm_{arch}", "-v", path,
                                   "-o", cubin], capture_output=True, text=True, check=True)
            sass = subprocess.run([str(NVDISASM), cubin], capture_output=True, text=True, check=True).stdout
        r = resources(proc.stderr + f"\nTriton shared memory: {kernel.metadata.shared} bytes\n", sass,
                      kernel.metadata.num_warps)
        r["num_warps"] = kernel.metadata.num_warps
        r["warps_per_sm"] = r.get("programs_per_sm", 0) * kernel.metadata.num_warps
        r["ptx_atomics"] = len(re.findall(r"^\s*(?:@%p\d+\s+)?(?:atom|red)\.", ptx, re.M))
        r["ptx_fenced"] = len(re.findall(r"\bmembar\.|\bfence\.(?:sc|acq_rel)\b|\b(?:atom|red)\.[\w.]*\.(?:acq_rel|acquire|release)\b",
                                         ptx))
        rows.append((" ".join([name] + tags), r))
    return rows


def tool_version(tool: Path) -> str:
    """The CUDA release of one of Triton's bundled tools (``V12.8.93``): Triton 3.6 and 3.8
    ship different ptxas and nvdisasm, which the committed reports record."""
    out = subprocess.run([str(tool), "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"\bV(\d+\.\d+\.\d+)", out)
    return f"V{found.group(1)}" if found else out.strip().splitlines()[-1]


def format_row(r: dict) -> str:
    mufu = " ".join(f"{op}:{n}" for op, n in r["mufu"].items()) or "-"
    return (f"registers {r['registers']:>3}  spills {r['spill_bytes']} B  shared {r['shared_bytes'] // 1024:>3} KB  "
            f"programs/SM {r.get('programs_per_sm')} (registers {r.get('programs_by_registers')}, "
            f"shared {r.get('programs_by_shared')})  "
            f"HGMMA {r['hgmma']:>3}  HMMA {r['hmma']:>3}  LDL/STL {r['local']}  atomics {r['atomics']} "
            f" MEMBAR {r['membar']}  SASS {r['instructions']}  MUFU {mufu}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="32,64,72,128", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--dtypes", default="bf16,fp32", type=lambda s: s.split(","))
    parser.add_argument("--directions", default="cosine,relu_split", type=lambda s: s.split(","))
    parser.add_argument("--arch", type=int, default=90, help="compute capability ×10 (90: H100/H200)")
    parser.add_argument("--variant", default="fused", choices=("fused", "baseline"),
                        help="the kernels to compile (baseline: before the rework; see NALA_TRITON_VARIANT)")
    parser.add_argument("--previous", dest="config", action="store_const", const={"table": "previous"},
                        help="the fused variant's launch configs from before the register work")
    parser.add_argument("--gated", default=None, type=lambda s: [int(x) for x in s.split(",")],
                        help="instead: the gated layer's epilogue kernels at these hidden sizes (e.g. 384,1152)")
    parser.add_argument("--launches", default=None, type=lambda s: [tuple(map(int, x.split("/"))) for x in s.split(",")],
                        help="instead: every kernel specialisation one training step launches, compiled through the "
                             "real launch functions (a stand-in driver, CPU tensors of the real shapes and strides), "
                             "for widths/heads such as 384/6,1152/16")
    parser.add_argument("--out", default="", type=new_output,
                        help="with --launches: also write the rows as JSON (the committed report: benchmarks/results/)")
    args = parser.parse_args(argv)
    if tn.INTERPRETED:
        parser.error("unset TRITON_INTERPRET: the interpreter builds no compilable kernels")
    if args.launches:
        rows = []
        for c, h in args.launches:
            for dtype in args.dtypes:
                with stand_in_launches(args.arch) as launched:
                    run_launches(launched, c, h, dtype)
                for label, r in launched_report(launched, args.arch):
                    rows.append(dict(width=c, heads=h, dtype=dtype, specialisation=label, **r))
                    print(f"C={c:<5d}H={h:<3d}{dtype:5s}{label:50s} warps {r['num_warps']:>2}  warps/SM "
                          f"{r['warps_per_sm']:>2}  PTX atom/red {r['ptx_atomics']} fenced {r['ptx_fenced']}  "
                          f"{format_row(r)}", flush=True)
        if args.out:
            meta = dict(command="python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None
                                                                                     else sys.argv[1:])]),
                        arch=f"sm_{args.arch}a" if args.arch == 90 else f"sm_{args.arch}", triton=triton.__version__,
                        torch=torch.__version__, ptxas=tool_version(PTXAS), nvdisasm=tool_version(NVDISASM),
                        how="compiled through the real launch functions with a stand-in driver (no GPU); SASS from "
                        "Triton's nvdisasm")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
        return
    if args.gated:
        for c in args.gated:
            for dtype in args.dtypes:
                for label, warps, r in gated_report(c, dtype, args.arch):
                    print(f"C={c:<5d}{dtype:5s}{label:9s} warps {warps}  {format_row(r)}", flush=True)
        return
    failures = 0
    for d in args.head_dims:
        for dtype in args.dtypes:
            for direction in args.directions:
                for label, kernel, pointers, constexprs, launch in kernel_variants(d, dtype, direction, args.variant,
                                                                                   args.config):
                    name = f"D={d:<4d}{dtype:5s}{direction:11s}{label:8s}"
                    try:
                        r = compile_launch(kernel, pointers, constexprs, launch, args.arch)
                        cap = f" cap {r['maxnreg']}" if r["maxnreg"] else ""
                        stages = f" stages {r['num_stages']}" if r["num_stages"] else ""
                        print(f"{name} warps {launch['num_warps']}{cap}{stages}  {format_row(r)}", flush=True)
                    except Exception as err:  # noqa: BLE001  (report every failing variant)
                        failures += 1
                        print(f"{name} FAILED {type(err).__name__}: {str(err)[:2000]}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
