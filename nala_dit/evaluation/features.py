"""What the metrics read: feature extractors and streaming image readers.

Extractors share one interface, ``extract(uint8 (B, C, H, W)) -> {"pool", "logits"[,
"spatial"]}``: torch-fidelity's Inception-v3 port (FID, sFID, IS, precision/recall as
ADM defines them) and the embedded digits classifier. Readers yield uint8 NHWC numpy
batches from an image folder, an ADM ``.npz`` (streamed, never loaded whole) or an
embedded dataset, plus the labels and sidecar metadata stored beside samples. The
statistics computed from the features are in ``metrics.py``.
"""

import hashlib
import json
import zipfile
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..cli.options import DATASETS, FEATURE_CHOICES, INCEPTION_WEIGHTS_FILE

INCEPTION_NAME = "inception-v3-compat"
DIGITS_NAME = "digits-classifier"
DIGITS_NOTE = "digits-classifier scores are not comparable to Inception FID"
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
SFID_CHANNELS = 7  # ADM keeps mixed_6/conv[..., :7]: 17 * 17 * 7 = 2023 features


# Feature extractors: `extract(uint8 (B, C, H, W)) -> {"pool", "logits"[, "spatial"]}`.


class MissingWeightsError(FileNotFoundError):
    """The Inception weights are not on disk; the message says what to fetch."""


def default_inception_weights_path() -> Path:
    # torch-fidelity downloads with torch.hub.load_state_dict_from_url, which caches
    # in <torch hub dir>/checkpoints/<file name>.
    return Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_WEIGHTS_FILE


def find_inception_weights(path: str | Path | None = None) -> Path:
    """The weights file to use: `path` if given, else torch-fidelity's cache; never downloads."""
    if path is not None:
        path = Path(path)
        if path.is_file():
            return path
        where = f"--inception-weights {path} does not exist."
    else:
        path = default_inception_weights_path()
        if path.is_file():
            return path
        where = "No --inception-weights given and torch-fidelity's cache has no copy."
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    raise MissingWeightsError(
        f"Inception weights not found. {where}\n"
        f"Needed file: {INCEPTION_WEIGHTS_FILE}\n"
        f"Download it on a machine with internet from:\n  {URL_INCEPTION_V3}\n"
        f"and either put it in {default_inception_weights_path().parent}/ "
        f"or pass --inception-weights /path/to/{INCEPTION_WEIGHTS_FILE}"
    )


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class InceptionExtractor:
    """torch-fidelity's Inception-v3 port: pool (2048), bias-free logits (1008) and
    sFID spatial features (2023) from one forward pass."""

    name = INCEPTION_NAME
    feature_dim, spatial_dim, num_classes = 2048, 17 * 17 * SFID_CHANNELS, None  # labels are not scored

    def __init__(self, weights_path: str | Path | None = None, device: str = "cpu"):
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        self.weights_file = find_inception_weights(weights_path).resolve()
        self.device = torch.device(device)
        # "logits_unbiased" = pool @ fc.weight.T, no bias: what ADM's softmax graph uses.
        self.model = FeatureExtractorInceptionV3(
            INCEPTION_NAME, ["2048", "logits_unbiased"], feature_extractor_weights_path=str(self.weights_file)
        ).to(self.device)
        self._spatial = None
        # Mixed_6d.branch1x1 is BasicConv2d (conv, BN, ReLU): its output is ADM's mixed_6/conv.
        self.model.Mixed_6d.branch1x1.register_forward_hook(self._keep_spatial)

    def _keep_spatial(self, module, inputs, output):
        self._spatial = output

    def describe(self) -> dict:
        return {"extractor": self.name, "weights_file": str(self.weights_file), "weights_sha256": _file_sha256(self.weights_file)}

    @torch.no_grad()
    def extract(self, images: torch.Tensor) -> dict[str, np.ndarray]:
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)  # grayscale -> RGB, as PIL's convert("RGB")
        pool, logits = self.model(images.to(self.device))
        s = self._spatial[:, :SFID_CHANNELS]  # (B, 7, 17, 17)
        spatial = s.permute(0, 2, 3, 1).reshape(len(s), -1)  # NHWC flatten as ADM: (B, 2023)
        self._spatial = None
        return {
            "pool": pool.float().cpu().numpy(),
            "logits": logits.float().cpu().numpy(),
            "spatial": spatial.float().cpu().numpy(),
        }


