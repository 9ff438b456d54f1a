"""The whole life of a model on the embedded digits, with no download (``make demo``).

Trains NaLaDiT, NaLaSiT and the softmax DiT of the same (tiny) size on scikit-learn's
8×8 handwritten digits through the same ``train.py`` a user calls, samples a labelled
grid per model with ``sample.py``, scores 30 samples per digit with
``evaluate_fid.py --features digits`` against the held-out digits (plus real training
digits as the ceiling), and writes ``<out>/report.md`` / ``report.json`` and a loss
plot. Then up the ladder: the NaLaDiT sampled directly at 16 px, and fine-tuned there
(``train.py --init-from <out>/NaLaDiT --image-size 16 --pos-embed interpolate``, the digits
upscaled 2x, 4x the tokens) into ``<out>/NaLaDiT-16``, both scored like the rest. Every
number in the report is measured in this run. The trained runs (``<out>/NaLaDiT``,
``<out>/NaLaSiT``, ``<out>/DiT``, ``<out>/NaLaDiT-16``) are ordinary run folders: the last
lines printed are ``sample.py`` / ``export.py`` commands for them and the ``app.py`` line that
opens the NaLaDiT in a web page, starting with the python that ran the demo
(``.venv/bin/python`` under ``make demo``) and carrying its ``--threads``.

    python demo.py                # full demo into runs/demo (7-8 min on 2 CPU cores little else needs: docs/demo.md)
    python demo.py --quick        # smoke run into runs/demo-quick (about 20 s): same pipeline, tiny budget (QUICK)
    python demo.py --threads 1    # on a shared or loaded machine (as every CLI's --threads)

Nothing is deleted: a previous demo in --out is moved aside to ``<out>.old-<time>``
before the run starts (delete those folders yourself when done); a folder that holds
anything else is refused, naming --out. Measured times, with the load they were measured
at: docs/demo.md, "How long".
"""

from __future__ import annotations

import json
import importlib
import sys
import time
from pathlib import Path

from nala_dit.cli.requirements import require_installed

require_installed()  # a python without torch (not the .venv one): one line naming .venv, not a traceback

from nala_dit.cli.parse import passive_wait_policy

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent
MODELS = [  # (name, config, sampler, steps)
    ("NaLaDiT", "configs/digits_nala_dit.yaml", "ddpm", 40),
    ("NaLaSiT", "configs/digits_nala_sit.yaml", "ode-heun", 16),
    ("DiT", "configs/digits_dit.yaml", "ddpm", 40),
]
CFG_SCALE = 2.0  # the same guidance for every model
# Up the ladder: the 8-px NaLaDiT fine-tuned at 16 px (--data digits --image-size 16, 4x the
# tokens) from its weights, positions interpolated; (source, side, steps, batch, lr). A 16-px
# step of batch 32 took 3.4x an 8-px step of batch 64 (NaLaDiT-T/2, CPU, docs/demo.md), so
# 100 steps cost about half of the model's 600-step training; --quick: 5 steps.
LADDER = ("NaLaDiT", 16, 100, 32, 1e-3)
# Samples per ladder row (a 16-px sample costs about 3.5 8-px ones) and grid columns; --quick: 20, 2.
LADDER_SAMPLES, LADDER_GRID = 100, 4
# --quick: the same pipeline at the least budget that runs every step: training steps per model
# (and its log interval), sampler steps (every model, the ladder and the printed next steps),
# scored samples per digit, the ladder's fine-tune steps, samples per row and grid columns.
QUICK = dict(train_steps=5, log_every=1, sample_steps=5, per_class=5, ladder_steps=5, ladder_samples=20,
             ladder_grid=2)


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


# Written first into every demo folder: a later demo knows the folder is a demo's to move aside.
DEMO_MARK = ".nala_dit_demo"


def is_demo_output(path: Path) -> bool:
    """A folder a demo wrote: its mark, or (older demos, before the mark) its report or
    held-out reference, the first file a demo writes."""
    return any((path / name).exists() for name in (DEMO_MARK, "report.json", "ref_heldout.npz"))


