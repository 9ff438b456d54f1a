"""FSDP2 against DDP on CPU: what each process holds, what a step exchanges, and its time.

For P = 1, 2, 4 processes (gloo, one thread each), the trainer's code path in fresh processes:
``create_model``, ``Sharding.broadcast`` / ``Sharding.shard`` (one ``fully_shard`` unit per
DiT block, the rest in the root unit) for the model and the fp32 EMA, ``build_optimizer``
(AdamW over ``param_groups``), ``Sharding.clip``; DDP is torch's ``DistributedDataParallel``
(what ``accelerator.prepare`` wraps a model in) with the trainer's CPU gradient hook
(``training/sharding.py``'s ``resumable_gradient_sync``), and no wrapper at P = 1 (as accelerate).
One step = forward of a micro-batch, mean-square loss, backward, clip, AdamW step,
``zero_grad``, ``update_ema``: the training step of ``loop.TrainStep`` without the data.

Measured, not computed:

- bytes held by this process's tensors, by kind, after the first (warm-up) step: parameters
  (FSDP: ``p.to_local()`` of each DTensor), their gradients (taken after clip, before the
  optimizer step frees them), AdamW's state tensors, the EMA's parameters; each as the bytes
  of the distinct storages behind them (FSDP pads a shard to ``ceil(dim0 / P)`` rows: the
  padding is held too) and as the local tensors' own bytes. DDP's reducer also holds a flat
  copy of the gradients in its buckets (``gradient_as_bucket_view=False``, accelerate's
  default): its bucket sizes (``_get_ddp_logging_data``) are reported apart;
- the collectives of a step, counted at the ``torch.distributed`` calls FSDP2 and the DDP hook
  make (``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``): each call's whole
  buffer (the gathered unit, the gradients scattered, the tensor reduced). A process sends
  ``(P − 1) / P`` of an all-gather's or a reduce-scatter's buffer and ``2 (P − 1) / P`` of an
  all-reduce's (ring algorithms, what NCCL and gloo run), which gives the bytes exchanged per
  process. The counts are checked against their closed forms from the parameter shapes
  (``formula``): FSDP all-gathers every unit in forward and again in backward
  (``reshard_after_forward``: ``Sharding.shard`` passes ``True`` to the root unit as well, so
  the root is freed after forward and gathered again too; torch's default, ``None``, would keep
  the root gathered), and reduce-scatters the trainable gradients, each parameter padded to
  ``P · ceil(dim0 / P)`` rows; DDP all-reduces the trainable gradients once;
- the step time: median over ``--steps`` steps after the warm-up, each between two barriers,
  the slowest rank's; reported as FSDP / DDP at each P.

Activations are not counted: FSDP does not shard them (each process keeps its own
micro-batch's, as with DDP; context parallel is what splits one image's); ``rss_mib`` records
each process's peak resident memory (``ru_maxrss``) for what the OS saw.

    python benchmarks/fsdp.py --out benchmarks/results/fsdp_cpu.json                  # NaLaDiT-B/2
    python benchmarks/fsdp.py --model NaLaDiT-S/2 --out benchmarks/results/fsdp_cpu_s2.json
    python benchmarks/fsdp.py --tiny                                           # NaLaDiT-T/2, P = 1, 2 (seconds)

The processes are fresh Pythons (spawned); ``--preloaded`` (``--tiny`` implies it) forks them
from one server that imported torch and the package once (``benchmarks/processes.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)
MODES = ("ddp", "fsdp")
KINDS = ("params", "grads", "adam", "ema")
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce")


def held(tensors) -> dict:
    """Bytes behind ``tensors`` on this process: the distinct storages (padding included)
    and the tensors' own elements. A DTensor counts its local shard."""
    from torch.distributed.tensor import DTensor

    storages, own = {}, 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        own += local.numel() * local.element_size()
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return dict(storage=sum(storages.values()), tensors=own)


def shapes_of(model) -> list[dict]:
    """Every parameter's global shape (a DTensor's is the full one), trainable or not, and
    whether it lives in a block (its own FSDP unit) or in the root unit."""
    return [dict(name=n, shape=list(p.shape), trainable=p.requires_grad, block=n.startswith("blocks."))
            for n, p in model.named_parameters()]


def _rows(shape) -> tuple[int, int]:
    return (shape[0], 1) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))


