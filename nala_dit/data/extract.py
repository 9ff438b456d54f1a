"""Pre-extract VAE latents of an image folder, sharded, multi-process and resumable.

For every image we store the posterior *mean and log-variance* of the image and of its
mirror image, ``moments[(2 flips), (mean, logvar), C, h, w]``, so training on cached
latents still draws a fresh flip and a fresh posterior sample each time (fast-DiT caches
one sample of one flip and so freezes both).

Shard ``k`` holds images ``[k·S, (k+1)·S)`` of the folder's sorted order; process ``r``
of ``W`` writes the shards with ``k % W == r``. A shard is written under a temporary
name, fsynced and renamed (the folder fsynced after), so an interrupted extraction resumes
by skipping finished shards, and a power loss leaves no complete-looking empty shard; a
resumed run first checks the finished shards' headers (a truncated shard is one line,
``meta.json`` untouched).
All images are opened up front; the unreadable ones are reported together.

Each shard also keeps its float64 sums of μ and μ² + σ² per channel (``moment_sums``);
once every shard is there, the first process combines them, in shard order, into the
cache's per-channel mean and std (``meta.json`` ``latent_stats``, with the counts), so
the statistics are exact over the whole cache however the extraction was split or
resumed (``nala_dit/data/latent_stats.py``). ``meta.json`` also records the encoder's
fingerprint (``vae_fingerprint``), the tokenizer's class, config hash and weights' sha256
(``vae_class``, ``vae_config_sha256``, ``vae_weights_sha256``: ``models/tokenizer.py``), how it
encodes (``encoding``: a distribution or deterministic) and the image folder's path and file list
(``source``, ``source_files``): a resume from another encoder or folder is refused.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Subset

from ..models.vae import load_vae
from .datasets import LATENT_META, ImageFolderDataset, check_images
from ..guards import durable_replace, read_json
from .latent_stats import LOGVAR_CLAMP, SUMS_KEY, cache_statistics, moment_sums, source_fingerprint, vae_fingerprint
from ..models import tokenizer
from .choices import default_num_workers
from ..runlock import check_process_count


def shard_name(index: int) -> str:
    return f"latents-{index:05d}.safetensors"


@torch.no_grad()
def encode_moments(vae, x: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] → (B, 2, 2, C, h, w): [orig, mirror] × [mean, logvar]. A
    deterministic tokenizer (DC-AE, RAE: ``tokenizer.describe``) stores its latent as the mean
    and the log-variance floor ``LOGVAR_CLAMP[0]`` (σ = 3e-7, below the stored mean's float16
    rounding), so every cache has one layout and the training step one sampler."""
    out = []
    for img in (x, x.flip(-1)):
        mean, logvar = tokenizer.encode_moments(vae, img)
        if logvar is None:
            logvar = torch.full_like(mean, LOGVAR_CLAMP[0])
        out.append(torch.stack([mean, logvar], dim=1))
    return torch.stack(out, dim=1).float()


