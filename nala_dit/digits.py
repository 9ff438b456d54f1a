"""The embedded default dataset: scikit-learn's handwritten digits.

`sklearn.datasets.load_digits` ships inside scikit-learn (1,797 real 8x8 scans,
10 classes, 4-bit values 0..16), so training and evaluation work offline with no
download. The split is fixed once and for all: stratified, 20 % held out,
`train_test_split(..., random_state=0)`. It is a pure function of the bundled
file and sklearn's seeded permutation, so every machine gets the same
1,437 training and 360 held-out images; `tests/test_metrics.py` pins the sizes
and class counts.

Pixel values are rescaled to uint8 with round(v * 255 / 16) so the images can go
through the same uint8 pipelines (image folders, ADM `.npz`) as real datasets.
"""

import json
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

DIGIT_LABELS = [str(i) for i in range(10)]
NUM_CLASSES = len(DIGIT_LABELS)
IMAGE_SIZE = 8
HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0
SPLITS = ("train", "heldout")


@lru_cache(maxsize=1)
def _split_indices() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    labels = load_digits().target
    index = np.arange(len(labels))
    train_idx, heldout_idx = train_test_split(
        index, test_size=HELDOUT_FRACTION, random_state=SPLIT_SEED, stratify=labels
    )
    # Sorted so the order of images does not depend on the shuffle, only membership.
    return np.sort(train_idx), np.sort(heldout_idx)


def load_digits_split(split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 (N, 8, 8) in 0..255 and labels int64 (N,) of one fixed split.

    `split` is "train" (1,437 images) or "heldout" (360 images).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    train_idx, heldout_idx = _split_indices()
    idx = train_idx if split == "train" else heldout_idx
    images = np.round(bunch.images[idx] * (255.0 / 16.0)).astype(np.uint8)
    labels = bunch.target[idx].astype(np.int64)
    return images, labels


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
    x = images.float() / 255.0
    if x.shape[1] == 3:
        weights = torch.tensor([0.299, 0.587, 0.114], device=x.device).view(1, 3, 1, 1)
        x = (x * weights).sum(1, keepdim=True)
    if x.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="area")
    return x


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
    info = json.loads((classifier_dir / CLASSIFIER_INFO).read_text())
    info["weights_file"] = str(weights.resolve())
    return model, info
