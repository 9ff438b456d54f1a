"""Training data: image folders, pre-extracted VAE latents, and the embedded digits.

Every dataset returns ``(x, label)`` with x a float tensor and *no* randomness: the
horizontal flip and the VAE posterior sample happen in the training step, drawn from
the step's seeded RNG, so an interrupted and resumed run sees exactly the same data.

* ``ImageFolderDataset`` — ``root/<class>/<image>``; ADM's center crop (box-halve,
  bicubic resize, crop), pixels in [-1, 1]. Fed through a VAE on the fly, or trained on
  directly in pixel space.
* ``LatentDataset`` — shards written by ``extract_latents``: the posterior mean and
  log-variance of each image *and of its mirror image*, so training still draws a fresh
  latent and a fresh flip every time (fast-DiT freezes one of each).
* ``DigitsDataset`` — scikit-learn's 1,797 real 8×8 handwritten digits (no download), or upscaled to 16, 32, 64 px.

``--data`` finds its dataset through the registry of ``sources.py`` (a new kind of data: its
dataset class and one line there).
"""

from __future__ import annotations

import bisect
import math
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler

from ..guards import check_finite_samples, read_json
from .choices import LATENT_META

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".JPEG", ".PNG", ".JPG")


def center_crop_arr(pil_image: Image.Image, image_size: int) -> np.ndarray:
    """ADM's center crop: halve with a box filter while large, bicubic resize, crop."""
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
    arr = np.array(pil_image)
    top = (arr.shape[0] - image_size) // 2
    left = (arr.shape[1] - image_size) // 2
    return arr[top: top + image_size, left: left + image_size]


