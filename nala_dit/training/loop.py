"""The training loop behind ``train.py`` (DiT / SiT recipes, Hugging Face Accelerate).

One optimizer step consumes ``grad_accum`` micro-batches per process. Every random draw
of a step (timesteps, noise, label dropout, flips, VAE samples) comes from the global
RNG re-seeded from ``(seed, rank, step)``, and the data order is a fixed permutation per
epoch, so a run resumed from a checkpoint continues bit for bit (on CPU, same process
count) where an uninterrupted run would be.

The shape (EDM2's ``training_loop.py``, DiT's ``train.py``): ``build_run`` builds the run
(data, model, EMA, optimizer, objective, the optional features, resume) into a ``Run``;
``train_loop`` runs it one ``TrainStep`` at a time, each step on one screen: batch → model
space → loss → backward → clip → skip if not finite → optimizer step → EMA → log,
evaluate, checkpoint. The step's pieces (data position, micro-batch loss, skip decision,
EMA) are in ``step.py``; what is logged in ``tracking.py``; what is evaluated while
training (held-out loss, FID, sample grids) in ``validation.py``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Callable

import torch

from . import convert
from ..data import datasets as data_lib
from ..models import vae as vae_lib
from ..attention.regions import check_regions
from .checkpoint import (build_objective, check_finite_weights, checkpoint_norm, config_changes, list_checkpoints, open_checkpoint,
                         remove_temporaries, save_checkpoint, set_aside_newer, source_norm)
from .config import dump_yaml, to_dict
from ..models.grid import latent_size, vae_factor
from ..data.latent_stats import agreed_norm, run_norm
from ..models.dit import create_model
from .config import MODEL_OVERRIDES, RECORDED_DEFAULTS, TrainConfig
from .resume_rules import RESUME_NOTES, RESUME_RULES
from ..data.choices import CANVAS_SIZES, DIGITS_SIZES, IMAGE_FOLDER_SIZE, default_num_workers
from . import repa as repa_lib
from ..runlock import LOCK_NAME, check_process_count, hold_lock
from .tracking import Logger, LossWindow, NanStreak, progress_values
from .step import (EpochBatches, MicroBatchLoss, StepResult, clip_gradients, ema_warning, lr_at, skip_step,
                   step_seed, to_model_space, update_ema)
from .sharding import Sharding, fsdp_from_launcher, reshard_after_forward
from .validation import HeldOutLoss, Periodic, SampleGrid, TrainingFID, heldout_dataset, val_samples_notice

def build_dataset(cfg: TrainConfig, state=None):
    """The dataset named by ``--data`` (embedded digits, latent folder or image folder);
    ``state`` (Accelerate) splits the ``--check-data`` pass over the processes."""
    if cfg.data == "digits":
        ds = data_lib.DigitsDataset("train", cfg.image_size or DIGITS_SIZES[0])
    elif cfg.data == "digits-canvas":
        ds = data_lib.DigitsCanvasDataset("train", cfg.image_size or CANVAS_SIZES[0])
    elif (Path(cfg.data) / data_lib.LATENT_META).is_file():
        ds = data_lib.LatentDataset(cfg.data, images=bool(cfg.repa_encoder))
        if cfg.vae is None:
            raise ValueError(f"{cfg.data} holds latents: pass --vae (the VAE they came from) to decode sample grids")
    else:
        ds = data_lib.ImageFolderDataset(cfg.data, cfg.image_size or IMAGE_FOLDER_SIZE, cfg.skip_corrupt)
        if cfg.check_data:
            data_lib.check_images(ds, state)
    if cfg.num_classes is not None and cfg.num_classes != ds.num_classes:
        raise ValueError(
            f"--num-classes {cfg.num_classes} does not match the data: {cfg.data} has {ds.num_classes} classes"
        )
    return ds


def model_space(dataset, vae, patch: int = 1) -> tuple[int, int]:
    """(channels, side) of what the model sees: latents or pixels. An image side that does
    not patch evenly is an error in pixels (a multiple of VAE factor × patch), before the
    model is built."""
    try:
        side, _ = latent_size(dataset.image_size, vae_factor(vae), patch)
    except ValueError as err:
        raise ValueError(f"--image-size: {err}") from None
    return (dataset.channels if vae is None else vae.config.latent_channels), side


def _open_resume(path: str, ckpt_dir: Path):
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


def build_model(cfg: TrainConfig, num_classes: int, in_channels: int, input_size: int):
    overrides = {key: getattr(cfg, k) for k, key in MODEL_OVERRIDES.items() if getattr(cfg, k) is not None}
    return create_model(cfg.model, input_size=input_size, in_channels=in_channels, num_classes=num_classes,
                        class_dropout_prob=cfg.class_dropout_prob, **overrides)


# Parameters that weight decay must not pull towards 0: a learned NaLa norm scale is
# exp(ρ), and decaying ρ would drag every scale to s = 1 (the saturated regime); region
# mixing weights are exp(ρ) too, where decay would pull every region pair to w = 1.
NO_DECAY = ("log_norm_scale", "region_logits")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: everything decays except ``NO_DECAY`` parameters (one group when a
    model has none, so optimizer states of older checkpoints still load)."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        (keep if name.rsplit(".", 1)[-1] in NO_DECAY else decay).append(p)
    groups = [dict(params=decay, weight_decay=weight_decay)]
    if keep:
        groups.append(dict(params=keep, weight_decay=0.0))
    return groups


def attention_path(model_config: dict, device_type: str, precision: str) -> str:
    """The attention and the code path it runs on ``device_type``: NaLa's ``impl="auto"``
    choice (``select_nala_impl``), SDPA for softmax; a hybrid's softmax blocks after it."""
    from ..attention import select_nala_impl, triton_available

    attention = model_config["attention"]
    regions = model_config.get("nala_regions") or 1
    if attention == "nala" and regions > 1:
        path = f"nala ({regions}x{regions} region states, fused)"
    elif attention == "nala":
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        tokens = (model_config["input_size"] // model_config["patch_size"]) ** 2
        head_dim = model_config["hidden_size"] // model_config["num_heads"]
        path = f"nala ({select_nala_impl(device_type, head_dim, dtype, triton_available(), tokens)})"
    else:
        path = f"{attention} (SDPA)" if attention.startswith("softmax") else attention
    if not (blocks := model_config.get("softmax_blocks")):
        return path
    return f"{path} with softmax in blocks {', '.join(map(str, blocks))} (--softmax-blocks {','.join(map(str, blocks))})"


def start_line(world: int, backend: str | None, devices: str, global_batch: int, micro_batch: int, grad_accum: int,
               precision: str, attention: str) -> str:
    """The one line a run prints before its first step (rank 0): how it is spread and computed."""
    group = f"{world} process{'es' if world > 1 else ''}" + (f" ({backend})" if world > 1 and backend else "")
    return (f"start: {group} on {devices}, global batch {global_batch} ({micro_batch} per process, "
            f"grad-accum {grad_accum}), precision {precision}, attention {attention}")


def resume_announcements(ckpt, cfg: TrainConfig) -> list[str]:
    """One line per setting a resume applies (``options.RESUME_RULES`` "applied") whose value
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


def allowed_changes(cfg: TrainConfig) -> set[str]:
    """The settings ``--allow-changes`` lets differ from the checkpoint (flag spelling)."""
    return {k.strip().replace("_", "-") for k in (cfg.allow_changes or "").split(",") if k.strip()}


def restore(ckpt, cfg: TrainConfig, model, ema, optimizer, world: int, rank: int, print=print,
            projector=None, sharding=None) -> None:
    """Load a checkpoint into this run after checking it is the same model and objective.

    Every setting follows its rule in ``options.RESUME_RULES``: a changed model or objective
    setting is refused with the list of differences unless named in ``--allow-changes``; the
    others (learning rate, β2, EMA, seed, flips, ...) are this run's, each change printed
    (``resume_announcements``), and the optimizer's are applied to the restored optimizer
    (its saved param groups would otherwise silently win)."""
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
    rng = ckpt.rng_state(rank)
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


def train(cfg: TrainConfig) -> Path:
    """Train; returns the run folder. Raises with a clear message on bad input.

    The run folder is locked for the whole run: a second run into it stops with the
    holder's pid and host."""
    from accelerate import Accelerator

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision)
    check_process_count(accelerator.num_processes, "train.py")
    run_dir = cfg.run_dir()
    try:
        with hold_lock(run_dir / LOCK_NAME, f"run folder {run_dir}", "choose another --exp-name / --results-dir",
                       accelerator):
            run = build_run(cfg, accelerator)
            train_loop(run)
            return run.run_dir
    finally:
        if accelerator.is_main_process:
            with contextlib.suppress(OSError):  # only when empty: a run that failed at once leaves no folder
                run_dir.rmdir()


