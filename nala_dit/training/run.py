"""A run as ``loop.build_run`` leaves it for ``loop.train_loop``: what a step uses, and the
three things a step asks of the run's set-up (save a checkpoint, a micro-batch's gradient
sync, the clipped gradient norm), the same under DDP and FSDP."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import check_finite_weights, save_checkpoint
from .config import TrainConfig, to_dict
from .sharding import Sharding
from .step import EpochBatches, MicroBatchLoss, clip_gradients
from .tracking import Logger, LossWindow, NanStreak
from .validation import Periodic, SampleGrid


@dataclasses.dataclass
class Run:
    """A run as ``build_run`` leaves it for ``train_loop``."""
    cfg: TrainConfig
    accelerator: object
    run_dir: Path
    rank: int                      # the data-parallel rank and size (context parallel: the group's)
    world: int
    model: torch.nn.Module         # the weights: what the EMA follows and checkpoints hold
    train_model: torch.nn.Module   # what a step calls: context-parallel, compiled, REPA-wrapped, prepared (DDP)
    ema: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: EpochBatches          # this process's micro-batches from the data position
    to_model: Callable             # a data batch → (the model's input, its clean images for REPA or None)
    loss: MicroBatchLoss           # one micro-batch: L_simple (+ distillation, + alignment)
    start_step: int                # 0, or the resumed checkpoint's step
    ema_updates: int               # the EMA's updates so far (--ema-warmup: a skipped step is none)
    evaluations: list[Periodic]    # the held-out loss (--val-every), FID (--fid-every)
    sample_grid: SampleGrid        # --sample-every
    logger: Logger
    window: LossWindow             # the steps since the last log step
    nan_streak: NanStreak          # skipped steps in a row: stops a diverged run
    stat_layers: list              # NaLa layers: exponent statistics recorded on log steps
    progress: object               # the progress bar (rank 0) or line
    norm: object = None            # latents → model space (None: pixels), saved with each checkpoint
    projector: torch.nn.Module | None = None  # REPA's, saved with each checkpoint
    sharding: Sharding | None = None          # --fsdp (sharding.py), else DDP through accelerate
    stop: object = None                       # preempt.StopSignals: SIGTERM / SIGUSR1 noted while it runs

    def save(self, step: int) -> None:
        """Save step ``step`` (weights, EMA, optimizer, data position, every rank's RNG state, the
        EMA's update count: the steps not skipped), after checking the weights are finite; with
        FSDP every process writes its shards (``sharding.py``)."""
        accelerator, ckpt_dir, projector = self.accelerator, self.run_dir / "checkpoints", self.projector
        check_finite_weights(ckpt_dir, step, model=self.model, ema=self.ema,
                             **({} if projector is None else dict(projector=projector)))
        rng_states = accelerator.gather(torch.get_rng_state().to(accelerator.device).unsqueeze(0)).cpu()
        state = dict(step=step, epoch=self.batches.epoch, position=self.batches.position, world_size=self.world,
                     ema_updates=self.ema_updates, config=to_dict(self.cfg), model_config=dict(self.model.config),
                     latent_norm=self.norm.to_dict() if self.norm is not None else None)
        if self.sharding is not None:
            path = self.sharding.save(ckpt_dir, state, list(rng_states), self.model, self.ema, self.optimizer,
                                      projector, self.cfg.keep_last)
            accelerator.print(f"saved checkpoint {path}")
        elif accelerator.is_main_process:
            path = save_checkpoint(ckpt_dir, model=self.model, ema=self.ema, optimizer=self.optimizer, state=state,
                                   rng_states=list(rng_states), keep_last=self.cfg.keep_last, projector=projector)
            accelerator.print(f"saved checkpoint {path}")
        accelerator.wait_for_everyone()

    def no_sync(self, sync: bool):
        """A micro-batch's context: gradients reduced over the processes only when ``sync``."""
        if self.sharding is not None:
            return self.sharding.no_sync(self.model, sync)
        return contextlib.nullcontext() if sync else self.accelerator.no_sync(self.train_model)

    def clip(self) -> torch.Tensor:
        """The gradients' global norm before clipping (``--max-grad-norm``)."""
        if self.sharding is not None:
            return self.sharding.clip(self.train_model.parameters(), self.cfg.max_grad_norm)
        return clip_gradients(self.accelerator, self.train_model.parameters(), self.cfg.max_grad_norm)