def to_model_range(arr_uint8: np.ndarray) -> torch.Tensor:
    """(H, W, C) uint8 → (C, H, W) float in [-1, 1]."""
    return torch.from_numpy(arr_uint8).permute(2, 0, 1).float() / 127.5 - 1.0


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) in [-1, 1] → (B, H, W, C) uint8, rounding as ADM's sample scripts.

    Every sample becomes an image here (grids, PNGs, ``.npz``, pipelines, FID), so this is
    where a non-finite sample is refused: the cast would turn NaN into 0 (a black image,
    scored as if real)."""
    check_finite_samples(x)
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def _hidden(path: Path, root: Path) -> bool:
    """A name starting with '.' below ``root`` (``.ipynb_checkpoints``, ``.git``, macOS' ``._x.png``)."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


class ImageFolderDataset(Dataset):
    """``root/<class name>/**/<image>``; classes are the sorted sub-folder names. Hidden
    folders and files (a name starting with '.', e.g. Jupyter's ``.ipynb_checkpoints``) are
    skipped at every level: torchvision's ``ImageFolder`` would make ``.ipynb_checkpoints``
    class 0 and shift every label."""

    is_latent = False   # items are images (sources.py: what every dataset has)

    def __init__(self, root: str | os.PathLike, image_size: int, skip_corrupt: bool = False):
        self.root = Path(root)
        if not self.root.is_dir():  # what --data takes, not one layout: it may have been a latent folder
            from ..checks import did_you_mean
            from .choices import data_guide

            raise FileNotFoundError(
                f"data folder not found: {self.root}{did_you_mean(self.root)} (--data takes digits, digits-canvas, "
                f"a latent folder written by extract_latents.py or an image folder <root>/<class name>/<images>)"
                f"{data_guide(self.root)}"
            )
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not self.classes:
            raise ValueError(
                f"data folder {self.root} has no class sub-folders; put images in <root>/<class name>/"
            )
        self.samples = [
            (path, label)
            for label, name in enumerate(self.classes)
            for path in sorted((self.root / name).rglob("*"))
            if path.suffix in IMAGE_EXTENSIONS and not _hidden(path, self.root)
        ]
        if not self.samples:
            raise ValueError(f"data folder {self.root} holds no images with extensions {IMAGE_EXTENSIONS}")
        self.refuse_empty_classes()
        self.image_size = image_size
        self.skip_corrupt = skip_corrupt
        self.num_classes = len(self.classes)
        self.channels = 3

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> np.ndarray:
        path, _ = self.samples[index]
        try:
            with Image.open(path) as img:
                return center_crop_arr(img.convert("RGB"), self.image_size)
        except Exception as err:  # PIL raises several types for broken files
            raise OSError(f"cannot read image {path}: {err} (pass --skip-corrupt to skip such files)") from err

    def __getitem__(self, index: int):
        # With --skip-corrupt an unreadable image is replaced by the next readable one
        # (a loop, not recursion: a folder of broken files must end in an error, not a
        # RecursionError).
        for offset in range(len(self)):
            candidate = (index + offset) % len(self)
            try:
                arr = self.load(candidate)
            except OSError as err:
                if not self.skip_corrupt:
                    raise
                warnings.warn(f"skipping corrupt image: {err}")
                continue
            return to_model_range(arr), self.samples[candidate][1]
        raise OSError(f"no readable image in {self.root}: all {len(self)} files failed to open")

    def refuse_empty_classes(self, why: str = "without images") -> None:
        # An empty class would still take a label (and a class embedding never trained).
        empty = sorted(set(self.classes) - {self.classes[label] for _, label in self.samples})
        if empty:
            raise ValueError(
                f"data folder {self.root}: class folders {why}: {_some(empty)}; "
                f"add images or remove those folders (every sub-folder is a class)"
            )

    def find_unreadable(self, rank: int = 0, world: int = 1) -> list[Path]:
        """Open every image of this process's share (``rank`` of ``world``); the failures."""
        from concurrent.futures import ThreadPoolExecutor

        def unreadable(path: Path) -> bool:
            try:
                with Image.open(path) as img:
                    img.draft("RGB", (self.image_size, self.image_size))  # JPEG: decode at reduced size
                    img.load()
                return False
            except Exception:  # PIL raises several types for broken files
                return True

        mine = [path for path, _ in self.samples[rank::world]]
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            return [p for p, b in zip(mine, pool.map(unreadable, mine)) if b]

    def drop_unreadable(self, bad: list[Path]) -> list[Path]:
        """Refuse (listing every file) or, with ``skip_corrupt``, drop the given unreadable images."""
        if not bad:
            return []
        if not self.skip_corrupt:
            raise OSError(f"{len(bad)} unreadable image(s) in {self.root}: {_some([str(p) for p in bad], 20)}; "
                          f"fix or remove them, or pass --skip-corrupt to leave them out")
        dropped = set(bad)
        self.samples = [(p, y) for p, y in self.samples if p not in dropped]
        if not self.samples:
            raise OSError(f"no readable image in {self.root}: all {len(bad)} files failed to open")
        self.refuse_empty_classes("whose images are all unreadable")
        warnings.warn(f"leaving out {len(bad)} unreadable image(s) of {self.root}: {_some([str(p) for p in bad], 20)}")
        return bad


def check_images(dataset: ImageFolderDataset, state=None) -> list[Path]:
    """The up-front check (``--check-data``, ``extract_latents.py``): every process of an
    Accelerate ``state`` opens its share, all see the full list of unreadable files, which
    is an error naming them all, or with ``skip_corrupt`` a warning and their removal."""
    rank, world = (state.process_index, state.num_processes) if state is not None else (0, 1)
    bad = dataset.find_unreadable(rank, world)
    if world > 1:
        from accelerate.utils import gather_object

        bad = gather_object(bad)
    return dataset.drop_unreadable(sorted(bad))


def _some(items: list, limit: int = 10) -> str:
    """``a, b, c`` or ``a, b, … (N in all)``: lists in error messages stay one line."""
    shown = ", ".join(map(str, items[:limit]))
    return shown if len(items) <= limit else f"{shown}, … ({len(items)} in all)"


class DigitsDataset(Dataset):
    """The embedded digits, 1×S×S in [-1, 1], S = 8 (the scans) or 16, 32, 64 (upscaled 2×,
    4×, 8×, every f×f block averaging to its scan pixel; ``nala_dit.data.digits.upscale_digits``); pixel space,
    no VAE, no download."""

    is_latent = False

    def __init__(self, split: str = "train", size: int = 8):
        from .digits import load_digits_split

        self._set(*load_digits_split(split, size))

    def _set(self, images, labels) -> None:
        """uint8 (N, H, W) images and int labels → the tensors the trainer reads."""
        from .digits import DIGIT_LABELS

        self.images = torch.from_numpy(images).float().unsqueeze(1) / 127.5 - 1.0  # (N, 1, H, W)
        self.labels = torch.from_numpy(labels).long()
        self.classes = list(DIGIT_LABELS)
        self.num_classes = len(self.classes)
        self.channels = 1
        self.image_size = images.shape[-1]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], int(self.labels[index])