class DigitsExtractor:
    """The embedded digits classifier: penultimate features (128) and logits (10)."""

    name = DIGITS_NAME
    feature_dim, spatial_dim, num_classes = 128, None, 10  # DigitsClassifier.feature_dim, NUM_CLASSES

    def __init__(self, classifier_dir: str | Path | None = None, device: str = "cpu"):
        from nala_dit.data.digits import CLASSIFIER_DIR, load_digits_classifier

        self.device = torch.device(device)
        model, self.info = load_digits_classifier(classifier_dir or CLASSIFIER_DIR)
        self.model = model.to(self.device)

    def describe(self) -> dict:
        return {
            "extractor": self.name,
            "weights_file": self.info["weights_file"],
            "classifier_heldout_accuracy": self.info["heldout_accuracy"],
            "note": DIGITS_NOTE,
        }

    @torch.no_grad()
    def extract(self, images: torch.Tensor) -> dict[str, np.ndarray]:
        from nala_dit.data.digits import digits_to_input

        feats, logits = self.model(digits_to_input(images.to(self.device)))
        return {"pool": feats.cpu().numpy(), "logits": logits.cpu().numpy()}


def build_extractor(
    features: str = "inception",
    device: str = "cpu",
    inception_weights: str | Path | None = None,
    digits_classifier_dir: str | Path | None = None,
):
    if features == "inception":
        return InceptionExtractor(inception_weights, device)
    if features == "digits":
        return DigitsExtractor(digits_classifier_dir, device)
    raise ValueError(f"features must be one of {FEATURE_CHOICES}, got {features!r}")


# Streaming inputs: every reader yields uint8 NHWC numpy batches.


def _npy_member(zip_f: zipfile.ZipFile, name: str) -> str:
    member = f"{name}.npy"
    if member not in zip_f.namelist():
        held = f"it holds {', '.join(n.removesuffix('.npy') for n in zip_f.namelist())}" if zip_f.namelist() \
            else "it holds no arrays at all"
        raise ValueError(f"{zip_f.filename}: no array {name!r} ({held})")
    return member


def load_npz_array(data, path: str | Path, key: str) -> np.ndarray:
    """``data[key]`` of an open ``np.load(path, allow_pickle=False)``; an array of Python
    objects is an error naming the file (numpy's own message names neither)."""
    try:
        return data[key]
    except ValueError as err:
        if "allow_pickle" not in str(err):
            raise
        raise ValueError(f"{path}: {key} is an array of Python objects, which is refused (reading it could run "
                         f"code); store plain numbers, e.g. np.savez(path, images, labels.astype(np.int64))") from None


def _read_npy_header(f) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    raise ValueError(f"unsupported .npy format version {version}")


