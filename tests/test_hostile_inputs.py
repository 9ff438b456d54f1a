"""Bad and hostile inputs (issue 27): each is refused with one line naming the problem and
the way out, before anything is built, allocated or overwritten; nothing a user made is lost."""

import functools
import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import export
import sample
from nala_dit.training import checkpoint as ckpt_lib
from nala_dit.models.dit import create_model
from tests.test_sample_cli import FAST, write_checkpoint


def cli(*args) -> int:
    return sample.main([str(a) for a in args])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("runs") / "dit")


@pytest.fixture(scope="module")
def pipe_dir(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pipes") / "pipe"
    assert export.main(["checkpoint", str(run_dir), str(out)]) == 0
    return out


def copy_tree(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def poison(file: Path, key: str | None = None) -> str:
    """Put a NaN into one tensor of a safetensors file; returns the tensor's name."""
    tensors = load_file(str(file))
    key = key or next(k for k, v in tensors.items() if v.is_floating_point() and v.numel() > 1)
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, str(file))
    return key


# 1. non-finite weights, guidance scales and samples
def test_pipeline_folder_with_nan_weights_is_refused(pipe_dir, tmp_path, capsys):
    from nala_dit.pipelines.pipeline import NaLaDiTPipeline

    bad = copy_tree(pipe_dir, tmp_path / "bad")
    key = poison(bad / "transformer" / "diffusion_pytorch_model.safetensors")
    assert cli("--ckpt", bad, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
    err = one_line_error(capsys)
    assert f"tensor {key} holds 1 non-finite value(s)" in err and str(bad / "transformer") in err
    assert not (tmp_path / "g.png").exists()
    with pytest.raises(ValueError, match="non-finite"):
        NaLaDiTPipeline.from_pretrained(str(bad))


@pytest.mark.parametrize("scale", ["nan", "inf", "-inf", "1e30", "-1"])
def test_cfg_scale_must_be_finite_and_bounded(run_dir, tmp_path, capsys, scale):
    with pytest.raises(SystemExit) as exit_:
        cli("--ckpt", run_dir, "--labels", "1", f"--cfg-scale={scale}", "--grid", tmp_path / "g.png")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "guidance scale must be a number from 0 (unconditional) to 100" in err and f"got '{scale}'" in err


def test_pipeline_guidance_scale_is_checked(pipe_dir):
    from nala_dit.pipelines.pipeline import load_pipeline

    pipe = load_pipeline(pipe_dir)
    pipe.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError, match="guidance scale must be a number from 0"):
        pipe([1], guidance_scale=float("nan"), sampler="ddim", num_inference_steps=2)


def test_non_finite_samples_never_become_images():
    from nala_dit.data.datasets import to_uint8
    from nala_dit.guards import NonFiniteError

    x = torch.zeros(3, 1, 4, 4)
    assert to_uint8(x).shape == (3, 4, 4, 1)
    x[1, 0, 2, 2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"1 of 3 samples hold NaN or inf \(first: sample 1"):
        to_uint8(x)
    x[1, 0, 2, 2] = float("inf")  # clamp would make it 255: refused too
    with pytest.raises(ValueError, match="NaN or inf"):
        to_uint8(x)


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
    assert err[-1].startswith("error: 10 of 10 samples hold NaN or inf") and "FD" not in " ".join(err)
    assert not (tmp_path / "m.json").exists()


# 2. export official
def test_export_official_refuses_non_finite_weights(tmp_path, capsys):
    state = create_model("DiT-T/4", input_size=8, num_classes=1000).state_dict()
    state["blocks.0.mlp.fc1.weight"][0, 0] = float("inf")
    torch.save(state, tmp_path / "DiT.pt")
    assert export.main(["official", str(tmp_path / "DiT.pt"), str(tmp_path / "out"), "--model", "DiT-T/4",
                        "--image-size", "64", "--model-only"]) == 1
    err = one_line_error(capsys)
    assert "tensor blocks.0.mlp.fc1.weight holds 1 non-finite value(s)" in err and str(tmp_path / "DiT.pt") in err
    assert not (tmp_path / "out").exists()


# 3. nothing a user made is overwritten
def test_finished_npz_is_not_overwritten_by_other_settings(run_dir, tmp_path, capsys):
    out = tmp_path / "s.npz"
    common = ["--ckpt", run_dir, "--num-samples", 10, *FAST, "--out", out]
    assert cli(*common) == 0
    before = out.read_bytes(), Path(f"{out}.json").read_bytes()
    capsys.readouterr()
    assert cli(*common[:-2], "--seed", 1, "--out", out) == 1
    err = one_line_error(capsys)
    assert f"{out} holds a finished run made with other settings {{'seed': (0, 1)}}" in err
    assert "choose another --out, or move" in err
    assert (out.read_bytes(), Path(f"{out}.json").read_bytes()) == before
    assert cli(*common) == 0  # the same settings: complete, nothing to do
    assert "already complete" in capsys.readouterr().out


def test_a_file_at_out_that_is_not_ours_is_kept(run_dir, tmp_path, capsys):
    out = tmp_path / "mine.npz"
    out.write_bytes(b"a user's own file")
    assert cli("--ckpt", run_dir, "--num-samples", 10, *FAST, "--out", out) == 1
    assert f"{out} exists and is not the output of this run (no mine.npz.json or shards beside it); not " \
           f"overwriting it: choose another --out, or move {out} away" in one_line_error(capsys)
    assert out.read_bytes() == b"a user's own file"


def test_npz_written_but_sidecar_missing_resumes(run_dir, tmp_path, capsys):
    """Killed between the .npz and its sidecar: the run's shards are there, so it finishes."""
    out = tmp_path / "s.npz"
    common = ["--ckpt", run_dir, "--num-samples", 10, *FAST, "--out", out, "--keep-parts"]
    assert cli(*common) == 0
    Path(f"{out}.json").unlink()
    assert cli(*common) == 0 and Path(f"{out}.json").is_file()


def test_export_into_an_existing_export_or_other_files_is_refused(run_dir, pipe_dir, tmp_path, capsys):
    before = {p: p.read_bytes() for p in pipe_dir.rglob("*") if p.is_file()}
    assert export.main(["checkpoint", str(run_dir), str(pipe_dir)]) == 1
    assert f"{pipe_dir} already holds an export; not overwriting it" in one_line_error(capsys)
    assert {p: p.read_bytes() for p in pipe_dir.rglob("*") if p.is_file()} == before
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "notes.txt").write_text("mine")
    assert export.main(["checkpoint", str(run_dir), str(mixed)]) == 1
    assert f"{mixed} is not empty (notes.txt)" in one_line_error(capsys)
    assert sorted(p.name for p in mixed.iterdir()) == ["notes.txt"]
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    assert export.main(["checkpoint", str(run_dir), str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "model_index.json").is_file()
    assert not list(tmp_path.glob(".tmp-*"))


# 4. wrong types in stored model configs
def test_wrong_type_in_state_json_model_config(run_dir, tmp_path, capsys):
    run = copy_tree(run_dir, tmp_path / "run")
    state_file = ckpt_lib.find_checkpoint(run) / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state["model_config"]["hidden_size"] = "128"
    state_file.write_text(json.dumps(state))
    assert cli("--ckpt", run, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
    assert f"{state_file}: 'hidden_size' must be an integer, got '128' (str)" in one_line_error(capsys)


def test_wrong_type_in_pipeline_transformer_config(pipe_dir, tmp_path, capsys):
    from nala_dit.pipelines.pipeline import load_pipeline

    bad = copy_tree(pipe_dir, tmp_path / "bad")
    config_file = bad / "transformer" / "config.json"
    for key, value, expected in (("hidden_size", "128", "an integer"), ("lepe", "yes", "true or false"),
                                 ("mlp_ratio", None, "a number")):
        config = json.loads((pipe_dir / "transformer" / "config.json").read_text())
        config_file.write_text(json.dumps({**config, key: value}))
        assert cli("--ckpt", bad, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
        assert f"{config_file}: {key!r} must be {expected}, got {value!r}" in one_line_error(capsys)
        with pytest.raises(ValueError, match=f"'{key}' must be {expected}"):
            load_pipeline(bad)


@pytest.mark.parametrize("name", ["transformer/config.json", "model_index.json"])
def test_deeply_nested_pipeline_json_is_one_line(pipe_dir, tmp_path, capsys, name):
    bad = copy_tree(pipe_dir, tmp_path / "bad")
    (bad / name).write_text("[" * 100_000 + "]" * 100_000)  # past the parser's recursion limit
    assert cli("--ckpt", bad, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
    assert one_line_error(capsys) == (f"error: {bad / name}: nested too deeply to read (lists or objects inside each "
                                      f"other thousands of levels deep); export the pipeline again")


# 5. huge model configs: refused from the weights file's header, before building
@pytest.mark.parametrize("hidden", [8192, 65536, 10**9])
def test_huge_config_is_refused_before_building(run_dir, pipe_dir, tmp_path, capsys, monkeypatch, hidden):
    from nala_dit.models import dit as models

    built = []
    real_init = models.DiT.__init__

    @functools.wraps(real_init)
    def counting_init(self, *args, **kwargs):
        built.append(kwargs.get("hidden_size"))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(models.DiT, "__init__", counting_init)
    run = copy_tree(run_dir, tmp_path / "run")
    state_file = ckpt_lib.find_checkpoint(run) / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state["model_config"].update(hidden_size=hidden, num_heads=2)
    state_file.write_text(json.dumps(state))
    bad = copy_tree(pipe_dir, tmp_path / "bad")
    config_file = bad / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "hidden_size": hidden}))
    start = time.perf_counter()
    for where, weights in ((run, state_file.parent / "ema.safetensors"),
                           (bad, bad / "transformer" / "diffusion_pytorch_model.safetensors")):
        assert cli("--ckpt", where, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
        err = one_line_error(capsys)
        assert f"hidden_size implies {hidden:,} where the weights have 128" in err and str(weights) in err
        assert " parameters)" in err
    assert time.perf_counter() - start < 20 and hidden not in built  # nothing of that size was built


def test_config_that_fits_in_size_but_not_in_shape_names_both_counts(run_dir, tmp_path, capsys):
    run = copy_tree(run_dir, tmp_path / "run")
    state_file = ckpt_lib.find_checkpoint(run) / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state["model_config"]["gate"] = not state["model_config"]["gate"]  # an edited switch: other tensors
    state_file.write_text(json.dumps(state))
    assert cli("--ckpt", run, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
    err = one_line_error(capsys)
    assert "implies a model of" in err and "parameters," in err and "holds" in err


# 6. huge image sizes: an estimate against the memory there is, before allocating
@pytest.mark.parametrize("size", ["99998", "4000x99998"])
def test_huge_image_size_is_refused_with_a_memory_estimate(run_dir, tmp_path, capsys, size):
    start = time.perf_counter()
    assert cli("--ckpt", run_dir, "--labels", "1", *FAST, "--image-size", size, "--grid", tmp_path / "g.png") == 1
    err = one_line_error(capsys)
    assert f"--image-size {size}: sampling 1 image(s) of" in err and "needs at least" in err
    assert "this machine has" in err and "use a smaller --image-size or --batch-size" in err
    assert time.perf_counter() - start < 20


def test_memory_estimate_is_a_lower_bound_with_known_terms():
    from nala_dit.guards import sample_memory

    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10)
    c = model.config
    # 4 bytes × (runs × (noise + output per pixel + tokens × hidden × (2 + 2 · mlp ratio)) + batch × RGB pixels)
    per_run = 16 * 16 * (1 + 2) + 64 * c.hidden_size * (2 + 2 * c.mlp_ratio)
    assert sample_memory(model, (16, 16), 3) == 4 * (3 * per_run + 3 * 3 * 16 * 16)
    assert sample_memory(model, (16, 16), 3, guided=True) == 4 * (6 * per_run + 3 * 3 * 16 * 16)
    assert sample_memory(model, (16, 16), 3, vae_factor=8) == 4 * (3 * per_run + 3 * 3 * 128 * 128)


def test_pipeline_height_width_are_checked(pipe_dir):
    from nala_dit.pipelines.pipeline import load_pipeline

    pipe = load_pipeline(pipe_dir)
    for kwargs in (dict(height=0), dict(width=0), dict(height=-8), dict(height=8.0)):
        with pytest.raises(ValueError, match="must be a positive number of pixels"):
            pipe([1], sampler="ddim", num_inference_steps=2, **kwargs)
    with pytest.raises(MemoryError, match="height=99998, width=99998: sampling 1 image"):
        pipe([1], sampler="ddim", num_inference_steps=2, height=99998, width=99998)


# 8. disk full while writing safetensors
def test_disk_full_in_a_safetensors_write_is_one_line(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    model = create_model("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    kwargs = dict(model=model, ema=model, optimizer=torch.optim.AdamW(model.parameters()),
                  rng_states=[torch.get_rng_state()])
    ckpt_lib.save_checkpoint(tmp_path, state=dict(step=1), **kwargs)

    def full(tensors, path):
        Path(path).write_bytes(b"partial")
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(ckpt_lib, "save_file", full)
    with pytest.raises(OSError) as err:
        ckpt_lib.save_checkpoint(tmp_path, state=dict(step=2), **kwargs)
    message = str(err.value)
    assert "\n" not in message and f"cannot write checkpoint {tmp_path / '0000002'}" in message
    assert "No space left on device" in message and f"{tmp_path / '0000001'} is intact" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000001"]


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


# 9. latent folders' meta.json
def write_latent_folder(root: Path) -> dict:
    root.mkdir()
    save_file({"moments": torch.zeros(2, 2, 2, 4, 2, 2), "labels": torch.tensor([0, 1])},
              str(root / "latents-000000.safetensors"))
    meta = dict(scaling_factor=0.18215, image_size=16, latent_channels=4, classes=["a", "b"],
                shards=["latents-000000.safetensors"])
    (root / "meta.json").write_text(json.dumps(meta))
    return meta


def test_latent_meta_keys_and_types_are_checked(tmp_path):
    from nala_dit.data.datasets import LatentDataset

    meta = write_latent_folder(tmp_path / "lat")
    assert len(LatentDataset(tmp_path / "lat")) == 2
    meta_file = tmp_path / "lat" / "meta.json"
    cases = [({k: v for k, v in meta.items() if k != "shards"}, "'shards' must be a list of shard file names, missing"),
             ({k: v for k, v in meta.items() if k != "classes"}, "'classes' must be a list of class names, missing"),
             ({**meta, "classes": "ab"}, "'classes' must be a list of class names, got 'ab' (str)"),
             ({**meta, "shards": [3]}, "'shards' must be a list of shard file names (non-empty strings)"),
             ({**meta, "image_size": "16"}, "'image_size' must be an integer, got '16' (str)"),
             ({**meta, "scaling_factor": -1}, "'scaling_factor' must be a positive number"),
             ({**meta, "shards": ["../../etc/hostname"]}, "shard '../../etc/hostname' is outside"),
             ({**meta, "shards": ["/etc/hostname"]}, "shard '/etc/hostname' is outside"),
             ([1, 2], "must hold a JSON object, got list")]
    for bad, message in cases:
        meta_file.write_text(json.dumps(bad))
        with pytest.raises(ValueError) as err:
            LatentDataset(tmp_path / "lat")
        assert f"{meta_file}: {message}" in str(err.value) and "\n" not in str(err.value), err.value


# minors
class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_malicious_pickle_is_called_blocked_not_corrupt(tmp_path, capsys):
    torch.save({"model": Evil()}, tmp_path / "evil.pt")
    assert export.main(["official", str(tmp_path / "evil.pt"), str(tmp_path / "out"), "--model", "DiT-T/4"]) == 1
    err = one_line_error(capsys)
    assert f"{tmp_path / 'evil.pt'}: blocked: not a plain tensor file (possibly malicious)" in err
    assert f"{os.system.__module__}.system" in err or "posix.system" in err
    assert "corrupt" not in err and "download it again" not in err and "weights_only=False" not in err
    with open(tmp_path / "plain.pkl", "wb") as f:  # the same, pickled without torch.save
        pickle.dump({"model": Evil()}, f, protocol=2)
    assert export.main(["official", str(tmp_path / "plain.pkl"), str(tmp_path / "out"), "--model", "DiT-T/4"]) == 1
    assert "blocked: not a plain tensor file (possibly malicious)" in one_line_error(capsys)


def test_non_finite_optimizer_state_is_refused_on_resume(tmp_path):
    model = create_model("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 1, 8, 8), torch.zeros(1), torch.zeros(1, dtype=torch.long)).sum().backward()
    optimizer.step()
    state = dict(step=1, epoch=0, position=1, world_size=1, config={}, model_config=dict(model.config))
    path = ckpt_lib.save_checkpoint(tmp_path, model=model, ema=model, optimizer=optimizer, state=state,
                                    rng_states=[torch.get_rng_state()])
    saved = torch.load(path / "optimizer.pt", weights_only=True)
    saved["state"][3]["exp_avg_sq"].view(-1)[0] = float("nan")
    torch.save(saved, path / "optimizer.pt")
    with pytest.raises(ckpt_lib.CheckpointError) as err:
        ckpt_lib.open_checkpoint(path).load_optimizer(torch.optim.AdamW(model.parameters()))
    message = str(err.value)
    assert f"{path / 'optimizer.pt'}: its tensor exp_avg_sq of parameter 3 holds 1 non-finite value(s)" in message
    assert "--lr" not in message and "last good" not in message


def test_non_finite_init_from_source_is_refused(pipe_dir, tmp_path):
    from nala_dit.training.convert import init_from

    bad = copy_tree(pipe_dir, tmp_path / "bad")
    poison(bad / "transformer" / "diffusion_pytorch_model.safetensors")
    student = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10)
    with pytest.raises(ValueError) as err:
        init_from(bad, student, "NaLaDiT-T/2", "all-but-attention", {})
    assert "non-finite" in str(err.value) and "--lr" not in str(err.value)


@pytest.mark.parametrize("flag,path,message", [
    ("--grid", "file.txt/grid.png", "is a file, not a folder"),
    ("--grid", "grid.xyz", ".xyz is not an image format PIL can write"),
    ("--grid", "a_folder", "a folder is in the way"),
    ("--out-dir", "file.txt", "a file is in the way"),
])
def test_output_paths_are_checked_before_sampling(run_dir, tmp_path, capsys, monkeypatch, flag, path, message):
    from nala_dit.pipelines import sample_files as sampling

    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "a_folder").mkdir()
    monkeypatch.setattr(sampling, "sample_images", lambda *a, **k: pytest.fail("sampled before checking"))
    assert cli("--ckpt", run_dir, "--labels", "1", *FAST, flag, tmp_path / path) == 1
    assert message in one_line_error(capsys)


def test_out_that_is_a_folder_is_refused_before_sampling(run_dir, tmp_path, capsys):
    (tmp_path / "s.npz").mkdir()
    assert cli("--ckpt", run_dir, "--num-samples", 10, *FAST, "--out", tmp_path / "s.npz") == 1
    assert "a folder is in the way" in one_line_error(capsys)
    assert not Path(f"{tmp_path / 's.npz'}.parts").exists()


@pytest.mark.parametrize("shift", ["1e300", "101", "0.001"])
def test_time_shift_is_bounded(run_dir, tmp_path, capsys, shift):
    assert cli("--ckpt", run_dir, "--labels", "1", *FAST, "--time-shift", shift, "--grid", tmp_path / "g.png") == 1
    assert "time shift must be a number from 0.01 to 100 (1 = no shift" in one_line_error(capsys)


def test_vae_tiling_on_a_pixel_model_is_refused(run_dir, pipe_dir, tmp_path, capsys):
    from nala_dit.pipelines.pipeline import load_pipeline

    assert cli("--ckpt", run_dir, "--labels", "1", *FAST, "--vae-tiling", "on", "--grid", tmp_path / "g.png") == 1
    assert "--vae-tiling on: this model samples pixels directly (no VAE)" in one_line_error(capsys)
    with pytest.raises(ValueError, match="vae_tiling on: this model samples pixels directly"):
        load_pipeline(pipe_dir)([1], sampler="ddim", num_inference_steps=2, vae_tiling="on")


def test_resume_with_another_init_from_says_it_ignores_it(tmp_path, capsys):
    import train as train_cli

    tiny = ["--model", "NaLaDiT-T/2", "--data", "digits", "--global-batch-size", "8", "--num-workers", "0",
            "--sample-every", "0", "--log-every", "1", "--flip", "false", "--results-dir", str(tmp_path),
            "--exp-name", "run"]
    assert train_cli.main(tiny + ["--max-steps", "1", "--ckpt-every", "1"]) == 0
    capsys.readouterr()
    assert train_cli.main(tiny + ["--max-steps", "2", "--ckpt-every", "2", "--resume", "auto",
                                  "--init-from", "somewhere/else"]) == 0
    out = capsys.readouterr().out
    assert "resume: --init-from somewhere/else is ignored: the run continues from" in out
    assert "(it started from random weights)" in out
    assert ckpt_lib.open_checkpoint(tmp_path / "run").config["init-from"] is None


def test_non_finite_start_is_not_blamed_on_the_learning_rate(tmp_path, capsys, monkeypatch):
    import train as train_cli
    from nala_dit.training import loop as training

    real_build = training.build_model

    def poisoned_build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        with torch.no_grad():
            model.final_layer.linear.bias.fill_(float("nan"))
        return model

    monkeypatch.setattr(training, "build_model", poisoned_build)
    argv = ["--model", "NaLaDiT-T/2", "--data", "digits", "--global-batch-size", "8", "--num-workers", "0",
            "--sample-every", "0", "--log-every", "1", "--flip", "false", "--results-dir", str(tmp_path),
            "--exp-name", "run", "--max-steps", "2", "--ckpt-every", "2"]
    assert train_cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "non-finite loss at step 1, the first of this run, before any update" in err
    assert "not the learning rate" in err and "Last good" not in err and "lower --lr" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()
