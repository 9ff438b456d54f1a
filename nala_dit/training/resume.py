"""How a run continues from a checkpoint: which checkpoint (``find_resume``), what is
checked and restored (``restore``: the rules in ``resume_rules.py``), where the data
resumes (``resumed_position``), and the whole resume as ``loop.build_run`` calls it
(``resume_run``). What a checkpoint holds is written by ``run.py`` ``Run.save``; a resumed
run continues bit for bit (on CPU, same process count) where an uninterrupted run would be.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..data.latent_stats import agreed_norm
from . import convert
from .checkpoint import (checkpoint_norm, config_changes, list_checkpoints, open_checkpoint, remove_temporaries,
                         set_aside_newer)
from .config import RECORDED_DEFAULTS, TrainConfig, to_dict
from .resume_rules import RESUME_NOTES, RESUME_RULES


def allowed_changes(cfg: TrainConfig) -> set[str]:
    """The settings ``--allow-changes`` lets differ from the checkpoint (flag spelling)."""
    return {k.strip().replace("_", "-") for k in (cfg.allow_changes or "").split(",") if k.strip()}


def find_resume(cfg: TrainConfig, run_dir: Path, ckpt_dir: Path, accelerator) -> Path | None:
    """The checkpoint this run continues from (``--resume``), or None for a new run; a run
    folder that already holds checkpoints is refused without ``--resume``. Clears the
    half-written files of killed runs (the caller holds the run folder's lock)."""
    resume_from = None
    if cfg.resume == "auto":
        found = list_checkpoints(ckpt_dir)
        resume_from = found[-1] if found else None
    elif cfg.resume:
        resume_from = open_resume(cfg.resume, ckpt_dir).path
    elif list_checkpoints(ckpt_dir):
        raise FileExistsError(
            f"{run_dir} already holds checkpoints; pass --resume auto to continue it, "
            f"or choose another --exp-name / --results-dir"
        )
    if accelerator.is_main_process:  # half-written files of killed runs (we hold the lock)
        remove_temporaries(run_dir)
        remove_temporaries(ckpt_dir)
    return resume_from


def open_resume(path: str, ckpt_dir: Path):
    """``open_checkpoint(path)``; a checkpoint that is not there names the steps that are
    (beside it, or in this run's ``checkpoints/``)."""
    try:
        return open_checkpoint(path)
    except FileNotFoundError as err:
        for folder in (Path(path).parent, Path(path) / "checkpoints", ckpt_dir):
            found = list_checkpoints(folder)
            if found:
                steps = ", ".join(str(int(p.name)) for p in found[-8:])
                raise FileNotFoundError(f"{err}; {folder} holds the checkpoints of steps "
                                        f"{'…, ' if len(found) > 8 else ''}{steps} (e.g. --resume {found[-1]})") from None
        raise


def keep_source(cfg: TrainConfig, model, resume_from: Path, print=print) -> None:
    """Before the weights are restored: a resumed run keeps its checkpoint's base grid and
    records the run's real source (``--init-from`` given on resume is ignored, and said so)."""
    resumed = open_checkpoint(resume_from)
    if base := resumed.model_config.get("base_size"):
        model.rebase(base)  # a run fine-tuned up the ladder keeps its source's base grid
    recorded = resumed.config.get("init-from")
    if cfg.init_from and cfg.init_from != recorded:
        # A resume continues the checkpoint's weights: say so, and keep recording the run's real source.
        print(f"resume: --init-from {cfg.init_from} is ignored: the run continues from {resumed.path} "
              f"(it started from {recorded or 'random weights'}); drop --init-from, or start a new "
              f"run (another --exp-name) to initialise from it")
        cfg.init_from = recorded


def resume_run(resume_from: Path, cfg: TrainConfig, where, weights, optimizer, norm) -> tuple[int, int, int, int, object]:
    """Restore the checkpoint into this run; (step, epoch, data position, EMA updates so far,
    the latent norm) to continue at (a checkpoint written before the count was stored: one
    update per step). The checkpoint's latent statistics must be this run's, refused before
    anything is moved. A rollback sets this run's later checkpoints aside. ``where`` and
    ``weights``: the run's ``run.Placement`` and ``run.Weights``."""
    accelerator = where.accelerator
    ckpt = open_checkpoint(resume_from)
    norm = agreed_norm(norm, checkpoint_norm(ckpt), f"checkpoint {resume_from}", cfg.data,
                       "latent-norm" in allowed_changes(cfg), accelerator.print)
    restore(ckpt, cfg, where, weights, optimizer)
    step, epoch = ckpt.step, ckpt.state["epoch"]
    position = resumed_position(ckpt, where.micro_batch, accelerator.print)
    ema_updates = ckpt.state.get("ema_updates", step)
    accelerator.print(f"resumed from {ckpt.path} at step {step}")
    if accelerator.is_main_process:
        # A rollback: this run's later checkpoints belong to the abandoned branch.
        aside = set_aside_newer(cfg.run_dir() / "checkpoints", step)
        if aside is not None:
            accelerator.print(f"rolled back to step {step}: moved this run's later checkpoints to {aside}")
    accelerator.wait_for_everyone()
    return step, epoch, position, ema_updates, norm


def restore(ckpt, cfg: TrainConfig, where, weights, optimizer) -> None:
    """Load a checkpoint into this run (``weights``: model, EMA, projector; the optimizer) after
    checking it is the same model and objective.

    Every setting follows its rule in ``resume_rules.RESUME_RULES``: a changed model or objective
    setting is refused with the list of differences unless named in ``--allow-changes``; the
    others (learning rate, β2, EMA, seed, flips, ...) are this run's, each change printed
    (``resume_announcements``), and the optimizer's are applied to the restored optimizer
    (its saved param groups would otherwise silently win)."""
    model, ema, projector, sharding = weights.model, weights.ema, weights.projector, where.sharding
    print, world = where.accelerator.print, where.world
    changes = config_changes(ckpt, to_dict(cfg), dict(model.config))
    allowed = allowed_changes(cfg)
    refused = {k: v for k, v in changes.items() if k not in allowed}
    if changes and (problem := convert.resume_refusal(ckpt, changes, refused, model, cfg.model, to_dict(cfg),
                                                      cfg.run_dir().name)):
        raise ValueError(problem)  # the advice names only what works: --allow-changes, or --init-from a new run
    for k, (a, b) in changes.items():
        print(f"resume: {k} changes from {a!r} to {b!r} (--allow-changes)")
    if ckpt.state["world_size"] != world:
        print(f"warning: resuming a {ckpt.state['world_size']}-process run on {world} processes; "
              "data order and RNG streams will differ from an uninterrupted run")
    if (was := ckpt.config.get("context-parallel") or 1) != cfg.context_parallel:
        print(f"resume: the checkpoint was trained with --context-parallel {was}, this run uses {cfg.context_parallel}: "
              f"it continues fp32-close to an uninterrupted run, not bit for bit (the split adds in another order; "
              f"2 processes against 1: 1.3e-6 apart after 3 steps, docs/highres.md)")
    if bool(ckpt.config.get("fsdp")) != cfg.fsdp:
        now = "shards it over the processes (--fsdp)" if cfg.fsdp else "holds the whole model on every process (DDP)"
        print(f"resume: the checkpoint was trained {'with' if ckpt.config.get('fsdp') else 'without'} --fsdp, this run "
              f"{now}: it continues within fp32 rounding of an uninterrupted run (FSDP against DDP: 1e-5 after 4 "
              f"steps, docs/scaling.md)")
    if ckpt.has_projector and projector is None:  # its parameters are in the optimizer state: both or neither
        raise ValueError(f"checkpoint {ckpt.path} was trained with --repa-encoder {ckpt.config.get('repa-encoder')}: "
                         f"resume with it, or start a new run from its weights (--init-from {ckpt.path})")
    if projector is not None and not ckpt.has_projector:
        raise ValueError(f"checkpoint {ckpt.path} was trained without --repa-encoder: resume without it, or start "
                         f"a new aligned run from its weights (--init-from {ckpt.path})")
    if sharding is not None:   # FSDP: shard by shard (a sharded checkpoint) or from full tensors
        sharding.restore(ckpt, model, ema, optimizer, projector)
    else:
        for which, module in (("model", model), ("ema", ema), ("projector", projector)):
            if module is not None:
                ckpt.load_into(module, which)
        ckpt.load_optimizer(optimizer)
    for line in resume_announcements(ckpt, cfg):
        print(line)
    for i, group in enumerate(optimizer.param_groups):  # the loop sets each step's lr (--warmup-steps)
        group.update(lr=cfg.lr, betas=(0.9, cfg.adam_beta2), weight_decay=cfg.weight_decay if i == 0 else 0.0)
    rng = ckpt.rng_state(where.accelerator.process_index)
    if rng is not None:
        torch.set_rng_state(rng)


def resumed_position(ckpt, micro_batch: int, print=print) -> int:
    """The data position (micro-batches into this epoch, per process) to resume at. It is
    stored in the checkpoint's micro-batches; a new batch size keeps the number of
    images already seen this epoch (rounded down) instead of skipping or repeating."""
    stored = ckpt.config
    old_micro = stored.get("global-batch-size", 0) // max(1, ckpt.state["world_size"] * stored.get("grad-accum", 1))
    position = ckpt.state["position"]
    if old_micro and old_micro != micro_batch:
        converted = position * old_micro // micro_batch
        print(f"resume: micro-batch {old_micro} → {micro_batch}: data position {position} → {converted} "
              f"({position * old_micro} images into epoch {ckpt.state['epoch']})")
        return converted
    return position


def resume_announcements(ckpt, cfg: TrainConfig) -> list[str]:
    """One line per setting a resume applies (``resume_rules.RESUME_RULES`` "applied") whose value
    differs from the checkpoint's: ``resume: --KEY NEW replaces the checkpoint's OLD`` (and
    what it means, ``RESUME_NOTES``). A key the checkpoint predates: its default then."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    spelled = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731  (as the CLI takes it)
    lines = []
    for key in RESUME_RULES["applied"]:
        name, wanted = key.replace("_", "-"), getattr(cfg, key)
        saved = ckpt.config.get(name, RECORDED_DEFAULTS.get(key, defaults[key]))
        if json.loads(json.dumps(saved)) != json.loads(json.dumps(wanted)):
            note = f" ({RESUME_NOTES[key]})" if key in RESUME_NOTES else ""
            lines.append(f"resume: --{name} {spelled(wanted)} replaces the checkpoint's {spelled(saved)}{note}")
    return lines
