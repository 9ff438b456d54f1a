"""Where the fused CPU path's time goes, one thread, CPU time (docs/performance.md).

Three sections, each timed by ``time.thread_time`` (the CPU time of this thread: a shared
machine's stolen time left out), median of ``--repeats``:

* ``lift``: the query lift of one token chunk (DiT-S/2 heads, 6 × 64, ``--chunk`` tokens) three
  ways: the fused path's in-place lift (``nala._query_lift``), the same math as plain unfused
  ops (fresh tensors, ``torch.cat`` of the halves), and that composition under
  ``torch.compile`` (inductor's C++ loop). Is a compiled loop the way below the op-by-op floor?
* ``chunks``: the fused forward and forward + backward at ``--tokens`` with the token chunks of
  near-equal length (``nala._token_chunks``, the default) against fixed-size chunks with a
  ragged last one (the previous policy), paired repeat by repeat: the median of the per-repeat
  ratios and its quartiles.
* ``profile``: cProfile over ``--calls`` forward calls at ``--profile-tokens``: the share of
  the batched GEMMs, the transcendental passes, the other aten calls and the rest (Python,
  views, dispatch).

    python benchmarks/cpu_path.py --out benchmarks/results/cpu_path.json
    python benchmarks/cpu_path.py --tiny --out runs/cpu_path.json      # smoke test, seconds
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402

import nala_dit.attention.nala.fused as nala  # noqa: E402
from nala_dit.attention import nala_attention  # noqa: E402
from nala_dit.attention import NaLaConfig  # noqa: E402

HEADS, HEAD_DIM = 6, 64
GEMMS = ("bmm", "baddbmm", "baddbmm_", "mm")
TRANSCENDENTAL = ("sin", "sin_", "tanh", "tanh_", "log", "log_", "exp", "exp_", "sqrt", "sqrt_", "pow", "pow_")


def cpu_us(fn, repeats: int) -> float:
    """Median CPU time of one call, µs, after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return 1e6 * statistics.median(times)


def naive_lift(q, inv, p, alpha=20.0):
    """The query lift of NALA_SPEC §2 as plain ops: every intermediate a fresh tensor."""
    q_hat = q * inv
    a = torch.exp(p * torch.log(q_hat.abs()))
    theta = torch.tanh(alpha * q_hat) * (math.pi / 4)
    return torch.cat([a * torch.cos(theta), a * torch.sin(theta)], -1)


def lift_section(chunk: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, chunk, HEAD_DIM, generator=g)
    opts = nala.fused_opts(NaLaConfig(), HEAD_DIM)
    t = nala._token_scales(q, opts, query=True, grad=False)
    feat = torch.empty(1, HEADS, chunk, 2 * HEAD_DIM)
    halves = (feat[..., :HEAD_DIM], feat[..., HEAD_DIM:])
    compiled = torch.compile(naive_lift, dynamic=False)
    nala._query_lift(q, t, opts, halves)
    ref = naive_lift(q, t["inv"], t["p"])
    err = max((feat - ref).abs().max().item(), (compiled(q, t["inv"], t["p"]) - ref).abs().max().item())
    return dict(chunk_tokens=chunk, max_abs_diff=err,
                fused_us=cpu_us(lambda: nala._query_lift(q, t, opts, halves), repeats),
                eager_us=cpu_us(lambda: naive_lift(q, t["inv"], t["p"]), repeats),
                compiled_us=cpu_us(lambda: compiled(q, t["inv"], t["p"]), repeats))


def ragged_chunks(shape, device):
    """The previous policy: chunks of the cap's length, the last one what is left."""
    b, h, n, d = shape
    size = max(64, nala._CHUNK_ELEMENTS // max(1, b * h * d))
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def chunks_section(tokens: list[int], repeats: int) -> list[dict]:
    policies = {"near_equal": nala._token_chunks, "ragged": ragged_chunks}
    rows = []
    try:
        for n in tokens:
            g = torch.Generator().manual_seed(n)
            q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g).requires_grad_() for _ in range(3))
            calls = {"fwd": lambda: nala_attention(q, k, v, impl="fused"),
                     "fwd+bwd": lambda: nala_attention(q, k, v, impl="fused").sum().backward()}
            for mode, call in calls.items():
                times = {name: [] for name in policies}
                for _ in range(repeats):
                    for name, policy in policies.items():
                        nala._token_chunks = policy
                        times[name].append(cpu_us(call, 1))
                ratios = sorted(a / b for a, b in zip(times["near_equal"], times["ragged"]))
                quartile = lambda f: ratios[min(len(ratios) - 1, int(f * len(ratios)))]  # noqa: E731
                rows.append(dict(tokens=n, mode=mode, chunks={k: len(p(q.shape, q.device)) for k, p in policies.items()},
                                 near_equal_us=statistics.median(times["near_equal"]),
                                 ragged_us=statistics.median(times["ragged"]),
                                 ratio_median=statistics.median(ratios), ratio_q1=quartile(0.25),
                                 ratio_q3=quartile(0.75)))
    finally:
        nala._token_chunks = policies["near_equal"]
    return rows


