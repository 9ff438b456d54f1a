"""The pieces of one optimizer step of ``train.py``, which reads top to bottom in
``loop.TrainStep``: the data position (``EpochBatches``), a data batch into model space,
the loss of a micro-batch (``MicroBatchLoss``), the learning rate, clipping, the shared
decisions to skip a non-finite step and to stop on a signal, and the EMA.

Every random draw of a step (timesteps, noise, label dropout, flips, VAE samples) comes
from the global RNG, which the loop re-seeds from ``step_seed(seed, rank, step)`` at the
start of each step; the data order is a fixed permutation per epoch (``EpochBatches``), so
a resumed run continues bit for bit.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.data import DataLoader

from ..data import datasets as data_lib
from ..models.tokenizer import encode_sample
# the EMA's reading (also what sampling warns about): checkpoints/ema.py
from ..checkpoints.ema import checkpoint_ema_warning, ema_initial_share, ema_warning  # noqa: F401


def step_seed(seed: int, rank: int, step: int) -> int:
    """A distinct, reproducible RNG stream per (seed, rank, step)."""
    return (seed * 1_000_003 + step * 4099 + rank) % (2**63)


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float, step: int | None = None) -> None:
    """``ema ← decay·ema + (1 − decay)·model`` over all parameters in one fused call.

    With ``step`` (``--ema-warmup``) the decay warms up: ``min(decay, (1 + step) / (10 + step))``,
    ``step`` = the EMA updates before this one (0 for the first: decay 0.1; skipped steps are none)."""
    if step is not None:
        decay = min(decay, (1 + step) / (10 + step))
    ema_params = list(ema.parameters())
    torch._foreach_lerp_(ema_params, [p.detach().to(e.dtype) for e, p in zip(ema_params, model.parameters())],
                         1 - decay)


class EpochBatches:
    """This process's micro-batches, epoch after epoch, from (``epoch``, ``position``):
    ``position`` micro-batches into the epoch, the state a checkpoint stores. The order is the
    dataset's own where it has one (``sampler``: sharded data, ``data/streams.py``), else a
    fixed permutation of the whole dataset per epoch (``datasets.EpochSampler``)."""

    def __init__(self, dataset, where, seed: int, workers: int, epoch: int = 0, position: int = 0):
        """``where``: the run's ``run.Placement`` (data rank and size, micro-batch, device)."""
        self.dataset, self.rank, self.world, self.seed = dataset, where.rank, where.world, seed
        self.micro_batch, self.workers, self.device = (micro_batch := where.micro_batch), workers, where.device
        self.epoch, self.position = epoch, position
        self.batches = self._loader(epoch, position * micro_batch)

    def _loader(self, epoch: int, start: int):
        if hasattr(self.dataset, "sampler"):
            sampler = self.dataset.sampler(self.rank, self.world, self.seed, epoch, start)
        else:
            sampler = data_lib.EpochSampler(len(self.dataset), self.rank, self.world, self.seed, epoch, start)
        self.per_epoch = sampler.per_rank // self.micro_batch   # the micro-batches of this epoch, every process's
        if self.per_epoch < 1:
            raise ValueError(f"the data ({len(self.dataset)} items; {sampler.per_rank} for each of {self.world} "
                             f"process(es)) is smaller than one micro-batch of {self.micro_batch} per process")
        return iter(DataLoader(self.dataset, batch_size=self.micro_batch, sampler=sampler, drop_last=True,
                               num_workers=self.workers, persistent_workers=False))

    def next(self):
        if self.position >= self.per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self.batches = self._loader(self.epoch, 0)
        x, y = next(self.batches)
        self.position += 1
        if isinstance(x, (list, tuple)):  # (latent moments, images): a --keep-images cache with --repa-encoder
            return [part.to(self.device) for part in x], y.to(self.device)
        return x.to(self.device), y.to(self.device)


