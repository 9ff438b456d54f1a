"""Reading a training checkpoint, below both training (which writes them and resumes from
them) and the pipelines (which sample and export them): ``open_checkpoint`` checks its
``state.json``, ``Checkpoint`` serves its files, each one checked (a truncated or edited file
is one line naming the file, the cause and the fix), ``load_model`` rebuilds the model with
its EMA (default) or raw weights, ``build_objective`` the diffusion or transport it was
trained with, ``checkpoint_norm`` / ``source_norm`` its latent normalisation. Nothing read
runs code (safetensors; ``torch.load(weights_only=True)``; ``shards.py``'s readers).

Writing checkpoints is training's (``training/checkpoint.py``); the folder layout is
described there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..checks import did_you_mean
from ..data.latent_stats import LatentNorm, recorded_norm
from ..diffusion.gaussian import GaussianDiffusion
from ..diffusion.transport import Transport
from ..guards import CheckpointError, load_error_cause, non_finite, read_json, state_dict_mismatch
from ..models.dit import DiT, config_keys
from ..models.files import check_config_fits, check_model_config, weight_shapes
from ..models.grid import model_grid
from ..models.vae import DEFAULT_SCALING_FACTOR

STATE = "state.json"


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
        f"no checkpoint found at {path}{did_you_mean(path)} (expected a folder with {STATE}, or a run folder "
        f"with checkpoints/<step>/)"
    )


# state.json keys and the types a resume relies on.
STATE_TYPES = dict(step=int, epoch=int, position=int, world_size=int, config=dict, model_config=dict)


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
        """The model's constructor keys (``config_keys``: a config an older version wrote reads
        in today's keys)."""
        return config_keys(self.state["model_config"])

    def previous(self) -> Path | None:
        """The checkpoint of the same run before this one, if any."""
        earlier = [p for p in list_checkpoints(self.path.parent) if int(p.name) < int(self.path.name)] \
            if self.path.name.isdigit() else []
        return earlier[-1] if earlier else None

    def error(self, name: str, cause: str, fix: str | None = None) -> CheckpointError:
        """A one-line error naming ``self.path/name``, the cause and the way out (by
        default: the previous checkpoint, for a damaged file)."""
        if fix is None:
            earlier = self.previous()
            fix = (f"resume from the previous checkpoint (--resume {earlier}) or delete {self.path}" if earlier
                   else f"use another checkpoint or delete {self.path}")
        return CheckpointError(f"{self.path / name}: {cause}; {fix}")

    def _read(self, name: str, read):
        file = self.path / name
        if not file.is_file():
            raise self.error(name, "missing (the checkpoint is incomplete)")
        try:
            return read(file)
        except Exception as err:  # safetensors / zip / unpickler raise many types
            raise self.error(name, load_error_cause(err)) from None

    @property
    def sharded(self) -> bool:
        """Written by an FSDP run (``sharding.py``): weights and optimizer in ``shards/``."""
        return "sharded" in self.state

    @property
    def has_projector(self) -> bool:
        """Saved with REPA's projector (``--repa-encoder``)."""
        if self.sharded:
            return "projector" in self.state["sharded"].get("parts", ())
        return (self.path / "projector.safetensors").is_file()

    def _read_shards(self, key: str):
        from .shards import SHARDS, ShardIndexError, read_shards

        folder = self.path / SHARDS
        if not folder.is_dir():
            raise self.error(SHARDS, "missing (the sharded checkpoint is incomplete)")
        try:
            return read_shards(folder, key)
        except ShardIndexError as err:
            raise self.error(f"{SHARDS}/.metadata", str(err)) from None
        except Exception as err:  # the storage reader and unpickler raise many types
            raise self.error(SHARDS, load_error_cause(err)) from None

    def weights(self, which: str = "ema") -> dict[str, torch.Tensor]:
        if which not in ("ema", "model", "projector"):
            raise ValueError(f"weights must be 'ema', 'model' or 'projector', got {which!r}")
        if self.sharded:
            tensors = self._read_shards(which)
        else:
            tensors = self._read(f"{which}.safetensors", lambda f: load_file(str(f)))
        if problem := non_finite(tensors, "its"):
            raise self.error(f"{which}.safetensors", f"{problem}: written by a run that diverged")
        return tensors

    def load_into(self, module: torch.nn.Module, which: str = "ema") -> None:
        """``module.load_state_dict`` of these weights, with one line saying what does not fit."""
        tensors = self.weights(which)
        problem = state_dict_mismatch(module.state_dict(), tensors)
        if problem:
            raise self.error(f"{which}.safetensors", f"does not fit this model ({problem})",
                             f"build the model the checkpoint was trained with (see {self.path / STATE})")
        module.load_state_dict(tensors, strict=True)

    def optimizer_state(self) -> dict:
        """The optimizer state as ``optimizer.state_dict()`` writes it (parameters numbered)."""
        if self.sharded:
            from .shards import by_number

            return by_number(self._read_shards("optimizer"))
        return self._read("optimizer.pt", lambda f: torch.load(f, weights_only=True, map_location="cpu"))

    def load_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.load_state_dict`` of ``optimizer.pt``, after checking it was saved for
        these parameters (torch compares group sizes only; moment tensors of another shape
        would load and fail at the first step)."""
        state = self.optimizer_state()
        moments = state.get("state") if isinstance(state, dict) else None
        for i, entry in (moments.items() if isinstance(moments, dict) else ()):
            tensors = {f"{key} of parameter {i}": v for key, v in (entry.items() if isinstance(entry, dict) else ())
                       if isinstance(v, torch.Tensor)}
            if bad := non_finite(tensors, "its"):
                raise self.error("optimizer.pt", f"{bad}: the optimizer state is damaged (or was saved by a run "
                                                 f"that diverged), and would turn every weight non-finite")
        problem = optimizer_mismatch(optimizer, state)
        if problem is None:
            try:
                optimizer.load_state_dict(state)
                return
            except (ValueError, KeyError, TypeError, RuntimeError) as err:
                problem = str(err).splitlines()[0] if str(err) else type(err).__name__
        earlier = self.previous()
        raise self.error("optimizer.pt", f"does not fit this model's optimizer ({problem}): it was saved for another "
                                         f"model", f"put back the optimizer.pt written with this checkpoint, or resume "
                                         f"from another checkpoint{f' (--resume {earlier})' if earlier else ''}")

    def rng_state(self, rank: int) -> torch.Tensor | None:
        states = self._read("rng.safetensors", lambda f: load_file(str(f)))
        return states.get(f"rank{rank}")


def optimizer_mismatch(optimizer: torch.optim.Optimizer, state) -> str | None:
    """What keeps a saved optimizer ``state`` from fitting ``optimizer``, or None."""
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list) \
            or not isinstance(state.get("state"), dict):
        return "not an optimizer state dict (no 'state' and 'param_groups')"
    groups = state["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        return f"{len(groups)} parameter groups in the file, {len(optimizer.param_groups)} here"
    for g, (saved, ours) in enumerate(zip(groups, optimizer.param_groups)):
        ids = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(ids, list) or len(ids) != len(ours["params"]):
            return (f"parameter group {g} has {len(ids) if isinstance(ids, list) else '?'} parameters in the file, "
                    f"{len(ours['params'])} here")
        for i, p in zip(ids, ours["params"]):
            moments = state["state"].get(i, {})
            for key, value in (moments.items() if isinstance(moments, dict) else ()):
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != p.shape:
                    return f"{key} of parameter {i} is {tuple(value.shape)} in the file, {tuple(p.shape)} here"
    return None


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    found = find_checkpoint(path)
    ckpt = Checkpoint(found, {})
    state = ckpt._read(STATE, lambda f: json.loads(f.read_text()))
    if not isinstance(state, dict):
        raise ckpt.error(STATE, f"must hold a JSON object, got {type(state).__name__}")
    for key, typ in STATE_TYPES.items():
        value = state.get(key)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise ckpt.error(STATE, f"{key!r} must be {'an integer' if typ is int else 'an object'}, "
                                    f"got {value!r} ({type(value).__name__}): the file was edited or damaged")
    if state["step"] < 0 or state["position"] < 0 or state["world_size"] < 1:
        raise ckpt.error(STATE, "step/position must be >= 0 and world_size >= 1")
    updates = state.get("ema_updates", state["step"])  # the EMA's updates (steps not skipped); older: absent
    if not isinstance(updates, int) or isinstance(updates, bool) or not 0 <= updates <= state["step"]:
        raise ckpt.error(STATE, f"'ema_updates' must be an integer from 0 to the step {state['step']}, got "
                                f"{updates!r}: the file was edited or damaged")
    check_model_config(state["model_config"], str(found / STATE), DiT, "the file was edited or damaged: "
                       "restore it, or use another checkpoint")
    ckpt.state = state
    return ckpt


def build_model_from_config(model_config: dict) -> DiT:
    """Rebuild a ``DiT`` from a stored model config (diffusers' ``config.json`` keys)."""
    return DiT(**config_keys(model_config))


def load_model(path: str | os.PathLike, weights: str = "ema") -> tuple[DiT, Checkpoint]:
    """The model of a training checkpoint with its EMA (default) or raw weights. The model
    config is checked against the weights file's header before the model is built."""
    ckpt = open_checkpoint(path)
    file = ckpt.path / f"{weights}.safetensors"
    try:
        shapes = weight_shapes(file) if file.is_file() else None
    except ValueError:  # unreadable: ``ckpt.weights`` names the file and the way out
        shapes = None
    if shapes is not None:
        check_config_fits(check_model_config(ckpt.model_config, str(ckpt.path / STATE), DiT), shapes,
                          str(ckpt.path / STATE), str(file), DiT)
    model = build_model_from_config(ckpt.model_config)
    ckpt.load_into(model, weights)
    return model.eval(), ckpt


# The training-config keys each objective is built from (``build_objective``): what
# ``--init-from`` compares (``training/convert.py``). What a resume compares is ``training/resume_rules.py``'s
# ``RESUME_RULES``.
OBJECTIVE_KEYS = {"diffusion": ("noise-schedule", "diffusion-steps", "time-shift"),
                  "transport": ("path-type", "prediction", "loss-weight", "train-eps", "sample-eps", "time-shift")}


# train.py's MeanFlow flags (their config keys) -> ``MeanFlow``'s keywords
MEANFLOW_KEYS = {"mf-ratio": "r_neq_t", "mf-t-mean": "mf_t_mean", "mf-t-std": "mf_t_std",
                 "mf-adaptive-p": "adaptive_p", "mf-adaptive-c": "adaptive_c", "mf-cfg-omega": "cfg_omega",
                 "mf-cfg-kappa": "cfg_kappa"}


def build_objective(model_config: dict, train_config: dict):
    """The ``GaussianDiffusion`` (DiT) or ``Transport`` (SiT) a model was trained with.

    ``time-shift`` ("auto" or a number; none = 1) moves the training times; "auto" is
    resolved for the model's trained grid (``grid.py``)."""
    shift = 1.0
    if train_config.get("time-shift") is not None and "input_size" in model_config:
        shift = model_grid(model_config).time_shift(train_config["time-shift"])
    # the training times' distribution (``--t-sampling``; older configs: uniform)
    t_sampling = dict(t_sampling=train_config.get("t-sampling") or "uniform", t_mean=train_config.get("t-mean", 0.0),
                      t_std=train_config.get("t-std", 1.0))
    if model_config.get("objective", "diffusion") == "diffusion":
        var_type = "learned_range" if model_config.get("learn_sigma", True) else "fixed_small"
        return GaussianDiffusion.from_schedule(
            train_config.get("noise-schedule", "linear"),
            train_config.get("diffusion-steps", 1000),
            var_type,
            time_shift=shift,
            **t_sampling,
        )
    if model_config.get("mean_flow"):   # MeanFlow (diffusion/meanflow.py): its training settings, paper defaults
        from ..diffusion.meanflow import MeanFlow

        mf = {key.replace("-", "_"): train_config[flag] for flag, key in MEANFLOW_KEYS.items()
              if train_config.get(flag) is not None}
        null = model_config.get("num_classes", 1000) if model_config.get("class_dropout_prob", 0.1) > 0 else None
        return MeanFlow(
            path=train_config.get("path-type", "linear"), prediction=train_config.get("prediction", "velocity"),
            train_eps=train_config.get("train-eps"), sample_eps=train_config.get("sample-eps"), time_shift=shift,
            null_label=null, drop_prob=model_config.get("class_dropout_prob", 0.1), **mf)
    return Transport(
        path=train_config.get("path-type", "linear"),
        prediction=train_config.get("prediction", "velocity"),
        loss_weight=train_config.get("loss-weight", "none"),
        train_eps=train_config.get("train-eps"),
        sample_eps=train_config.get("sample-eps"),
        time_shift=shift,
        **t_sampling,
    )


# ------------------------------------------------------------------ the latent normalisation a model was trained with
def checkpoint_norm(ckpt) -> LatentNorm | None:
    """``recorded_norm`` of a ``checkpoint.Checkpoint``; a damaged entry is a one-line error
    naming its ``state.json``."""
    try:
        return recorded_norm(ckpt.state)
    except ValueError as err:
        raise CheckpointError(f"{ckpt.path / 'state.json'}: {err}") from None


def source_norm(path: str | os.PathLike) -> LatentNorm | None:
    """What an ``--init-from`` source was trained with: a checkpoint or run folder's
    ``state.json``, a pipeline folder's ``model_index.json``, or, for a published ``.pt``,
    DiT / SiT's SD-VAE factor 0.18215. None when unknown (a pixel-space model)."""
    p = Path(path)
    if p.is_file():
        return LatentNorm.scalar(DEFAULT_SCALING_FACTOR)
    if (p / "model_index.json").is_file():
        config = read_json(p / "model_index.json", "export the pipeline again")
        if not isinstance(config, dict):
            raise CheckpointError(f"{p / 'model_index.json'}: not a JSON object; export the pipeline again")
        if config.get("latent_norm") is not None:
            return LatentNorm.from_dict(config["latent_norm"], f"{p / 'model_index.json'} 'latent_norm'")
        if config.get("scaling_factor") is not None:
            return LatentNorm.scalar(config["scaling_factor"])
        return None
    return checkpoint_norm(open_checkpoint(p))  # None: pixel space, or an old run whose cache is gone
