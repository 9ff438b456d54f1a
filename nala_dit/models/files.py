"""Stored model configs checked against their weights files before a model is built.

* ``check_model_config``: a stored model config (``state.json``'s ``model_config``, a
  pipeline's ``transformer/config.json``) holds only known keys of the types ``DiT``
  takes, counts >= 1 and a label dropout in [0, 1).
* ``check_config_fits``: the sizes a config implies agree with the tensors of its
  weights file, read from the safetensors header (``weight_shapes``) without loading
  them, so an edited ``hidden_size: 65536`` is refused instead of built.
* ``check_transformer_folder``: a pipeline's ``transformer/`` folder, both of the above;
  ``DiT.from_pretrained`` runs it first (and refuses missing or non-finite weights after).
"""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path

import torch

from .presets import check_class_dropout
from ..guards import read_json, state_dict_mismatch

# Config keys that count things: a model with 0 (or fewer) of them is not a model.
COUNT_KEYS = ("input_size", "patch_size", "in_channels", "hidden_size", "depth", "num_heads", "num_classes")
# Config keys older versions wrote -> today's (diffusers configs, checkpoints' state.json).
RENAMED_KEYS = {"pos_embed": "positions"}


def config_keys(config) -> dict:
    """The constructor keys of a stored ``DiT`` config: diffusers' ``_`` keys dropped and the
    keys of older versions renamed (``RENAMED_KEYS``). Every stored config is read through
    this one function (checkpoints, pipeline folders, ``DiT.from_config`` / ``from_pretrained``)."""
    return {RENAMED_KEYS.get(k, k): v for k, v in dict(config).items() if not str(k).startswith("_")}


_TYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str, "None": type(None), "list": list, "dict": dict}


def _dit_parameters(model_class) -> dict[str, inspect.Parameter]:
    return {k: p for k, p in inspect.signature(model_class.__init__).parameters.items() if k != "self"}


def _allowed_types(param: inspect.Parameter) -> tuple[type, ...]:
    """The types a ``DiT.__init__`` argument takes, from its annotation (``"int | None"``),
    else from its default's type; () when neither says."""
    annotation = param.annotation
    if isinstance(annotation, str):
        names = [part.strip().split("[")[0] for part in annotation.split("|")]
        if all(n in _TYPE_NAMES for n in names):
            return tuple(_TYPE_NAMES[n] for n in names)
    if param.default is not inspect.Parameter.empty and param.default is not None:
        return (type(param.default),)
    return ()


def _describe(types: tuple[type, ...]) -> str:
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return " or ".join(words.get(t, t.__name__) for t in types)


def _fits(value, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True  # JSON writes 4.0 as 4
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, types)


def check_model_config(config, where: str, model_class, fix: str = "restore the file written with the weights, or "
                                                                    "export the model again") -> dict:
    """The constructor keys of a stored ``DiT`` config (``dit.config_keys``: diffusers' ``_``
    keys dropped, older versions' keys renamed), after checking every key is known and of the type ``DiT`` takes; else a ValueError
    ``"<where>: 'hidden_size' must be an integer, got '128' (str); <fix>"``."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: the model config must be a JSON object, got {type(config).__name__}; {fix}")
    params = _dit_parameters(model_class)
    keys = config_keys(config)
    unknown = sorted(k for k in keys if k not in params)
    if unknown:
        raise ValueError(f"{where}: unknown model config key(s) {unknown} (this version knows "
                         f"{', '.join(params)}); {fix}")
    for key, value in keys.items():
        types = _allowed_types(params[key])
        if types and not _fits(value, types):
            raise ValueError(f"{where}: {key!r} must be {_describe(types)}, got {value!r} ({type(value).__name__}); "
                             f"{fix}")
        if key in COUNT_KEYS and value < 1:
            raise ValueError(f"{where}: {key!r} must be >= 1, got {value!r}; {fix}")
    if "class_dropout_prob" in keys:   # 1.5 would build a model that never saw a label
        check_class_dropout(keys["class_dropout_prob"], f"{where}: 'class_dropout_prob'", fix)
    return keys


def weight_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of a safetensors file (or of every shard a diffusers
    ``*.safetensors.index.json`` names), read from the headers: nothing is loaded."""
    path = Path(path)
    files = [path]
    if path.name.endswith(".index.json"):
        index = read_json(path, "export or download it again")
        files = sorted({path.parent / name for name in index.get("weight_map", {}).values()})
    return header_shapes(files, lambda file, cause: f"{file}: unreadable safetensors file ({cause}); export or "
                                                    f"download it again")


