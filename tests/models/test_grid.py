"""High resolution: image sizes, position policies, the time shift and progressive
upscaling, each against its closed form (docs/highres.md)."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

import sample
from nala_dit.cli.config import resolve
from nala_dit.cli.options import TrainConfig
from nala_dit.diffusion.gaussian import GaussianDiffusion, shift_timesteps
from nala_dit.diffusion.generate import (
    SampleSettings,
    generate,
    initial_noise,
    renoise,
    sample_batch,
    upsample_latents,
)
from nala_dit.diffusion.samplers import ode_sample
from nala_dit.diffusion.transport import Transport, shift_time, shifted_grid
from nala_dit.models.dit import DiT
from nala_dit.models.grid import (
    TokenGrid,
    latent_size,
    parse_image_size,
    parse_time_shift,
    sincos_pos_embed_1d,
    sincos_pos_embed_2d,
)
from tests.scripts.test_sample import write_checkpoint
from tests.utils import TINY, assert_names, one_line


def perturbed(**kw):
    torch.manual_seed(0)
    model = DiT(**{**TINY, **kw}).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


# ------------------------------------------------------------------- sizes
@pytest.mark.parametrize("value, hw", [(512, (512, 512)), ("256", (256, 256)), ("512x768", (512, 768)),
                                       ("64×32", (64, 32)), ((16, 8), (16, 8))])
def test_image_size_forms(value, hw):
    assert parse_image_size(value) == hw


@pytest.mark.parametrize("value", [0, -8, "0x64", "abc", "64x", "1.5", True, None])
def test_bad_image_sizes_name_the_value(value):
    with pytest.raises(ValueError, match="image size must be"):
        parse_image_size(value)


def test_latent_size_checks_vae_factor_times_patch():
    assert latent_size("512x768", 8, 2) == (64, 96)
    with pytest.raises(ValueError) as err:
        latent_size(520, 8, 2)
    assert_names(err, "520", "VAE factor 8 × patch 2 = 16", "choose e.g.")


@pytest.mark.parametrize("value", [0, -1, "nan", "inf", "fast", True])
def test_bad_time_shift(value):
    with pytest.raises(ValueError, match="time shift must be"):
        parse_time_shift(value)


def test_unknown_positions_mode():
    with pytest.raises(ValueError) as err:
        DiT(**TINY, positions="stretch")
    assert_names(err, "positions", "extrapolate, interpolate, none", "--pos-embed", "got 'stretch'")


# ------------------------------------------------------- position policies
def test_extrapolate_is_dits_integer_table_on_any_grid():
    model = perturbed()
    table = model.position_embedding(model.grid(6, 10))[0]           # 3×5 tokens
    assert torch.equal(table, sincos_pos_embed_2d(32, 3, 5))
    # channel 0 of the first half: sin(col · ω_0), ω_0 = 1 (closed form)
    cols = torch.arange(15) % 5
    assert torch.allclose(table[:, 0].double(), torch.sin(cols.double()), atol=1e-6)


def test_interpolate_scales_positions_into_the_base_range():
    model = perturbed(positions="interpolate")
    base = model.pos_embed[0]
    assert torch.equal(base, sincos_pos_embed_2d(32, 4, 4))          # the trained grid is unchanged
    big = model.position_embedding(model.grid(16, 24))[0].reshape(8, 12, 32)
    # PixArt's rule: index i on a g-grid sits at i · base / g; rows 8 → base 4 (×1/2), cols 12 → ×1/3
    assert torch.equal(big[::2, ::3].reshape(16, 32), base)
    expected_col = sincos_pos_embed_1d(16, torch.tensor([5 * 4 / 12]))[0].float()
    assert torch.allclose(big[0, 5, :16], expected_col, atol=1e-6)


def test_none_has_no_absolute_positions():
    model = perturbed(positions="none")
    assert not model.pos_embed.any()
    assert not model.position_embedding(model.grid(12, 12)).any()
    assert model.grid(12, 12).position_scale() is None


def test_tables_are_cached_per_grid_and_follow_the_device():
    model = perturbed()
    first = model.position_embedding(model.grid(12, 8))
    assert model.position_embedding(model.grid(12, 8)) is first
    model.double()
    assert model.position_embedding(model.grid(12, 8)).dtype == torch.float64


def test_grid_unpacks_like_the_old_tuple():
    g = TokenGrid(3, 5, 4, 4, "interpolate")
    h, w = g
    assert (h, w, g.tokens, len(g), g[1]) == (3, 5, 15, 2, 5)
    assert g.position_scale() == (4 / 3, 4 / 5)
    assert g.time_shift("auto") == math.sqrt(15 / 16)


def test_model_at_other_sizes_square_and_non_square():
    """At grids other than the trained one, against the forward pass written out token by
    token: patch (i, j) of the image → its embedding + DiT's sin-cos position (first half the
    column j, second half the row i; extrapolated integer positions), the blocks on the
    (h, w) grid, and the final layer's p·p·C values put back at rows i·p + a, columns j·p + b."""
    model = perturbed()
    p, c_out, hidden = model.patch_size, model.out_channels, model.config.hidden_size
    t, y = torch.tensor([3.0, 500.0]), torch.tensor([1, 2])
    weight = model.x_embedder.proj.weight.reshape(hidden, -1)
    for hw in ((16, 16), (8, 24)):
        x = torch.randn(2, 4, *hw, generator=torch.Generator().manual_seed(hw[1]))
        h, w = hw[0] // p, hw[1] // p
        with torch.no_grad():
            tokens, pos = [], []
            for i in range(h):
                for j in range(w):
                    patch = x[:, :, i * p:(i + 1) * p, j * p:(j + 1) * p].reshape(2, -1)
                    tokens.append(patch @ weight.T + model.x_embedder.proj.bias)
                    pos.append(torch.cat([sincos_pos_embed_1d(hidden // 2, torch.tensor([float(j)])),
                                          sincos_pos_embed_1d(hidden // 2, torch.tensor([float(i)]))], 1)[0])
            seq = torch.stack(tokens, 1) + torch.stack(pos).float()
            cond = model.t_embedder(t) + model.y_embedder(y, False)
            for block in model.blocks:
                seq = block(seq, cond, (h, w))
            values = model.final_layer(seq, cond).reshape(2, h, w, p, p, c_out)
            want = torch.empty(2, c_out, *hw)
            for i in range(h):
                for j in range(w):
                    for a in range(p):
                        for b in range(p):
                            want[:, :, i * p + a, j * p + b] = values[:, i, j, a, b]
            got = model(x, t, y)
        assert got.shape == (2, 8, *hw)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_interpolate_at_the_trained_size_is_the_same_model():
    a, b = perturbed(), perturbed(positions="interpolate")
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3.0, 500.0]), torch.tensor([1, 2])
    assert torch.equal(a(x, t, y), b(x, t, y))


# ---------------------------------------------------------------- time shift
def test_shift_time_closed_form():
    t = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    s = 3.0
    u = 1 - t                                                        # SD3: u = noise fraction
    assert torch.allclose(shift_time(t, s), 1 - s * u / (1 + (s - 1) * u))
    # linear path: SNR = (t / (1 − t))² is divided by s²
    inner = slice(1, 4)
    snr, snr2 = (t / (1 - t)) ** 2, (shift_time(t, s) / (1 - shift_time(t, s))) ** 2
    assert torch.allclose(snr2[inner], snr[inner] / s ** 2)
    assert torch.equal(shift_time(t, 1.0), t)


def test_shifted_grid_endpoints_exact_and_interior_shifted():
    grid = shifted_grid(0.001, 0.999, 4, 2.0)
    assert grid[0] == 0.001 and grid[-1] == 0.999
    assert grid[2] == pytest.approx(0.001 + 0.998 * 0.5 / (0.5 + 2.0 * 0.5))
    assert shifted_grid(0.0, 1.0, 4) == torch.linspace(0, 1, 5, dtype=torch.float64).tolist()


def test_dit_shift_moves_log_snr_by_two_log_s():
    d = GaussianDiffusion.from_schedule("linear", 1000)
    acp = d.alphas_cumprod
    logsnr = (acp.log() - (-acp).log1p()).numpy()
    kept = [0, 100, 400, 700, 999]
    s = 2.0
    out = shift_timesteps(kept, acp, s)
    assert out[0] == 0 and out[-1] == 999
    for t, t2 in zip(kept[1:-1], out[1:-1]):
        target = logsnr[t] - 2 * math.log(s)
        assert t2 == int(np.argmin(np.abs(logsnr - target)))          # brute force over every timestep
        assert t2 > t                                                # more noise
    assert shift_timesteps(kept, acp, 1.0) == kept


def test_training_times_follow_the_shift():
    torch.manual_seed(0)
    u = torch.rand(1000)
    torch.manual_seed(0)
    t = Transport("linear", time_shift=3.0).sample_t(1000)
    assert torch.allclose(t, shift_time(u, 3.0))
    d = GaussianDiffusion.from_schedule("linear", 1000, time_shift=2.0)
    torch.manual_seed(0)
    raw = torch.randint(0, 1000, (64,))
    torch.manual_seed(0)
    shifted = d.sample_timesteps(64)
    assert shifted.tolist() == [shift_timesteps([int(r)], d.alphas_cumprod, 2.0)[0] for r in raw]


def test_shifted_euler_steps_on_the_shifted_grid():
    # A velocity field v = x (exact per step): Euler multiplies by (1 + h_i) on each interval.
    transport = Transport("linear")
    x0 = torch.ones(1, 1, 2, 2)
    out = ode_sample(transport, lambda x, t, y: x, x0, torch.zeros(1), method="euler", num_steps=5, time_shift=3.0)
    grid = shifted_grid(0.0, 1.0, 5, 3.0)
    expected = math.prod(1 + (b - a) for a, b in zip(grid, grid[1:]))
    assert torch.allclose(out.samples, x0 * expected, atol=1e-6)


def test_shift_refused_where_it_has_no_meaning():
    d = GaussianDiffusion.from_schedule("linear", 1000, "fixed_small")
    with pytest.raises(ValueError, match="not to a diffusers scheduler"):
        generate(lambda x, t, y: x, d, torch.randn(1, 1, 2, 2), torch.zeros(1, dtype=torch.long),
                 sampler="dpm-solver", time_shift=2.0)
    with pytest.raises(ValueError, match="dopri5 chooses its own steps"):
        generate(lambda x, t, y: x, Transport("linear"), torch.randn(1, 1, 2, 2), torch.zeros(1, dtype=torch.long),
                 sampler="dopri5", time_shift=2.0)


# -------------------------------------------------------- progressive upscaling
def sit_model():
    return perturbed(objective="transport", learn_sigma=False)


def test_strength_zero_returns_the_upsampled_latent():
    model = sit_model()
    small = torch.randn(2, 4, 8, 8)
    init = upsample_latents(small, (16, 16))
    out = generate(model, Transport("linear"), torch.randn(2, 4, 16, 16), torch.tensor([1, 2]), sampler="ode-euler",
                   num_steps=4, init=init, strength=0.0)
    assert torch.equal(out.samples, init) and out.nfe == 0


def test_strength_one_is_plain_sampling_from_the_same_noise():
    model, transport = sit_model(), Transport("linear")
    noise, labels = torch.randn(2, 4, 16, 16), torch.tensor([1, 2])
    plain = generate(model, transport, noise, labels, sampler="ode-heun", num_steps=6)
    init = upsample_latents(torch.randn(2, 4, 8, 8), (16, 16))
    full = generate(model, transport, noise, labels, sampler="ode-heun", num_steps=6, init=init, strength=1.0)
    assert torch.equal(full.samples, plain.samples) and full.nfe == plain.nfe


def test_renoise_closed_forms():
    init, noise = torch.randn(1, 4, 4, 4), torch.randn(1, 4, 4, 4)
    x, start, steps = renoise(Transport("linear"), init, noise, 0.25, 40)
    assert start == {"t_start": 0.75} and steps == 10
    assert torch.allclose(x, 0.75 * init + 0.25 * noise)
    d = GaussianDiffusion.from_schedule("linear", 1000)
    x, start, steps = renoise(d, init, noise, 0.5, 50)
    r = d.respace(50)
    assert start == {"first_step": 24} and steps == 50
    a = r.alphas_cumprod[24]
    assert torch.allclose(x, a.sqrt().float() * init + (1 - a).sqrt().float() * noise)


def test_upscaling_settings_errors():
    model = sit_model()
    s = SampleSettings("ode-euler", 2, latent_size=(8, 8), upscale_from=(16, 16))
    with pytest.raises(ValueError, match="--upscale-from must be smaller"):
        sample_batch(model, Transport("linear"), torch.tensor([1]), [0], 0, s, decode_output=False)
    s = SampleSettings("ode-euler", 2, latent_size=(16, 16), upscale_from=(8, 8), strength=1.5)
    with pytest.raises(ValueError, match="--strength must be in"):
        sample_batch(model, Transport("linear"), torch.tensor([1]), [0], 0, s, decode_output=False)


def test_upscaled_batch_runs_both_stages():
    model, transport = sit_model(), Transport("linear")
    s = SampleSettings("ode-euler", 4, latent_size=(16, 16), upscale_from=(8, 8), strength=0.5)
    out, nfe = sample_batch(model, transport, torch.tensor([1, 2]), [0, 1], 3, s, decode_output=False)
    assert out.shape == (2, 4, 16, 16) and nfe == 4 + 2
    # stage 2 starts from the upsampled stage-1 sample, re-noised with the index's own noise
    small = sample_batch(model, transport, torch.tensor([1, 2]), [0, 1], 3,
                         SampleSettings("ode-euler", 4), decode_output=False)[0]
    assert not torch.equal(small, initial_noise([0, 1], (4, 8, 8), 3))


def test_sized_settings_takes_plain_values_and_no_flags(capsys):
    """The model layer reads sizes as keywords and prints nothing (the CLIs turn their flags into them
    and print the size note: cli/sizes.py)."""
    import inspect
    from types import SimpleNamespace

    from nala_dit.guards import TooLargeError
    from nala_dit.models import grid
    from nala_dit.models.grid import STRENGTH, sized_settings

    source = SimpleNamespace(model=sit_model(), vae=None)           # TINY: 8-px latent, patch 2, 4 channels
    s = sized_settings(SampleSettings("ode-euler", 4), source, image_size="16x8", time_shift="auto")
    assert (s.latent_size, s.time_shift, s.upscale_from, s.strength) == ((16, 8), "auto", None, STRENGTH)
    s = sized_settings(SampleSettings("ode-euler", 4), source, image_size=16, upscale_from=8, strength=0.3,
                       time_shift=2)
    assert (s.latent_size, s.upscale_from, s.strength, s.time_shift) == ((16, 16), (8, 8), 0.3, 2.0)
    assert sized_settings(SampleSettings("ode-euler", 4), source).latent_size is None
    with pytest.raises(TooLargeError, match=r"^image size 99998: sampling 1 image\(s\) of 99998x99998 px"):
        sized_settings(SampleSettings("ode-euler", 4), source, image_size=99998)
    assert capsys.readouterr() == ("", "")
    assert not any(word in inspect.getsource(grid) for word in ("argparse", "args.", "sys.stderr", "print("))


# --------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("runs") / "dit")


@pytest.mark.parametrize("size, shape", [("16", (16, 16)), ("8x24", (8, 24))])
def test_checkpoint_samples_at_another_size(run_dir, tmp_path, capsys, size, shape):
    assert sample.main(["--ckpt", str(run_dir), "--labels", "1", "--sampler", "ddim", "--steps", "2",
                        "--image-size", size, "--out-dir", str(tmp_path)]) == 0
    assert np.asarray(Image.open(tmp_path / "000000_class1.png")).shape[:2] == shape
    assert "not the trained 8 px" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--image-size", "9"], "not a multiple of VAE factor 1 × patch 2"),
    (["--image-size", "0"], "--image-size: image size must be"),
    (["--image-size", "16", "--upscale-from", "32"], "--upscale-from must be smaller"),
    (["--upscale-from", "8"], "--upscale-from needs --image-size"),
    (["--time-shift", "-1"], "time shift must be"),
])
def test_bad_size_flags_are_one_line_errors(run_dir, tmp_path, capsys, flags, message):
    grid = tmp_path / "g.png"
    assert sample.main(["--ckpt", str(run_dir), "--labels", "1", "--sampler", "ddim", "--steps", "2",
                        *flags, "--grid", str(grid)]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not grid.exists()


def test_pipeline_height_width_follow_diffusers(run_dir):
    from nala_dit.pipelines.pipeline import pipeline_from_checkpoint

    pipe = pipeline_from_checkpoint(run_dir)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.vae_scale_factor == 1
    wide = pipe([1], num_inference_steps=2, sampler="ddim", generator=4, height=8, width=16, output_type="pt").images
    assert wide.shape == (1, 1, 8, 16)
    same = pipe([1], num_inference_steps=2, sampler="ddim", generator=4, output_type="pt").images
    default = pipe([1], num_inference_steps=2, sampler="ddim", generator=4, height=8, width=8, output_type="pt")
    assert torch.equal(same, default.images)                         # default: the trained size
    with pytest.raises(ValueError, match="not a multiple of VAE factor 1 × patch 2"):
        pipe([1], height=9)


def test_evaluate_gen_takes_the_size_flags(run_dir):
    import evaluate_fid

    args = evaluate_fid.build_parser().parse_args(
        ["gen", "--ckpt", str(run_dir), "--ref", "r.npz", "--num-samples", "2", "--image-size", "16x8",
         "--time-shift", "auto"])
    assert (args.image_size, args.time_shift) == ("16x8", "auto")


# ------------------------------------------------------- up the resolution ladder
def ladder_source(tmp_path, preset, name):
    """A trained-looking 8-px RGB run of ``preset`` (every tensor random), as train.py writes it."""
    from tests.training.test_convert import randomised
    from tests.training.test_convert import write_checkpoint as write_run

    model = randomised(preset, in_channels=3, num_classes=2)
    return write_run(tmp_path / name, model, preset, data="images", **{"image-size": 8})


def ladder_run(tmp_path, images, name, *extra):
    import train

    argv = ["--model", "NaLaDiT-T/2", "--data", str(images), "--image-size", "16", "--global-batch-size", "2",
            "--num-workers", "0", "--sample-every", "0", "--log-every", "1", "--flip", "false",
            "--results-dir", str(tmp_path), "--exp-name", name, *extra]
    assert train.main(argv) == 0
    return tmp_path / name


@pytest.mark.parametrize("preset, table", [("NaLaDiT-T/2", "inheritance (all)"),
                                           ("DiT-T/2", "inheritance (all-but-attention)")])
def test_fine_tune_up_copies_every_weight_and_recomputes_positions(tmp_path, capsys, preset, table):
    import json

    from nala_dit.training import checkpoint as ckpt_lib
    from tests.training.test_loop import make_image_folder

    images = make_image_folder(tmp_path / "images", per_class=2)
    source = ladder_source(tmp_path, preset, "base")
    run = ladder_run(tmp_path, images, "up", "--init-from", str(source), "--pos-embed", "interpolate",
                     "--lr", "0", "--max-steps", "1", "--ckpt-every", "1")
    out = capsys.readouterr().out
    assert_names(out, table, "model input (latent side): 8 → 16", "positions: interpolate", "base size 8",
                 "grid side 4 at patch 2")
    src = ckpt_lib.open_checkpoint(source).weights("ema")
    got = ckpt_lib.open_checkpoint(run).weights("ema")
    for key, value in got.items():
        if key == "pos_embed" or (".attn." in key and preset == "DiT-T/2"):
            continue
        assert torch.equal(value, src[key]), key                      # bitwise, lr 0
    # 8×8 tokens on the base 4×4 grid: positions i · 4/8 (PixArt), channel 0 = sin(col)
    cols = (torch.arange(64) % 8).double() * 0.5
    assert torch.allclose(got["pos_embed"][0, :, 0].double(), torch.sin(cols), atol=1e-6)
    record = json.loads((run / "init_from.json").read_text())
    assert (record["source_input_size"], record["input_size"], record["base_size"], record["base_grid_side"]) == (8, 16, 8, 4)
    assert ckpt_lib.open_checkpoint(run).model_config["base_size"] == 8


def test_resume_of_a_resized_run_is_bitwise(tmp_path):
    from nala_dit.training import checkpoint as ckpt_lib
    from tests.training.test_loop import make_image_folder

    images = make_image_folder(tmp_path / "images", per_class=2)
    source = ladder_source(tmp_path, "NaLaDiT-T/2", "base")
    common = ("--init-from", str(source), "--pos-embed", "interpolate", "--time-shift", "auto")
    straight = ladder_run(tmp_path, images, "straight", *common, "--max-steps", "4", "--ckpt-every", "4")
    ladder_run(tmp_path, images, "resumed", *common, "--max-steps", "2", "--ckpt-every", "2")
    resumed = ladder_run(tmp_path, images, "resumed", *common, "--max-steps", "4", "--ckpt-every", "4",
                         "--resume", "auto")
    a, b = ckpt_lib.open_checkpoint(straight), ckpt_lib.open_checkpoint(resumed)
    assert a.step == b.step == 4 and a.model_config["base_size"] == b.model_config["base_size"] == 8
    for which in ("model", "ema"):
        wa, wb = a.weights(which), b.weights(which)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), which


def test_mass_sampling_at_a_size_records_it_and_refuses_another(run_dir, tmp_path, capsys):
    import json

    common = ["--ckpt", str(run_dir), "--num-samples", "4", "--sampler", "ddim", "--steps", "2", "--batch-size", "2",
              "--shard-size", "2", "--out", str(tmp_path / "s.npz")]
    assert sample.main([*common, "--image-size", "16x8", "--stop-after", "1"]) == 0
    stored = json.loads((tmp_path / "s.npz.parts" / "settings.json").read_text())
    assert stored["latent_size"] == [16, 8]
    assert sample.main([*common, "--image-size", "16"]) == 1                 # other shards' size: refused
    assert "other settings" in capsys.readouterr().err
    assert sample.main([*common, "--image-size", "16x8"]) == 0               # the same size finishes the job
    assert np.load(tmp_path / "s.npz")["arr_0"].shape == (4, 16, 8, 1)


def test_rope_follows_the_position_policy():
    from nala_dit.attention.functional import rope_angles

    base = rope_angles((4, 4), 8)
    assert torch.equal(rope_angles(TokenGrid(4, 4, 4, 4, "extrapolate"), 8), base)
    big = rope_angles(TokenGrid(8, 8, 4, 4, "interpolate"), 8).reshape(8, 8, 4)
    assert torch.equal(big[::2, ::2].reshape(16, 4), base)              # positions i · 4/8: even ones on the base
    assert torch.equal(rope_angles(TokenGrid(8, 8, 8, 8, "extrapolate"), 8), rope_angles((8, 8), 8))
    assert not rope_angles(TokenGrid(6, 6, 4, 4, "none"), 8).any()       # no rotation
    # a RoPE model runs at another size under each policy, and interpolate at the base size is extrapolate
    x, t, y = torch.randn(1, 4, 8, 8), torch.tensor([5.0]), torch.tensor([1])
    a, b = perturbed(attention="nala", rope=True), perturbed(attention="nala", rope=True, positions="interpolate")
    assert torch.equal(a(x, t, y), b(x, t, y))
    assert b(torch.randn(1, 4, 16, 12), t, y).shape == (1, 8, 16, 12)


def test_a_state_dict_of_another_size_loads_strictly_and_keeps_the_positions():
    small, big = perturbed(), DiT(**{**TINY, "input_size": 16})
    own = big.pos_embed.clone()
    big.load_state_dict(small.state_dict(), strict=True)        # 4×4-token table into an 8×8-token model
    assert torch.equal(big.pos_embed, own)
    assert all(torch.equal(v, small.state_dict()[k]) for k, v in big.state_dict().items() if k != "pos_embed")


def test_train_image_size_malformed_says_the_format(capsys):
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--image-size", "16x"])
    err = capsys.readouterr().err
    assert_names(err, "--image-size expects an integer", "e.g. 256", "got '16x'")
    assert "<lambda>" not in err
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--lr", "fast"])
    assert "--lr expects a number, got 'fast'" in capsys.readouterr().err


def test_non_square_size_suggests_non_square_sizes():
    from nala_dit.models.grid import latent_size

    with pytest.raises(ValueError) as err:
        latent_size("8x15", 1, 2)
    assert_names(one_line(err), "image size 8x15", "VAE factor 1 × patch 2 = 2", "on each side")
    assert str(err.value).endswith("choose e.g. 8x14, 8x16"), err.value
    with pytest.raises(ValueError, match=r"choose e.g. 256x256, 240x256, 256x272, 240x272$"):
        latent_size("250x260", 8, 2)
    with pytest.raises(ValueError, match=r"choose e.g. 16, 32, 48$"):  # square: as before
        latent_size(15, 8, 2)


def test_train_image_size_not_patching_evenly_is_in_pixels(tmp_path, capsys):
    from types import SimpleNamespace

    import train as train_cli
    from nala_dit.training.build import model_space
    from tests.training.test_loop import make_image_folder
    from tests.utils import TINY_RUN

    from tests.models.test_vae import tiny_vae

    sd_like_vae = tiny_vae()   # 4 levels (factor 8) and 4 latent channels, as the SD VAE
    with pytest.raises(ValueError) as err:
        model_space(SimpleNamespace(image_size=15, channels=3), sd_like_vae, 2)
    assert_names(one_line(err), "--image-size", "image size 15", "VAE factor 8 × patch 2 = 16")
    assert str(err.value).endswith("choose e.g. 16, 32, 48"), err.value
    assert model_space(SimpleNamespace(image_size=32, channels=3), sd_like_vae, 2) == (4, 4)
    images = make_image_folder(tmp_path / "images", per_class=1)
    assert train_cli.main(TINY_RUN + ["--data", str(images), "--image-size", "15", "--max-steps", "1",
                                      "--results-dir", str(tmp_path), "--exp-name", "odd"]) == 1
    err = capsys.readouterr().err
    assert_names(err, "error: --image-size", "image size 15", "VAE factor 1 × patch 2 = 2")
    assert "input_size" not in err
