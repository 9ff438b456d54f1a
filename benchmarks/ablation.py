"""Does NaLa help? A seeded ablation grid trained through ``train.py``.

Every *cell* is one (task, variant, seed, lr): one ``train.py`` run to the largest
budget, with a checkpoint at every budget. The learning rate is constant, so the
checkpoint at step S is exactly an S-step run: one training run gives every budget.
Each checkpoint's EMA weights are then scored:

* class-consistency and Fréchet distance in the digits classifier's feature space
  (balanced labelled samples, the demo's sampler and guidance);
* held-out loss: the training objective on the held-out split with fixed timesteps and
  noise (the same draws for every model);
* training loss: mean of the logged loss over the last 100 steps before the budget;
* training time: the summed logged step times up to the budget (no checkpoint/eval).

A cell writes one small JSON (``<out>/cells/<task>/<variant>/seed<k>_lr<lr>.json``);
finished cells are skipped on a rerun, interrupted runs resume from their last
checkpoint, and the table is rebuilt from whatever JSONs exist (``n`` per cell shown).

    python benchmarks/ablation.py run --out runs/ablation --jobs 2            # the grid
    python benchmarks/ablation.py run --out runs/ablation --tasks digits --variants softmax,nala
    python benchmarks/ablation.py table --out runs/ablation --md benchmarks/ablation/RESULTS.md --page docs/ablation.md
    python benchmarks/ablation.py run --quick --out /tmp/ablation_quick       # smoke (digits + a 64-px canvas)

The canvas ladder (``--tasks canvas64,canvas128``: 1,024 and 4,096 tokens, the same picture as
the 256-token ``canvas``) is sized for about 8 core-hours from scratch; its step times come
from one isolated timing run, so the table can rank time to a held-out loss
(docs/ablation_ladder.md has the commands and the recipe's arithmetic):

    python benchmarks/ablation.py timing --out runs/ablation --tasks canvas64,canvas128 --variants ladder
    python benchmarks/ablation.py run --out runs/ablation --tasks canvas64,canvas128 --variants ladder \\
        --sweep-lrs "" --jobs 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nala_dit.cli import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

# Variants: the flags that make them, on top of the task's recipe. Every model is the
# DiT-T/2 backbone (diffusion objective, learned sigma); only the attention differs.
VARIANTS = {
    "softmax": ["--model", "DiT-T/2", "--attention", "softmax"],
    "softmax_gated": ["--model", "DiT-T/2", "--attention", "softmax_gated"],
    "relu_gated": ["--model", "DiT-T/2", "--attention", "relu"],
    "elu_gated": ["--model", "DiT-T/2", "--attention", "elu"],
    "nala": ["--model", "DiT-T/2", "--attention", "nala"],
    "nala_sqrt_d": ["--model", "DiT-T/2", "--attention", "nala", "--norm-scale", "sqrt_d"],
    "nala_learned": ["--model", "DiT-T/2", "--attention", "nala", "--norm-scale", "learned"],
    "nala_relu_split": ["--model", "DiT-T/2", "--attention", "nala", "--direction", "relu_split"],
    "nala_no_lepe": ["--model", "DiT-T/2", "--attention", "nala", "--lepe", "false"],
    "nala_no_gate": ["--model", "DiT-T/2", "--attention", "nala", "--gate", "false"],
    "nala_rope": ["--model", "DiT-T/2", "--attention", "nala", "--rope", "true"],
    "hybrid": ["--model", "DiT-T/2", "--attention", "nala", "--softmax-blocks", "every:4"],
    # The 4,096-token remedies (docs/ablation.md "Where it pays"): region states, Mix-FFN,
    # both, and the hybrid's softmax block elsewhere.
    "nala_r2": ["--model", "DiT-T/2", "--attention", "nala", "--nala-regions", "2"],
    "nala_r4": ["--model", "DiT-T/2", "--attention", "nala", "--nala-regions", "4"],
    "nala_mix": ["--model", "DiT-T/2", "--attention", "nala", "--mlp", "mix"],
    "nala_r4_mix": ["--model", "DiT-T/2", "--attention", "nala", "--nala-regions", "4", "--mlp", "mix"],
    "hybrid_b0": ["--model", "DiT-T/2", "--attention", "nala", "--softmax-blocks", "0"],
    "hybrid_b13": ["--model", "DiT-T/2", "--attention", "nala", "--softmax-blocks", "1,3"],
}
DESCRIPTIONS = {
    "softmax": "DiT's softmax attention (qkv, proj; no extras)",
    "softmax_gated": "softmax in the gated layer (qkvg, LePE, LayerNorm, SiLU gate)",
    "relu_gated": "ReLU linear attention in the gated layer",
    "elu_gated": "1+ELU linear attention in the gated layer",
    "nala": "NaLa cosine, s = 1 (the paper), gated layer",
    "nala_sqrt_d": "NaLa cosine, s = √D",
    "nala_learned": "NaLa cosine, learned s per head",
    "nala_relu_split": "NaLa relu_split direction, s = 1",
    "nala_no_lepe": "NaLa s = 1 without LePE",
    "nala_no_gate": "NaLa s = 1 without the SiLU gate",
    "nala_rope": "NaLa s = 1 with numerator-only 2-D RoPE",
    "hybrid": "NaLa s = 1 in blocks 0-2, DiT's softmax layer in block 3 (one of four)",
    "nala_r2": "NaLa s = 1 with 2 x 2 region states",
    "nala_r4": "NaLa s = 1 with 4 x 4 region states",
    "nala_mix": "NaLa s = 1 with Mix-FFN (3 x 3 depthwise conv in the MLP)",
    "nala_r4_mix": "NaLa s = 1 with 4 x 4 region states and Mix-FFN",
    "hybrid_b0": "DiT's softmax layer in block 0, NaLa s = 1 in blocks 1-3",
    "hybrid_b13": "DiT's softmax layer in blocks 1 and 3, NaLa s = 1 in blocks 0 and 2",
}
# The ladder grid's variants (``--variants ladder``): the five and the hybrid.
LADDER_VARIANTS = ("softmax", "softmax_gated", "nala", "nala_sqrt_d", "relu_gated", "hybrid")
# The 4,096-token remedies (``--variants remedies``).
REMEDY_VARIANTS = ("nala_r2", "nala_r4", "nala_mix", "nala_r4_mix", "hybrid_b0", "hybrid_b13")

# The digits recipe is the demo's (configs/digits_*.yaml): batch 64, lr 2e-3, EMA 0.99;
# budgets 0.5x, 1x, 2x its 600 steps.
TASKS = {
    "digits": dict(data="digits", batch=64, lr=2e-3, ema=0.99, budgets=(300, 600, 1200), log_every=50,
                   per_class=30, sampler="ddpm", sample_steps=40, cfg=2.0, sample_batch=300),
    # 256 tokens: a step takes 1.0 s (softmax) to 1.5 s (NaLa) on one thread, and scoring at
    # the digits settings would take ~5 min per budget, so the canvas grid (5 variants x 3
    # seeds) is sized to fit 2 cores (measured: ~90 min): 100 samples (10 per class), 25 DDPM
    # steps, budgets 1/3x and 2/3x the demo's steps.
    "canvas": dict(data="digits-canvas", batch=32, lr=2e-3, ema=0.99, budgets=(200, 400), log_every=50,
                   per_class=10, sampler="ddpm", sample_steps=25, cfg=2.0, sample_batch=100),
    # The ladder (the same pictures at 64 / 128 px). Sized in docs/ablation_ladder.md from the
    # isolated timing run: 36 cells (6 variants x 3 seeds x 2 sizes) in about 8 core-hours.
    # Held-out loss (the time-to-quality measure) at every budget on fixed draws of
    # ``heldout_items`` canvases; samples (class-consistency, Fréchet distance) only at
    # ``sample_budgets``, since one sampled image costs 2 x sample_steps forward passes.
    "canvas64": dict(data="digits-canvas", image_size=64, batch=8, lr=2e-3, ema=0.99, budgets=(100, 200, 400),
                     log_every=25, per_class=5, sampler="ddim", sample_steps=20, cfg=2.0, sample_batch=25,
                     sample_budgets=(200, 400), heldout_items=120, heldout_repeats=1),
    "canvas128": dict(data="digits-canvas", image_size=128, batch=4, lr=2e-3, ema=0.99, budgets=(75, 150, 300),
                      log_every=25, per_class=2, sampler="ddim", sample_steps=20, cfg=2.0, sample_batch=20,
                      sample_budgets=(300,), heldout_items=60, heldout_repeats=1),
}
# Up the ladder: the same 64 / 128-px recipes, each cell starting from the final checkpoint
# of the same variant and seed on the 256-token ``canvas`` (every weight copied, positions
# recomputed, train.py --init-from), under both position policies of docs/highres.md.
for _side in (64, 128):
    for _pos, _tag in (("interpolate", "interp"), ("extrapolate", "extrap")):
        TASKS[f"ladder{_side}_{_tag}"] = dict(TASKS[f"canvas{_side}"], init_task="canvas", pos_embed=_pos)
LADDER_TASKS = tuple(t for t in TASKS if t.startswith("ladder"))
QUICK = dict(batch=16, budgets=(2, 4), log_every=1, per_class=2, sample_steps=4, sample_batch=20,
             heldout_items=64, heldout_repeats=1)
# A ladder task in quick mode: the smallest batch and scoring that still fill every column.
QUICK_LADDER = dict(batch=2, per_class=1, sample_steps=2, sample_batch=10, sample_budgets=(4,), heldout_items=8)
QUICK_VARIANTS = ("softmax", "nala")
QUICK_SEEDS = (0, 1)
QUICK_TASKS = ("digits", "canvas64", "ladder64_interp")
HELDOUT_REPEATS = 4  # fixed (t, noise) draws per held-out image (all items unless a recipe says)
METRICS = ("class_consistency", "frechet_distance", "train_loss", "heldout_loss", "train_time_s")
RAW = "heldout_loss_raw"   # held-out loss of the raw (not EMA) weights; absent from cells scored before it


def lr_tag(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def cell_name(task: str, variant: str, seed: int, lr: float) -> str:
    return f"{task}/{variant}/seed{seed}_lr{lr_tag(lr)}"


def task_recipe(task: str, quick: bool) -> dict:
    recipe = dict(TASKS[task])
    if quick:
        recipe.update(QUICK)
        if "image_size" in recipe:
            recipe.update(QUICK_LADDER)
    return recipe


def is_canvas(task: str) -> bool:
    return TASKS[task]["data"] == "digits-canvas"


def data_flags(recipe: dict) -> list:
    """The train.py flags that pick the task's data (the ladder's canvas side)."""
    size = recipe.get("image_size")
    return ["--data", recipe["data"]] + (["--image-size", size] if size else [])


# ------------------------------------------------------------------ one cell


def train_log(run_dir: Path) -> list[dict]:
    """The log records by step; a resumed run's repeated steps keep the later record."""
    by_step = {}
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def log_summary(records: list[dict], budget: int, window: int) -> tuple[float, float]:
    """(training loss over the last ``window`` steps before ``budget``, summed step time)."""
    time_s, prev = 0.0, 0
    losses, weights = [], []
    for r in records:
        if r["step"] > budget:
            break
        steps = r["step"] - prev
        time_s += steps / r["steps_per_sec"]
        if r["step"] > budget - window:
            losses.append(r["loss"])
            weights.append(steps)
        prev = r["step"]
    loss = sum(l * w for l, w in zip(losses, weights)) / sum(weights) if weights else float("nan")
    return loss, time_s


