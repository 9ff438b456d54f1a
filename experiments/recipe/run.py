"""Does the 2025 recipe help at demo scale? Logit-normal times and warm-up + clipping
against DiT/SiT's uniform times, on the embedded digits (docs/training.md, "The 2025 recipe").

Every *cell* is one (model, recipe, seed): one ``train.py`` run of the demo's config
(``configs/digits_nala_{dit,sit}.yaml``: 600 steps, batch 64, lr 2e-3, EMA 0.99) with the
recipe's flags, ``--threads 1``, in its own run folder
``experiments/recipe/work/<model>/<recipe>/seed<k>`` (gitignored). The scores come from
the run's own evaluation at its last step (``--val-every``, ``--fid-every``), so they are the
numbers its ``log.jsonl`` holds:

* held-out loss: the training objective of the EMA (and raw) weights on all 360 held-out
  digits, one fixed (uniform t, noise) draw per digit, the same draws for every cell;
* class-consistency and Fréchet distance in the digits classifier's feature space
  (``evaluate_fid.py``'s metrics) of 300 EMA samples, the demo's sampler and guidance
  (NaLaDiT: DDPM 40 steps, NaLaSiT: Heun 16 steps, guidance 2).

A finished cell leaves ``result.json`` beside its run and is skipped on a rerun; an
interrupted one resumes from its last checkpoint (every 200 steps). The table (mean ± sample
std over the seeds found, n shown) is rebuilt from whatever results exist.

    python experiments/recipe/run.py run                  # all 18 cells, one after another
    python experiments/recipe/run.py run --jobs 2         # two at a time (one thread each)
    python experiments/recipe/run.py run --models NaLaSiT --recipes uniform,logit-normal --seeds 0
    python experiments/recipe/run.py run --models NaLaSiT,SiT,NaLaDiT --recipes uniform,repa --jobs 2   # REPA
    python experiments/recipe/run.py table                # experiments/recipe/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE for the runs it starts, unless set (docs/performance.md, Threads)

HERE = ROOT / "experiments" / "recipe"
WORK = HERE / "work"

# model: (config, sampler, steps, extra flags) as the demo (demo.py MODELS); SiT is the softmax control
MODELS = {
    "NaLaDiT": ("configs/digits_nala_dit.yaml", "ddpm", 40, []),
    "NaLaSiT": ("configs/digits_nala_sit.yaml", "ode-heun", 16, []),
    "SiT": ("configs/digits_nala_sit.yaml", "ode-heun", 16, ["--model", "SiT-T/2"]),
}
ENCODER = "{digits_encoder}"   # replaced by <work>/digits_encoder, trained once (python -m nala_dit.training.repa)
RECIPES = {
    "uniform": [],
    "logit-normal": ["--t-sampling", "logit-normal"],
    "warmup50-clip1": ["--warmup-steps", "50", "--max-grad-norm", "1.0"],
    "repa": ["--repa-encoder", ENCODER],
}
DESCRIPTIONS = {
    "uniform": "DiT/SiT: uniform t, constant lr, no clipping (the demo)",
    "logit-normal": "logit-normal t (mean 0, std 1)",
    "warmup50-clip1": "uniform t, 50-step linear warm-up, gradient clipping at 1.0",
    "repa": "the demo's recipe plus representation alignment to the repo's label-free digits encoder "
            "(block 1 of 4, λ 0.5, projector 2048: the T preset's defaults)",
}
SEEDS = (0, 1, 2)
STEPS = 600            # the demo's, equal for every cell
CFG_SCALE = 2.0        # demo.py
SAMPLES = 300          # demo.py: 30 per digit
HELDOUT = 360          # every held-out digit
METRICS = (  # (log key, table title, digits)
    ("val/ema_loss", "held-out loss (EMA)", 4),
    ("val/loss", "held-out loss (raw)", 4),
    ("fid/class_consistency", "class-consistency", 3),
    ("fid/fd_digits", "Fréchet distance", 2),
)


def cell_dir(model: str, recipe: str, seed: int, work: Path = WORK) -> Path:
    return work / model / recipe / f"seed{seed}"


def python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.is_file() else sys.executable


def reference(work: Path) -> tuple[Path, Path]:
    """(reference .npz of the held-out digits, digits classifier folder), made once."""
    classifier, ref = work / "digits_classifier", work / "ref_heldout.npz"
    if not ref.is_file():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run([python(), str(ROOT / "evaluate_fid.py"), "ref", "--dataset", "digits-heldout", "--features",
                        "digits", "--out", str(ref), "--digits-classifier", str(classifier), "--threads", "1"],
                       check=True, cwd=ROOT)
    encoder = work / "digits_encoder"
    if not (encoder / "encoder.json").is_file():   # the repa recipe's encoder: label-free, deterministic
        subprocess.run([python(), "-m", "nala_dit.training.repa", str(encoder)], check=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    return ref, classifier


def train_argv(model: str, recipe: str, seed: int, ref: Path, classifier: Path, work: Path = WORK,
               steps_: int = STEPS, samples: int = SAMPLES) -> list[str]:
    config, sampler, steps, extra = MODELS[model]
    folder = cell_dir(model, recipe, seed, work)
    flags = [str(work / "digits_encoder") if flag == ENCODER else flag for flag in RECIPES[recipe]]
    return [python(), str(ROOT / "train.py"), "--config", str(ROOT / config), *extra, *flags,
            "--seed", str(seed), "--threads", "1", "--max-steps", str(steps_), "--ckpt-every", str(max(1, steps_ // 3)),
            "--keep-last", "1", "--val-every", str(100 if steps_ % 100 == 0 else steps_), "--val-samples", str(HELDOUT),
            "--fid-every", str(steps_), "--fid-ref", str(ref), "--fid-samples", str(samples),
            "--digits-classifier", str(classifier), "--sample-sampler", sampler, "--sample-steps", str(steps),
            "--sample-cfg-scale", str(CFG_SCALE), "--report-to", "none",
            "--results-dir", str(folder.parent), "--exp-name", folder.name, "--resume", "auto"]


def run_cell(model: str, recipe: str, seed: int, ref: Path, classifier: Path, work: Path = WORK,
             steps_: int = STEPS, samples: int = SAMPLES) -> str:
    """Train (or resume) one cell and write its ``result.json``; a finished cell is skipped."""
    folder = cell_dir(model, recipe, seed, work)
    argv = train_argv(model, recipe, seed, ref, classifier, work, steps_, samples)
    result = folder / "result.json"
    if result.is_file():
        return f"{model}/{recipe}/seed{seed}: done before"
    folder.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(folder.parent / f"seed{seed}.out", "a") as out:
        proc = subprocess.run(argv, cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        return f"{model}/{recipe}/seed{seed}: train.py failed ({proc.returncode}), see {folder.parent}/seed{seed}.out"
    records = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    last = records[-1]
    missing = [key for key, _, _ in METRICS if key not in last]
    if last["step"] != steps_ or missing:
        return f"{model}/{recipe}/seed{seed}: the step-{last['step']} record lacks {missing}; not scored"
    scores = {key: last[key] for key, _, _ in METRICS}
    tail = [r["loss"] for r in records if r["step"] > steps_ - 100 and r.get("loss") is not None]
    data = dict(model=model, recipe=recipe, seed=seed, steps=steps_, scores=scores,
                train_loss_last100=sum(tail) / len(tail), wall_s=round(time.perf_counter() - start, 1),
                command=" ".join(str(a) for a in argv[1:]))
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, result)
    return f"{model}/{recipe}/seed{seed}: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items())


def mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else float("nan")
    return mean, std


def table(work: Path = WORK) -> str:
    results = [json.loads(p.read_text()) for p in sorted(work.glob("*/*/seed*/result.json"))]
    steps = sorted({r["steps"] for r in results})
    lines = [f"# Recipe study: digits, {'/'.join(map(str, steps)) or STEPS} steps, the demo's recipe otherwise", "",
             "Written by `python experiments/recipe/run.py table` from the cells in "
             "`experiments/recipe/work/` (mean ± sample std over seeds; n = seeds found). "
             "Held-out loss: 360 held-out digits, one fixed uniform (t, noise) per digit. Class-consistency and "
             "Fréchet distance: 300 EMA samples, the digits classifier (not comparable to Inception FID). "
             "The training loss is over each recipe's own t distribution: compare it within a recipe only.", "",
             "| model | recipe | n | " + " | ".join(title for _, title, _ in METRICS) + " | training loss (last 100) |",
             "|---|---|---|" + "---|" * (len(METRICS) + 1)]
    for model in MODELS:
        for recipe in RECIPES:
            found = [r for r in results if r["model"] == model and r["recipe"] == recipe]
            if not found:
                continue
            cells = []
            for key, _, digits in METRICS:
                mean, std = mean_std([r["scores"][key] for r in found])
                cells.append(f"{mean:.{digits}f} ± {std:.{digits}f}" if len(found) > 1 else f"{mean:.{digits}f}")
            mean, std = mean_std([r["train_loss_last100"] for r in found])
            cells.append(f"{mean:.4f} ± {std:.4f}" if len(found) > 1 else f"{mean:.4f}")
            lines.append(f"| {model} | {recipe} | {len(found)} | " + " | ".join(cells) + " |")
    lines += ["", *(f"- `{name}`: {text}" for name, text in DESCRIPTIONS.items()), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train and score the missing cells, then write the table")
    run.add_argument("--models", default="NaLaDiT,NaLaSiT", help=f"comma-separated, of {', '.join(MODELS)}")
    run.add_argument("--recipes", default="uniform,logit-normal,warmup50-clip1",
                     help=f"comma-separated, of {', '.join(RECIPES)}")
    run.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    run.add_argument("--jobs", type=int, default=1, help="cells at a time (each one thread)")
    run.add_argument("--quick", action="store_true", help="smoke test: 20 steps, 20 samples, into --work")
    for p in (run, sub.add_parser("table", help="write RESULTS.md beside --work's cells")):
        p.add_argument("--work", type=Path, default=WORK, help="cells' folder (default experiments/recipe/work)")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    out = HERE / "RESULTS.md" if work == WORK.resolve() else work / "RESULTS.md"
    if args.command == "run":
        models, recipes = args.models.split(","), args.recipes.split(",")
        bad = [m for m in models if m not in MODELS] + [r for r in recipes if r not in RECIPES]
        if bad:
            parser.error(f"unknown model or recipe {bad[0]!r}; models: {', '.join(MODELS)}; "
                         f"recipes: {', '.join(RECIPES)}")
        cells = [(m, r, int(s)) for m in models for r in recipes for s in args.seeds.split(",")]
        ref, classifier = reference(work)
        steps, samples = (20, 20) if args.quick else (STEPS, SAMPLES)
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for line in pool.map(lambda cell: run_cell(*cell, ref, classifier, work, steps, samples), cells):
                print(line, flush=True)
    out.write_text(table(work))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