def to_model_space(x, dataset, vae, norm, flip: bool, images: bool = False):
    """A data batch as the model sees it: cached latents sampled from their moments and
    normalised, or images flipped and (with a VAE) encoded and normalised; pixels as they
    are. ``norm``: the run's ``latent_norm.LatentNorm`` (scalar factor or per-channel
    statistics; None in pixel space). ``images``: (that, the clean images flipped as it
    was) for ``--repa-encoder``."""
    if dataset.is_latent:   # cached latent moments (data/sources.py: what a dataset has)
        if images:  # x = (moments, uint8 images) of a --keep-images cache
            return data_lib.sample_latents(x[0], norm, flip=flip, images=x[1])
        return data_lib.sample_latents(x, norm, flip=flip)
    if flip:
        x = data_lib.random_flip(x)
    pixels = x
    if vae is not None:
        with torch.no_grad():
            x = norm.normalize(encode_sample(vae, x).float())
    return (x, pixels) if images else x


def lr_at(step: int, lr: float, warmup_steps: int) -> float:
    """The learning rate of the update from step ``step`` to ``step + 1``: linear from 0
    over the first ``warmup_steps`` updates (lr·step/warmup, as diffusers'
    ``get_constant_schedule_with_warmup``), then ``lr``."""
    if step < warmup_steps:
        return lr * step / warmup_steps
    return lr


def clip_gradients(accelerator, parameters, max_norm: float) -> torch.Tensor:
    """The gradients' global 2-norm before clipping (all processes' gradients, as the
    optimizer sees them), clipped to ``max_norm`` when it is > 0. The norm is computed
    either way, to be logged (clipping at ∞ scales by exactly 1)."""
    return accelerator.clip_grad_norm_(parameters, max_norm if max_norm > 0 else float("inf"))


class MicroBatchLoss:
    """The loss of one micro-batch, and its terms for the log (detached): L_simple; then,
    with a teacher (``convert.Distiller``), the distillation terms [prediction, variance];
    then, with ``--repa-encoder`` (``repa.Alignment``), the alignment terms [−cos, cos].
    ``train_model`` is what the step calls (the DDP-prepared, compiled, REPA-wrapped model)."""

    def __init__(self, objective, train_model, diffusion: bool, distiller=None, alignment=None):
        self.objective, self.train_model, self.diffusion = objective, train_model, diffusion
        self.distiller, self.alignment = distiller, alignment

    def __call__(self, x, y, images=None) -> tuple[torch.Tensor, torch.Tensor]:
        fn = self.distiller.watch(self.train_model) if self.distiller else self.train_model
        if self.diffusion:
            t = self.objective.sample_timesteps(x.shape[0], x.device)
            loss = self.objective.training_losses(fn, x, t, y)["loss"].mean()
        else:
            loss = self.objective.training_losses(fn, x, y)["loss"].mean()
        terms = [loss.detach().reshape(1)]
        if self.distiller is not None:
            extra, distill_terms = self.distiller.terms()
            loss, terms = loss + extra, terms + [distill_terms]
        if self.alignment is not None:
            extra, align_terms = self.alignment.loss(images, x)
            loss, terms = loss + extra, terms + [align_terms]
        return loss, torch.cat(terms)


def shared_verdicts(accelerator, loss: torch.Tensor, grad_norm: torch.Tensor, stop: bool = False) -> tuple[bool, bool]:
    """(skip this step, stop after it), the same on every process, from one gather of each
    process's two flags. Skip: no optimizer update, no EMA update, when the loss is not finite
    on some process or, without an fp16 loss scaler (which skips non-finite gradients itself
    and lowers its scale), the gradient norm is not. Stop: some process was asked to
    (``stop``: a SIGTERM / SIGUSR1 it received, ``preempt.py``), so all stop at this step.
    The stop flag rides on the gather the skip decision needs anyway: no collective is added."""
    bad = ~torch.isfinite(loss)
    if getattr(accelerator, "scaler", None) is None:
        bad = bad | ~torch.isfinite(grad_norm.detach().float())
    flags = torch.stack([bad.reshape(()), torch.tensor(bool(stop), device=bad.device)]).int().reshape(1, 2)
    skip, stop = accelerator.gather(flags).any(dim=0).tolist()
    return bool(skip), bool(stop)


@dataclasses.dataclass
class StepResult:
    """What one step did: its loss and the micro-batches' shares of its terms (on the
    device), the gradient norm before clipping, the learning rate, whether it was skipped,
    whether the run stops after it (a signal, ``preempt.py``)."""
    loss: torch.Tensor
    parts: list
    grad_norm: torch.Tensor
    lr: float
    skipped: bool
    stop: bool = False
