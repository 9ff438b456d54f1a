"""The VAE: loading it (``load_vae``: a local folder or a hub id, one line offline; any diffusers
image autoencoder its config.json names, ``tokenizer.py``) and decoding latents with it, tiled
and sliced when the image is large. Tiling is diffusers' ``tile_sample_min_size`` scheme of the
KL family (``tiles``); a class without it (DC-AE, RAE) decodes in one piece and refuses
``--vae-tiling on`` / ``--vae-tile-size`` in one line.

diffusers' ``AutoencoderKL`` decodes in one piece by default. Its last level holds
128 channels at full resolution and its mid-block attends over every latent pixel, so
the fp32 peak grows with the pixel count: 0.75 GiB at 512², 3 GiB at 1024², 12 GiB at
2048², 48 GiB at 4096² (``docs/highres.md``). diffusers' own switches bound it:

* ``vae.enable_tiling()``: the latent is cut into tiles of ``tile_latent_min_size``
  latent px (``tile_sample_min_size`` image px), each decoded alone; neighbours overlap
  by ``tile_overlap_factor`` (¼) of a tile and are blended linearly there. Only a latent
  larger than one tile is tiled.
* ``vae.enable_slicing()``: a batch is decoded one image at a time.

``decoding`` sets these for one decode and puts the VAE's own settings back afterwards
(also after an error). Modes (``--vae-tiling``, the pipelines' ``vae_tiling=``):

* ``auto`` (default): tile an image larger than ``VAE_AUTO_TILING_PIXELS`` (1024² px),
  slice a batch whose pixels together exceed it, and otherwise keep what the VAE is set
  to (``pipe.vae.enable_tiling()``, diffusers' convention, still works);
* ``on``: tile and slice whatever the size;
* ``off``: one piece, even on a VAE set to tile.

Tile size: ``tile_size`` image px (``--vae-tile-size``), else ``VAE_TILE_PIXELS`` (512)
when tiling is switched on here, else the VAE's own.

Where the seams are (P = tile px, s = ¾P the tile stride, E = ¼P): tile k covers image
px [k·s, k·s + P) along each axis; px [k·s, k·s + E) blend tile k−1 (weight 1 − x/E)
with tile k (weight x/E); px [k·s + E, (k+1)·s) come from tile k alone. That layout
needs ¾ of a tile to be whole latent px, hence tile sizes in multiples of 4 × the VAE
factor (32 px for the f8 VAEs).

Tiling changes pixels beyond the blend bands too: each tile sees only its own latent
(the decoder's receptive field is cut at the tile edge, and GroupNorm statistics and
the mid-block attention are per tile). ``auto`` therefore leaves every size up to 1024²
px untiled, so metrics at trained sizes are unaffected; slicing changes nothing but
float rounding.
"""

from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager
from pathlib import Path


# Decoding big latents. "auto" tiles an image above one megapixel (1024² px): up
# to there an fp32 SD-VAE decode peaks at 3 GiB (counted, docs/highres.md) and
# tiles would change the pixels of the sizes models are trained and scored at; above it
# the untiled peak grows 4x per doubling of the side (12 GiB at 2048², 48 GiB at 4096²).
# It also slices (one image at a time) a batch whose pixels together exceed it.
VAE_TILING_MODES = ("auto", "on", "off")
VAE_AUTO_TILING_PIXELS = 1024 * 1024
# Default tile side when tiling is switched on here: 512 px (64 latent px), whose fp32
# decode peaks at 0.75 GiB, as a 512² image does.
VAE_TILE_PIXELS = 512

# The mode and tile size that ``decode`` uses when its caller passes none: set by the
# CLIs around the code that samples (``decode_settings``), default ("auto", None).
_SETTINGS = contextvars.ContextVar("nala_dit_vae_decoding", default=("auto", None))
from .tokenizer import DEFAULT_SCALING_FACTOR  # noqa: E402,F401  (the SD VAE's, for configs that predate the field)
_STATE = ("use_tiling", "use_slicing", "tile_sample_min_size", "tile_latent_min_size")


