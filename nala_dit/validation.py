"""What a training run evaluates while it runs: EMA sample grids."""

from __future__ import annotations

from pathlib import Path

import torch

from . import data as data_lib
from .generate import decode, generate
from .options import TrainConfig
from .sampling import save_grid


def write_sample_grid(model, objective, noise, labels, path: Path, cfg: TrainConfig, vae, scaling,
                      nrow: int = 8) -> None:
    """EMA samples as a PNG grid (fixed noise and labels, so grids are comparable);
    ``scaling``: the run's ``LatentNorm`` (or a factor), undone before decoding."""
    was_training = model.training
    model.eval()
    gen = torch.Generator(noise.device).manual_seed(cfg.seed)
    # DDIM / Heun by default: a grid is a progress check, 250 DDPM steps would dominate the step time.
    sampler = cfg.sample_sampler or ("ddim" if model.config.objective == "diffusion" else "ode-heun")
    out = generate(model, objective, noise, labels, sampler=sampler, num_steps=cfg.sample_steps,
                   cfg_scale=cfg.sample_cfg_scale, generator=gen)
    save_grid(data_lib.to_uint8(decode(out.samples, vae, scaling)), path, nrow=nrow)
    model.train(was_training)
