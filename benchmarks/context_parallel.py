"""Context parallel on CPU: one image's rows over P = 2 processes against one process.

NaLaDiT-S/2, batch 1, fp32, random weights, one torch thread per process: the time of a
forward (no grad) and of a training step (forward, mean-square loss, backward), the peak
resident memory per process (``ru_maxrss``) and what it grew by during the calls, and the
numbers each rank contributes to the exchanges of one forward, counted at the
``torch.distributed`` calls. The counts are checked against the closed forms of
``context_parallel.exchanged_numbers``, which the table also evaluates for XL/2 at 4K /
16K / 65K tokens (NaLa's state all-reduce plus its LePE halo against softmax's K/V gather).

Every measurement runs in a fresh process (or process pair, gloo): timings take the
median over ``--repeats`` calls after one warm-up, each call between two barriers.
``--preloaded`` (``--tiny`` implies it) forks those processes from one server that imported
torch and the package once instead (``benchmarks/processes.py``): the same measurements
without a Python start-up each.

    python benchmarks/context_parallel.py --tokens 4096 --out benchmarks/results/context_parallel_cpu_4k.json
    python benchmarks/context_parallel.py --tokens 16384 --repeats 1 --out benchmarks/results/context_parallel_cpu_16k.json
    python benchmarks/context_parallel.py --tiny          # smoke test (seconds)
    python benchmarks/context_parallel.py --device cuda --tokens 4096,16384,65536   # NCCL, a GPU per rank

On CUDA "peak" is ``torch.cuda.max_memory_allocated`` of the rank's GPU, and with fewer GPUs
than P only the one-process numbers are measured (NCCL takes one GPU per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import child_env, passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)
SECTIONS = ("forward", "train")


def _count_exchanges(cp_lib, dist, counted: dict) -> None:
    """Route context parallel's collectives through counters of the numbers this rank sends
    (``counted``: all-reduced, all-gathered, reduce-scattered, sent point to point)."""
    real_reduce, real_gather = dist.all_reduce, dist.all_gather

    def all_reduce(t, *a, **k):
        counted["all_reduce"] += t.numel()
        return real_reduce(t, *a, **k)

    def all_gather(outs, t, *a, **k):
        counted["all_gather"] += t.numel()
        return real_gather(outs, t, *a, **k)

    def reduce_scatter_tensor(out, t, *a, **k):
        counted["reduce_scatter"] = counted.get("reduce_scatter", 0) + t.numel()
        return dist.reduce_scatter_tensor(out, t, *a, **k)

    def batch_isend_irecv(ops):
        counted["send"] += sum(op.tensor.numel() for op in ops if op.op is dist.isend)
        return dist.batch_isend_irecv(ops)

    cp_lib.dist = type("CountingDist", (), dict(
        all_reduce=staticmethod(all_reduce), all_gather=staticmethod(all_gather),
        batch_isend_irecv=staticmethod(batch_isend_irecv), P2POp=dist.P2POp, isend=dist.isend,
        reduce_scatter_tensor=staticmethod(reduce_scatter_tensor),
        irecv=dist.irecv))


def _device_and_peak(rank: int, cuda: bool):
    """This rank's device and a function giving its peak memory in MiB (the GPU's allocations,
    or the process's resident memory)."""
    import resource

    import torch

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        return device, lambda: torch.cuda.max_memory_allocated(device) / 2**20
    return device, lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _built_model(cfg: dict, device, procs: int, rank: int, cp_lib):
    """The model of ``cfg`` with small random weights, split over the ``procs`` ranks."""
    import torch
    import torch.distributed as dist

    from nala_dit.models.dit import create_model

    torch.manual_seed(0)
    model = create_model(cfg["model"], input_size=cfg["latent"]).to(device)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.02)
    if procs > 1:
        group = dist.new_group(list(range(procs)))
        cp_lib.enable(model, cp_lib.ContextParallel(procs, rank, group))
    return model


def _timed_calls(model, cfg: dict, device, barrier, counted: dict) -> tuple[list[float], dict]:
    """The section's call (forward, or forward + backward) ``repeats`` + 1 times, each between two
    barriers: (times, the warm-up call's exchanges)."""
    import torch

    x = torch.randn(1, model.in_channels, cfg["latent"], cfg["latent"], generator=torch.Generator().manual_seed(1))
    x, t, y = x.to(device), torch.tensor([500.0], device=device), torch.tensor([1], device=device)

    def call():
        if cfg["section"] == "forward":
            with torch.no_grad():
                model(x, t, y)
        else:
            model(x, t, y).pow(2).mean().backward()
            model.zero_grad(set_to_none=True)

    times, counted_one = [], None
    for i in range(cfg["repeats"] + 1):
        if i == 1:
            counted_one = dict(counted)      # the warm-up call's exchanges
        barrier()
        start = time.perf_counter()
        call()
        barrier()
        times.append(time.perf_counter() - start)
    return times, counted_one