def profile_section(tokens: int, calls: int) -> dict:
    q, k, v = (torch.randn(1, HEADS, tokens, HEAD_DIM) for _ in range(3))
    for _ in range(3):
        nala_attention(q, k, v, impl="fused")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        nala_attention(q, k, v, impl="fused")
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.items())
    shares = dict(gemm=0.0, transcendental=0.0, other_aten=0.0)
    for (filename, _, name), (_, _, tottime, _, _) in stats.items():
        # torch's C functions: "<built-in method torch.bmm>", "<method 'sin_' of 'torch._C.TensorBase' objects>"
        if filename != "~" or "torch" not in name:        # Python code and other builtins: the rest
            continue
        op = name.split("'")[1] if name.startswith("<method '") else name.strip("<>").rsplit(".", 1)[-1]
        key = "gemm" if op in GEMMS else "transcendental" if op in TRANSCENDENTAL else "other_aten"
        shares[key] += tottime
    shares["python_views_dispatch"] = total - sum(shares.values())
    return dict(tokens=tokens, calls=calls, ms_per_call=1e3 * total / calls,
                shares={key: value / total for key, value in shares.items()})


def main(argv=None) -> int:
    from benchmarks.outputs import new_output  # an existing results file is refused

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk", type=int, default=170, help="tokens of the lift's chunk (170: the cap at 6 × 64)")
    p.add_argument("--tokens", default="64,200,256,300,1024,1100", help="comma-separated N of the chunks section")
    p.add_argument("--profile-tokens", type=int, default=1024)
    p.add_argument("--calls", type=int, default=50, help="forward calls under cProfile")
    p.add_argument("--repeats", type=int, default=30, help="paired repeats (chunks); the lift takes 10x")
    p.add_argument("--tiny", action="store_true", help="small sizes and 3 repeats: a smoke test")
    p.add_argument("--out", type=new_output)
    args = p.parse_args(argv)
    tokens = [int(n) for n in args.tokens.split(",")]
    if args.tiny:
        args.chunk, tokens, args.profile_tokens, args.calls, args.repeats = 16, [40, 171], 64, 3, 3
    if min([args.chunk, args.profile_tokens, args.calls, args.repeats, *tokens]) < 1:
        p.error("--chunk, --tokens, --profile-tokens, --calls and --repeats must be >= 1")
    torch.set_num_threads(1)
    load = os.getloadavg()
    data = dict(meta=dict(command="python benchmarks/cpu_path.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                          torch=torch.__version__, threads=1, dtype="fp32", heads=HEADS, head_dim=HEAD_DIM,
                          cpu_capability=torch.backends.cpu.get_cpu_capability(), cpu_count=os.cpu_count(),
                          load_average_start=list(load), time="time.thread_time, median"),
                lift=lift_section(args.chunk, 10 * args.repeats),
                chunks=chunks_section(tokens, args.repeats),
                profile=profile_section(args.profile_tokens, args.calls))
    data["meta"]["load_average_end"] = list(os.getloadavg())
    lift = data["lift"]
    print(f"lift of {lift['chunk_tokens']} tokens: fused {lift['fused_us']:.1f} us, eager {lift['eager_us']:.1f} us, "
          f"compiled {lift['compiled_us']:.1f} us")
    for r in data["chunks"]:
        print(f"chunks N={r['tokens']:5d} {r['mode']:8s} near-equal / ragged {r['ratio_median']:.3f} "
              f"({r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}), chunks {r['chunks']}")
    print("profile:", {k: round(v, 3) for k, v in data["profile"]["shares"].items()})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