def find_resume(cfg: TrainConfig, run_dir: Path, ckpt_dir: Path, accelerator) -> Path | None:
    """The checkpoint this run continues from (``--resume``), or None for a new run; a run
    folder that already holds checkpoints is refused without ``--resume``. Clears the
    half-written files of killed runs (the caller holds the run folder's lock)."""
    resume_from = None
    if cfg.resume == "auto":
        found = list_checkpoints(ckpt_dir)
        resume_from = found[-1] if found else None
    elif cfg.resume:
        resume_from = _open_resume(cfg.resume, ckpt_dir).path
    elif list_checkpoints(ckpt_dir):
        raise FileExistsError(
            f"{run_dir} already holds checkpoints; pass --resume auto to continue it, "
            f"or choose another --exp-name / --results-dir"
        )
    if accelerator.is_main_process:  # half-written files of killed runs (we hold the lock)
        remove_temporaries(run_dir)
        remove_temporaries(ckpt_dir)
    return resume_from


def build_run_model(cfg: TrainConfig, dataset, channels: int, side: int, resume_from: Path | None, print=print):
    """(model, what ``--init-from`` did or None): a resumed run keeps its checkpoint's base
    grid and records the run's real source; a new run may start from ``--init-from``."""
    model = build_model(cfg, dataset.num_classes, channels, side)
    init_report = None
    if resume_from is not None:
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
    elif cfg.init_from:
        init_report = convert.init_from(cfg.init_from, model, cfg.model, cfg.inherit, to_dict(cfg))
        print(init_report.table())
    return model, init_report


