"""sample.py: grids and PNGs, identity with the pipeline, mass sampling (2 processes,
exact balance, resume), and clear errors."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import sample
from nala_dit.cli.config import to_dict
from nala_dit.cli.options import TrainConfig
from nala_dit.models.dit import create_model
from nala_dit.training.checkpoint import save_checkpoint
from tests.ranks import run_ranks
from tests.utils import assert_names, cli, one_line_error

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--sampler", "ddim", "--steps", "2"]


def write_checkpoint(run_dir: Path, model_name="NaLaDiT-T/2", vae=None, **overrides) -> Path:
    """A checkpoint as train.py writes it, for a digits model with random weights
    (pixel space, or 4-channel latents of ``vae``)."""
    model = create_model(model_name, input_size=8, in_channels=4 if vae else 1, num_classes=10, **overrides)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    cfg = TrainConfig(model=model_name, data="digits", vae=vae, exp_name=run_dir.name, results_dir=str(run_dir.parent),
                      class_dropout_prob=model.config.class_dropout_prob)
    state = dict(step=5, epoch=0, position=5, world_size=1, config=to_dict(cfg), model_config=dict(model.config))
    save_checkpoint(run_dir / "checkpoints", model=model, ema=model, state=state,
                    optimizer=torch.optim.AdamW(model.parameters()), rng_states=[torch.get_rng_state()])
    return run_dir


def test_grid_and_pngs_match_the_pipeline(run_dir, tmp_path):
    from nala_dit.pipelines.pipeline import pipeline_from_checkpoint

    assert cli("--ckpt", run_dir, "--labels", "1,7", "--per-label", 3, "--seed", 5, *FAST,
               "--grid", tmp_path / "grid.png", "--out-dir", tmp_path / "pngs") == 0
    grid = np.asarray(Image.open(tmp_path / "grid.png"))
    assert grid.shape == (2 * 10 + 2, 3 * 10 + 2)  # one row per label, 8 px + 2 px padding
    pngs = sorted((tmp_path / "pngs").glob("*.png"))
    assert [p.name for p in pngs][-1] == "000005_class7.png"
    pipe = pipeline_from_checkpoint(run_dir)
    pipe.set_progress_bar_config(disable=True)
    images = pipe([1, 1, 1, 7, 7, 7], sampler="ddim", num_inference_steps=2, generator=5).images
    for png, img in zip(pngs, images):
        np.testing.assert_array_equal(np.asarray(Image.open(png)), np.asarray(img))


def test_balanced_labels_and_class_names(run_dir, tmp_path):
    assert cli("--ckpt", run_dir, "--num-samples", 20, *FAST, "--batch-size", 8, "--out-dir", tmp_path) == 0
    labels = [int(p.stem.split("class")[1]) for p in sorted(tmp_path.glob("*.png"))]
    assert np.bincount(labels).tolist() == [2] * 10


def test_images_do_not_depend_on_batch_size(run_dir, tmp_path):
    """Per-index noise: a deterministic sampler gives the same images for any batch layout
    (up to float summation order, hence one uint8 level of slack)."""
    for bs in (6, 4):
        assert cli("--ckpt", run_dir, "--num-samples", 6, *FAST, "--batch-size", bs,
                   "--out-dir", tmp_path / str(bs)) == 0
    for a, b in zip(sorted((tmp_path / "6").glob("*.png")), sorted((tmp_path / "4").glob("*.png"))):
        assert a.name == b.name
        diff = np.abs(np.asarray(Image.open(a)).astype(int) - np.asarray(Image.open(b)))
        assert diff.max() <= 1


def test_errors_name_the_problem(run_dir, tmp_path, capsys):
    grid = ["--grid", tmp_path / "g.png"]
    cases = [
        (["--ckpt", tmp_path / "missing", "--labels", "1", *grid], "no checkpoint or pipeline folder"),
        (["--ckpt", run_dir, "--labels", "1,seven", *grid], "unknown class name(s): 'seven'"),
        (["--ckpt", run_dir, "--labels", "12", *grid], "class id 12 is out of range"),
        (["--ckpt", run_dir, "--labels", "1", "--sampler", "sde-heun", *grid], "sampler 'sde-heun' is for transport"),
        (["--ckpt", run_dir, "--labels", "1"], "nothing to write"),
        (["--ckpt", run_dir, "--labels", "1", "--out", tmp_path / "x.npz"], "takes --num-samples"),
    ]
    for args, message in cases:
        assert cli(*args) == 1, message
        assert message in capsys.readouterr().err
    uncond = write_checkpoint(tmp_path / "uncond", class_dropout_prob=0.0)
    assert cli("--ckpt", uncond, "--labels", "1", "--cfg-scale", 1.5, *FAST, *grid) == 1
    assert "null class" in capsys.readouterr().err


def test_latent_checkpoint_with_vae_matches_exported_pipeline(tmp_path):
    from diffusers import AutoencoderKL

    import export
    from nala_dit.pipelines.pipeline import load_pipeline

    torch.manual_seed(0)
    vae_dir = tmp_path / "tiny-vae"
    AutoencoderKL(block_out_channels=(8, 8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=8,
                  latent_channels=4, sample_size=64).save_pretrained(vae_dir)
    run = write_checkpoint(tmp_path / "latent", "NaLaSiT-T/2", vae=str(vae_dir))
    flags = ["--ckpt", run, "--labels", "2,5", "--sampler", "ode-euler", "--steps", 2, "--cfg-scale", 1.5]
    assert cli(*flags, "--out-dir", tmp_path / "fp32") == 0
    assert cli(*flags, "--out-dir", tmp_path / "bf16", "--precision", "bf16", "--vae", vae_dir) == 0
    fp32 = [np.asarray(Image.open(p)) for p in sorted((tmp_path / "fp32").glob("*.png"))]
    bf16 = [np.asarray(Image.open(p)) for p in sorted((tmp_path / "bf16").glob("*.png"))]
    assert fp32[0].shape == (64, 64, 3)
    assert np.abs(np.stack(fp32).astype(int) - np.stack(bf16)).mean() < 8  # same images, bf16 rounding

    assert export.main(["checkpoint", str(run), str(tmp_path / "pipe"), "--copy-vae"]) == 0
    pipe = load_pipeline(tmp_path / "pipe")
    pipe.set_progress_bar_config(disable=True)
    images = pipe([2, 5], sampler="ode-euler", num_inference_steps=2, guidance_scale=1.5, generator=0).images
    for ref, img in zip(fp32, images):
        np.testing.assert_array_equal(ref, np.asarray(img))


@pytest.mark.slow
def test_mass_sampling_two_processes_balanced_and_resumable(run_dir, tmp_path):
    common = ["--ckpt", run_dir, "--num-samples", 30, "--seed", 3, *FAST, "--batch-size", 2, "--shard-size", 4]
    # Reference: one process, in this interpreter.
    assert cli(*common, "--out", tmp_path / "one.npz") == 0
    with np.load(tmp_path / "one.npz") as ref:
        ref_images, ref_labels = ref["arr_0"], ref["arr_1"]
    assert ref_images.shape == (30, 8, 8, 1) and ref_images.dtype == np.uint8
    assert np.bincount(ref_labels).tolist() == [3] * 10
    assert not (tmp_path / "one.npz.parts").exists()  # shards are removed once assembled

    # An interrupted run: two shards, then "killed".
    out = tmp_path / "two.npz"
    assert cli(*common, "--out", out, "--stop-after", 2, "--keep-parts") == 0
    parts = Path(f"{out}.parts")
    done = {p: p.stat().st_mtime_ns for p in parts.glob("shard-*.npz")}
    assert len(done) == 2 and not out.exists()

    # Resume with two processes: the finished shards are kept, the rest is split.
    result = run_ranks(tmp_path, "sample.py", *common, "--out", out, "--keep-parts", cwd=tmp_path, HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in done} == done
    assert len(list(parts.glob("shard-*.npz"))) == 8
    with np.load(out) as got:
        np.testing.assert_array_equal(got["arr_0"], ref_images)
        np.testing.assert_array_equal(got["arr_1"], ref_labels)
    meta = json.loads(Path(f"{out}.json").read_text())
    assert meta["num_samples"] == 30 and meta["world_size"] == 2 and meta["step"] == 5
    assert meta["sampler"] == "ddim" and meta["steps"] == 2 and meta["nfe"] == 2 and meta["seed"] == 3
    assert meta["per_class_min"] == meta["per_class_max"] == 3 and meta["precision"] == "fp32"


def test_mass_sampling_refuses_mixed_settings(run_dir, tmp_path, capsys):
    common = ["--ckpt", run_dir, "--num-samples", 4, *FAST, "--batch-size", 2, "--shard-size", 2,
              "--out", tmp_path / "s.npz"]
    assert cli(*common, "--stop-after", 1) == 0
    assert cli(*common, "--seed", 9) == 1
    assert "other settings" in capsys.readouterr().err


def test_ctrl_c_keeps_finished_shards_and_the_same_command_resumes(run_dir, tmp_path, monkeypatch, capsys):
    """A real KeyboardInterrupt mid-job: one line says what was kept; the same command
    finishes only the rest, and the result equals an uninterrupted run."""
    import nala_dit.pipelines.sample_files as sampling

    common = ["--ckpt", run_dir, "--num-samples", 40, "--seed", 1, *FAST, "--batch-size", 2]
    assert cli(*common, "--out", tmp_path / "whole.npz") == 0
    real, calls, interrupt_at = sampling.sample_batch, [], [8]

    def interrupt_at_eighth(*args, **kwargs):
        calls.append(1)
        if len(calls) == interrupt_at[0]:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "sample_batch", interrupt_at_eighth)
    out = tmp_path / "cut.npz"
    with pytest.raises(KeyboardInterrupt) as info:  # main() lets in-process callers see the interrupt
        cli(*common, "--out", out)
    # 40 samples → automatic shards of 2 (1/20 of the job): 7 finished before the 8th batch.
    kept = f"14 of 40 samples kept (7 finished shards in {out}.parts/); run the same command to resume"
    assert str(info.value) == kept
    # ... and the script entry point turns it into one line and exit status 130.
    from nala_dit.cli.parse import run_main

    capsys.readouterr()

    def main():
        raise info.value

    assert run_main(main) == 130
    assert capsys.readouterr().err.strip().splitlines() == [f"interrupted: {kept}"]
    calls.clear()
    interrupt_at[0] = None
    assert cli(*common, "--out", out) == 0
    assert len(calls) == 13  # only the 26 samples that were missing
    with np.load(out) as cut, np.load(tmp_path / "whole.npz") as whole:
        np.testing.assert_array_equal(cut["arr_0"], whole["arr_0"])
        np.testing.assert_array_equal(cut["arr_1"], whole["arr_1"])


def test_silent_cases_are_notices_or_errors(run_dir, tmp_path, capsys):
    assert cli("--ckpt", run_dir, "--num-samples", 0, "--grid", tmp_path / "g.png") == 1
    assert "--num-samples must be >= 1, got 0" in capsys.readouterr().err
    assert cli("--ckpt", run_dir, "--num-samples", 25, *FAST, "--grid", tmp_path / "g.png") == 0
    assert_names(capsys.readouterr().err, "note: ", "25 samples over 10 classes", "not balanced", "5 classes get 3",
                 "other 5 get 2")
    import export

    assert export.main(["checkpoint", str(run_dir), str(tmp_path / "exp"), "--copy-vae"]) == 1
    assert "--copy-vae" in capsys.readouterr().err and not (tmp_path / "exp").exists()


def test_dopri5_tolerances_and_nfe_bound_from_the_cli(tmp_path, capsys):
    """--max-nfe bounds the adaptive solver (a clear one-line error when exceeded) and
    changes nothing below the bound; --atol/--rtol reach the solver; the three flags
    are refused for fixed-step samplers."""
    sit = write_checkpoint(tmp_path / "sit", model_name="NaLaSiT-T/2")
    base = ["--ckpt", sit, "--labels", "2,5", "--seed", 3, "--sampler", "dopri5"]
    assert cli(*base, "--out-dir", tmp_path / "free") == 0
    assert cli(*base, "--max-nfe", 1000, "--out-dir", tmp_path / "bounded") == 0
    for free, bounded in zip(sorted((tmp_path / "free").glob("*.png")), sorted((tmp_path / "bounded").glob("*.png"))):
        assert np.array_equal(np.asarray(Image.open(free)), np.asarray(Image.open(bounded)))
    capsys.readouterr()
    assert cli(*base, "--max-nfe", 2, "--out-dir", tmp_path / "tight") == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "max_nfe=2" in errors[0] and "--max-nfe" in errors[0]
    assert "Traceback" not in err
    # the tolerances reach the solver: this model needs 14-20 evaluations at the default
    # tolerances and 50 at atol 1e-9 / rtol 1e-8 (measured), so a bound of 32 splits them
    assert cli(*base, "--max-nfe", 32, "--out-dir", tmp_path / "default-tol") == 0
    assert cli(*base, "--atol", 1e-9, "--rtol", 1e-8, "--max-nfe", 32, "--out-dir", tmp_path / "tight-tol") == 1
    assert cli("--ckpt", sit, "--labels", "2", "--sampler", "ode-heun", "--max-nfe", 10,
               "--out-dir", tmp_path / "heun") == 1
    assert "dopri5 sampler only" in capsys.readouterr().err


def test_a_finished_npz_made_with_other_size_settings_is_never_complete(run_dir, tmp_path, capsys):
    """The size settings (image size, time shift, upscaling) are compared
    resolved, defaults included, both ways; "wrote" only when something was written."""
    base = ["--ckpt", run_dir, "--num-samples", 2, *FAST, "--batch-size", 2]
    cases = [(["--image-size", 16], {"latent_size": ([16, 16], [8, 8])}),
             (["--time-shift", 2], {"time_shift": (2.0, 1.0)}),
             (["--image-size", 16, "--upscale-from", 8],
              {"latent_size": ([16, 16], [8, 8]), "upscale_from": ([8, 8], None), "strength": (0.6, None)})]
    for i, (extra, diff) in enumerate(cases):
        out = tmp_path / f"s{i}.npz"
        assert cli(*base, *extra, "--out", out) == 0
        before = out.read_bytes()
        capsys.readouterr()
        assert cli(*base, "--out", out) == 1  # without the options: other settings, refused
        err = capsys.readouterr().err
        assert_names(err, str(out), "finished run", f"other settings {diff}", f"its s{i}.npz.json")
        flipped = {k: (b, a) for k, (a, b) in diff.items()}
        other = tmp_path / f"n{i}.npz"   # ... and the other way round
        assert cli(*base, "--out", other) == 0
        capsys.readouterr()
        assert cli(*base, *extra, "--out", other) == 1
        assert_names(capsys.readouterr().err, str(other), f"other settings {flipped}", f"its n{i}.npz.json")
        assert cli(*base, *extra, "--out", out) == 0  # the same command: complete, nothing written
        got = capsys.readouterr().out
        assert_names(got, str(out), "already complete", "nothing to do")
        assert "wrote" not in got
        assert out.read_bytes() == before
    # a sidecar written before the size settings were recorded still matches the native command
    sidecar = Path(f"{tmp_path / 'n0.npz'}.json")
    old = {k: v for k, v in json.loads(sidecar.read_text()).items()
           if k not in ("latent_size", "time_shift", "upscale_from", "strength")}
    sidecar.write_text(json.dumps(old))
    assert cli(*base, "--out", tmp_path / "n0.npz") == 0
    assert "already complete" in capsys.readouterr().out


def test_a_run_refused_after_recording_its_settings_does_not_block_the_corrected_one(run_dir, tmp_path, capsys):
    """--time-shift with dpm-solver is refused by the sampler; the corrected
    command starts (no shard was written), and a parts folder with shards still refuses with
    the difference named."""
    out = tmp_path / "t.npz"
    base = ["--ckpt", run_dir, "--num-samples", 2, "--sampler", "dpm-solver", "--steps", 2, "--out", out]
    assert cli(*base, "--time-shift", 2) == 1
    assert "not to a diffusers scheduler (dpm-solver)" in capsys.readouterr().err
    assert cli(*base) == 0
    assert Path(f"{out}.json").is_file() and not Path(f"{out}.parts").exists()
    cut = tmp_path / "cut.npz"
    common = ["--ckpt", run_dir, "--num-samples", 4, *FAST, "--batch-size", 2, "--shard-size", 2, "--out", cut]
    assert cli(*common, "--stop-after", 1) == 0
    capsys.readouterr()
    assert cli(*common, "--image-size", 16) == 1
    assert_names(capsys.readouterr().err, f"{cut}.parts", "shards",
                 "other settings {'latent_size': ([8, 8], [16, 16])}")


def test_disk_full_while_writing_shards_or_the_npz_is_one_line(run_dir, tmp_path, capsys, monkeypatch):
    """The file, what was kept and the rerun; the rerun finishes the job."""
    out = tmp_path / "s.npz"
    common = ["--ckpt", run_dir, "--num-samples", 4, *FAST, "--batch-size", 2, "--shard-size", 2, "--out", out]
    real_savez = np.savez
    calls = []

    def full_after_one(f, **arrays):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"partial")
            raise OSError(28, "No space left on device")
        return real_savez(f, **arrays)

    monkeypatch.setattr(np, "savez", full_after_one)
    assert cli(*common) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: "), err
    assert_names(err, f"cannot write {out}.parts/shard-000001.npz", "No space left on device",
                 f"kept 1 finished shard (2 samples) in {out}.parts", "free space", "rerun the same command")
    assert sorted(p.name for p in Path(f"{out}.parts").iterdir()) == ["settings.json", "shard-000000.npz"]
    monkeypatch.setattr(np, "savez", real_savez)
    import nala_dit.pipelines.sample_files as sampling

    real_zip = sampling.zipfile.ZipFile

    def full_zip(f, mode="r", *args, **kwargs):
        if mode == "w" and str(getattr(f, "name", "")).endswith("-s.npz"):  # the .npz, not a shard
            f.write(b"partial")
            raise OSError(28, "No space left on device")
        return real_zip(f, mode, *args, **kwargs)

    monkeypatch.setattr(sampling.zipfile, "ZipFile", full_zip)
    assert cli(*common) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: "), err
    assert_names(err, f"cannot write {out}: ", "No space left on device",
                 f"kept 2 finished shards (4 samples) in {out}.parts", "free space", "rerun the same command")
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))
    monkeypatch.undo()
    assert cli(*common) == 0
    with np.load(out) as done:
        assert done["arr_0"].shape == (4, 8, 8, 1)


# ------------------------------------------------------------ smaller checks
def test_strength_without_upscale_from_is_an_error(capsys, tmp_path):
    import sample

    assert sample.main(["--ckpt", str(tmp_path / "none"), "--labels", "1", "--strength", "0.5",
                        "--grid", str(tmp_path / "g.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), err   # one line
    assert_names(err, "--strength", "progressive upscaling", "--upscale-from SIZE", "drop --strength")


@pytest.mark.parametrize("script", ["sample", "evaluate_fid"])
def test_strength_default_is_in_help(script):
    import importlib

    parser = importlib.import_module(script).build_parser()
    if script == "evaluate_fid":
        parser = next(a for a in parser._actions if a.dest == "command").choices["gen"]
    (strength,) = [a for a in parser._actions if a.dest == "strength"]
    assert strength.help.endswith("(default: 0.6)") and strength.default is None  # None: "not given"


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


def test_grid_scale_enlarges_the_saved_grid_by_nearest_neighbour(run_dir, tmp_path, capsys):
    args = ["--ckpt", str(run_dir), "--labels", "1,7", "--per-label", "3", *FAST]
    assert sample.main(args + ["--grid", str(tmp_path / "1.png")]) == 0
    hint = capsys.readouterr().out
    assert sample.main(args + ["--grid", str(tmp_path / "4.png"), "--grid-scale", "4"]) == 0
    small, big = np.asarray(Image.open(tmp_path / "1.png")), np.asarray(Image.open(tmp_path / "4.png"))
    assert big.shape == (small.shape[0] * 4, small.shape[1] * 4)
    np.testing.assert_array_equal(big, small.repeat(4, 0).repeat(4, 1))
    # the 8-px grid written without --grid-scale says its size (the file's) and the flag to enlarge it
    assert f"; {small.shape[1]} x {small.shape[0]} px: pass --grid-scale 4 to enlarge)" in hint, hint
    assert "--grid-scale" not in capsys.readouterr().out


@pytest.mark.parametrize("scale", ["0", "-2", "1.5", "65"])
def test_grid_scale_is_checked_in_one_line(run_dir, tmp_path, capsys, scale):
    with pytest.raises(SystemExit) as exit_code:
        sample.main(["--ckpt", str(run_dir), "--labels", "1", *FAST, "--grid", str(tmp_path / "g.png"),
                     "--grid-scale", scale])
    assert exit_code.value.code == 2
    err = next(line for line in capsys.readouterr().err.splitlines() if "error:" in line)
    assert "--grid-scale" in err and "1 to 64" in err
    assert not (tmp_path / "g.png").exists()


def test_an_enlarged_grid_too_large_is_refused_before_sampling(run_dir, tmp_path, capsys):
    assert sample.main(["--ckpt", str(run_dir), "--num-samples", "1000", *FAST, "--grid", str(tmp_path / "g.png"),
                        "--grid-scale", "64"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--grid-scale 64" in err and "megapixels" in err


# ------------------------------------------------------------ a user's files are never replaced
def test_an_existing_grid_or_sample_pngs_are_refused_before_sampling(run_dir, tmp_path, capsys, monkeypatch):
    """--grid over an existing file, --out-dir over sample PNGs: one line naming the file and the
    fix, the files untouched, nothing sampled."""
    import nala_dit.pipelines.sample_files as sampling

    monkeypatch.setattr(sampling, "sample_images", lambda *a, **k: pytest.fail("sampled before refusing"))
    grid = tmp_path / "grid.png"
    grid.write_bytes(b"the user's own grid")
    assert cli("--ckpt", run_dir, "--labels", "1", *FAST, "--grid", grid) == 1
    assert_names(one_line_error(capsys), f"--grid {grid} exists", "not overwriting", "choose another --grid")
    assert grid.read_bytes() == b"the user's own grid"
    pngs = tmp_path / "pngs"
    pngs.mkdir()
    (pngs / "000000_class1.png").write_bytes(b"the user's own sample")
    assert cli("--ckpt", run_dir, "--labels", "1", *FAST, "--out-dir", pngs) == 1
    assert_names(one_line_error(capsys), f"--out-dir {pngs} already holds 1 sample PNG", "000000_class1.png",
                 "choose another --out-dir")
    assert (pngs / "000000_class1.png").read_bytes() == b"the user's own sample"


def test_a_full_disk_leaves_no_empty_png_and_names_the_path(run_dir, tmp_path, capsys, monkeypatch):
    """A write failing with ENOSPC: one line with the path and the fix, no zero-byte or partial
    file at the path nor a temporary beside it."""
    from PIL import Image as PILImage

    def full(self, fp, *args, **kwargs):
        Path(fp).write_bytes(b"")   # what a full disk leaves: an empty file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PILImage.Image, "save", full)
    grid = tmp_path / "out" / "grid.png"
    assert cli("--ckpt", run_dir, "--labels", "1", *FAST, "--grid", grid) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("error: "), err   # after the progress line
    assert_names(err.splitlines()[-1], f"cannot write {grid}", "No space left on device", "free space")
    assert not grid.exists() and list(grid.parent.iterdir()) == []