def heldout_set(task: str):
    from nala_dit import data as data_lib

    if not is_canvas(task):
        return data_lib.DigitsDataset("heldout")
    return data_lib.DigitsCanvasDataset("heldout", TASKS[task].get("image_size", 32))


def heldout_loss(model, objective, dataset, seed: int = 1234, items: int | None = None,
                 repeats: int = HELDOUT_REPEATS) -> float:
    """The training objective on the held-out split, same (t, noise) draws for every model."""
    import torch

    x, y = dataset.images[:items], dataset.labels[:items]
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    with torch.no_grad():
        for _ in range(repeats):
            for start in range(0, len(x), 256):
                xb, yb = x[start:start + 256], y[start:start + 256]
                noise = torch.randn(xb.shape, generator=gen)
                if model.config.objective == "diffusion":
                    t = torch.randint(0, objective.num_timesteps, (len(xb),), generator=gen)
                    loss = objective.training_losses(model, xb, t, yb, noise=noise)["loss"]
                else:
                    t = objective.sample_t(len(xb), xb.device, gen)
                    loss = objective.training_losses(model, xb, yb, t=t, noise=noise)["loss"]
                total += loss.sum().item()
    return total / (repeats * len(x))


def classifier_view(task: str, images):
    """uint8 NHWC samples → what the digits classifier scores (canvas: the digit's crop)."""
    if is_canvas(task):
        from nala_dit.digits import canvas_crop

        return canvas_crop(images)
    return images


