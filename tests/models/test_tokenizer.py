"""Any diffusers tokenizer (nala_dit/models/tokenizer.py): for each autoencoder class, a tiny
random-weight instance saved with save_pretrained goes the whole way — extract latents, train
three steps, sample, export, load as a diffusers pipeline — and the pipeline gives sample.py's
pixels; what the tokenizer is (factor, channels, distribution or not, scaling and shift, pixel
range) is read from the model and checked against the instance's own encode; a cache of
another tokenizer is refused in one line."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from nala_dit.models import tokenizer as tok
from tests.training.test_loop import make_image_folder, run_train
from tests.utils import assert_names, one_line

SIZE = 16   # image px: every tokenizer below encodes it to a 4x4 or 8x8 latent


def kl():   # an AutoencoderKL with FLUX.1's kind of config: a scaling and a shift factor
    import diffusers

    return diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, norm_num_groups=8,
                                   latent_channels=4, sample_size=32, scaling_factor=0.5, shift_factor=0.1)


def dc():   # DC-AE's layout (ResBlocks, then an EfficientViT stage), 3 levels: f4
    import diffusers

    blocks = ("ResBlock", "ResBlock", "EfficientViTBlock")
    return diffusers.AutoencoderDC(latent_channels=8, attention_head_dim=8, encoder_block_types=blocks,
                                   decoder_block_types=blocks, encoder_block_out_channels=(8, 16, 16),
                                   decoder_block_out_channels=(8, 16, 16), encoder_layers_per_block=(1, 1, 1),
                                   decoder_layers_per_block=(1, 1, 1), encoder_qkv_multiscales=((), (), (5,)),
                                   decoder_qkv_multiscales=((), (), (5,)), scaling_factor=0.4)


def flux2():   # FLUX.2's KL: 8 latent channels here, no scaling factor in its config
    import diffusers

    return diffusers.AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                                        norm_num_groups=8, latent_channels=8, sample_size=32)


def rae():   # a DINOv2-with-registers encoder (64 wide, 8-px patches of a 32-px input) → 4x4 tokens, 16 px out
    import diffusers

    return diffusers.AutoencoderRAE(encoder_type="dinov2", encoder_hidden_size=64, encoder_patch_size=8,
                                    encoder_num_hidden_layers=1, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                    decoder_num_attention_heads=2, decoder_intermediate_size=64, patch_size=4,
                                    encoder_input_size=32)


# class: (builder, factor, channels, distribution, scaling, shift, [0, 1] images)
CASES = {
    "AutoencoderKL": (kl, 2, 4, True, 0.5, 0.1, False),
    "AutoencoderDC": (dc, 4, 8, False, 0.4, 0.0, False),
    "AutoencoderKLFlux2": (flux2, 2, 8, True, 1.0, 0.0, False),
    "AutoencoderRAE": (rae, 4, 64, False, 1.0, 0.0, True),
}


def saved(path, name, seed=0):
    torch.manual_seed(seed)
    CASES[name][0]().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("tok-images") / "images", per_class=2, size=SIZE)


def extract(images, out, vae):
    from extract_latents import main as extract_main

    assert extract_main(["--data", str(images), "--out", str(out), "--vae", str(vae), "--image-size", str(SIZE),
                         "--num-workers", "0", "--dtype", "float32"]) == 0
    return json.loads((out / "meta.json").read_text())


def test_the_classes_are_diffusers_own():
    import diffusers

    classes = tok.autoencoder_classes()
    assert set(CASES) <= set(classes) and all(c is getattr(diffusers, n) for n, c in classes.items())
    assert "ModelMixin" not in classes and all(n.startswith("Autoencoder") for n in classes)
    with pytest.raises(ValueError) as err:
        tok.autoencoder_class("os.system", "x/config.json")
    assert_names(err, "x/config.json", "'os.system' is not an autoencoder class of diffusers", "AutoencoderDC")


@pytest.mark.parametrize("name", list(CASES))
def test_a_tokenizer_goes_from_extraction_to_a_diffusers_pipeline(name, images, tmp_path, capsys):
    import diffusers
    import export
    import nala_dit
    import sample
    from nala_dit.data.datasets import ImageFolderDataset
    from nala_dit.models.vae import load_vae

    _, factor, channels, distribution, scaling, shift, unit = CASES[name]
    folder = saved(tmp_path / "vae", name)
    vae, got_scaling = load_vae(str(folder))
    info = tok.describe(vae)
    assert type(vae).__name__ == name == info.kind
    assert (info.factor, info.channels, info.distribution, info.scaling, info.shift, info.unit_range) == \
        (factor, channels, distribution, scaling, shift, unit) and got_scaling == scaling

    meta = extract(images, tmp_path / "lat", folder)
    assert meta["vae_class"] == name and meta["spatial_factor"] == factor and meta["latent_channels"] == channels
    assert meta["encoding"] == ("distribution" if distribution else "deterministic")
    assert meta["vae_weights_sha256"] == tok.identity(vae)["vae_weights_sha256"]
    # The cache holds the tokenizer's own encoding of the image (its posterior mean, or the latent).
    from nala_dit.data.datasets import LatentDataset

    x, _ = ImageFolderDataset(images, SIZE)[1]
    out = vae.encode(((x[None] + 1) / 2) if unit else x[None])
    mean = out.latent_dist.mean if distribution else out.latent
    moments, _ = LatentDataset(tmp_path / "lat")[1]
    assert moments.shape == (2, 2, channels, SIZE // factor, SIZE // factor)
    torch.testing.assert_close(moments[0, 0], mean[0], rtol=1e-5, atol=1e-5)

    run = run_train(tmp_path, "--data", str(tmp_path / "lat"), "--vae", str(folder), "--model", "SiT-T/1",
                    "--global-batch-size", "2", "--max-steps", "3", "--ckpt-every", "3", "--report-to", "none", name="run")
    state = json.loads(sorted((run / "checkpoints").glob("*/state.json"))[-1].read_text())
    assert state["latent_norm"] == dict(mode="scalar", scale=scaling, **({"shift": shift} if shift else {}))

    flags = ["--labels", "0,1", "--sampler", "ode-euler", "--steps", "2", "--seed", "3"]
    assert sample.main(["--ckpt", str(run), *flags, "--out-dir", str(tmp_path / "png")]) == 0
    pngs = [np.asarray(Image.open(p)) for p in sorted((tmp_path / "png").glob("*.png"))]
    assert len(pngs) == 2 and pngs[0].shape == (SIZE, SIZE, 3)
    if name == "AutoencoderDC":   # another tokenizer's channels: one line, not a convolution's shape error
        other = saved(tmp_path / "kl", "AutoencoderKL")
        capsys.readouterr()
        assert sample.main(["--ckpt", str(run), *flags, "--vae", str(other), "--out-dir", str(tmp_path / "x")]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert_names(err, f"--vae {other}: a AutoencoderKL of 4 latent channels, and the model takes 8")
    assert export.main(["checkpoint", str(run), str(tmp_path / "pipe"), "--copy-vae"]) == 0
    capsys.readouterr()
    nala_dit.register_with_diffusers()
    pipe = diffusers.DiffusionPipeline.from_pretrained(str(tmp_path / "pipe"))
    assert type(pipe.vae).__name__ == name
    if name == "AutoencoderDC":
        with pytest.raises(ValueError, match="a AutoencoderKL of 4 latent channels, and the model takes 8"):
            pipe.vae_override(str(other))
        assert type(pipe.vae).__name__ == name   # kept
    pipe.set_progress_bar_config(disable=True)
    direct = pipe(class_labels=[0, 1], sampler="ode-euler", num_inference_steps=2, generator=3).images
    for a, b in zip(pngs, direct, strict=True):   # the loaded pipeline gives sample.py's pixels
        np.testing.assert_array_equal(a, np.asarray(b))


def test_a_cache_of_another_tokenizer_is_refused_in_one_line(images, tmp_path, capsys):
    import train as train_cli

    extract(images, tmp_path / "lat", saved(tmp_path / "dc", "AutoencoderDC"))
    kl_folder = saved(tmp_path / "kl", "AutoencoderKL")
    argv = ["--model", "SiT-T/1", "--data", str(tmp_path / "lat"), "--vae", str(kl_folder), "--global-batch-size", "2",
            "--num-workers", "0", "--max-steps", "1", "--results-dir", str(tmp_path), "--exp-name", "bad"]
    capsys.readouterr()
    assert train_cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert_names(err, "holds latents of a AutoencoderDC", f"--vae {kl_folder} is a AutoencoderKL")


def test_tiling_is_refused_in_one_line_where_the_class_has_none(tmp_path):
    from nala_dit.models import vae as vae_lib

    torch.manual_seed(0)
    model = dc().eval()
    with pytest.raises(ValueError) as err:
        vae_lib.check_tiling("on", 64, model)
    assert_names(err, "AutoencoderDC has no tiled decode", "drop --vae-tile-size")
    assert vae_lib.plan(model, (1, 8, 64, 64), "auto") == dict(use_slicing=False)  # one piece, no tiles
    with pytest.raises(ValueError, match="AutoencoderDC has no tiled decode"):
        vae_lib.plan(model, (1, 8, 4, 4), "on")


def test_a_folder_without_weights_or_of_another_size_is_one_line(images, tmp_path):
    from nala_dit.models.vae import load_vae

    folder = saved(tmp_path / "rae", "AutoencoderRAE")
    vae, _ = load_vae(str(folder))
    with pytest.raises(ValueError) as err:   # an RAE decodes its one size only
        tok.check_image_size(vae, 32)
    assert_names(err, "--image-size 32", "AutoencoderRAE", "decodes 16 px only", "use --image-size 16")
    from types import SimpleNamespace

    from nala_dit.models.grid import latent_for

    model = SimpleNamespace(config=SimpleNamespace(patch_size=1))
    assert latent_for(model, vae, "16") == (4, 4)
    with pytest.raises(ValueError, match="--image-size 16x32: AutoencoderRAE .* decodes 16 px only"):
        latent_for(model, vae, "16x32")   # sampling at another size too
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_vae(str(folder))
    assert_names(err, f"{folder} has a config.json but no weights", "diffusion_pytorch_model.safetensors is missing")


def test_a_video_or_audio_autoencoder_is_refused_in_one_line():
    import diffusers

    audio = diffusers.AutoencoderOobleck(encoder_hidden_size=8, downsampling_ratios=[2, 2], channel_multiples=[1, 2],
                                         decoder_channels=8, decoder_input_channels=4, audio_channels=2)
    with pytest.raises(ValueError) as err:
        tok.describe(audio)
    assert_names(one_line(err), "AutoencoderOobleck", "gives no spatial factor", "not an image autoencoder")
    video = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                                       temperal_downsample=[False])
    with pytest.raises(ValueError) as err:   # its encode takes (B, C, frames, H, W)
        tok.describe(video)
    assert_names(one_line(err), "AutoencoderKLWan cannot encode a (1, 3,", "not an image autoencoder")


def test_the_scalar_norm_with_a_shift_is_exact_and_travels():
    from nala_dit.data.latent_stats import LatentNorm, difference

    norm = LatentNorm.scalar(0.5, 0.1)
    z = torch.tensor([[[[0.1, 2.1]]]])
    torch.testing.assert_close(norm.normalize(z), torch.tensor([[[[0.0, 1.0]]]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(norm.denormalize(norm.normalize(z)), z, rtol=0, atol=1e-7)
    assert norm.to_dict() == dict(mode="scalar", scale=0.5, shift=0.1)
    assert LatentNorm.from_dict(norm.to_dict()) == norm
    assert LatentNorm.scalar(0.5).to_dict() == dict(mode="scalar", scale=0.5)   # as stored before shifts
    assert difference(LatentNorm.scalar(0.5), norm) == "shift 0.1 vs 0"
    with pytest.raises(ValueError, match="the shift must be a finite number, got nan"):
        LatentNorm.scalar(0.5, float("nan"))