def resume_run(resume_from: Path, cfg: TrainConfig, accelerator, model, ema, optimizer, world: int,
               micro_batch: int, ckpt_dir: Path, projector=None, sharding=None) -> tuple[int, int, int, int]:
    """Restore the checkpoint into this run; (step, epoch, data position, EMA updates so far) to
    continue at (a checkpoint written before the count was stored: one update per step).
    A rollback sets this run's later checkpoints aside."""
    ckpt = open_checkpoint(resume_from)
    restore(ckpt, cfg, model, ema, optimizer, world, accelerator.process_index, accelerator.print, projector,
            sharding)
    step, epoch, position = ckpt.step, ckpt.state["epoch"], resumed_position(ckpt, micro_batch, accelerator.print)
    ema_updates = ckpt.state.get("ema_updates", step)
    accelerator.print(f"resumed from {ckpt.path} at step {step}")
    if accelerator.is_main_process:
        # A rollback: this run's later checkpoints belong to the abandoned branch.
        aside = set_aside_newer(ckpt_dir, step)
        if aside is not None:
            accelerator.print(f"rolled back to step {step}: moved this run's later checkpoints to {aside}")
    accelerator.wait_for_everyone()
    return step, epoch, position, ema_updates


def checkpoint(accelerator, cfg: TrainConfig, ckpt_dir: Path, step: int, batches: EpochBatches, world: int,
               model, ema, optimizer, norm, projector=None, ema_updates: int | None = None, sharding=None) -> None:
    """Save step ``step`` (weights, EMA, optimizer, data position, every rank's RNG state, the
    EMA's update count: the steps not skipped), after checking the weights are finite; with
    FSDP every process writes its shards (``sharding.py``)."""
    check_finite_weights(ckpt_dir, step, model=model, ema=ema, **({} if projector is None else dict(projector=projector)))
    rng_states = accelerator.gather(torch.get_rng_state().to(accelerator.device).unsqueeze(0)).cpu()
    state = dict(step=step, epoch=batches.epoch, position=batches.position, world_size=world,
                 ema_updates=step if ema_updates is None else ema_updates,
                 config=to_dict(cfg), model_config=dict(model.config),
                 latent_norm=norm.to_dict() if norm is not None else None)
    if sharding is not None:
        path = sharding.save(ckpt_dir, state, list(rng_states), model, ema, optimizer, projector, cfg.keep_last)
        accelerator.print(f"saved checkpoint {path}")
    elif accelerator.is_main_process:
        path = save_checkpoint(ckpt_dir, model=model, ema=ema, optimizer=optimizer, state=state,
                               rng_states=list(rng_states), keep_last=cfg.keep_last, projector=projector)
        accelerator.print(f"saved checkpoint {path}")
    accelerator.wait_for_everyone()