def extract_latents(
    data: str,
    out: str,
    vae_path: str,
    image_size: int = 256,
    batch_size: int = 32,
    shard_size: int = 4096,
    num_workers: int | None = None,
    dtype: str = "float16",
    skip_corrupt: bool = False,
    keep_images: bool = False,
) -> Path:
    from accelerate import Accelerator

    from ..progress import progress_bar

    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    check_process_count(world, "extract_latents.py")
    if num_workers is None:
        num_workers = default_num_workers(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    dataset = ImageFolderDataset(data, image_size, skip_corrupt)
    # Every image is opened before any encoding: unreadable files are reported in one list
    # (or, with --skip-corrupt, left out of the shards rather than replaced by a neighbour).
    check_images(dataset, accelerator)
    vae, scaling = load_vae(vae_path, accelerator.device)
    tokenizer.check_image_size(vae, image_size)
    info = tokenizer.describe(vae)
    out_dir = Path(out)
    num_shards = math.ceil(len(dataset) / shard_size)
    meta = dict(
        source=str(Path(data).resolve()), vae=vae_path, scaling_factor=scaling, image_size=image_size,
        latent_channels=info.channels, classes=dataset.classes, num_images=len(dataset),
        shard_size=shard_size, shards=[shard_name(k) for k in range(num_shards)], dtype=dtype,
        vae_fingerprint=vae_fingerprint(vae), images=keep_images, source_files=source_fingerprint(dataset),
        **tokenizer.identity(vae), spatial_factor=info.factor,
        encoding="distribution" if info.distribution else "deterministic",
    )
    meta_path = out_dir / LATENT_META
    if meta_path.is_file():
        _check_previous(meta_path, out_dir, meta)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_meta(meta_path, meta)
    accelerator.wait_for_everyone()

    mine = [k for k in range(num_shards) if k % world == rank and not (out_dir / shard_name(k)).is_file()]
    store = getattr(torch, dtype)
    # Counted in images, not shards, so the ETA moves within a 4096-image shard.
    with progress_bar(total=sum(min(shard_size, len(dataset) - k * shard_size) for k in mine), unit="img",
                      desc=f"extract (rank {rank} of {world})", disable=not accelerator.is_local_main_process) as bar:
        for k in mine:
            indices = range(k * shard_size, min((k + 1) * shard_size, len(dataset)))
            loader = DataLoader(Subset(dataset, indices), batch_size=batch_size, num_workers=num_workers)
            tensors = _encode_shard(vae, loader, accelerator.device, store, keep_images, bar)
            _save_shard(out_dir / shard_name(k), tensors)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:  # every shard is there now: the statistics of the whole cache
        meta["latent_stats"] = cache_statistics(out_dir, meta["shards"])
        write_meta(meta_path, meta)
    accelerator.wait_for_everyone()
    return out_dir


def _check_previous(meta_path: Path, out_dir: Path, meta: dict) -> None:
    """An earlier extraction at ``out_dir`` is resumed only when it was made from the same
    images with the same settings and encoder (else one error naming what changed) and its
    shards are sound; its latent statistics are kept in ``meta`` until recomputed."""
    old = read_json(meta_path, f"delete {out_dir} (or use another --out) to extract again")
    if not isinstance(old, dict):
        raise ValueError(f"{meta_path}: must hold a JSON object, got {type(old).__name__}; use another --out or "
                         f"delete {out_dir}")
    old["images"] = bool(old.get("images"))   # extractions before --keep-images kept none
    changed = [k for k in ("num_images", "image_size", "shard_size", "classes", "vae", "dtype", "images")
               if old.get(k) != meta[k]]
    # the encoder, and the image folder (its path; its file list: names, sizes, labels): another
    # folder of as many images in the same classes must not mix into this cache
    changed += [k for k in ("vae_class", "vae_fingerprint", "source", "source_files") if old.get(k, meta[k]) != meta[k]]
    if changed:
        source = (f" (extracted from {old.get('source')}, --data is {meta['source']})"
                  if {"source", "source_files"} & set(changed) else "")
        raise ValueError(
            f"{out_dir} holds an extraction with different {changed}{source}; use another --out or delete it"
        )
    check_shards(out_dir, meta["shards"])   # before meta.json is touched: a damaged shard is one line
    if old.get("latent_stats") is not None:   # kept until this run recomputes them over every shard
        meta["latent_stats"] = old["latent_stats"]


def _encode_shard(vae, loader, device, store: torch.dtype, keep_images: bool, bar) -> dict[str, torch.Tensor]:
    """One shard's tensors: the VAE's moments in ``store``, the labels, the moments' float64
    sums and (``keep_images``) the resized images as uint8."""
    moments, labels, images, sums = [], [], [], 0
    for x, y in loader:
        m = encode_moments(vae, x.to(device)).to(store)
        # float64 sums of the stored (rounded) values, on the GPU where there is one (MPS has no
        # float64): the statistics are those of what training reads
        sums = sums + moment_sums(m if m.device.type == "cuda" else m.cpu()).cpu()
        moments.append(m.cpu())
        labels.append(y)
        if keep_images:  # the resized image the latents encode, as uint8 (REPA's encoder input)
            images.append(((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8))
        bar.update(len(y))
    return {"moments": torch.cat(moments).contiguous(), "labels": torch.cat(labels).contiguous(), SUMS_KEY: sums,
            **({"images": torch.cat(images).contiguous()} if keep_images else {})}


def _save_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` to ``path`` through a temporary file; a full disk is one line, the partial file removed."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        save_file(tensors, str(tmp))
    except (OSError, SafetensorError) as err:  # disk full: safetensors raises its own error
        tmp.unlink(missing_ok=True)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise OSError(f"cannot write {path}: {first} (disk full?); removed the partial file, the finished "
                      f"shards are kept: free space and rerun the same command to resume") from None
    durable_replace(tmp, path)   # fsynced before and after: a power loss leaves no empty shard


def write_meta(path: Path, meta: dict) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text(json.dumps(meta, indent=2))
    durable_replace(tmp, path)


def check_shards(out_dir: Path, names: list[str]) -> None:
    """The finished shards of a resumed extraction are readable safetensors files (their
    headers cover the file: a shard cut short by a crash or a copy is found here, before
    ``meta.json`` is rewritten or the statistics are summed); else one line naming it."""
    from safetensors import safe_open

    for name in names:
        path = out_dir / name
        if not path.is_file():
            continue
        try:
            with safe_open(str(path), "pt") as f:
                f.keys()
        except Exception as err:  # safetensors raises its own error types
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(f"{path}: a truncated or damaged latent shard ({first}); delete it and rerun the same "
                             f"command to extract it again (the other shards and {LATENT_META} are kept)") from None


def shards_done(out: str | os.PathLike) -> tuple[int, int | None]:
    """(finished shards, all shards) of an extraction folder: what an interrupted run keeps."""
    out = Path(out)
    meta = out / LATENT_META
    if not meta.is_file():
        return 0, None
    try:
        shards = json.loads(meta.read_text())["shards"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return 0, None
    return sum((out / name).is_file() for name in shards), len(shards)
