"""The data's names, as plain data: importing this module costs no torch (the CLIs'
``--help`` and ``--dry-run`` read it): the embedded digits' sizes (``digits.py``), the
image folders' default side (``datasets.py``), the latent normalisations (``latent_stats.py``) and the data loaders' workers."""

from __future__ import annotations

import os
from pathlib import Path

# Data sides when --image-size is not given: the digits canvas ladder (32 / 64 / 128 px =
# 256 / 1,024 / 4,096 tokens at patch 2; digits.py) and image folders.
CANVAS_SIZES = (32, 64, 128)
IMAGE_FOLDER_SIZE = 256
# --data digits: the 8x8 scans and the ladder's rungs, the scans upscaled 2x, 4x, 8x (digits.py):
# 16, 64, 256, 1,024 tokens at patch 2, the whole frame one digit.
DIGITS_SIZES = (8, 16, 32, 64)


def check_digits_size(size: int) -> int:
    if size not in DIGITS_SIZES:
        raise ValueError(f"--image-size {size} is not a digits size; choose {DIGITS_SIZES[0]} (the scans, 16 tokens "
                         f"at patch 2) or {', '.join(map(str, DIGITS_SIZES[1:]))} (upscaled 2x, 4x, 8x: 64, 256, "
                         f"1,024 tokens), or use --data digits-canvas for {'/'.join(map(str, CANVAS_SIZES))}-px "
                         f"canvases")
    return size


def check_canvas_size(size: int) -> int:
    if size not in CANVAS_SIZES:
        raise ValueError(f"--image-size {size} is not a digits-canvas size; choose one of "
                         f"{', '.join(map(str, CANVAS_SIZES))} (256 / 1,024 / 4,096 tokens at patch 2)")
    return size


# The data the shipped configs name (configs/*.yaml: data/cifar10/train, data/imagenet256-latents, ...) and the
# page that says how to make it: a missing --data folder whose path has one of these names points there.
DATA_GUIDES = (("cifar10", "docs/evaluation.md#cifar-10"), ("imagenet", "docs/data.md#data"))


def data_guide(path) -> str:
    """``; docs/evaluation.md#cifar-10 says how to make it`` for a path naming a dataset of
    ``DATA_GUIDES`` (a folder name starting with its name), else ''."""
    from pathlib import Path

    parts = [part.lower() for part in Path(path).parts]
    for name, page in DATA_GUIDES:
        if any(part.startswith(name) for part in parts):
            return f"; {page} says how to make it"
    return ""


# A latent folder (extract_latents.py) is the folder holding this file (datasets.py, sources.py).
LATENT_META = "meta.json"


def tar_names(data: str) -> list[str] | None:
    """A tar-shard folder's class names: its ``classes.txt``, one name a line, if it has one (streams.py)."""
    names_file = Path(data) / "classes.txt"
    return [n.strip() for n in names_file.read_text().splitlines() if n.strip()] if names_file.is_file() else None

# latent_stats.py (LatentNorm): how VAE latents become the model's inputs: × the VAE's scaling factor
# (DiT / SiT) or per channel by the latent cache's mean and std (LightningDiT).
LATENT_NORMS = ("scalar", "channel")


def default_num_workers(processes: int, cpus: int | None = None) -> int:
    """Data-loader workers per process when ``--num-workers`` is not given: the CPUs this
    process may use (its affinity mask, which taskset and Slurm set; else the CPU count)
    shared by the ``processes`` on this machine, at most 4. A fixed 4 makes PyTorch warn
    on a 2-core machine, and 4 per process oversubscribes it further."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(4, cpus // max(1, processes)))
