"""Images and labels on disk: grids and PNG files of uint8 images, and the balanced label
lists every sampler of the repo draws (training grids, ``sample.py``, ``evaluate_fid.py gen``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


# The most images one command samples: 200 FID sets of 50,000. Its label list alone is 80 MB; a
# count beyond it is a typo (one line), not an allocation that fails minutes later.
MAX_SAMPLES = 10_000_000


def check_sample_count(count: int, what: str = "--num-samples") -> None:
    """Refuse, before anything is allocated, a sample count below 1 or above ``MAX_SAMPLES``."""
    if not 1 <= count <= MAX_SAMPLES:
        raise ValueError(f"{what}: {count:,} images is {'below 1' if count < 1 else 'more than one command samples'} "
                         f"(1 to {MAX_SAMPLES:,}; an FID uses 50,000)")


def balanced_labels(num_samples: int, num_classes: int, seed: int) -> torch.Tensor:
    """``i % num_classes`` over the global index, then a permutation seeded with ``seed``."""
    check_sample_count(num_samples, f"{num_samples:,} balanced labels")
    base = torch.arange(num_samples) % num_classes
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    return base[perm]


def balance_notice(num_samples: int, num_classes: int) -> str | None:
    """A line for the user when ``num_samples`` cannot be split evenly over the classes."""
    if num_samples % num_classes == 0:
        return None
    low = num_samples // num_classes
    high_count = num_samples % num_classes
    return (f"note: {num_samples} samples over {num_classes} classes are not balanced: {high_count} classes get "
            f"{low + 1}, the other {num_classes - high_count} get {low} (a multiple of {num_classes} balances them)")


def save_grid(images: torch.Tensor, path: str | os.PathLike, nrow: int, scale: int = 1, new: bool = False) -> None:
    """uint8 (N, H, W, C) → one PNG grid with ``nrow`` images per row, 2 px padding,
    enlarged ``scale`` times by nearest neighbour (every pixel a ``scale``² block: for
    viewing tiny images, ``sample.py --grid-scale``); ``new``: as ``save_image``'s."""
    from PIL import Image
    from torchvision.utils import make_grid

    grid = make_grid(images.permute(0, 3, 1, 2), nrow=nrow, padding=2, pad_value=0)  # (3, H', W')
    grid = grid[: images.shape[-1]]  # make_grid repeats a grey channel three times
    arr = grid.permute(1, 2, 0).numpy()
    if scale > 1:
        arr = arr.repeat(scale, axis=0).repeat(scale, axis=1)
    save_image(arr, path, new)


def save_image(arr, path: str | os.PathLike, new: bool = False) -> None:
    """uint8 (H, W, C) as an image file, written to a temporary sibling and renamed into place:
    a full disk or a kill never leaves a truncated or empty file, and the failure names ``path``.
    ``new``: ``path`` must not exist when it is published (``durable_publish``): a file created
    there while the image was made is kept, and the image stays at its temporary name, named in
    the one-line ``FileExistsError``."""
    from PIL import Image

    from ..guards import durable_publish, durable_replace

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")   # same suffix: PIL picks the format from it
    try:
        Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr).save(tmp)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(f"cannot write {path}: {err.strerror or err} (disk full?); nothing was left there: free space "
                      f"and rerun the same command") from None
    if not new:
        durable_replace(tmp, path)
        return
    try:
        durable_publish(tmp, path)
    except FileExistsError:
        raise FileExistsError(f"{path} was created by something else while this command ran; not overwriting it: "
                              f"this command's image is {tmp} (move it where you want it)") from None


def save_pngs(images: torch.Tensor, labels: list[int], out_dir: str | os.PathLike, new: bool = False) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (img, label) in enumerate(zip(images.numpy(), labels)):
        path = out_dir / f"{i:06d}_class{label}.png"
        save_image(img, path, new)
        paths.append(path)
    return paths
