"""Does one-step MeanFlow work with linear attention? NaLaSiT-T and SiT-T trained with MeanFlow
(arXiv 2505.13447; ``nala_dit/diffusion/meanflow.py``) on the embedded digits, sampled in 1
and 2 steps, against the same models' 16-step transport sampler and against the demo's
multi-step models (the recipe study's ``uniform`` cells, experiments/recipe/).

Every *cell* is one (model, seed): one ``train.py`` run of the demo's NaLaSiT config
(``configs/digits_nala_sit.yaml``: 600 steps, batch 64, lr 2e-3, EMA 0.99; ``--model SiT-T/2``
for the softmax control) with ``--mean-flow`` and guidance folded into the target at the
demo's scale (ω = 1, κ = 0.5: effective scale ω/(1 − κ) = 2, the demo's ``--cfg-scale 2``;
the paper's B/2 setting), ``--threads 1``, in ``experiments/meanflow/work/<model>/seed<k>``
(gitignored). Its last EMA weights are then scored three ways, each on 300 samples (30 per
digit, ``evaluate_fid.py gen``'s balanced labels, seed 0) with the digits classifier against
all 360 held-out digits, guidance 1 (it is in the weights):

* ``meanflow`` 1 step (1 NFE) and 2 steps (2 NFE);
* ``ode-heun`` 16 steps (31 NFE) of the same network's instantaneous velocity u(z, t, t).

The multi-step baselines are the recipe study's ``uniform`` cells of the same models (same
config, seeds, held-out draws, deterministic digits classifier and reference; Heun 16 steps,
guidance 2: 62 NFE), read from ``experiments/recipe/cells.json``.

A finished cell leaves ``result.json`` beside its run and is skipped on a rerun; an
interrupted one resumes from its last checkpoint (every 200 steps), and a scored sampler is
kept. ``collect`` writes ``cells.json`` (every cell's scores and commands) and ``RESULTS.md``.

    python experiments/meanflow/run.py run --jobs 2       # 6 cells, two at a time (one thread each)
    python experiments/meanflow/run.py run --models NaLaSiT --seeds 0
    python experiments/meanflow/run.py collect            # cells.json and RESULTS.md
    python experiments/meanflow/run.py run --quick --work /tmp/mf   # smoke test: 20 steps, 20 samples
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE for the runs it starts, unless set (docs/performance.md, Threads)
_spec = importlib.util.spec_from_file_location("recipe_study", ROOT / "experiments" / "recipe" / "run.py")
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)   # its reference(), python(), mean_std(), train_argv() and constants

WORK = HERE / "work"
MODELS = {"NaLaSiT": [], "SiT": ["--model", "SiT-T/2"]}
MEANFLOW = ["--mean-flow", "--mf-cfg-omega", "1.0", "--mf-cfg-kappa", "0.5"]   # effective guidance 2 (module doc)
SAMPLERS = {  # name: (sampler, steps, NFE)
    "1-NFE": ("meanflow", 1, 1),
    "2-NFE": ("meanflow", 2, 2),
    "heun-16": ("ode-heun", 16, 31),
}
METRICS = (("class_consistency", "class-consistency", 3), ("fd_digits", "Fréchet distance", 2))
SEEDS = (0, 1, 2)


def reference(work: Path) -> tuple[Path, Path]:
    """(reference .npz of the held-out digits, digits classifier folder), made once as the recipe study's."""
    classifier, ref = work / "digits_classifier", work / "ref_heldout.npz"
    if not ref.is_file():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run([recipe.python(), str(ROOT / "evaluate_fid.py"), "ref", "--dataset", "digits-heldout",
                        "--features", "digits", "--out", str(ref), "--digits-classifier", str(classifier),
                        "--threads", "1"], check=True, cwd=ROOT)
    return ref, classifier


def train_argv(model: str, seed: int, ref: Path, classifier: Path, work: Path, steps: int, samples: int) -> list[str]:
    """The recipe study's command for this model, plus MeanFlow, scored in-run at 1 NFE."""
    argv = recipe.train_argv("NaLaSiT", "uniform", seed, ref, classifier, work, steps, samples)
    folder = work / model / f"seed{seed}"
    at = {flag: i for i, flag in enumerate(argv)}
    argv[at["--sample-sampler"] + 1], argv[at["--sample-steps"] + 1] = "meanflow", "1"
    argv[at["--sample-cfg-scale"] + 1] = "1.0"
    argv[at["--results-dir"] + 1], argv[at["--exp-name"] + 1] = str(folder.parent), folder.name
    return argv[:2] + MODELS[model] + MEANFLOW + argv[2:]