def reference(task: str, work: Path, classifier_dir: Path) -> Path:
    """Digits-classifier statistics of the held-out split (built once per output folder)."""
    from nala_dit import metrics
    from nala_dit.data import to_uint8

    path = work / f"ref_{task}_heldout.npz"
    if path.is_file():
        return path
    images = classifier_view(task, to_uint8(heldout_set(task).images).numpy())
    from nala_dit.metric_inputs import build_extractor

    extractor = build_extractor("digits", digits_classifier_dir=classifier_dir)
    feats = metrics.compute_features(extractor, [images[i:i + 250] for i in range(0, len(images), 250)])
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    metrics.save_reference(tmp, metrics.reference_statistics(feats, extractor.describe()))
    os.replace(tmp, path)
    return path


def evaluate_checkpoint(task: str, ckpt: Path, recipe: dict, ref: Path, classifier_dir: Path,
                        sample: bool = True) -> dict:
    """Held-out loss of the EMA weights and of the raw weights (an EMA of 0.99 lags about 100
    steps, a third of a 300-step budget), and with ``sample`` class-consistency and Fréchet
    distance of the EMA weights (NaN without)."""
    import numpy as np

    from nala_dit import metrics
    from nala_dit.generate import SampleSettings
    from nala_dit.sampling import sample_images
    from nala_dit.sources import load_source

    source = load_source(ckpt)
    source.model.eval()
    held = dict(items=recipe.get("heldout_items"), repeats=recipe.get("heldout_repeats", HELDOUT_REPEATS))
    loss = heldout_loss(source.model, source.objective, heldout_set(task), **held)
    raw = load_source(ckpt, weights="model").model.eval()
    loss_raw = heldout_loss(raw, source.objective, heldout_set(task), **held)
    if not sample:
        return dict(class_consistency=math.nan, frechet_distance=math.nan, heldout_loss=loss,
                    heldout_loss_raw=loss_raw, num_samples=0)
    labels = [c for _ in range(recipe["per_class"]) for c in range(source.num_classes)]
    settings = SampleSettings(sampler=recipe["sampler"], num_steps=recipe["sample_steps"], cfg_scale=recipe["cfg"])
    start = time.perf_counter()
    images, nfe = sample_images(source, labels, seed=1, settings=settings, batch_size=recipe["sample_batch"])
    sample_time = time.perf_counter() - start
    view = classifier_view(task, images.numpy())
    result = metrics.evaluate_samples([view], ref, features="digits", digits_classifier_dir=classifier_dir,
                                      labels=np.asarray(labels))
    return dict(class_consistency=result["metrics"]["class_consistency"],
                frechet_distance=result["metrics"]["fd_digits"], heldout_loss=loss, heldout_loss_raw=loss_raw,
                num_samples=len(labels), nfe=nfe, sample_time_s=round(sample_time, 2))


def run_cell(task: str, variant: str, seed: int, lr: float, out: Path, quick: bool,
             budgets: list[int] | None = None, classifier_dir: Path | None = None) -> dict:
    """Train one cell to its largest budget (resuming if interrupted), score every budget."""
    import torch

    import train as train_cli
    from nala_dit.checkpoint import list_checkpoints, open_checkpoint
    from nala_dit.models import count_params

    recipe = task_recipe(task, quick)
    if budgets:
        recipe["budgets"] = tuple(sorted(budgets))
    work = out / "work"
    run_dir = work / "runs" / cell_name(task, variant, seed, lr)
    budgets = recipe["budgets"]
    every = math.gcd(*budgets)
    argv = [*VARIANTS[variant], *data_flags(recipe), "--flip", "false",
            "--global-batch-size", recipe["batch"], "--lr", lr, "--ema-decay", recipe["ema"],
            "--max-steps", budgets[-1], "--ckpt-every", every, "--log-every", recipe["log_every"],
            "--sample-every", 0, "--num-workers", 0, "--mixed-precision", "no", "--seed", seed,
            "--results-dir", run_dir.parent, "--exp-name", run_dir.name]
    if list_checkpoints(run_dir / "checkpoints"):
        argv += ["--resume", "auto"]
    elif recipe.get("init_task"):
        argv += ["--init-from", ladder_source(recipe["init_task"], variant, seed, out, quick, classifier_dir),
                 "--pos-embed", recipe["pos_embed"]]
    argv = [str(a) for a in argv]
    load = os.getloadavg()
    start = time.perf_counter()
    print(f"[{cell_name(task, variant, seed, lr)}] python train.py {' '.join(argv)}", flush=True)
    code = train_cli.main(argv)
    wall_train = time.perf_counter() - start
    if code:
        raise RuntimeError(f"train.py exited with {code}")
    classifier_dir = classifier_dir or work / "digits_classifier"
    ref = reference(task, work, classifier_dir)
    records = train_log(run_dir)
    by_step = {open_checkpoint(p).step: p for p in list_checkpoints(run_dir / "checkpoints")}
    # A cell extended to a larger budget keeps the scores of the budgets it already had
    # (the resumed run is the same run, continued; scoring is deterministic, so the kept
    # final checkpoint is not scored twice).
    previous = _previous(out, task, variant, seed, lr)
    scored = {row["budget"]: row for row in previous.get("budgets", [])}
    rows = []
    for budget in budgets:
        if budget in scored:
            rows.append(scored[budget])
            continue
        ckpt = by_step[budget]
        loss, time_s = log_summary(records, budget, window=2 * recipe["log_every"])
        scores = evaluate_checkpoint(task, ckpt, recipe, ref, classifier_dir,
                                     sample=budget in recipe.get("sample_budgets", budgets) or budget == budgets[-1])
        rows.append(dict(budget=budget, train_loss=loss, train_time_s=round(time_s, 2), **scores))
        print(f"[{cell_name(task, variant, seed, lr)}] step {budget}: {rows[-1]}", flush=True)
    from nala_dit.checkpoint import load_model

    model, _ = load_model(by_step[budgets[-1]])
    result = dict(task=task, variant=variant, seed=seed, lr=lr, quick=quick, recipe=recipe,
                  flags=VARIANTS[variant], params=count_params(model), budgets=rows,
                  wall_train_s=round(wall_train + previous.get("wall_train_s", 0), 1),
                  wall_total_s=round(time.perf_counter() - start + previous.get("wall_total_s", 0), 1),
                  loadavg_start=load, loadavg_end=os.getloadavg(), torch_threads=torch.get_num_threads(),
                  last_exponent=records[-1].get("nala/exponent_mean"))
    # Keep only the final checkpoint (diagnostics read it); earlier ones were scored.
    for step, path in by_step.items():
        if step != budgets[-1]:
            shutil.rmtree(path, ignore_errors=True)
    return result


