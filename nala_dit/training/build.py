"""The pieces ``loop.build_run`` builds a run from: where it runs (processes, FSDP, context
parallel, the micro-batch: ``run.Placement``), the model and what it sees (pixels or latents), the optimizer,
the run folder's files and the ``start:`` line."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from ..attention.regions import check_regions
from ..data.choices import default_num_workers
from ..data.latent_stats import run_norm
from ..models import vae as vae_lib
from ..models.compile import compile_model, compile_note
from ..models.dit import create_model
from ..models.grid import latent_size, vae_factor
from ..models.tokenizer import check_fixed_size, describe
from . import convert
from . import repa as repa_lib
from .config import MODEL_OVERRIDES, TrainConfig, dump_yaml, to_dict
from .resume import allowed_changes
from .run import Placement, Weights
from .sharding import Sharding, fsdp_from_launcher, reshard_after_forward


def placement(cfg: TrainConfig, accelerator) -> Placement:
    """Where the run runs: FSDP's ``Sharding`` or None, the ``ContextParallel`` groups, the
    micro-batch. Context parallel: the P processes of a group hold the same samples (one data
    rank), so data order, RNG streams and the batch split follow the data rank; each process
    runs its rows of the token grid (nala_dit/attention/context_parallel.py). FSDP2
    (sharding.py): its mesh gives the groups."""
    from ..attention.context_parallel import ContextParallel

    sharding = None
    if cfg.fsdp or fsdp_from_launcher():
        cfg.fsdp = True
        sharding = Sharding(accelerator.device, cfg.context_parallel, cfg.mixed_precision, reshard_after_forward())
    context = sharding.context() if sharding is not None else ContextParallel.from_world(cfg.context_parallel)
    return Placement(accelerator, sharding, context,
                     micro_batch_size(cfg, accelerator.num_processes, context.data_size))


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


def model_space(dataset, vae, patch: int = 1) -> tuple[int, int]:
    """(channels, side) of what the model sees: latents or pixels. An image side that does
    not patch evenly is an error in pixels (a multiple of VAE factor × patch), before the
    model is built."""
    if vae is not None:   # an RAE encodes and decodes its one size only
        check_fixed_size(vae, (dataset.image_size, dataset.image_size))
    try:
        side, _ = latent_size(dataset.image_size, vae_factor(vae), patch)
    except ValueError as err:
        raise ValueError(f"--image-size: {err}") from None
    return (dataset.channels if vae is None else describe(vae).channels), side


def checked_space(cfg: TrainConfig, dataset, vae) -> tuple[int, int]:
    """``model_space`` for ``--model``'s patch, with ``--nala-regions`` checked against the token
    grid before the model (and its R⁴ region weights) is built."""
    patch = int(cfg.model.rsplit("/", 1)[1])
    channels, side = model_space(dataset, vae, patch)
    grid = side // patch
    if cfg.nala_regions:
        check_regions(cfg.nala_regions, (grid, grid), grid * grid)
    return channels, side


def load_vae_and_norm(cfg: TrainConfig, dataset, device, print=print):
    """(the VAE or None, the run's latent norm: latents → model space, None in pixel space)."""
    vae, scaling = None, vae_lib.DEFAULT_SCALING_FACTOR
    if cfg.vae is not None:
        vae, scaling = vae_lib.load_vae(cfg.vae, device)
        if dataset.is_latent:
            scaling = dataset.scaling_factor
    return vae, run_norm(cfg.latent_norm, dataset, vae, scaling, cfg.vae, "vae" in allowed_changes(cfg), print)


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


def build_optimizer(cfg: TrainConfig, model, projector=None) -> torch.optim.AdamW:
    """AdamW over ``param_groups``; REPA's projector trains in the decay group."""
    groups = param_groups(model, cfg.weight_decay)
    if projector is not None:
        groups[0]["params"] += list(projector.parameters())
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.adam_beta2))