def header_shapes(files, problem) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from the headers of safetensors ``files`` (nothing is loaded); a file
    that is not one (truncated, a renamed pickle) raises ``ValueError(problem(file, cause))``."""
    from safetensors import safe_open

    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as err:  # safetensors raises its own error types
            cause = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            raise ValueError(problem(file, cause)) from None
    return shapes


def _count(n: int) -> str:
    """``1,412,345 (1.4 M)``: exact, and readable when large."""
    for unit, size in (("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n:,} ({n / size:.1f} {unit})"
    return f"{n:,}"


def check_config_fits(keys: dict, shapes: dict[str, tuple[int, ...]], config_where: str, weights_where: str,
                      model_class) -> None:
    """Refuse a config whose model is not the one in the weights file, before building it.

    The sizes that set every tensor (width, depth, patch, channels, grid, MLP width,
    classes) are compared with the file's tensors first, so the model built next on the
    ``meta`` device (no memory) is never larger than the file; then its parameter count
    and shapes must equal the file's."""
    defaults = {k: p.default for k, p in _dit_parameters(model_class).items() if p.default is not inspect.Parameter.empty}
    c = {**defaults, **keys}
    fix = "one of the two was edited or damaged, or they come from different models: restore the files written together"
    expected = []
    proj = shapes.get("x_embedder.proj.weight")
    if proj is not None and len(proj) == 4:
        expected += [("hidden_size", c["hidden_size"], proj[0]), ("in_channels", c["in_channels"], proj[1]),
                     ("patch_size", c["patch_size"], proj[2])]
    blocks = {name.split(".")[1] for name in shapes if name.startswith("blocks.")}
    if blocks:
        expected.append(("depth", c["depth"], len(blocks)))
    pos = shapes.get("pos_embed")
    if pos is not None and len(pos) == 3 and c["patch_size"] >= 1:
        expected.append(("input_size", (c["input_size"] // c["patch_size"]) ** 2, pos[1]))
    fc1 = shapes.get("blocks.0.mlp.fc1.weight")
    if fc1 is not None and isinstance(c["mlp_ratio"], (int, float)):
        expected.append(("mlp_ratio", int(c["hidden_size"] * c["mlp_ratio"]), fc1[0]))
    table = shapes.get("y_embedder.embedding_table.weight")
    if table is not None:
        expected.append(("num_classes", c["num_classes"] + int(c["class_dropout_prob"] > 0), table[0]))
    wrong = [f"{key} implies {want:,} where the weights have {got:,}" for key, want, got in expected if want != got]
    file_params = sum(math.prod(s) for s in shapes.values())
    if wrong:
        raise ValueError(f"{config_where} does not describe {weights_where} ({_count(file_params)} parameters): "
                         f"{'; '.join(wrong[:3])}; {fix}")
    try:
        with torch.device("meta"):
            model = model_class(**keys)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{config_where}: {str(err).splitlines()[0]}; {fix}") from None
    built = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    implied = sum(math.prod(s) for s in built.values())
    if implied != file_params or built != shapes:
        mismatch = state_dict_mismatch({k: torch.empty(s, device="meta") for k, s in built.items()},
                                       {k: torch.empty(s, device="meta") for k, s in shapes.items()})
        raise ValueError(f"{config_where} implies a model of {_count(implied)} parameters, {weights_where} holds "
                         f"{_count(file_params)} ({mismatch or 'shapes differ'}); {fix}")


TRANSFORMER_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json")


def check_transformer_folder(folder: str | os.PathLike, model_class) -> None:
    """A pipeline's ``transformer/`` folder: its ``config.json`` typed and sized like its weights
    (``model_class``: ``DiT``, whose ``from_pretrained`` calls this)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: {folder.parent} is not a complete pipeline folder; "
                                f"export it again")
    config = read_json(config_file, "export the pipeline again")
    keys = check_model_config(config, str(config_file), model_class)
    weights = next((folder / name for name in TRANSFORMER_WEIGHTS if (folder / name).is_file()), None)
    if weights is None:   # refused before diffusers builds a model of the config's size (and never a pickle .bin)
        raise FileNotFoundError(f"{folder} has no {TRANSFORMER_WEIGHTS[0]}: {folder.parent} is not a complete "
                                f"pipeline folder (weights are read from safetensors only); export it again")
    check_config_fits(keys, weight_shapes(weights), str(config_file), str(weights), model_class)


# ---------------------------------------------------------------- an autoencoder's folder (the VAE)
# Any size an autoencoder's config.json gives (channels, layers, image size) and how many levels:
# far above every published autoencoder, far below what would allocate terabytes.
AUTOENCODER_MAX_SIZE = 1 << 16
AUTOENCODER_MAX_ITEMS = 64


def _annotation_fits(value, annotation) -> bool:
    """``value`` (read from JSON) is of the type an ``__init__`` annotation names: ``int``,
    ``float``, ``bool``, ``str``, ``tuple[int]`` (a JSON list), unions with ``None``. An
    annotation of another kind says nothing (True)."""
    import types
    import typing

    if annotation is inspect.Parameter.empty:
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_annotation_fits(value, arg) for arg in args)
    if annotation is None or annotation is type(None):
        return value is None
    if annotation in (int, float, bool, str):
        return _fits(value, (annotation,))
    if origin in (tuple, list):
        items = [a for a in args if a is not Ellipsis]
        return isinstance(value, (list, tuple)) and all(_annotation_fits(v, items[0]) for v in value) if items \
            else isinstance(value, (list, tuple))
    return True


def _sizes(value):
    """Every integer in a config value (lists included)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _sizes(item)
    elif isinstance(value, int) and not isinstance(value, bool):
        yield value


def autoencoder_class_named(config: dict, where: str) -> type:
    """The diffusers autoencoder class a config's ``_class_name`` names (AutoencoderKL when absent),
    among diffusers' own (``tokenizer.autoencoder_class``)."""
    from .tokenizer import autoencoder_class

    return autoencoder_class(config.get("_class_name", "AutoencoderKL"), where)


def check_autoencoder_folder(folder: str | os.PathLike, cls: type | None = None) -> None:
    """An autoencoder folder's ``config.json`` checked against its weights before diffusers
    builds what it describes (``block_out_channels: [60000]`` is 482 G parameters; a size that
    fits memory would be allocated for real): every key of the type ``cls.__init__`` takes,
    sizes at most ``AUTOENCODER_MAX_SIZE``, lists at most ``AUTOENCODER_MAX_ITEMS`` long, its
    levels and layers as many as the weights hold, then the model built on the ``meta`` device
    (no memory) holding as many parameters as the safetensors file, in the same shapes."""
    import warnings

    folder = Path(folder)
    where = folder / "config.json"
    fix = "save the autoencoder again with save_pretrained, or download it again"
    config = read_json(where, fix)
    if not isinstance(config, dict):
        raise ValueError(f"{where}: must hold a JSON object, got {type(config).__name__}; {fix}")
    cls = cls or autoencoder_class_named(config, str(where))
    params = {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}
    for key, value in config.items():
        if key in params and not _annotation_fits(value, params[key].annotation):
            kind = params[key].annotation
            kind = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
            raise ValueError(f"{where}: {key!r} must be {kind}, got {str(value)[:40]!r} "
                             f"({type(value).__name__}); {fix}")
        too_big = [v for v in _sizes(value) if abs(v) > AUTOENCODER_MAX_SIZE]
        if key in params and (too_big or isinstance(value, list) and len(value) > AUTOENCODER_MAX_ITEMS):
            what = f"{too_big[0]:,}" if too_big else f"{len(value):,} items"
            raise ValueError(f"{where}: {key!r} {what} is beyond any autoencoder (sizes up to "
                             f"{AUTOENCODER_MAX_SIZE:,}, lists up to {AUTOENCODER_MAX_ITEMS} items); {fix}")
    weights = next((folder / name for name in TRANSFORMER_WEIGHTS if (folder / name).is_file()), None)
    if weights is None:
        return   # a .bin (read by torch.load(weights_only=True)) or nothing: diffusers says which
    shapes = weight_shapes(weights)
    levels = {n.split(".")[2] for n in shapes if n.startswith("encoder.down_blocks.")}
    layers = {n.split(".")[4] for n in shapes if n.startswith("encoder.down_blocks.0.resnets.")}
    implied = [("block_out_channels", len(config.get("block_out_channels") or ()), len(levels), "levels"),
               ("layers_per_block", config.get("layers_per_block"), len(layers), "layers per level")]
    for key, want, got, what in implied:   # before the meta build, which takes time per module
        if key in config and got and want != got:
            raise ValueError(f"{where}: {key!r} implies {want:,} {what} where {weights} holds {got:,}; {fix}")
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = cls.from_config(config)
    except Exception as err:   # diffusers' and torch's constructors raise many types
        raise ValueError(f"{where}: does not build a {cls.__name__} ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:120] if str(err) else ''}); {fix}") from None
    built = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    counts = sum(math.prod(s) for s in built.values()), sum(math.prod(s) for s in shapes.values())
    differ = [f"{k}: {shapes[k]} in the file, {built[k]} by the config" for k in built if k in shapes and
              built[k] != shapes[k]]
    if counts[0] != counts[1] or differ:
        raise ValueError(f"{where} implies a {cls.__name__} of {_count(counts[0])} parameters, {weights} holds "
                         f"{_count(counts[1])}{' (' + differ[0] + ')' if differ else ''}; one of the two was edited "
                         f"or damaged: restore the files written together")