def vae_factor(vae) -> int:
    """Image px per latent px, as the tokenizer's config and a probe encode give it (``tokenizer.py``)."""
    from .tokenizer import spatial_factor

    return spatial_factor(vae)


def tiles(vae) -> bool:
    """Whether ``vae`` has the tiled decode this module drives (diffusers' ``tile_sample_min_size``
    and ``tile_overlap_factor``: the KL family). DC-AE tiles by another scheme, RAE not at all."""
    return hasattr(vae, "tile_sample_min_size") and hasattr(vae, "tile_overlap_factor")


def no_tiling(vae, flag: str) -> str:
    """The one line for a tiling request ``vae`` cannot follow."""
    return (f"{flag}: {type(vae).__name__} has no tiled decode of diffusers' tile_sample_min_size kind, which this "
            f"repository drives; decode in one piece (--vae-tiling auto or off), sliced one image at a time")


def _tile_fits(pixels: int, factor: int, overlap: float) -> bool:
    """diffusers' tiled_decode advances ``int(L·(1 − overlap))`` latent px per tile but keeps
    ``P − int(P·overlap)`` image px of each: the two must agree or tiles overlap wrongly."""
    latent = pixels // factor
    stride = int(latent * (1 - overlap))
    return pixels % factor == 0 and stride > 0 and stride * factor == pixels - int(pixels * overlap)


def check_tiling_mode(mode, name: str = "--vae-tiling") -> None:
    if mode not in VAE_TILING_MODES:
        raise ValueError(f"{name} must be one of {', '.join(VAE_TILING_MODES)}, got {mode!r}")


def check_tiling(mode, tile_size=None, vae=None, names=("--vae-tiling", "--vae-tile-size")) -> None:
    """A one-line ValueError for an unknown mode, a tile size that is not a positive whole
    number of tiles for ``vae``, or a tile request without a VAE. ``names``: the option
    names to put in the message (CLI flags or keyword arguments)."""
    check_tiling_mode(mode, names[0])
    if mode == "on" and vae is None:
        raise ValueError(f"{names[0]} on: this model samples pixels directly (no VAE), so there is no decode to "
                         f"tile; drop {names[0]}")
    if tile_size is None:
        return
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size <= 0:
        raise ValueError(f"{names[1]} must be a positive number of image pixels, got {tile_size!r}")
    if vae is None:
        raise ValueError(f"{names[1]} {tile_size}: this model samples pixels directly (no VAE), so there is nothing "
                         f"to tile; drop {names[1]}")
    if not tiles(vae):
        raise ValueError(no_tiling(vae, f"{names[1]} {tile_size}") + f"; drop {names[1]}")
    factor, overlap = vae_factor(vae), vae.tile_overlap_factor
    if not _tile_fits(tile_size, factor, overlap):
        below = next((p for p in range(tile_size - 1, 0, -1) if _tile_fits(p, factor, overlap)), None)
        above = next(p for p in range(tile_size + 1, tile_size + 64 * factor) if _tile_fits(p, factor, overlap))
        step = next(p for p in range(1, 64 * factor) if _tile_fits(p, factor, overlap))
        choices = " or ".join(str(p) for p in (below, above) if p)
        raise ValueError(f"{names[1]} {tile_size} does not tile this VAE (factor {factor}, tiles overlapping by "
                         f"{overlap:g}): use a multiple of {step} px, e.g. {choices}")


@contextmanager
def decode_settings(tiling: str = "auto", tile_size: int | None = None):
    """The tiling mode and tile size for every ``decode`` inside (the CLIs' flags)."""
    check_tiling_mode(tiling)
    token = _SETTINGS.set((tiling, tile_size))
    try:
        yield
    finally:
        _SETTINGS.reset(token)


