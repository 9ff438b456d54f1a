"""Checks on what a user (or an attacker) hands us, made before anything is built,
allocated or written; each failure is one line naming the file or flag, the problem and
the way out.

* ``check_model_config``: a stored model config (``state.json``'s ``model_config``, a
  pipeline's ``transformer/config.json``) holds only known keys of the types ``DiT``
  takes.
* ``check_config_fits``: the sizes a config implies agree with the tensors of its
  weights file, read from the safetensors header (``weight_shapes``) without loading
  them, so an edited ``hidden_size: 65536`` is refused instead of built.
* ``load_transformer``: a pipeline folder's transformer, checked both ways and for
  non-finite weights (``refuse_non_finite``).
* ``check_sample_memory``: a lower bound on what sampling at a size needs, against the
  memory this machine has, before the first allocation.
* ``check_writable``: an output path can be written, checked before the work that fills it.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from pathlib import Path

import torch

class NonFiniteError(FloatingPointError, ValueError):
    """Samples or weights holding NaN or inf (a ValueError too: the CLIs print it in one line)."""


class TooLargeError(MemoryError, ValueError):
    """A request that cannot fit in this machine's memory, refused before allocating."""


def check_finite_samples(x: torch.Tensor) -> None:
    """Refuse a batch of samples (B, ...) holding NaN or inf: cast to uint8 NaN becomes 0
    (a black image, scored as if real)."""
    finite = torch.isfinite(x).flatten(1).all(1)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        raise NonFiniteError(
            f"{len(bad)} of {len(x)} samples hold NaN or inf (first: sample {bad[0]} of its batch), so no image is "
            f"written: the weights hold non-finite values or the guidance is too strong for the precision; check "
            f"the model (export or train it again) and use a guidance scale of a few units")


# Config keys that count things: a model with 0 (or fewer) of them is not a model.
COUNT_KEYS = ("input_size", "patch_size", "in_channels", "hidden_size", "depth", "num_heads", "num_classes")
_TYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str, "None": type(None), "list": list, "dict": dict}


def _dit_parameters() -> dict[str, inspect.Parameter]:
    from .models import DiT

    return {k: p for k, p in inspect.signature(DiT.__init__).parameters.items() if k != "self"}


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


def check_model_config(config, where: str, fix: str = "restore the file written with the weights, or export "
                                                       "the model again") -> dict:
    """The constructor keys of a stored ``DiT`` config (diffusers' ``_`` keys dropped),
    after checking every key is known and of the type ``DiT`` takes; else a ValueError
    ``"<where>: 'hidden_size' must be an integer, got '128' (str); <fix>"``."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: the model config must be a JSON object, got {type(config).__name__}; {fix}")
    params = _dit_parameters()
    keys = {k: v for k, v in config.items() if not str(k).startswith("_")}
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
    return keys


def weight_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of a safetensors file (or of every shard a diffusers
    ``*.safetensors.index.json`` names), read from the headers: nothing is loaded."""
    from safetensors import safe_open

    path = Path(path)
    files = [path]
    if path.name.endswith(".index.json"):
        index = json.loads(path.read_text())
        files = sorted({path.parent / name for name in index.get("weight_map", {}).values()})
    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{file}: unreadable safetensors file ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}); export or download it again") from None
    return shapes


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def check_config_fits(keys: dict, shapes: dict[str, tuple[int, ...]], config_where: str, weights_where: str) -> None:
    """Refuse a config whose model is not the one in the weights file, before building it.

    The sizes that set every tensor (width, depth, patch, channels, grid, MLP width,
    classes) are compared with the file's tensors first, so the model built next on the
    ``meta`` device (no memory) is never larger than the file; then its parameter count
    and shapes must equal the file's."""
    from .models import DiT

    defaults = {k: p.default for k, p in _dit_parameters().items() if p.default is not inspect.Parameter.empty}
    c = {**defaults, **keys}
    fix = f"the config was edited or belongs to other weights: restore {config_where} or use the weights it came with"
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
            model = DiT(**keys)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{config_where}: {str(err).splitlines()[0]}; {fix}") from None
    built = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    implied = sum(math.prod(s) for s in built.values())
    if implied != file_params or built != shapes:
        from .checkpoint import state_dict_mismatch

        mismatch = state_dict_mismatch({k: torch.empty(s, device="meta") for k, s in built.items()},
                                       {k: torch.empty(s, device="meta") for k, s in shapes.items()})
        raise ValueError(f"{config_where} implies a model of {_count(implied)} parameters, {weights_where} holds "
                         f"{_count(file_params)} ({mismatch or 'shapes differ'}); {fix}")