def prepare_out(out: Path) -> Path | None:
    """Make ``out`` an empty folder for a fresh demo without deleting anything. A previous
    demo there is renamed to ``<out>.old-<YYYYmmdd-HHMMSS>`` (returned); a missing or empty
    folder is used as is; a file, or a folder holding anything else, is refused."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file, not a folder; nothing was changed. "
                         "Pass --out a new or empty folder")
    aside = None
    if out.is_dir() and any(out.iterdir()):
        if not is_demo_output(out):
            raise SystemExit(f"error: --out {out} holds files that are not a demo's output; nothing was "
                             "changed. Pass --out a new or empty folder")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = out.with_name(f"{out.name}.old-{stamp}")
        for n in range(1, 1000):  # two demos within one second
            if not aside.exists():
                break
            aside = out.with_name(f"{out.name}.old-{stamp}-{n}")
        out.rename(aside)
        print(f"moved the previous demo {out} aside to {aside} (delete it when you no longer need it)")
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARK).write_text(json.dumps(dict(started=time.time(), argv=sys.argv)) + "\n")
    return aside


def write_real_digits(path: Path, per_class: int, seed: int = 0) -> None:
    """Real training digits as an ADM-style .npz: the ceiling any generator can reach."""
    from nala_dit.data.digits import load_digits_split

    images, labels = load_digits_split("train")
    rng = np.random.default_rng(seed)
    keep = np.concatenate([rng.choice(np.flatnonzero(labels == c), per_class, replace=False) for c in range(10)])
    np.savez(path, arr_0=images[keep][..., None], arr_1=labels[keep])


# A digit in the report's grids, and in the grids the printed next steps write, is drawn
# this many pixels wide (8-px digits at their own size: 102 × 102 px for 10 × 10, too small
# to judge a digit at screen resolution).
REPORT_DIGIT_PX = 32


def grid_scale(side: int) -> int:
    """The enlargement that draws a ``side``-px digit ``REPORT_DIGIT_PX`` wide (nearest
    neighbour: ``enlarge_grid``, ``sample.py --grid-scale``)."""
    return max(1, REPORT_DIGIT_PX // side)


def enlarge_grid(grid: Path, side: int) -> tuple[Path, tuple[int, int]]:
    """``<name>_grid.png`` of ``side``-px samples → ``<name>_grid_x<k>.png``, each pixel a
    k × k block (nearest neighbour: no blur added to what the model drew), k so that a digit
    is ``REPORT_DIGIT_PX`` wide. Returns the file and its (width, height)."""
    from PIL import Image

    k = grid_scale(side)
    with Image.open(grid) as img:
        big = img.resize((img.width * k, img.height * k), Image.NEAREST)
    path = grid.with_name(f"{grid.stem}_x{k}.png")
    big.save(path)
    return path, big.size


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
    from nala_dit.cli.parse import THREADS_HELP, ArgumentParser
    from nala_dit.runlock import LockedError, RunLock

    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps, few samples")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default runs/demo, with --quick runs/demo-quick); a previous "
                             "demo there is moved aside to <out>.old-<time>, never deleted")
    parser.add_argument("--threads", type=int, help=THREADS_HELP + "; passed to every step of the demo")
    parser.add_argument("--digits-classifier", type=Path, default=None,
                        help="folder of the digits classifier that scores the samples (default "
                             "<out>/digits_classifier, trained there; its training is deterministic, so one "
                             "folder serves every demo)")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    out = (args.out or ROOT / "runs" / ("demo-quick" if args.quick else "demo")).resolve()
    # One demo per folder at a time: a second one would move the first one's files away.
    lock = RunLock(out.with_name(f"{out.name}.lock"), f"demo folder {out}", "pass another --out")
    try:
        lock.acquire()
    except LockedError as err:
        raise SystemExit(f"error: {err}") from None
    try:
        prepare_out(out)
        run_demo(out, args.quick, [] if args.threads is None else ["--threads", args.threads],
                 args.digits_classifier and args.digits_classifier.resolve())
    finally:
        lock.release()
    return 0


def run_demo(out: Path, quick: bool, threads: list, classifier: Path | None = None) -> None:
    """Every step of the demo into the empty folder ``out``; ``threads`` goes to every CLI;
    the samples scored by the digits classifier in ``classifier`` (default: trained into
    ``<out>/digits_classifier``)."""
    per_class = QUICK["per_class"] if quick else 30
    classifier = classifier or out / "digits_classifier"

    ref = out / "ref_heldout.npz"
    run(["evaluate_fid.py", "ref", "--dataset", "digits-heldout", "--features", "digits", "--out", ref,
         "--digits-classifier", classifier, *threads])

    def sample_and_score(name: str, run_dir: Path, sampler: str, steps: int, size: list,
                         per_label: int = 10, num: int = 10 * per_class) -> tuple[dict, dict, float]:
        """A grid ``<name>_grid.png`` (per_label of each digit), then ``num`` samples scored
        against the held-out digits (a 16-px sample is area-averaged to 8 × 8 by the scorer):
        (metrics, the samples' sidecar, sampling seconds)."""
        run(["sample.py", "--ckpt", run_dir, "--labels", ",".join(map(str, range(10))), "--per-label", per_label,
             "--sampler", sampler, "--steps", steps, "--cfg-scale", CFG_SCALE, "--grid", out / f"{name}_grid.png",
             "--seed", "0", *size, *threads])
        samples = out / f"{name}_samples.npz"
        start = time.perf_counter()
        run(["sample.py", "--ckpt", run_dir, "--num-samples", num, "--sampler", sampler,
             "--steps", steps, "--cfg-scale", CFG_SCALE, "--batch-size", 300, "--out", samples, "--seed", "1",
             *size, *threads])
        sample_time = time.perf_counter() - start
        metrics_path = out / f"{name}_metrics.json"
        run(["evaluate_fid.py", "calc", "--samples", samples, "--ref", ref, "--features", "digits",
             "--json", metrics_path, "--digits-classifier", classifier, *threads])
        metrics = json.loads(metrics_path.read_text())["metrics"]
        return metrics, json.loads(Path(f"{samples}.json").read_text()), sample_time

    from nala_dit.training.checkpoint import load_model
    from nala_dit.models.dit import count_params

    rows, curves = [], {}
    for name, config, sampler, steps in MODELS:
        train_args = ["train.py", "--config", ROOT / config, "--results-dir", out, "--exp-name", name, *threads]
        if quick:   # no held-out loss: its first one (--val-every 100) is past the quick run's last step
            train_args += ["--max-steps", QUICK["train_steps"], "--ckpt-every", QUICK["train_steps"],
                           "--log-every", QUICK["log_every"], "--val-every", 0]
        start = time.perf_counter()
        run(train_args)
        train_time = time.perf_counter() - start
        run_dir = out / name
        curves[name] = loss_curve(run_dir)
        metrics, sidecar, sample_time = sample_and_score(name, run_dir, sampler,
                                                         QUICK["sample_steps"] if quick else steps, [])
        model, ckpt = load_model(run_dir)
        rows.append(dict(
            model=name, preset=ckpt.config["model"], params=count_params(model), steps=ckpt.step,
            train_time_s=round(train_time, 2),   # to 0.01 s: a quick run's train.py call takes about a second
            # All images over the whole train.py call (start-up and checkpoints included),
            # so the ratio of two rows is the ratio of their train times.
            images_per_sec=round(ckpt.step * ckpt.config["global-batch-size"] / train_time, 1),
            sampler=sampler, cfg_scale=CFG_SCALE, nfe=sidecar.get("nfe"), sample_time_s=round(sample_time, 1),
            class_consistency=metrics["class_consistency"],
            frechet_distance=metrics["fd_digits"],
            final_loss=curves[name][1][-1],
        ))

    # Up the ladder: the 8-px model sampled directly at 16 px, then fine-tuned there.
    ladder_start = time.perf_counter()
    source, side, ladder_steps, batch, lr = LADDER
    _, config, sampler, steps = next(m for m in MODELS if m[0] == source)
    sample_steps = QUICK["sample_steps"] if quick else steps
    size = ["--image-size", side]
    budget = dict(per_label=QUICK["ladder_grid"], num=QUICK["ladder_samples"]) if quick else \
        dict(per_label=LADDER_GRID, num=LADDER_SAMPLES)

    def ladder_row(model: str, steps_: int, train_time_: float, metrics_: dict) -> dict:
        return dict(model=model, steps=steps_, train_time_s=round(train_time_, 1),
                    samples=budget["num"], class_consistency=metrics_["class_consistency"],
                    frechet_distance=metrics_["fd_digits"])

    metrics, _, _ = sample_and_score(f"{source}_at{side}", out / source, sampler, sample_steps, size, **budget)
    ladder = [ladder_row(f"{source} 8 px, sampled at {side} px", 0, 0.0, metrics)]
    tuned = f"{source}-{side}"
    ladder_steps = QUICK["ladder_steps"] if quick else ladder_steps
    start = time.perf_counter()
    run(["train.py", "--config", ROOT / config, "--init-from", out / source, *size, "--pos-embed", "interpolate",
         "--max-steps", ladder_steps, "--global-batch-size", batch, "--lr", lr, "--ckpt-every", ladder_steps,
         "--log-every", max(1, ladder_steps // 6), "--results-dir", out, "--exp-name", tuned, *threads,
         *(["--val-every", 0] if quick else [])])
    train_time = time.perf_counter() - start
    metrics, _, _ = sample_and_score(tuned, out / tuned, sampler, sample_steps, [], **budget)
    ladder.append(dict(ladder_row(f"{source} 8 → {side} px, fine-tuned", ladder_steps, train_time, metrics),
                       batch=batch, lr=lr))
    ladder_time = round(time.perf_counter() - ladder_start, 1)

    real = out / "real_train_digits.npz"
    write_real_digits(real, per_class)
    run(["evaluate_fid.py", "calc", "--samples", real, "--ref", ref, "--features", "digits",
         "--json", out / "real_metrics.json", "--digits-classifier", classifier, *threads])
    real_metrics = json.loads((out / "real_metrics.json").read_text())["metrics"]
    ceiling = dict(model="real digits (train split)", class_consistency=real_metrics["class_consistency"],
                   frechet_distance=real_metrics["fd_digits"])

    plot_losses(curves, out / "loss.png")
    grids = {}   # model → (enlarged grid file, its size): shown in the report beside the scores
    for name, grid_side in [(r["model"], 8) for r in rows] + [(f"{source}_at{side}", side), (tuned, side)]:
        path, size = enlarge_grid(out / f"{name}_grid.png", grid_side)
        grids[name] = dict(file=path.name, width=size[0], height=size[1])
    report = dict(quick=quick, samples_per_model=10 * per_class, models=rows, ceiling=ceiling, grids=grids,
                  ladder=dict(rows=ladder, time_s=ladder_time, side=side, source=source, sampler=sampler),
                  note="Fréchet distance in the digits classifier's feature space; not comparable to Inception FID.")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(render_report(report))
    print((out / "report.md").read_text())
    print(f"report: {out / 'report.md'}\nplot:   {out / 'loss.png'}\ngrids:  {out}/*_grid.png")
    print(next_steps(out, threads, quick))


def _shown(path: Path) -> str:
    """``path`` as the user would type it from the current folder."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def next_steps(out: Path, threads: list = (), quick: bool = False) -> str:
    """What to run next on the demo's models: copy-paste commands that run as printed from
    the folder the demo ran in. They start with the interpreter that ran the demo (the
    venv's ``.venv/bin/python`` under ``make demo``: no activation needed) and carry the
    demo's ``--threads``; the grids drawn ``--grid-scale`` times larger, a digit
    ``REPORT_DIGIT_PX`` wide. Pixel-space models, so export.py takes no --vae / --copy-vae.
    The quick demo's lines sample with its own sampler steps (``QUICK``), its models at chance."""
    python = _shown(Path(sys.executable)) if sys.executable else "python"
    sample, export, app = _shown(ROOT / "sample.py"), _shown(ROOT / "export.py"), _shown(ROOT / "app.py")
    t = "".join(f" {a}" for a in threads)
    runs = {name: _shown(out / name) for name, *_ in MODELS}
    source, side, *_ = LADDER
    tuned = _shown(out / f"{source}-{side}")
    lines = ["", "next: the trained models are ordinary run folders (latest checkpoint, EMA weights): "
             + ", ".join(runs.values()) + f", and {tuned} (fine-tuned up the ladder at {side} px)"]
    for name, _, sampler, steps in MODELS[:2]:
        steps = QUICK["sample_steps"] if quick else steps
        lines.append(f"  {python} {sample} --ckpt {runs[name]} --labels 0,1,2,3,4,5,6,7,8,9 --per-label 8 "
                     f"--sampler {sampler} --steps {steps} --cfg-scale {CFG_SCALE:g} --grid {name.lower()}_grid.png "
                     f"--grid-scale {grid_scale(8)}{t}")
    name, _, sampler, steps = MODELS[0]
    steps = QUICK["sample_steps"] if quick else steps
    # named after the demo's folder: the quick and the full demo's blocks can be pasted one
    # after the other (runs/demo → exported/demo-naladit, runs/demo-quick → exported/demo-quick-naladit)
    exported = f"exported/{out.name}-{name.lower()}"
    lines += [f"  {python} {sample} --ckpt {tuned} --labels 0,1,2,3,4,5,6,7,8,9 --per-label 8 --sampler {sampler} "
              f"--steps {steps} --cfg-scale {CFG_SCALE:g} --grid {name.lower()}{side}_grid.png --grid-scale "
              f"{grid_scale(side)}{t}    # {side} px",
              f"  {python} {export} checkpoint {runs[name]} {exported}    # a diffusers pipeline folder (pixel "
              f"space: no VAE to copy)",
              f"  {python} {sample} --ckpt {exported} --labels 3,1,4 --per-label 4 --sampler {sampler} --steps {steps} "
              f"--cfg-scale {CFG_SCALE:g} --grid exported_grid.png --grid-scale {grid_scale(8)}{t}",
              f"  {python} {app} --ckpt {runs[name]}{t}    # a web page that samples it by class name, on "
              f"http://127.0.0.1:7860 (docs/app.md)"]
    return "\n".join(lines)


def render_report(report: dict) -> str:
    lines = [
        "# Digits demo report" + (" (quick smoke run)" if report["quick"] else ""),
        "",
        f"{report['samples_per_model']} samples per model, balanced over the 10 digits, scored against the "
        "held-out digits. Class-consistency = share of samples the digits classifier assigns to their "
        "conditioning label. Fréchet distance is in the classifier's feature space (**not comparable to "
        "Inception FID**). images/s = steps × batch ÷ train time (the whole `train.py` call, start-up and "
        "checkpoints included), measured on whatever else the machine was running.",
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
    if report["quick"]:
        lines += ["", f"**Quick smoke run: these models are at chance.** {report['models'][0]['steps']} training "
                  "steps teach them nothing yet: a class-consistency near 0.1 is what random labels get, and the "
                  "grids are noise. The run checks that every step works; `make demo` (600 steps) gives models "
                  "that draw digits."]
    grids = report.get("grids") or {}
    if grids:
        lines += ["", "## Samples", "", f"One row per digit 0-9, {REPORT_DIGIT_PX} px per digit (the sampled "
                  "pixels enlarged, nearest neighbour; `<model>_grid.png` holds them at their own size).", "",
                  "| model | class-consistency | Fréchet distance | samples |", "|---|---|---|---|"]
        for r in report["models"]:
            if r["model"] in grids:
                g = grids[r["model"]]
                lines.append(f"| {r['model']} | {r['class_consistency']:.3f} | {r['frechet_distance']:.3f} | "
                             f"![{r['model']} samples, {g['width']}×{g['height']} px]({g['file']}) |")
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
                  "(`experiments/ablation/run.py`; its findings in docs/results.md) separates them."]
    if ladder := report.get("ladder"):
        side, source = ladder["side"], ladder["source"]
        lines += ["", f"## Up the ladder: {source} at {side} px", "",
                  f"The 8-px {source} sampled directly at {side} × {side} px (4× the tokens, its own positions), "
                  f"then fine-tuned there from its weights (`train.py --init-from {source} --data digits "
                  f"--image-size {side} --pos-embed interpolate`; the digits upscaled 2× so that every 2×2 block "
                  f"averages to its scan pixel). {ladder['rows'][0]['samples']} samples per row, area-averaged back to "
                  f"8 × 8 and scored like the rows above ({ladder['sampler']}, cfg {CFG_SCALE}). The whole section "
                  f"took {ladder['time_s']} s (both samplings and grids, scoring, fine-tune).", "",
                  "| model | fine-tune steps | train time (s) | class-consistency | Fréchet distance |",
                  "|---|---|---|---|---|"]
        for r in ladder["rows"]:
            lines.append(f"| {r['model']} | {r['steps']} | {r['train_time_s']} | {r['class_consistency']:.3f} | "
                         f"{r['frechet_distance']:.3f} |")
        lines += ["", f"Grids: `{source}_at{side}_grid.png` (sampled directly), `{source}-{side}_grid.png` "
                  "(fine-tuned)."]
        shown = [(label, grids[key]) for label, key in (("sampled directly", f"{source}_at{side}"),
                                                        ("fine-tuned", f"{source}-{side}")) if key in grids]
        if shown:
            lines += ["", "| " + " | ".join(label for label, _ in shown) + " |", "|" + "---|" * len(shown),
                      "| " + " | ".join(f"![{label}, {g['width']}×{g['height']} px]({g['file']})"
                                        for label, g in shown) + " |"]
    lines += ["", "![training loss](loss.png)", ""]
    return "\n".join(lines)


def _script() -> int:
    from nala_dit.cli.parse import Interrupted

    try:
        return main()
    except KeyboardInterrupt:  # the CLIs' "rerun the same command" would not hold: the demo starts fresh
        raise Interrupted("the demo does not resume: run it again (it moves this partial run aside to "
                          "<out>.old-<time> and starts fresh)") from None


if __name__ == "__main__":
    from nala_dit.cli.parse import run_main

    sys.exit(run_main(_script))
