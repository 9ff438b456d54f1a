"""Any diffusers image autoencoder as the model's tokenizer: which class, and what it does.

A ``--vae`` folder (or hub id) names its class in ``config.json`` (``_class_name``). The class
is looked up only among the installed diffusers' own autoencoders (``autoencoder_classes``:
attributes of the ``diffusers`` module whose names start with ``Autoencoder`` and that are
``ModelMixin`` subclasses): never by importing a module a file names. diffusers 0.42 ships
``AutoencoderKL`` (SD, SDXL, FLUX.1, E2E-VAE), ``AutoencoderDC`` (DC-AE, SANA),
``AutoencoderKLFlux2`` (FLUX.2), ``AutoencoderRAE`` (representation autoencoders) and more;
video and audio autoencoders are refused in one line when they cannot encode an image.

What a tokenizer does is read from the model (``describe``), not assumed:

* the spatial factor (image px per latent px) from its config: an RAE decodes each of its
  encoder's tokens into a ``patch_size`` px patch; DC-AE's ``spatial_compression_ratio``;
  else 2^(levels − 1) of ``encoder_block_out_channels`` / ``block_out_channels`` (diffusers'
  own ``vae_scale_factor``). A probe encode of one blank image checks it and gives the rest:
* the latent channels (the probe's output);
* distribution or deterministic: an encoder output with ``latent_dist`` (the KL family) is a
  Gaussian posterior (its mean and log-variance are cached, a fresh sample is drawn at each
  step); one with ``latent`` (DC-AE, RAE) is the latent itself;
* ``scaling_factor`` and ``shift_factor`` of its config (x = (z − shift) · scale); a config
  without a scaling factor (FLUX.2's) trains unscaled unless ``--latent-norm channel``;
  ``AutoencoderRAE`` applies its own ``scaling_factor`` and latent statistics inside
  ``encode``/``decode`` (diffusers' own source of the class), so its latents are taken as they are;
* the pixel range: a config with ``encoder_norm_mean`` (RAE) standardises [0, 1] images itself
  and decodes to [0, 1]; every other class takes and gives [-1, 1];
* the one image size it works at, for a class that resizes every input to its encoder's size
  (RAE: ``decoder_image_size``); None for convolutional tokenizers, which take any multiple of
  the factor.

Tiled decode is ``models/vae.py``'s (``tiles``): diffusers' ``tile_sample_min_size`` /
``tile_overlap_factor`` scheme of the KL family; DC-AE tiles by another scheme and RAE not at
all, so for them ``--vae-tiling on`` is refused in one line and ``auto`` decodes in one piece.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

CLASS_PREFIX = "Autoencoder"
# Classes whose encode/decode apply the config's scaling_factor (and latent statistics) themselves.
SCALES_ITSELF = ("AutoencoderRAE",)
DEFAULT_SCALING_FACTOR = 0.18215   # the SD VAE's, for AutoencoderKL configs that predate the field
_ATTRIBUTE = "_nala_tokenizer"     # where describe() keeps its answer on the model


def autoencoder_classes() -> dict[str, type]:
    """The installed diffusers' autoencoder classes by name (``AutoencoderKL`` …)."""
    import diffusers
    from diffusers import ModelMixin

    found = {}
    for name in dir(diffusers):
        if not name.startswith(CLASS_PREFIX):
            continue
        cls = getattr(diffusers, name, None)
        if isinstance(cls, type) and issubclass(cls, ModelMixin):
            found[name] = cls
    return found


def autoencoder_class(name, where: str) -> type:
    """The diffusers class a config's ``_class_name`` names, else one line naming the choices."""
    import diffusers

    classes = autoencoder_classes()
    if not isinstance(name, str) or name not in classes:
        raise ValueError(f"{where}: '_class_name' {name!r} is not an autoencoder class of diffusers "
                         f"{diffusers.__version__} (one of {', '.join(sorted(classes))}); pass a diffusers "
                         f"autoencoder folder (config.json + diffusion_pytorch_model.safetensors)")
    return classes[name]


@dataclass(frozen=True)
class Tokenizer:
    """What an autoencoder does to images, as ``describe`` reads it from the model."""

    kind: str                  # the diffusers class name
    factor: int                # image px per latent px
    channels: int              # latent channels
    distribution: bool         # encode gives a Gaussian posterior (latent_dist), else the latent itself
    scaling: float             # model space = (z − shift) · scaling
    shift: float
    unit_range: bool           # takes and gives images in [0, 1] (else [-1, 1])
    image_size: int | None     # the only image side it works at (None: any multiple of factor)


def describe(vae) -> Tokenizer:
    """``vae``'s ``Tokenizer``, worked out once per model (a probe encode of one blank image)."""
    known = vae.__dict__.get(_ATTRIBUTE)
    if known is None:
        known = _describe(vae)
        vae.__dict__[_ATTRIBUTE] = known
    return known


def spatial_factor(vae) -> int:
    """Image px per latent px of ``vae`` (1 without one: pixel space)."""
    return 1 if vae is None else describe(vae).factor


def _config_factor(vae) -> int | None:
    config = vae.config
    if "encoder_input_size" in config and "patch_size" in config:   # tokens decoded into patches (RAE)
        return int(config["patch_size"])
    ratio = getattr(vae, "spatial_compression_ratio", None)
    if isinstance(ratio, int) and ratio > 0:
        return ratio
    for key in ("encoder_block_out_channels", "block_out_channels"):
        if key in config and config[key]:
            return 2 ** (len(config[key]) - 1)
    return None


