"""Everything that turns files into a model ready to sample, below both the pipelines
and the samplers: ``pipeline.py`` and ``sample_files.py`` import this module, never each other.

* ``load_source``: a training checkpoint (checkpoint folder, ``checkpoints/`` or run
  folder: latest checkpoint) or an exported pipeline folder → ``Source`` (model,
  objective, VAE, scaling factor, latent normalisation, class names, provenance). A
  pipeline folder is read from its files (``model_index.json``, ``transformer/``,
  ``vae/``), exactly what its pipeline class holds, without building the pipeline.
* labels: class ids from ids or names, the class names of a training set, label files.
* the published DiT / SiT ``.pt`` weights → our softmax ``DiT`` (``load_official_source``:
  as a ``Source``, for ``app.py``).
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoints.ema import ema_warning_once
from ..checkpoints.read import build_objective, checkpoint_norm, load_model
from ..diffusion.choices import check_diffusion_steps
from ..checks import did_you_mean
from ..guards import (CheckpointError, assert_no_meta, non_finite, read_json, refuse_non_finite,  # noqa: F401
                      torch_load_tensors)  # (assert_no_meta re-exported)
from ..data.latent_stats import LatentNorm
from ..models.files import check_autoencoder_folder, check_transformer_folder
from ..models.dit import DiT
from ..models.tokenizer import check_fits
from ..models.vae import DEFAULT_SCALING_FACTOR, load_vae

# A pipeline folder's class (model_index.json "_class_name") → the objective it runs.
PIPELINE_OBJECTIVES = {"NaLaDiTPipeline": "diffusion", "NaLaSiTPipeline": "transport"}


@dataclass
class Source:
    """A model ready to sample: weights, objective, decoder, class names, provenance."""

    model: torch.nn.Module
    objective: object
    vae: object = None
    scaling_factor: float = 0.18215
    id2label: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    # model space → VAE latents as trained (what decoding undoes); None: the scalar scaling_factor
    latent_norm: LatentNorm | None = None

    def __post_init__(self):
        if self.latent_norm is None:
            self.latent_norm = LatentNorm.scalar(self.scaling_factor)

    @property
    def num_classes(self) -> int:
        return self.model.config.num_classes


def load_source(path: str | os.PathLike, weights: str = "ema", vae: str | None = None, device="cpu") -> Source:
    """A training checkpoint (folder, ``checkpoints/`` or run folder) or a pipeline folder."""
    from ..data import datasets as data_lib

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint or pipeline folder at {path}{did_you_mean(path)}")
    if (path / "model_index.json").is_file():
        if weights != "ema":
            raise ValueError(f"--weights {weights}: a pipeline folder holds one set of weights (exported from "
                             f"the checkpoint's EMA by default); export the raw weights with "
                             f"`export.py checkpoint --weights model` instead")
        return load_pipeline_folder(path, vae, device)
    model, ckpt = load_model(path, weights)
    if weights == "ema" and (warning := ema_warning_once(ckpt)):
        print(f"warning: {warning}", file=sys.stderr)
    try:   # a stored value out of range (an edited diffusion-steps) is the file's fault: name it
        objective = build_objective(ckpt.model_config, ckpt.config)
    except ValueError as err:
        raise CheckpointError(f"{ckpt.path / 'state.json'}: {err}; the file was edited or damaged: restore it, or "
                              f"use another checkpoint") from None
    model = model.to(device)
    vae_path = vae or ckpt.config.get("vae")
    vae_model, scaling, norm = None, DEFAULT_SCALING_FACTOR, None
    if vae_path:
        vae_model, scaling = load_vae(vae_path, device)
        check_fits(vae_model, model.config.in_channels, vae_path)
        norm = checkpoint_norm(ckpt)
        scaling = norm.scale if norm is not None and norm.mode == "scalar" else scaling
    info = dict(model=ckpt.config.get("model"), checkpoint=str(ckpt.path), step=ckpt.step, weights=weights,
                vae=vae_path)
    return Source(model, objective, vae_model, scaling, default_id2label(ckpt.config, model.config.num_classes),
                  info, norm)


def read_pipeline_index(path: str | os.PathLike) -> dict:
    """A pipeline folder's ``model_index.json``, checked to be one of our pipelines."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{index} not found: {path} is not a saved pipeline folder")
    config = read_json(index, "export the pipeline again")
    name = config.get("_class_name") if isinstance(config, dict) else None
    if not isinstance(name, str) or name not in PIPELINE_OBJECTIVES:
        what = f"a {name}" if isinstance(name, str) else f"_class_name {name!r}"
        raise ValueError(f"{index}: holds {what}, not one of {sorted(PIPELINE_OBJECTIVES)}; export the pipeline "
                         f"again with export.py")
    return config


