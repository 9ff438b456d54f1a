"""export.py: training checkpoints and official DiT/SiT weights → pipeline folders."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import export
import train
from nala_dit.diffusion.generate import SampleSettings
from nala_dit.models.dit import DiT, create_model
from nala_dit.pipelines.pipeline import NaLaDiTPipeline, NaLaSiTPipeline, load_pipeline
from nala_dit.pipelines.sample_files import sample_images
from nala_dit.pipelines.sources import load_source
from tests.utils import Evil, assert_names, one_line_error


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two real train.py steps on the digits (pixel space, 10 classes)."""
    root = tmp_path_factory.mktemp("train")
    assert train.main(["--model", "NaLaDiT-T/2", "--data", "digits", "--global-batch-size", "16",
                       "--max-steps", "2", "--num-workers", "0", "--results-dir", str(root), "--exp-name", "x",
                       "--sample-every", "0", "--log-every", "1", "--ckpt-every", "2"]) == 0
    return root / "x"


def test_export_checkpoint_written_by_train(trained, tmp_path):
    labels_file = tmp_path / "names.txt"
    labels_file.write_text("\n".join(f"digit {i}" for i in range(10)))
    out = tmp_path / "pipe"
    assert export.main(["checkpoint", str(trained), str(out), "--labels-file", str(labels_file)]) == 0
    index = json.loads((out / "model_index.json").read_text())
    assert index["transformer"] == ["nala_dit.models.dit", "DiT"] and index["vae"] == [None, None]
    assert index["source"]["step"] == 2 and index["source"]["weights"] == "ema"
    assert index["objective_config"] == {"noise-schedule": "linear", "diffusion-steps": 1000}
    # The EMA weights, bit for bit.
    ema = load_file(str(trained / "checkpoints" / "0000002" / "ema.safetensors"))
    saved = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(ema[k], saved[k]) for k in ema)

    pipe = load_pipeline(out)
    assert isinstance(pipe, NaLaDiTPipeline) and pipe.id2label[3] == "digit 3"
    pipe.set_progress_bar_config(disable=True)
    got = pipe(["digit_3", 4], sampler="ddim", num_inference_steps=3, generator=11).images
    # The checkpoint through sample.py's code path gives the same pixels.
    ref, _ = sample_images(load_source(trained), [3, 4], 11, SampleSettings("ddim", 3))
    for a, b in zip(got, ref.numpy()):
        np.testing.assert_array_equal(np.asarray(a), b[..., 0])


def test_export_official_weights(tmp_path):
    """Fake "official" checkpoints from our own softmax state dicts, saved with torch.save.
    The weights are perturbed first (a fresh model's adaLN and final layer are all zero, so
    a key mix-up among them would pass unseen); every export keeps each tensor bit for bit."""
    def perturbed(model, seed):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:      # not the frozen sin-cos table: a function of the config
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        return model

    def same_weights(want, got):
        got = got.state_dict()
        return want.state_dict().keys() == got.keys() and all(torch.equal(v, got[k]) for k, v in want.state_dict().items())

    dit = perturbed(create_model("DiT-T/4", input_size=8, num_classes=1000), 0)
    torch.save(dit.state_dict(), tmp_path / "DiT.pt")
    assert export.main(["official", str(tmp_path / "DiT.pt"), str(tmp_path / "dit"), "--model", "DiT-T/4",
                        "--image-size", "64"]) == 0
    pipe = load_pipeline(tmp_path / "dit")
    assert pipe.config.vae_path == "stabilityai/sd-vae-ft-ema" and pipe.config.null_class_id == 1000
    assert same_weights(dit, pipe.transformer)

    # SiT's released weights keep DiT's learned-sigma head; training dicts wrap them in "ema".
    sit = perturbed(create_model("SiT-T/4", input_size=8, num_classes=1000, learn_sigma=True), 1)
    torch.save({"model": {}, "ema": sit.state_dict()}, tmp_path / "SiT.pt")
    assert export.main(["official", str(tmp_path / "SiT.pt"), str(tmp_path / "sit"), "--model", "SiT-T/4",
                        "--image-size", "64"]) == 0
    sit_pipe = load_pipeline(tmp_path / "sit")
    assert isinstance(sit_pipe, NaLaSiTPipeline) and same_weights(sit, sit_pipe.transformer)
    assert export.main(["official", str(tmp_path / "SiT.pt"), str(tmp_path / "sit-model"), "--model", "SiT-T/4",
                        "--image-size", "64", "--model-only"]) == 0
    loaded = DiT.from_pretrained(tmp_path / "sit-model")
    assert loaded.config.learn_sigma and same_weights(sit, loaded)


