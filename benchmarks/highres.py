"""Cost of one high-resolution image: the transformer (NaLaDiT vs DiT) and the VAE decode.

One image, batch 1, random weights (cost does not depend on them), 256 → 4096 px
(latent 32 → 512 with the f8 SD VAE, patch 2: 256 → 65,536 tokens):

* ``sample``: one transformer forward without gradients, i.e. one sampling step
  (classifier-free guidance runs two, as a batch of 2): seconds and peak memory, for
  NaLaDiT (its NaLa path: fused on CPU, Triton on CUDA), DiT with softmax through SDPA
  (fused, O(N) memory) and DiT with SDPA forced onto its math backend
  (``sdpa_kernel(SDPBackend.MATH)``: the explicit N×N scores, what "softmax" costs
  without a fused kernel). The NaLaFormer paper's claim (70K tokens: peak memory −92.3 %
  against softmax) is checked as the ratio NaLaDiT / DiT both ways.
* ``train``: forward + MSE loss + backward (no optimizer step) at 1K/4K/16K tokens,
  with and without gradient checkpointing (``model.gradient_checkpointing = True``):
  the peak memory per image includes the parameter gradients.
* ``vae``: ``nala_dit.diffusion.generate.decode`` with the SD-VAE architecture (kl-f8: 128/256/
  512/512 channels), untiled and tiled (``--vae-tile`` px tiles), reported apart from
  the transformer.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` above what existed before the
call; on CPU the storage tracker of ``benchmarks/attention.py`` (tensors created during
the call: activations, outputs, gradients). On CPU every cell is also *counted*: the same
call run under ``FakeTensorMode`` (every operator runs on shapes only, so no arithmetic
and no memory), tracked the same way. It gives the peak of cells far too slow or too big
to run here (DiT at 65K tokens, the math backend's 100 GiB of scores, XL/2); where both
exist the JSON has both and the printed table shows whether they agree.

Time: every method at one size runs back to back, repeat after repeat (round robin), so
machine noise hits them alike and the ratios survive it. A cell is not run when the
previous sizes predict (by the fitted growth) a call longer than ``--time-cap``; the
math backend is not run when its N×N scores would exceed ``--math-cap-gib``; a call
predicted above ``--single-call-s`` is timed once, under the tracker, without a
warm-up. Skips are recorded with their reason. ``--budget-s`` stops starting new real
cells after that many seconds (counted cells still run: they take seconds).

    python benchmarks/highres.py --threads 1 --out benchmarks/results/highres_cpu.json
    python benchmarks/highres.py --device cuda --dtype bf16 --sizes S/2,XL/2 --math-cap-gib 60 \\
        --vae-real-max-px 4096 --out benchmarks/results/highres_cuda.json
    python benchmarks/highres.py --tiny --out runs/highres.json     # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benchmarks.attention import DTYPES, PeakMemory, sdpa_backend, sync  # noqa: E402
from nala_dit.diffusion.generate import decode  # noqa: E402
from nala_dit.models.dit import count_params, create_model  # noqa: E402
from nala_dit.cli.options import SIZES  # noqa: E402

# (row name, model family, SDPA backend forced for DiT's softmax; None = SDPA's choice)
METHODS = (("nala", "NaLaDiT", None), ("sdpa", "DiT", None), ("math", "DiT", SDPBackend.MATH))
TINY_MODEL = dict(depth=2, hidden_size=64, num_heads=2)
SD_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32)
TINY_VAE = dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=8)


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def backend_context(backend, counted):
    """The SDPA backend for a DiT cell. Counted CPU cells name the fused kernel that real
    CPU runs pick (flash), since shape-only tensors can make SDPA fall back to math."""
    if backend is not None:
        return sdpa_kernel(backend)
    if counted:
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    return contextlib.nullcontext()


def model_inputs(model, latent, device, dtype, counted):
    shape = (1, model.in_channels, latent, latent)
    out_shape = (1, model.out_channels, latent, latent)
    if counted:
        return (torch.empty(shape, dtype=dtype), torch.empty(1), torch.zeros(1, dtype=torch.long),
                torch.empty(out_shape, dtype=dtype))
    g = torch.Generator().manual_seed(latent)
    return (torch.randn(shape, generator=g).to(device, dtype), torch.full((1,), 500.0, device=device),
            torch.ones(1, dtype=torch.long, device=device), torch.randn(out_shape, generator=g).to(device, dtype))


def transformer_call(model, inputs, task, backend, counted, grad_checkpointing=False):
    """One sampling forward or one training forward+backward, as a closure. The model's
    mode is set at each call: cells of one size share a model."""
    x, t, y, target = inputs

    def sample():
        model.eval()
        with torch.no_grad(), backend_context(backend, counted):
            model(x, t, y)

    def train():
        model.train()
        model.gradient_checkpointing = grad_checkpointing
        for p in model.parameters():
            p.grad = None
        with backend_context(backend, counted):
            F.mse_loss(model(x, t, y).float(), target.float()).backward()

    return sample if task == "sample" else train


def build_model(name, latent, device, dtype, tiny, counted):
    """``counted``: a shape-only model, to be built inside the ``fake_mode()`` it runs in
    (a second mode would re-wrap every parameter at every use)."""
    # Parameters are made in ``dtype`` (torch's default dtype for the build), not cast after:
    # ``model.to(dtype)`` must swap fake parameters, which a fake mode's weakrefs forbid.
    default = torch.get_default_dtype()
    with contextlib.nullcontext() if counted else torch.device(device):   # an XL/2 host init takes long
        torch.manual_seed(0)
        torch.set_default_dtype(dtype)
        try:
            model = create_model(name, input_size=latent, **(TINY_MODEL if tiny else {}))
        finally:
            torch.set_default_dtype(default)
    return model


def build_vae(tiny, device, dtype):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        latent_channels=4, sample_size=256, **(TINY_VAE if tiny else SD_VAE))
    if device.type != "cpu" or dtype != torch.float32:
        vae.to(device, dtype)
    return vae.eval().requires_grad_(False)


def counted_peak(make_call):
    """Peak bytes of ``make_call()()`` run on shapes only (CPU counting, see above)."""
    with fake_mode():
        fn = make_call()
        with PeakMemory() as tracker:
            fn()
    return tracker.peak


def real_peak_and_time(fn, device, tracked):
    """(seconds, peak bytes or None) of one call; the peak only when ``tracked``."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - start, (torch.cuda.max_memory_allocated(device) - base) if tracked else None
    if not tracked:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start, None
    with PeakMemory() as tracker:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
    return took, tracker.peak


