"""How VAE latents become the model's inputs, and back: one scalar factor or per-channel statistics.

* ``scalar`` (``--latent-norm scalar``, the default): ``x = z · f`` with the VAE config's
  ``scaling_factor`` f (0.18215 for the SD VAE), as DiT and SiT train; ``x = (z − s) · f``
  with a tokenizer's ``shift_factor`` s (FLUX.1's VAE; ``models/tokenizer.py``).
* ``channel`` (``--latent-norm channel``): ``x_c = (z_c − mean_c) / std_c`` with the
  per-channel mean and standard deviation of the latent cache (LightningDiT's
  ``latent_stats``), so every channel the model sees has mean 0 and std 1.

The statistics are those of the latents training draws, exactly: over every image of the
cache and its mirror image (both halves of the stored moments), every latent position, and
the VAE's posterior sample ``z = μ + σ·ε``, whose per-channel moments follow from the
stored ones in closed form: ``mean_c = E[μ]`` and ``std_c² = E[μ² + σ²] − mean_c²`` (σ² =
exp(logvar), clamped as ``data.sample_latents`` clamps it). ``extract_latents`` sums μ and
μ² + σ² in float64 over each shard as it writes it and keeps the sums in the shard, so the
statistics combine exactly, in shard order, however the extraction was split over
processes or resumed; a shard without sums (a cache written before) is summed from its
moments (``cache_statistics``).

The choice and the numbers travel with everything a model is sampled from: ``state.json``
of every checkpoint (``latent_norm``), the pipelines' config, and ``Source.latent_norm``;
``generate.decode`` undoes exactly them. A cache also records a fingerprint of the encoder
that wrote it (``vae_fingerprint``): a run whose ``--vae`` has another encoder is refused.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .choices import LATENT_NORMS

SUMS_KEY = "moment_sums"       # (2, C) float64 in each shard: Σ μ and Σ (μ² + σ²) per channel
LOGVAR_CLAMP = (-30.0, 20.0)   # as diffusers' DiagonalGaussianDistribution and data.sample_latents


@functools.lru_cache(maxsize=64)
def _channel_view(values: tuple[float, ...], dtype: torch.dtype, device: torch.device, ndim: int) -> torch.Tensor:
    """(1, C, 1, …) of per-channel statistics, made once per device and dtype (not copied from
    the host at every micro-batch). Read-only: nothing writes into it."""
    return torch.tensor(values, dtype=dtype, device=device).view(1, -1, *([1] * (ndim - 2)))


@dataclass(frozen=True)
class LatentNorm:
    """Model space ↔ VAE latents: ``scalar`` (``scale``) or ``channel`` (``mean``, ``std``)."""

    mode: str = "scalar"
    scale: float | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    shift: float = 0.0   # scalar: x = (z − shift) · scale (the tokenizer's shift_factor: FLUX.1's VAE)

    def __post_init__(self):
        if self.mode not in LATENT_NORMS:
            raise ValueError(f"latent norm must be one of {', '.join(LATENT_NORMS)}, got {self.mode!r}")
        if self.mode == "scalar":
            if not (isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool)
                    and math.isfinite(self.scale) and self.scale > 0):
                raise ValueError(f"scalar latent norm: the scale must be a positive number, got {self.scale!r}")
            if isinstance(self.shift, bool) or not isinstance(self.shift, (int, float)) or not math.isfinite(self.shift):
                raise ValueError(f"scalar latent norm: the shift must be a finite number, got {self.shift!r}")
            object.__setattr__(self, "shift", float(self.shift))
            return
        ok = all(isinstance(v, (list, tuple)) and v and all(isinstance(n, (int, float)) and not isinstance(n, bool)
                                                            and math.isfinite(n) for n in v)
                 for v in (self.mean, self.std))
        if not ok or len(self.mean) != len(self.std):
            raise ValueError(f"channel latent norm: mean and std must be lists of finite numbers of one length, got "
                             f"mean {self.mean!r:.80} and std {self.std!r:.80}")
        if min(self.std) <= 0:
            c = min(range(len(self.std)), key=lambda i: self.std[i])
            raise ValueError(f"channel latent norm: the std of channel {c} is {self.std[c]}, not positive: that "
                             f"channel is constant over the cache; use --latent-norm scalar")
        object.__setattr__(self, "mean", tuple(float(v) for v in self.mean))
        object.__setattr__(self, "std", tuple(float(v) for v in self.std))

    @classmethod
    def scalar(cls, scale: float, shift: float = 0.0) -> "LatentNorm":
        return cls("scalar", scale=float(scale), shift=shift)

    @classmethod
    def channel(cls, mean, std) -> "LatentNorm":
        return cls("channel", mean=tuple(mean), std=tuple(std))

    def _shaped(self, values, z: torch.Tensor) -> torch.Tensor:
        if len(values) != z.shape[1]:
            raise ValueError(f"channel latent norm has statistics of {len(values)} channels, the latents have "
                             f"{z.shape[1]}")
        return _channel_view(values, z.dtype, z.device, z.dim())

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """VAE latents (B, C, h, w) → model space."""
        if self.mode == "scalar":
            return (z - self.shift) * self.scale if self.shift else z * self.scale
        return (z - self._shaped(self.mean, z)) / self._shaped(self.std, z)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """Model space → VAE latents (what ``vae.decode`` takes)."""
        if self.mode == "scalar":
            return x / self.scale + self.shift if self.shift else x / self.scale
        return x * self._shaped(self.std, x) + self._shaped(self.mean, x)

    def to_dict(self) -> dict:
        if self.mode == "scalar":
            return dict(mode="scalar", scale=self.scale, **({"shift": self.shift} if self.shift else {}))
        return dict(mode="channel", mean=list(self.mean), std=list(self.std))

    @classmethod
    def from_dict(cls, value, where: str = "latent_norm") -> "LatentNorm":
        """The inverse of ``to_dict``; anything else is a one-line ValueError naming ``where``."""
        if not isinstance(value, dict) or value.get("mode") not in LATENT_NORMS:
            raise ValueError(f"{where}: must be an object with 'mode' one of {', '.join(LATENT_NORMS)}, got "
                             f"{value!r:.80}; the file was edited or damaged")
        try:
            if value["mode"] == "scalar":
                return cls.scalar(value.get("scale"), value.get("shift", 0.0))
            return cls.channel(value.get("mean"), value.get("std"))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from None

    def describe(self) -> str:
        if self.mode == "scalar":
            return f"scalar (factor {self.scale:g}{f', shift {self.shift:g}' if self.shift else ''})"
        show = lambda v: "[" + ", ".join(f"{x:.4g}" for x in v) + "]"  # noqa: E731
        return f"channel (mean {show(self.mean)}, std {show(self.std)})"


def as_latent_norm(norm) -> LatentNorm:
    """A ``LatentNorm`` from a ``LatentNorm`` or a scalar scaling factor."""
    return norm if isinstance(norm, LatentNorm) else LatentNorm.scalar(norm)


def denormalize(latents: torch.Tensor, norm) -> torch.Tensor:
    """Model space → VAE latents, for a ``LatentNorm`` or a scaling factor (``latents / f``)."""
    return latents / norm if isinstance(norm, (int, float)) else norm.denormalize(latents)


def difference(ours: LatentNorm, theirs: LatentNorm) -> str | None:
    """Where two normalisations differ (None: they are the same), for an error message."""
    if ours.mode != theirs.mode:
        return f"{theirs.mode} vs {ours.mode}"
    if ours == theirs:
        return None
    if ours.mode == "scalar":
        if ours.scale == theirs.scale:
            return f"shift {theirs.shift:g} vs {ours.shift:g}"
        return f"factor {theirs.scale:g} vs {ours.scale:g}"
    if len(ours.mean) != len(theirs.mean):
        return f"{len(theirs.mean)} vs {len(ours.mean)} channels"
    gaps = [(abs(a - b), c, "mean", a, b) for c, (a, b) in enumerate(zip(theirs.mean, ours.mean))]
    gaps += [(abs(a - b), c, "std", a, b) for c, (a, b) in enumerate(zip(theirs.std, ours.std))]
    _, c, what, a, b = max(gaps)
    return f"channel {c} {what} {a:.6g} vs {b:.6g}"


# ------------------------------------------------------------------ statistics of a cache
def moment_sums(moments: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """(B, 2, 2, C, h, w) stored moments → (2, C) float64: Σ μ and Σ (μ² + σ²) per channel,
    over images, both flips and positions (B · 2 · h · w values per channel)."""
    sums = torch.zeros(2, moments.shape[3], dtype=torch.float64, device=moments.device)
    for start in range(0, moments.shape[0], chunk):
        m = moments[start: start + chunk].to(torch.float64)
        mu, var = m[:, :, 0], m[:, :, 1].clamp(*LOGVAR_CLAMP).exp()
        sums[0] += mu.sum(dim=(0, 1, 3, 4))
        sums[1] += (mu * mu + var).sum(dim=(0, 1, 3, 4))
    return sums


def statistics(sums: torch.Tensor, images: int, latent_hw: int) -> dict:
    """The ``latent_stats`` entry of a cache's meta.json from its float64 sums."""
    values = images * 2 * latent_hw
    mean = sums[0] / values
    var = (sums[1] / values - mean * mean).clamp_min(0)
    return dict(mean=mean.tolist(), std=var.sqrt().tolist(), images=images, latents=2 * images,
                values_per_channel=values)