def npz_array_shape(path: str | Path, name: str = "arr_0") -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of one array inside an .npz, from its header only."""
    try:
        with zipfile.ZipFile(path) as zip_f, zip_f.open(_npy_member(zip_f, name)) as f:
            shape, _, dtype = _read_npy_header(f)
    except (zipfile.BadZipFile, EOFError) as err:
        raise ValueError(f"{path}: not a readable .npz (truncated or not a zip archive: {err}); "
                         f"write it again") from None
    return shape, dtype


def iter_npz_array(path: str | Path, name: str = "arr_0", batch_size: int = 250) -> Iterator[np.ndarray]:
    """Yield `name` from an .npz in batches along axis 0 without loading it whole.

    An .npz is a zip of .npy files, so np.load's mmap_mode does not apply; as in
    ADM's `StreamingNpzArrayReader` we read the .npy header from the zip member and
    then exactly one batch of raw bytes at a time (works for stored and deflated
    members alike).
    """
    with zipfile.ZipFile(path) as zip_f, zip_f.open(_npy_member(zip_f, name)) as f:
        shape, fortran_order, dtype = _read_npy_header(f)
        if fortran_order or dtype.hasobject:
            raise ValueError(f"{path}:{name} must be a C-ordered plain array to stream it")
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        for start in range(0, shape[0], batch_size):
            count = min(batch_size, shape[0] - start)
            data = f.read(count * row_bytes)  # zip members return full reads until EOF
            if len(data) != count * row_bytes:
                raise ValueError(f"{path}:{name} is truncated")
            yield np.frombuffer(bytearray(data), dtype=dtype).reshape(count, *shape[1:])


def npz_has(path: str | Path, name: str) -> bool:
    try:
        with zipfile.ZipFile(path) as zip_f:
            return f"{name}.npy" in zip_f.namelist()
    except (zipfile.BadZipFile, EOFError) as err:
        raise ValueError(f"{path}: not a readable .npz (truncated or not a zip archive: {err}); "
                         f"write it again") from None


def list_image_files(folder: str | Path) -> list[Path]:
    """Image files under `folder`, recursive, sorted by path for a stable order."""
    files = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if not files:
        raise FileNotFoundError(f"no {'/'.join(IMAGE_EXTENSIONS)} images under {folder}")
    return files


class _ImageFiles(torch.utils.data.Dataset):
    def __init__(self, files: list[Path]):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        with Image.open(self.files[i]) as img:
            gray = img.mode in ("1", "L", "I", "I;16", "F")
            arr = np.array(img.convert("L" if gray else "RGB"))
        return torch.from_numpy(arr[..., None] if gray else arr)  # (H, W, C)


def _collate_images(items: list[torch.Tensor]) -> np.ndarray:
    if len({tuple(x.shape[:2]) for x in items}) > 1:
        raise ValueError("all images in a folder must have the same size")
    if len({x.shape[2] for x in items}) > 1:  # mixed gray and colour: promote to RGB
        items = [x.expand(-1, -1, 3) for x in items]
    return torch.stack(items).numpy()


def iter_image_folder(folder: str | Path, batch_size: int = 250, num_workers: int = 0) -> Iterator[np.ndarray]:
    loader = torch.utils.data.DataLoader(
        _ImageFiles(list_image_files(folder)), batch_size=batch_size, num_workers=num_workers, collate_fn=_collate_images
    )
    yield from loader


def iter_images(path: str | Path, batch_size: int = 250, num_workers: int = 0) -> Iterator[np.ndarray]:
    """uint8 NHWC batches from an image folder or an ADM .npz (`arr_0`)."""
    path = Path(path)
    if path.is_dir():
        yield from iter_image_folder(path, batch_size, num_workers)
        return
    if path.suffix != ".npz":
        raise ValueError(f"{path}: expected an image folder or an .npz with arr_0")
    for batch in iter_npz_array(path, "arr_0", batch_size):
        if batch.dtype != np.uint8:
            raise ValueError(f"{path}: arr_0 must be uint8 NHWC, got {batch.dtype}")
        yield batch[..., None] if batch.ndim == 3 else batch


def count_images(source: str | Path) -> int:
    """How many images `iter_images` / `iter_dataset` will yield (for progress bars)."""
    if source in DATASETS:
        from nala_dit.data.digits import load_digits_split

        return len(load_digits_split(str(source).removeprefix("digits-"))[0])
    path = Path(source)
    if path.is_dir():
        return len(list_image_files(path))
    return npz_array_shape(path, "arr_0")[0][0]


def sidecar_path(path: str | Path) -> Path | None:
    """Metadata json beside the samples: `<samples>.json` (e.g. samples.npz.json),
    else the same name with .json instead of the suffix (samples.json)."""
    path = Path(path)
    for candidate in (Path(str(path) + ".json"), path.with_suffix(".json")):
        if candidate != path and candidate.is_file():
            return candidate
    return None


def read_sidecar(path: str | Path) -> dict | None:
    found = sidecar_path(path)
    return json.loads(found.read_text()) if found else None


def read_labels(path: str | Path) -> np.ndarray | None:
    """Class labels of the samples: `arr_1` of an .npz, else the sidecar's "labels"."""
    path = Path(path)
    if path.suffix == ".npz" and npz_has(path, "arr_1"):
        with np.load(path, allow_pickle=False) as data:
            return load_npz_array(data, path, "arr_1")  # as stored: check_labels decides
    meta = read_sidecar(path)
    if meta and meta.get("labels") is not None:
        return np.asarray(meta["labels"])
    return None


