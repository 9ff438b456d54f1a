"""experiments/cifar10_speedrun/run.py: the smoke run end to end, resume, the data on device, FID."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TARBALL = ROOT.parent / "shared" / "data" / "cifar10" / "cifar10_jpg.tar.gz"
needs_data = pytest.mark.skipif(not TARBALL.is_file(), reason=f"{TARBALL} is absent (CIFAR-10 for development)")


def _load_run():
    spec = importlib.util.spec_from_file_location("speedrun_run", ROOT / "experiments" / "cifar10_speedrun" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = _load_run()
sys.path.insert(0, str(ROOT))
import evaluate_fid  # noqa: E402


@pytest.fixture(scope="module")
def cifar_subset(tmp_path_factory):
    """The first 10 files of each class of both splits (200 images), read from the tarball."""
    if not TARBALL.is_file():
        pytest.skip(f"{TARBALL} is absent (CIFAR-10 for development)")
    out = tmp_path_factory.mktemp("cifar")
    if shutil.which("tar"):   # GNU tar picks the 200 of 60,000 members in C: ~1 s, where tarfile takes ~12 s
        subprocess.run(["tar", "-xzf", str(TARBALL), "-C", str(out), "--wildcards", "cifar10/*/*/000[0-9].jpg"],
                       check=True)
    else:
        with tarfile.open(TARBALL) as tar:
            members = [m for m in tar if m.isfile() and int(Path(m.name).stem) < 10]
            tar.extractall(out, members=members, filter="data")
    return out / "cifar10"


@pytest.fixture(scope="module")
def smoke(cifar_subset, inception_weights, tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    argv = ["--smoke", "--cifar", str(cifar_subset), "--out", str(out), "--inception-weights", str(inception_weights),
            "--allow-unknown-weights"]
    run.main(argv)
    return out, argv


@needs_data
@pytest.mark.slow  # the run end to end, Inception on CPU: about 20 s on 2 shared cores
def test_smoke_writes_every_stage_and_the_summary_is_recomputed_from_the_cells(smoke):
    out, _ = smoke
    assert (out / "data_fid.json").is_file()
    cells = {p.stem: json.loads(p.read_text()) for p in (out / "cells").glob("*.json")}
    assert set(cells) == {"softmax_mlp_s0", "nala_mlp_s0"}
    assert all(c["train"]["steps"] == 5 and c["samples"] == 10 and c["batched_seeds"] == 1 for c in cells.values())
    assert json.loads((out / "data_fid.json").read_text())["n_test"] == 20   # 2 images a class
    assert "fid_between_sets" in cells["softmax_mlp_s0"]
    summary = json.loads((out / "summary.json").read_text())
    for v, row in summary["variants"].items():
        assert row["fid_mean"] == pytest.approx(cells[f"{v}_s0"]["fid"], abs=0)
        assert row["step_s"] == cells[f"{v}_s0"]["train"]["step_s"] and row["n"] == 1 and row["fid_spread"] == 0.0
        assert row["images_per_s"] == pytest.approx(5 * 8 / cells[f"{v}_s0"]["train"]["seconds"], rel=1e-12)
    assert summary["variants"]["nala_mlp"]["contrast_vs_softmax_mlp"]["0"] == pytest.approx(
        cells["nala_mlp_s0"]["fid"] - cells["softmax_mlp_s0"]["fid"], abs=1e-12)
    assert summary["variants"]["softmax_mlp"]["contrast_vs_softmax_mlp"]["0"] == 0.0


@needs_data
@pytest.mark.slow
def test_resume_does_not_redo_finished_cells(smoke, monkeypatch):
    out, argv = smoke
    before = {p.name: p.read_text() for p in (out / "cells").glob("*.json")}
    (out / "cells" / "nala_mlp_s0.json").rename(out / "nala_mlp_s0.json.moved")   # an interrupted run
    trained = []
    real = run.train_variant
    monkeypatch.setattr(run, "train_variant", lambda v, s, *a, **k: trained.append((v, s)) or real(v, s, *a, **k))
    try:
        run.main(argv)
    finally:
        (out / "nala_mlp_s0.json.moved").unlink()
    assert trained == [("nala_mlp", [0])]
    assert (out / "cells" / "softmax_mlp_s0.json").read_text() == before["softmax_mlp_s0.json"]


@needs_data
def test_data_on_device_equals_the_image_folder(cifar_subset):
    from nala_dit.data.datasets import ImageFolderDataset, random_flip

    images, labels = run.load_split(cifar_subset / "train")
    ds = ImageFolderDataset(cifar_subset / "train", 32)
    assert ds.classes[:3] == ["airplane", "automobile", "bird"] and len(images) == len(ds) == 100
    assert images.dtype == torch.uint8
    for i in (0, 37, 99):
        x, y = ds[i]
        assert labels[i] == y
        assert torch.equal(images[i].float() / 127.5 - 1, x)
    ref = torch.stack([ds[i][0] for i in range(8)])
    torch.manual_seed(3)
    ours = run.batch_to_model(images[:8])
    torch.manual_seed(3)
    assert torch.equal(ours, random_flip(ref))
    assert not torch.equal(ours, ref) and ours.min() >= -1 and ours.max() <= 1


def test_fid_of_a_set_against_itself_is_zero_and_matches_evaluate_fid_calc(tmp_path, inception_weights):
    from nala_dit.evaluation import metrics
    from nala_dit.evaluation.features import InceptionExtractor

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)   # 5 a set: Inception at 299 px is the test's time
    b = rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    extractor = InceptionExtractor(inception_weights, allow_unknown=True)
    fa = metrics.compute_features(extractor, [a])["pool"]
    fb = metrics.compute_features(extractor, [b])["pool"]
    assert abs(run.fid_against(fa, fa)) < 1e-6
    np.savez(tmp_path / "b.npz", arr_0=b)
    np.savez(tmp_path / "a.npz", arr_0=a)
    common = ["--device", "cpu", "--inception-weights", str(inception_weights), "--allow-unknown-inception-weights"]
    assert evaluate_fid.main(["ref", "--data", str(tmp_path / "a.npz"), "--out", str(tmp_path / "ref.npz"), *common]) == 0
    assert evaluate_fid.main(["calc", "--samples", str(tmp_path / "b.npz"), "--ref", str(tmp_path / "ref.npz"),
                              "--json", str(tmp_path / "calc.json"), "--inception-score", "off", *common]) == 0
    theirs = json.loads((tmp_path / "calc.json").read_text())["metrics"]["fid"]
    assert run.fid_against(fb, fa) == pytest.approx(theirs, abs=1e-6)


def test_every_variant_sees_the_same_batches_for_a_seed(monkeypatch):
    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(40) % 10
    seen = {}
    real = run.batch_to_model
    for variant in ("softmax_mlp", "nala_mix"):
        monkeypatch.setattr(run, "batch_to_model", lambda u8, v=variant: seen.setdefault(v, []).append(u8) or real(u8))
        run.train_cell(variant, 7, images, labels, 2, 4, 2e-4, 256, "cpu", 60.0)
    assert len(seen["softmax_mlp"]) == 2
    assert all(torch.equal(a, b) for a, b in zip(seen["softmax_mlp"], seen["nala_mix"]))


@needs_data
@pytest.mark.slow
def test_other_settings_in_the_same_out_are_refused(smoke, capsys):
    out, argv = smoke
    with pytest.raises(SystemExit, match="error: .* holds cells of other settings"):
        run.main(argv + ["--cfg-scale", "2.0"])


@pytest.mark.parametrize("variant", ["softmax_mlp", "nala_mix"])
def test_batched_seeds_end_with_the_weights_of_their_plain_runs(variant):
    """Seed 5 trained beside seed 0 (vmap over stacked weights, foreach AdamW and the EMA on the
    stacked tensors) ends, after 3 steps, with the weights and EMA of its plain single-model run
    (``train_cell``: its own AdamW, ``MicroBatchLoss``), to fp32 rounding; the steps moved the
    weights by 1e-4 or more, so the comparison is not of the initial weights."""
    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(40) % 10
    batched, _, timing = run.train_variant(variant, [0, 5], images, labels, 3, 4, 2e-4, 256, "cpu", 60.0)
    [(plain, plain_ema)], _, _ = run.train_cell(variant, 5, images, labels, 3, 4, 2e-4, 256, "cpu", 60.0)
    initial = run.build(variant, 5, 256, "cpu")[0]
    model, ema = batched[1]
    assert timing["steps"] == 3 and len(timing["final_loss"]) == 2

    def gap(a, b):
        return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))

    assert gap(initial, plain) > 1e-4
    assert gap(model, plain) < 1e-6
    assert gap(ema, plain_ema) < 1e-6
    assert gap(batched[0][0], plain) > 1e-3   # seed 0's slice is another model


@pytest.mark.parametrize("flag, value", [("--seeds", "0"), ("--samples", "1"), ("--steps", "0")])
def test_a_count_below_its_least_is_one_error_line(tmp_path, flag, value):
    for split in ("train", "test"):
        (tmp_path / "cifar" / split).mkdir(parents=True)
    with pytest.raises(SystemExit, match=f"^error: {flag} {value}: pass [12] or more$"):
        run.main(["--cifar", str(tmp_path / "cifar"), "--out", str(tmp_path / "out"), flag, value])
    assert not (tmp_path / "out").exists()