def formulas(shapes: list[dict], procs: int, reshard: bool = True) -> dict:
    """The same quantities from the parameter shapes alone (fp32, 4 bytes a number)."""
    full = padded = shard_trainable = 0
    gather_fwd = gather_bwd = scatter = reduce = 0
    for s in shapes:
        d0, rest = _rows(s["shape"])
        n, shard = d0 * rest, -(-d0 // procs) * rest      # a process's shard: ceil(d0 / P) rows
        full += 4 * n
        padded += 4 * shard
        gather_fwd += 4 * procs * shard
        gather_bwd += 4 * procs * shard if reshard else 0   # every unit, the root too (below)
        if s["trainable"]:
            shard_trainable += 4 * shard
            scatter += 4 * procs * shard
            reduce += 4 * n
    ring = (procs - 1) / procs
    return dict(
        ddp=dict(params=full, grads=reduce, adam=2 * reduce, ema=full,
                 all_reduce=reduce, exchanged_per_process=2 * ring * reduce),
        fsdp=dict(params=padded, grads=shard_trainable, adam=2 * shard_trainable, ema=padded,
                  all_gather_forward=gather_fwd, all_gather_backward=gather_bwd, reduce_scatter=scatter,
                  exchanged_per_process=ring * (gather_fwd + gather_bwd + scatter)))


def on_paper(model: str = "NaLaDiT-H/2", latent: int = 128, procs: int = 8) -> dict:
    """``formulas`` for a model too big for this machine, built on the meta device (shapes
    only): what a process of ``procs`` holds and exchanges per step at ``latent`` (128 = 1024 px),
    under ``--mixed-precision bf16``: the sharded weights, gradients, AdamW and EMA stay fp32,
    the all-gathers carry bf16 (half the fp32 bytes), the reduce-scatters fp32. Activations apart."""
    import torch

    from nala_dit.models.dit import create_model

    with torch.device("meta"):
        net = create_model(model, input_size=latent)
    f = formulas(shapes_of(net), procs)
    ddp, fsdp = f["ddp"], f["fsdp"]
    ring = (procs - 1) / procs
    gathers = (fsdp["all_gather_forward"] + fsdp["all_gather_backward"]) / 2   # bf16
    largest_block = max(sum(4 * math.prod(p.shape) for p in b.parameters()) for b in net.blocks)
    return dict(model=model, latent=latent, procs=procs, params=sum(p.numel() for p in net.parameters()),
                ddp_held=sum(ddp[k] for k in KINDS), fsdp_held=sum(fsdp[k] for k in KINDS),
                ddp_exchanged_per_process=ddp["exchanged_per_process"],
                fsdp_exchanged_per_process=ring * (gathers + fsdp["reduce_scatter"]),
                gathered_block_bf16=largest_block // 2)


def _count_collectives(dist) -> tuple[dict, list]:
    """Wrap the collectives FSDP2 and the DDP hook call (``all_gather_single``,
    ``reduce_scatter_single``, ``all_reduce``) so that, while ``counting[0]`` is set, each call
    adds its whole buffer's bytes and one call to ``counted``; returns (counted, counting)."""
    counted, counting = {}, [False]

    def counter(name, buffer_of):
        real = getattr(dist, name)

        def call(*args, **kwargs):
            if counting[0]:
                t = buffer_of(*args, **kwargs)
                counted[name] = counted.get(name, 0) + t.numel() * t.element_size()
                counted[f"{name}_calls"] = counted.get(f"{name}_calls", 0) + 1
            return real(*args, **kwargs)
        setattr(dist, name, call)

    # the whole buffer of each call: the gathered output, the input scattered, the tensor reduced
    counter("all_gather_single", lambda output_tensor, *a, **k: output_tensor)
    counter("reduce_scatter_single", lambda *a, **k: k["input"] if "input" in k else a[1])
    counter("all_reduce", lambda tensor, *a, **k: tensor)
    return counted, counting


def _build(mode: str, procs: int, cfg: dict):
    """A fresh model, its EMA, optimizer and the module a step calls, as the trainer builds them
    for ``mode``: (model, ema, optimizer, train_model, sharding or None, the parameters' shapes
    before sharding)."""
    import copy
    from types import SimpleNamespace

    import torch

    import nala_dit.training.sharding as sharding_lib
    from nala_dit.training.sharding import resumable_gradient_sync
    from nala_dit.models.dit import create_model
    from nala_dit.training.build import build_optimizer

    fsdp = mode == "fsdp"
    torch.manual_seed(0)
    model = create_model(cfg["model"], input_size=cfg["latent"])
    shapes = shapes_of(model)
    sharding = None
    if fsdp:
        if procs == 1:   # train.py refuses --fsdp on one process; measured here as the baseline
            sharding_lib.check_fsdp = lambda *args: None
        sharding = sharding_lib.Sharding(torch.device("cpu"), 1, "no", reshard=cfg["reshard"])
        sharding.broadcast(model)
    ema = copy.deepcopy(model).float().requires_grad_(False)
    if fsdp:   # as loop.build_run: before the optimizer, which holds the sharded parameters
        for module, train in ((model, True), (ema, False)):
            sharding.broadcast(module)
            sharding.shard(module, train)
    optimizer = build_optimizer(SimpleNamespace(weight_decay=0.0, lr=1e-4, adam_beta2=0.999), model)
    train_model = model
    if mode == "ddp" and procs > 1:   # accelerator.prepare's wrapper, and the trainer's gloo hook
        train_model = torch.nn.parallel.DistributedDataParallel(model)
        resumable_gradient_sync(train_model)
    return model, ema, optimizer, train_model, sharding, shapes


def _step_memory(memory: dict, model, ema, optimizer, train_model, when: str) -> None:
    """The first step's bytes held, by kind, into ``memory``: the gradients at their peak
    (``when="grads"``: after clip, before the step frees them), AdamW's state after the step
    (``"adam"``), the parameters, EMA, buffers and DDP's buckets after the EMA update (``"end"``)."""
    import torch

    if when == "grads":
        memory["grads"] = held(p.grad for p in model.parameters())
    elif when == "adam":
        memory["adam"] = held(v for state in optimizer.state.values() for v in state.values()
                              if isinstance(v, torch.Tensor))
        memory["adam_moments"] = held(state[k] for state in optimizer.state.values()
                                      for k in ("exp_avg", "exp_avg_sq"))
    else:
        memory["params"] = held(model.parameters())
        memory["ema"] = held(ema.parameters())
        memory["buffers"] = held([*model.buffers(), *ema.buffers()])
        if train_model is not model:
            sizes = train_model._get_ddp_logging_data().get("bucket_sizes", "")
            memory["ddp_buckets"] = dict(storage=sum(int(v) for v in str(sizes).split(", ") if v), tensors=None)


def _train_steps(rank: int, cfg: dict, built, sharding, counted: dict, counting: list):
    """``cfg["steps"]`` + 1 training steps (the first a warm-up) on this rank's own micro-batch,
    each between two barriers: (memory by kind after the first, times, collectives of each)."""
    import torch
    import torch.distributed as dist

    from nala_dit.training.step import update_ema

    model, ema, optimizer, train_model = built
    gen = torch.Generator().manual_seed(1 + rank)   # each process its own micro-batch
    b, c, side = cfg["batch"], model.in_channels, cfg["latent"]
    x = torch.randn(b, c, side, side, generator=gen)
    t = torch.randint(0, 1000, (b,), generator=gen).float()
    y = torch.randint(0, model.config.num_classes, (b,), generator=gen)
    target = None
    memory, times, exchanged = {}, [], []
    for step in range(cfg["steps"] + 1):
        counted.clear()
        dist.barrier()
        start = time.perf_counter()
        counting[0] = True
        pred = train_model(x, t, y)
        if target is None:
            target = torch.randn(pred.shape, generator=gen)
        (pred - target).pow(2).mean().backward()
        del pred
        if sharding is not None:
            sharding.clip(model.parameters(), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        counting[0] = False
        if step == 0:
            _step_memory(memory, *built, "grads")
        optimizer.step()
        if step == 0:
            _step_memory(memory, *built, "adam")
        optimizer.zero_grad(set_to_none=True)
        update_ema(ema, model, 0.9999)
        dist.barrier()
        times.append(time.perf_counter() - start)
        exchanged.append(dict(counted))
        if step == 0:
            _step_memory(memory, *built, "end")
    return memory, times, exchanged


def _measure(rank: int, procs: int, port: int, cfg: dict, out: str) -> None:
    """One process of the measurements at one P, one per mode of ``cfg["modes"]`` (each from
    a fresh model); rank 0 writes every rank's rows."""
    import gc
    import resource

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(cfg["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=procs)
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731  (MiB)
    counted, counting = _count_collectives(dist)
    try:
        results = {}
        for mode in cfg["modes"]:   # each from a fresh model, optimizer and EMA
            model, ema, optimizer, train_model, sharding, shapes = _build(mode, procs, cfg)
            built = rss()
            memory, times, exchanged = _train_steps(rank, cfg, (model, ema, optimizer, train_model), sharding,
                                                    counted, counting)
            row = dict(rank=rank, memory=memory, times_s=times[1:], built_mib=round(built, 1), rss_mib=round(rss(), 1),
                       exchanged=exchanged[-1], exchanged_steady=all(e == exchanged[-1] for e in exchanged[1:]),
                       trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                       params_total=sum(math.prod(s["shape"]) for s in shapes))
            rows = [None] * procs
            dist.all_gather_object(rows, row)
            results[mode] = dict(rows=rows, shapes=shapes)
            del train_model, model, ema, optimizer, sharding   # before the next mode's
            gc.collect()
            dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(procs: int, cfg: dict, preloaded: bool = False) -> dict:
    """``cfg["modes"]`` at one P in ``procs`` fresh spawned processes (gloo, also at P = 1), or
    with ``preloaded`` forks of the preloaded server (``benchmarks/processes.py``):
    {mode: {rows, shapes}}."""
    import tempfile

    from benchmarks.processes import start_processes

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        start_processes(_measure, (procs, _free_port(), cfg, str(out)), procs, preloaded)
        return json.loads(out.read_text())


def summarise(mode: str, procs: int, got: dict, reshard: bool) -> dict:
    """One table row: the largest rank's bytes of each kind, the collectives of a step and
    the bytes a process sends, against ``formulas``."""
    rows, expect = got["rows"], formulas(got["shapes"], procs, reshard)[mode]
    held_by = {k: max(r["memory"][k]["storage"] for r in rows) for k in KINDS}
    ex = rows[0]["exchanged"]
    ring = (procs - 1) / procs
    row = dict(mode=mode, procs=procs, held=held_by, held_total=sum(held_by.values()),
               held_tensors={k: [r["memory"][k]["tensors"] for r in rows] for k in KINDS},
               adam_moments=max(r["memory"]["adam_moments"]["storage"] for r in rows),
               buffers=max(r["memory"]["buffers"]["storage"] for r in rows),
               ddp_buckets=max((r["memory"].get("ddp_buckets") or {}).get("storage", 0) for r in rows),
               collectives=ex, exchanged_steady=all(r["exchanged_steady"] for r in rows),
               step_s=statistics.median(max(ts) for ts in zip(*(r["times_s"] for r in rows))),
               times_s=[r["times_s"] for r in rows], rss_mib=[r["rss_mib"] for r in rows],
               built_mib=[r["built_mib"] for r in rows], trainable=rows[0]["trainable"],
               params_total=rows[0]["params_total"], formula=expect)
    if mode == "ddp":
        counted_ex = 2 * ring * ex.get("all_reduce", 0) if procs > 1 else 0.0
        row["collectives_match_formula"] = procs == 1 or ex.get("all_reduce", 0) == expect["all_reduce"]
    else:   # the norm's all-reduce (one number) rides along: left out of the traffic
        gathers, scatters = ex.get("all_gather_single", 0), ex.get("reduce_scatter_single", 0)
        counted_ex = ring * (gathers + scatters)
        row["collectives_match_formula"] = procs == 1 or (
            gathers == expect["all_gather_forward"] + expect["all_gather_backward"]
            and scatters == expect["reduce_scatter"])
    row["exchanged_per_process"] = counted_ex
    row["held_match_formula"] = all(held_by[k] == expect[k] for k in ("params", "grads", "ema")) and \
        row["adam_moments"] == expect["adam"]
    return row


def mb(n) -> str:
    return f"{n / 2**20:,.1f}"


def table(rows: list[dict]) -> str:
    lines = ["| P | mode | params MiB | grads MiB | AdamW MiB | EMA MiB | total MiB | bytes/param | "
             "DDP buckets MiB | exchanged/step/process MiB | step s | FSDP/DDP time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["mode"], r["procs"]): r for r in rows}
    for r in rows:
        ddp = by.get(("ddp", r["procs"]))
        ratio = f"{r['step_s'] / ddp['step_s']:.2f}" if r["mode"] == "fsdp" and ddp else ""
        h = r["held"]
        lines.append(f"| {r['procs']} | {r['mode'].upper()} | {mb(h['params'])} | {mb(h['grads'])} | {mb(h['adam'])} | "
                     f"{mb(h['ema'])} | {mb(r['held_total'])} | {r['held_total'] / r['params_total']:.2f} | "
                     f"{mb(r['ddp_buckets']) if r['ddp_buckets'] else '-'} | {mb(r['exchanged_per_process'])} | "
                     f"{r['step_s']:.3f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from benchmarks.outputs import new_output  # an existing results file is refused

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="NaLaDiT-B/2", help="a preset of nala_dit.models.dit.MODELS")
    p.add_argument("--procs", default="1,2,4", help="comma-separated process counts P")
    p.add_argument("--latent", type=int, default=16, help="latent side (16 = 128 px, 64 tokens at patch 2)")
    p.add_argument("--batch", type=int, default=2, help="images per process per step")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up one")
    p.add_argument("--no-reshard", action="store_true",
                   help="FSDP keeps each block's gathered weights from forward to backward "
                        "(fsdp_reshard_after_forward: false): no all-gather in backward")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--shared-processes", action="store_true",
                   help="DDP then FSDP in the same processes at each P (half the start-ups; rss_mib is then "
                        "the pair's)")
    p.add_argument("--preloaded", action="store_true",
                   help="fork the measuring processes from one server that imported torch and the package once "
                        "(benchmarks/processes.py) instead of starting fresh Pythons")
    p.add_argument("--tiny", action="store_true",
                   help="NaLaDiT-T/2, latent 8, P = 1, 2, one timed step, --shared-processes, --preloaded")
    p.add_argument("--out", type=new_output)
    args = p.parse_args(argv)
    model = "NaLaDiT-T/2" if args.tiny else args.model
    procs = [1, 2] if args.tiny else [int(v) for v in args.procs.split(",")]
    latent, steps = (8, 1) if args.tiny else (args.latent, args.steps)
    if min(procs) < 1 or steps < 1:
        p.error("--procs takes counts >= 1 and --steps >= 1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)   # the spawned processes read it when torch loads
    load, started = os.getloadavg(), time.perf_counter()
    shared = args.tiny or args.shared_processes
    preloaded = args.tiny or args.preloaded
    rows = []
    for n in procs:
        got = {}
        for modes in [MODES] if shared else [(m,) for m in MODES]:
            cfg = dict(model=model, latent=latent, batch=args.batch, steps=steps, threads=args.threads,
                       modes=list(modes), reshard=not args.no_reshard)
            got.update(measure(n, cfg, preloaded))
        for mode in MODES:
            rows.append(summarise(mode, n, got[mode], not args.no_reshard))
            r = rows[-1]
            print(f"P={n} {mode.upper()}: holds {mb(r['held_total'])} MiB per process, exchanges "
                  f"{mb(r['exchanged_per_process'])} MiB per step, step {r['step_s']:.3f} s", flush=True)
    text = table(rows)
    params = rows[0]["params_total"]
    print(f"\n{model}, {params:,} parameters ({rows[0]['trainable']:,} trainable), fp32, latent {latent} "
          f"(batch {args.batch} per process), gloo, {args.threads} thread(s) per process, {os.cpu_count()} CPUs\n")
    print(text)
    paper = on_paper()
    print(f"\non paper, {paper['model']} at latent {paper['latent']} (1024 px) on {paper['procs']} processes, bf16 "
          f"gathers: {paper['fsdp_held'] / 2**30:.1f} GiB held per process (DDP {paper['ddp_held'] / 2**30:.1f} GiB), "
          f"{paper['fsdp_exchanged_per_process'] / 2**30:.1f} GiB sent per process per step (DDP "
          f"{paper['ddp_exchanged_per_process'] / 2**30:.1f} GiB), one gathered block {mb(paper['gathered_block_bf16'])} MiB")
    data = dict(meta=dict(command="python benchmarks/fsdp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                          date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), model=model, latent=latent,
                          batch=args.batch, steps=steps, threads=args.threads, cpu_count=os.cpu_count(),
                          reshard_after_forward=not args.no_reshard, dtype="fp32", backend="gloo", tiny=args.tiny,
                          processes=("both modes in the same processes at each P" if shared else
                                     "fresh processes for each mode and P")
                                    + (", forks of a preloaded server" if preloaded else ""),
                          load_average_start=list(load), load_average_end=list(os.getloadavg()),
                          wall_s=round(time.perf_counter() - started, 1),
                          statistic=f"step time: median of {steps} after one warm-up, the slowest rank",
                          exchanged="per process per step: (P-1)/P x (all-gather + reduce-scatter buffers) "
                                    "for FSDP, 2 (P-1)/P x all-reduce buffers for DDP (ring)"),
                results=rows, table=text, on_paper=paper)
    if args.out:
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
