"""The embedded default dataset: scikit-learn's handwritten digits.

`sklearn.datasets.load_digits` ships inside scikit-learn (1,797 real 8x8 scans,
10 classes, 4-bit values 0..16), so training and evaluation work offline with no
download. The split is fixed once and for all: stratified, 20 % held out,
`train_test_split(..., random_state=0)`. It is a pure function of the bundled
file and sklearn's seeded permutation, so every machine gets the same
1,437 training and 360 held-out images; `tests/evaluation/test_metrics.py` pins the sizes
and class counts. The file is read and the split taken from ``digits_split.py`` without
importing scikit-learn (about 2 s per process); `tests/data/test_digits.py` checks both
against scikit-learn's own functions.

Pixel values are rescaled to uint8 with round(v * 255 / 16) so the images can go
through the same uint8 pipelines (image folders, ADM `.npz`) as real datasets.
"""

import importlib.util
import json
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .choices import CANVAS_SIZES, DIGITS_SIZES, check_canvas_size, check_digits_size  # noqa: F401
from .digits_split import HELDOUT_INDICES

DIGIT_LABELS = [str(i) for i in range(10)]
NUM_CLASSES = len(DIGIT_LABELS)
IMAGE_SIZE = 8
HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0
SPLITS = ("train", "heldout")


@lru_cache(maxsize=1)
def _scans() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 scans (float64 (N, 8, 8), 0..16) and labels, as ``load_digits()``
    gives them, read from its bundled ``digits.csv.gz`` without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():   # another layout: let scikit-learn read it
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, IMAGE_SIZE, IMAGE_SIZE), data[:, -1].astype(int)


@lru_cache(maxsize=1)
def _split_indices() -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices into the scans, each sorted: the order of images does not
    depend on the shuffle, only membership."""
    heldout = np.array(HELDOUT_INDICES)
    return np.setdiff1d(np.arange(len(_scans()[1])), heldout), heldout


def load_digits_split(split: str, size: int = IMAGE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 (N, size, size) in 0..255 and labels int64 (N,) of one fixed split.

    `split` is "train" (1,437 images) or "heldout" (360 images); `size` is 8 (the scans) or
    16, 32, 64 (the scans upscaled 2x, 4x, 8x by ``upscale_digits``: every f×f block averages
    to its scan pixel).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    check_digits_size(size)
    scans, targets = _scans()
    train_idx, heldout_idx = _split_indices()
    idx = train_idx if split == "train" else heldout_idx
    images = np.round(scans[idx] * (255.0 / 16.0)).astype(np.uint8)
    labels = targets[idx].astype(np.int64)
    return (images if size == IMAGE_SIZE else upscale_digits(images, size // IMAGE_SIZE)), labels


# The digits ladder (``--data digits --image-size 16``): the same scans at 2x, 64 tokens at
# patch 2, so a demo model can be fine-tuned up the ladder on the embedded data. Plain
# bilinear upscaling does not keep the scan: along a row its 2x2 mean is x_i + (x_{i-1} −
# 2 x_i + x_{i+1}) / 8 (a blur), and the scoring (area-averaging back to 8x8, as every
# classifier input is) would then see other digits than the held-out ones. So each scan
# pixel's 2x2 block takes bilinear's shape (its deviation from the block mean), scaled down
# just enough to stay in 0..255, around the scan value, and the uint8 rounding hands the
# block's remainder to its largest fractions: every block sums to exactly 4x its scan pixel
# (blank pixels stay blank, the ink gets bilinear's smooth edges). Area-averaging 16 -> 8
# gives back the 8x8 scans exactly (tested).

def upscale_digits(images: np.ndarray, factor: int = 2) -> np.ndarray:
    """uint8 images (N, H, W) -> uint8 (N, H·factor, W·factor) whose factor×factor blocks
    sum to exactly factor² × the source pixel: bilinear detail inside each block, kept in
    0..255 by scaling that block's detail down, rounded by largest remainders."""
    if images.ndim != 3 or images.dtype != np.uint8 or factor < 1:
        raise ValueError(f"expected uint8 images (N, H, W) and factor >= 1, got {images.dtype} {images.shape}, {factor}")
    n, h, w = images.shape
    x = torch.from_numpy(images).double()
    big = F.interpolate(x[:, None], scale_factor=factor, mode="bilinear", align_corners=False)[:, 0]
    blocks = big.view(n, h, factor, w, factor).permute(0, 1, 3, 2, 4).reshape(n, h, w, factor * factor)
    dev = blocks - blocks.mean(-1, keepdim=True)                     # bilinear's shape in each block
    target = x[..., None]
    # The largest t <= 1 with target + t·dev inside [0, 255] at every pixel of the block.
    room = torch.where(dev > 0, (255.0 - target) / dev.clamp(min=1e-12),
                       torch.where(dev < 0, target / (-dev).clamp(min=1e-12), torch.full_like(dev, np.inf)))
    t = room.amin(-1, keepdim=True).clamp(max=1.0)
    values = (target + t * dev).clamp(0.0, 255.0)
    low = values.floor()
    short = (target[..., 0] * factor * factor - low.sum(-1)).round().long()   # 0 .. factor²-1
    rank = (values - low).argsort(dim=-1, descending=True, stable=True).argsort(dim=-1, stable=True)
    out = (low + (rank < short[..., None]).double()).long()
    out = out.view(n, h, w, factor, factor).permute(0, 1, 3, 2, 4).reshape(n, h * factor, w * factor)
    return out.clamp(0, 255).to(torch.uint8).numpy()