def check_pipeline_folder(path, subfolder: str | None = None) -> None:
    """The checks our ways into a local pipeline folder run before diffusers reads it
    (``NaLaDiTPipeline.from_pretrained``, ``load_pipeline``, ``sample.py``; diffusers' own
    ``DiffusionPipeline.from_pretrained`` is left as diffusers made it: ``register.py``):
    ``model_index.json`` and every component's config read with the guarded reader (invalid
    or deeply nested JSON, a list instead of an object: one line naming the file), and for
    our pipelines the transformer's ``config.json`` checked against its weights' header
    (types, sizes: an edited ``hidden_size`` is refused before anything is built). Hub ids
    and folders without ``model_index.json`` are left to diffusers."""
    if not isinstance(path, (str, os.PathLike)):
        return
    root = Path(path) / subfolder if subfolder else Path(path)
    index = root / "model_index.json"
    if not index.is_file():
        return
    fix = "export the pipeline again"
    config = read_json(index, fix)
    if not isinstance(config, dict):
        raise ValueError(f"{index}: must hold a JSON object (a pipeline's components), got {type(config).__name__}; "
                         f"{fix}")
    if "_class_name" in config and not isinstance(config["_class_name"], str):   # diffusers looks it up by name
        raise ValueError(f"{index}: _class_name must be a string (the pipeline class), got "
                         f"{type(config['_class_name']).__name__} {str(config['_class_name'])[:60]}; {fix}")
    for name, value in config.items():
        if name.startswith("_") or not isinstance(value, list) or not (root / name).is_dir():
            continue
        for file in ("config.json", "scheduler_config.json"):
            if (root / name / file).is_file():
                component = read_json(root / name / file, fix)
                if not isinstance(component, dict):
                    raise ValueError(f"{root / name / file}: must hold a JSON object, got "
                                     f"{type(component).__name__}; {fix}")
                if file == "scheduler_config.json":   # diffusers allocates tables of num_train_timesteps entries
                    check_diffusion_steps(component.get("num_train_timesteps", 1000),
                                          f"{root / name / file}: 'num_train_timesteps'", fix)
    if isinstance(config.get("objective_config"), dict) and "diffusion-steps" in config["objective_config"]:
        check_diffusion_steps(config["objective_config"]["diffusion-steps"],
                              f"{index}: objective_config 'diffusion-steps'", fix)
    if config.get("_class_name") in PIPELINE_OBJECTIVES and (root / "transformer").is_dir():
        check_transformer_folder(root / "transformer", DiT)
    if config.get("_class_name") in PIPELINE_OBJECTIVES and (root / "vae" / "config.json").is_file():
        check_autoencoder_folder(root / "vae")


def load_pipeline_folder(path: str | os.PathLike, vae: str | None = None, device="cpu") -> Source:
    """The ``Source`` a saved ``NaLaDiTPipeline`` / ``NaLaSiTPipeline`` folder holds: its
    transformer, its VAE (stored inside, else ``vae_path``; ``vae`` overrides both), its
    objective settings, scaling factor and class names, as the pipeline itself uses them."""

    path = Path(path)
    config = read_pipeline_index(path)
    check_pipeline_folder(path)   # every component's JSON, as the pipelines' own loaders check it
    model = DiT.from_pretrained(str(path / "transformer")).to(device).eval()
    if vae is not None:
        vae_model, _ = load_vae(vae, device)
        check_fits(vae_model, model.config.in_channels, vae)
    elif (config.get("vae") or [None])[0] is not None:
        vae_model, _ = load_vae(str(path / "vae"), device)
        assert_no_meta(vae_model, f"{path}/vae")
        refuse_non_finite(vae_model, f"{path}/vae")
    elif config.get("vae_path"):
        vae_model, _ = load_vae(config["vae_path"], device)
    else:
        vae_model = None
    id2label = check_id2label(config.get("id2label"), model.config.num_classes,
                              f"{path / 'model_index.json'}: id2label", "export the pipeline again")
    norm = config.get("latent_norm")
    norm = None if norm is None else LatentNorm.from_dict(norm, f"{path / 'model_index.json'} 'latent_norm'")
    return Source(model, build_objective(dict(model.config), dict(config.get("objective_config") or {})),
                  vae_model, resolve_scaling_factor(config.get("scaling_factor"), vae_model), id2label,
                  dict(config.get("source") or {}, pipeline=str(path)), norm)


def resolve_scaling_factor(stored: float | None, vae=None) -> float:
    """The latent scaling factor: the stored one, else the tokenizer's (``tokenizer.describe``:
    its config's, 1 where the class scales itself or names none), else the SD VAE's."""
    from ..models.tokenizer import describe

    if stored is not None:
        return float(stored)
    return describe(vae).scaling if vae is not None else DEFAULT_SCALING_FACTOR


