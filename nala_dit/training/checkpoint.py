"""Checkpoints: plain, rebuildable, written atomically, loaded without unpickling code.

A checkpoint is a folder ``<run>/checkpoints/<step:07d>/`` holding

* ``model.safetensors`` and ``ema.safetensors`` — the raw and EMA weights (fp32);
* ``optimizer.pt`` — the AdamW state, read back with ``torch.load(weights_only=True)``;
* ``rng.safetensors`` — each rank's torch RNG state;
* ``projector.safetensors`` — with ``--repa-encoder`` only: the alignment projector
  (``repa.py``), trained with the model, never part of its weights, EMA or exports;
* ``state.json`` — step, data position, world size, the resolved training config and
  the model config, so the checkpoint alone rebuilds the model (SiT's do not).

It is written under a temporary name (unique per process), its files and folder fsynced,
and renamed into place (the checkpoints folder fsynced after), so a run killed mid-save,
or a power loss, leaves the previous checkpoint intact and never a renamed folder of empty
files (the half-written folder is ignored, and removed by the next run). A save that fails (disk full) removes its
temporary folder. Every file read is checked: a truncated or edited file is an error
naming the file, the cause and the fix. Loaders prefer the EMA weights (DiT's ``find_model``).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..diffusion.gaussian import GaussianDiffusion
from ..models.grid import model_grid
from ..data.latent_stats import LatentNorm, recorded_norm
from ..guards import (CheckpointError, durable_replace, load_error_cause, non_finite, read_json,  # noqa: F401
                      refused_pickle, state_dict_mismatch, torch_load_tensors)
from ..models.files import check_config_fits, check_model_config, weight_shapes
from ..models.dit import DiT, config_keys
from ..models.vae import DEFAULT_SCALING_FACTOR
from ..diffusion.transport import Transport

STATE = "state.json"
TMP_PREFIX = ".tmp-"
ABANDONED = "abandoned"


def _contiguous(state_dict: dict) -> dict:
    return {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}


def _state_dict(x) -> dict:
    """A module's or an optimizer's state dict, or ``x`` when it is one already."""
    return x if isinstance(x, dict) else x.state_dict()


def check_finite_weights(ckpt_dir: str | os.PathLike, step: int, **modules: torch.nn.Module) -> None:
    """Raise (naming the tensor and the last good checkpoint) instead of saving the
    checkpoint of ``step`` when a weight is NaN or inf: a finite loss at the last step does
    not prove its update was finite. Call it on every rank (same weights, same verdict)."""
    for which, module in modules.items():
        if problem := _non_finite_anywhere(_state_dict(module), which):
            previous = list_checkpoints(ckpt_dir)
            raise FloatingPointError(
                f"not writing checkpoint {Path(ckpt_dir) / f'{step:07d}'}: {problem} (the run diverged); the last "
                f"good checkpoint is {previous[-1] if previous else '(none)'}. Try a lower --lr, --max-grad-norm 1, "
                f"or --mixed-precision no")


def _non_finite_anywhere(state_dict: dict, which: str) -> str | None:
    """``non_finite`` of a state dict, also of one sharded over processes (FSDP: each process
    checks its shards, and all hear the first problem any found)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(v, DTensor) for v in state_dict.values()):
        return non_finite(state_dict, which)
    import torch.distributed as dist

    problem = non_finite({k: v.to_local() if isinstance(v, DTensor) else v for k, v in state_dict.items()}, which)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    return next((p for p in found if p), None)


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    *,
    model: torch.nn.Module | dict,
    ema: torch.nn.Module | dict,
    optimizer: torch.optim.Optimizer | dict,
    state: dict,
    rng_states: list[torch.Tensor],
    keep_last: int = 0,
    projector: torch.nn.Module | dict | None = None,
    after_failure: str | None = None,
) -> Path:
    """Write ``ckpt_dir/<step:07d>`` atomically; keep the last ``keep_last`` (0 = all).
    Non-finite weights are never written: every checkpoint on disk is a good one. Modules
    and the optimizer may be given as their state dicts (``consolidate``). A failed write
    (disk full) is one line ending in ``after_failure`` (default: training's, the previous
    checkpoint and ``--resume auto``)."""
    root = Path(ckpt_dir)
    final = root / f"{state['step']:07d}"
    check_finite_weights(root, state["step"], model=model, ema=ema, **({} if projector is None else
                                                                        dict(projector=projector)))
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{os.getpid()}-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_file(_contiguous(_state_dict(model)), str(tmp / "model.safetensors"))
        save_file(_contiguous(_state_dict(ema)), str(tmp / "ema.safetensors"))
        if projector is not None:
            save_file(_contiguous(_state_dict(projector)), str(tmp / "projector.safetensors"))
        torch.save(_state_dict(optimizer), tmp / "optimizer.pt")
        save_file({f"rank{i}": s.contiguous() for i, s in enumerate(rng_states)}, str(tmp / "rng.safetensors"))
        (tmp / STATE).write_text(json.dumps(state, indent=2))
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, (OSError, RuntimeError, SafetensorError)):  # disk full surfaces as any of these
            previous = list_checkpoints(root)
            after = after_failure or (f"the previous checkpoint {previous[-1] if previous else '(none)'} is intact: "
                                      f"free space and rerun with --resume auto")
            raise OSError(
                f"cannot write checkpoint {final}: {str(err).splitlines()[0] if str(err) else type(err).__name__} "
                f"(disk full?); removed the partial copy, {after}"
            ) from err
        raise
    if final.exists():
        shutil.rmtree(final)
    durable_replace(tmp, final)  # the commit point: atomic on POSIX, its files on disk before the name
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def remove_temporaries(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Delete half-written checkpoints (or files) left by killed runs (call while holding the run lock)."""
    root = Path(ckpt_dir)
    stale = sorted(p for p in root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return stale


def set_aside_newer(ckpt_dir: str | os.PathLike, step: int) -> Path | None:
    """Rolling back to ``step``: move this run's checkpoints after it into
    ``abandoned/<time>-from-<step>/`` so ``--resume auto`` and ``--keep-last`` see only the
    new branch (nothing is deleted). Returns that folder, or None when there were none."""
    import time

    newer = [p for p in list_checkpoints(ckpt_dir) if int(p.name) > step]
    if not newer:
        return None
    aside = Path(ckpt_dir) / ABANDONED / f"{time.strftime('%Y%m%d-%H%M%S')}-from-{step:07d}"
    aside.mkdir(parents=True, exist_ok=False)
    for p in newer:
        os.replace(p, aside / p.name)
    return aside


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
    from ..cli.parse import did_you_mean

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
        from .shards import SHARDS, read_shards

        folder = self.path / SHARDS
        if not folder.is_dir():
            raise self.error(SHARDS, "missing (the sharded checkpoint is incomplete)")
        try:
            return read_shards(folder, key)
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
    check_model_config(state["model_config"], str(found / STATE), "the file was edited or damaged: "
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
        check_config_fits(check_model_config(ckpt.model_config, str(ckpt.path / STATE)), shapes,
                          str(ckpt.path / STATE), str(file))
    model = build_model_from_config(ckpt.model_config)
    ckpt.load_into(model, weights)
    return model.eval(), ckpt


# The training-config keys each objective is built from (``build_objective``): what
# ``--init-from`` compares (convert.py). What a resume compares is ``resume_rules.RESUME_RULES``.
OBJECTIVE_KEYS = {"diffusion": ("noise-schedule", "diffusion-steps", "time-shift"),
                  "transport": ("path-type", "prediction", "loss-weight", "train-eps", "sample-eps", "time-shift")}


def config_changes(ckpt: Checkpoint, train_config: dict, model_config: dict) -> dict[str, tuple]:
    """``{flag name: (checkpoint value, new value)}`` for every model-config key (the whole
    architecture: preset sizes, attention and its options, classes, objective type) and
    every training key ``resume_rules.RESUME_RULES`` refuses (objective, VAE, a teacher's, REPA's, when
    it applies) that differs between ``ckpt`` and a run about to resume from it."""
    import inspect

    from ..cli.config import flag_name
    from ..cli.options import MODEL_OVERRIDES, OBJECTIVE_OPTIONS, RESUME_RULES, RESUME_WHEN

    flags = {key: field for field, key in MODEL_OVERRIDES.items()}   # model key -> its flag (positions: pos-embed)
    defaults = {k: p.default for k, p in inspect.signature(DiT.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    changes, stored_config = {}, ckpt.model_config
    for key, now in model_config.items():
        if key.startswith("_"):  # diffusers bookkeeping
            continue
        stored = stored_config.get(key, defaults.get(key))  # keys added later keep their defaults
        if _jsonable(stored) != _jsonable(now):
            changes[flag_name(flags.get(key, key))] = (stored, now)
    objective = model_config.get("objective", "diffusion")
    for name in RESUME_RULES["refused"]:
        if OBJECTIVE_OPTIONS.get(name, objective) != objective:   # the other objective's option
            continue
        if (feature := RESUME_WHEN.get(name)) and not (ckpt.config.get(flag_name(feature))
                                                       or train_config.get(flag_name(feature))):
            continue   # a teacher's / REPA's setting, and neither run uses it
        key = flag_name(name)
        stored, now = ckpt.config.get(key, train_config.get(key)), train_config.get(key)
        if _jsonable(stored) != _jsonable(now):
            changes[key] = (stored, now)
    return changes


def _jsonable(value):
    """What ``value`` reads back as from state.json (tuples → lists, ints vs floats kept)."""
    return json.loads(json.dumps(value))


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