def iter_dataset(name: str, batch_size: int = 250) -> Iterator[np.ndarray]:
    """uint8 NHWC batches of an embedded dataset (see `nala_dit.data.digits`)."""
    from nala_dit.data.digits import load_digits_split

    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")
    images, _ = load_digits_split(name.removeprefix("digits-"))
    for start in range(0, len(images), batch_size):
        yield images[start : start + batch_size, :, :, None]


# Up-front checks: wrong input is named (file and rule) before any feature is computed,
# instead of being scored (a 4x4 image, labels 100-109) or failing deep inside numpy.


def check_image_shape(shape: tuple, dtype, where: str, extractor) -> None:
    """Images must be uint8 NHWC (N >= 2, square, C = 1 or 3) at a size the extractor reads."""
    shape, dtype = tuple(shape), np.dtype(dtype)
    if len(shape) == 3:
        shape = (*shape, 1)  # (N, H, W) grayscale
    if len(shape) != 4 or shape[3] not in (1, 3):
        hint = ""
        if len(shape) == 4 and shape[1] in (1, 3):
            hint = "; it looks like NCHW: transpose it with x.transpose(0, 2, 3, 1)"
        raise ValueError(f"{where}: images must be (N, H, W, C) with C = 1 or 3 (NHWC), got shape {shape}{hint}")
    n, h, w, _ = shape
    if dtype != np.uint8:
        raise ValueError(f"{where}: images must be uint8 in [0, 255], got {dtype}; convert with "
                         f"np.clip(np.round(x * 255), 0, 255).astype(np.uint8) for values in [0, 1]")
    if n < 2:
        raise ValueError(f"{where}: {n} image(s); Frechet distances need at least 2")
    if h != w:
        raise ValueError(f"{where}: images must be square, got {h}x{w}")
    if extractor.name == DIGITS_NAME and h % 8:
        raise ValueError(f"{where}: the digits classifier reads 8x8 images (or sides that are multiples of 8, "
                         f"averaged down), got {h}x{w}")
    if extractor.name == INCEPTION_NAME and h < 16:
        raise ValueError(f"{where}: {h}x{w} images are too small for Inception features (at least 16x16)")