def score(folder: Path, name: str, ref: Path, classifier: Path, samples: int) -> dict:
    """One sampler's scores of the run's last EMA weights (kept in ``scores/<name>.json``)."""
    sampler, steps, _ = SAMPLERS[name]
    out = folder / "scores" / f"{name}.json"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part.json")
        tmp.unlink(missing_ok=True)   # our own partial file from an interrupted scoring
        subprocess.run([recipe.python(), str(ROOT / "evaluate_fid.py"), "gen", "--ckpt", str(folder), "--ref", str(ref),
                        "--num-samples", str(samples), "--seed", "0", "--sampler", sampler, "--steps", str(steps),
                        "--cfg-scale", "1", "--features", "digits", "--digits-classifier", str(classifier),
                        "--threads", "1", "--json", str(tmp)],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
        os.replace(tmp, out)
    return json.loads(out.read_text())["metrics"]


def run_cell(model: str, seed: int, ref: Path, classifier: Path, work: Path, steps: int, samples: int) -> str:
    folder = work / model / f"seed{seed}"
    result = folder / "result.json"
    if result.is_file():
        return f"{model}/seed{seed}: done before"
    argv = train_argv(model, seed, ref, classifier, work, steps, samples)
    folder.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(folder.parent / f"seed{seed}.out", "a") as out:
        proc = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        return f"{model}/seed{seed}: train.py failed ({proc.returncode}), see {folder.parent}/seed{seed}.out"
    train_s = time.perf_counter() - start
    records = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    if records[-1]["step"] != steps:
        return f"{model}/seed{seed}: the last record is step {records[-1]['step']}, not {steps}; not scored"
    scores = {name: {key: score(folder, name, ref, classifier, samples)[key] for key, _, _ in METRICS}
              for name in SAMPLERS}
    in_run = {key: records[-1][key] for key in ("val/ema_loss", "val/loss", "fid/class_consistency", "fid/fd_digits")
                if key in records[-1]}   # the run's own last evaluation (its FID: 1 NFE, the same samples' seed 0)
    data = dict(model=model, seed=seed, steps=steps, samples=samples, scores=scores, in_run=in_run,
                train_s=round(train_s, 1), command=" ".join(str(a) for a in argv[1:]))
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, result)
    return f"{model}/seed{seed}: " + ", ".join(f"{n} cc {s['class_consistency']:.3f}" for n, s in scores.items())


def cell(values: list[float], digits: int) -> str:
    mean, std = recipe.mean_std(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def table(results: list[dict], baselines: list[dict]) -> str:
    lines = ["# MeanFlow on the digits: one- and two-step samples of NaLaSiT-T and SiT-T", "",
             "Written by `python experiments/meanflow/run.py collect` (mean ± sample std over seeds; n = seeds). "
             "300 EMA samples per row, the digits classifier against the 360 held-out digits (not comparable to "
             "Inception FID). MeanFlow rows: 600 steps with guidance 2 folded into the target, sampled at guidance 1. "
             "Multi-step rows: the recipe study's `uniform` cells (experiments/recipe/cells.json), the same 600 "
             "steps, sampled with guidance 2 (two network calls per evaluation).", "",
             "| model | training | sampler | NFE | n | " + " | ".join(t for _, t, _ in METRICS) + " |",
             "|---|---|---|---|---|" + "---|" * len(METRICS)]
    for model in MODELS:
        found = [r for r in results if r["model"] == model]
        for name, (sampler, steps, nfe) in SAMPLERS.items():
            if found:
                cells = [cell([r["scores"][name][key] for r in found], d) for key, _, d in METRICS]
                lines.append(f"| {model}-T/2 | MeanFlow | {sampler} {steps} | {nfe} | {len(found)} | "
                             + " | ".join(cells) + " |")
        base = [b for b in baselines if b["model"] == model and b["recipe"] == "uniform"]
        if base:
            cells = [cell([b["scores"][f"fid/{key}"] for b in base], d) for key, _, d in METRICS]
            lines.append(f"| {model}-T/2 | transport (demo) | ode-heun 16 | 62 | {len(base)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def collect(work: Path, out_dir: Path) -> Path:
    results = [json.loads(p.read_text()) for p in sorted(work.glob("*/seed*/result.json"))]
    for r in results:
        r["command"] = r["command"].replace(str(ROOT) + "/", "")
    (out_dir / "cells.json").write_text(json.dumps(results, indent=1) + "\n")
    baselines = json.loads((ROOT / "experiments" / "recipe" / "cells.json").read_text())
    page = out_dir / "RESULTS.md"
    page.write_text(table(results, baselines))
    return page


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train and score the missing cells, then collect")
    run.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    run.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    run.add_argument("--jobs", type=int, default=1, help="cells at a time (each one thread)")
    run.add_argument("--quick", action="store_true", help="smoke test: 20 steps, 20 samples (use with --work)")
    for p in (run, sub.add_parser("collect", help="write cells.json and RESULTS.md from --work's cells")):
        p.add_argument("--work", type=Path, default=WORK, help="cells' folder (default experiments/meanflow/work)")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    out_dir = HERE if work == WORK.resolve() else work
    if args.command == "run":
        models, seeds = args.models.split(","), args.seeds.split(",")
        if any(m not in MODELS for m in models):
            parser.error(f"unknown model in {args.models!r}; models: {', '.join(MODELS)}")
        if not all(s.isdigit() for s in seeds):
            parser.error(f"--seeds takes comma-separated non-negative integers, got {args.seeds!r}")
        ref, classifier = reference(work)
        steps, samples = (20, 20) if args.quick else (recipe.STEPS, recipe.SAMPLES)
        cells = [(m, int(s)) for m in models for s in seeds]
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for line in pool.map(lambda c: run_cell(*c, ref, classifier, work, steps, samples), cells):
                print(line, flush=True)
    print(f"wrote {collect(work, out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
