"""A run as ``loop.build_run`` leaves it for ``loop.train_loop``: what a step uses, in four
bundles the set-up passes around (``Placement``: where it runs; ``Space``: what the model sees;
``Weights``: model, EMA, REPA's encoder and projector; ``Logs``), and the
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
from .step import EpochBatches, MicroBatchLoss, clip_gradients, to_model_space
from .tracking import Logger, LossWindow, NanStreak
from .validation import Periodic, SampleGrid


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run runs (``build.placement``): the accelerator, FSDP's ``Sharding`` (``--fsdp``)
    or None (DDP through accelerate), context parallel's groups, one process's micro-batch."""
    accelerator: object
    sharding: Sharding | None
    context: object                # attention/context_parallel.py ContextParallel (None: a bare model, in tests)
    micro_batch: int

    @property
    def rank(self) -> int:
        """The data-parallel rank (context parallel: the group's)."""
        return self.context.data_rank

    @property
    def world(self) -> int:
        """The number of data-parallel ranks (context parallel: groups)."""
        return self.context.data_size

    @property
    def device(self) -> torch.device:
        return self.accelerator.device


@dataclasses.dataclass(frozen=True)
class Space:
    """What the model sees (``build.checked_space``): the dataset, the VAE or None (pixels), the
    run's latent norm (None in pixel space; saved with each checkpoint), channels and side."""
    dataset: object
    vae: object
    norm: object
    channels: int
    side: int

    def to_model(self, x, flip: bool, images: bool = False):
        """A data batch in model space (``step.to_model_space``)."""
        return to_model_space(x, self.dataset, self.vae, self.norm, flip, images)


@dataclasses.dataclass(frozen=True)
class Weights:
    """The modules a run trains and saves: the model (what the EMA follows and checkpoints hold),
    its EMA, and REPA's frozen encoder and trained projector (None without ``--repa-encoder``)."""
    model: torch.nn.Module
    ema: torch.nn.Module
    encoder: torch.nn.Module | None = None
    projector: torch.nn.Module | None = None


@dataclasses.dataclass(frozen=True)
class Logs:
    """What a run reports (``loop.build_logs``)."""
    logger: Logger
    window: LossWindow             # the steps since the last log step
    nan_streak: NanStreak          # skipped steps in a row: stops a diverged run
    stat_layers: list              # NaLa layers: exponent statistics recorded on log steps
    progress: object               # the progress bar (rank 0) or line


@dataclasses.dataclass
class Run:
    """A run as ``build_run`` leaves it for ``train_loop``."""
    cfg: TrainConfig
    where: Placement
    space: Space
    weights: Weights
    train_model: torch.nn.Module   # what a step calls: context-parallel, compiled, REPA-wrapped, prepared (DDP)
    optimizer: torch.optim.Optimizer
    batches: EpochBatches          # this process's micro-batches from the data position
    to_model: Callable             # a data batch → (the model's input, its clean images for REPA or None)
    loss: MicroBatchLoss           # one micro-batch: L_simple (+ distillation, + alignment)
    start_step: int                # 0, or the resumed checkpoint's step
    ema_updates: int               # the EMA's updates so far (--ema-warmup: a skipped step is none)
    evaluations: list[Periodic]    # the held-out loss (--val-every), FID (--fid-every)
    sample_grid: SampleGrid        # --sample-every
    logs: Logs
    stop: object = None            # preempt.StopSignals: SIGTERM / SIGUSR1 noted while it runs

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir()

    def save(self, step: int) -> None:
        """Save step ``step`` (weights, EMA, optimizer, data position, every rank's RNG state, the
        EMA's update count: the steps not skipped), after checking the weights are finite; with
        FSDP every process writes its shards (``sharding.py``)."""
        accelerator, ckpt_dir = self.where.accelerator, self.run_dir / "checkpoints"
        model, ema, projector = self.weights.model, self.weights.ema, self.weights.projector
        check_finite_weights(ckpt_dir, step, model=model, ema=ema, **({} if projector is None else dict(projector=projector)))
        rng_states = accelerator.gather(torch.get_rng_state().to(accelerator.device).unsqueeze(0)).cpu()
        norm, sharding = self.space.norm, self.where.sharding
        state = dict(step=step, epoch=self.batches.epoch, position=self.batches.position, world_size=self.where.world,
                     ema_updates=self.ema_updates, config=to_dict(self.cfg), model_config=dict(model.config),
                     latent_norm=norm.to_dict() if norm is not None else None)
        if sharding is not None:
            path = sharding.save(ckpt_dir, state, list(rng_states), model, ema, self.optimizer, projector,
                                 self.cfg.keep_last)
            accelerator.print(f"saved checkpoint {path}")
        elif accelerator.is_main_process:
            path = save_checkpoint(ckpt_dir, model=model, ema=ema, optimizer=self.optimizer, state=state,
                                   rng_states=list(rng_states), keep_last=self.cfg.keep_last, projector=projector)
            accelerator.print(f"saved checkpoint {path}")
        accelerator.wait_for_everyone()

    def no_sync(self, sync: bool):
        """A micro-batch's context: gradients reduced over the processes only when ``sync``."""
        if self.where.sharding is not None:
            return self.where.sharding.no_sync(self.weights.model, sync)
        return contextlib.nullcontext() if sync else self.where.accelerator.no_sync(self.train_model)

    def clip(self) -> torch.Tensor:
        """The gradients' global norm before clipping (``--max-grad-norm``)."""
        if self.where.sharding is not None:
            return self.where.sharding.clip(self.train_model.parameters(), self.cfg.max_grad_norm)
        return clip_gradients(self.where.accelerator, self.train_model.parameters(), self.cfg.max_grad_norm)
