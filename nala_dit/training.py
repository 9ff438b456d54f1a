"""The training loop behind ``train.py`` (DiT / SiT recipes, Hugging Face Accelerate).

One optimizer step consumes ``grad_accum`` micro-batches per process. Every random draw
of a step (timesteps, noise, label dropout, flips, VAE samples) comes from the global
RNG re-seeded from ``(seed, rank, step)``, and the data order is a fixed permutation per
epoch, so a run resumed from a checkpoint continues bit for bit (on CPU, same process
count) where an uninterrupted run would be.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from . import convert
from . import data as data_lib
from .checkpoint import (build_objective, check_finite_weights, config_changes, list_checkpoints, open_checkpoint,
                         remove_temporaries, save_checkpoint, set_aside_newer)
from .config import dump_yaml, to_dict
from .generate import decode, generate
from .grid import latent_size, vae_factor
from .models import create_model
from .options import MODEL_OVERRIDES, TrainConfig, default_num_workers  # noqa: F401  (TrainConfig: the CLI's options, torch-free)
from .options import CANVAS_SIZES, DIGITS_SIZES, IMAGE_FOLDER_SIZE
from .runlock import LOCK_NAME, check_process_count, hold_lock
from .sampling import save_grid


def build_dataset(cfg: TrainConfig, state=None):
    """The dataset named by ``--data`` (embedded digits, latent folder or image folder);
    ``state`` (Accelerate) splits the ``--check-data`` pass over the processes."""
    if cfg.data == "digits":
        ds = data_lib.DigitsDataset("train", cfg.image_size or DIGITS_SIZES[0])
    elif cfg.data == "digits-canvas":
        ds = data_lib.DigitsCanvasDataset("train", cfg.image_size or CANVAS_SIZES[0])
    elif (Path(cfg.data) / data_lib.LATENT_META).is_file():
        ds = data_lib.LatentDataset(cfg.data)
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
    overrides = {k: getattr(cfg, k) for k in MODEL_OVERRIDES if getattr(cfg, k) is not None}
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


def exponent_log(layers) -> dict:
    """The NaLa exponent statistics of the last forward: the first layer's as
    ``nala/exponent_mean`` / ``nala/exponent_std`` / ``nala/saturated`` (as before), and the
    saturated share and mean exponent of every layer as ``nala/layer{i}/...``."""
    values = {}
    for i, layer in enumerate(layers):
        stats = getattr(layer, "last_stats", None)
        if not stats:
            continue
        if not values:
            values.update({f"nala/{k}": v for k, v in stats.items()})
        values[f"nala/layer{i}/exponent_mean"] = stats["exponent_mean"]
        values[f"nala/layer{i}/saturated"] = stats["saturated"]
    return values


def attention_path(model_config: dict, device_type: str, precision: str) -> str:
    """The attention and the code path it runs on ``device_type``: NaLa's ``impl="auto"``
    choice (``select_nala_impl``), SDPA for softmax."""
    from .attention import select_nala_impl, triton_available

    attention = model_config["attention"]
    regions = model_config.get("nala_regions") or 1
    if attention == "nala" and regions > 1:
        return f"nala ({regions}x{regions} region states, fused)"
    if attention == "nala":
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        tokens = (model_config["input_size"] // model_config["patch_size"]) ** 2
        head_dim = model_config["hidden_size"] // model_config["num_heads"]
        return f"nala ({select_nala_impl(device_type, head_dim, dtype, triton_available(), tokens)})"
    return f"{attention} (SDPA)" if attention.startswith("softmax") else attention


def start_line(world: int, backend: str | None, devices: str, global_batch: int, micro_batch: int, grad_accum: int,
               precision: str, attention: str) -> str:
    """The one line a run prints before its first step (rank 0): how it is spread and computed."""
    group = f"{world} process{'es' if world > 1 else ''}" + (f" ({backend})" if world > 1 and backend else "")
    return (f"start: {group} on {devices}, global batch {global_batch} ({micro_batch} per process, "
            f"grad-accum {grad_accum}), precision {precision}, attention {attention}")


def step_seed(seed: int, rank: int, step: int) -> int:
    """A distinct, reproducible RNG stream per (seed, rank, step)."""
    return (seed * 1_000_003 + step * 4099 + rank) % (2**63)


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float, step: int | None = None) -> None:
    """``ema ← decay·ema + (1 − decay)·model`` over all parameters in one fused call.

    With ``step`` (``--ema-warmup``) the decay warms up: ``min(decay, (1 + step) / (10 + step))``,
    ``step`` = the optimizer steps before this update (0 for the first: decay 0.1)."""
    if step is not None:
        decay = min(decay, (1 + step) / (10 + step))
    ema_params = list(ema.parameters())
    torch._foreach_lerp_(ema_params, [p.detach().to(e.dtype) for e, p in zip(ema_params, model.parameters())],
                         1 - decay)


class Logger:
    """JSON lines + TensorBoard on the main process, starting after ``step``: records of
    later steps (written by a run that died before its next checkpoint, or by an abandoned
    branch) are dropped, so a resumed run's log holds every step once."""

    def __init__(self, run_dir: Path, enabled: bool, step: int = 0):
        self.enabled = enabled
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            truncate_log(run_dir / "log.jsonl", step)
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=step + 1)
            self.file = open(run_dir / "log.jsonl", "a")

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        for k, v in values.items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            self.writer.close()