class DigitsCanvasDataset(DigitsDataset):
    """The digits canvas (``--data digits-canvas --image-size S``): 1×S×S in [-1, 1], S in
    32 / 64 / 128, one digit upscaled to S/2 at a random position, the same placements at
    every size (``nala_dit.data.digits.load_canvas_split``)."""

    def __init__(self, split: str = "train", size: int = 32):
        from .digits import load_canvas_split

        images, labels, self.offsets = load_canvas_split(split, size=size)
        self._set(images, labels)


# meta.json keys a latent folder is read by, and what each must hold.
LATENT_META_TYPES = dict(shards=(list, "a list of shard file names"), classes=(list, "a list of class names"),
                         scaling_factor=((int, float), "a number"), latent_channels=(int, "an integer"),
                         image_size=(int, "an integer"))


def read_latent_meta(root: str | os.PathLike) -> dict:
    """A latent folder's ``meta.json``, checked: every key ``LATENT_META_TYPES`` names, of
    its type, and shard names that stay inside the folder; else a one-line error naming
    the file and the key."""
    root = Path(root)
    path = root / LATENT_META
    fix = "rerun extract_latents.py with the same flags (finished shards are kept)"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {root} is not a latent folder written by extract_latents.py")
    meta = read_json(path, fix)   # invalid or nested too deeply: one line naming the file
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(meta).__name__}; {fix}")
    for key, (types, what) in LATENT_META_TYPES.items():
        value = meta.get(key)
        if key not in meta or isinstance(value, bool) or not isinstance(value, types):
            got = "missing" if key not in meta else f"got {value!r:.60} ({type(value).__name__})"
            raise ValueError(f"{path}: {key!r} must be {what}, {got}; {fix}")
    for key in ("shards", "classes"):
        if not all(isinstance(v, str) and v for v in meta[key]):
            raise ValueError(f"{path}: {key!r} must be {LATENT_META_TYPES[key][1]} (non-empty strings); {fix}")
    inside = root.resolve()
    for name in meta["shards"]:
        if Path(name).is_absolute() or inside not in (root / name).resolve().parents:
            raise ValueError(f"{path}: shard {name!r} is outside {root}: shards are file names inside the latent "
                             f"folder; {fix}")
    if not math.isfinite(meta["scaling_factor"]) or meta["scaling_factor"] <= 0:
        raise ValueError(f"{path}: 'scaling_factor' must be a positive number, got {meta['scaling_factor']!r}; {fix}")
    stats = meta.get("latent_stats")
    if stats is not None:  # written by extract_latents once every shard is there
        channels = meta["latent_channels"]
        good = isinstance(stats, dict) and all(
            isinstance(stats.get(k), list) and len(stats[k]) == channels
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in stats[k])
            for k in ("mean", "std"))
        if not good:
            raise ValueError(f"{path}: 'latent_stats' must hold 'mean' and 'std', {channels} finite numbers each, got "
                             f"{stats!r:.80}; {fix}")
    return meta