def _describe(vae) -> Tokenizer:
    import torch

    kind = type(vae).__name__
    factor = _config_factor(vae)
    if factor is None:
        raise ValueError(f"{kind}: its config gives no spatial factor (no block_out_channels, "
                         f"encoder_block_out_channels or patch_size); not an image autoencoder this repository can use")
    fixed = getattr(vae, "decoder_image_size", None)
    side = int(fixed) if fixed else 2 * factor
    param = next(iter(vae.parameters()), None)
    probe = torch.zeros(1, 3, side, side, dtype=param.dtype if param is not None else torch.float32,
                        device=param.device if param is not None else "cpu")
    try:
        with torch.no_grad():
            out = vae.encode(probe)
    except Exception as err:   # a video/audio autoencoder: diffusers raises its own error types
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{kind} cannot encode a (1, 3, {side}, {side}) image ({first}): not an image autoencoder; "
                         f"pass an image tokenizer (e.g. AutoencoderKL, AutoencoderDC, AutoencoderRAE)") from None
    z, distribution = _latent(out)
    if z.dim() != 4 or z.shape[-1] * factor != side or z.shape[-2] * factor != side:
        raise ValueError(f"{kind}: a {side}x{side} image encodes to latents of shape {tuple(z.shape)}, not "
                         f"{side // factor}x{side // factor} as its config's factor {factor} says; not an image "
                         f"autoencoder this repository can use")
    config = vae.config
    own = kind in SCALES_ITSELF
    scaling = config.get("scaling_factor")
    if own or scaling is None:
        scaling = DEFAULT_SCALING_FACTOR if (kind == "AutoencoderKL" and scaling is None) else 1.0
    shift = 0.0 if own else float(config.get("shift_factor") or 0.0)
    return Tokenizer(kind, factor, int(z.shape[1]), distribution, float(scaling), shift,
                     "encoder_norm_mean" in config, int(fixed) if fixed else None)


def _latent(out):
    """(latent or posterior mean, is a distribution) of an encoder's output."""
    dist = getattr(out, "latent_dist", None)
    if dist is not None:
        return dist.mean, True
    for name in ("latent", "latents"):
        z = getattr(out, name, None)
        if z is not None:
            return z, False
    if isinstance(out, tuple) and out:
        return out[0], False
    raise ValueError(f"{type(out).__name__}: an encoder output with neither latent_dist nor latent")


# ------------------------------------------------------------------ images ↔ latents
def to_input(vae, images):
    """Images in [-1, 1] → what ``vae.encode`` takes, in its dtype."""
    x = (images + 1) / 2 if describe(vae).unit_range else images
    return x.to(vae.dtype)


def encode_moments(vae, images):
    """Images in [-1, 1] → (mean, log-variance): a deterministic tokenizer's log-variance is None."""
    out = vae.encode(to_input(vae, images))
    dist = getattr(out, "latent_dist", None)
    if dist is not None:
        return dist.mean, dist.logvar
    return _latent(out)[0], None


def encode_sample(vae, images):
    """Images in [-1, 1] → one latent: a posterior sample, or the deterministic latent."""
    out = vae.encode(to_input(vae, images))
    dist = getattr(out, "latent_dist", None)
    return dist.sample() if dist is not None else _latent(out)[0]


def decode_latents(vae, z):
    """VAE latents → images in [-1, 1] (unclamped), through the tokenizer's own decode."""
    x = vae.decode(z.to(vae.dtype)).sample
    return x * 2 - 1 if describe(vae).unit_range else x


def check_fixed_size(vae, hw: tuple[int, int], flag: str = "--image-size") -> None:
    """A tokenizer that works at one image size only (RAE) refuses any other (h, w) in one line."""
    info = describe(vae)
    if info.image_size is not None and tuple(hw) != (info.image_size, info.image_size):
        size = f"{hw[0]}" if hw[0] == hw[1] else f"{hw[0]}x{hw[1]}"
        raise ValueError(f"{flag} {size}: {info.kind} resizes every image to its encoder's input and decodes "
                         f"{info.image_size} px only; use {flag} {info.image_size}")


def check_image_size(vae, image_size: int, flag: str = "--image-size") -> None:
    """An image side ``vae`` encodes: its one size (RAE), else a multiple of its factor; else one line."""
    info = describe(vae)
    check_fixed_size(vae, (image_size, image_size), flag)
    if image_size % info.factor:
        raise ValueError(f"{flag} {image_size} is not a multiple of {info.kind}'s spatial factor {info.factor}")


def check_fits(vae, in_channels: int, name) -> None:
    """A model trained on latents of C channels decodes only through a tokenizer of C channels
    (``sample.py --vae``, a pipeline's override): else one line naming both."""
    info = describe(vae)
    if info.channels != in_channels:
        raise ValueError(f"--vae {name}: a {info.kind} of {info.channels} latent channels, and the model takes "
                         f"{in_channels}: pass the tokenizer the model was trained with")


# ------------------------------------------------------------------ identity
def identity(vae) -> dict:
    """What a latent cache records of the tokenizer that wrote it: its class, a hash of its
    config (diffusers' own keys, those starting with ``_``, left out) and the sha256 of all its
    weights (in the order of its state dict, as float32 bytes)."""
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    weights = hashlib.sha256()
    for name, tensor in vae.state_dict().items():
        weights.update(name.encode())
        weights.update(_bytes(tensor))
    return dict(vae_class=type(vae).__name__,
                vae_config_sha256=hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
                vae_weights_sha256=weights.hexdigest())


def _bytes(tensor) -> bytes:
    import torch

    return tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