def ladder_source(task: str, variant: str, seed: int, out: Path, quick: bool, classifier_dir) -> Path:
    """The final checkpoint of ``task``'s cell for this variant and seed, the start of a
    ladder cell; the cell is run first (and recorded, unless already recorded) if its
    checkpoint is not in ``out/work`` (a fresh clone holds the cell JSONs, not the runs)."""
    from nala_dit.checkpoint import list_checkpoints

    lr = task_recipe(task, quick)["lr"]
    found = list_checkpoints(out / "work" / "runs" / cell_name(task, variant, seed, lr) / "checkpoints")
    final = max(task_recipe(task, quick)["budgets"])
    if not found or int(found[-1].name) < final:
        result = run_cell(task, variant, seed, lr, out, quick, classifier_dir=classifier_dir)
        if not cell_path(out, task, variant, seed, lr).is_file():
            write_json(cell_path(out, task, variant, seed, lr), result)
        found = list_checkpoints(out / "work" / "runs" / cell_name(task, variant, seed, lr) / "checkpoints")
    return found[-1]


def cell_path(out: Path, task: str, variant: str, seed: int, lr: float) -> Path:
    return out / "cells" / f"{cell_name(task, variant, seed, lr)}.json"


def _previous(out: Path, *cell) -> dict:
    """The cell's earlier successful result, or {}."""
    path = cell_path(out, *cell)
    data = json.loads(path.read_text()) if path.is_file() else {}
    return {} if "error" in data else data


def cell_done(out: Path, *cell, budgets=None) -> bool:
    """Finished successfully with every budget asked for (a failed cell's JSON holds its
    error and is retried on a rerun; a cell asked for a larger budget is continued)."""
    previous = _previous(out, *cell)
    have = {row["budget"] for row in previous.get("budgets", [])}
    return bool(previous) and (not budgets or set(budgets) <= have)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def cell_main(args) -> int:
    out = args.out.resolve()
    path = cell_path(out, args.task, args.variant, args.seed, args.lr)
    try:
        result = run_cell(args.task, args.variant, args.seed, args.lr, out, args.quick, args.budgets,
                          args.classifier_dir)
    except Exception as err:  # a failed cell is recorded, not retried forever
        import traceback

        traceback.print_exc()
        result = dict(task=args.task, variant=args.variant, seed=args.seed, lr=args.lr, quick=args.quick,
                      error=f"{type(err).__name__}: {err}")
    write_json(path, result)
    return 0 if "error" not in result else 1


# ------------------------------------------------------------------ the grid


def grid(args) -> list[tuple[str, str, int, float]]:
    """Cells in priority order: seed 0 of every variant first, then seed 1, ... (with
    ``--core N``: all seeds of the first N variants before the others); the lr sweep
    (seed 0 of --sweep-variants at --sweep-lrs) after the seeds."""
    cells = []
    groups = [args.variants[:args.core], args.variants[args.core:]] if args.core else [args.variants]
    for task in args.tasks:
        recipe = task_recipe(task, args.quick)
        for group in groups:
            for seed in args.seeds:
                cells += [(task, v, seed, recipe["lr"]) for v in group]
        for lr in args.sweep_lrs:
            cells += [(task, v, 0, lr) for v in args.sweep_variants if v in args.variants and lr != recipe["lr"]]
    return cells


def _locked(lock: Path) -> bool:
    """A cell is being run by a live process (runners may overlap after a restart)."""
    try:
        pid = int(lock.read_text())
        os.kill(pid, 0)
        return True
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return False


def _live_cells(out: Path) -> int:
    return sum(_locked(lock) for lock in (out / "locks").glob("*.pid"))


