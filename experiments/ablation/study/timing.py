"""Isolated step times: every variant built, then round robin on one thread (``timing.json``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .cells import write_json
from .recipes import VARIANTS, data_flags, recipe_flags, task_recipe
from .scoring import heldout_set

TIMING_FILE = "timing.json"
QUICK_TIMING = dict(rounds=2, steps=1)


def _timing_setup(task: str, variant: str, recipe: dict, batch: int):
    """One variant's training step as train.py builds it (model, objective, AdamW, EMA, a batch),
    and one no-grad forward of that batch (what a sampler step costs per image)."""
    import copy

    import torch

    from nala_dit.training.checkpoint import build_objective
    from nala_dit.cli.config import resolve, to_dict
    from nala_dit.training.build import build_model, param_groups
    from nala_dit.training.loop import TrainConfig, update_ema

    flags = [*VARIANTS[variant], *recipe_flags(recipe, variant), *data_flags(recipe)]
    cfg, _ = resolve(TrainConfig, [str(a) for a in [*flags, "--lr", recipe["lr"], "--ema-decay", recipe["ema"]]])
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
                                      date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
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
