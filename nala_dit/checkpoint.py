"""Checkpoints: plain, rebuildable, written atomically, loaded without unpickling code.

A checkpoint is a folder ``<run>/checkpoints/<step:07d>/`` holding

* ``model.safetensors`` and ``ema.safetensors`` — the raw and EMA weights (fp32);
* ``optimizer.pt`` — the AdamW state, read back with ``torch.load(weights_only=True)``;
* ``rng.safetensors`` — each rank's torch RNG state;
* ``state.json`` — step, data position, world size, the resolved training config and
  the model config, so the checkpoint alone rebuilds the model (SiT's do not).

It is written under a temporary name and renamed into place, so a run killed mid-save
leaves the previous checkpoint intact (and the half-written folder is ignored).
Loaders prefer the EMA weights (DiT's ``find_model``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .diffusion import GaussianDiffusion
from .models import DiT
from .transport import Transport

STATE = "state.json"
TMP_PREFIX = ".tmp-"


def _contiguous(state_dict: dict) -> dict:
    return {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    *,
    model: torch.nn.Module,
    ema: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict,
    rng_states: list[torch.Tensor],
    keep_last: int = 0,
) -> Path:
    """Write ``ckpt_dir/<step:07d>`` atomically; keep the last ``keep_last`` (0 = all)."""
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{state['step']:07d}"
    tmp = root / f"{TMP_PREFIX}{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(_contiguous(model.state_dict()), str(tmp / "model.safetensors"))
    save_file(_contiguous(ema.state_dict()), str(tmp / "ema.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    save_file({f"rank{i}": s.contiguous() for i, s in enumerate(rng_states)}, str(tmp / "rng.safetensors"))
    (tmp / STATE).write_text(json.dumps(state, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)  # the commit point: atomic on POSIX
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``ckpt_dir``, oldest first (temporaries skipped)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.isdigit() and (p / STATE).is_file()]
    return sorted(done, key=lambda p: int(p.name))


def find_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder from itself, a ``checkpoints/`` folder or a run folder (latest)."""
    path = Path(path)
    if (path / STATE).is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise FileNotFoundError(
        f"no checkpoint found at {path} (expected a folder with {STATE}, or a run folder "
        f"with checkpoints/<step>/)"
    )


@dataclass
class Checkpoint:
    path: Path
    state: dict

    @property
    def step(self) -> int:
        return self.state["step"]

    @property
    def config(self) -> dict:
        """The resolved training config (flag-named keys)."""
        return self.state["config"]

    @property
    def model_config(self) -> dict:
        return self.state["model_config"]

    def weights(self, which: str = "ema") -> dict[str, torch.Tensor]:
        if which not in ("ema", "model"):
            raise ValueError(f"weights must be 'ema' or 'model', got {which!r}")
        return load_file(str(self.path / f"{which}.safetensors"))

    def optimizer_state(self) -> dict:
        return torch.load(self.path / "optimizer.pt", weights_only=True, map_location="cpu")

    def rng_state(self, rank: int) -> torch.Tensor | None:
        states = load_file(str(self.path / "rng.safetensors"))
        return states.get(f"rank{rank}")


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    found = find_checkpoint(path)
    return Checkpoint(found, json.loads((found / STATE).read_text()))


def build_model_from_config(model_config: dict) -> DiT:
    """Rebuild a ``DiT`` from a stored model config (diffusers' ``config.json`` keys)."""
    keys = {k: v for k, v in model_config.items() if not k.startswith("_")}
    return DiT(**keys)


def load_model(path: str | os.PathLike, weights: str = "ema") -> tuple[DiT, Checkpoint]:
    """The model of a training checkpoint with its EMA (default) or raw weights."""
    ckpt = open_checkpoint(path)
    model = build_model_from_config(ckpt.model_config)
    model.load_state_dict(ckpt.weights(weights), strict=True)
    return model.eval(), ckpt


def build_objective(model_config: dict, train_config: dict):
    """The ``GaussianDiffusion`` (DiT) or ``Transport`` (SiT) a model was trained with."""
    if model_config.get("objective", "diffusion") == "diffusion":
        var_type = "learned_range" if model_config.get("learn_sigma", True) else "fixed_small"
        return GaussianDiffusion.from_schedule(
            train_config.get("noise-schedule", "linear"),
            train_config.get("diffusion-steps", 1000),
            var_type,
        )
    return Transport(
        path=train_config.get("path-type", "linear"),
        prediction=train_config.get("prediction", "velocity"),
        loss_weight=train_config.get("loss-weight", "none"),
        train_eps=train_config.get("train-eps"),
        sample_eps=train_config.get("sample-eps"),
    )
