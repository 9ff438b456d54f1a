"""Tiled and sliced VAE decoding (nala_dit/models/vae.py) on a tiny real AutoencoderKL.

Geometry (P = tile px, s = ¾P stride, E = ¼P blend width, per axis): tile k covers
image px [k·s, k·s + P); px [k·s, k·s + E) blend tiles k−1 and k linearly; the rest of
[k·s, (k+1)·s) is tile k alone. The tests check that layout exactly, then that a tiled
decode equals the untiled one wherever a pixel's receptive field lies inside its tile.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image

from nala_dit.cli.options import VAE_AUTO_TILING_PIXELS, VAE_TILE_PIXELS
from nala_dit.diffusion.generate import decode
from nala_dit.models import vae as vae_lib

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import time

from benchmarks.attention import PeakMemory  # noqa: E402  (the repo's storage-counting tracker)
from tests.scripts.test_sample import FAST
from tests.utils import assert_names, cli, one_line, one_line_error

F = 8  # the tiny VAE's factor, as the SD VAEs'


def tiny_vae(attention=True, local=False, dtype=torch.float32):
    """INTEGRATION.md's ≈67k-parameter VAE with seeded random weights. ``local``: every
    GroupNorm replaced by the identity and no mid-block attention, so that each output
    pixel depends only on latents within the convolutions' receptive field."""
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8, 8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=8,
                        latent_channels=4, sample_size=64, mid_block_add_attention=attention and not local)
    if local:
        for module in list(vae.decoder.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, torch.nn.GroupNorm):
                    setattr(module, name, torch.nn.Identity())
    if dtype != torch.float32:
        vae.to(dtype)
    return vae.eval().requires_grad_(False)


