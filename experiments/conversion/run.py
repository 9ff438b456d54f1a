"""Does a linearised softmax DiT beat NaLaDiT trained from scratch at equal steps? (digits)

Trains one softmax DiT-T/2 teacher on the embedded digits, then NaLaDiT-T/2 students for
each seed, all with the same recipe, data order and number of steps:

* ``scratch``  : NaLaDiT-T/2 from its own init (``configs/digits_nala_dit.yaml``);
* ``inherit``  : every teacher weight but the attention's (``--init-from``, LiT's recipe);
* ``distill``  : ``inherit`` + LiT's distillation terms (``--teacher``, 0.5 ε + 0.05 Σ),
  i.e. ``configs/digits_nala_dit_from_dit.yaml``;
* ``qkv-distill``: ``distill`` with ``--inherit attention-qkv`` (softmax q, k, v and
  output projection too; LiT found loading them slightly worse).

Each student's EMA checkpoints at 25 %, 50 % and 100 % of its steps are scored with
``evaluate_fid.py gen --features digits`` (class-consistency and Fréchet distance in the
digits classifier's feature space, 30 samples per digit against the 360 held-out digits,
DDIM 25 steps, guidance 2). Everything goes through the CLIs' ``main()`` in this process
with one torch thread. Rerunning resumes: finished runs and scores are kept, an
interrupted run continues from its last checkpoint.

    python experiments/conversion/run.py                      # the README table (32 core-minutes measured)
    python experiments/conversion/run.py --quick --out /tmp/c # smoke run of the same pipeline
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)
VARIANTS = ("scratch", "inherit", "distill", "qkv-distill")
FRACTIONS = (0.25, 0.5, 1.0)


def cli(script: str, *argv) -> None:
    """Run one of the project's CLIs through its ``main(argv)``; stop on failure."""
    argv = [str(a) for a in argv]
    print("$ python", script, " ".join(argv), flush=True)
    code = importlib.import_module(Path(script).stem).main(argv)
    if code:
        raise SystemExit(f"{script} failed with exit code {code}")


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def train_run(out: Path, name: str, steps: int, ckpt_every: int, *flags) -> Path:
    """Train (or finish) ``out/name``; a complete run is left alone."""
    from nala_dit.training.checkpoint import list_checkpoints

    done = list_checkpoints(out / name / "checkpoints")
    if done and int(done[-1].name) >= steps:
        return out / name
    resume = ["--resume", "auto"] if done else []
    cli("train.py", *flags, "--results-dir", out, "--exp-name", name, "--max-steps", steps,
        "--ckpt-every", ckpt_every, "--keep-last", 0, "--log-every", max(1, ckpt_every // 2), *resume)
    return out / name


def score(ckpt: Path, dest: Path, args, ref: Path, classifier: Path) -> dict:
    if not dest.is_file():
        cli("evaluate_fid.py", "gen", "--ckpt", ckpt, "--ref", ref, "--features", "digits",
            "--digits-classifier", classifier, "--num-samples", 10 * args.per_class, "--seed", 1,
            "--sampler", "ddim", "--steps", args.sample_steps, "--cfg-scale", args.cfg_scale,
            "--device", "cpu", "--json", dest)
    m = json.loads(dest.read_text())["metrics"]
    return dict(class_consistency=m["class_consistency"], frechet_distance=m["fd_digits"])


def mean_std(values: list[float]) -> tuple[float, float]:
    import numpy as np

    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def render(report: dict) -> str:
    lines = [f"Teacher DiT-T/2, {report['teacher_steps']} steps: class-consistency "
             f"{report['teacher']['class_consistency']:.3f}, Fréchet distance {report['teacher']['frechet_distance']:.2f}",
             "", "| student steps | variant | class-consistency | Fréchet distance |", "|---|---|---|---|"]
    for row in report["table"]:
        cc, fd = row["class_consistency"], row["frechet_distance"]
        lines.append(f"| {row['steps']} | {row['variant']} | {cc[0]:.3f} ± {cc[1]:.3f} | {fd[0]:.2f} ± {fd[1]:.2f} |")
    lines += ["", f"mean ± standard deviation over seeds {report['seeds']}; "
              f"{report['samples_per_model']} samples per score; CPU time {report['cpu_minutes']:.1f} core-minutes, "
              f"wall {report['wall_minutes']:.1f} minutes."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "convert_digits")
    p.add_argument("--teacher-steps", type=int, default=1500)
    p.add_argument("--student-steps", type=int, default=400, help="divisible by 4 (scored at 25/50/100 %%)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--per-class", type=int, default=30, help="samples per digit for each score")
    p.add_argument("--sample-steps", type=int, default=25)
    p.add_argument("--cfg-scale", type=float, default=2.0)
    p.add_argument("--quick", action="store_true", help="tiny budget: checks the pipeline, numbers mean nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.teacher_steps, args.student_steps, args.seeds, args.per_class, args.sample_steps = 8, 4, "0,1", 3, 4
    if args.student_steps % 4:
        p.error("--student-steps must be divisible by 4")
    import torch

    torch.set_num_threads(1)
    os.chdir(ROOT)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    start_wall, start_cpu = time.perf_counter(), cpu_seconds()
    timing_file = out / "timing.json"
    spent = json.loads(timing_file.read_text()) if timing_file.is_file() else dict(cpu_s=0.0, wall_s=0.0)

    classifier, ref = out / "digits_classifier", out / "ref_heldout.npz"
    if not ref.is_file():
        cli("evaluate_fid.py", "ref", "--dataset", "digits-heldout", "--features", "digits", "--out", ref,
            "--digits-classifier", classifier)

    teacher = train_run(out, "teacher", args.teacher_steps, args.teacher_steps,
                        "--config", "configs/digits_dit.yaml", "--seed", 0)
    teacher_score = score(teacher, out / "scores" / "teacher.json", args, ref, classifier)

    s = args.student_steps
    flags = {
        "scratch": ["--config", "configs/digits_nala_dit.yaml"],
        "inherit": ["--config", "configs/digits_nala_dit_from_dit.yaml", "--init-from", teacher, "--teacher", "none"],
        "distill": ["--config", "configs/digits_nala_dit_from_dit.yaml", "--init-from", teacher, "--teacher", teacher],
        "qkv-distill": ["--config", "configs/digits_nala_dit_from_dit.yaml", "--init-from", teacher, "--teacher", teacher,
                        "--inherit", "attention-qkv"],
    }
    results = {}
    for seed in seeds:
        for variant in VARIANTS:
            name = f"{variant}-s{seed}"
            run = train_run(out, name, s, s // 4, *flags[variant], "--seed", seed)
            for frac in FRACTIONS:
                step = int(s * frac)
                results[(variant, step, seed)] = score(run / "checkpoints" / f"{step:07d}",
                                                       out / "scores" / f"{name}-{step}.json", args, ref, classifier)
            spent_now = dict(cpu_s=spent["cpu_s"] + cpu_seconds() - start_cpu,
                             wall_s=spent["wall_s"] + time.perf_counter() - start_wall)
            timing_file.write_text(json.dumps(spent_now))

    table = []
    for frac in FRACTIONS:
        for variant in VARIANTS:
            step = int(s * frac)
            rows = [results[(variant, step, seed)] for seed in seeds]
            table.append(dict(steps=step, variant=variant,
                              class_consistency=mean_std([r["class_consistency"] for r in rows]),
                              frechet_distance=mean_std([r["frechet_distance"] for r in rows]),
                              per_seed=rows))
    spent_now = json.loads(timing_file.read_text())
    report = dict(quick=args.quick, teacher_steps=args.teacher_steps, student_steps=s, seeds=seeds,
                  samples_per_model=10 * args.per_class, sampler=f"ddim {args.sample_steps} steps, cfg {args.cfg_scale}",
                  teacher=teacher_score, table=table, cpu_minutes=spent_now["cpu_s"] / 60,
                  wall_minutes=spent_now["wall_s"] / 60,
                  note="Fréchet distance in the digits classifier's feature space; not comparable to Inception FID.")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