def plan(vae, shape, tiling: str | None = None, tile_size: int | None = None) -> dict:
    """What a decode of latents of ``shape`` (B, C, h, w) does: the VAE attributes to set.

    ``tiling``/``tile_size`` None: those of the surrounding ``decode_settings``.
    """
    if tiling is None:
        tiling, context_size = _SETTINGS.get()
        tile_size = context_size if tile_size is None else tile_size
    check_tiling(tiling, tile_size, vae, names=("vae_tiling", "vae_tile_size"))
    if not tiles(vae):      # DC-AE, RAE, a VAE without diffusers' switches: one piece (sliced where it can)
        if tiling == "on":
            raise ValueError(no_tiling(vae, "vae_tiling='on'"))
        big = shape[0] > 1 and shape[0] * shape[-2] * shape[-1] * vae_factor(vae) ** 2 > VAE_AUTO_TILING_PIXELS
        return dict(use_slicing=tiling == "auto" and (vae.use_slicing or big)) if hasattr(vae, "use_slicing") else {}
    batch, pixels = shape[0], shape[-2] * shape[-1] * vae_factor(vae) ** 2
    if tiling == "off":
        tile = slices = False
    elif tiling == "on":
        tile = slices = True
    else:
        tile = vae.use_tiling or pixels > VAE_AUTO_TILING_PIXELS
        slices = vae.use_slicing or (batch > 1 and batch * pixels > VAE_AUTO_TILING_PIXELS)
    settings = dict(use_tiling=tile, use_slicing=slices)
    if tile and (tile_size is not None or not vae.use_tiling):
        size = VAE_TILE_PIXELS if tile_size is None else tile_size
        settings.update(tile_sample_min_size=size, tile_latent_min_size=size // vae_factor(vae))
    return settings


@contextmanager
def decoding(vae, shape, tiling: str | None = None, tile_size: int | None = None):
    """``vae`` set up for decoding latents of ``shape`` (see ``plan``), restored on exit."""
    settings = plan(vae, shape, tiling, tile_size)
    saved = {name: getattr(vae, name) for name in _STATE if hasattr(vae, name)}
    try:
        for name, value in settings.items():
            setattr(vae, name, value)
        yield vae
    finally:
        for name, value in saved.items():
            setattr(vae, name, value)


def vae_load_problem(name_or_path: str, err: BaseException, local: bool) -> str:
    """Why ``from_pretrained`` of the autoencoder failed, in one line. diffusers wraps everything in
    "Unable to load weights": a weights file refused because it is a pickle that asks to run code
    says so (found in the exception chain, worded by ``load_error_cause``); a local folder's
    failure is the folder's, never "Offline?"; only a hub id gets the download advice."""
    import pickle

    from ..guards import load_error_cause, refused_pickle

    cause, seen = err, set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, pickle.UnpicklingError) and refused_pickle(why := load_error_cause(cause)):
            return (f"cannot load the VAE {name_or_path!r}: its weights file (a pickle, .bin) {why}; use a VAE "
                    f"folder with diffusion_pytorch_model.safetensors from a source you trust")
        cause = cause.__cause__ or cause.__context__
    first = str(err).splitlines()[0].strip() if str(err) else type(err).__name__
    if local:
        return (f"cannot load the VAE {name_or_path!r}: {first} (the folder's files are damaged or not a diffusers "
                f"autoencoder's: save it again with save_pretrained, or download it again)")
    return f"cannot load the VAE {name_or_path!r}: {first} Offline? {download_advice(name_or_path)}"


