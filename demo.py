"""The whole life of a model on the embedded digits, with no download (``make demo``).

Trains NaLaDiT, NaLaSiT and the softmax DiT of the same (tiny) size on scikit-learn's
8×8 handwritten digits through the same ``train.py`` a user calls, samples a labelled
grid per model with ``sample.py``, scores 30 samples per digit with
``evaluate_fid.py --features digits`` against the held-out digits (plus real training
digits as the ceiling), and writes ``runs/demo/report.md`` / ``report.json`` and a loss
plot. Every number in the report is measured in this run.

    python demo.py            # full demo (about 10 minutes on 2 CPU cores)
    python demo.py --quick    # smoke run (about a minute): same pipeline, tiny budget
"""

from __future__ import annotations

import json
import importlib
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
MODELS = [  # (name, config, sampler, steps)
    ("NaLaDiT", "configs/digits_nala_dit.yaml", "ddpm", 40),
    ("NaLaSiT", "configs/digits_nala_sit.yaml", "ode-heun", 16),
    ("DiT", "configs/digits_dit.yaml", "ddpm", 40),
]
CFG_SCALE = 2.0  # the same guidance for every model


def run(cmd: list[str]) -> None:
    """Run one of the project's CLIs (``train.py``, ``sample.py``, ``evaluate_fid.py``)
    through its ``main(argv)``, exactly as its command line would, in this process (one
    interpreter start instead of fourteen); stop on failure."""
    script, *argv = map(str, cmd)
    print("$ python", script, " ".join(argv), flush=True)
    module = importlib.import_module(Path(script).stem)
    code = module.main(argv)
    if code:
        raise SystemExit(f"{script} failed with exit code {code}")


def write_real_digits(path: Path, per_class: int, seed: int = 0) -> None:
    """Real training digits as an ADM-style .npz: the ceiling any generator can reach."""
    from nala_dit.digits import load_digits_split

    images, labels = load_digits_split("train")
    rng = np.random.default_rng(seed)
    keep = np.concatenate([rng.choice(np.flatnonzero(labels == c), per_class, replace=False) for c in range(10)])
    np.savez(path, arr_0=images[keep][..., None], arr_1=labels[keep])


def loss_curve(run_dir: Path) -> tuple[list[int], list[float]]:
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [r["step"] for r in records], [r["loss"] for r in records]