def refuse_non_finite(module: torch.nn.Module, where: str) -> None:
    """A ValueError naming the first tensor of ``module`` holding a NaN or inf."""
    from .checkpoint import non_finite

    if problem := non_finite(module.state_dict(), "its"):
        raise ValueError(f"{where}: {problem}: the weights are damaged or come from a run that diverged; export "
                         f"them again from a good checkpoint")


TRANSFORMER_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json")


def check_transformer_folder(folder: str | os.PathLike) -> None:
    """A pipeline's ``transformer/`` folder: its ``config.json`` typed and sized like its weights."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: {folder.parent} is not a complete pipeline folder; "
                                f"export it again")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as err:
        raise ValueError(f"{config_file}: not valid JSON ({err}); export the pipeline again") from None
    keys = check_model_config(config, str(config_file))
    weights = next((folder / name for name in TRANSFORMER_WEIGHTS if (folder / name).is_file()), None)
    if weights is not None:
        check_config_fits(keys, weight_shapes(weights), str(config_file), str(weights))


def load_transformer(folder: str | os.PathLike):
    """``DiT.from_pretrained(folder)`` after ``check_transformer_folder``, refusing weights
    left on ``meta`` (missing) and non-finite ones."""
    from .models import DiT
    from .sources import assert_no_meta

    check_transformer_folder(folder)
    model = DiT.from_pretrained(str(folder))
    assert_no_meta(model, str(folder))
    refuse_non_finite(model, str(folder))
    return model


# ------------------------------------------------------------------ sampling memory
def available_memory(device) -> tuple[int, str]:
    """(bytes free, what was asked) for a device: CUDA's free memory, else the host's
    ``MemAvailable`` (Linux) or total physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {torch.cuda.get_device_name(device)}"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available RAM"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "RAM"


def sample_memory(model, latent_hw: tuple[int, int], batch: int, vae_factor: int = 1, guided: bool = False) -> int:
    """A lower bound on the bytes one sampling batch holds at once (fp32): the noise and
    the model output per latent pixel; per token, at the MLP's activation, the block's
    input, the MLP's input, its first layer's output and the activation's (``Mlp``
    keeps all four alive); the decoded RGB pixels. Guidance runs the model on 2× the
    batch. Weights, attention buffers and the VAE decoder's activations come on top."""
    h, w = latent_hw
    cfg = model.config
    tokens = (h // cfg.patch_size) * (w // cfg.patch_size)
    runs = 2 * batch if guided else batch
    model_bytes = runs * (h * w * (model.in_channels + model.out_channels)
                          + tokens * cfg.hidden_size * (2 + 2 * cfg.mlp_ratio))
    return int(4 * (model_bytes + batch * 3 * h * w * vae_factor ** 2))


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def check_sample_memory(model, latent_hw: tuple[int, int] | None, batch: int, vae_factor: int, device,
                        what: str, fix: str, guided: bool = False) -> None:
    """Refuse, before any allocation, a sampling batch whose lower-bound memory
    (``sample_memory``) exceeds what ``device`` has free."""
    if latent_hw is None:
        return
    need = sample_memory(model, latent_hw, batch, vae_factor, guided)
    have, kind = available_memory(device)
    if need > have:
        h, w = latent_hw
        raise TooLargeError(f"{what}: sampling {batch} image(s) of {h * vae_factor}x{w * vae_factor} px needs at least "
                          f"{_bytes(need)} of memory, this machine has {_bytes(have)} {kind}; {fix}")


# ------------------------------------------------------------------ outputs
def check_writable(path: str | os.PathLike, flag: str, folder: bool = False, image: bool = False) -> None:
    """Refuse an output path that cannot be written, before the work that fills it: an
    existing folder where a file goes (or a file where a folder goes), a parent that is
    a file, no write permission, or (``image``) a file name PIL cannot save to. Creates nothing."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        kind = "a folder" if path.is_dir() else "a file"
        raise ValueError(f"{flag} {path}: {kind} is in the way; choose another {flag}")
    if image:
        from PIL import Image

        if path.suffix.lower() not in Image.registered_extensions():
            raise ValueError(f"{flag} {path}: {path.suffix or 'no extension'} is not an image format PIL can write; "
                             f"use e.g. .png")
    parent = path if folder and path.exists() else path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder; choose another {flag}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{flag} {path}: cannot write in {parent} (permission denied); choose another {flag}")