def micro_batch_size(cfg: TrainConfig, processes: int, world: int) -> int:
    """One process's micro-batch: the global batch over (data-parallel ranks × grad-accum),
    refused unless it divides."""
    per_step = world * cfg.grad_accum
    if cfg.global_batch_size % per_step:
        groups = f"data-parallel groups ({processes} processes / context-parallel {cfg.context_parallel}) " \
            if cfg.context_parallel > 1 else "processes "
        raise ValueError(
            f"global-batch-size {cfg.global_batch_size} must be divisible by {groups}× grad-accum = {per_step}"
        )
    return cfg.global_batch_size // per_step


def load_vae_and_norm(cfg: TrainConfig, dataset, device, print=print):
    """(the VAE or None, the run's latent norm: latents → model space, None in pixel space)."""
    vae, scaling = None, vae_lib.DEFAULT_SCALING_FACTOR
    if cfg.vae is not None:
        vae, scaling = vae_lib.load_vae(cfg.vae, device)
        if isinstance(dataset, data_lib.LatentDataset):
            scaling = dataset.scaling_factor
    return vae, run_norm(cfg.latent_norm, dataset, vae, scaling, cfg.vae, "vae" in allowed_changes(cfg), print)


def build_optimizer(cfg: TrainConfig, model, projector=None) -> torch.optim.AdamW:
    """AdamW over ``param_groups``; REPA's projector trains in the decay group."""
    groups = param_groups(model, cfg.weight_decay)
    if projector is not None:
        groups[0]["params"] += list(projector.parameters())
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.adam_beta2))


def print_start(accelerator, cfg: TrainConfig, model, side: int, micro_batch: int, world: int) -> None:
    """The ``start:`` line (rank 0), and with context parallel how the token rows split."""
    device, processes = accelerator.device, accelerator.num_processes
    devices = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    accelerator.print(start_line(processes, accelerator.state.backend, f"{processes}× {devices}",
                                 cfg.global_batch_size, micro_batch, cfg.grad_accum, cfg.mixed_precision,
                                 attention_path(dict(model.config), device.type, cfg.mixed_precision)))
    if cfg.context_parallel > 1:
        from ..attention.context_parallel import row_split

        rows = side // model.patch_size
        accelerator.print(f"context parallel: {cfg.context_parallel} processes per image ({rows} "
                          f"token rows split as {row_split(rows, cfg.context_parallel)}), "
                          f"{world} data-parallel group{'s' if world > 1 else ''} of {micro_batch} images")