# Labels.


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", " ")


def label_lookup(id2label: dict[int, str]) -> dict[str, int]:
    """Every spelling of every class name → id; ImageNet names list synonyms with ", "."""
    lookup = {}
    for idx, names in id2label.items():
        lookup[_normalise(names)] = int(idx)
        for synonym in names.split(","):
            lookup.setdefault(_normalise(synonym), int(idx))
    return lookup


def resolve_labels(labels, id2label: dict[int, str], num_classes: int) -> list[int]:
    """Class ids from ids, id strings or class names (``golden_retriever`` = "golden retriever")."""
    if isinstance(labels, (int, str)):
        labels = [labels]
    lookup = label_lookup(id2label)
    ids, unknown = [], []
    for label in labels:
        if isinstance(label, str) and label.strip().lstrip("-").isdigit():
            label = int(label)
        if isinstance(label, str):
            if _normalise(label) in lookup:
                ids.append(lookup[_normalise(label)])
            else:
                unknown.append(label)
            continue
        label = int(label)
        if not 0 <= label < num_classes:
            raise ValueError(f"class id {label} is out of range: this model has {num_classes} classes "
                             f"(0..{num_classes - 1})")
        ids.append(label)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(_normalise(name), list(lookup), n=3)
            hints.append(f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise ValueError(f"unknown class name(s): {'; '.join(hints)}. Known classes: "
                         f"{', '.join(list(id2label.values())[:20])}{' ...' if len(id2label) > 20 else ''}")
    return ids


def check_id2label(id2label, num_classes: int, where: str = "id2label", fix: str = "") -> dict[int, str]:
    """Class names as a pipeline holds them: ``{id: name}`` for every id 0..num_classes-1 once
    (ids as ints or digit strings, JSON's keys), each name a non-empty string; empty or None:
    the ids as text. Anything else is one line naming ``where`` (a name past the model's
    classes would pick the null class, or index past the embedding table)."""
    fix = f"; {fix}" if fix else ""
    if not id2label:
        return {i: str(i) for i in range(num_classes)}
    if not isinstance(id2label, dict):
        raise ValueError(f"{where} must be an object {{class id: name}}, got a {type(id2label).__name__}{fix}")
    if len(id2label) != num_classes:
        raise ValueError(f"{where} has {len(id2label):,} names but the model has {num_classes} classes "
                         f"(ids 0..{num_classes - 1}){fix}")
    names = {}
    for key, name in id2label.items():
        idx = key if type(key) is int else int(key) if isinstance(key, str) and key.isdigit() and len(key) < 10 else None
        if idx is None or not 0 <= idx < num_classes:
            raise ValueError(f"{where}: key {str(key)[:40]!r} is not a class id of this model (0..{num_classes - 1})"
                             f"{fix}")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}: the name of class {idx} must be a non-empty string, got "
                             f"{type(name).__name__} {str(name)[:40]}{fix}")
        names[idx] = name
    if len(names) != num_classes:
        raise ValueError(f"{where}: class ids repeat ({sorted(id2label)[:6]}...): each of 0..{num_classes - 1} "
                         f"needs one name{fix}")
    return names


def default_id2label(train_config: dict, num_classes: int) -> dict[int, str]:
    """Class names of the training data when they can be found (``data/sources.py``: its source's
    ``class_names``), else the ids as text."""
    from ..data.sources import class_names

    names = class_names(train_config.get("data"))
    if not names or len(names) != num_classes:
        names = [str(i) for i in range(num_classes)]
    return dict(enumerate(names))


def read_labels_file(path: str | os.PathLike) -> dict[int, str]:
    """``id2label`` from a JSON object/list or a text file with one class name per line;
    a file that is neither is one line naming it."""
    fix = "--labels-file takes a .json list of names or object {id: name}, or one name per line"
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--labels-file {path}: no such file{did_you_mean(path)}")
    if path.suffix == ".json":
        data = read_json(path, fix)
        if isinstance(data, list):
            return dict(enumerate(map(str, data)))
        if not isinstance(data, dict):
            raise ValueError(f"{path}: holds a JSON {type(data).__name__}; {fix}")
        try:
            return {int(k): str(v) for k, v in data.items()}
        except ValueError:
            raise ValueError(f"{path}: its keys must be class ids (0, 1, ...); {fix}") from None
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file; {fix}") from None
    return dict(enumerate(line.strip() for line in text.splitlines() if line.strip()))


# Published weights.