# The digits canvas: a harder task for attention (256 tokens at patch 2). Each digit is
# upscaled 2x (bilinear) to 16x16 and pasted at a random position of an empty 32x32
# canvas; the label is the digit. A model must place one coherent digit somewhere on a
# large blank grid, so tokens far apart have to agree (global structure), unlike the 8x8
# task where 16 tokens see everything. The positions come from a seeded generator: the
# same (split, seed, copies) always gives the same canvases.
#
# The ladder (64 and 128 px: 1,024 and 4,096 tokens at patch 2) is the same picture at a
# higher resolution: the digit is upscaled to half the canvas side and its offset is the
# 32-px offset times size/32 (the same generator draws, so canvas k holds the same digit at
# the same relative place at every size). Bilinear upscaling samples one piecewise-linear
# surface, and the 2x2 mean of the samples at side 2m equals the sample at side m (no
# breakpoint falls between two paired samples), so area-averaging a 64 canvas by 2 gives
# the 32 canvas up to the uint8 rounding of each: within 1 grey level (tested).

CANVAS_SIZE = CANVAS_SIZES[0]      # the base canvas (and the default of --image-size)
CANVAS_DIGIT = 16
CANVAS_SEEDS = {"train": 0, "heldout": 1}
CANVAS_COPIES = {"train": 4, "heldout": 1}


def make_canvas(images: np.ndarray, labels: np.ndarray, seed: int, copies: int = 1, size: int = CANVAS_SIZE):
    """uint8 digits (N, 8, 8) -> (canvases uint8 (N·copies, size, size), labels, offsets (N·copies, 2)).

    Canvas ``k`` holds digit ``k % N`` upscaled to size/2 × size/2 with its top-left corner at
    ``offsets[k] = (row, col)``: a draw uniform in ``0..16`` times ``size / 32``; everything else is 0.
    """
    if images.ndim != 3 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE) or images.dtype != np.uint8:
        raise ValueError(f"expected uint8 digits (N, 8, 8), got {images.dtype} {images.shape}")
    scale = check_canvas_size(size) // CANVAS_SIZE
    digit = CANVAS_DIGIT * scale
    big = F.interpolate(torch.from_numpy(images).float()[:, None], size=(digit, digit),
                        mode="bilinear", align_corners=False)[:, 0].round().clamp(0, 255).to(torch.uint8).numpy()
    n = len(images)
    rng = np.random.default_rng(seed)
    offsets = rng.integers(0, CANVAS_SIZE - CANVAS_DIGIT + 1, size=(n * copies, 2)) * scale
    canvases = np.zeros((n * copies, size, size), dtype=np.uint8)
    for k, (r, c) in enumerate(offsets):
        canvases[k, r:r + digit, c:c + digit] = big[k % n]
    return canvases, np.tile(labels, copies), offsets


def load_canvas_split(split: str, seed: int | None = None, copies: int | None = None, size: int = CANVAS_SIZE):
    """The canvas of one digits split: (canvases uint8 (N, size, size), labels int64, offsets).

    Defaults: train = 4 placements of each of the 1,437 training digits (seed 0), held out =
    one placement of each of the 360 held-out digits (seed 1); the same placements at every size.
    """
    images, labels = load_digits_split(split)
    seed = CANVAS_SEEDS[split] if seed is None else seed
    return make_canvas(images, labels, seed, CANVAS_COPIES[split] if copies is None else copies, size)