def latents(shape, dtype=torch.float32, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def raw_decode(vae, z):
    """The VAE's own untiled decode (no scaling, no clamp)."""
    with vae_lib.decoding(vae, z.shape, "off"):
        return vae.decode(z).sample


def tiled_decode(vae, z, tile):
    with vae_lib.decoding(vae, z.shape, "on", tile):
        return vae.decode(z).sample


def tile_starts(n_latent, tile_latent):
    return list(range(0, n_latent, tile_latent * 3 // 4))


def test_tiled_decode_is_the_tile_decodes_cut_and_blended_at_the_stated_seams():
    """Each tile decoded alone, cut and blended as the module docstring says, rebuilds the
    tiled decode: where one tile alone holds a pixel, bit for bit; in a blend band, to
    fp32 rounding of one multiply-add (1e-6 of the output scale). A wrong tile size or
    seam position would move whole bands."""
    vae = tiny_vae()
    P, L = 128, 16
    s, E = P * 3 // 4, P // 4
    z = latents((1, 4, 40, 56))                 # non-square; the last tiles are partial
    out = tiled_decode(vae, z, P)               # (1, 3, 320, 448)
    assert out.shape == (1, 3, 320, 448)
    rows, cols = tile_starts(40, L), tile_starts(56, L)
    tiles = {(i, j): raw_decode(vae, z[:, :, a:a + L, b:b + L]) for i, a in enumerate(rows) for j, b in enumerate(cols)}
    H, W = out.shape[-2:]
    for (i, j), tile in tiles.items():          # the pixels of tile (i, j) alone
        y0, y1 = i * s + (E if i else 0), min((i + 1) * s, H)
        x0, x1 = j * s + (E if j else 0), min((j + 1) * s, W)
        assert torch.equal(out[..., y0:y1, x0:x1], tile[..., y0 - i * s:y1 - i * s, x0 - j * s:x1 - j * s]), (i, j)
    scale = out.abs().max()
    for j in range(1, len(cols)):               # the first tile row's horizontal blend bands
        left, right = tiles[(0, j - 1)], tiles[(0, j)]
        w = torch.arange(E, dtype=torch.float32) / E
        expected = left[..., :s, s:s + E] * (1 - w) + right[..., :s, :E] * w
        torch.testing.assert_close(out[..., :s, j * s:j * s + E], expected, rtol=0, atol=1e-6 * scale)


def receptive_radius(vae, n=48):
    """Latent px by which one latent cell's decode reaches out, from the gradient's support."""
    z = latents((1, 4, n, n), torch.float64).requires_grad_(True)
    c = n // 2
    with vae_lib.decoding(vae, z.shape, "off"):
        vae.decode(z).sample[..., c * F:(c + 1) * F, c * F:(c + 1) * F].sum().backward()
    rows = z.grad.abs().sum(dim=(0, 1, 3)).nonzero().flatten()
    return int(max(c - rows.min(), rows.max() - c))


def exact_mask(n_latent, tile_latent, radius):
    """Image px (one axis) that come from one tile alone and whose receptive field does not
    reach a tile edge inside the image (an edge on the image border pads alike)."""
    P = tile_latent * F
    s, E = P * 3 // 4, P // 4
    mask = torch.zeros(n_latent * F, dtype=torch.bool)
    for k, a in enumerate(tile_starts(n_latent, tile_latent)):
        b = min(a + tile_latent, n_latent)
        for y in range(k * s + (E if k else 0), min((k + 1) * s, n_latent * F)):
            mask[y] = (a == 0 or y // F - radius >= a) and (b == n_latent or y // F + radius < b)
    return mask


@pytest.mark.slow
def test_tiled_equals_untiled_away_from_tile_edges():
    """A local decoder (no GroupNorm statistics, no attention) decodes a pixel from its
    receptive field only, so tiled == untiled wherever that field lies inside the pixel's
    tile: the same operations on the same numbers. Tolerance 1e-10 of the output scale
    in float64 (fp32 is not used: oneDNN picks shape-dependent convolution algorithms
    whose rounding, amplified by this unnormalised random network, reaches 1e-3 of the
    output std). Near seams the two must differ, or the test would check nothing.

    With GroupNorm kept, tiles also differ in the interior (per-tile statistics): that is
    what the docs report as the price of tiling, and why "auto" never tiles <= 1024² px."""
    vae = tiny_vae(local=True, dtype=torch.float64)
    radius = receptive_radius(vae)
    assert 8 <= radius <= 16, radius            # ≈ 14 for this architecture: 9 convs at latent size, more above
    L = 32                                      # a tile must be wider than the field on both sides
    z = latents((1, 4, 56, 72), torch.float64)
    ref, out = raw_decode(vae, z), tiled_decode(vae, z, L * F)
    mask = exact_mask(56, L, radius)[:, None] & exact_mask(72, L, radius)[None, :]
    assert mask.float().mean() > 0.1
    diff = (out - ref).abs()
    scale = ref.abs().max()
    assert diff[..., mask].max() <= 1e-10 * scale, diff[..., mask].max() / scale
    assert diff[..., ~mask].max() > 1e-3 * scale


def test_slicing_changes_only_rounding():
    vae = tiny_vae(dtype=torch.float64)
    z = latents((3, 4, 8, 8), torch.float64)
    with vae_lib.decoding(vae, z.shape, "off"):
        whole = vae.decode(z).sample
    vae.enable_slicing()
    sliced = vae.decode(z).sample
    assert ((sliced - whole).norm() / whole.norm()).item() <= 1e-12


def test_tiled_decode_peaks_lower():
    """Storage-counted peak of one fp32 decode of a 512² image. Untiled it holds about five
    8-channel full-size activations (40 MiB); tiled at 128 px, one tile's activations
    (1/16 of those) plus the 3-channel tiles, blends and output at full size (≈ 1.4
    activations): expected ≈ 0.3, asserted ≤ 0.5."""
    vae = tiny_vae()
    z = latents((1, 4, 64, 64))
    peaks = {}
    for mode in ("off", "on"):
        with torch.no_grad(), PeakMemory() as tracker:
            decode(z, vae, tiling=mode, tile_size=128)
        peaks[mode] = tracker.peak
    assert peaks["off"] >= 5 * 8 * 512 * 512 * 4
    assert peaks["on"] <= 0.5 * peaks["off"], peaks


class Stop(Exception):
    pass


def decoder_input(vae, shape, **kw):
    """The latent shape the decoder network is first called with (then the decode stops)."""
    seen = []

    def spy(z, *args, **kwargs):
        seen.append(tuple(z.shape))
        raise Stop

    vae.decoder.forward = spy
    try:
        with pytest.raises(Stop):
            decode(torch.zeros(shape), vae, **kw)
    finally:
        del vae.decoder.forward
    return seen[0]


def state(vae):
    return tuple(getattr(vae, name) for name in ("use_tiling", "use_slicing", "tile_sample_min_size",
                                                  "tile_latent_min_size"))


def test_auto_switches_exactly_above_one_megapixel_and_restores_the_vae():
    vae = tiny_vae()
    before = state(vae)
    side = VAE_AUTO_TILING_PIXELS ** 0.5 / F
    assert side == 128 and VAE_TILE_PIXELS == 512
    # 1024 x 1024 px: one piece; 1024 x 1032 px: tiles of 512 px (64 latent)
    assert decoder_input(vae, (1, 4, 128, 128)) == (1, 4, 128, 128)
    assert decoder_input(vae, (1, 4, 128, 129)) == (1, 4, 64, 64)
    # batches: 4 x 512² px = 1 MP together, decoded at once; 5 images, one at a time
    assert decoder_input(vae, (4, 4, 64, 64)) == (4, 4, 64, 64)
    assert decoder_input(vae, (5, 4, 64, 64)) == (1, 4, 64, 64)
    assert state(vae) == before                 # restored, also after the error
    # on / off / a tile size, whatever the image size
    assert decoder_input(vae, (2, 4, 16, 16), tiling="on", tile_size=64) == (1, 4, 8, 8)
    assert decoder_input(vae, (2, 4, 16, 16), tiling="on") == (1, 4, 16, 16)     # smaller than one 512-px tile
    assert decoder_input(vae, (1, 4, 130, 130), tiling="off") == (1, 4, 130, 130)
    assert state(vae) == before


def test_auto_keeps_what_the_user_set_and_off_overrides_it():
    vae = tiny_vae()
    vae.enable_tiling()                          # diffusers' convention: pipe.vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 96, 12
    before = state(vae)
    assert decoder_input(vae, (1, 4, 16, 16)) == (1, 4, 12, 12)
    assert decoder_input(vae, (1, 4, 16, 16), tile_size=64) == (1, 4, 8, 8)
    assert decoder_input(vae, (1, 4, 16, 16), tiling="off") == (1, 4, 16, 16)
    assert state(vae) == before
    with vae_lib.decode_settings("on", 32):      # what the CLIs set around sampling
        assert decoder_input(vae, (1, 4, 16, 16)) == (1, 4, 4, 4)
    assert decoder_input(vae, (1, 4, 16, 16)) == (1, 4, 12, 12)


@pytest.mark.parametrize("mode,size,message", [
    ("maybe", None, ("--vae-tiling", "auto, on, off", "got 'maybe'")),
    ("on", 0, ("--vae-tile-size", "positive number of image pixels", "got 0")),
    ("on", -64, ("--vae-tile-size", "positive number", "got -64")),
    ("auto", 100, ("--vae-tile-size 100", "does not tile", "factor 8", "overlapping by 0.25",
                   "use a multiple of 32 px, e.g. 96 or 128")),
    ("auto", 520, ("--vae-tile-size 520", "use a multiple of 32 px, e.g. 512 or 544")),
])
def test_bad_values_are_one_line_errors(mode, size, message):
    with pytest.raises(ValueError) as err:
        vae_lib.check_tiling(mode, size, tiny_vae())
    assert_names(one_line(err), *message)


def test_tile_size_without_a_vae_is_an_error():
    with pytest.raises(ValueError, match="no VAE"):
        vae_lib.check_tiling("auto", 64, None)
    vae_lib.check_tiling("auto", None, None)    # the default: nothing to decode, nothing to say
    with pytest.raises(ValueError) as err:
        vae_lib.check_tiling("on", None, None)  # asked for explicitly: say it cannot apply
    assert_names(err, "--vae-tiling on", "samples pixels directly", "drop --vae-tiling")


def test_pipeline_takes_vae_tiling_and_restores_the_vae():
    from nala_dit.models.dit import create_model
    from nala_dit.pipelines.pipeline import pipeline_for

    model = create_model("NaLaSiT-T/2", input_size=8, in_channels=4, num_classes=3).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    vae = tiny_vae()
    pipe = pipeline_for(model, vae=vae)
    pipe.set_progress_bar_config(disable=True)
    call = dict(class_labels=[1, 2], sampler="ode-euler", num_inference_steps=2, generator=3)
    lat = pipe(**call, output_type="latent").images
    before = state(vae)
    tiled = pipe(**call, output_type="pt", vae_tiling="on", vae_tile_size=32).images
    plain = pipe(**call, output_type="pt", vae_tiling="off").images
    assert state(vae) == before
    torch.testing.assert_close(tiled, (decode(lat, vae, pipe.scaling_factor, "on", 32) + 1) / 2, rtol=0, atol=0)
    torch.testing.assert_close(plain, (decode(lat, vae, pipe.scaling_factor, "off") + 1) / 2, rtol=0, atol=0)
    assert (tiled - plain).abs().max() > 1e-3    # tiling happened (64-px images, 32-px tiles)
    with pytest.raises(ValueError, match="vae_tile_size 40 does not tile"):
        pipe(**call, vae_tile_size=40)


@pytest.fixture(scope="module")
def latent_run(tmp_path_factory):
    from tests.scripts.test_sample import write_checkpoint

    root = tmp_path_factory.mktemp("tiling")
    tiny_vae().save_pretrained(root / "tiny-vae")
    return write_checkpoint(root / "latent", "NaLaSiT-T/2", vae=str(root / "tiny-vae"))


def test_sample_cli_flags(latent_run, tmp_path, capsys):
    import sample
    from nala_dit.pipelines.pipeline import pipeline_from_checkpoint

    flags = ["--ckpt", str(latent_run), "--labels", "2,5", "--sampler", "ode-euler", "--steps", "2"]
    assert sample.main([*flags, "--vae-tiling", "on", "--vae-tile-size", "32", "--out-dir", str(tmp_path / "on")]) == 0
    pngs = [np.asarray(Image.open(p)) for p in sorted((tmp_path / "on").glob("*.png"))]
    pipe = pipeline_from_checkpoint(latent_run)
    pipe.set_progress_bar_config(disable=True)
    call = dict(class_labels=[2, 5], sampler="ode-euler", num_inference_steps=2, generator=0)
    tiled, plain = pipe(**call, vae_tiling="on", vae_tile_size=32).images, pipe(**call).images
    for ref, img, untiled in zip(pngs, tiled, plain):
        np.testing.assert_array_equal(ref, np.asarray(img))
        assert (ref != np.asarray(untiled)).any()  # 64-px images: "auto" does not tile, the flag did
    capsys.readouterr()
    assert sample.main([*flags, "--vae-tile-size", "30", "--out-dir", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert_names(err, "--vae-tile-size 30", "does not tile this VAE", "use a multiple of")
    assert err.count("\n") == 1
    assert not (tmp_path / "bad").exists()


def test_evaluate_gen_checks_the_tile_size_first(latent_run, tmp_path, capsys):
    import evaluate_fid

    rc = evaluate_fid.main(["gen", "--ckpt", str(latent_run), "--ref", str(tmp_path / "missing.npz"),
                            "--num-samples", "2", "--vae-tile-size", "-8", "--device", "cpu"])
    assert rc == 1
    assert_names(capsys.readouterr().err, "--vae-tile-size", "positive number", "got -8")


def test_vae_tiling_on_a_pixel_model_is_refused(run_dir, pipe_dir, tmp_path, capsys):
    from nala_dit.pipelines.pipeline import load_pipeline

    assert cli("--ckpt", run_dir, "--labels", "1", *FAST, "--vae-tiling", "on", "--grid", tmp_path / "g.png") == 1
    assert_names(one_line_error(capsys), "--vae-tiling on", "samples pixels directly (no VAE)", "drop --vae-tiling")
    with pytest.raises(ValueError) as err:
        load_pipeline(pipe_dir)([1], sampler="ddim", num_inference_steps=2, vae_tiling="on")
    assert_names(err, "vae_tiling on", "samples pixels directly", "drop vae_tiling")


@pytest.mark.parametrize("why", ["HF_HUB_OFFLINE", "no network"])
def test_load_vae_offline_fails_at_once_naming_the_local_folder(monkeypatch, why):
    import huggingface_hub.constants

    from nala_dit.models import vae as vae_lib

    if why == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(proxy, raising=False)
        monkeypatch.setattr(vae_lib, "hub_reachable", lambda timeout=2.0: False)
    from diffusers import AutoencoderKL  # noqa: F401  (imported before the clock starts)

    start = time.perf_counter()
    with pytest.raises(OSError) as err:
        vae_lib.load_vae("nala-dit-tests/no-such-vae")
    assert time.perf_counter() - start < 5
    text = str(err.value)
    assert "\n" not in text and "offline" in text and "hf download nala-dit-tests/no-such-vae" in text
    assert "--vae no-such-vae" in text and "load_vae('no-such-vae')" in text


# --- a VAE folder that cannot be loaded: the cause, not "Offline?" ---

class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_refused_pickle_bin_in_a_vae_folder_is_named_as_such(tmp_path):
    """A folder whose only weights are a .bin that asks to run code: refused, nothing run, and
    the one line says a pickle was refused (it used to say "Offline? download it ...")."""
    from nala_dit.models.vae import load_vae

    folder = tmp_path / "vae"
    tiny_vae().save_pretrained(folder, safe_serialization=False)
    marker = tmp_path / "ran"
    torch.save({"encoder.conv_in.weight": _RunsCode(marker)}, folder / "diffusion_pytorch_model.bin")
    with pytest.raises(OSError) as err:
        load_vae(str(folder))
    message = str(err.value)
    assert "\n" not in message and "Offline?" not in message and "weights_only=False" not in message, message
    assert_names(message, str(folder), "a pickle, .bin", "posix.system", "nothing in it was run",
                 "diffusion_pytorch_model.safetensors")
    assert not marker.exists()
    (folder / "diffusion_pytorch_model.bin").write_bytes(b"damaged")   # not a pickle that runs code
    with pytest.raises(OSError) as err:
        load_vae(str(folder))
    assert "Offline?" not in str(err.value) and "save it again" in str(err.value)