def run_main(args) -> int:
    out = args.out.resolve()
    todo = [c for c in grid(args) if not cell_done(out, *c, budgets=args.budgets)]
    print(f"{len(todo)} cells to run", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    running: list[tuple[subprocess.Popen, Path]] = []
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "locks").mkdir(parents=True, exist_ok=True)
    # Shared by every cell: build them once before the cells run side by side.
    classifier_dir = (args.classifier_dir or out / "work" / "digits_classifier").resolve()
    for task in args.tasks:
        reference(task, out / "work", classifier_dir)
    failures = 0
    for cell in todo:
        lock = out / "locks" / (cell_name(*cell).replace("/", "__") + ".pid")
        if cell_done(out, *cell, budgets=args.budgets) or _locked(lock):
            continue
        flags = ["--task", cell[0], "--variant", cell[1], "--seed", str(cell[2]), "--lr", repr(cell[3]),
                 "--out", str(out)] + (["--quick"] if args.quick else [])
        if args.budgets:
            flags += ["--budgets", ",".join(map(str, args.budgets))]
        flags += ["--classifier-dir", str(classifier_dir)]
        if args.jobs <= 1:  # in this process: no interpreter start per cell
            lock.write_text(str(os.getpid()))
            import torch

            torch.set_num_threads(1)
            failures += cell_main(cell_parser().parse_args(flags))
            lock.unlink(missing_ok=True)
            write_table(out, args.md)
            continue
        # Slots count every live cell, also those of an earlier runner still finishing
        # (a restarted runner picks up where the old one is, without oversubscribing).
        while len(running) >= args.jobs or _live_cells(out) >= args.jobs or _source_busy(out, cell, args.quick):
            time.sleep(2)
            failures += _reap(running, out, args.md)
        log = open(out / "logs" / (cell_name(*cell).replace("/", "__") + ".log"), "a")
        proc = subprocess.Popen([sys.executable, __file__, "cell", *flags], env=env, cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        lock.write_text(str(proc.pid))
        running.append((proc, lock))
    while running and not args.no_wait:
        time.sleep(2)
        failures += _reap(running, out, args.md)
    write_table(out, args.md)
    return 1 if failures else 0


def _source_busy(out: Path, cell: tuple, quick: bool) -> bool:
    """A ladder cell waits while another process trains its source cell (same run folder)."""
    source = task_recipe(cell[0], quick).get("init_task")
    if source is None:
        return False
    lr = task_recipe(source, quick)["lr"]
    return _locked(out / "locks" / (cell_name(source, *cell[1:3], lr).replace("/", "__") + ".pid"))


def _reap(running: list, out: Path, md: Path | None) -> int:
    failures = 0
    for item in list(running):
        proc, lock = item
        if proc.poll() is not None:
            running.remove(item)
            lock.unlink(missing_ok=True)
            failures += proc.returncode != 0
            write_table(out, md)
    return failures


# ------------------------------------------------------------------ step times

TIMING_FILE = "timing.json"
QUICK_TIMING = dict(rounds=2, steps=1)


def _timing_setup(task: str, variant: str, recipe: dict, batch: int):
    """One variant's training step as train.py builds it (model, objective, AdamW, EMA, a batch),
    and one no-grad forward of that batch (what a sampler step costs per image)."""
    import copy

    import torch

    from nala_dit.checkpoint import build_objective
    from nala_dit.config import resolve, to_dict
    from nala_dit.training import TrainConfig, build_model, param_groups, update_ema

    cfg, _ = resolve(TrainConfig, [str(a) for a in [*VARIANTS[variant], *data_flags(recipe),
                                                    "--lr", recipe["lr"], "--ema-decay", recipe["ema"]]])
    data = heldout_set(task)
    torch.manual_seed(0)
    model = build_model(cfg, data.num_classes, data.channels, data.image_size)
    objective = build_objective(dict(model.config), to_dict(cfg))
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    x, y = data.images[:batch], data.labels[:batch]

    def step():
        t = torch.randint(0, objective.num_timesteps, (batch,))
        loss = objective.training_losses(model, x, t, y)["loss"].mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_ema(ema, model, cfg.ema_decay)

    def forward():
        with torch.no_grad():
            ema(x, torch.full((batch,), 500), y)

    return step, forward


def timing_main(args) -> int:
    """Each variant's training-step time per task in this one process: one thread, every
    variant built first, then ``rounds`` round-robin passes of ``steps`` timed steps each (one
    untimed warm-up step per variant), so drifting machine load hits all variants alike.
    Writes the medians to ``<out>/timing.json`` (the table's time-to-loss reads it)."""
    import platform
    import statistics

    import torch

    torch.set_num_threads(1)
    knobs = dict(QUICK_TIMING) if args.quick else dict(rounds=args.rounds, steps=args.steps)
    out_file = args.out.resolve() / TIMING_FILE
    previous = json.loads(out_file.read_text()) if out_file.is_file() else {}
    result = dict(previous, meta=dict(threads=torch.get_num_threads(), torch=torch.__version__,
                                      machine=platform.processor() or platform.machine(), quick=args.quick,
                                      loadavg_start=os.getloadavg(), **knobs))
    for task in args.tasks:
        recipe = task_recipe(task, args.quick)
        batch = recipe["batch"]
        calls = {v: _timing_setup(task, v, recipe, batch) for v in args.variants}
        task_load = os.getloadavg()
        for step, forward in calls.values():
            step()                                                      # warm-up (allocations, first call)
            forward()
        times = {v: [] for v in args.variants}
        cpu = {v: [] for v in args.variants}      # process CPU time: what the step costs under load
        forwards = {v: [] for v in args.variants}
        for _ in range(knobs["rounds"]):
            for v, (step, forward) in calls.items():
                for _ in range(knobs["steps"]):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    step()
                    times[v].append(time.perf_counter() - start)
                    cpu[v].append(time.process_time() - start_cpu)
                start = time.perf_counter()
                forward()
                forwards[v].append(time.perf_counter() - start)
        result.setdefault("tasks", {})[task] = {
            v: dict(median_step_s=statistics.median(ts), steps_s=[round(t, 4) for t in ts], batch=batch,
                    median_step_cpu_s=statistics.median(cpu[v]), forward_per_image_s=statistics.median(forwards[v]) / batch)
            for v, ts in times.items()}
        print(f"{task} (batch {batch}): " + ", ".join(
            f"{v} {statistics.median(ts):.3f} s" for v, ts in times.items()), flush=True)
        result["meta"]["loadavg_end"] = os.getloadavg()
        # ``meta`` is the last run's; each task keeps the conditions it was measured under.
        result.setdefault("task_meta", {})[task] = dict(result["meta"], loadavg_start=task_load, variants=args.variants)
        write_json(out_file, result)                                    # each task as it finishes
    print(f"wrote {out_file}")
    return 0


def load_timing(out: Path) -> dict:
    """{task: {variant: median step seconds}} from ``<out>/timing.json`` ({} if absent).

    The CPU time of the step's one thread where recorded: what a step costs, which a shared
    machine's load does not inflate the way it inflates wall time; else the wall median."""
    path = out / TIMING_FILE
    if not path.is_file():
        return {}
    tasks = json.loads(path.read_text()).get("tasks", {})
    return {task: {v: row.get("median_step_cpu_s", row["median_step_s"]) for v, row in rows.items()}
            for task, rows in tasks.items()}


def _timed_rows(rows: list[dict], step_s: dict):
    """Per task with a timing: (task, its rows at the default lr with a held-out loss and a
    timed variant, those variants in ``VARIANTS`` order)."""
    for task in _tasks(r["task"] for r in rows):
        lr = TASKS[task]["lr"]
        mine = [r for r in rows if r["task"] == task and r["lr"] == lr and r["variant"] in step_s.get(task, {})
                and not math.isnan(r["heldout_loss"])]
        variants = sorted({r["variant"] for r in mine}, key=list(VARIANTS).index)
        if variants:
            yield task, mine, variants


def time_to_loss(rows: list[dict], step_s: dict) -> list[dict]:
    """Per task: the held-out loss every variant reaches (the largest of the variants' best
    mean losses), each variant's first budget at or below it and that budget's compute time
    (budget × isolated median step time), with the factor over the fastest variant. Only
    variants with a timing and the default lr; a variant never at the target is omitted."""
    out = []
    for task, mine, variants in _timed_rows(rows, step_s):
        best = {v: min(r["heldout_loss"] for r in mine if r["variant"] == v) for v in variants}
        target = max(best.values())
        found = []
        for v in variants:
            hit = min(r["budget"] for r in mine if r["variant"] == v and r["heldout_loss"] <= target)
            n = next(r["n"] for r in mine if r["variant"] == v and r["budget"] == hit)
            found.append(dict(task=task, variant=v, target=target, budget=hit, n=n,
                              step_s=step_s[task][v], time_s=hit * step_s[task][v]))
        fastest = min(f["time_s"] for f in found)
        for f in sorted(found, key=lambda f: f["time_s"]):
            out.append(dict(f, factor=f["time_s"] / fastest))
    return out


def equal_compute(rows: list[dict], step_s: dict, reference: str | None = None) -> list[dict]:
    """Per task: held-out loss at equal compute. The compute is the cheapest variant's whole
    run (its last budget × its isolated median step time), or with ``reference`` that
    variant's whole run (tasks without it are left out); each variant affords
    ``steps`` = compute / its step time. Only budgets are measured, so each variant gets the
    budgets around its ``steps``: ``below`` (the largest at or under it) and ``above`` (the
    next); a loss that falls with training puts the variant's loss at equal compute between
    them. No interpolation."""
    out = []
    for task, mine, variants in _timed_rows(rows, step_s):
        cost = {v: max(r["budget"] for r in mine if r["variant"] == v) * step_s[task][v] for v in variants}
        if reference is not None and reference not in cost:
            continue
        limit = cost[reference] if reference is not None else min(cost.values())
        for v in sorted(variants, key=lambda v: step_s[task][v]):
            steps = int(limit / step_s[task][v] * (1 + 1e-9))
            by_budget = sorted((r for r in mine if r["variant"] == v), key=lambda r: r["budget"])
            below = [r for r in by_budget if r["budget"] <= steps]
            above = [r for r in by_budget if r["budget"] > steps]
            exact = bool(below) and below[-1]["budget"] == steps       # a measured budget: nothing to bracket
            out.append(dict(task=task, variant=v, compute_s=limit, step_s=step_s[task][v], steps=steps,
                            below=_bracket(below[-1]) if below else None,
                            above=_bracket(above[0]) if above and not exact else None))
    return out


def _bracket(row: dict) -> dict:
    return dict(budget=row["budget"], n=row["n"], heldout_loss=row["heldout_loss"],
                heldout_loss_std=row["heldout_loss_std"])


def _equal_compute_lines(found: list[dict]) -> list[str]:
    lines = ["| variant | step time (s) | steps in that compute | held-out loss at the budgets around it |",
             "|---|---|---|---|"]
    for f in found:
        around = [f"{b['budget']} steps: {_fmt(b['heldout_loss'], b['heldout_loss_std'], 4)} (n = {b['n']})"
                  for b in (f["below"], f["above"]) if b]
        if f["below"] is None:
            around.insert(0, "none measured below")
        lines.append(f"| {f['variant']} | {f['step_s']:.3f} | {f['steps']} | {' · '.join(around)} |")
    return lines


def _timing_sections(rows: list[dict], step_s: dict, heading) -> list[str]:
    """The time-to-loss and equal-compute tables of every task with a timing."""
    lines = []
    found, equal = time_to_loss(rows, step_s), equal_compute(rows, step_s)
    at_softmax = equal_compute(rows, step_s, reference="softmax")
    for task in _tasks(f["task"] for f in found):
        mine = [f for f in found if f["task"] == task]
        same = [f for f in equal if f["task"] == task]
        title = TASK_TITLES.get(task, task)
        lines += [heading(f"{title}: time to held-out loss {mine[0]['target']:.4f}"), "",
                  "The target is the loss every variant reaches (the largest of their best means); compute time "
                  f"= the first budget at or below it × the median step time of the isolated timing run "
                  f"({TIMING_FILE}: one thread, all variants back to back).", ""]
        lines += _time_to_loss_lines(mine) + [""]
        lines += [heading(f"{title}: held-out loss at equal compute ({same[0]['compute_s']:.0f} s)"), "",
                  "The compute is the cheapest variant's whole run. Each variant affords compute / step time "
                  "steps; only budgets are measured, so the table gives the budgets around that count (a loss "
                  "that falls with training lies between them; no interpolation).", ""]
        lines += _equal_compute_lines(same) + [""]
        theirs = [f for f in at_softmax if f["task"] == task]
        if theirs and theirs[0]["compute_s"] != same[0]["compute_s"]:
            lines += [heading(f"{title}: held-out loss at plain softmax's compute ({theirs[0]['compute_s']:.0f} s)"), "",
                      "The compute is plain softmax's whole run: what the other variants do with the seconds "
                      "softmax trains for (a variant run to fewer steps shows its last budget).", ""]
            lines += _equal_compute_lines(theirs) + [""]
    return lines


def _time_to_loss_lines(found: list[dict]) -> list[str]:
    lines = ["| variant | n | first budget at the target | step time (s) | compute time (s) | × fastest |",
             "|---|---|---|---|---|---|"]
    for f in found:
        lines.append(f"| {f['variant']} | {f['n']} | {f['budget']} | {f['step_s']:.3f} | {f['time_s']:.1f} | "
                     f"{f['factor']:.2f} |")
    return lines


# ------------------------------------------------------------------ the table


def load_cells(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "cells").rglob("*.json"))]