def truncate_log(path: Path, step: int) -> None:
    """Keep the JSON lines of steps <= ``step`` (atomic rewrite; a torn last line is dropped)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def restore(ckpt, cfg: TrainConfig, model, ema, optimizer, world: int, rank: int, print=print) -> None:
    """Load a checkpoint into this run after checking it is the same model and objective.

    Changed settings are refused with the list of differences unless named in
    ``--allow-changes``; ``--lr`` and ``--weight-decay`` are applied to the restored
    optimizer (its saved param groups would otherwise silently win)."""
    changes = config_changes(ckpt, to_dict(cfg), dict(model.config))
    allowed = {k.strip().replace("_", "-") for k in (cfg.allow_changes or "").split(",") if k.strip()}
    refused = {k: v for k, v in changes.items() if k not in allowed}
    if refused:
        listed = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in refused.items())
        raise ValueError(
            f"checkpoint {ckpt.path} was trained with other settings ({listed}). Resume with the checkpoint's "
            f"settings, or pass --allow-changes {','.join(refused)} to change them deliberately"
        )
    for k, (a, b) in changes.items():
        print(f"resume: {k} changes from {a!r} to {b!r} (--allow-changes)")
    if ckpt.state["world_size"] != world:
        print(f"warning: resuming a {ckpt.state['world_size']}-process run on {world} processes; "
              "data order and RNG streams will differ from an uninterrupted run")
    ckpt.load_into(model, "model")
    ckpt.load_into(ema, "ema")
    ckpt.load_optimizer(optimizer)
    for name, key in (("lr", "lr"), ("weight-decay", "weight_decay")):
        wanted = getattr(cfg, key)
        saved = sorted({group[key] for group in optimizer.param_groups})
        if saved != [wanted]:
            print(f"resume: --{name} {wanted} replaces the checkpoint's {', '.join(map(str, saved))}")
            for group in optimizer.param_groups:
                group[key] = wanted
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
            return _train(cfg, accelerator)
    finally:
        if accelerator.is_main_process:
            with contextlib.suppress(OSError):  # only when empty: a run that failed at once leaves no folder
                run_dir.rmdir()


def _train(cfg: TrainConfig, accelerator) -> Path:
    from accelerate.utils import set_seed

    from .progress import progress_bar

    from .context_parallel import ContextParallel, enable, row_split

    # Context parallel: the P processes of a group hold the same samples (one data rank), so
    # data order, RNG streams and the batch split follow the data rank; each process runs
    # its rows of the token grid (nala_dit/context_parallel.py).
    context = ContextParallel.from_world(cfg.context_parallel)
    process, processes = accelerator.process_index, accelerator.num_processes
    rank, world = context.data_rank, context.data_size
    device = accelerator.device
    set_seed(cfg.seed + rank)

    per_step = world * cfg.grad_accum
    if cfg.global_batch_size % per_step:
        groups = f"data-parallel groups ({processes} processes / context-parallel {cfg.context_parallel}) " \
            if cfg.context_parallel > 1 else "processes "
        raise ValueError(
            f"global-batch-size {cfg.global_batch_size} must be divisible by {groups}× grad-accum = {per_step}"
        )
    micro_batch = cfg.global_batch_size // per_step

    run_dir = cfg.run_dir()
    ckpt_dir = run_dir / "checkpoints"
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

    dataset = build_dataset(cfg, accelerator)
    vae, scaling = None, data_lib.DEFAULT_SCALING_FACTOR
    if cfg.vae is not None:
        vae, scaling = data_lib.load_vae(cfg.vae, device)
        if isinstance(dataset, data_lib.LatentDataset):
            scaling = dataset.scaling_factor
    channels, side = model_space(dataset, vae, int(cfg.model.rsplit("/", 1)[1]))
    model = build_model(cfg, dataset.num_classes, channels, side)
    init_report = None
    if resume_from is not None:
        resumed = open_checkpoint(resume_from)
        if base := resumed.model_config.get("base_size"):
            model.rebase(base)  # a run fine-tuned up the ladder keeps its source's base grid
        recorded = resumed.config.get("init-from")
        if cfg.init_from and cfg.init_from != recorded:
            # A resume continues the checkpoint's weights: say so, and keep recording the run's real source.
            accelerator.print(f"resume: --init-from {cfg.init_from} is ignored: the run continues from {resumed.path} "
                              f"(it started from {recorded or 'random weights'}); drop --init-from, or start a new "
                              f"run (another --exp-name) to initialise from it")
            cfg.init_from = recorded
    elif cfg.init_from:
        init_report = convert.init_from(cfg.init_from, model, cfg.model, cfg.inherit, to_dict(cfg))
        accelerator.print(init_report.table())
    row_split(side // model.patch_size, cfg.context_parallel)     # P > the grid's rows: refused now
    objective = build_objective(dict(model.config), to_dict(cfg))
    distiller = None
    if cfg.teacher:  # not saved in checkpoints: its path is in the config, reloaded on resume
        distiller = convert.Distiller.load(cfg.teacher, model, cfg.model, to_dict(cfg), cfg.distill_weight,
                                           cfg.distill_sigma_weight, device)
    ema = copy.deepcopy(model).float().requires_grad_(False)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    devices = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    accelerator.print(start_line(processes, accelerator.state.backend, f"{processes}× {devices}",
                                 cfg.global_batch_size, micro_batch, cfg.grad_accum, cfg.mixed_precision,
                                 attention_path(dict(model.config), device.type, cfg.mixed_precision)))
    if cfg.context_parallel > 1:
        accelerator.print(f"context parallel: {cfg.context_parallel} processes per image ({side // model.patch_size} "
                          f"token rows split as {row_split(side // model.patch_size, cfg.context_parallel)}), "
                          f"{world} data-parallel group{'s' if world > 1 else ''} of {micro_batch} images")

    step, epoch, position = 0, 0, 0
    if resume_from is not None:
        ckpt = open_checkpoint(resume_from)
        restore(ckpt, cfg, model, ema, optimizer, world, process, accelerator.print)
        step, epoch, position = ckpt.step, ckpt.state["epoch"], resumed_position(ckpt, micro_batch, accelerator.print)
        accelerator.print(f"resumed from {ckpt.path} at step {step}")
        if accelerator.is_main_process:
            # A rollback: this run's later checkpoints belong to the abandoned branch.
            aside = set_aside_newer(ckpt_dir, step)
            if aside is not None:
                accelerator.print(f"rolled back to step {step}: moved this run's later checkpoints to {aside}")
        accelerator.wait_for_everyone()

    if cfg.grad_checkpointing:
        model.gradient_checkpointing = True
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
        if init_report is not None:  # what --init-from did, sizes included, beside the config
            (run_dir / "init_from.json").write_text(json.dumps(init_report.to_dict(), indent=2) + "\n")
    enable(model, context)   # after the EMA copy: the EMA (sample grids on one process) runs whole
    train_model = torch.compile(model) if cfg.compile else model
    train_model, optimizer = accelerator.prepare(train_model, optimizer)
    ema.to(device)
    logger = Logger(run_dir, accelerator.is_main_process, step)

    workers = cfg.num_workers if cfg.num_workers is not None else \
        default_num_workers(int(os.environ.get("LOCAL_WORLD_SIZE", processes)))

    def loader_for(epoch: int, start: int):
        sampler = data_lib.EpochSampler(len(dataset), rank, world, cfg.seed, epoch, start)
        return iter(DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True,
                               num_workers=workers, persistent_workers=False))

    batches_per_epoch = math.ceil(len(dataset) / world) // micro_batch
    if batches_per_epoch < 1:
        raise ValueError(f"the data ({len(dataset)} items) is smaller than one micro-batch of {micro_batch} per process")
    batches = loader_for(epoch, position * micro_batch)

    def next_batch():
        nonlocal batches, epoch, position
        if position >= batches_per_epoch:
            epoch, position = epoch + 1, 0
            batches = loader_for(epoch, 0)
        x, y = next(batches)
        position += 1
        return x.to(device), y.to(device)

    def to_model_space(x):
        if isinstance(dataset, data_lib.LatentDataset):
            return data_lib.sample_latents(x, scaling, flip=cfg.flip)
        if cfg.flip:
            x = data_lib.random_flip(x)
        if vae is not None:
            with torch.no_grad():
                x = vae.encode(x.to(vae.dtype)).latent_dist.sample().float() * scaling
        return x

    def loss_fn(x, y):
        """(loss, its terms [L_simple, distillation, variance distillation]) of one micro-batch."""
        fn = distiller.watch(train_model) if distiller else train_model
        if model.config.objective == "diffusion":
            t = objective.sample_timesteps(x.shape[0], device)
            loss = objective.training_losses(fn, x, t, y)["loss"].mean()
        else:
            loss = objective.training_losses(fn, x, y)["loss"].mean()
        if distiller is None:
            return loss, loss.detach().reshape(1)
        extra, terms = distiller.terms()
        return loss + extra, torch.cat([loss.detach().reshape(1), terms])

    grid_noise = torch.randn(16, channels, side, side, generator=torch.Generator().manual_seed(cfg.seed)).to(device)
    grid_labels = (torch.arange(16) % dataset.num_classes).to(device)
    if step == 0:
        update_ema(ema, model, 0.0)  # EMA starts as a copy of the model (DiT)

    def checkpoint():
        check_finite_weights(ckpt_dir, step, model=model, ema=ema)
        rng_states = accelerator.gather(torch.get_rng_state().to(device).unsqueeze(0)).cpu()
        if accelerator.is_main_process:
            state = dict(step=step, epoch=epoch, position=position, world_size=world,
                         config=to_dict(cfg), model_config=dict(model.config))
            path = save_checkpoint(ckpt_dir, model=model, ema=ema, optimizer=optimizer, state=state,
                                   rng_states=list(rng_states), keep_last=cfg.keep_last)
            accelerator.print(f"saved checkpoint {path}")
        accelerator.wait_for_everyone()

    # NaLa layers record their exponent statistics on log steps only (a norm per layer).
    stat_layers = [b.attn for b in model.blocks if hasattr(b.attn, "record_stats")]
    progress = progress_bar(total=cfg.max_steps, initial=step, disable=not accelerator.is_main_process,
                            desc=f"train {cfg.model}", unit="step")
    # Losses stay on the device between log steps: no host sync in the step itself. A
    # non-finite loss is remembered by step and checked (across ranks) at every log step
    # and before every checkpoint, so no NaN weights are ever saved.
    window_loss = torch.zeros((), device=device)
    window_terms = torch.zeros(3 if distiller else 1, device=device)
    first_bad = torch.full((), -1, dtype=torch.long, device=device)
    window_steps, window_start = 0, time.perf_counter()

    def check_finite():
        bad = accelerator.gather(first_bad.unsqueeze(0))
        bad = bad[bad >= 0]
        if len(bad):
            progress.close()
            last = list_checkpoints(ckpt_dir)
            if int(bad.min()) == start_step + 1:  # no update had run yet: what the run started from is bad
                raise FloatingPointError(
                    f"non-finite loss at step {int(bad.min())}, the first of this run, before any update: the weights "
                    f"it started from (--resume / --init-from), or the data, hold NaN or inf; not the learning rate. "
                    f"Stopping without saving; check those files")
            raise FloatingPointError(
                f"non-finite loss at step {int(bad.min())}; stopping without saving. Last good checkpoint: "
                f"{last[-1] if last else 'none'}. Try a lower --lr, --max-grad-norm 1, or --mixed-precision no."
            )

    train_model.train()
    start_step = step
    while step < cfg.max_steps:
        torch.manual_seed(step_seed(cfg.seed, rank, step))
        log_now = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps
        for layer in stat_layers:
            layer.record_stats = log_now
        local = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            x, y = next_batch()
            x = to_model_space(x)
            # Gradients are all-reduced only on the last micro-batch.
            sync = micro == cfg.grad_accum - 1
            with accelerator.no_sync(train_model) if not sync else contextlib.nullcontext():
                with accelerator.autocast():
                    loss, terms = loss_fn(x, y)
                accelerator.backward(loss / cfg.grad_accum)
            local += loss.detach().float() / cfg.grad_accum
            window_terms += terms.float() / cfg.grad_accum
        if cfg.max_grad_norm > 0:
            accelerator.clip_grad_norm_(train_model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_ema(ema, model, cfg.ema_decay, step if cfg.ema_warmup else None)
        step += 1
        first_bad = torch.where((first_bad < 0) & ~torch.isfinite(local), step, first_bad)
        window_loss += local
        window_steps += 1
        if log_now:
            check_finite()
            per_rank = accelerator.gather((window_loss / window_steps).unsqueeze(0)).cpu()
            elapsed = time.perf_counter() - window_start
            values = dict(loss=per_rank.mean().item(), loss_per_rank=per_rank.tolist(),
                          steps_per_sec=window_steps / elapsed,
                          images_per_sec=window_steps * cfg.global_batch_size / elapsed)
            values.update(exponent_log(stat_layers))
            if distiller:
                terms = accelerator.gather((window_terms / window_steps).unsqueeze(0)).mean(0).tolist()
                values.update(loss_simple=terms[0], loss_distill=terms[1], loss_distill_sigma=terms[2])
            logger.log(step, values)
            progress.set_postfix(loss=f"{values['loss']:.4f}", img_s=f"{values['images_per_sec']:.1f}")
            window_loss.zero_()
            window_terms.zero_()
            window_steps, window_start = 0, time.perf_counter()
        progress.update(1)  # after the log step's loss is set: a line printed now shows this step's loss
        if cfg.sample_every > 0 and step % cfg.sample_every == 0:
            check_finite()  # every rank: a diverged run stops with its own message, not with NaN samples
            if accelerator.is_main_process:
                write_sample_grid(ema, objective, grid_noise, grid_labels, run_dir / "samples" / f"{step:07d}.png",
                                  cfg, vae, scaling, nrow=min(dataset.num_classes, 8))
        if step % cfg.ckpt_every == 0 or step == cfg.max_steps:
            check_finite()
            checkpoint()
    progress.close()
    logger.close()
    accelerator.end_training()
    return run_dir


def write_sample_grid(model, objective, noise, labels, path: Path, cfg: TrainConfig, vae, scaling,
                      nrow: int = 8) -> None:
    """EMA samples as a PNG grid (fixed noise and labels, so grids are comparable)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator(noise.device).manual_seed(cfg.seed)
    # DDIM / Heun by default: a grid is a progress check, 250 DDPM steps would dominate the step time.
    sampler = cfg.sample_sampler or ("ddim" if model.config.objective == "diffusion" else "ode-heun")
    out = generate(model, objective, noise, labels, sampler=sampler, num_steps=cfg.sample_steps,
                   cfg_scale=cfg.sample_cfg_scale, generator=gen)
    save_grid(data_lib.to_uint8(decode(out.samples, vae, scaling)), path, nrow=nrow)
    model.train(was_training)
