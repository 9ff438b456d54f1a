"""From a trained model to image files: loading, labels, seeded noise, mass sampling.

Used by ``sample.py`` and by the pipelines (``pipeline.py``), so one seed gives the
same images through either door.

Determinism. Every sample has a *global index*. Its starting noise comes from its own
generator seeded with ``(seed, index)``, so it does not depend on the batch it lands
in, the process that draws it or the process count. Stochastic samplers (ddpm,
sde-*) also draw fresh noise inside the loop; that comes from one generator per batch,
seeded with ``(seed, first index of the batch)``, so for them the batch layout
(``--batch-size``) is part of the recipe. Deterministic samplers (ddim, dpm-solver,
ode-*) depend only on the per-index noise.

Mass sampling (``mass_sample``) for FID-50K: labels are ``i % num_classes`` over the
global index, shuffled by a permutation seeded with ``seed`` (exact class balance
whenever ``num_classes`` divides the sample count). The index range is cut into fixed
shards; shard ``k`` belongs to rank ``k % world_size``. Each finished shard is written
atomically (temporary name, then rename) to ``<out>.parts/``, so a restarted run skips
what is done. Rank 0 then streams the shards into ADM's ``.npz`` (``arr_0`` uint8
NHWC, ``arr_1`` labels) without ever holding the whole array, and writes the JSON
sidecar ``<out>.json``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .generate import DEFAULT_STEPS, check_sampler, decode, default_sampler, generate

PRECISIONS = ("fp32", "bf16")
NOISE_STREAM, LOOP_STREAM = 0, 1


# ----------------------------------------------------------------- seeds and noise
def index_seed(seed: int, index: int, stream: int = NOISE_STREAM) -> int:
    """A 63-bit seed for one global sample index (numpy's SeedSequence mixes the words)."""
    state = np.random.SeedSequence([seed, index, stream]).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


def initial_noise(indices, shape: tuple[int, ...], seed: int, device="cpu") -> torch.Tensor:
    """(B, *shape) standard normal noise, row b drawn from its own ``(seed, indices[b])`` stream."""
    rows = [torch.randn(shape, generator=torch.Generator().manual_seed(index_seed(seed, int(i))))
            for i in indices]
    return torch.stack(rows).to(device)


def seed_from(generator) -> int:
    """The integer seed behind a pipeline's ``generator`` argument (None: a fresh random one)."""
    if generator is None:
        return int(torch.randint(0, 2**62, ()).item())
    if isinstance(generator, int):
        return generator
    if isinstance(generator, torch.Generator):
        # Drawing from the caller's generator keeps diffusers' convention: the same
        # manual_seed gives the same images, and a used generator gives new ones.
        return int(torch.randint(0, 2**62, (), generator=generator, device=generator.device).item())
    raise TypeError(f"generator must be None, an int seed or a torch.Generator, got {type(generator).__name__}")


class _Precision:
    """The model under autocast, returning fp32 so the sampler arithmetic stays fp32."""

    def __init__(self, model, precision: str):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.model, self.precision = model, precision
        self.null_label = getattr(model, "null_label", None)

    def __call__(self, x, t, y):
        if self.precision == "fp32":
            return self.model(x, t, y)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.model(x, t, y).float()


@dataclass
class SampleSettings:
    """Everything besides labels and indices that decides the images."""

    sampler: str | None = None
    num_steps: int | None = None
    cfg_scale: float = 1.0
    guidance_interval: tuple[float, float] | None = None
    guide_channels: int | None = None
    precision: str = "fp32"

    def resolved(self, objective) -> "SampleSettings":
        sampler = self.sampler or default_sampler(objective)
        check_sampler(sampler, objective)
        steps = DEFAULT_STEPS[sampler] if self.num_steps is None else self.num_steps
        interval = tuple(self.guidance_interval) if self.guidance_interval is not None else None
        return SampleSettings(sampler, steps, float(self.cfg_scale), interval, self.guide_channels, self.precision)


@torch.no_grad()
def sample_batch(model, objective, labels: torch.Tensor, indices, seed: int, settings: SampleSettings,
                 vae=None, scaling_factor: float = 0.18215, progress: bool = False,
                 decode_output: bool = True) -> tuple[torch.Tensor, int]:
    """One batch: pixels in [-1, 1] (B, C, H, W) (or latents) and the NFE per sample."""
    device = next(model.parameters()).device
    size = model.config.input_size
    noise = initial_noise(indices, (model.in_channels, size, size), seed, device)
    loop_gen = torch.Generator(device).manual_seed(index_seed(seed, int(indices[0]), LOOP_STREAM))
    s = settings.resolved(objective)
    out = generate(_Precision(model, s.precision), objective, noise, labels.to(device), sampler=s.sampler,
                   num_steps=s.num_steps, cfg_scale=s.cfg_scale, guidance_interval=s.guidance_interval,
                   guide_channels=s.guide_channels, null_label=model.null_label, generator=loop_gen,
                   progress=progress)
    if not decode_output:
        return out.samples, out.nfe
    return decode(out.samples, vae, scaling_factor), out.nfe


# ----------------------------------------------------------------- labels
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


def balanced_labels(num_samples: int, num_classes: int, seed: int) -> torch.Tensor:
    """``i % num_classes`` over the global index, then a permutation seeded with ``seed``."""
    base = torch.arange(num_samples) % num_classes
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    return base[perm]


def default_id2label(train_config: dict, num_classes: int) -> dict[int, str]:
    """Class names of the training data when they can be found, else the ids as text."""
    from . import data as data_lib

    names = None
    source = train_config.get("data")
    if source == "digits":
        from .digits import DIGIT_LABELS
        names = list(DIGIT_LABELS)
    elif source and (Path(source) / data_lib.LATENT_META).is_file():
        names = json.loads((Path(source) / data_lib.LATENT_META).read_text()).get("classes")
    elif source and Path(source).is_dir():
        names = sorted(d.name for d in Path(source).iterdir() if d.is_dir())
    if not names or len(names) != num_classes:
        names = [str(i) for i in range(num_classes)]
    return dict(enumerate(names))


def read_labels_file(path: str | os.PathLike) -> dict[int, str]:
    """``id2label`` from a JSON object/list or a text file with one class name per line."""
    text = Path(path).read_text()
    if Path(path).suffix == ".json":
        data = json.loads(text)
        if isinstance(data, list):
            return dict(enumerate(map(str, data)))
        return {int(k): str(v) for k, v in data.items()}
    return dict(enumerate(line.strip() for line in text.splitlines() if line.strip()))


# ----------------------------------------------------------------- sources
@dataclass
class Source:
    """A model ready to sample: weights, objective, decoder, class names, provenance."""

    model: torch.nn.Module
    objective: object
    vae: object = None
    scaling_factor: float = 0.18215
    id2label: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return self.model.config.num_classes


def load_source(path: str | os.PathLike, weights: str = "ema", vae: str | None = None, device="cpu") -> Source:
    """A training checkpoint (folder, ``checkpoints/`` or run folder) or a pipeline folder."""
    from . import data as data_lib
    from .checkpoint import build_objective, load_model

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint or pipeline folder at {path}")
    if (path / "model_index.json").is_file():
        from .pipeline import load_pipeline

        if weights != "ema":
            raise ValueError(f"--weights {weights}: a pipeline folder holds one set of weights (exported from "
                             f"the checkpoint's EMA by default); export the raw weights with "
                             f"`export.py checkpoint --weights model` instead")
        pipe = load_pipeline(path)
        if vae is not None:
            pipe.vae_override(vae)
        model = pipe.transformer.to(device).eval()
        vae_model = pipe.resolved_vae(device)
        if vae_model is not None:
            vae_model.to(device)
        return Source(model, pipe.objective(), vae_model, pipe.scaling_factor, pipe.id2label,
                      dict(pipe.config.get("source") or {}, pipeline=str(path)))
    model, ckpt = load_model(path, weights)
    model = model.to(device)
    vae_path = vae or ckpt.config.get("vae")
    vae_model, scaling = None, data_lib.DEFAULT_SCALING_FACTOR
    if vae_path:
        vae_model, scaling = data_lib.load_vae(vae_path, device)
        scaling = _latent_scaling(ckpt.config) or scaling
    info = dict(model=ckpt.config.get("model"), checkpoint=str(ckpt.path), step=ckpt.step, weights=weights,
                vae=vae_path)
    return Source(model, build_objective(ckpt.model_config, ckpt.config), vae_model, scaling,
                  default_id2label(ckpt.config, model.config.num_classes), info)


def _latent_scaling(train_config: dict) -> float | None:
    """The scaling factor a latent folder was written with (it overrides the VAE's)."""
    from . import data as data_lib

    meta = Path(train_config.get("data") or "") / data_lib.LATENT_META
    if train_config.get("data") and meta.is_file():
        return json.loads(meta.read_text()).get("scaling_factor")
    return None


# ----------------------------------------------------------------- small runs
def sample_images(source: Source, labels: list[int], seed: int, settings: SampleSettings,
                  batch_size: int = 32, progress: bool = False) -> tuple[torch.Tensor, int]:
    """Images for ``labels`` (global indices 0..n-1) as uint8 (N, H, W, C), and the NFE."""
    from .data import to_uint8

    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    out, nfe = [], 0
    for start in range(0, len(labels), batch_size):
        idx = list(range(start, min(start + batch_size, len(labels))))
        y = torch.tensor([labels[i] for i in idx], dtype=torch.long)
        images, nfe = sample_batch(source.model, source.objective, y, idx, seed, settings,
                                   source.vae, source.scaling_factor, progress)
        out.append(to_uint8(images))
    return torch.cat(out), nfe


def save_grid(images: torch.Tensor, path: str | os.PathLike, nrow: int) -> None:
    """uint8 (N, H, W, C) → one PNG grid with ``nrow`` images per row, 2 px padding."""
    from PIL import Image
    from torchvision.utils import make_grid

    grid = make_grid(images.permute(0, 3, 1, 2), nrow=nrow, padding=2, pad_value=0)  # (3, H', W')
    grid = grid[: images.shape[-1]]  # make_grid repeats a grey channel three times
    arr = grid.permute(1, 2, 0).numpy()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr).save(path)