def shard_sums(path: str | os.PathLike) -> tuple[torch.Tensor, int, int]:
    """(sums, images, h·w) of one shard: the stored sums, else summed from its moments."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        shape = f.get_slice("moments").get_shape()
        sums = f.get_tensor(SUMS_KEY) if SUMS_KEY in f.keys() else moment_sums(f.get_tensor("moments"))
    return sums.to(torch.float64), shape[0], shape[-2] * shape[-1]


def cache_statistics(root: str | os.PathLike, shards: list[str]) -> dict:
    """Per-channel mean and std over a whole cache (``shards`` in order), exact in float64."""
    total, images, hw = None, 0, None
    for name in shards:
        sums, n, shard_hw = shard_sums(Path(root) / name)
        total = sums if total is None else total + sums
        images += n
        hw = shard_hw
    return statistics(total, images, hw)


def stored_sums(root: str | os.PathLike, shards: list[str]) -> tuple[torch.Tensor, int, int] | None:
    """(Σ of every shard's stored sums in shard order, images, h·w), read from the shards'
    ``SUMS_KEY`` tensors only (a few bytes each, no moments); None when a shard has none (a cache
    written before the sums were kept: only reading all its moments could check it)."""
    from safetensors import safe_open

    total, images, hw = None, 0, None
    for name in shards:
        with safe_open(str(Path(root) / name), "pt") as f:
            if SUMS_KEY not in f.keys():
                return None
            shape = f.get_slice("moments").get_shape()
            sums = f.get_tensor(SUMS_KEY).to(torch.float64)
        total = sums if total is None else total + sums
        images, hw = images + shape[0], shape[-2] * shape[-1]
    return (total, images, hw) if total is not None else None


def check_statistics(root: str | os.PathLike, meta: dict) -> None:
    """Refuse a cache whose ``meta.json`` ``latent_stats`` are not what its shards' stored
    float64 sums give (an edited or damaged file: ``--latent-norm channel`` would train every
    channel off by it), in one line naming the file, the first channel that differs and the fix.
    Cheap: the sums only, never the moments; a cache without stored sums is not checked."""
    from .datasets import LATENT_META

    recorded = meta.get("latent_stats")
    found = stored_sums(root, meta["shards"]) if recorded is not None else None
    if found is None:
        return
    expected = statistics(*found)
    for what in ("mean", "std"):
        for c, (a, b) in enumerate(zip(recorded[what], expected[what])):
            if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
                raise ValueError(
                    f"{Path(root) / LATENT_META}: 'latent_stats' do not match the float64 sums its shards store "
                    f"(channel {c} {what} {a:.6g} in the file, {b:.6g} from the shards): the file was edited or "
                    f"damaged; rerun extract_latents.py with the same flags to rewrite it (finished shards are kept)")
    if recorded.get("images", expected["images"]) != expected["images"]:
        raise ValueError(f"{Path(root) / LATENT_META}: 'latent_stats' count {recorded.get('images')!r} images, the "
                         f"shards {expected['images']}: the file was edited or damaged; rerun extract_latents.py with "
                         f"the same flags to rewrite it (finished shards are kept)")


# ------------------------------------------------------------------ the source's identity
def source_fingerprint(dataset) -> str:
    """sha256 of an image folder's file list as extraction reads it (``ImageFolderDataset``
    samples, after unreadable files are left out): each file's path inside the folder, its
    size and its label. Another folder of as many images in the same classes, or this one with a
    picture replaced, gives another fingerprint; the pictures themselves are not read."""
    h = hashlib.sha256()
    root = Path(dataset.root)
    for path, label in dataset.samples:
        h.update(f"{Path(path).relative_to(root).as_posix()}\0{Path(path).stat().st_size}\0{label}\n".encode())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ the encoder's identity
DECODER_PREFIXES = ("decoder.", "post_quant_conv.")   # the weights that only decode


def vae_fingerprint(vae) -> str:
    """sha256 of every weight but the decoder's: what defines the latent space (a KL's
    ``encoder.*`` and ``quant_conv.*``; an RAE's encoder with its input and latent statistics).
    Decoders fine-tuned alone (sd-vae-ft-ema / ft-mse) keep the fingerprint."""
    h = hashlib.sha256()
    for name, tensor in sorted(vae.state_dict().items()):
        if not name.startswith(DECODER_PREFIXES):
            h.update(name.encode())
            h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ what a model was trained with
def recorded_norm(state: dict, train_config: dict | None = None) -> LatentNorm | None:
    """The normalisation a checkpoint's ``state.json`` records; a checkpoint written before
    the key existed trained with the scalar factor of its cache (else of its VAE). None for a
    pixel-space model (no VAE)."""
    if state.get("latent_norm") is not None:
        return LatentNorm.from_dict(state["latent_norm"], "state.json 'latent_norm'")
    config = train_config if train_config is not None else state.get("config", {})
    if not config.get("vae"):
        return None
    from .datasets import LATENT_META, read_latent_meta

    data = config.get("data")
    if data and (Path(data) / LATENT_META).is_file():
        return LatentNorm.scalar(read_latent_meta(data)["scaling_factor"])
    return None


# ------------------------------------------------------------------ a training run's normalisation
def run_norm(mode: str, dataset, vae, scaling: float, vae_name: str | None, allow_vae: bool = False,
             print=print) -> LatentNorm | None:
    """The normalisation a run trains with (None in pixel space). A latent cache whose
    encoder fingerprint is not ``vae``'s, a cache that records no fingerprint and another VAE
    name than ``vae_name`` (unless ``allow_vae``: ``--allow-changes vae``), ``channel`` without a
    cache's statistics or with statistics its shards' sums do not give, are one-line errors
    naming the fix."""
    from .datasets import LATENT_META

    if vae is None:
        return None
    cache = dataset.is_latent   # a latent cache (LatentDataset), not images encoded on the fly
    if cache:
        check_tokenizer_class(dataset, vae, vae_name)
    if cache and dataset.vae_fingerprint is not None and dataset.vae_fingerprint != vae_fingerprint(vae):
        raise ValueError(f"{dataset.root} holds latents of another VAE ({dataset.meta.get('vae')}, encoder "
                         f"{dataset.vae_fingerprint}) than --vae {vae_name} (encoder {vae_fingerprint(vae)}): pass the "
                         f"VAE the latents were extracted with, or extract them again with this one")
    if cache and dataset.vae_fingerprint is None and not same_name(dataset.meta.get("vae"), vae_name):
        recorded = dataset.meta.get("vae")
        if not allow_vae:
            raise ValueError(f"{dataset.root / LATENT_META} records no encoder fingerprint ('vae_fingerprint'), so "
                             f"the latents of {recorded} cannot be told from those of --vae {vae_name}: pass --vae "
                             f"{recorded}, rerun extract_latents.py with its flags to record the fingerprint (finished "
                             f"shards are kept), or pass --allow-changes vae if {vae_name} has the same encoder")
        print(f"latents: {dataset.root} records no encoder fingerprint; training them with --vae {vae_name}, not "
              f"the {recorded} they were extracted with (--allow-changes vae)")
    if mode == "scalar":
        from ..models.tokenizer import describe

        return LatentNorm.scalar(scaling, describe(vae).shift)
    if not cache:
        raise ValueError(f"--latent-norm channel needs the per-channel statistics of a latent cache, and {dataset.root} "
                         f"is an image folder (encoded on the fly): extract it with extract_latents.py and train on "
                         f"that folder, or use --latent-norm scalar")
    if dataset.stats is None:
        raise ValueError(f"{dataset.root / LATENT_META} holds no latent statistics (written before extract_latents.py "
                         f"computed them): rerun extract_latents.py with the same flags to add them (finished shards "
                         f"are kept), or use --latent-norm scalar")
    check_statistics(dataset.root, dataset.meta)   # the stored sums, not the file's word for them
    return LatentNorm.channel(dataset.stats["mean"], dataset.stats["std"])


def check_tokenizer_class(dataset, vae, vae_name) -> None:
    """A latent cache written by another tokenizer class than ``vae``'s is one line (a cache
    written before the class was recorded passes on to the encoder fingerprint)."""
    recorded = dataset.meta.get("vae_class")
    if recorded is not None and recorded != type(vae).__name__:
        raise ValueError(f"{dataset.root} holds latents of a {recorded} ({dataset.meta.get('vae')}), and --vae "
                         f"{vae_name} is a {type(vae).__name__}: pass the tokenizer the latents were extracted with, "
                         f"or extract them again with this one")


def same_name(recorded, given) -> bool:
    """Whether two ``--vae`` values name the same VAE: the same hub id, or local folders that
    resolve to one path."""
    if recorded == given:
        return True
    if not (isinstance(recorded, str) and isinstance(given, str)):
        return False
    a, b = Path(recorded), Path(given)
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def agreed_norm(ours: LatentNorm | None, theirs: LatentNorm | None, what: str, data: str,
                allow: bool = False, print=print) -> LatentNorm | None:
    """The normalisation a run that continues ``what`` (a checkpoint, an ``--init-from``
    source) trains with: its own, when the model was trained with the same (or it is not
    known); with ``allow`` (``--allow-changes latent-norm``) the model's; else a one-line error."""
    if ours is None or theirs is None:
        return ours
    diff = difference(ours, theirs)
    if diff is None:
        return ours
    if allow:
        print(f"latent norm: keeping {what}'s {theirs.describe()} for {data}, whose own is {ours.describe()} "
              f"(--allow-changes latent-norm)")
        return theirs
    raise ValueError(f"{what} was trained on latents normalised otherwise than {data} gives ({diff}; the model's vs "
                     f"this run's): train on the latents it was trained on, or pass --allow-changes latent-norm to "
                     f"keep its normalisation for this data")