class Predictor:
    """Predicts a cell's call time from the same method's smaller sizes (fitted exponent
    of time against size, clipped to [1, 2]; 1 from a single point)."""

    def __init__(self):
        self.points: dict[tuple, list[tuple[float, float]]] = {}

    def add(self, key, size, seconds):
        self.points.setdefault(key, []).append((size, seconds))

    def predict(self, key, size):
        pts = self.points.get(key, [])
        if not pts:
            return 0.0
        (n1, t1), (n2, t2) = (pts[-2] if len(pts) > 1 else pts[-1]), pts[-1]
        slope = 1.0 if n1 == n2 else min(max(math.log(t2 / t1) / math.log(n2 / n1), 1.0), 2.0)
        return t2 * (size / n2) ** slope


def run_real(cells, device, args, predictor, start):
    """Time and track the real cells of one size, round robin. ``cells``: dicts with key,
    make (builds the call), size and the row to fill."""
    active = []
    for cell in cells:
        row = cell["row"]
        predicted = predictor.predict(cell["key"], cell["size"])
        if row.get("skipped"):
            continue
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            row["skipped"] = f"--budget-s {args.budget_s:g} s spent before this cell"
        elif predicted > args.time_cap:
            row["skipped"] = f"predicted {predicted:.0f} s per call from smaller sizes > --time-cap {args.time_cap:g} s"
        else:
            try:
                cell["fn"] = cell["make"]()
            except torch.cuda.OutOfMemoryError as err:
                row["skipped"] = f"OutOfMemoryError: {str(err).splitlines()[0][:160]}"
                continue
            cell["single"] = predicted > args.single_call_s
            active.append(cell)
    times = {id(c): [] for c in active}
    for cell in list(active):     # warm-up, which on CPU also tracks the peak (a slow cell: its only call)
        try:
            took, peak = real_peak_and_time(cell["fn"], device, tracked=device.type == "cpu" or cell["single"])
        except Exception as err:  # noqa: BLE001  (out of memory, a backend refusing the dtype)
            cell["row"]["skipped"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
            active.remove(cell)
            cell.pop("fn")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        cell["row"]["peak_mib"] = None if peak is None else peak / 2**20
        if cell["single"]:
            times[id(cell)].append(took)
    repeats = [c for c in active if not c["single"]]
    for _ in range(args.repeats):
        for cell in repeats:
            took, peak = real_peak_and_time(cell["fn"], device, tracked=device.type == "cuda")
            times[id(cell)].append(took)
            if peak is not None:
                cell["row"]["peak_mib"] = max(cell["row"].get("peak_mib") or 0, peak / 2**20)
    for cell in active:
        median = statistics.median(times[id(cell)])
        cell["row"].update(time_s=median, calls=len(times[id(cell)]), timed_with_tracker=cell["single"]
                           and device.type == "cpu")
        predictor.add(cell["key"], cell["size"], median)
        cell.pop("fn")
    if device.type == "cuda":
        torch.cuda.empty_cache()


def transformer_rows(args, device, dtype, predictor, start, task):
    rows = []
    ladder = args.resolutions if task == "sample" else [int(math.isqrt(n)) * 16 for n in args.train_tokens]
    grad_ckpt = (False,) if task == "sample" else (False, True)
    params = {}
    for size in args.sizes:
        for px in ladder:
            latent = px // 8
            tokens = (latent // 2) ** 2
            cells, counted_cells = [], []
            models = {}
            for method, family, backend in METHODS:
                if task == "train" and method == "math":
                    continue
                name = f"{family}-{size}"
                for ckpt in grad_ckpt:
                    row = dict(section=task, model=name, size=size, attention=method, px=px, latent=latent,
                               tokens=tokens, grad_checkpointing=ckpt, dtype=args.dtype, skipped=None)
                    if name not in params:   # counted on a shape-only build: no memory, no init time
                        with fake_mode():
                            params[name] = count_params(build_model(name, 32, device, dtype, args.tiny, True))
                    row["params"] = params[name]
                    rows.append(row)
                    heads = TINY_MODEL["num_heads"] if args.tiny else SIZES[size.split("/")[0]]["num_heads"]
                    nn_bytes = heads * tokens * tokens * DTYPES[args.dtype].itemsize
                    if method == "math" and nn_bytes > args.math_cap_gib * 2**30:
                        row["skipped"] = f"N×N scores {nn_bytes / 2**30:.1f} GiB > --math-cap-gib {args.math_cap_gib:g}"
                    if size not in args.real_sizes and not row["skipped"]:
                        row["skipped"] = f"{size} runs counted only here (--real-sizes {','.join(args.real_sizes)})"

                    def make(name=name, backend=backend, ckpt=ckpt):
                        if name not in models:
                            models[name] = build_model(name, latent, device, dtype, args.tiny, counted=False)
                        model = models[name]
                        return transformer_call(model, model_inputs(model, latent, device, dtype, False), task,
                                                backend, False, ckpt)

                    def make_counted(name=name, backend=backend, ckpt=ckpt):
                        model = build_model(name, latent, device, dtype, args.tiny, counted=True)
                        return transformer_call(model, model_inputs(model, latent, device, dtype, True), task,
                                                backend, True, ckpt)

                    cells.append(dict(key=(task, name, method, ckpt), size=tokens, make=make, row=row))
                    counted_cells.append((row, make_counted))
            run_real(cells, device, args, predictor, start)
            models.clear()
            if args.count:
                for row, make_counted in counted_cells:
                    row["peak_mib_counted"] = counted_peak(make_counted) / 2**20
            for row in rows[-len(cells):]:
                print(format_row(row), flush=True)
    return rows


def vae_rows(args, device, dtype, predictor, start):
    rows = []
    vae = build_vae(args.tiny, device, dtype)
    for px in args.vae_resolutions:
        latent = px // 8
        cells, counted_cells = [], []
        for tiling in ("off", "on"):
            tile = args.vae_tile if px > args.vae_tile else None
            row = dict(section="vae", model="SD-VAE (kl-f8)" if not args.tiny else "tiny VAE", px=px, latent=latent,
                       tiling=tiling, tile_px=tile if tiling == "on" else None, dtype=args.dtype, skipped=None)
            if tiling == "on" and tile is None:
                continue   # an image no larger than one tile is decoded in one piece anyway
            rows.append(row)
            if px > args.vae_real_max_px:
                row["skipped"] = f"real decode only up to --vae-real-max-px {args.vae_real_max_px}"

            def make(tiling=tiling, tile=tile, counted=False):
                z = torch.empty(1, 4, latent, latent) if counted else \
                    torch.randn(1, 4, latent, latent, generator=torch.Generator().manual_seed(0)).to(device, dtype)

                def call():
                    with torch.no_grad():
                        decode(z, vae, 1.0, tiling=tiling, tile_size=tile)
                return call

            cells.append(dict(key=("vae", tiling), size=px * px, make=make, row=row))
            counted_cells.append((row, lambda make=make: make(counted=True)))
        run_real(cells, device, args, predictor, start)
        if args.count:
            for row, make_counted in counted_cells:
                if args.count_budget_s and time.perf_counter() - start > args.count_budget_s:
                    row["counted_skipped"] = f"--count-budget-s {args.count_budget_s:g} s spent"
                    continue
                row["peak_mib_counted"] = counted_peak(make_counted) / 2**20
        for row in rows[-len(cells):]:
            print(format_row(row), flush=True)
    return rows


def format_row(r):
    what = (f"{r['model']:12s} {r.get('attention', ''):5s} ckpt={int(r.get('grad_checkpointing') or 0)}"
            if r["section"] != "vae" else f"{r['model']:16s} tiling={r['tiling']:3s}")
    real = ("skipped: " + r["skipped"]) if r["skipped"] else f"{r['time_s']:8.3f} s  {r['peak_mib']:10.1f} MiB"
    counted = f"  counted {r['peak_mib_counted']:10.1f} MiB" if r.get("peak_mib_counted") is not None else ""
    return f"{r['section']:6s} {r['px']:5d}px {what}  {real}{counted}"


def peak(r):
    """The measured peak, else the counted one (MiB), and which it is."""
    if r.get("peak_mib") is not None:
        return r["peak_mib"], "measured"
    if r.get("peak_mib_counted") is not None:
        return r["peak_mib_counted"], "counted"
    return None, None


def ratios(rows):
    """NaLaDiT / DiT (SDPA and math) per size, checkpointing on / off, tiled / untiled."""
    out = []
    get = {}
    for r in rows:
        key = (r["section"], r.get("size"), r.get("attention"), r.get("grad_checkpointing"), r["px"], r.get("tiling"))
        get[key] = r
    for (section, size, attention, ckpt, px, _), r in get.items():
        if section in ("sample", "train") and attention == "nala":
            for other in ("sdpa", "math"):
                ref = get.get((section, size, other, ckpt, px, None))
                if ref is None:
                    continue
                row = dict(section=section, size=size, px=px, tokens=r["tokens"], grad_checkpointing=ckpt,
                           vs=other)
                (a, ka), (b, kb) = peak(r), peak(ref)
                if a and b:
                    row.update(mem_ratio=a / b, mem_from=f"{ka}/{kb}")
                if r.get("time_s") and ref.get("time_s"):
                    row["time_ratio"] = r["time_s"] / ref["time_s"]
                out.append(row)
    for (section, size, attention, ckpt, px, _), r in get.items():
        if section == "train" and ckpt:
            off = get.get((section, size, attention, False, px, None))
            (a, ka), (b, kb) = peak(r), peak(off)
            if a and b:
                out.append(dict(section="train", size=size, px=px, tokens=r["tokens"], attention=attention,
                                vs="no checkpointing", mem_ratio=a / b, mem_from=f"{ka}/{kb}"))
        if section == "vae" and r["tiling"] == "on":
            off = get.get(("vae", None, None, None, px, "off"))
            (a, ka), (b, kb) = peak(r), peak(off)
            row = dict(section="vae", px=px, vs="untiled")
            if a and b:
                row.update(mem_ratio=a / b, mem_from=f"{ka}/{kb}")
            if r.get("time_s") and off.get("time_s"):
                row["time_ratio"] = r["time_s"] / off["time_s"]
            out.append(row)
    return out


def run_line(meta) -> str:
    load = meta.get("load_average") or [None, None]
    where = f"{meta['device_name']}, {meta['dtype']}, {meta['threads']} thread(s), batch 1, {meta['date']}"
    if load[0] is not None:
        where += f", load average {load[0]:.1f} → {load[1]:.1f} on {meta['cpu_count']} cores"
    return f"{where}, {meta['wall_s'] / 60:.1f} min: `{meta['command']}`"


def markdown(rows, meta, header=True) -> str:
    """The docs tables: MiB and seconds per cell; † = counted (shape-only run), — = not run."""
    def mib(r):
        value, how = peak(r) if r else (None, None)
        if value is None:
            return "—"
        text = f"{value / 1024:.2f} GiB" if value >= 1024 else f"{value:.1f} MiB"
        return text + ("†" if how == "counted" else "")

    def sec(r):
        return f"{r['time_s']:.2f}" if r and r.get("time_s") else "—"

    def ratio(a, b, key):
        if not (a and b):
            return "—"
        if key == "mem":
            (x, kx), (y, ky) = peak(a), peak(b)
            return "—" if not (x and y) else f"{x / y:.3f}" + ("†" if "counted" in (kx, ky) else "")
        return f"{a['time_s'] / b['time_s']:.2f}" if a.get("time_s") and b.get("time_s") else "—"

    def find(**kw):
        return next((r for r in rows if all(r.get(k) == v for k, v in kw.items())), None)

    out = [run_line(meta), ""] if header else []
    for size in sorted({r["size"] for r in rows if r["section"] == "sample"}, key=lambda s: s != "S/2"):
        out += [f"**One sampling forward, {size}** (seconds per call; peak memory of the call)", "",
                "| px | tokens | NaLaDiT s | DiT SDPA s | DiT math s | NaLaDiT peak | DiT SDPA peak | DiT math peak "
                "| NaLa / SDPA memory | NaLa / math memory | NaLa / SDPA time |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for px in sorted({r["px"] for r in rows if r["section"] == "sample" and r["size"] == size}):
            n, d, m = (find(section="sample", size=size, px=px, attention=a) for a in ("nala", "sdpa", "math"))
            out.append(f"| {px} | {n['tokens']:,} | {sec(n)} | {sec(d)} | {sec(m)} | {mib(n)} | {mib(d)} | {mib(m)} "
                       f"| {ratio(n, d, 'mem')} | {ratio(n, m, 'mem')} | {ratio(n, d, 'time')} |")
        out.append("")
    for size in sorted({r["size"] for r in rows if r["section"] == "train"}, key=lambda s: s != "S/2"):
        out += [f"**Training forward + backward, {size}** (peak per image, parameter gradients included)", "",
                "| tokens | NaLaDiT | NaLaDiT ckpt | DiT SDPA | DiT SDPA ckpt | ckpt / none NaLa | ckpt / none DiT "
                "| NaLa / DiT | NaLa s | DiT s |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for px in sorted({r["px"] for r in rows if r["section"] == "train" and r["size"] == size}):
            cell = {(a, c): find(section="train", size=size, px=px, attention=a, grad_checkpointing=c)
                    for a in ("nala", "sdpa") for c in (False, True)}
            n0 = cell[("nala", False)]
            out.append(f"| {n0['tokens']:,} | {mib(n0)} | {mib(cell[('nala', True)])} | {mib(cell[('sdpa', False)])} "
                       f"| {mib(cell[('sdpa', True)])} | {ratio(cell[('nala', True)], n0, 'mem')} "
                       f"| {ratio(cell[('sdpa', True)], cell[('sdpa', False)], 'mem')} "
                       f"| {ratio(n0, cell[('sdpa', False)], 'mem')} | {sec(n0)} | {sec(cell[('sdpa', False)])} |")
        out.append("")
    vae = [r for r in rows if r["section"] == "vae"]
    if vae:
        tile = next((r["tile_px"] for r in vae if r["tile_px"]), None)
        out += [f"**VAE decode** ({vae[0]['model']}, random weights; tiles of {tile} px)", "",
                "| px | untiled peak | tiled peak | tiled / untiled | untiled s |", "|---:|---:|---:|---:|---:|"]
        for px in sorted({r["px"] for r in vae}):
            off, on = find(section="vae", px=px, tiling="off"), find(section="vae", px=px, tiling="on")
            out.append(f"| {px} | {mib(off)} | {mib(on) if on else 'one tile'} | {ratio(on, off, 'mem') if on else '—'} "
                       f"| {sec(off)} |")
        out.append("")
    reasons = {}
    for r in rows:   # one line per kind of reason, with its cell count
        if r.get("skipped"):
            reason = re.sub(r"^(N×N scores|predicted) [\d.]+ (GiB|s per call)", r"\1", r["skipped"])
            reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        out += ["Not run for real (peaks marked † are counted instead): "
                + "; ".join(f"{reason} ({n} cells)" for reason, n in sorted(reasons.items())) + ".", ""]
    return "\n".join(out)


def plot(rows, path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [(axes[0, 0], "sample", "peak"), (axes[0, 1], "sample", "time"), (axes[1, 0], "train", "peak"),
              (axes[1, 1], "vae", "peak")]
    for ax, section, what in panels:
        groups = {}
        for r in rows:
            if r["section"] != section:
                continue
            if section == "vae":
                label = f"decode, tiling {r['tiling']}" + (f" ({r['tile_px']} px tiles)" if r["tile_px"] else "")
                x = r["px"]
            else:
                label = f"{r['model']} {r['attention']}" + (" + ckpt" if r["grad_checkpointing"] else "")
                x = r["tokens"]
            groups.setdefault(label, []).append((x, r))
        for label, pts in sorted(groups.items()):
            if what == "time":
                xy = sorted((x, r["time_s"]) for x, r in pts if r.get("time_s"))
                if xy:
                    ax.loglog(*zip(*xy), marker="o", label=label)
                continue
            measured = sorted((x, r["peak_mib"]) for x, r in pts if r.get("peak_mib") is not None)
            counted = sorted((x, r["peak_mib_counted"]) for x, r in pts if r.get("peak_mib_counted") is not None)
            line = None
            if counted:
                (line,) = ax.loglog(*zip(*counted), linestyle="--", marker="x", label=f"{label} (counted)")
            if measured:
                ax.loglog(*zip(*measured), linestyle="", marker="o", color=line.get_color() if line else None,
                          label=f"{label} (measured)")
        unit = "image px" if section == "vae" else "tokens"
        ax.set_xlabel(unit)
        ax.set_ylabel("seconds per call" if what == "time" else "peak MiB")
        title = {"sample": "one sampling forward", "train": "forward + backward", "vae": "VAE decode"}[section]
        ax.set_title(f"{title}: {what}, {meta['dtype']}, {meta['device_name']}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    from benchmarks.outputs import new_output  # an existing results file is refused

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--sizes", default="S/2", type=lambda s: s.split(","), help="e.g. S/2,XL/2")
    parser.add_argument("--real-sizes", type=lambda s: s.split(","),
                        help="sizes that also run for real (default: all on CUDA, S/2 on CPU)")
    parser.add_argument("--resolutions", default="256,512,1024,2048,4096", type=ints, help="sample: image px")
    parser.add_argument("--train-tokens", default="1024,4096,16384", type=ints, help="train: tokens (square grids)")
    parser.add_argument("--vae-resolutions", default="256,512,1024,2048,4096", type=ints, help="vae: image px")
    parser.add_argument("--vae-tile", type=int, default=512, help="tile px of the tiled decode")
    parser.add_argument("--vae-real-max-px", type=int, default=512, help="largest real VAE decode (larger: counted)")
    parser.add_argument("--sections", default="sample,train,vae", type=lambda s: s.split(","))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-cap", type=float, default=30.0, help="seconds: no real call predicted longer")
    parser.add_argument("--single-call-s", type=float, default=8.0,
                        help="a call predicted longer is run once (tracked, timed, no warm-up)")
    parser.add_argument("--math-cap-gib", type=float, default=1.0, help="largest N×N score tensor for the math backend")
    parser.add_argument("--budget-s", type=float, default=0.0, help="start no real cell after this many seconds")
    parser.add_argument("--count-budget-s", type=float, default=0.0,
                        help="start no counted VAE cell after this many seconds (tiled counting is slow)")
    parser.add_argument("--no-count", dest="count", action="store_false", help="CPU: skip the counted peaks")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--tiny", action="store_true", help="2-block narrow models, tiny VAE, 64-128 px (tests)")
    parser.add_argument("--out", default="", type=new_output, help="JSON path; a PNG plot is written beside it")
    parser.add_argument("--from-json", metavar="JSON", nargs="+", help="run nothing: print the markdown tables of "
                        "result files (a cell in a later file replaces the same cell of an earlier one) and redraw "
                        "the plot beside the first")
    return parser


def redraw(paths: list[str]) -> None:
    """``--from-json``: the markdown tables of result files (a cell in a later file replaces the
    same cell of an earlier one) and the plot beside the first, running nothing."""
    files = [json.loads(Path(f).read_text()) for f in paths]
    cells = {}
    for data in files:
        for r in data["results"]:
            cells[tuple(r.get(k) for k in ("section", "model", "attention", "px", "grad_checkpointing",
                                            "tiling"))] = r
    rows = list(cells.values())
    print("\n".join(run_line(data["meta"]) for data in files) + "\n")
    print(markdown(rows, files[0]["meta"], header=False))
    plot(rows, Path(paths[0]).with_suffix(".png"), files[0]["meta"])


def run_meta(args, argv, device, load_before, start: float) -> dict:
    """What the JSON records of the run: command, date, machine, versions, method."""
    import diffusers

    dtype = DTYPES[args.dtype]
    return dict(
        command="python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        device=str(device), dtype=args.dtype, threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine()),
        torch=torch.__version__, diffusers=diffusers.__version__, tiny=args.tiny,
        sdpa_backend=sdpa_backend(device, dtype), batch=1, repeats=args.repeats, statistic="median",
        memory_method="torch.cuda.max_memory_allocated" if device.type == "cuda" else
        "TorchDispatchMode storage tracking (tensors created during the call); counted: the same under FakeTensorMode",
        load_average=[load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
        wall_s=time.perf_counter() - start,
    )


def print_ratios(table: list[dict]) -> None:
    print("\nratios (peak memory from measured/counted cells; time from measured ones)")
    for r in table:
        mem = f"mem {r['mem_ratio']:.3f} ({r['mem_from']})" if "mem_ratio" in r else "mem -"
        tim = f"time {r['time_ratio']:.3f}" if "time_ratio" in r else ""
        what = r.get("attention", "nala") if r["section"] != "vae" else "tiled"
        ck = " ckpt" if r.get("grad_checkpointing") else ""
        vs = r["vs"] + (ck if r["vs"] in ("sdpa", "math") else "")
        print(f"  {r['section']:6s} {r.get('size') or '':5s} {r['px']:5d}px {what}{ck} / {vs}: {mem} {tim}")


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.from_json:
        redraw(args.from_json)
        return
    device = torch.device(args.device)
    if args.tiny:
        args.resolutions, args.train_tokens, args.vae_resolutions = [64, 128], [64], [64, 128]
        args.vae_tile, args.vae_real_max_px, args.repeats = 64, 128, 1
    if args.real_sizes is None:
        args.real_sizes = args.sizes if device.type == "cuda" else ["S/2"]
    args.count = args.count and device.type == "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    start, predictor, rows = time.perf_counter(), Predictor(), []
    try:
        for section in args.sections:
            if section == "vae":
                rows += vae_rows(args, device, dtype, predictor, start)
            else:
                rows += transformer_rows(args, device, dtype, predictor, start, section)
    except KeyboardInterrupt:  # a time limit (timeout --signal=INT): keep what was measured
        print("interrupted: reporting the results so far", flush=True)
    meta = run_meta(args, argv, device, load_before, start)
    table = ratios(rows)
    print_ratios(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(meta=meta, results=rows, ratios=table), indent=1))
        plot(rows, out.with_suffix(".png"), meta)
        print(f"wrote {out} and {out.with_suffix('.png')}")
    print("\n" + markdown(rows, meta))


if __name__ == "__main__":
    main()