def _mean_std(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
    return mean, std


def summarize(cells: list[dict]) -> list[dict]:
    """One row per (task, variant, lr, budget): mean, std (ddof 1) and n over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        if "error" in c:
            continue
        for row in c["budgets"]:
            groups.setdefault((c["task"], c["variant"], c["lr"], row["budget"]), []).append(row)
    order = {v: i for i, v in enumerate(VARIANTS)}
    rows = []
    for (task, variant, lr, budget), items in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][3], kv[0][2], order.get(kv[0][1], 99))):
        row = dict(task=task, variant=variant, lr=lr, budget=budget, n=len(items))
        for m in METRICS:
            row[m], row[m + "_std"] = _mean_std([float(it[m]) for it in items])
        # Raw-weight held-out loss: cells scored before it existed lack it (n counts those that have it).
        raw = [float(it[RAW]) for it in items if RAW in it]
        row[RAW], row[RAW + "_std"] = _mean_std(raw) if raw else (math.nan, math.nan)
        row[RAW + "_n"] = len(raw)
        rows.append(row)
    return rows


def _fmt(mean: float, std: float, digits: int) -> str:
    if math.isnan(mean):
        return "—"  # not measured at this budget (samples are drawn at the recipe's sample budgets)
    if math.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _tasks(names) -> list[str]:
    """The tasks present, in ``TASKS`` order (digits before canvas)."""
    order = list(TASKS)
    return sorted(set(names), key=lambda t: (order.index(t) if t in order else len(order), t))


def _raw_cell(row: dict) -> str:
    """The raw-weight held-out loss, with its own n when fewer cells than the row's have it."""
    n = row.get(RAW + "_n", 0)
    if not n:
        return "—"
    text = _fmt(row[RAW], row[RAW + "_std"], 4)
    return text if n == row["n"] else f"{text} (n = {n})"


def _table_lines(rows: list[dict]) -> list[str]:
    lines = ["| variant | lr | n | class-consistency ↑ | Fréchet distance ↓ | train loss | held-out loss | "
             "held-out loss, raw weights | train time (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {lr_tag(r['lr'])} | {r['n']} | "
            f"{_fmt(r['class_consistency'], r['class_consistency_std'], 3)} | "
            f"{_fmt(r['frechet_distance'], r['frechet_distance_std'], 2)} | "
            f"{_fmt(r['train_loss'], r['train_loss_std'], 4)} | "
            f"{_fmt(r['heldout_loss'], r['heldout_loss_std'], 4)} | "
            f"{_raw_cell(r)} | "
            f"{_fmt(r['train_time_s'], r['train_time_s_std'], 1)} |")
    return lines


def render_table(rows: list[dict], cells: list[dict], step_s: dict | None = None) -> str:
    lines = ["# Ablation results", "",
             "Mean ± sample std over seeds (n = seeds finished). Class-consistency: share of samples the "
             "digits classifier assigns to their label (higher is better). Fréchet distance: digits-classifier "
             "features vs the held-out split (lower is better; not Inception FID). Losses: the iDDPM hybrid "
             "training objective (training: last 100 steps; held-out: fixed draws). Time: summed training "
             "step time on one thread (load varies, see cells' loadavg).", ""]
    for task in _tasks(r["task"] for r in rows):
        for budget in sorted({r["budget"] for r in rows if r["task"] == task}):
            lines += [f"## {task}, {budget} steps", ""]
            lines += _table_lines([r for r in rows if r["task"] == task and r["budget"] == budget]) + [""]
    lines += _timing_sections(rows, step_s or {}, lambda text: f"## {text}")
    failed = [c for c in cells if "error" in c]
    if failed:
        lines += ["## Failed cells", ""] + [
            f"- {cell_name(c['task'], c['variant'], c['seed'], c['lr'])}: {c['error']}" for c in failed] + [""]
    lines += ["## Variants", ""] + [f"- `{k}`: {DESCRIPTIONS[k]} (`{' '.join(VARIANTS[k])}`)" for k in VARIANTS]
    return "\n".join(lines) + "\n"


TASK_TITLES = {"digits": "Digits (16 tokens)", "canvas": "Canvas (256 tokens)", "canvas64": "Canvas 64 px (1,024 tokens)",
               "canvas128": "Canvas 128 px (4,096 tokens)",
               **{f"ladder{s}_{tag}": f"Canvas {s} px ({(s // 2) ** 2:,} tokens), up the ladder from the 256-token "
                                      f"canvas, {pos} positions"
                  for s in (64, 128) for pos, tag in (("interpolate", "interp"), ("extrapolate", "extrap"))}}
README_START, README_END = "<!-- ablation:start", "<!-- ablation:end -->"


def readme_block(rows: list[dict], cells: list[dict], step_s: dict | None = None) -> str:
    """The README's generated part: what ran (cells, cost, load), one table per task and
    budget, and with a timing the time-to-loss and equal-compute tables."""
    ok = [c for c in cells if "error" not in c]
    lines = [f"{README_START} (generated by `benchmarks/ablation.py table --page docs/ablation.md`) -->"]
    for task in _tasks(c["task"] for c in ok):
        done = [c for c in ok if c["task"] == task]
        loads = [c["loadavg_start"][0] for c in done] + [c["loadavg_end"][0] for c in done]
        budgets = sorted({r["budget"] for c in done for r in c["budgets"]})
        lines += [f"{TASK_TITLES.get(task, task)}: {len(done)} cells, "
                  f"{sum(c['wall_total_s'] for c in done) / 60:.0f} core-minutes of training and scoring "
                  f"(1 thread per cell, 1-minute load average {min(loads):.1f}–{max(loads):.1f}); "
                  f"budgets {', '.join(map(str, budgets))} steps.", ""]
    lines += ["The training-time column is wall time under that varying load: compare throughput "
              "with `benchmarks/model.py` instead.", ""]
    for task in _tasks(r["task"] for r in rows):
        for budget in sorted({r["budget"] for r in rows if r["task"] == task}):
            lines += [f"**{TASK_TITLES.get(task, task)}, {budget} steps**", ""]
            lines += _table_lines([r for r in rows if r["task"] == task and r["budget"] == budget]) + [""]
    if step_s:
        lines += _timing_sections(rows, step_s, lambda text: f"**{text}**")
    return "\n".join(lines + [README_END])


def fill_readme(path: Path, block: str) -> None:
    """Replace the text between the ablation markers of ``path`` with ``block``."""
    if not path.is_file():
        raise SystemExit(f"{path}: no such file; pass --page the page that holds the ablation markers (docs/ablation.md)")
    text = path.read_text()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"{path}: no '{README_START} ... -->' ... '{README_END}' block to fill; "
                         "add the two marker lines where the tables belong")
    tmp = path.with_name(f".tmp{os.getpid()}-{path.name}")  # never a half-written README
    tmp.write_text(text[:start] + block + text[end + len(README_END):])
    os.replace(tmp, path)


