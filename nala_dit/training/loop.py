"""The training loop behind ``train.py`` (DiT / SiT recipes, Hugging Face Accelerate).

One optimizer step consumes ``grad_accum`` micro-batches per process. Every random draw
of a step (timesteps, noise, label dropout, flips, VAE samples) comes from the global
RNG re-seeded from ``(seed, rank, step)``, and the data order is a fixed permutation per
epoch, so a run resumed from a checkpoint continues bit for bit (on CPU, same process
count) where an uninterrupted run would be.

The shape (EDM2's ``training_loop.py``, DiT's ``train.py``): ``build_run`` builds the run
(data, model, EMA, optimizer, objective, the optional features, resume) into a ``Run``
(``run.py``) from the pieces in ``build.py``, resuming by ``resume.py``; ``train_loop``
runs it one ``TrainStep`` at a time, each step on one screen: batch → model space → loss →
backward → clip → skip if not finite → optimizer step → EMA → log, evaluate, checkpoint.
The step's pieces (data position, micro-batch loss, skip decision, EMA) are in ``step.py``;
what is logged in ``tracking.py``; what is evaluated while training (held-out loss, FID,
sample grids) in ``validation.py``.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from ..data.sources import data_source
from ..data.latent_stats import agreed_norm
from ..progress import restart_rate
from ..runlock import LOCK_NAME, check_process_count, hold_lock
from . import convert
from .build import (build_model, build_optimizer, build_teacher, build_weights, checked_space, load_vae_and_norm,
                    num_workers, placement, print_start, step_model, write_run_files)
from .checkpoint import build_objective, source_norm
from .preempt import Preempted, StopSignals
from .config import TrainConfig, to_dict
from .resume import allowed_changes, find_resume, keep_source, resume_run
from .run import Logs, Placement, Run, Space, Weights
from .step import EpochBatches, MicroBatchLoss, StepResult, ema_warning, lr_at, shared_verdicts, step_seed, update_ema
from .tracking import Logger, LossWindow, NanStreak, progress_values
from .validation import HeldOutLoss, Periodic, SampleGrid, TrainingFID, heldout_dataset, val_samples_notice


def build_dataset(cfg: TrainConfig, state=None):
    """The dataset ``--data`` names (embedded digits, latent folder, image folder: the registry
    of ``data/sources.py``); ``state`` (Accelerate) splits the ``--check-data`` pass over the processes."""
    ds = data_source(cfg.data).open(cfg.data, cfg, "train", state=state)
    if cfg.num_classes is not None and cfg.num_classes != ds.num_classes:
        raise ValueError(
            f"--num-classes {cfg.num_classes} does not match the data: {cfg.data} has {ds.num_classes} classes"
        )
    return ds


def train(cfg: TrainConfig) -> Path:
    """Train; returns the run folder. Raises with a clear message on bad input.

    The run folder is locked for the whole run: a second run into it stops with the
    holder's pid and host. SIGTERM / SIGUSR1 stop every process at the same step, after its
    checkpoint (``preempt.py``: raises ``Preempted``)."""
    from accelerate import Accelerator

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision)
    check_process_count(accelerator.num_processes, "train.py")
    run_dir = cfg.run_dir()
    try:
        with hold_lock(run_dir / LOCK_NAME, f"run folder {run_dir}", "choose another --exp-name / --results-dir",
                       accelerator), StopSignals() as stop:
            run = build_run(cfg, accelerator)
            run.stop = stop
            train_loop(run)
            return run.run_dir
    finally:
        if accelerator.is_main_process:
            with contextlib.suppress(OSError):  # only when empty: a run that failed at once leaves no folder
                run_dir.rmdir()


def build_run_model(cfg: TrainConfig, dataset, channels: int, side: int, norm, resume_from: Path | None,
                    print=print):
    """(model, what ``--init-from`` did or None, the latent norm): a resumed run keeps its
    checkpoint's base grid and records the run's real source (``resume.keep_source``); a new
    run may start from ``--init-from``, whose latents must then be this run's. Context
    parallel's split of the token rows is checked against the model's grid."""
    from ..attention.context_parallel import row_split

    model = build_model(cfg, dataset.num_classes, channels, side)
    init_report = None
    if resume_from is not None:
        keep_source(cfg, model, resume_from, print)
    elif cfg.init_from:
        init_report = convert.init_from(cfg.init_from, model, cfg.model, cfg.inherit, to_dict(cfg))
        print(init_report.table())
        if norm is not None:  # a latent run: the source's latents must be this run's
            norm = agreed_norm(norm, source_norm(cfg.init_from), f"--init-from {cfg.init_from}", cfg.data,
                               "latent-norm" in allowed_changes(cfg), print)
    row_split(side // model.patch_size, cfg.context_parallel)     # P > the grid's rows: refused now
    return model, init_report, norm


def build_run(cfg: TrainConfig, accelerator) -> Run:
    """Everything before the first step: data, model, objective, EMA, optimizer, the optional
    features (teacher, REPA, evaluation while training, context parallel, compile), resume.
    Bad input is refused before anything slow is built, in this order."""
    from accelerate.utils import set_seed

    where = placement(cfg, accelerator)   # FSDP, context parallel, the micro-batch: build.py
    set_seed(cfg.seed + where.rank)
    run_dir = cfg.run_dir()
    resume_from = find_resume(cfg, run_dir, run_dir / "checkpoints", accelerator)

    # --- data; evaluation's data and reference (validation.py) are checked now, before the model ---
    dataset = build_dataset(cfg, accelerator)
    heldout_data = heldout_dataset(cfg, dataset) if cfg.val_every else None
    if heldout_data is not None and (notice := val_samples_notice(cfg, heldout_data)):
        accelerator.print(notice)
    fid = TrainingFID(cfg, dataset.num_classes, where.micro_batch, lockstep=where.sharding is not None) \
        if cfg.fid_every else None
    vae, norm = load_vae_and_norm(cfg, dataset, where.device, accelerator.print)
    channels, side = checked_space(cfg, dataset, vae)

    # --- model, objective, teacher, EMA, REPA, optimizer ---
    model, init_report, norm = build_run_model(cfg, dataset, channels, side, norm, resume_from, accelerator.print)
    objective = build_objective(dict(model.config), to_dict(cfg))
    distiller = build_teacher(cfg, model, where.device)
    weights = build_weights(cfg, model, where)
    optimizer = build_optimizer(cfg, model, weights.projector)
    print_start(cfg, where, model, side)

    # --- resume (resume.py) ---
    step, epoch, position, ema_updates = 0, 0, 0, 0
    if resume_from is not None:
        step, epoch, position, ema_updates, norm = resume_run(resume_from, cfg, where, weights, optimizer, norm)
    if cfg.grad_checkpointing:
        model.gradient_checkpointing = True
    write_run_files(accelerator, cfg, run_dir, init_report)
    space = Space(dataset, vae, norm, channels, side)

    # --- the model as a step calls it; the step's data and loss; evaluation ---
    train_model, optimizer, alignment = step_model(cfg, where, weights, optimizer)
    batches = EpochBatches(dataset, where, cfg.seed, num_workers(cfg, accelerator), epoch, position)
    loss = MicroBatchLoss(objective, train_model, model.config.objective == "diffusion", distiller, alignment)
    sample_grid = SampleGrid(weights.ema, objective, cfg, space, run_dir / "samples", where.device,
                             write=accelerator.is_main_process)
    if step == 0:
        update_ema(weights.ema, model, 0.0)  # EMA starts as a copy of the model (DiT)
    return Run(cfg=cfg, where=where, space=space, weights=weights, train_model=train_model, optimizer=optimizer,
               batches=batches, to_model=model_input(space, cfg.flip, images=alignment is not None), loss=loss,
               start_step=step, ema_updates=ema_updates,
               evaluations=build_evaluations(cfg, where, space, weights, objective, heldout_data, fid),
               sample_grid=sample_grid, logs=build_logs(cfg, accelerator, model, step, distiller is not None,
                                                        alignment is not None))


def model_input(space: Space, flip: bool, images: bool):
    """A data batch → (the model's input, its clean images for REPA (``images``), flipped as
    the input, or None)."""
    if images:
        return functools.partial(space.to_model, flip=flip, images=True)

    def to_model(x):
        return space.to_model(x, flip=flip), None
    return to_model


def build_evaluations(cfg: TrainConfig, where: Placement, space: Space, weights: Weights, objective, heldout_data,
                      fid) -> list[Periodic]:
    """The held-out loss (``--val-every``; its fixed draws made once, the same every time) and
    FID (``--fid-every``) as due every so many steps (validation.py)."""
    evaluations, accelerator, model, ema = [], where.accelerator, weights.model, weights.ema
    if heldout_data is not None:
        heldout = HeldOutLoss(heldout_data, objective, functools.partial(space.to_model, flip=False), where,
                              cfg.val_samples, 4 * where.micro_batch, cfg.context_parallel)
        evaluations.append(Periodic(cfg.val_every, lambda: {**heldout(model, accelerator, "val/loss"),
                                                            **heldout(ema, accelerator, "val/ema_loss")}))
    if fid is not None:
        evaluations.append(Periodic(cfg.fid_every, lambda: fid(ema, objective, space.vae, space.norm, accelerator)))
    return evaluations


def build_logs(cfg: TrainConfig, accelerator, model, step: int, distilled: bool, aligned: bool) -> Logs:
    """The ``Run``'s logging parts: NaLa layers whose exponent statistics are recorded on log
    steps, the progress bar (rank 0), the loss window since the last log step, the streak
    of skipped steps that stops a diverged run."""
    from ..progress import progress_bar

    stat_layers = [b.attn for b in model.blocks if hasattr(b.attn, "record_stats")]
    return Logs(logger=Logger(cfg.run_dir(), accelerator, step, cfg.report_to, to_dict(cfg)),
                window=LossWindow(accelerator, cfg.global_batch_size, stat_layers, distilled, aligned),
                nan_streak=NanStreak(cfg.max_nan_steps, step, cfg.run_dir() / "checkpoints", accelerator.print),
                stat_layers=stat_layers,
                progress=progress_bar(total=cfg.max_steps, initial=step, disable=not accelerator.is_main_process,
                                      desc=f"train {cfg.model}", unit="step"))


def train_loop(run: Run) -> None:
    """Steps ``run.start_step + 1`` … ``--max-steps``; a stop signal (``preempt.py``) ends
    them at the step every process agreed on, its checkpoint written, with ``Preempted``."""
    train_step, logs = TrainStep(run), run.logs
    if missing_grid(run) and (run.where.accelerator.is_main_process or run.where.sharding):
        run.sample_grid(run.start_step)   # the checkpoint's EMA: the grid the step would have written
    run.train_model.train()
    for step in range(run.start_step, run.cfg.max_steps):
        if train_step(step).stop and step + 1 < run.cfg.max_steps:
            logs.progress.close()
            logs.logger.close()
            again = "the same command" if run.cfg.resume == "auto" else "the same command with --resume auto"
            signal = getattr(run.stop, "name", None) or "a signal to another process"   # the flag is shared
            raise Preempted(f"{signal} at step {step + 1}: wrote checkpoint "
                            f"{run.run_dir / 'checkpoints' / f'{step + 1:07d}'}; run {again} to continue from it")
    logs.progress.close()
    if warning := ema_warning(run.cfg.ema_decay, run.cfg.ema_warmup, run.ema_updates):
        run.where.accelerator.print(f"warning: {warning}")   # a short run without the warm-up: its EMA is still noise
    logs.logger.close()
    run.where.accelerator.end_training()


def missing_grid(run: Run) -> bool:
    """A resumed run whose checkpoint is of a grid step (``--sample-every``) lacking its grid: a
    kill between the checkpoint and the grid, or a stop at that step (which writes no grid).
    The grid is drawn from the resumed EMA, as the step would have drawn it."""
    step, every = run.start_step, run.cfg.sample_every
    return step > 0 and every > 0 and step % every == 0 and not (run.run_dir / "samples" / f"{step:07d}.png").exists()


class TrainStep:
    """One training step of a built ``Run``, top to bottom: batch → model space → loss →
    backward → clip → skip if not finite → optimizer step → EMA → log, evaluate,
    checkpoint, sample grid. It re-seeds the global RNG from (seed, rank, step) first:
    every draw of a step (times, noise, label dropout, flips, VAE samples) is the same
    resumed or not, so a resumed run continues bit for bit."""

    def __init__(self, run: Run):
        self.run = run

    def __call__(self, step: int) -> StepResult:
        """From step ``step`` to ``step + 1``."""
        run, cfg, accelerator, optimizer = self.run, self.run.cfg, self.run.where.accelerator, self.run.optimizer
        logs = run.logs
        torch.manual_seed(step_seed(cfg.seed, run.where.rank, step))
        due = [evaluation for evaluation in run.evaluations if evaluation.due(step + 1)]
        log_now = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps or bool(due)
        for layer in logs.stat_layers:  # NaLa exponent statistics: on log steps only
            layer.record_stats = log_now

        # forward and backward of grad-accum micro-batches; the gradients are all-reduced on the last
        loss_sum, parts = torch.zeros((), device=accelerator.device), []
        for micro in range(cfg.grad_accum):
            x, y = run.batches.next()
            x, images = run.to_model(x)  # latents or pixels as the model sees them (+ clean images for REPA)
            with run.no_sync(sync=micro == cfg.grad_accum - 1):
                with accelerator.autocast():
                    loss, terms = run.loss(x, y, images)  # L_simple (+ distillation) (+ alignment)
                accelerator.backward(loss / cfg.grad_accum)
            loss_sum += loss.detach().float() / cfg.grad_accum
            parts.append(terms.float() / cfg.grad_accum)
        grad_norm = run.clip()

        # the update, skipped on every process when the step is not finite on one; a stop signal
        # on any process (preempt.py) stops every process after this step, on the same gather
        skipped, stop = shared_verdicts(accelerator, loss_sum, grad_norm, run.stop is not None and run.stop.requested)
        lr = lr_at(step, cfg.lr, cfg.warmup_steps)
        if not skipped:
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
        elif (scaler := getattr(accelerator, "scaler", None)) is not None:
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if not skipped:  # --ema-warmup counts the EMA's updates: a skipped step is none
            update_ema(run.weights.ema, run.weights.model, cfg.ema_decay, run.ema_updates if cfg.ema_warmup else None)
            run.ema_updates += 1
        result = StepResult(loss_sum, parts, grad_norm.detach().float(), lr, skipped, stop)
        step += 1
        logs.window.add(result)
        logs.nan_streak.update(step, result, logs.progress)  # every process: the skip decision is shared

        # log (with the evaluations due), checkpoint, sample grid
        if log_now:
            values = logs.window.values()
            for evaluation in due:
                values.update(evaluation.evaluate())
            logs.logger.log(step, values)
            logs.progress.set_postfix(**progress_values(values))
            logs.window.reset()
        logs.progress.update(1)  # after the log step's loss is set: a line printed now shows this step's loss
        if cfg.compile and step == run.start_step + 1:   # this step compiled the model: no step's time
            restart_rate(logs.progress)
        if step % cfg.ckpt_every == 0 or step == cfg.max_steps or stop:  # before the grid: a failed grid loses no steps
            run.save(step)
        if stop:
            return result
        if cfg.sample_every > 0 and step % cfg.sample_every == 0 and (accelerator.is_main_process or run.where.sharding):
            run.sample_grid(step)   # FSDP: every process runs the sharded EMA, the first writes the grid
        return result