class LatentDataset(Dataset):
    """Shards of ``extract_latents``: each item is (moments of image and mirror, label).

    x has shape ``(2, 2, C, h, w)``: [orig, flipped] × [mean, logvar]. Use
    ``sample_latents`` in the training step to draw the flip and the latent. Shards are
    memory-mapped (safetensors), so an ImageNet-size folder does not need to fit in RAM.
    With ``images`` (``--repa-encoder``), x is (moments, the uint8 image (3, S, S) the
    extraction kept with ``--keep-images``).
    """

    is_latent = True   # items are latent moments: the training step samples them (sample_latents)

    def __init__(self, root: str | os.PathLike, images: bool = False):
        from safetensors import safe_open

        self.root = Path(root)
        self.meta = read_latent_meta(self.root)
        self.images = images
        if images and not self.meta.get("images"):
            raise ValueError(f"{self.root}: cache without images: rerun extract_latents.py with --keep-images "
                             f"(into another --out; --repa-encoder needs the clean images)")
        self.shards = [self.root / name for name in self.meta["shards"]]
        missing = [str(s) for s in self.shards if not s.is_file()]
        if missing:
            raise FileNotFoundError(
                f"latent folder {self.root} is incomplete: missing {missing[:3]}; rerun extract_latents.py to resume"
            )
        self.offsets = [0]
        labels, grid = [], None
        for shard in self.shards:
            try:
                with safe_open(str(shard), "pt") as f:
                    labels.append(f.get_tensor("labels"))
                    moments = tuple(f.get_slice("moments").get_shape())
                    pixels = tuple(f.get_slice("images").get_shape()) if "images" in f.keys() else None
            except Exception as err:  # safetensors raises its own error types
                raise ValueError(f"{shard}: unreadable latent shard ({type(err).__name__}: {err}); delete it and "
                                 f"rerun extract_latents.py with the same flags to rewrite it") from None
            grid = self._check_shard(shard, len(labels[-1]), moments, pixels, grid)
            self.offsets.append(self.offsets[-1] + len(labels[-1]))
        self.labels = torch.cat(labels).long()
        self.classes = self.meta["classes"]
        self.num_classes = len(self.classes)
        self._check_classes()
        self.scaling_factor = self.meta["scaling_factor"]
        # per-channel mean/std of the whole cache and the encoder's fingerprint (None: a cache written
        # before extract_latents recorded them; rerunning it with the same flags adds them)
        self.stats = self.meta.get("latent_stats")
        self.vae_fingerprint = self.meta.get("vae_fingerprint")
        self.channels = self.meta["latent_channels"]
        self.image_size = self.meta["image_size"]
        self._handles: dict[int, object] = {}

    def _check_classes(self) -> None:
        """``meta.json``'s class list against the labels the shards hold, before a model of that
        many classes is built: names unique, every label a class of the list, and every class
        holding at least one latent (as an image folder's classes hold images), which also bounds
        the count by the images; else one line naming the file."""
        path, fix = self.root / LATENT_META, "rerun extract_latents.py into a new --out, or restore the file"
        if len(set(self.classes)) != len(self.classes):
            twice = next(name for name in self.classes if self.classes.count(name) > 1)
            raise ValueError(f"{path}: 'classes' names {twice!r} twice; {fix}")
        if len(self.labels) and (int(self.labels.min()) < 0 or int(self.labels.max()) >= len(self.classes)):
            raise ValueError(f"{path}: the shards hold labels {int(self.labels.min())}..{int(self.labels.max())}, "
                             f"but 'classes' lists {len(self.classes):,} name(s); {fix}")
        if len(self.classes) > len(self.labels):
            raise ValueError(f"{path}: 'classes' lists {len(self.classes):,} names for {len(self.labels):,} latents: "
                             f"every class needs at least one; {fix}")
        empty = (torch.bincount(self.labels, minlength=len(self.classes)) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"{path}: {len(empty):,} of the {len(self.classes):,} classes hold no latent (e.g. "
                             f"{self.classes[empty[0]]!r}, label {empty[0]}): the class list does not match the "
                             f"shards; {fix}")

    def _check_shard(self, shard: Path, n: int, moments: tuple, pixels: tuple | None, grid):
        """A shard's tensors as ``extract_latents`` writes them, from its header: ``moments``
        (n, 2 flips, mean/logvar, channels, h, h) with every shard's h the same, and with
        ``images`` the (n, 3, S, S) pixels; else one line naming the shard (not a shape error
        from inside a DataLoader worker at the first step)."""
        fix = "delete it and rerun extract_latents.py with the same flags to rewrite it"
        channels, size = self.meta["latent_channels"], self.meta["image_size"]
        expected = f"(N, 2, 2, {channels}, h, h) as extract_latents.py writes for {channels} latent channels"
        if len(moments) != 6 or moments[:4] != (n, 2, 2, channels) or moments[4] != moments[5] \
                or (grid is not None and moments[4:] != grid):
            if grid is not None and len(moments) == 6 and moments[:4] == (n, 2, 2, channels):
                expected = f"the other shards' (N, 2, 2, {channels}, {grid[0]}, {grid[1]})"
            raise ValueError(f"{shard}: 'moments' has shape {moments}, expected {expected} ({n} labels); {fix}")
        if self.images:
            if pixels is None:
                raise ValueError(f"{shard}: holds no 'images' though {self.root / LATENT_META} says the cache kept "
                                 f"them: rerun extract_latents.py with --keep-images (into another --out; "
                                 f"--repa-encoder needs the clean images)")
            if pixels != (n, 3, size, size):
                raise ValueError(f"{shard}: 'images' has shape {pixels}, expected ({n}, 3, {size}, {size}); {fix}")
        return moments[4:]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        from safetensors import safe_open

        shard = bisect.bisect_right(self.offsets, index) - 1
        if shard not in self._handles:  # one open handle per shard and worker
            self._handles[shard] = safe_open(str(self.shards[shard]), "pt")
        row = index - self.offsets[shard]
        moments = self._handles[shard].get_slice("moments")[row: row + 1][0].float()
        if self.images:
            return (moments, self._handles[shard].get_slice("images")[row: row + 1][0]), int(self.labels[index])
        return moments, int(self.labels[index])

    def __getstate__(self):  # handles do not pickle into DataLoader workers
        return {**self.__dict__, "_handles": {}}


