"""Time and peak memory of one attention call: NaLa against its reference points.

Methods, all on DiT-S/2 heads (B=1, 6 heads × 64) unless told otherwise:

* ``nala``        -- ``nala_attention`` with ``impl="auto"``: the fused token-chunked path
  on CPU, the Triton kernels (``nala_dit/attention/nala/triton/``) on CUDA;
* ``nala_naive``  -- NaLa written naively, unfused (the default cosine direction,
  concatenated features, a chain of elementwise ops, einsums, autograd saving
  everything; the released code's structure, not its relu_split direction): the
  reference point the fast path is measured against;
* ``relu``        -- ReLU linear attention with the same normalisation (the floor:
  what any kernel linear attention costs);
* ``sdpa``        -- softmax through ``F.scaled_dot_product_attention`` (fused kernel);
* ``math``        -- explicit ``softmax(q kᵀ/√D) v``, only while its N×N matrix fits
  under ``--math-cap-gib``;
* ``nala_compile``-- ``torch.compile`` of ``nala_attention(impl="eager")`` with ``--compile`` (slow to build).

``--jvp`` adds a third mode: ``torch.func.jvp`` of each method for tangents of q, k and v
(what a MeanFlow training step adds), with each method's JVP time over its forward time
(``time_jvp/fwd_<method>``, the forward timed again call by call beside the JVP: ``fwd_beside_ms``,
so a change of machine load between the modes does not enter the ratio); a method without a
forward-mode rule is recorded as skipped.

On CUDA also:

* ``nala_eager``  -- the unchunked composition ``impl="eager"`` (what ``auto`` falls back
  to without Triton);
* ``sdpa_flash``, ``sdpa_cudnn`` -- SDPA forced onto the FlashAttention and cuDNN
  backends (``sdpa`` is whatever SDPA picks by itself).

A method that raises (a backend that does not take the dtype, out of memory) is recorded
as skipped with the error, and the others go on; ``--budget-s`` stops starting new token
counts once that many seconds have passed, so a run fits a fixed time slot.

All methods at one N run back to back, repeat after repeat (round robin), so a noisy
shared machine disturbs them alike and the ratios stay meaningful. A method whose
single call took longer than ``--time-cap`` seconds is skipped at larger N.

Time: the median wall time of a call (``time_ms``, host launch overhead included) and, on
CUDA, beside it the median GPU time between CUDA events around the same call (``gpu_ms``;
``null`` on the CPU; ``benchmarks/timing.py``).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` minus what was allocated
before the call. On CPU a ``TorchDispatchMode`` tracks every tensor storage that an
operator creates (not views of existing ones) and frees it through a weakref
finalizer, so the peak counts all tensors alive at once during the call (outputs,
saved activations, gradients). Scratch space a C++ kernel allocates internally without
returning it (e.g. SDPA's per-thread blocks) is not seen; it is small.

    python benchmarks/attention.py --out benchmarks/results/attention_cpu.json
    python benchmarks/attention.py --dtype bf16 --max-tokens 16384 --repeats 3
    python benchmarks/attention.py --device cuda --dtype bf16 --compile --min-tokens 1024 --step 2 \\
        --out benchmarks/results/attention_cuda.json
    python benchmarks/attention.py --tiny --out runs/attention.json     # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import weakref
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from nala_dit.attention import (  # noqa: E402
    linear_attention,
    nala_attention,
    softmax_attention_reference,
)
from nala_dit.attention.regions import initial_region_logits, region_nala_attention  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benchmarks.timing import median_or_none, sync, timed_call  # noqa: E402  (wall and GPU time)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("fwd", "fwd+bwd")


def nala_naive(q, k, v, power=3.0, offset=0.5, alpha=20.0, eps=1e-6):
    """NaLa written naively, unfused, in the default cosine direction (the released
    code's structure, not its relu_split direction: ``NaLaConfig.authors()`` is that):
    every feature is a fresh tensor, the halves are concatenated, and autograd keeps
    all intermediates."""
    q, k, v = q.float(), k.float(), v.float()
    q_norm = q.norm(dim=-1, keepdim=True)
    q_dir = q / q_norm.clamp_min(1e-6)
    k_dir = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    p = power * (offset + torch.tanh(q_norm))
    q_mag = torch.pow(torch.abs(q_dir), p)
    k_mag = torch.pow(torch.abs(k), power)
    theta_q = math.pi / 4 * torch.tanh(alpha * q_dir)
    theta_k = math.pi / 4 * torch.tanh(alpha * k_dir)
    q_feat = torch.cat([q_mag * torch.cos(theta_q), q_mag * torch.sin(theta_q)], dim=-1)
    k_feat = torch.cat([k_mag * torch.cos(theta_k), k_mag * torch.sin(theta_k)], dim=-1)
    n = k.shape[-2]
    kv = torch.einsum("bhnf,bhnd->bhfd", k_feat, v) / n
    z = 1.0 / (torch.einsum("bhnf,bhf->bhn", q_feat, k_feat.mean(dim=-2)) + eps)
    return torch.einsum("bhnf,bhfd,bhn->bhnd", q_feat, kv, z).to(v.dtype)


_COMPILED = []


def nala_compiled(q, k, v):
    """``torch.compile`` of the readable composition (``impl="eager"``), built on first use."""
    if not _COMPILED:
        from nala_dit.compile_cache import private_compile_cache

        private_compile_cache()
        _COMPILED.append(torch.compile(partial(nala_attention, impl="eager"), dynamic=True))
    return _COMPILED[0](q, k, v)


def nala_regions(regions):
    """NaLa with R x R region states (``--nala-regions``) on the squarest grid of N tokens,
    at the fresh layer's distance-initialised mixing weights."""
    def attend(q, k, v):
        n = q.shape[-2]
        h = 2 ** (int(math.log2(n)) // 2)
        logits = initial_region_logits(regions, q.shape[1]).to(q.device)
        return region_nala_attention(q, k, v, (h, n // h), logits, regions=regions)
    return attend


def sdpa_on(backend):
    def sdpa(q, k, v):
        # The backend picked in the forward also runs the backward (its own autograd node).
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)
    return sdpa


METHODS = {
    "nala": nala_attention,
    "nala_naive": nala_naive,
    "nala_r2": nala_regions(2),
    "nala_r4": nala_regions(4),
    "relu": lambda q, k, v: linear_attention(q, k, v, kernel="relu"),
    "sdpa": F.scaled_dot_product_attention,
    "math": softmax_attention_reference,
}
CUDA_METHODS = {
    "nala_eager": lambda q, k, v: nala_attention(q, k, v, impl="eager"),
    "sdpa_flash": sdpa_on(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": sdpa_on(SDPBackend.CUDNN_ATTENTION),
}


class PeakMemory(TorchDispatchMode):
    """Peak bytes of tensor storages created while active (CPU method, see above)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Outputs that alias an argument (views, out=, in-place) allocate nothing new.
        seen = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in seen or key in self.live:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out


def make_inputs(n, args, device, dtype, requires_grad):
    g = torch.Generator(device="cpu").manual_seed(n)
    shape = (args.batch, args.heads, n, args.head_dim)
    ts = [torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(3)]
    grad = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in ts], grad


def run_once(fn, inputs, grad, mode):
    if mode == "fwd":
        with torch.no_grad():
            return fn(*inputs)
    if mode == "jvp":   # forward-mode: output and its tangent for tangents of q, k, v (MeanFlow's cost)
        with torch.no_grad():
            return torch.func.jvp(fn, tuple(inputs), (grad, grad, grad))
    for t in inputs:
        t.grad = None
    fn(*inputs).backward(grad)


def timed(fn, inputs, grad, mode, device):
    """(wall seconds, GPU ms or None on the CPU) of one call (``benchmarks/timing.py``)."""
    return timed_call(lambda: run_once(fn, inputs, grad, mode), device)


def peak_memory(fn, inputs, grad, mode, device):
    """Peak bytes allocated by one call beyond what existed before it."""
    for t in inputs:
        t.grad = None
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_once(fn, inputs, grad, mode)
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    with PeakMemory() as tracker:
        run_once(fn, inputs, grad, mode)
    return tracker.peak


def sdpa_backend(device, dtype):
    """Name of the aten kernel SDPA dispatched to for the benchmark shape."""
    from torch.profiler import profile

    q = torch.randn(1, 6, 256, 64, device=device, dtype=dtype)
    with profile() as prof:
        F.scaled_dot_product_attention(q, q, q)
    names = {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")}
    return sorted(names)[0].removeprefix("aten::") if names else "unknown"


def token_counts(args):
    if args.tiny:
        return [64, 256]
    counts, n = [], args.min_tokens
    while n <= args.max_tokens:
        counts.append(n)
        n *= 2 if args.step == 2 else 4
    return counts


def fit_slope(points):
    """Least-squares slope of log(time) against log(N)."""
    if len(points) < 2:
        return None
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def benchmark(args):
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = dict(METHODS)
    if device.type == "cuda":
        methods.update(CUDA_METHODS)
    if args.compile:
        methods["nala_compile"] = nala_compiled
    if args.methods:
        methods = {m: methods[m] for m in args.methods.split(",")}
    repeats = 1 if args.tiny else args.repeats
    warmup = 1 if args.tiny else args.warmup
    results, too_slow, failed = [], set(), {}
    start = time.perf_counter()
    # Both modes at each N before the next N, so a spent --budget-s cuts large N only.
    try:
        for n in token_counts(args):
            over_budget = args.budget_s and time.perf_counter() - start > args.budget_s
            for mode in MODES + (("jvp",) if args.jvp else ()):
                inputs, grad = make_inputs(n, args, device, dtype, mode == "fwd+bwd")
                active = {}
                for name, fn in methods.items():
                    skip = None
                    bytes_nn = args.batch * args.heads * n * n * 4
                    if over_budget:
                        skip = f"--budget-s {args.budget_s} s spent before this point"
                    elif (name, mode) in failed:
                        skip = failed[(name, mode)]
                    elif name == "math" and bytes_nn > args.math_cap_gib * 2**30:
                        skip = f"N×N weights {bytes_nn / 2**30:.1f} GiB > --math-cap-gib"
                    elif (name, mode) in too_slow:
                        skip = f"a call took > --time-cap {args.time_cap} s at a smaller N"
                    if skip:
                        results.append(dict(method=name, mode=mode, n=n, skipped=skip))
                    else:
                        active[name] = fn
                for name, fn in list(active.items()):
                    # The warm-up call doubles as the check that a method runs here at all.
                    try:
                        for _ in range(warmup):
                            run_once(fn, inputs, grad, mode)
                    except Exception as err:  # noqa: BLE001  (a backend refusing the dtype, OOM)
                        message = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                        if not isinstance(err, torch.cuda.OutOfMemoryError):
                            failed[(name, mode)] = message       # it will not run at larger N either
                        results.append(dict(method=name, mode=mode, n=n, skipped=message))
                        del active[name]
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                times = {name: [] for name in active}
                gpu_times = {name: [] for name in active}
                fwd_times = {name: [] for name in active}   # jvp mode: the forward again, call by call beside it
                # Round robin: every method sees the same stretch of machine noise.
                for _ in range(repeats):
                    for name, fn in active.items():
                        wall, gpu = timed(fn, inputs, grad, mode, device)
                        times[name].append(wall)
                        gpu_times[name].append(gpu)
                        if mode == "jvp":
                            fwd_times[name].append(timed(fn, inputs, grad, "fwd", device)[0])
                for name, fn in active.items():
                    median = statistics.median(times[name])
                    if median > args.time_cap:
                        too_slow.add((name, mode))
                    peak = peak_memory(fn, inputs, grad, mode, device)
                    results.append(dict(method=name, mode=mode, n=n, time_ms=1e3 * median,
                                        time_min_ms=1e3 * min(times[name]), peak_mib=peak / 2**20,
                                        gpu_ms=median_or_none(gpu_times[name]), skipped=None))
                    if mode == "jvp":
                        results[-1]["fwd_beside_ms"] = 1e3 * statistics.median(fwd_times[name])
                print(f"{mode:8s} N={n:6d} " + " ".join(
                    f"{r['method']}={r['time_ms']:.1f}ms" for r in results
                    if r["mode"] == mode and r["n"] == n and not r["skipped"]), flush=True)
    except KeyboardInterrupt:  # a time limit (timeout --signal=INT): keep what was measured
        print("interrupted: reporting the results so far", flush=True)
    return results, methods


def modes_of(results):
    """The modes in ``results``: ``MODES``, then ``jvp`` where ``--jvp`` ran it."""
    return [m for m in (*MODES, "jvp") if m in MODES or any(r["mode"] == m for r in results)]


def summarise(results, min_fit_tokens):
    ok = [r for r in results if not r["skipped"]]
    MODES = modes_of(results)  # noqa: N806
    get = {(r["method"], r["mode"], r["n"]): r for r in ok}
    slopes = {mode: {} for mode in MODES}
    for mode in MODES:
        for method in sorted({r["method"] for r in ok}):
            pts = [(r["n"], r["time_ms"]) for r in ok
                   if r["method"] == method and r["mode"] == mode and r["n"] >= min_fit_tokens]
            slopes[mode][method] = fit_slope(pts)
    ratios = []
    for mode in MODES:
        for n in sorted({r["n"] for r in ok if r["mode"] == mode}):
            row = dict(mode=mode, n=n)
            nala = get.get(("nala", mode, n))
            for other in ("relu", "sdpa", "sdpa_flash", "sdpa_cudnn", "nala_naive", "nala_eager", "nala_compile"):
                ref = get.get((other, mode, n))
                if nala and ref:
                    row[f"time_nala/{other}"] = nala["time_ms"] / ref["time_ms"]
                    row[f"mem_nala/{other}"] = nala["peak_mib"] / max(ref["peak_mib"], 1e-9)
            if mode == "jvp":   # each method's JVP call against its own forward call
                for method in sorted({r["method"] for r in ok}):
                    jvp = get.get((method, "jvp", n))
                    if jvp and "fwd_beside_ms" in jvp:   # the forward timed call by call beside the JVP
                        row[f"time_jvp/fwd_{method}"] = jvp["time_ms"] / jvp["fwd_beside_ms"]
            ratios.append(row)
    return slopes, ratios


def print_table(results, ratios):
    methods = sorted({r["method"] for r in results})
    MODES = modes_of(results)  # noqa: N806
    for mode in MODES:
        print(f"\n{mode}: median time ms (peak MiB)")
        print("N".rjust(7) + "".join(m.rjust(22) for m in methods))
        for n in sorted({r["n"] for r in results if r["mode"] == mode}):
            cells = []
            for m in methods:
                r = next((r for r in results if (r["method"], r["mode"], r["n"]) == (m, mode, n)), None)
                cells.append("skipped" if r is None or r["skipped"] else f"{r['time_ms']:.1f} ({r['peak_mib']:.1f})")
            print(f"{n:7d}" + "".join(c.rjust(22) for c in cells))
        keys = ["time_nala/relu", "time_nala/sdpa", "time_nala/nala_naive", "mem_nala/sdpa"]
        keys += [k for k in ("time_nala/sdpa_flash", "mem_nala/sdpa_flash", "time_nala/sdpa_cudnn")
                 if any(k in r for r in ratios)]
        if mode == "jvp":
            keys = [f"time_jvp/fwd_{m}" for m in methods if any(f"time_jvp/fwd_{m}" in r for r in ratios)]
        print("ratios".rjust(7) + "".join(k.replace("time_", "t ").replace("_", " ").rjust(18) for k in keys))
        for row in (r for r in ratios if r["mode"] == mode):
            vals = [row.get(k) for k in keys]
            print(f"{row['n']:7d}" + "".join(("-" if v is None else f"{v:.3f}").rjust(18) for v in vals))


def plot(results, slopes, path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    MODES = modes_of(results)  # noqa: N806
    fig, axes = plt.subplots(1, len(MODES), figsize=(5 * len(MODES), 4), sharey=True)
    for ax, mode in zip(axes, MODES):
        for method in sorted({r["method"] for r in results}):
            pts = sorted((r["n"], r["time_ms"]) for r in results
                         if r["method"] == method and r["mode"] == mode and not r["skipped"])
            if not pts:
                continue
            slope = slopes[mode].get(method)
            label = method + (f" (slope {slope:.2f})" if slope is not None else "")
            ax.loglog(*zip(*pts), marker="o", label=label)
        ax.set_title(f"{mode}, {meta['dtype']}, {meta['device_name']}, {meta['threads']} threads", fontsize=9)
        ax.set_xlabel("tokens N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("median time per call (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def main(argv=None):
    from benchmarks.outputs import new_output  # an existing results file is refused

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=65536)
    parser.add_argument("--step", type=int, choices=(2, 4), default=4, help="N grows by this factor")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--methods", default="", help="comma-separated subset of the methods")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of impl='eager'")
    parser.add_argument("--math-cap-gib", type=float, default=1.0, help="largest N×N matrix for 'math'")
    parser.add_argument("--time-cap", type=float, default=3.0, help="seconds per call before skipping larger N")
    parser.add_argument("--min-fit-tokens", type=int, default=4096, help="slopes fit N >= this")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="start no new token count after this many seconds (0: no limit)")
    parser.add_argument("--tiny", action="store_true", help="N = 64, 256, one repeat (tests)")
    parser.add_argument("--jvp", action="store_true",
                        help="also time torch.func.jvp of each method (tangents of q, k, v; mode 'jvp'), "
                             "with its ratio to the method's forward")
    parser.add_argument("--out", default="", type=new_output, help="JSON path; a PNG plot is written beside it")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results, methods = benchmark(args)
    slopes, ratios = summarise(results, args.min_fit_tokens)
    meta = dict(
        command="python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine()),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        dtype=args.dtype, threads=torch.get_num_threads(), torch=torch.__version__,
        python=platform.python_version(), sdpa_backend=sdpa_backend(device, DTYPES[args.dtype]),
        shape=dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim),
        repeats=1 if args.tiny else args.repeats, statistic="median",
        time_method="time_ms: wall clock around a synchronized call; gpu_ms: CUDA events around it (null on CPU)",
        memory_method="torch.cuda.max_memory_allocated" if device.type == "cuda"
        else "TorchDispatchMode storage tracking (tensors created during the call)",
        methods=list(methods), cpu_count=os.cpu_count(),
        # Other processes on a shared machine slow everything; the 1-minute load average
        # before and after the run says how busy it was.
        load_average=[load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
    )
    print_table(results, ratios)
    print("\nslope of time vs N (N >= %d):" % args.min_fit_tokens,
          json.dumps({m: {k: (None if v is None else round(v, 3)) for k, v in s.items()} for m, s in slopes.items()}))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(meta=meta, results=results, slopes=slopes, ratios=ratios), indent=1))
        plot(results, slopes, out.with_suffix(".png"), meta)
        print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