def check_labels(labels: np.ndarray, num_images: int, where: str, extractor) -> None:
    """Labels: integers, one per image, inside the classifier's classes when it scores them."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) != num_images:
        raise ValueError(f"{where}: {labels.shape} labels for {num_images} images (expected one per image)")
    if labels.dtype.kind == "f":  # 3.0 is class 3; 2.5 is no class (a cast would silently make it 2)
        fractional = labels[~np.isfinite(labels) | (labels != np.round(labels))]
        if len(fractional):
            raise ValueError(f"{where}: labels must be whole class ids, got {len(fractional)} fractional or "
                             f"non-finite value(s) (e.g. {fractional[0]}); store the integer class of each sample")
    elif labels.dtype.kind not in "iu":
        raise ValueError(f"{where}: labels must be integers, got {labels.dtype}")
    classes = extractor.num_classes
    if len(labels) and (labels.min() < 0 or (classes is not None and labels.max() >= classes)):
        bound = f"[0, {classes})" if classes is not None else ">= 0"
        raise ValueError(f"{where}: labels range over [{labels.min()}, {labels.max()}] but the {extractor.name} "
                         f"knows classes {bound}")


def check_samples(path: str | Path, extractor) -> np.ndarray | None:
    """Check a samples folder or .npz (images, labels) before scoring; returns the labels."""
    path = Path(path)
    if path.is_dir():
        files = list_image_files(path)
        from PIL import Image

        try:
            with Image.open(files[0]) as img:
                first = np.asarray(img.convert("L" if img.mode in ("1", "L", "I", "I;16", "F") else "RGB"))
        except Exception as err:  # PIL raises several types
            raise ValueError(f"{files[0]}: unreadable image ({err})") from None
        check_image_shape((len(files), *first.shape), first.dtype, f"{path} ({files[0].name})", extractor)
        num_images = len(files)
    elif path.suffix == ".npz":
        if not path.is_file():
            raise FileNotFoundError(f"samples not found: {path}")
        shape, dtype = npz_array_shape(path, "arr_0")
        check_image_shape(shape, dtype, f"{path} (arr_0)", extractor)
        num_images = shape[0]
    else:
        raise ValueError(f"{path}: expected an image folder or an .npz with arr_0")
    labels = read_labels(path)
    if labels is not None:
        check_labels(labels, num_images, f"{path} (labels)", extractor)
        labels = labels.astype(np.int64)
    return labels


def not_a_covariance(sigma: np.ndarray) -> str | None:
    """Why ``sigma`` cannot be a covariance (not symmetric, a negative eigenvalue), or None.

    Round-off leaves a singular covariance (fewer images than dimensions) with eigenvalues
    a little below 0, so the test is a Cholesky factorisation of ``sigma + δI`` with δ a
    1e-9 share of the trace; only when it fails is the smallest eigenvalue computed."""
    scale = max(float(np.abs(sigma).max()), np.finfo(np.float64).tiny)
    if np.abs(sigma - sigma.T).max() > 1e-6 * scale:
        return f"is not symmetric (|sigma - sigma^T| up to {np.abs(sigma - sigma.T).max():.3g})"
    delta = 1e-9 * max(float(np.trace(sigma)), scale)
    try:
        np.linalg.cholesky(sigma + delta * np.eye(len(sigma)))
        return None
    except np.linalg.LinAlgError:
        return f"is not positive semi-definite (smallest eigenvalue {np.linalg.eigvalsh(sigma).min():.6g})"


def check_reference(ref: dict, path: str | Path, extractor) -> None:
    """Reference statistics: shapes match the extractor's feature dimension, all finite."""
    for mu_key, sigma_key, dim in (("mu", "sigma", extractor.feature_dim), ("mu_s", "sigma_s", extractor.spatial_dim)):
        if mu_key not in ref or dim is None:
            continue
        mu, sigma = ref[mu_key], ref.get(sigma_key)
        if sigma is None or mu.shape != (dim,) or sigma.shape != (dim, dim):
            raise ValueError(f"{path}: {mu_key} {mu.shape} / {sigma_key} {None if sigma is None else sigma.shape} "
                             f"do not match the {extractor.name} features of dimension {dim}; "
                             f"compute the reference with the same --features")
        for key, value in ((mu_key, mu), (sigma_key, sigma)):
            if not np.isfinite(value).all():
                raise ValueError(f"{path}: {key} holds {int((~np.isfinite(value)).sum())} non-finite value(s); "
                                 f"recompute the reference")
        if problem := not_a_covariance(sigma):
            raise ValueError(f"{path}: {sigma_key} {problem}, so it is not a covariance matrix (a Frechet distance "
                             f"to it means nothing); rebuild the reference with `evaluate_fid.py ref`")
    if "pool" in ref:
        pool = ref["pool"]
        if pool.ndim != 2 or pool.shape[1] != extractor.feature_dim:
            raise ValueError(f"{path}: pool features {pool.shape} do not match the {extractor.name} features "
                             f"of dimension {extractor.feature_dim}")
        if not np.isfinite(pool).all():
            raise ValueError(f"{path}: pool holds non-finite values; recompute the reference")
