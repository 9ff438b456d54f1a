"""Absurd image counts are one line before anything is loaded or allocated: ``sample.py
--num-samples`` / ``--per-label`` (``check_counts``), ``evaluate_fid.py gen --num-samples``, and
``balanced_labels`` itself (every route that draws balanced labels); ``--grid`` / ``--out-dir``
refuse to hold more images in memory than the machine has (``check_held_images``)."""
import pytest

import evaluate_fid
import sample
from nala_dit.data.images import MAX_SAMPLES, balanced_labels
from tests.utils import one_line, one_line_error


@pytest.fixture
def never_loaded(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("nala_dit.pipelines.sources.load_source", refuse)


@pytest.mark.parametrize("flags,names", [
    (["--num-samples", "10000000000", "--grid", "g.png"], ["--num-samples", "10,000,000,000", "10,000,000"]),
    (["--num-samples", "10000000000", "--out", "s.npz"], ["--num-samples", "10,000,000,000"]),
    (["--labels", "1,2", "--per-label", "1000000000", "--grid", "g.png"], ["--per-label 1,000,000,000", "2,000,000,000"]),
])
def test_sample_refuses_absurd_counts_before_loading(tmp_path, monkeypatch, capsys, never_loaded, flags, names):
    monkeypatch.chdir(tmp_path)
    assert sample.main(["--ckpt", str(tmp_path), "--steps", "2", *flags]) == 1
    err = one_line_error(capsys)
    assert "Traceback" not in err and all(name in err for name in names), err
    assert not list(tmp_path.iterdir())


def test_evaluate_fid_gen_refuses_an_absurd_count_before_loading(tmp_path, capsys, never_loaded):
    assert evaluate_fid.main(["gen", "--ckpt", str(tmp_path), "--ref", str(tmp_path / "r.npz"),
                              "--num-samples", "10000000000"]) == 1
    err = one_line_error(capsys)
    assert "--num-samples: 10,000,000,000 images" in err, err


def test_balanced_labels_bounds_its_count():
    assert sorted(balanced_labels(20, 10, 0).tolist()) == sorted(list(range(10)) * 2)
    for count in (MAX_SAMPLES + 1, 10 ** 10, 0):
        with pytest.raises(ValueError) as err:
            balanced_labels(count, 10, 0)
        assert f"{count:,} balanced labels" in one_line(err)


def test_held_images_beyond_memory_are_refused_before_sampling(digits_checkpoint, tmp_path, monkeypatch, capsys):
    """8x8 px images, 3 bytes a pixel: 1,000 of them are 192,000 bytes; with 100,000 available
    the command refuses before sampling, and writes nothing."""
    monkeypatch.setattr("nala_dit.guards.available_memory", lambda device: (100_000, "available RAM"))
    monkeypatch.setattr("nala_dit.pipelines.sample_files.sample_images",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("sampled")))
    grid = tmp_path / "g.png"
    assert sample.main(["--ckpt", str(digits_checkpoint), "--num-samples", "1000", "--steps", "2",
                        "--grid", str(grid)]) == 1
    err = one_line_error(capsys).splitlines()[-1]
    assert "1,000 images of 8x8 px in memory (0.0 GB)" in err and "--out samples.npz --num-samples 1000" in err, err
    assert not grid.exists()