def build_teacher(cfg: TrainConfig, model, device):
    """``--teacher``'s ``Distiller`` (convert.py) or None: not saved in checkpoints, its path is
    in the config, reloaded on resume."""
    if not cfg.teacher:
        return None
    return convert.Distiller.load(cfg.teacher, model, cfg.model, to_dict(cfg), cfg.distill_weight,
                                  cfg.distill_sigma_weight, device)


def build_weights(cfg: TrainConfig, model, where: Placement) -> Weights:
    """The model with its EMA, REPA's encoder and projector or None: the EMA a float32 copy of the model;
    REPA's projector trains beside the model, outside it and its EMA (repa.py). FSDP: rank 0's
    initial weights first (DDP broadcasts them when it wraps the model), then each module
    sharded before the optimizer, which holds the sharded parameters."""
    sharding = where.sharding
    if sharding is not None:
        sharding.broadcast(model)
    ema = copy.deepcopy(model).float().requires_grad_(False)
    encoder = projector = None
    if cfg.repa_encoder:
        encoder = repa_lib.load_encoder(cfg.repa_encoder).to(where.device)
        projector = repa_lib.build_projector(model.config.hidden_size, cfg.repa_projector_dim, encoder.dim)
    if sharding is not None:
        if projector is not None:
            sharding.broadcast(projector)
        for module, train in ((model, True), (ema, False), (projector, True)):
            if module is not None:
                sharding.shard(module.to(where.device), train)
    return Weights(model, ema, encoder, projector)


def step_model(cfg: TrainConfig, where: Placement, weights: Weights, optimizer):
    """(the model as a step calls it, the optimizer, REPA's ``Alignment`` or None): context
    parallel (after the EMA copy: the EMA, sample grids on one process, runs whole), compiled,
    REPA-wrapped (one module for DDP: the projector's gradients are all-reduced with the
    model's), prepared by accelerate for DDP (FSDP's units already reduce-scatter); then the
    EMA is moved to the device."""
    from ..attention.context_parallel import enable
    from .sharding import resumable_gradient_sync

    accelerator, model, projector = where.accelerator, weights.model, weights.projector
    enable(model, where.context)
    train_model = compile_model(model, in_place=False) if cfg.compile else model
    if cfg.compile:   # compiled at the first step: minutes on a CPU, left out of the ETA (TrainStep)
        accelerator.print(compile_note("step") + "; the rate and ETA leave it out")
    alignment = None
    if projector is not None:
        depth = cfg.repa_depth or repa_lib.default_depth(cfg.model)
        train_model = aligned = repa_lib.Aligned(model, train_model, projector, depth)
        alignment = repa_lib.Alignment(aligned, weights.encoder, cfg.repa_weight, model.patch_size)
    if where.sharding is None:
        train_model, optimizer = accelerator.prepare(train_model, optimizer)
        resumable_gradient_sync(train_model)   # CPU processes: the same gradient sums resumed or not
    weights.ema.to(accelerator.device)
    return train_model, optimizer, alignment


def num_workers(cfg: TrainConfig, accelerator) -> int:
    """``--num-workers``, or the default for the processes on this machine."""
    if cfg.num_workers is not None:
        return cfg.num_workers
    return default_num_workers(int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))


def print_start(cfg: TrainConfig, where: Placement, model, side: int) -> None:
    """The ``start:`` line (rank 0), with context parallel how the token rows split, with FSDP
    how the model is sharded."""
    accelerator, micro_batch, world = where.accelerator, where.micro_batch, where.world
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
    if where.sharding is not None:
        accelerator.print(where.sharding.describe())


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


def write_run_files(accelerator, cfg: TrainConfig, run_dir: Path, init_report) -> None:
    """The run folder's ``config.yaml``, and what ``--init-from`` did (sizes included) beside it."""
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
        if init_report is not None:
            (run_dir / "init_from.json").write_text(json.dumps(init_report.to_dict(), indent=2) + "\n")