def canvas_window(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """Float canvases (B, 1, 32, 32) -> (rows, cols) of the 16x16 window holding the most ink."""
    ink = F.avg_pool2d(x, CANVAS_DIGIT, stride=1).flatten(1)                         # (B, 17·17)
    side = CANVAS_SIZE - CANVAS_DIGIT + 1
    grid = torch.arange(side * side)
    # Digits have blank border rows/columns, so several windows hold all the ink: take
    # the middle of those (this recovers the true row of every held-out canvas; the column
    # can be one off, the window still holding all the ink).
    best = (ink >= ink.max(1, keepdim=True).values * 0.999).float()
    count = best.sum(1)
    rows = ((best * (grid // side)).sum(1) / count).round().long().tolist()
    cols = ((best * (grid % side)).sum(1) / count).round().long().tolist()
    return rows, cols


def canvas_crop(images: np.ndarray) -> np.ndarray:
    """uint8 canvases (B, S, S, 1), S in ``CANVAS_SIZES`` -> the S/2-side window of largest
    ink, area-averaged to (B, 8, 8, 1): what the digits classifier scores for a canvas sample.

    The window is chosen on the canvas area-averaged to 32 px and cut at full resolution
    (at a multiple of S/32), so every size scores the same window of the same picture: the
    crops of one held-out canvas at 32, 64 and 128 px agree within 2 grey levels (tested).
    """
    x = torch.from_numpy(np.ascontiguousarray(images)).float().permute(0, 3, 1, 2)   # (B, 1, S, S)
    if x.ndim != 4 or x.shape[1] != 1 or x.shape[2] != x.shape[3] or x.shape[2] not in CANVAS_SIZES:
        raise ValueError(f"expected canvases (B, S, S, 1) with S in {CANVAS_SIZES}, got {tuple(images.shape)}")
    scale = x.shape[-1] // CANVAS_SIZE
    digit = CANVAS_DIGIT * scale
    rows, cols = canvas_window(F.avg_pool2d(x, scale) if scale > 1 else x)
    crops = torch.stack([x[i, :, r * scale:r * scale + digit, c * scale:c * scale + digit]
                         for i, (r, c) in enumerate(zip(rows, cols))])                # (B, 1, S/2, S/2)
    small = F.interpolate(crops, size=(IMAGE_SIZE, IMAGE_SIZE), mode="area")
    return small.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


# The digits classifier: a stand-in for Inception when the data are 8x8 digits.
# Inception features of 8x8 images upsampled to 299 px say little; a small CNN
# trained on the train split gives a feature space (its penultimate layer) in
# which a Frechet distance is meaningful, and logits for class-consistency.
# Its scores are NOT comparable to Inception FID.

CLASSIFIER_DIR = "runs/digits_classifier"
CLASSIFIER_WEIGHTS = "model.safetensors"
CLASSIFIER_INFO = "classifier.json"
MIN_HELDOUT_ACCURACY = 0.95


class DigitsClassifier(nn.Module):
    """Two 3x3 convs, one 2x2 max-pool, a 128-d hidden layer, 10 logits."""

    feature_dim = 128

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.hidden = nn.Linear(64 * 4 * 4, self.feature_dim)
        self.head = nn.Linear(self.feature_dim, NUM_CLASSES)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 1, 8, 8) float in [0, 1] -> penultimate features (B, 128)."""
        x = F.relu(self.conv1(x))  # (B, 32, 8, 8)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (B, 64, 4, 4)
        return F.relu(self.hidden(x.flatten(1)))  # (B, 128)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = self.features(x)
        return feats, self.head(feats)  # (B, 128), (B, 10)


def digits_to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 images (B, C, H, W), C in {1, 3}, H = W >= 8 -> (B, 1, 8, 8) float in [0, 1].

    Colour is turned into luma with ITU-R 601 weights (what PIL's "L" mode does);
    larger images are box-averaged down to 8x8 ("area" interpolation).
    """
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"expected uint8 images (B, 1 or 3, H, W), got {tuple(images.shape)}")
    x = images.float()
    if x.shape[1] == 3:
        weights = torch.tensor([0.299, 0.587, 0.114], device=x.device).view(1, 3, 1, 1)
        x = (x * weights).sum(1, keepdim=True)
    if x.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        # Averaged before the scaling: a block mean of grey levels is exact in float32, so
        # the 16-px digits (upscale_digits) score bit for bit as their 8-px scans.
        x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="area")
    return x / 255.0


def _accuracy(model: DigitsClassifier, images: np.ndarray, labels: np.ndarray) -> float:
    with torch.no_grad():
        x = digits_to_input(torch.from_numpy(images)[:, None])
        _, logits = model(x)
    return float((logits.argmax(1).numpy() == labels).mean())


def train_digits_classifier(
    out_dir: str | Path = CLASSIFIER_DIR, epochs: int = 15, seed: int = 0
) -> dict:
    """Train the digits classifier on the train split and save it to `out_dir`.

    Deterministic CPU training (fixed seed, one thread, fixed
    batch order from a seeded generator): about 5 s. Writes
    `model.safetensors` and `classifier.json` (held-out accuracy, recipe) and
    returns the json dict. Raises if held-out accuracy is below 95 %.
    """
    images, labels = load_digits_split("train")
    heldout_images, heldout_labels = load_digits_split("heldout")
    x = digits_to_input(torch.from_numpy(images)[:, None])
    y = torch.from_numpy(labels)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-identical results across machines with different core counts
    try:
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = DigitsClassifier()
        opt = torch.optim.Adam(model.parameters(), lr=2e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
        batch = 64
        model.train()
        for _ in range(epochs):
            order = torch.randperm(len(x), generator=gen)
            for start in range(0, len(x), batch):
                idx = order[start : start + batch]
                xb = x[idx]
                # One-pixel random shifts: cheap augmentation that helps on 1.4k images.
                dx, dy = torch.randint(-1, 2, (2,), generator=gen).tolist()
                xb = torch.roll(xb, shifts=(dy, dx), dims=(2, 3))
                _, logits = model(xb)
                loss = F.cross_entropy(logits, y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()
        model.eval()
        acc = _accuracy(model, heldout_images, heldout_labels)
    finally:
        torch.set_num_threads(threads)

    if acc < MIN_HELDOUT_ACCURACY:
        raise RuntimeError(f"digits classifier reached only {acc:.3f} held-out accuracy")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), str(out_dir / CLASSIFIER_WEIGHTS))
    info = {
        "heldout_accuracy": acc,
        "num_train": len(images),
        "num_heldout": len(heldout_images),
        "epochs": epochs,
        "seed": seed,
        "feature_dim": DigitsClassifier.feature_dim,
        "split": f"sklearn load_digits, stratified train_test_split(test_size={HELDOUT_FRACTION}, random_state={SPLIT_SEED})",
        "note": "scores in this feature space are not comparable to Inception FID",
    }
    (out_dir / CLASSIFIER_INFO).write_text(json.dumps(info, indent=2))
    return info


def load_digits_classifier(
    classifier_dir: str | Path = CLASSIFIER_DIR, train_if_missing: bool = True
) -> tuple[DigitsClassifier, dict]:
    """Load (training first if absent) the cached classifier; safetensors only, no pickle."""
    classifier_dir = Path(classifier_dir)
    weights = classifier_dir / CLASSIFIER_WEIGHTS
    if classifier_dir.exists() and not classifier_dir.is_dir():
        raise ValueError(f"the digits classifier folder {classifier_dir} is a file: --digits-classifier takes a "
                         f"folder (one is trained there if it holds no classifier)")
    if not weights.exists():
        if not train_if_missing:
            raise FileNotFoundError(f"no digits classifier at {weights}")
        # A notice, not a silent side effect: this writes into the working directory.
        print(f"no digits classifier at {classifier_dir}: training one there (about 5 s, deterministic; "
              f"--digits-classifier DIR picks another folder)", file=sys.stderr)
        train_digits_classifier(classifier_dir)
    model = DigitsClassifier()
    model.load_state_dict(load_file(str(weights)))
    model.eval().requires_grad_(False)
    from ..guards import read_json

    info = read_json(classifier_dir / CLASSIFIER_INFO, f"delete {classifier_dir} to train the classifier again")
    if not isinstance(info, dict):
        raise ValueError(f"{classifier_dir / CLASSIFIER_INFO}: must hold a JSON object, got {type(info).__name__}; "
                         f"delete {classifier_dir} to train the classifier again")
    info["weights_file"] = str(weights.resolve())
    return model, info