def write_run_files(accelerator, cfg: TrainConfig, run_dir: Path, init_report) -> None:
    """The run folder's ``config.yaml``, and what ``--init-from`` did (sizes included) beside it."""
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
        if init_report is not None:
            (run_dir / "init_from.json").write_text(json.dumps(init_report.to_dict(), indent=2) + "\n")


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

    def save(self, step: int) -> None:
        checkpoint(self.accelerator, self.cfg, self.run_dir / "checkpoints", step, self.batches, self.world,
                   self.model, self.ema, self.optimizer, self.norm, self.projector, self.ema_updates, self.sharding)

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


def build_run(cfg: TrainConfig, accelerator) -> Run:
    """Everything before the first step: data, model, objective, EMA, optimizer, the optional
    features (teacher, REPA, evaluation while training, context parallel, compile), resume.
    Bad input is refused before anything slow is built, in this order."""
    from accelerate.utils import set_seed

    from ..progress import progress_bar
    from ..attention.context_parallel import ContextParallel, enable, resumable_gradient_sync, row_split

    # Context parallel: the P processes of a group hold the same samples (one data rank), so
    # data order, RNG streams and the batch split follow the data rank; each process runs
    # its rows of the token grid (nala_dit/attention/context_parallel.py).
    sharding = None
    if cfg.fsdp or fsdp_from_launcher():   # FSDP2 (sharding.py): its mesh gives the context-parallel groups
        cfg.fsdp = True
        sharding = Sharding(accelerator.device, cfg.context_parallel, cfg.mixed_precision, reshard_after_forward())
        context = sharding.context()
    else:
        context = ContextParallel.from_world(cfg.context_parallel)
    rank, world, device = context.data_rank, context.data_size, accelerator.device
    set_seed(cfg.seed + rank)
    micro_batch = micro_batch_size(cfg, accelerator.num_processes, world)
    run_dir = cfg.run_dir()
    ckpt_dir = run_dir / "checkpoints"
    resume_from = find_resume(cfg, run_dir, ckpt_dir, accelerator)

    # --- data; evaluation's data and reference (validation.py) are checked now, before the model ---
    dataset = build_dataset(cfg, accelerator)
    heldout_data = heldout_dataset(cfg, dataset) if cfg.val_every else None
    if heldout_data is not None and (notice := val_samples_notice(cfg, heldout_data)):
        accelerator.print(notice)
    fid = TrainingFID(cfg, dataset.num_classes, micro_batch, lockstep=sharding is not None) if cfg.fid_every else None
    vae, norm = load_vae_and_norm(cfg, dataset, device, accelerator.print)
    keep_norm = "latent-norm" in allowed_changes(cfg)
    patch = int(cfg.model.rsplit("/", 1)[1])
    channels, side = model_space(dataset, vae, patch)
    grid = side // patch
    if cfg.nala_regions:  # R against the token grid before the model (and its R⁴ region weights) is built
        check_regions(cfg.nala_regions, (grid, grid), grid * grid)

    # --- model, objective, teacher, EMA, REPA, optimizer ---
    model, init_report = build_run_model(cfg, dataset, channels, side, resume_from, accelerator.print)
    if resume_from is None and cfg.init_from and norm is not None:  # a latent run: the source's latents must be this run's
        norm = agreed_norm(norm, source_norm(cfg.init_from), f"--init-from {cfg.init_from}", cfg.data, keep_norm,
                           accelerator.print)
    row_split(side // model.patch_size, cfg.context_parallel)     # P > the grid's rows: refused now
    objective = build_objective(dict(model.config), to_dict(cfg))
    distiller = None
    if cfg.teacher:  # not saved in checkpoints: its path is in the config, reloaded on resume
        distiller = convert.Distiller.load(cfg.teacher, model, cfg.model, to_dict(cfg), cfg.distill_weight,
                                           cfg.distill_sigma_weight, device)
    if sharding is not None:
        sharding.broadcast(model)   # rank 0's initial weights (DDP broadcasts them when it wraps the model)
    ema = copy.deepcopy(model).float().requires_grad_(False)
    encoder = projector = None
    if cfg.repa_encoder:  # REPA (repa.py): the projector trains beside the model, outside it and its EMA
        encoder = repa_lib.load_encoder(cfg.repa_encoder).to(device)
        projector = repa_lib.build_projector(model.config.hidden_size, cfg.repa_projector_dim, encoder.dim)
    if sharding is not None:   # before the optimizer: it holds the sharded parameters
        if projector is not None:   # the model was broadcast above, and the EMA copied from it
            sharding.broadcast(projector)
        for module, train in ((model, True), (ema, False), (projector, True)):
            if module is not None:
                sharding.shard(module.to(device), train)
    optimizer = build_optimizer(cfg, model, projector)
    print_start(accelerator, cfg, model, side, micro_batch, world)
    if sharding is not None:
        accelerator.print(sharding.describe())

    # --- resume ---
    step, epoch, position, ema_updates = 0, 0, 0, 0
    if resume_from is not None:
        # the checkpoint's latent statistics must be this run's: refused before anything is moved
        norm = agreed_norm(norm, checkpoint_norm(open_checkpoint(resume_from)), f"checkpoint {resume_from}", cfg.data,
                           keep_norm, accelerator.print)
        step, epoch, position, ema_updates = resume_run(resume_from, cfg, accelerator, model, ema, optimizer, world,
                                                        micro_batch, ckpt_dir, projector, sharding)
    if cfg.grad_checkpointing:
        model.gradient_checkpointing = True
    write_run_files(accelerator, cfg, run_dir, init_report)

    # --- the model as a step calls it ---
    enable(model, context)   # after the EMA copy: the EMA (sample grids on one process) runs whole
    train_model = torch.compile(model) if cfg.compile else model
    aligned = alignment = None
    if projector is not None:  # one module for DDP: the projector's gradients are all-reduced with the model's
        depth = cfg.repa_depth or repa_lib.default_depth(cfg.model)
        train_model = aligned = repa_lib.Aligned(model, train_model, projector, depth)
        alignment = repa_lib.Alignment(aligned, encoder, cfg.repa_weight, model.patch_size)
    if sharding is None:   # DDP; FSDP's units already reduce-scatter the gradients
        train_model, optimizer = accelerator.prepare(train_model, optimizer)
        resumable_gradient_sync(train_model)   # CPU processes: the same gradient sums resumed or not
    ema.to(device)
    logger = Logger(run_dir, accelerator, step, cfg.report_to, to_dict(cfg))

    # --- the step's data and loss; evaluation; logs ---
    workers = cfg.num_workers if cfg.num_workers is not None else \
        default_num_workers(int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
    batches = EpochBatches(dataset, rank, world, cfg.seed, micro_batch, workers, device, epoch, position)
    to_space = functools.partial(to_model_space, dataset=dataset, vae=vae, norm=norm)
    if alignment is not None:  # REPA: the clean images too, flipped as the model's input
        to_model = functools.partial(to_space, flip=cfg.flip, images=True)
    else:
        def to_model(x):
            return to_space(x, flip=cfg.flip), None
    loss = MicroBatchLoss(objective, train_model, model.config.objective == "diffusion", distiller, alignment)
    evaluations = []
    if heldout_data is not None:  # the held-out loss's fixed draws (validation.py), made once: the same every time
        heldout = HeldOutLoss(heldout_data, objective, functools.partial(to_space, flip=False), rank, world,
                              cfg.val_samples, 4 * micro_batch, device, cfg.context_parallel,
                              lockstep=sharding is not None)
        evaluations.append(Periodic(cfg.val_every, lambda: {**heldout(model, accelerator, "val/loss"),
                                                            **heldout(ema, accelerator, "val/ema_loss")}))
    if fid is not None:
        evaluations.append(Periodic(cfg.fid_every, lambda: fid(ema, objective, vae, norm, accelerator)))
    sample_grid = SampleGrid(ema, objective, cfg, vae, norm, channels, side, dataset.num_classes, run_dir / "samples",
                             device, write=accelerator.is_main_process)
    if step == 0:
        update_ema(ema, model, 0.0)  # EMA starts as a copy of the model (DiT)
    stat_layers = [b.attn for b in model.blocks if hasattr(b.attn, "record_stats")]
    progress = progress_bar(total=cfg.max_steps, initial=step, disable=not accelerator.is_main_process,
                            desc=f"train {cfg.model}", unit="step")
    window = LossWindow(accelerator, cfg.global_batch_size, stat_layers, distiller is not None, alignment is not None)
    nan_streak = NanStreak(cfg.max_nan_steps, step, ckpt_dir, accelerator.print)
    return Run(cfg, accelerator, run_dir, rank, world, model, train_model, ema, optimizer, batches, to_model, loss,
               step, ema_updates, evaluations, sample_grid, logger, window, nan_streak, stat_layers, progress, norm,
               projector, sharding)


def train_loop(run: Run) -> None:
    """Steps ``run.start_step + 1`` … ``--max-steps``."""
    train_step = TrainStep(run)
    run.train_model.train()
    for step in range(run.start_step, run.cfg.max_steps):
        train_step(step)
    run.progress.close()
    if warning := ema_warning(run.cfg.ema_decay, run.cfg.ema_warmup, run.ema_updates):
        run.accelerator.print(f"warning: {warning}")   # a short run without the warm-up: its EMA is still noise
    run.logger.close()
    run.accelerator.end_training()


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
        run, cfg, accelerator, optimizer = self.run, self.run.cfg, self.run.accelerator, self.run.optimizer
        torch.manual_seed(step_seed(cfg.seed, run.rank, step))
        due = [evaluation for evaluation in run.evaluations if evaluation.due(step + 1)]
        log_now = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps or bool(due)
        for layer in run.stat_layers:  # NaLa exponent statistics: on log steps only
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

        # the update, skipped on every process when the step is not finite on one
        skipped = skip_step(accelerator, loss_sum, grad_norm)
        lr = lr_at(step, cfg.lr, cfg.warmup_steps)
        if not skipped:
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
        elif (scaler := getattr(accelerator, "scaler", None)) is not None:
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if not skipped:  # --ema-warmup counts the EMA's updates: a skipped step is none
            update_ema(run.ema, run.model, cfg.ema_decay, run.ema_updates if cfg.ema_warmup else None)
            run.ema_updates += 1
        result = StepResult(loss_sum, parts, grad_norm.detach().float(), lr, skipped)
        step += 1
        run.window.add(result)
        run.nan_streak.update(step, result, run.progress)  # every process: the skip decision is shared

        # log (with the evaluations due), checkpoint, sample grid
        if log_now:
            values = run.window.values()
            for evaluation in due:
                values.update(evaluation.evaluate())
            run.logger.log(step, values)
            run.progress.set_postfix(**progress_values(values))
            run.window.reset()
        run.progress.update(1)  # after the log step's loss is set: a line printed now shows this step's loss
        if step % cfg.ckpt_every == 0 or step == cfg.max_steps:  # before the grid: a failed grid loses no steps
            run.save(step)
        if cfg.sample_every > 0 and step % cfg.sample_every == 0 and (accelerator.is_main_process or run.sharding):
            run.sample_grid(step)   # FSDP: every process runs the sharded EMA, the first writes the grid
        return result
