"""Per-channel latent statistics (nala_dit/data/latent_stats.py): computed by extract_latents over
the whole cache, carried by checkpoints and pipelines, undone exactly when decoding, and
refused when a run's latents disagree with what its model was trained on."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from safetensors.torch import load_file, save_file

import train as train_cli
from nala_dit.data.latent_stats import (
    SUMS_KEY,
    LatentNorm,
    cache_statistics,
    moment_sums,
)
from tests.training.test_loop import make_image_folder
from tests.utils import TINY_RUN, assert_names, one_line


def write_vae(path, seed):
    """The tests' ≈67k-parameter AutoencoderKL (tests/training/test_loop.py), seeded."""
    torch.manual_seed(seed)
    AutoencoderKL(block_out_channels=(8, 8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=8,
                  latent_channels=4, sample_size=64).save_pretrained(path)
    return path


def extract(images, out, vae, *extra):
    from extract_latents import main as extract_main

    argv = ["--data", str(images), "--out", str(out), "--vae", str(vae), "--image-size", "64", "--shard-size", "4",
            "--num-workers", "0", *extra]
    assert extract_main(argv) == 0
    return json.loads((out / "meta.json").read_text())


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Two caches of the same tiny VAE over different images (A resumed after a lost shard),
    and a second VAE with other weights."""
    root = tmp_path_factory.mktemp("latent-stats")
    vae, other_vae = write_vae(root / "vae", 0), write_vae(root / "vae2", 1)
    images_a = make_image_folder(root / "images-a", seed=0)
    images_b = make_image_folder(root / "images-b", seed=1)
    meta = extract(images_a, root / "a", vae, "--dtype", "float32")
    # An interrupted extraction: shard 1 never written, meta.json without statistics; resumed.
    (root / "a" / "latents-00001.safetensors").unlink()
    (root / "a" / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "latent_stats"}))
    resumed = extract(images_a, root / "a", vae, "--dtype", "float32")
    extract(images_b, root / "b", vae, "--dtype", "float32")
    return dict(root=root, vae=vae, other_vae=other_vae, a=root / "a", b=root / "b", meta=meta, resumed=resumed)


def test_statistics_closed_form_over_shards_with_and_without_stored_sums(tmp_path):
    # Two images, two channels, one latent pixel, moments [flip][mean, logvar]:
    # channel 0: μ = 0, 2 (image 0 and its mirror), 4, 6 (image 1), σ² = 1:
    #   mean = 3, E[μ² + σ²] = (0 + 4 + 16 + 36) / 4 + 1 = 15, std = √(15 − 9) = √6;
    # channel 1: μ = 1 everywhere, σ² = 1/4: mean 1, std = √(1 + 1/4 − 1) = 1/2.
    def moments(mu0):
        m = torch.zeros(1, 2, 2, 2, 1, 1)
        m[0, :, 0, 0, 0, 0] = torch.tensor(mu0)
        m[0, :, 0, 1] = 1.0
        m[0, :, 1, 1] = math.log(0.25)
        return m

    first, second = moments([0.0, 2.0]), moments([4.0, 6.0])
    # shard 0 as extract_latents writes it now (float64 sums kept), shard 1 as an older cache (summed on reading)
    save_file({"moments": first, "labels": torch.zeros(1, dtype=torch.long), SUMS_KEY: moment_sums(first)},
              str(tmp_path / "s0.safetensors"))
    save_file({"moments": second, "labels": torch.ones(1, dtype=torch.long)}, str(tmp_path / "s1.safetensors"))
    stats = cache_statistics(tmp_path, ["s0.safetensors", "s1.safetensors"])
    assert (stats["images"], stats["latents"], stats["values_per_channel"]) == (2, 4, 4)
    np.testing.assert_allclose(stats["mean"], [3.0, 1.0], rtol=1e-7)
    np.testing.assert_allclose(stats["std"], [math.sqrt(6.0), 0.5], rtol=1e-6)


def test_extraction_statistics_are_exact_over_the_cache_and_a_resume(caches):
    meta, resumed = caches["meta"], caches["resumed"]
    # 6 images in shards of 4; each image and its mirror; 64 px → 8×8 latent px
    stats = resumed["latent_stats"]
    assert (stats["images"], stats["latents"], stats["values_per_channel"]) == (6, 12, 12 * 64)
    assert stats == meta["latent_stats"]  # the resumed extraction: the same numbers, bit for bit
    # independent reference: float64 over every stored moment of the cache
    m = np.concatenate([load_file(str(caches["a"] / name))["moments"].double().numpy() for name in resumed["shards"]])
    mu, var = m[:, :, 0], np.exp(np.clip(m[:, :, 1], -30, 20))
    mean = mu.mean(axis=(0, 1, 3, 4))
    std = np.sqrt((mu * mu + var).mean(axis=(0, 1, 3, 4)) - mean ** 2)
    np.testing.assert_allclose(stats["mean"], mean, rtol=1e-12)
    np.testing.assert_allclose(stats["std"], std, rtol=1e-12)
    assert len(resumed["vae_fingerprint"]) == 16


def test_round_trip_channel_norm_decodes_as_the_vae_alone(caches, tmp_path):
    """encode → normalise → denormalise → decode equals the VAE's own decode of the encoding,
    through generate.decode and through a saved and reloaded pipeline."""
    from nala_dit.models.vae import load_vae
    from nala_dit.diffusion.generate import decode
    from nala_dit.pipelines.pipeline import load_pipeline
    from nala_dit.pipelines.sources import load_source
    from tests.pipelines.test_pipeline import NAMES, tiny

    vae, _ = load_vae(str(caches["vae"]))
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = vae.encode(x).latent_dist.mean
    stats = caches["resumed"]["latent_stats"]
    norm = LatentNorm.channel(stats["mean"], stats["std"])
    model_space = norm.normalize(z)
    # the known answer of a normalisation by z's own statistics: mean 0, std 1 per channel
    own = LatentNorm.channel(z.mean((0, 2, 3)).tolist(), z.std((0, 2, 3), unbiased=False).tolist())
    torch.testing.assert_close(own.normalize(z).mean((0, 2, 3)), torch.zeros(4), rtol=0, atol=1e-6)
    torch.testing.assert_close(own.normalize(z).std((0, 2, 3), unbiased=False), torch.ones(4), rtol=0, atol=1e-5)
    # Denormalising inverts the normalisation to float rounding (a few ulps of z, |z| < 8) ...
    back = norm.denormalize(model_space)
    assert (back - z).abs().max() <= 8 * torch.finfo(torch.float32).eps * z.abs().max().clamp(min=1)
    # ... and generate.decode is the VAE's own decode of exactly those latents, bit for bit. (Not
    # decode(z) at a fixed tolerance: the random tiny decoder amplifies those ulps ~100x, by an
    # amount that changes with the thread count: 1.3e-5 with one thread, under 1e-5 with two.)
    alone = vae.decode(back).sample.clamp(-1, 1)
    assert torch.equal(decode(model_space, vae, norm), alone)

    from nala_dit.pipelines.pipeline import NaLaSiTPipeline

    pipe = NaLaSiTPipeline.from_model(tiny("NaLaSiT-T/2", in_channels=4), id2label=NAMES,
                                      vae_path=str(caches["vae"]), latent_norm=norm.to_dict())
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = load_pipeline(tmp_path / "pipe")
    loaded.set_progress_bar_config(disable=True)
    assert loaded.latent_norm == norm and load_source(tmp_path / "pipe").latent_norm == norm
    kw = dict(class_labels=[0, 2], num_inference_steps=2, generator=3)
    lat = loaded(output_type="latent", **kw).images
    images = loaded(output_type="pt", **kw).images
    torch.testing.assert_close(images, (vae.decode(lat * norm._shaped(norm.std, lat) + norm._shaped(norm.mean, lat))
                                        .sample.clamp(-1, 1) + 1) / 2, rtol=0, atol=1e-6)


def latent_run(tmp_path, cache, vae, *extra, name="run"):
    argv = TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", name, "--data", str(cache), "--vae", str(vae),
                       "--global-batch-size", "2", "--latent-norm", "channel", *extra]
    return train_cli.main(argv)


def test_channel_norm_travels_with_checkpoint_and_mismatches_are_refused(caches, tmp_path, capsys):
    from export import main as export_main
    from nala_dit.data.datasets import to_uint8
    from nala_dit.diffusion.generate import SampleSettings, sample_batch
    from nala_dit.pipelines.pipeline import load_pipeline
    from nala_dit.pipelines.sample_files import sample_images
    from nala_dit.pipelines.sources import load_source

    stats_a, stats_b = (json.loads((caches[k] / "meta.json").read_text())["latent_stats"] for k in "ab")
    norm_a = LatentNorm.channel(stats_a["mean"], stats_a["std"])
    assert latent_run(tmp_path, caches["a"], caches["vae"], "--max-steps", "1", "--ckpt-every", "1") == 0
    state = json.loads((tmp_path / "run" / "checkpoints" / "0000001" / "state.json").read_text())
    assert state["latent_norm"] == norm_a.to_dict() and state["config"]["latent-norm"] == "channel"
    assert load_source(tmp_path / "run").latent_norm == norm_a
    # sample.py / evaluate_fid.py's path decodes with exactly the checkpoint's statistics
    source = load_source(tmp_path / "run")
    settings = SampleSettings("ddim", 2)
    images, _ = sample_images(source, [0, 1], 0, settings, batch_size=2)
    lat, _ = sample_batch(source.model, source.objective, torch.tensor([0, 1]), [0, 1], 0, settings,
                          decode_output=False)
    with torch.no_grad():
        expected = source.vae.decode(lat * torch.tensor(stats_a["std"]).view(1, 4, 1, 1)
                                     + torch.tensor(stats_a["mean"]).view(1, 4, 1, 1)).sample
    assert torch.equal(images, to_uint8(expected.clamp(-1, 1)))
    capsys.readouterr()
    assert export_main(["checkpoint", str(tmp_path / "run"), str(tmp_path / "exported")]) == 0
    assert f"latents normalised {norm_a.describe()}" in capsys.readouterr().out.splitlines()[0]
    assert load_pipeline(tmp_path / "exported").latent_norm == norm_a
    capsys.readouterr()  # diffusers' loading bar

    # resume on another cache: its statistics are not the checkpoint's
    gaps = [(abs(a - b), i, "mean", a, b) for i, (a, b) in enumerate(zip(stats_a["mean"], stats_b["mean"]))]
    gaps += [(abs(a - b), i, "std", a, b) for i, (a, b) in enumerate(zip(stats_a["std"], stats_b["std"]))]
    _, c, what, a, b = max(gaps)
    ckpt = tmp_path / "run" / "checkpoints" / "0000001"
    assert latent_run(tmp_path, caches["b"], caches["vae"], "--max-steps", "2", "--resume", "auto") == 1
    err = one_line(capsys.readouterr().err.strip())
    assert err.startswith("error: "), err
    assert_names(err, f"checkpoint {ckpt}", "latents normalised otherwise", str(caches["b"]),
                 f"channel {c} {what} {a:.6g} vs {b:.6g}", "--allow-changes latent-norm")
    # deliberately: the new data in the checkpoint's normalisation
    assert latent_run(tmp_path, caches["b"], caches["vae"], "--max-steps", "2", "--resume", "auto",
                      "--allow-changes", "latent-norm") == 0
    assert_names(capsys.readouterr().out, "latent norm: keeping", f"{ckpt}'s {norm_a.describe()}", str(caches["b"]))
    state = json.loads((tmp_path / "run" / "checkpoints" / "0000002" / "state.json").read_text())
    assert state["latent_norm"] == norm_a.to_dict()
    # --init-from with another cache, and with the scalar norm: the same refusal
    assert latent_run(tmp_path, caches["b"], caches["vae"], "--max-steps", "1", "--init-from", str(tmp_path / "run"),
                      name="init") == 1
    assert_names(capsys.readouterr().err, f"error: --init-from {tmp_path / 'run'}", "latents normalised otherwise",
                 str(caches["b"]), f"channel {c} {what}")
    assert latent_run(tmp_path, caches["a"], caches["vae"], "--max-steps", "1", "--init-from", str(tmp_path / "run"),
                      "--latent-norm", "scalar", name="init") == 1
    assert_names(capsys.readouterr().err, "latents normalised otherwise", "channel vs scalar")

    # a damaged entry in state.json names the file
    state_file = tmp_path / "run" / "checkpoints" / "0000002" / "state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "latent_norm": {"mode": "chanel"}}))
    with pytest.raises(ValueError) as err:
        load_source(tmp_path / "run")
    assert_names(one_line(err), f"{state_file}: ", "'latent_norm'", "'mode' one of scalar, channel",
                 "got {'mode': 'chanel'}", "edited or damaged")

    # a cache made by another VAE
    from nala_dit.models.vae import load_vae
    from nala_dit.data.latent_stats import vae_fingerprint

    prints = [vae_fingerprint(load_vae(str(caches[k]))[0]) for k in ("vae", "other_vae")]
    assert latent_run(tmp_path, caches["a"], caches["other_vae"], "--max-steps", "1", name="other") == 1
    err = one_line(capsys.readouterr().err.strip())
    assert err.startswith("error: "), err
    assert_names(err, str(caches["a"]), "another VAE", f"{caches['vae']}, encoder {prints[0]}",
                 f"--vae {caches['other_vae']} (encoder {prints[1]})", "pass the VAE the latents were extracted with",
                 "extract them again")


def test_channel_norm_needs_a_cache_with_statistics(caches, tmp_path, capsys):
    meta = json.loads((caches["a"] / "meta.json").read_text())
    old = tmp_path / "old"
    old.mkdir()
    for name in meta["shards"]:
        shutil.copy(caches["a"] / name, old / name)
    (old / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "latent_stats"}))
    assert latent_run(tmp_path, old, caches["vae"], "--max-steps", "1") == 1
    err = one_line(capsys.readouterr().err.strip())
    assert err.startswith("error: "), err
    assert_names(err, str(old / "meta.json"), "no latent statistics", "rerun extract_latents.py with the same flags",
                 "--latent-norm scalar")
    with pytest.raises(SystemExit):
        train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--latent-norm", "channel", "--max-steps", "1"])
    line = capsys.readouterr().err.splitlines()[1]
    assert_names(line[line.index("error: "):], "--latent-norm channel", "pixel space (no --vae)", "drop it",
                 "latent folder from extract_latents.py")


def test_damaged_statistics_are_one_line_errors(caches, tmp_path):
    from nala_dit.data.datasets import LatentDataset

    meta = json.loads((caches["a"] / "meta.json").read_text())
    folder = tmp_path / "lat"
    folder.mkdir()
    for name in meta["shards"]:
        shutil.copy(caches["a"] / name, folder / name)
    (folder / "meta.json").write_text(json.dumps({**meta, "latent_stats": {"mean": [0.0] * 3, "std": [1.0] * 4}}))
    with pytest.raises(ValueError) as err:
        LatentDataset(folder)
    assert_names(one_line(err), f"{folder / 'meta.json'}: ", "'latent_stats'", "'mean' and 'std'",
                 "4 finite numbers each", "'mean': [0.0, 0.0, 0.0]", "rerun extract_latents.py")
    with pytest.raises(ValueError) as err:
        LatentNorm.channel([0.0, 1.0], [1.0, 0.0])
    assert_names(one_line(err), "std of channel 1 is 0.0", "not positive", "use --latent-norm scalar")
    with pytest.raises(ValueError) as err:
        LatentNorm.from_dict({"mode": "channel", "mean": [0.0], "std": "x"}, "state.json 'latent_norm'")
    assert_names(err, "state.json 'latent_norm'", "mean and std must be lists")


# --- the cache's statistics, encoder and source are checked, not trusted ------

def copied_cache(caches, tmp_path, edit=None, name="lat"):
    """Cache A copied, its meta.json passed through ``edit`` (a dict → dict function)."""
    folder = shutil.copytree(caches["a"], tmp_path / name)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps(edit(meta) if edit else meta))
    return folder


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("edit", [
    lambda s: dict(s, mean=[5.0] * len(s["mean"])),
    lambda s: dict(s, std=[10 * v for v in s["std"]]),
], ids=["mean 5", "std x10"])
def test_edited_statistics_are_refused_naming_the_file(caches, tmp_path, capsys, edit):
    folder = copied_cache(caches, tmp_path, lambda m: dict(m, latent_stats=edit(m["latent_stats"])))
    assert latent_run(tmp_path, folder, caches["vae"], "--max-steps", "1") == 1
    line = one_error(capsys)
    for words in (str(folder / "meta.json"), "latent_stats", "do not match", "float64 sums", "edited or damaged",
                  "rerun extract_latents.py"):
        assert words in line, (words, line)
    assert not (tmp_path / "run").exists()
    # the statistics as the shards give them (what extract_latents.py writes): trains
    folder = copied_cache(caches, tmp_path, name="intact")
    assert latent_run(tmp_path, folder, caches["vae"], "--max-steps", "1") == 0


def test_a_cache_without_its_encoder_fingerprint_is_not_trained_with_another_vae(caches, tmp_path, capsys):
    folder = copied_cache(caches, tmp_path, lambda m: {k: v for k, v in m.items() if k != "vae_fingerprint"})
    assert latent_run(tmp_path, folder, caches["other_vae"], "--max-steps", "1", "--latent-norm", "scalar") == 1
    line = one_error(capsys)
    for words in (str(folder / "meta.json"), "no encoder fingerprint", str(caches["vae"]), str(caches["other_vae"]),
                  "--allow-changes vae", "rerun extract_latents.py"):
        assert words in line, (words, line)
    # the VAE it records: trains; another one, deliberately: trains, and says so
    assert latent_run(tmp_path, folder, caches["vae"], "--max-steps", "1", "--latent-norm", "scalar",
                      name="same") == 0
    capsys.readouterr()
    assert latent_run(tmp_path, folder, caches["other_vae"], "--max-steps", "1", "--latent-norm", "scalar",
                      "--allow-changes", "vae", name="forced") == 0
    assert "--allow-changes vae" in capsys.readouterr().out


def test_an_extraction_resumed_from_another_image_folder_is_refused(caches, tmp_path, capsys):
    from extract_latents import main as extract_main

    folder = copied_cache(caches, tmp_path)
    (folder / "latents-00001.safetensors").unlink()      # interrupted
    argv = ["--out", str(folder), "--vae", str(caches["vae"]), "--image-size", "64", "--shard-size", "4",
            "--num-workers", "0", "--dtype", "float32"]
    before = (folder / "meta.json").read_bytes()
    capsys.readouterr()
    # images B: the same count, classes and file names as A, other pictures
    assert extract_main(["--data", str(caches["root"] / "images-b"), *argv]) == 1
    line = one_error(capsys)
    assert "source" in line and str(caches["root"] / "images-a") in line and str(caches["root"] / "images-b") in line
    assert not (folder / "latents-00001.safetensors").exists() and (folder / "meta.json").read_bytes() == before
    # the same folder with one picture replaced: its file list differs (a size)
    images = shutil.copytree(caches["root"] / "images-a", tmp_path / "images-a")
    folder2 = copied_cache(caches, tmp_path, lambda m: dict(m, source=str(images.resolve())), name="lat2")
    (folder2 / "latents-00001.safetensors").unlink()
    victim = sorted((images / "dog").iterdir())[-1]
    from PIL import Image

    Image.new("RGB", (72, 64), (1, 2, 3)).save(victim)
    assert extract_main(["--data", str(images), *argv[:1], str(folder2), *argv[2:]]) == 1
    assert "source_files" in one_error(capsys)
    # the folder it was extracted from: resumes
    assert extract_main(["--data", str(caches["root"] / "images-a"), *argv]) == 0