def _measure(rank: int, procs: int, port: int, cfg: dict, out: str) -> None:
    """One process of a measurement (rank 0 writes the JSON)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    import nala_dit.attention.context_parallel as cp_lib

    torch.set_num_threads(cfg["threads"])
    cuda = cfg.get("device") == "cuda"
    device, rss = _device_and_peak(rank, cuda)
    counted = {"all_reduce": 0, "all_gather": 0, "send": 0}
    if procs > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=procs,
                                **(dict(device_id=device) if cuda else {}))
        _count_exchanges(cp_lib, dist, counted)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def barrier():
        sync()
        if procs > 1:
            dist.barrier()

    model = _built_model(cfg, device, procs, rank, cp_lib)
    built = rss()
    times, counted_one = _timed_calls(model, cfg, device, barrier, counted)
    row = dict(rank=rank, time_s=statistics.median(times[1:]), times_s=times[1:], built_mib=round(built, 1),
               peak_mib=round(rss(), 1), grew_mib=round(rss() - built, 1),
               exchanged=counted_one if procs > 1 else None)
    rows = [None] * procs
    if procs > 1:
        dist.all_gather_object(rows, row)
        dist.destroy_process_group()
    else:
        rows = [row]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(procs: int, cfg: dict, preloaded: bool = False) -> list[dict]:
    """One measurement in fresh processes: ``procs`` = 1 or P (spawned; gloo, or NCCL on CUDA);
    with ``preloaded``, forks of the preloaded server (``benchmarks/processes.py``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        if preloaded:
            _child_main(procs, cfg, str(out), preloaded=True)
        else:
            env = child_env(ROOT, OMP_NUM_THREADS=str(cfg["threads"]))
            subprocess.run([sys.executable, __file__, "--child", str(procs), json.dumps(cfg), str(out)],
                           env=env, check=True, cwd=ROOT)
        return json.loads(out.read_text())


def _child_main(procs: int, cfg: dict, out: str, preloaded: bool = False) -> None:
    if procs == 1 and not preloaded:   # the fresh child measures itself
        _measure(0, 1, 0, cfg, out)
        return
    from benchmarks.processes import start_processes

    start_processes(_measure, (procs, _free_port(), cfg, out), procs, preloaded)


def byte_table(tokens_list=(4096, 16384, 65536)) -> list[dict]:
    """Numbers (and fp32 MB) one rank contributes per layer forward with P = 2, XL/2."""
    from nala_dit.attention.context_parallel import exchanged_numbers
    from nala_dit.cli.options import SIZES

    xl = SIZES["XL"]
    rows = []
    for n in tokens_list:
        nala = exchanged_numbers("nala", n, xl["hidden_size"], xl["num_heads"])
        soft = exchanged_numbers("softmax", n, xl["hidden_size"], xl["num_heads"])
        state = exchanged_numbers("nala", n, xl["hidden_size"], xl["num_heads"], kernel=1)
        rows.append(dict(model="XL/2", tokens=n, nala_numbers=nala, nala_state_numbers=state,
                         nala_halo_numbers=nala - state, softmax_numbers=soft,
                         nala_mb=nala * 4 / 1e6, softmax_mb=soft * 4 / 1e6, softmax_over_nala=soft / nala))
    return rows


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.outputs import new_output  # an existing results file is refused

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096", help="comma-separated token counts (a square grid; 4096 = 1024 px)")
    p.add_argument("--sections", default="forward,train", help=f"comma-separated, of {SECTIONS}")
    p.add_argument("--model", default="NaLaDiT-S/2")
    p.add_argument("--procs", type=int, default=2, help="P, the processes one image is split over")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (the table's numbers: 1)")
    p.add_argument("--preloaded", action="store_true",
                   help="fork the measuring processes from one server that imported torch and the package once "
                        "(benchmarks/processes.py) instead of starting fresh Pythons")
    p.add_argument("--tiny", action="store_true",
                   help="NaLaDiT-T/2 and DiT-T/2 at 256 tokens, one repeat, --preloaded")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo; cuda: NCCL, rank r on cuda:r (P = 1 only where fewer than P GPUs)")
    p.add_argument("--out", type=new_output)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    return p


def _gpus(p, args) -> int:
    """The CUDA devices ``--device cuda`` has (0 on the CPU); says so when fewer than P."""
    if args.device != "cuda":
        return 0
    import torch

    gpus = torch.cuda.device_count()
    if not gpus:
        p.error("--device cuda: no CUDA device found; run without --device for the CPU (gloo) numbers")
    if gpus < args.procs:
        print(f"P={args.procs} needs {args.procs} GPUs (NCCL takes one per rank), found {gpus}: "
              f"measuring one process only", flush=True)
    return gpus


def _split_row(model: str, n: int, section: str, procs: int, one: dict, split: list[dict]) -> dict:
    """One image of ``n`` tokens on one process against P: times, memory, and the numbers
    exchanged, counted and from the formula (per layer: the output's gather taken out)."""
    from nala_dit.attention.context_parallel import exchanged_numbers
    from nala_dit.cli.options import FAMILIES, SIZES, preset

    size, patch = model.split("-")[1].split("/")
    hidden, heads, depth = (SIZES[size][k] for k in ("hidden_size", "num_heads", "depth"))
    side = round(n ** 0.5)
    per_layer = exchanged_numbers("nala" if preset(model)[2] == "nala" else "softmax", n, hidden, heads)
    # the output's gather (once per forward): this rank's tokens (padded to the most
    # rows) × p² × C_out, C_out = 8 for the learned-σ DiT families, 4 for SiT
    c_out = 4 * (2 if FAMILIES[model.split("-")[0]][1] else 1)
    out_gather = -(-side // procs) * side * int(patch) ** 2 * c_out
    got = split[0]["exchanged"]
    row = dict(model=model, tokens=n, section=section, procs=procs,
               one_time_s=one["time_s"], split_time_s=max(r["time_s"] for r in split),
               speedup=one["time_s"] / max(r["time_s"] for r in split),
               one_peak_mib=one["peak_mib"], split_peak_mib=max(r["peak_mib"] for r in split),
               one_grew_mib=one["grew_mib"], split_grew_mib=max(r["grew_mib"] for r in split),
               exchanged_forward=got, exchanged_per_layer_formula=per_layer, one=one, split=split)
    row["memory_ratio"] = row["split_grew_mib"] / max(row["one_grew_mib"], 1e-9)
    if section == "forward":   # the counts of one forward: depth layers and the output gather
        row["exchanged_per_layer_counted"] = (sum(got.values()) - out_gather) / depth
    return row


def _measure_all(p, args, models, tokens, sections, repeats: int, preloaded: bool, gpus: int) -> list[dict]:
    """Every (model, tokens, section) on one process and on P, printed as it goes."""
    results = []
    for model in models:
        patch = int(model.split("/")[1])
        for n in tokens:
            side = round(n ** 0.5)
            if side * side != n:
                p.error(f"--tokens {n} is not a square grid")
            for section in sections:
                cfg = dict(model=model, latent=side * patch, section=section, repeats=repeats,
                           threads=args.threads, device=args.device)
                one = run_child(1, cfg, preloaded)[0]
                if args.device == "cuda" and gpus < args.procs:
                    results.append(dict(model=model, tokens=n, section=section, procs=1, one_time_s=one["time_s"],
                                        one_peak_mib=one["peak_mib"], one_grew_mib=one["grew_mib"], one=one))
                    print(f"{model} {n:,} tokens {section}: 1 process {one['time_s']:.3f} s, "
                          f"peak {one['peak_mib']:.0f} MiB", flush=True)
                    continue
                row = _split_row(model, n, section, args.procs, one, run_child(args.procs, cfg, preloaded))
                results.append(row)
                print(f"{model} {n:,} tokens {section}: 1 process {one['time_s']:.2f} s, P={args.procs} "
                      f"{row['split_time_s']:.2f} s ({row['speedup']:.2f}×); grew {one['grew_mib']:.0f} → "
                      f"{row['split_grew_mib']:.0f} MiB per process ({row['memory_ratio']:.2f}×)", flush=True)
    return results


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.child:
        _child_main(int(args.child[0]), json.loads(args.child[1]), args.child[2])
        return 0
    tokens = [256] if args.tiny else [int(v) for v in args.tokens.split(",")]
    models = ["NaLaDiT-T/2", "DiT-T/2"] if args.tiny else [args.model]
    sections = [s for s in args.sections.split(",") if s]
    if any(s not in SECTIONS for s in sections) or args.procs < 2:
        p.error(f"--sections takes {SECTIONS}; --procs must be >= 2")
    repeats = 1 if args.tiny else args.repeats
    preloaded = args.tiny or args.preloaded
    gpus = _gpus(p, args)
    load = os.getloadavg()
    started = time.perf_counter()
    results = _measure_all(p, args, models, tokens, sections, repeats, preloaded, gpus)
    table = byte_table()
    for r in table:
        print(f"XL/2 {r['tokens']:,} tokens, per layer per rank: NaLa {r['nala_mb']:.2f} MB "
              f"(state {r['nala_state_numbers'] * 4 / 1e6:.2f}), softmax gather {r['softmax_mb']:.1f} MB "
              f"({r['softmax_over_nala']:.0f}×)")
    data = dict(meta=dict(command="python benchmarks/context_parallel.py " + " ".join(argv or sys.argv[1:]),
                          date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), threads=args.threads,
                          cpu_count=os.cpu_count(), load_average_start=list(load), load_average_end=list(os.getloadavg()),
                          wall_s=time.perf_counter() - started, batch=1, dtype="fp32", tiny=args.tiny,
                          device=args.device, gpus=gpus,
                          statistic=f"median of {repeats} after one warm-up",
                          processes="forks of a preloaded server" if preloaded else "fresh Pythons"),
                results=results, bytes_xl2=table)
    if args.out:
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