def random_flip(x: torch.Tensor) -> torch.Tensor:
    """Mirror each image of a (B, C, H, W) batch with probability 1/2 (global RNG)."""
    flip = torch.rand(x.shape[0], device=x.device) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def sample_latents(moments: torch.Tensor, scaling_factor, flip: bool = True, images=None):
    """(B, 2, 2, C, h, w) stored moments → a fresh latent sample in model space (B, C, h, w).

    Picks the mirrored image's posterior with probability 1/2, then draws
    ``z = mean + exp(logvar / 2)·ε`` (the VAE's DiagonalGaussian sample), and scales it:
    ``scaling_factor`` is a number (``z · f``) or a ``latent_norm.LatentNorm``. With ``images``
    (B, 3, S, S) uint8: (that, the images in [−1, 1] mirrored where the latent is).
    """
    b = moments.shape[0]
    which = (torch.rand(b, device=moments.device) < 0.5).long() if flip else torch.zeros(b, dtype=torch.long, device=moments.device)
    chosen = moments[torch.arange(b, device=moments.device), which]   # (B, 2, C, h, w)
    mean, logvar = chosen[:, 0], chosen[:, 1].clamp(-30.0, 20.0)
    z = mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)
    z = z * scaling_factor if isinstance(scaling_factor, (int, float)) else scaling_factor.normalize(z)
    if images is None:
        return z
    pixels = images.float() / 127.5 - 1
    return z, torch.where(which.bool()[:, None, None, None], pixels.flip(-1), pixels)


class EpochSampler(Sampler[int]):
    """Deterministic shuffled indices for one rank: a fixed permutation per epoch
    (seeded by ``seed + epoch``), split round-robin over ranks, padded so every rank
    gets the same count, starting at ``start`` (the data position of a resumed run)."""

    def __init__(self, size: int, rank: int, world_size: int, seed: int, epoch: int = 0, start: int = 0):
        self.size, self.rank, self.world_size, self.seed = size, rank, world_size, seed
        self.epoch, self.start = epoch, start
        self.per_rank = math.ceil(size / world_size)

    def indices(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.size, generator=g).tolist()
        perm += perm[: self.per_rank * self.world_size - self.size]
        return perm[self.rank:: self.world_size]

    def __iter__(self):
        return iter(self.indices()[self.start:])

    def __len__(self) -> int:
        return self.per_rank - self.start