def hub_offline() -> str | None:
    """Why the Hugging Face hub cannot be reached (``HF_HUB_OFFLINE`` set, or no route to its
    endpoint: a TCP connection attempt of at most 2 s), or None when it may be. Behind a
    proxy (``HTTPS_PROXY``) the hub is assumed reachable: only the proxy knows."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    return None if hub_reachable() else f"no network: {constants.ENDPOINT} cannot be reached"


def hub_reachable(timeout: float = 2.0) -> bool:
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def download_advice(hub_id: str) -> str:
    """The offline way out, in words a user can run: ``hf download`` (the pinned
    huggingface_hub's CLI) on a connected machine, then the local folder."""
    folder = hub_id.rstrip("/").rsplit("/", 1)[-1]
    return (f"download it once on a connected machine (`hf download {hub_id} --local-dir {folder}`) and pass the "
            f"local folder (--vae {folder}; from Python, load_vae({folder!r}))")


def vae_folder(name_or_path: str) -> Path:
    """The local folder holding the autoencoder's config.json: the folder itself, or its ``vae/``
    (a pipeline folder); a folder with neither is one line."""
    local = Path(name_or_path)
    if local.exists() and not (local / "config.json").is_file():
        if (local / "vae" / "config.json").is_file():
            return local / "vae"
        raise FileNotFoundError(f"{local} has no config.json: not a diffusers autoencoder folder (config.json + "
                                f"diffusion_pytorch_model.safetensors, as save_pretrained writes)")
    return local


WEIGHTS_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json",
                 "diffusion_pytorch_model.bin")   # what diffusers' from_pretrained reads, safetensors first


def check_weights_file(local: Path) -> None:
    """A local autoencoder folder without its weights is one line naming the missing file (not
    diffusers' search through every name it knows, ending on the .bin)."""
    if not any((local / name).is_file() for name in WEIGHTS_FILES):
        raise FileNotFoundError(f"{local} has a config.json but no weights: {WEIGHTS_FILES[0]} is missing (save the "
                                f"autoencoder with save_pretrained, or download the whole folder again)")


def vae_class(name_or_path: str, local: Path, offline: str | None) -> type:
    """The diffusers autoencoder class the config names (``tokenizer.autoencoder_class``): read
    from the local config.json, or the hub's (the cache only when offline)."""
    from diffusers import AutoencoderKL

    from ..guards import read_json
    from .tokenizer import autoencoder_class

    if local.exists():
        where = local / "config.json"
        config = read_json(where, "save the autoencoder again with save_pretrained")
    else:
        where = f"{name_or_path}/config.json"
        config = AutoencoderKL.load_config(name_or_path, local_files_only=offline is not None)
    if not isinstance(config, dict):
        raise ValueError(f"{where}: must hold a JSON object, got {type(config).__name__}")
    return autoencoder_class(config.get("_class_name"), str(where))


def load_vae(name_or_path: str, device: torch.device | str = "cpu"):
    """A diffusers autoencoder (any class ``tokenizer.autoencoder_classes`` lists: the one its
    config.json names) from a local folder or a hub id, with a clear offline error. Returns
    (vae, scaling_factor): the factor ``tokenizer.describe`` reads from the model (its
    config's, 0.18215 for an AutoencoderKL config that predates the field, 1 where the class
    scales itself or names none). Offline (``HF_HUB_OFFLINE``, or the hub unreachable) a hub id
    is looked up in the local cache only: one line at once, naming the local-folder
    alternative, instead of the hub client's retries."""
    from .files import check_autoencoder_folder
    from .tokenizer import describe

    local = vae_folder(name_or_path)
    if local.exists():
        check_weights_file(local)
    offline = None if local.exists() else hub_offline()
    try:
        cls = vae_class(name_or_path, local, offline)
        if local.exists():
            check_autoencoder_folder(local, cls)   # its config against its weights, before building it
            vae = cls.from_pretrained(str(local))
        else:
            vae = cls.from_pretrained(name_or_path, local_files_only=offline is not None)
    except OSError as err:
        if offline is not None:
            raise OSError(f"cannot load the VAE {name_or_path!r}: offline ({offline}) and not in the local Hugging "
                          f"Face cache; {download_advice(name_or_path)}") from None
        raise OSError(vae_load_problem(name_or_path, err, local.exists())) from None
    vae = vae.to(device).eval().requires_grad_(False)
    return vae, describe(vae).scaling
