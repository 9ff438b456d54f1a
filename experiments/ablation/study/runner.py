"""One cell (train through ``train.py``, score every budget) and the grid of cells."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from nala_dit.cli.parse import child_env

from . import ENTRY, ROOT
from .cells import _previous, cell_done, cell_path, write_json
from .recipes import TASKS, VARIANTS, cell_name, data_flags, recipe_flags, task_recipe
from .scoring import evaluate_checkpoint, log_summary, reference, train_log
from .tables import write_table

def run_cell(task: str, variant: str, seed: int, lr: float, out: Path, quick: bool,
             budgets: list[int] | None = None, classifier_dir: Path | None = None) -> dict:
    """Train one cell to its largest budget (resuming if interrupted), score every budget."""
    import torch

    import train as train_cli
    from nala_dit.training.checkpoint import list_checkpoints, open_checkpoint
    from nala_dit.models.dit import count_params

    recipe = task_recipe(task, quick)
    if budgets:
        recipe["budgets"] = tuple(sorted(budgets))
    work = out / "work"
    run_dir = work / "runs" / cell_name(task, variant, seed, lr)
    budgets = recipe["budgets"]
    every = math.gcd(*budgets)
    source = None  # a ladder cell's start, when this call made it (not on a resume)
    argv = [*VARIANTS[variant], *recipe_flags(recipe, variant), *data_flags(recipe), "--flip", "false",
            "--global-batch-size", recipe["batch"], "--lr", lr, "--ema-decay", recipe["ema"],
            "--max-steps", budgets[-1], "--ckpt-every", every, "--log-every", recipe["log_every"],
            "--sample-every", 0, "--num-workers", 0, "--mixed-precision", "no", "--seed", seed,
            "--results-dir", run_dir.parent, "--exp-name", run_dir.name]
    if list_checkpoints(run_dir / "checkpoints"):
        argv += ["--resume", "auto"]
    elif recipe.get("init_task"):
        source_path, source = ladder_source(recipe["init_task"], variant, seed, out, quick, classifier_dir)
        argv += ["--init-from", source_path, "--pos-embed", recipe["pos_embed"]]
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
    rows, mismatched = [], []
    for budget in budgets:
        loss, time_s = log_summary(records, budget, window=2 * recipe["log_every"])
        if budget in scored:
            # Kept scores belong to this run only if its training log still says what they say
            # (a retrained cell, its checkpoints lost, must have trained bit for bit alike).
            if loss != scored[budget]["train_loss"]:
                mismatched.append(dict(budget=budget, recorded=scored[budget]["train_loss"], now=loss))
            rows.append(scored[budget])
            continue
        ckpt = by_step[budget]
        scores = evaluate_checkpoint(task, ckpt, recipe, ref, classifier_dir,
                                     sample=budget in recipe.get("sample_budgets", budgets) or budget == budgets[-1])
        rows.append(dict(budget=budget, train_loss=loss, train_time_s=round(time_s, 2), **scores))
        print(f"[{cell_name(task, variant, seed, lr)}] step {budget}: {rows[-1]}", flush=True)
    from nala_dit.training.checkpoint import load_model

    model, _ = load_model(by_step[budgets[-1]])
    result = dict(task=task, variant=variant, seed=seed, lr=lr, quick=quick, recipe=recipe,
                  flags=VARIANTS[variant], params=count_params(model), budgets=rows,
                  wall_train_s=round(wall_train + previous.get("wall_train_s", 0), 1),
                  wall_total_s=round(time.perf_counter() - start + previous.get("wall_total_s", 0), 1),
                  loadavg_start=load, loadavg_end=os.getloadavg(), torch_threads=torch.get_num_threads(),
                  last_exponent=records[-1].get("nala/exponent_mean"))
    if mismatched:
        result["kept_scores_mismatch"] = mismatched
    if source is not None:
        result["init_from"] = source
    # Keep only the final checkpoint (diagnostics read it); earlier ones were scored.
    for step, path in by_step.items():
        if step != budgets[-1]:
            shutil.rmtree(path, ignore_errors=True)
    return result


def ladder_source(task: str, variant: str, seed: int, out: Path, quick: bool, classifier_dir) -> tuple[Path, dict]:
    """The final checkpoint of ``task``'s cell for this variant and seed, the start of a
    ladder cell, and what the ladder cell records of it. The cell is run first (and
    recorded, unless already recorded) if its checkpoint is not in ``out/work`` (a fresh
    clone holds the cell JSONs, not the runs). A recorded cell is then retrained, not
    rescored: ``reproduced`` says whether its training log matched the recorded one bit for
    bit (one thread, same machine and torch: it does; on another machine it may not), so the
    rung above starts from the very model whose scores are committed; where it did not, the
    rung above still starts from an equal-recipe run, and the JSON says so."""
    lr = task_recipe(task, quick)["lr"]
    with _holding(_lock_path(out, (task, variant, seed, lr))):  # one trainer per run folder, across runners
        return _ladder_source(task, variant, seed, lr, out, quick, classifier_dir)


def _ladder_source(task: str, variant: str, seed: int, lr: float, out: Path, quick: bool,
                   classifier_dir) -> tuple[Path, dict]:
    from nala_dit.training.checkpoint import list_checkpoints

    found = list_checkpoints(out / "work" / "runs" / cell_name(task, variant, seed, lr) / "checkpoints")
    final = max(task_recipe(task, quick)["budgets"])
    info = dict(cell=cell_name(task, variant, seed, lr), retrained=False)
    if not found or int(found[-1].name) < final:
        recorded = cell_path(out, task, variant, seed, lr).is_file()
        result = run_cell(task, variant, seed, lr, out, quick, classifier_dir=classifier_dir)
        if recorded:
            info.update(retrained=True, reproduced="kept_scores_mismatch" not in result)
            if not info["reproduced"]:
                print(f"[{info['cell']}] warning: retrained, its training loss differs from the recorded cell's "
                      f"({result['kept_scores_mismatch']}); the rung above starts from this retrained model, "
                      f"whose scores are not the recorded ones", flush=True)
        else:
            write_json(cell_path(out, task, variant, seed, lr), result)
        found = list_checkpoints(out / "work" / "runs" / cell_name(task, variant, seed, lr) / "checkpoints")
    return found[-1], info


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


def _lock_path(out: Path, cell: tuple) -> Path:
    return out / "locks" / (cell_name(*cell).replace("/", "__") + ".pid")


def _holder(lock: Path) -> int | None:
    """The live process that holds a cell's lock, if any (runners may overlap after a restart)."""
    try:
        pid = int(lock.read_text())
        os.kill(pid, 0)
        return pid
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None