def write_table(out: Path, md: Path | None = None, readme: Path | None = None) -> Path:
    """table.json and the markdown table (``md`` or <out>/table.md); with ``readme``, also
    the generated block of that file."""
    cells = load_cells(out)
    rows = summarize(cells)
    step_s = load_timing(out)
    write_json(out / "table.json", dict(rows=rows))
    target = md or out / "table.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_table(rows, cells, step_s))
    if readme:
        fill_readme(readme, readme_block(rows, cells, step_s))
    for task in _tasks(r["task"] for r in rows):
        if "image_size" in TASKS[task]:  # the ladder's sizes: one plot each
            plot_curves(rows, step_s.get(task, {}), task, out / f"curves_{task}.png")
    return target


def plot_curves(rows: list[dict], step_s: dict, task: str, path: Path) -> Path:
    """Held-out loss (mean ± std over seeds, log scale) against steps and against compute
    seconds (budget × the isolated median step time; the right panel is empty without a timing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["task"] == task and r["lr"] == TASKS[task]["lr"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for variant in sorted({r["variant"] for r in mine}, key=list(VARIANTS).index):
        pts = sorted((r["budget"], r["heldout_loss"], r["heldout_loss_std"], r["n"]) for r in mine
                     if r["variant"] == variant)
        steps, loss, std, n = zip(*pts)
        std = [0.0 if math.isnan(s) else s for s in std]
        label = f"{variant} (n={min(n)})"
        axes[0].errorbar(steps, loss, yerr=std, marker="o", capsize=3, label=label)
        if variant in step_s:
            axes[1].errorbar([b * step_s[variant] for b in steps], loss, yerr=std, marker="o", capsize=3, label=label)
    axes[0].set_xlabel("training steps")
    axes[1].set_xlabel("compute seconds (steps × isolated median step time, 1 thread)")
    axes[0].set_ylabel("held-out loss (log scale)")
    axes[0].set_yscale("log")    # the loss falls 10x over the budgets; the late gaps matter
    axes[0].set_title(TASK_TITLES.get(task, task), fontsize=9)
    axes[0].legend(fontsize=8)
    if not step_s:
        axes[1].set_title("no timing.json yet", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ CLI


def cell_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ablation.py cell", description="train and score one cell")
    p.add_argument("--task", choices=list(TASKS), required=True)
    p.add_argument("--variant", choices=list(VARIANTS), required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budgets", type=_csv(int), default=None)
    p.add_argument("--classifier-dir", type=Path, default=None)
    return p


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def _check_names(parser, args, names) -> None:
    for name in names:
        allowed = TASKS if name == "tasks" else VARIANTS
        bad = [x for x in getattr(args, name) if x not in allowed]
        if bad:
            parser.error(f"--{name.replace('_', '-')}: unknown {bad}; choose from {list(allowed)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the grid (skips finished cells), then write the table")
    run.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation")
    run.add_argument("--tasks", type=_csv(str), default=None,
                     help=f"comma list of {list(TASKS)} (default digits; --quick: {','.join(QUICK_TASKS)})")
    run.add_argument("--variants", type=_csv(str), default=None,
                     help=f"comma list, or 'ladder' = {','.join(LADDER_VARIANTS)}, 'remedies' = "
                          f"{','.join(REMEDY_VARIANTS)} (default: all)")
    run.add_argument("--seeds", type=_csv(int), default=[0, 1, 2])
    run.add_argument("--sweep-lrs", type=_csv(float), default=[1e-3, 4e-3],
                     help="extra learning rates run at seed 0 for --sweep-variants")
    run.add_argument("--sweep-variants", type=_csv(str), default=["softmax", "nala"])
    run.add_argument("--core", type=int, default=0,
                     help="run every seed of the first N --variants before the other variants start")
    run.add_argument("--jobs", type=int, default=1, help="cells at once, one thread each (1 = in this process)")
    run.add_argument("--budgets", type=_csv(int), default=None,
                     help="steps at which to score (train to the largest); default the task's")
    run.add_argument("--no-wait", action="store_true",
                     help="return once the last cell has started (a following runner shares the slots)")
    run.add_argument("--md", type=Path, default=None, help="also write the table here (default <out>/table.md)")
    run.add_argument("--classifier-dir", type=Path, default=None,
                     help="digits classifier folder (default <out>/work/digits_classifier, trained if absent)")
    run.add_argument("--quick", action="store_true",
                     help=f"smoke run: variants {QUICK_VARIANTS}, seeds {QUICK_SEEDS}, {QUICK['budgets']} steps, no sweep")
    table = sub.add_parser("table", help="rebuild the table from the cell JSONs")
    table.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation")
    table.add_argument("--md", type=Path, default=None)
    table.add_argument("--page", "--readme", dest="page", type=Path, default=None,  # --readme: its old name
                       help="also replace the tables between the ablation markers of this file (docs/ablation.md)")
    timing = sub.add_parser("timing", help="isolated step times per variant and task (one thread, round robin)")
    timing.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation", help=f"writes <out>/{TIMING_FILE}")
    timing.add_argument("--tasks", type=_csv(str), default=["canvas64", "canvas128"])
    timing.add_argument("--variants", type=_csv(str), default=["ladder"],
                        help="comma list, 'ladder' (default) or 'remedies'")
    timing.add_argument("--rounds", type=int, default=5, help="round-robin passes over the variants")
    timing.add_argument("--steps", type=int, default=2, help="timed steps per variant per pass")
    timing.add_argument("--quick", action="store_true",
                        help=f"smoke run: the quick recipes' batches, {QUICK_TIMING}")
    sub.add_parser("cell", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "cell":
        return cell_main(cell_parser().parse_args(rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in ("run", "timing") and args.variants:
        groups = {"ladder": LADDER_VARIANTS, "remedies": REMEDY_VARIANTS}
        args.variants = [x for v in args.variants for x in groups.get(v, [v])]
    if args.command == "timing":
        _check_names(parser, args, ("tasks", "variants"))
        if args.rounds < 1 or args.steps < 1:
            parser.error(f"--rounds {args.rounds} and --steps {args.steps} must be >= 1")
        return timing_main(args)
    if args.command == "table":
        print(write_table(args.out.resolve(), args.md, args.page).read_text())
        return 0
    if args.quick:
        args.variants = args.variants or list(QUICK_VARIANTS)
        args.tasks = args.tasks or list(QUICK_TASKS)
        args.seeds, args.sweep_lrs = list(QUICK_SEEDS), []
    args.variants = args.variants or list(VARIANTS)
    args.tasks = args.tasks or ["digits"]
    _check_names(parser, args, ("tasks", "variants", "sweep_variants"))
    code = run_main(args)
    print((args.md or args.out.resolve() / "table.md").read_text())
    return code


if __name__ == "__main__":
    sys.exit(main())