def save_pngs(images: torch.Tensor, labels: list[int], out_dir: str | os.PathLike) -> list[Path]:
    from PIL import Image

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (img, label) in enumerate(zip(images.numpy(), labels)):
        path = out_dir / f"{i:06d}_class{label}.png"
        Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img).save(path)
        paths.append(path)
    return paths


# ----------------------------------------------------------------- mass sampling
def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def write_npz_streaming(out: Path, shards: list[Path], num_samples: int, image_shape: tuple[int, ...]) -> None:
    """ADM's sample ``.npz`` (``arr_0`` uint8 NHWC, ``arr_1`` int64 labels), one shard in
    memory at a time: each array's ``.npy`` header is written first, then the shards'
    bytes are appended to the zip member (stored, zip64 for > 4 GB)."""

    def write(f):
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, key, dtype, shape in (("arr_0", "images", np.uint8, (num_samples, *image_shape)),
                                            ("arr_1", "labels", np.int64, (num_samples,))):
                with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                              "shape": shape}
                    np.lib.format.write_array_header_2_0(member, header)
                    for shard in shards:
                        with np.load(shard) as part:
                            member.write(np.ascontiguousarray(part[key], dtype=dtype).tobytes())

    _atomic_write(out, write)


def mass_sample(source: Source, out: str | os.PathLike, num_samples: int, seed: int, settings: SampleSettings,
                batch_size: int = 32, shard_size: int = 1000, stop_after: int | None = None,
                keep_parts: bool = False, progress: bool = True, state=None) -> Path | None:
    """Generate ``num_samples`` images into ``out`` (.npz) across all processes of ``state``
    (an accelerate ``PartialState``; None = this process alone). Returns the ``.npz``
    path, or None when this run stopped early (``stop_after`` shards per process).
    The shards are deleted once the ``.npz`` is complete unless ``keep_parts``."""
    from tqdm.auto import tqdm

    from .data import to_uint8

    rank, world = (state.process_index, state.num_processes) if state is not None else (0, 1)
    is_main = rank == 0
    if num_samples < 1 or batch_size < 1 or shard_size < 1:
        raise ValueError("--num-samples, --batch-size and --shard-size must be >= 1")
    # Micro-batches start at multiples of batch_size inside each shard; aligning the
    # shard size to it keeps batch boundaries global, whatever the process count.
    shard_size = math.ceil(shard_size / batch_size) * batch_size
    s = settings.resolved(source.objective)
    out = Path(out)
    parts = Path(f"{out}.parts")
    model = source.model
    num_classes = model.config.num_classes
    recipe = dict(model=source.info.get("model"),
                  checkpoint=source.info.get("checkpoint") or source.info.get("pipeline"),
                  step=source.info.get("step"), weights=source.info.get("weights"), vae=source.info.get("vae"),
                  sampler=s.sampler, steps=s.num_steps, cfg_scale=s.cfg_scale,
                  guidance_interval=list(s.guidance_interval) if s.guidance_interval else None,
                  guide_channels=s.guide_channels, precision=s.precision, seed=seed, num_samples=num_samples,
                  num_classes=num_classes, batch_size=batch_size, shard_size=shard_size)
    sidecar = Path(f"{out}.json")
    if out.is_file() and sidecar.is_file():
        done = json.loads(sidecar.read_text())
        if {k: done.get(k) for k in recipe} == recipe:
            if is_main:
                print(f"{out} is already complete with these settings; nothing to do")
            return out
    parts.mkdir(parents=True, exist_ok=True)
    settings_file = parts / "settings.json"
    if settings_file.is_file():
        stored = json.loads(settings_file.read_text())
        if stored != recipe:
            diff = {k: (stored.get(k), v) for k, v in recipe.items() if stored.get(k) != v}
            raise ValueError(f"{parts} holds shards made with other settings {diff} (stored, now); "
                             f"rerun with the same flags or delete {parts}")
    elif is_main:
        _atomic_write(settings_file, lambda f: f.write(json.dumps(recipe, indent=2).encode()))

    labels = balanced_labels(num_samples, num_classes, seed)
    num_shards = math.ceil(num_samples / shard_size)

    def shard_path(k: int) -> Path:
        return parts / f"shard-{k:06d}.npz"

    mine = [k for k in range(rank, num_shards, world) if not shard_path(k).is_file()]
    if stop_after is not None:
        mine = mine[:stop_after]
    bar = tqdm(total=sum(min(shard_size, num_samples - k * shard_size) for k in mine),
               disable=not (progress and is_main), desc=f"sample (rank 0 of {world})", dynamic_ncols=True)
    for k in mine:
        lo, hi = k * shard_size, min((k + 1) * shard_size, num_samples)
        images, nfes = [], []
        for start in range(lo, hi, batch_size):
            idx = list(range(start, min(start + batch_size, hi)))
            pixels, nfe = sample_batch(model, source.objective, labels[idx], idx, seed, s,
                                       source.vae, source.scaling_factor)
            images.append(to_uint8(pixels).numpy())
            nfes.append(nfe)
            bar.update(len(idx))
        _atomic_write(shard_path(k), lambda f: np.savez(f, images=np.concatenate(images),
                                                          labels=labels[lo:hi].numpy(), nfe=np.array(nfes)))
    bar.close()
    if state is not None:
        state.wait_for_everyone()
    if not is_main:
        return out
    shards = [shard_path(k) for k in range(num_shards)]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        print(f"{len(shards) - len(missing)} of {num_shards} shards done in {parts}; "
              f"rerun the same command to resume")
        return None
    with np.load(shards[0]) as first:
        image_shape = first["images"].shape[1:]
    nfe = []
    for p in shards:
        with np.load(p) as part:
            nfe.extend(part["nfe"].tolist())
    write_npz_streaming(out, shards, num_samples, image_shape)
    counts = torch.bincount(labels, minlength=num_classes)
    meta = dict(recipe, nfe=max(nfe), nfe_mean=float(np.mean(nfe)), image_shape=list(image_shape),
                world_size=world, per_class_min=int(counts.min()), per_class_max=int(counts.max()),
                npz=str(out))
    _atomic_write(sidecar, lambda f: f.write(json.dumps(meta, indent=2).encode()))
    if not keep_parts:
        import shutil
        shutil.rmtree(parts)
    return out