def _locked(lock: Path) -> bool:
    return _holder(lock) is not None


@contextlib.contextmanager
def _holding(lock: Path, poll_s: float = 2.0):
    """Hold a cell's lock in this process, first waiting while another live process holds it.
    A ladder rung trains its source cell inside its own process (``ladder_source``): without
    this, two runners whose rungs share a source would both train that source in one folder."""
    while (pid := _holder(lock)) is not None and pid != os.getpid():
        time.sleep(poll_s)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(str(os.getpid()))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _live_cells(out: Path) -> int:
    return sum(_locked(lock) for lock in (out / "locks").glob("*.pid"))


def run_main(args) -> int:
    out = args.out.resolve()
    todo = [c for c in grid(args) if not cell_done(out, *c, budgets=args.budgets)]
    print(f"{len(todo)} cells to run", flush=True)
    env = child_env(ROOT, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    running: list[tuple[subprocess.Popen, Path]] = []
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "locks").mkdir(parents=True, exist_ok=True)
    # Shared by every cell: build them once before the cells run side by side.
    classifier_dir = (args.classifier_dir or out / "work" / "digits_classifier").resolve()
    for task in args.tasks:
        reference(task, out / "work", classifier_dir)
    failures = 0
    for cell in todo:
        lock = _lock_path(out, cell)
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

            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # one thread per cell, as the subprocess cells; the caller's restored after
            try:
                failures += cell_main(cell_parser().parse_args(flags))
            finally:
                torch.set_num_threads(threads)
                lock.unlink(missing_ok=True)
            write_table(out, args.md, plots=False)
            continue
        # Slots count every live cell, also those of an earlier runner still finishing
        # (a restarted runner picks up where the old one is, without oversubscribing).
        while len(running) >= args.jobs or _live_cells(out) >= args.jobs or _source_busy(out, cell, args.quick):
            time.sleep(2)
            failures += _reap(running, out, args.md)
        log = open(out / "logs" / (cell_name(*cell).replace("/", "__") + ".log"), "a")
        proc = subprocess.Popen([sys.executable, str(ENTRY), "cell", *flags], env=env, cwd=ROOT,
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
    return _locked(_lock_path(out, (source, *cell[1:3], task_recipe(source, quick)["lr"])))


def _reap(running: list, out: Path, md: Path | None) -> int:
    failures = 0
    for item in list(running):
        proc, lock = item
        if proc.poll() is not None:
            running.remove(item)
            lock.unlink(missing_ok=True)
            failures += proc.returncode != 0
            write_table(out, md, plots=False)
    return failures


def cell_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="experiments/ablation/run.py cell", description="train and score one cell")
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
