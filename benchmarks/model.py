"""Throughput and peak memory of whole models: DiT against NaLaDiT.

For each size (``--sizes S/2,B/2``) and image resolution (256, 512, 1024 px → latent
32, 64, 128 with the SD VAE's 8× downsampling), this measures

* a training step (forward, MSE loss against a random target, backward, AdamW step),
* sampling: one forward pass without gradients (a sampler calls it once per step),

as images per second from the wall time (median over ``--repeats``, both models back to
back at each point so machine noise hits both alike; on CUDA the GPU time between CUDA
events around the same call is ``gpu_ms`` beside it, ``benchmarks/timing.py``), peak memory of one call (see
``benchmarks/attention.py`` for the CPU method), parameters and forward FLOPs
(``count_flops``: torch's counter, 2 per multiply-accumulate; SDPA counted as the
math path). A configuration whose call took longer than ``--time-cap`` seconds is
skipped at larger resolutions; one that raises (out of memory) is recorded as skipped
with the error; ``--budget-s`` starts no new size/resolution after that many seconds.
On CUDA, NaLaDiT's attention runs the Triton kernels (``impl="auto"``).

    python benchmarks/model.py --out benchmarks/results/model_cpu.json
    python benchmarks/model.py --sizes S/2,XL/2 --resolutions 256,512,1024 --device cuda \\
        --dtype bf16 --batch 8 --out benchmarks/results/model_cuda.json
    python benchmarks/model.py --tiny --out runs/model.json     # smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402

from benchmarks.attention import DTYPES, PeakMemory  # noqa: E402
from benchmarks.timing import median_or_none, sync, timed_call  # noqa: E402
from nala_dit.models.dit import count_flops, count_params, create_model  # noqa: E402

FAMILIES = ("DiT", "NaLaDiT")


def make_batch(model, batch, latent, device, dtype):
    g = torch.Generator().manual_seed(0)
    c = model.in_channels
    x = torch.randn(batch, c, latent, latent, generator=g).to(device, dtype)
    t = torch.randint(0, 1000, (batch,), generator=g).float().to(device)
    y = torch.randint(0, model.config.num_classes, (batch,), generator=g).to(device)
    target = torch.randn(batch, model.out_channels, latent, latent, generator=g).to(device, dtype)
    return x, t, y, target


def train_step(model, opt, batch):
    x, t, y, target = batch
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x, t, y).float(), target.float())
    loss.backward()
    opt.step()


def sample_step(model, batch):
    x, t, y, _ = batch
    with torch.no_grad():
        model(x, t, y)




def peak(fn, device):
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    with PeakMemory() as tracker:
        fn()
    return tracker.peak


def benchmark(args):
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    rows, too_slow = [], set()
    start = time.perf_counter()
    overrides = {}
    if args.tiny:
        # The shared tiny test config's width, so the smoke test runs in seconds.
        overrides = dict(depth=2, hidden_size=64, num_heads=2)
    try:
        for size in args.sizes.split(","):
            for res in args.resolutions:
                latent = res // 8
                if args.budget_s and time.perf_counter() - start > args.budget_s:
                    for family in FAMILIES:
                        for task in ("train", "sample"):
                            rows.append(dict(model=f"{family}-{size}", size=size, resolution=res, latent=latent,
                                             task=task, skipped=f"--budget-s {args.budget_s} s spent"))
                    continue
                models = {}
                for family in FAMILIES:
                    name = f"{family}-{size}"
                    torch.manual_seed(0)
                    with device:  # initialise on the device: an XL/2 init on the host takes many seconds
                        model = create_model(name, input_size=latent, **overrides).to(device)
                    if dtype != torch.float32:
                        model.to(dtype)
                    models[family] = dict(name=name, model=model,
                                          opt=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                          batch=make_batch(model, args.batch, latent, device, dtype))
                for task in ("train", "sample"):
                    calls = {}
                    for family, m in models.items():
                        if (family, size, task) in too_slow:
                            rows.append(dict(model=m["name"], size=size, resolution=res, latent=latent,
                                             task=task, skipped=f"a call took > --time-cap {args.time_cap} s"))
                            continue
                        calls[family] = ((lambda m=m: train_step(m["model"], m["opt"], m["batch"]))
                                         if task == "train" else (lambda m=m: sample_step(m["model"], m["batch"])))
                    for family, fn in list(calls.items()):  # warm-up (allocator, AdamW state, thread pool)
                        try:
                            fn()
                        except torch.cuda.OutOfMemoryError as err:
                            rows.append(dict(model=models[family]["name"], size=size, resolution=res, latent=latent,
                                             task=task, skipped=f"OutOfMemoryError: {str(err).splitlines()[0][:200]}"))
                            del calls[family]
                            torch.cuda.empty_cache()
                    times = {f: [] for f in calls}
                    gpu_times = {f: [] for f in calls}
                    for _ in range(args.repeats):   # back to back, repeat after repeat
                        for family, fn in calls.items():
                            wall, gpu = timed_call(fn, device)
                            times[family].append(wall)
                            gpu_times[family].append(gpu)
                    for family, fn in calls.items():
                        m = models[family]
                        med = statistics.median(times[family])
                        if med > args.time_cap:
                            too_slow.add((family, size, task))
                        rows.append(dict(
                            model=m["name"], size=size, resolution=res, latent=latent, task=task,
                            batch=args.batch, time_ms=1e3 * med, images_per_s=args.batch / med,
                            gpu_ms=median_or_none(gpu_times[family]),
                            peak_mib=peak(fn, device) / 2**20, params=count_params(m["model"]),
                            gflops_fwd_per_image=count_flops(m["model"], latent) / 1e9, skipped=None))
                        print(f"{m['name']:14s} {res:5d}px {task:6s} {rows[-1]['images_per_s']:8.2f} img/s "
                              f"{rows[-1]['peak_mib']:9.1f} MiB", flush=True)
    except KeyboardInterrupt:  # a time limit (timeout --signal=INT): keep what was measured
        print("interrupted: reporting the results so far", flush=True)
    return rows


def print_table(rows):
    print(f"\n{'model':14s} {'px':>5s} {'task':6s} {'img/s':>9s} {'peak MiB':>10s} {'params M':>9s} {'GFLOPs':>8s} {'speedup':>8s}")
    for r in rows:
        if r["skipped"]:
            print(f"{r['model']:14s} {r['resolution']:5d} {r['task']:6s}  skipped: {r['skipped']}")
            continue
        base = next((b for b in rows if b["model"] == f"DiT-{r['size']}" and not b["skipped"]
                     and (b["resolution"], b["task"]) == (r["resolution"], r["task"])), None)
        speed = f"{r['images_per_s'] / base['images_per_s']:.2f}x" if base else "-"
        print(f"{r['model']:14s} {r['resolution']:5d} {r['task']:6s} {r['images_per_s']:9.2f} "
              f"{r['peak_mib']:10.1f} {r['params'] / 1e6:9.2f} {r['gflops_fwd_per_image']:8.2f} {speed:>8s}")


def plot(rows, path, meta):
    """Images/s against resolution, one panel per task, a line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, task in zip(axes, ("train", "sample")):
        for model in sorted({r["model"] for r in rows}):
            pts = sorted((r["resolution"], r["images_per_s"]) for r in rows
                         if r["model"] == model and r["task"] == task and not r["skipped"])
            if pts:
                ax.loglog(*zip(*pts), marker="o", label=model, linestyle="--" if model.startswith("DiT") else "-")
        ax.set_title(f"{task}, {meta['dtype']}, batch {meta['batch']}, {meta['device_name']}", fontsize=9)
        ax.set_xlabel("image size (px)")
        ax.set_ylabel("images / s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def main(argv=None):
    from benchmarks.outputs import new_output  # an existing results file is refused

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--sizes", default="S/2", help="comma-separated, e.g. S/2,B/2")
    parser.add_argument("--resolutions", default="256,512,1024",
                        type=lambda s: [int(v) for v in s.split(",")], help="image sizes in px")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--time-cap", type=float, default=20.0, help="seconds per call before skipping larger sizes")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="start no new size/resolution after this many seconds (0: no limit)")
    parser.add_argument("--tiny", action="store_true", help="narrow 2-block models at 64 px, one repeat (tests)")
    parser.add_argument("--out", default="", type=new_output, help="JSON path")
    args = parser.parse_args(argv)
    if args.tiny:
        args.resolutions, args.repeats = [64], 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = benchmark(args)
    print_table(rows)
    meta = dict(
        command="python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        device=str(device), dtype=args.dtype, threads=torch.get_num_threads(), torch=torch.__version__,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine()),
        batch=args.batch, repeats=args.repeats, statistic="median", tiny=args.tiny,
        memory_method="torch.cuda.max_memory_allocated" if device.type == "cuda"
        else "TorchDispatchMode storage tracking (tensors created during the call)",
    )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
        plot(rows, out.with_suffix(".png"), meta)
        print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