def load_official_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The weights of a published DiT/SiT ``.pt``: a plain state dict, or SiT's training
    dict with "ema"/"model" entries (EMA preferred). Read with ``weights_only=True``."""
    import argparse

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"official checkpoint not found: {path} (e.g. DiT-XL-2-256x256.pt from "
                                f"https://dl.fbaipublicfiles.com/DiT/models/, downloaded on a connected machine)")
    # SiT's training checkpoints also pickle their argparse namespace; allow just that class.
    state = torch_load_tensors(path, safe_globals=(argparse.Namespace,))
    for key in ("ema", "model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a DiT/SiT state dict (expected tensors, or an 'ema'/'model' entry)")
    if problem := non_finite(state, "its"):  # as export.py checkpoint refuses a diverged run's weights
        raise CheckpointError(f"{path}: {problem}: the file is damaged or the run that wrote it diverged; "
                              f"download it again or use another checkpoint")
    return {k.removeprefix("module."): v for k, v in state.items()}


# The VAE the published DiT and SiT models were trained with (export.py official's default).
OFFICIAL_VAE = "stabilityai/sd-vae-ft-ema"


def load_official_source(path: str | os.PathLike, model_name: str, image_size: int = 256, num_classes: int = 1000,
                         vae: str | None = None, device="cpu") -> Source:
    """A published DiT / SiT ``.pt`` as a ``Source``: the model ``export.py official``
    exports (same weights, objective settings and VAE scaling), so sampling it gives the
    images ``sample.py`` makes from that export. ``vae``: a folder or hub id (default
    ``OFFICIAL_VAE``, which must be in the local cache or a folder offline)."""

    model = model_from_official(load_official_state_dict(path), model_name, image_size, num_classes).to(device)
    vae_path = vae or OFFICIAL_VAE
    vae_model, scaling = load_vae(vae_path, device)
    info = dict(model=model_name, checkpoint=str(path), weights="official", vae=vae_path)
    return Source(model, build_objective(dict(model.config), {}), vae_model, scaling,
                  {i: str(i) for i in range(num_classes)}, info)


def model_from_official(state: dict[str, torch.Tensor], model_name: str, image_size: int = 256,
                        num_classes: int = 1000) -> DiT:
    """Our softmax DiT holding official weights (``load_state_dict(strict=True)``).

    ``learn_sigma`` and the input channels are read off the weights (SiT's released models
    keep DiT's 8 output channels; our samplers use the first 4). Any other mismatch with
    the preset is an error that names the tensor and the likely cause.
    """
    from ..models.dit import create_model

    if model_name not in _softmax_presets():
        raise ValueError(f"--model {model_name!r}: official checkpoints are softmax DiT/SiT; choose one of "
                         f"{', '.join(_softmax_presets())}")
    if image_size % 8:
        raise ValueError(f"--image-size {image_size} must be a multiple of 8 (the SD VAE downsamples by 8)")
    overrides = dict(input_size=image_size // 8, num_classes=num_classes)
    if "x_embedder.proj.weight" in state and "final_layer.linear.weight" in state:
        in_channels = state["x_embedder.proj.weight"].shape[1]
        patch = state["x_embedder.proj.weight"].shape[-1]
        out_channels = state["final_layer.linear.weight"].shape[0] // (patch * patch)
        overrides.update(in_channels=in_channels, learn_sigma=out_channels == 2 * in_channels)
    model = create_model(model_name, **overrides)
    expected = model.state_dict()
    problems = [f"missing {k}" for k in expected if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in expected]
    problems += [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
                 for k, v in state.items() if k in expected and v.shape != expected[k].shape]
    if problems:
        hints = []
        proj = state.get("x_embedder.proj.weight")
        if proj is not None and proj.shape[-1] != model.patch_size:
            hints.append(f"the checkpoint uses patch size {proj.shape[-1]}, {model_name} uses {model.patch_size}")
        table = state.get("y_embedder.embedding_table.weight")
        if table is not None and table.shape[0] != expected["y_embedder.embedding_table.weight"].shape[0]:
            hints.append(f"the checkpoint has {table.shape[0] - 1} classes (+ the null row); pass "
                         f"--num-classes {table.shape[0] - 1}")
        pos = state.get("pos_embed")
        want = expected["pos_embed"].shape
        if not hints and pos is not None and pos.shape[-1] == want[-1] and pos.shape != want:
            side = int(round(pos.shape[1] ** 0.5)) * model.patch_size * 8
            hints.append(f"the position table fits --image-size {side}")
        if not hints:
            hints.append(f"the checkpoint is not a {model_name} (depth, width or patch size differ)")
        raise ValueError(f"checkpoint does not fit --model {model_name}: {'; '.join(hints)}. "
                         f"{len(problems)} mismatches, e.g. {problems[:4]}")
    model.load_state_dict(state, strict=True)
    return model.eval()


def _softmax_presets() -> list[str]:
    from ..models.dit import MODELS

    return [name for name in MODELS if name.startswith(("DiT-", "SiT-"))]
