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
temporary folder. Reading one is ``checkpoints/read.py``'s (below training and the pipelines):
every file read is checked, a truncated or edited file is an error naming the file, the cause
and the fix, and loaders prefer the EMA weights (DiT's ``find_model``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

# Reading is below both training and the pipelines (``checkpoints/read.py``); its names are
# also importable from here, where the docs and older scripts import them.
from ..checkpoints.read import (  # noqa: F401
    OBJECTIVE_KEYS, STATE, STATE_TYPES, Checkpoint, build_model_from_config, build_objective, checkpoint_norm,
    find_checkpoint, list_checkpoints, load_model, open_checkpoint, optimizer_mismatch, source_norm,
)
from ..guards import (CheckpointError, durable_replace, load_error_cause, non_finite, read_json,  # noqa: F401
                      refused_pickle, state_dict_mismatch, torch_load_tensors)
from ..models.dit import DiT
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


def config_changes(ckpt: Checkpoint, train_config: dict, model_config: dict) -> dict[str, tuple]:
    """``{flag name: (checkpoint value, new value)}`` for every model-config key (the whole
    architecture: preset sizes, attention and its options, classes, objective type) and
    every training key ``resume_rules.RESUME_RULES`` refuses (objective, VAE, a teacher's, REPA's, when
    it applies) that differs between ``ckpt`` and a run about to resume from it."""
    import inspect

    from .config import MODEL_OVERRIDES, OBJECTIVE_OPTIONS, flag_name
    from .resume_rules import RESUME_RULES, RESUME_WHEN

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