def plot_losses(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for name, (steps, losses) in curves.items():
        ax.plot(steps, losses, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-process mean)")
    ax.set_yscale("log")
    ax.set_title("Digits demo: training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    from nala_dit.cli import ArgumentParser

    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps, few samples")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "demo")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)  # a demo always starts fresh, so its numbers belong to one run
    out.mkdir(parents=True)
    per_class = 10 if args.quick else 30
    classifier = out / "digits_classifier"

    ref = out / "ref_heldout.npz"
    run(["evaluate_fid.py", "ref", "--dataset", "digits-heldout", "--features", "digits", "--out", ref,
         "--digits-classifier", classifier])

    rows, curves = [], {}
    for name, config, sampler, steps in MODELS:
        train_args = ["train.py", "--config", ROOT / config, "--results-dir", out, "--exp-name", name]
        if args.quick:
            train_args += ["--max-steps", "20", "--ckpt-every", "20", "--log-every", "5"]
        start = time.perf_counter()
        run(train_args)
        train_time = time.perf_counter() - start
        run_dir = out / name
        curves[name] = loss_curve(run_dir)
        log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
        images_per_sec = float(np.median([r["images_per_sec"] for r in log]))
        sample_steps = 10 if args.quick else steps
        run(["sample.py", "--ckpt", run_dir, "--labels", ",".join(map(str, range(10))), "--per-label", "10",
             "--sampler", sampler, "--steps", sample_steps, "--cfg-scale", CFG_SCALE, "--grid", out / f"{name}_grid.png", "--seed", "0"])
        samples = out / f"{name}_samples.npz"
        start = time.perf_counter()
        run(["sample.py", "--ckpt", run_dir, "--num-samples", 10 * per_class, "--sampler", sampler,
             "--steps", sample_steps, "--cfg-scale", CFG_SCALE, "--batch-size", 300, "--out", samples, "--seed", "1"])
        sample_time = time.perf_counter() - start
        metrics_path = out / f"{name}_metrics.json"
        run(["evaluate_fid.py", "calc", "--samples", samples, "--ref", ref, "--features", "digits",
             "--json", metrics_path, "--digits-classifier", classifier])
        metrics = json.loads(metrics_path.read_text())
        sidecar = json.loads(Path(f"{samples}.json").read_text())
        from nala_dit.checkpoint import load_model
        from nala_dit.models import count_params

        model, ckpt = load_model(run_dir)
        rows.append(dict(
            model=name, preset=ckpt.config["model"], params=count_params(model), steps=ckpt.step,
            train_time_s=round(train_time, 1), images_per_sec=round(images_per_sec, 1),
            sampler=sampler, cfg_scale=CFG_SCALE, nfe=sidecar.get("nfe"), sample_time_s=round(sample_time, 1),
            class_consistency=metrics["metrics"]["class_consistency"],
            frechet_distance=metrics["metrics"]["fd_digits"],
            final_loss=curves[name][1][-1],
        ))

    real = out / "real_train_digits.npz"
    write_real_digits(real, per_class)
    run(["evaluate_fid.py", "calc", "--samples", real, "--ref", ref, "--features", "digits",
         "--json", out / "real_metrics.json", "--digits-classifier", classifier])
    real_metrics = json.loads((out / "real_metrics.json").read_text())["metrics"]
    ceiling = dict(model="real digits (train split)", class_consistency=real_metrics["class_consistency"],
                   frechet_distance=real_metrics["fd_digits"])

    plot_losses(curves, out / "loss.png")
    report = dict(quick=args.quick, samples_per_model=10 * per_class, models=rows, ceiling=ceiling,
                  note="Fréchet distance in the digits classifier's feature space; not comparable to Inception FID.")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(render_report(report))
    print((out / "report.md").read_text())
    print(f"report: {out / 'report.md'}\nplot:   {out / 'loss.png'}\ngrids:  {out}/*_grid.png")
    return 0


def render_report(report: dict) -> str:
    lines = [
        "# Digits demo report" + (" (quick smoke run)" if report["quick"] else ""),
        "",
        f"{report['samples_per_model']} samples per model, balanced over the 10 digits, scored against the "
        "held-out digits. Class-consistency = share of samples the digits classifier assigns to their "
        "conditioning label. Fréchet distance is in the classifier's feature space (**not comparable to "
        "Inception FID**).",
        "",
        "| model | preset | params | steps | train time (s) | images/s | sampler | NFE | class-consistency | Fréchet distance |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["models"]:
        lines.append(
            f"| {r['model']} | {r['preset']} | {r['params']:,} | {r['steps']} | {r['train_time_s']} | "
            f"{r['images_per_sec']} | {r['sampler']}, cfg {r['cfg_scale']} | {r['nfe']} | {r['class_consistency']:.3f} | "
            f"{r['frechet_distance']:.3f} |"
        )
    c = report["ceiling"]
    lines.append(f"| {c['model']} | | | | | | | | {c['class_consistency']:.3f} | {c['frechet_distance']:.3f} |")
    by = {r["model"]: r for r in report["models"]}
    if "DiT" in by:
        base = by["DiT"]
        lines += ["", "Compared with the softmax DiT of the same size:"]
        for name in ("NaLaDiT", "NaLaSiT"):
            if name in by:
                r = by[name]
                lines.append(
                    f"- {name}: class-consistency {r['class_consistency']:.3f} vs {base['class_consistency']:.3f}, "
                    f"Fréchet distance {r['frechet_distance']:.3f} vs {base['frechet_distance']:.3f}, "
                    f"training throughput {r['images_per_sec'] / base['images_per_sec']:.2f}× "
                    f"({r['params']:,} vs {base['params']:,} parameters)."
                )
        lines += ["", "One seed per model at one short budget: this measures early training speed, not the "
                  "end result, and cannot tell the NaLa kernel from its layer's extras. The seeded ablation "
                  "(`benchmarks/ablation.py`, README \"Does NaLa help?\") separates them."]
    lines += ["", "![training loss](loss.png)", ""]
    return "\n".join(lines)


def _script() -> int:
    from nala_dit.cli import Interrupted

    try:
        return main()
    except KeyboardInterrupt:  # the CLIs' "rerun the same command" would not hold: the demo starts fresh
        raise Interrupted("nothing is kept (the demo starts fresh every time); run it again") from None


if __name__ == "__main__":
    from nala_dit.cli import run_main

    sys.exit(run_main(_script))