def test_official_mismatches_are_named(tmp_path, capsys):
    torch.save(create_model("DiT-T/4", input_size=8, num_classes=1000).state_dict(), tmp_path / "DiT.pt")
    pt, out = str(tmp_path / "DiT.pt"), str(tmp_path / "out")
    cases = [
        (["--model", "DiT-T/2", "--image-size", "64"], "patch size 4, DiT-T/2 uses 2"),
        (["--model", "DiT-T/4", "--image-size", "64", "--num-classes", "10"], "pass --num-classes 1000"),
        (["--model", "DiT-T/4", "--image-size", "128"], "fits --image-size 64"),
        (["--model", "NaLaDiT-T/4"], "official checkpoints are softmax"),
        (["--model", "DiT-T/4", "--copy-vae"], "--copy-vae needs --vae"),
    ]
    for flags, message in cases:
        assert export.main(["official", pt, out, *flags]) == 1, message
        assert message in capsys.readouterr().err
    assert export.main(["official", str(tmp_path / "nope.pt"), out, "--model", "DiT-T/4"]) == 1
    assert "official checkpoint not found" in capsys.readouterr().err
    assert export.main(["checkpoint", str(tmp_path / "no-run"), out]) == 1
    assert "no checkpoint found" in capsys.readouterr().err


# 2. export official
def test_export_official_refuses_non_finite_weights(tmp_path, capsys):
    state = create_model("DiT-T/4", input_size=8, num_classes=1000).state_dict()
    state["blocks.0.mlp.fc1.weight"][0, 0] = float("inf")
    torch.save(state, tmp_path / "DiT.pt")
    assert export.main(["official", str(tmp_path / "DiT.pt"), str(tmp_path / "out"), "--model", "DiT-T/4",
                        "--image-size", "64", "--model-only"]) == 1
    err = one_line_error(capsys)
    assert_names(err, "tensor blocks.0.mlp.fc1.weight", "1 non-finite value(s)", str(tmp_path / "DiT.pt"))
    assert not (tmp_path / "out").exists()


def test_export_into_an_existing_export_or_other_files_is_refused(run_dir, pipe_dir, tmp_path, capsys):
    before = {p: p.read_bytes() for p in pipe_dir.rglob("*") if p.is_file()}
    assert export.main(["checkpoint", str(run_dir), str(pipe_dir)]) == 1
    assert_names(one_line_error(capsys), f"{pipe_dir} already holds an export", "not overwriting",
                 "choose another output folder", f"move {pipe_dir} away")
    assert {p: p.read_bytes() for p in pipe_dir.rglob("*") if p.is_file()} == before
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "notes.txt").write_text("mine")
    assert export.main(["checkpoint", str(run_dir), str(mixed)]) == 1
    assert_names(one_line_error(capsys), f"{mixed} is not empty", "notes.txt", "new or empty output folder")
    assert sorted(p.name for p in mixed.iterdir()) == ["notes.txt"]
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    assert export.main(["checkpoint", str(run_dir), str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "model_index.json").is_file()
    assert not list(tmp_path.glob(".tmp-*"))


def test_disk_full_during_export_leaves_nothing(run_dir, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    from nala_dit.pipelines.pipeline import NaLaDiTPipeline

    def full(self, save_directory, **kwargs):
        Path(save_directory).mkdir(parents=True)
        (Path(save_directory) / "half").write_bytes(b"x")
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(NaLaDiTPipeline, "save_pretrained", full)
    assert export.main(["checkpoint", str(run_dir), str(tmp_path / "out")]) == 1
    err = one_line_error(capsys)
    assert f"cannot write {tmp_path / 'out'}: Error while serializing" in err and "nothing was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_export_official_pickle_is_named_without_unsafe_advice(tmp_path, capsys):
    import export

    torch.save({"model": Evil()}, tmp_path / "evil.pt")
    (tmp_path / "trunc.pt").write_bytes((tmp_path / "evil.pt").read_bytes()[:100])
    for name, cause in (("evil.pt", ("pickled Python objects", "tests.utils.Evil", "refused")),
                        ("trunc.pt", ("unreadable, truncated or corrupt",))):
        assert export.main(["official", str(tmp_path / name), str(tmp_path / "out"), "--model", "DiT-T/4"]) == 1
        err = capsys.readouterr().err
        assert_names(err, f"{tmp_path / name}: ", *cause)
        assert "weights_only=False" not in err, err
        assert len(err.strip().splitlines()) == 1


def test_export_folder_is_fsynced_before_its_rename(run_dir, tmp_path, fsynced):
    import export

    assert export.main(["checkpoint", str(run_dir), str(tmp_path / "pipe")]) == 0
    weights = [p for p in fsynced if p.name == "diffusion_pytorch_model.safetensors"]
    assert weights and tmp_path in fsynced
