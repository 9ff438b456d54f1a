"""The diffusers pipelines: save → load round trips, diffusers' DiTPipeline, bad input.

Models are tiny (depth 4, width 128, 8×8 inputs) with randomised weights, so images are
not all zero (DiT's zero init makes an untrained model output exactly 0).
"""

import ast

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, DDIMScheduler
from safetensors.torch import load_file, save_file

import nala_dit  # noqa: F401  (diffusers resolves nala_dit.models.dit.DiT through sys.modules)  # noqa: F401  (teaches diffusers our pipeline names)
from nala_dit.models.dit import create_model
from nala_dit.pipelines.pipeline import (
    CUSTOM_PIPELINES,
    DiTPipelineTransformer,
    NaLaDiTPipeline,
    NaLaSiTPipeline,
    diffusers_dit_pipeline,
    load_pipeline,
    pipeline_for,
)
from tests.utils import assert_names, one_line

NAMES = {i: name for i, name in enumerate(["tench, Tinca tinca", "golden retriever", "tabby cat"])}


def randomised(model, seed=0, std=0.05):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def tiny(name, **overrides):
    kw = dict(input_size=8, in_channels=1, num_classes=3)
    return randomised(create_model(name, **{**kw, **overrides}))


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    """The ≈67k-parameter offline VAE (true 8× downsampling), saved once."""
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8, 8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=8,
                        latent_channels=4, sample_size=64)
    path = tmp_path_factory.mktemp("vae") / "tiny-vae"
    vae.save_pretrained(path)
    return path


def quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, **kw):
    kw = {"class_labels": [1, "tabby_cat", 0], "num_inference_steps": 2, "generator": 7, "output_type": "np", **kw}
    return quiet(pipe)(**kw).images


@pytest.mark.parametrize("name,sampler", [("NaLaDiT-T/2", "ddim"), ("NaLaSiT-T/2", "ode-euler")])
def test_round_trip_pixel_space(tmp_path, name, sampler):
    pipe = pipeline_for(tiny(name), id2label=NAMES)
    before = run(pipe, sampler=sampler, guidance_scale=2.0)
    assert before.shape == (3, 8, 8, 1) and before.std() > 0
    pipe.save_pretrained(tmp_path)
    loaded = load_pipeline(tmp_path)
    assert type(loaded) is type(pipe)
    assert loaded.vae is None and loaded.id2label == NAMES and loaded.config.null_class_id == 3
    assert not any(p.device.type == "meta" for p in loaded.transformer.parameters())
    np.testing.assert_array_equal(run(loaded, sampler=sampler, guidance_scale=2.0), before)
    # The class's own from_pretrained works too, and a torch.Generator seeds like diffusers.
    again = quiet(type(pipe).from_pretrained(tmp_path))
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a = again([2, 2], sampler=sampler, num_inference_steps=2, generator=g(), output_type="pil").images
    b = quiet(pipe)([2, 2], sampler=sampler, num_inference_steps=2, generator=g(), output_type="pil").images
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


def test_round_trip_latent_with_tiny_vae(tmp_path, tiny_vae):
    """DiT with the VAE copied into the folder, SiT with the VAE stored by reference."""
    from nala_dit.models.vae import load_vae

    vae, scaling = load_vae(str(tiny_vae))
    dit = NaLaDiTPipeline.from_model(tiny("NaLaDiT-T/2", in_channels=4), vae=vae, id2label=NAMES,
                                     scaling_factor=scaling)
    sit = NaLaSiTPipeline.from_model(tiny("NaLaSiT-T/2", in_channels=4), id2label=NAMES, vae_path=str(tiny_vae))
    for pipe, sampler, copied in ((dit, "dpm-solver", True), (sit, "sde-euler", False)):
        before = run(pipe, sampler=sampler, guidance_scale=1.5, num_inference_steps=2)
        assert before.shape == (3, 64, 64, 3)
        pipe.save_pretrained(tmp_path / sampler)
        assert (tmp_path / sampler / "vae").is_dir() == copied
        after = run(load_pipeline(tmp_path / sampler), sampler=sampler, guidance_scale=1.5, num_inference_steps=2)
        np.testing.assert_array_equal(after, before)


def test_scheduler_sampler_runs_the_pipelines_diffusers_scheduler():
    from diffusers import DPMSolverMultistepScheduler

    from nala_dit.diffusion.gaussian import GaussianDiffusion
    from nala_dit.diffusion.generate import initial_noise

    # A fresh model predicts exactly 0 (adaLN-Zero): the scheduler must end at x_T / √ᾱ_999,
    # x_T the noise of seed 7, whatever the step count (3 does not divide 1000) and guidance.
    fresh = pipeline_for(create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=3).eval(),
                         id2label=NAMES)
    got = run(fresh, sampler="scheduler", output_type="latent", num_inference_steps=3, guidance_scale=3.0)
    noise = initial_noise(range(3), (1, 8, 8), 7)
    want = noise.double() / GaussianDiffusion.from_schedule("linear", 1000).alphas_cumprod[-1] ** 0.5
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)   # diffusers keeps ᾱ in fp32

    pipe = pipeline_for(tiny("NaLaDiT-T/2"), id2label=NAMES)
    out = run(pipe, sampler="scheduler", output_type="latent")
    assert out.shape == (3, 1, 8, 8) and torch.isfinite(out).all()
    torch.testing.assert_close(run(pipe, sampler="scheduler", output_type="latent"), out, rtol=0, atol=0)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    assert not torch.equal(run(pipe, sampler="scheduler", output_type="latent"), out)


def test_our_dit_inside_diffusers_dit_pipeline(tiny_vae, tmp_path):
    from diffusers import DiTPipeline

    from nala_dit.models.vae import load_vae

    model = tiny("NaLaDiT-T/4", in_channels=4, num_classes=1000)
    vae, _ = load_vae(str(tiny_vae))
    pipe = quiet(diffusers_dit_pipeline(model, vae, scheduler=DDIMScheduler(timestep_spacing="trailing")))
    assert isinstance(pipe, DiTPipeline)
    images = pipe([1, 999], num_inference_steps=2, guidance_scale=1.5, output_type="np",
                  generator=torch.manual_seed(0)).images
    assert images.shape == (2, 64, 64, 3) and np.isfinite(images).all()
    # It saves and loads as diffusers' own pipeline (the adapter lives in nala_dit.pipelines.pipeline).
    pipe.save_pretrained(tmp_path)
    loaded = quiet(DiTPipeline.from_pretrained(tmp_path))
    assert isinstance(loaded.transformer, DiTPipelineTransformer)
    again = loaded([1, 999], num_inference_steps=2, guidance_scale=1.5, output_type="np",
                   generator=torch.manual_seed(0)).images
    np.testing.assert_array_equal(again, images)
    # The adapter is the same function as the model.
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.tensor([3, 1000])
    torch.testing.assert_close(pipe.transformer(x, timestep=t, class_labels=y).sample, model(x, t, y))
    with pytest.raises(ValueError, match="null class as 1000"):
        DiTPipelineTransformer.from_dit(tiny("NaLaDiT-T/4", in_channels=4, num_classes=10))
    # DiTPipeline decodes latents / scaling_factor only: other latent statistics are refused, not decoded wrongly.
    from nala_dit.data.latent_stats import LatentNorm
    same = LatentNorm.scalar(vae.config.scaling_factor)
    assert isinstance(diffusers_dit_pipeline(model, vae, latent_norm=same), DiTPipeline)
    for other in (LatentNorm.channel([0.1, 0, 0, 0], [1.1, 1, 1, 1]), LatentNorm.scalar(0.5)):
        with pytest.raises(ValueError, match="use NaLaDiTPipeline"):
            diffusers_dit_pipeline(model, vae, latent_norm=other)


@pytest.mark.slow
def test_diffusers_generic_loader_round_trip(tmp_path, monkeypatch):
    """DiffusionPipeline.from_pretrained gives back our pipeline and its exact images: after
    `nala_dit.register_with_diffusers()` and through custom_pipeline= (diffusers' door). Fresh
    processes with and without registering are test_register.py's
    test_a_folder_loads_generically_after_registering_and_our_routes_without, pixels included."""
    import diffusers.utils.dynamic_modules_utils as dynamic
    from diffusers import DiffusionPipeline

    import nala_dit
    from nala_dit.pipelines.pipeline import CUSTOM_PIPELINES

    nala_dit.register_with_diffusers()

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # not the user's cache
    expected = {}
    for name, sampler in [("NaLaDiT-T/2", "ddim"), ("NaLaSiT-T/2", "ode-euler")]:
        pipe = pipeline_for(tiny(name), id2label=NAMES, sampler=sampler)
        folder = tmp_path / name.replace("/", "-")
        pipe.save_pretrained(folder)
        expected[type(pipe)] = run(pipe)
        generic = DiffusionPipeline.from_pretrained(folder)
        assert type(generic) is type(pipe)
        np.testing.assert_array_equal(run(generic), expected[type(pipe)])
        custom = DiffusionPipeline.from_pretrained(folder, custom_pipeline=CUSTOM_PIPELINES[type(pipe).__name__],
                                                   trust_remote_code=True)
        assert type(custom) is type(pipe)
        np.testing.assert_array_equal(run(custom), expected[type(pipe)])


def test_missing_weights_are_an_error_not_meta(tmp_path):
    pipe = pipeline_for(tiny("NaLaDiT-T/2"), id2label=NAMES)
    pipe.save_pretrained(tmp_path)
    weights = tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    state.pop("final_layer.linear.weight")
    save_file(state, str(weights))
    # refused from the weights file's header, before diffusers would leave the tensor on meta
    with pytest.raises(ValueError, match=r"holds 1,\d{3},\d{3} \(1.4 M\)") as err:
        load_pipeline(tmp_path)
    assert_names(err, "1 missing", "final_layer.linear.weight")


def test_bad_input_is_named():
    dit = pipeline_for(tiny("NaLaDiT-T/2"), id2label=NAMES)
    with pytest.raises(ValueError, match="for transport"):
        run(dit, sampler="ode-heun")
    with pytest.raises(ValueError) as err:
        run(dit, class_labels=["golden retrever"])
    assert_names(err, "unknown class name", "'golden retrever'", "did you mean golden retriever")
    with pytest.raises(ValueError, match="out of range"):
        run(dit, class_labels=[3])
    with pytest.raises(ValueError, match="null class"):
        run(pipeline_for(tiny("NaLaSiT-T/2", class_dropout_prob=0.0), id2label=NAMES), guidance_scale=2.0)
    with pytest.raises(ValueError, match="use NaLaSiTPipeline"):
        NaLaDiTPipeline(tiny("NaLaSiT-T/2"))
    with pytest.raises(ValueError, match="id2label has 2 names"):
        NaLaSiTPipeline(tiny("NaLaSiT-T/2"), id2label={0: "a", 1: "b"})


@pytest.mark.parametrize("name,sampler", [("NaLaDiT-T/2", "ddim"), ("NaLaSiT-T/2", "ode-euler")])
def test_diffusers_bf16_idioms_run_as_precision_bf16(tmp_path, name, sampler):
    """``torch_dtype=torch.bfloat16`` / ``dtype=`` / ``pipe.to(torch.bfloat16)``
    give bf16 weights, which run under bf16 autocast (NaLa's features and state stay fp32,
    the sampler's arithmetic too) like ``precision="bf16"`` with fp32 weights.

    Tolerance, justified: matmuls and convolutions see the same bf16-rounded weights either
    way; what differs is where values are rounded to bf16 besides: with bf16 weights the
    residual stream (and the embeddings, position table, norm weights) is bf16, under autocast
    it stays fp32. The stream is rounded once per residual add, 2 per block, plus the patch
    embedding and the final layer: 2·depth + 2 roundings of at most bf16's unit roundoff
    2**-9, relative to the output's scale (depth 4: 1.95e-2). Measured over 4 random models
    and 1 or 4 steps: 1.5e-3 to 5.3e-3, 2-3x the fp32 run's own distance from precision="bf16"
    (which is > 1e-4: the comparison is not vacuous)."""
    from diffusers import DiffusionPipeline

    from nala_dit import register_with_diffusers

    register_with_diffusers()

    torch.manual_seed(0)
    model = tiny(name)
    bound = (2 * len(model.blocks) + 2) * 2 ** -9
    pipe = pipeline_for(model, id2label=NAMES)
    pipe.save_pretrained(tmp_path)
    kw = dict(sampler=sampler, num_inference_steps=4, output_type="latent")
    fp32 = run(pipe, **kw)
    ref = run(pipe, precision="bf16", **kw)
    scale = ref.abs().max()
    assert (fp32 - ref).abs().max() > 1e-4 * scale
    loaded = [DiffusionPipeline.from_pretrained(tmp_path, torch_dtype=torch.bfloat16),
              DiffusionPipeline.from_pretrained(tmp_path, dtype=torch.bfloat16), pipe.to(torch.bfloat16)]
    for bf16 in loaded:
        assert bf16.transformer.dtype == torch.bfloat16 and type(bf16) is type(pipe)
        out = run(bf16, **kw)
        assert out.dtype == torch.float32
        assert (out - ref).abs().max() <= bound * scale, ((out - ref).abs().max(), scale)
        torch.testing.assert_close(run(bf16, precision="bf16", **kw), out, rtol=0, atol=0)  # the default is bf16
        assert run(bf16, sampler=sampler, num_inference_steps=2, output_type="np").shape == (3, 8, 8, 1)
    with pytest.raises(ValueError) as err:
        run(pipe, precision="fp32", **kw)
    assert_names(err, "precision='fp32'", "float32 weights", "bfloat16", "pipe.to(torch.float32)", "precision='bf16'")
    assert run(pipe.to(torch.float32), **kw).dtype == torch.float32  # fp32 weights again (bf16-rounded): fp32 runs
    with pytest.raises(ValueError) as err:
        run(pipe.to(torch.float16), **kw)
    assert_names(err, "torch.float16 weights", "float32 or bfloat16", "dtype=torch.bfloat16", "pipe.to(torch.bfloat16)")


def test_pipeline_guidance_scale_is_checked(pipe_dir):
    from nala_dit.pipelines.pipeline import load_pipeline

    pipe = load_pipeline(pipe_dir)
    pipe.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError) as err:
        pipe([1], guidance_scale=float("nan"), sampler="ddim", num_inference_steps=2)
    assert_names(err, "guidance scale", "from 0 (unconditional) to 100", "nan")


def test_pipeline_height_width_are_checked(pipe_dir):
    from nala_dit.pipelines.pipeline import load_pipeline

    pipe = load_pipeline(pipe_dir)
    for kwargs in (dict(height=0), dict(width=0), dict(height=-8), dict(height=8.0)):
        with pytest.raises(ValueError, match="must be a positive number of pixels"):
            pipe([1], sampler="ddim", num_inference_steps=2, **kwargs)
    with pytest.raises(MemoryError) as err:
        pipe([1], sampler="ddim", num_inference_steps=2, height=99998, width=99998)
    assert_names(err, "height=99998, width=99998", "sampling 1 image", "use a smaller height/width")


def test_the_shipped_custom_pipeline_file_is_only_a_docstring_and_the_import(pipe_folder):
    for cls, module in CUSTOM_PIPELINES.items():
        source = (pipe_folder / f"{module}.py") if cls == "NaLaDiTPipeline" else None
        if source is None:
            folder = pipe_folder.parent / "sit"
            if not folder.exists():
                pipeline_for(tiny("NaLaSiT-T/2"), id2label=NAMES).save_pretrained(folder)
            source = folder / f"{module}.py"
        tree = ast.parse(source.read_text())
        assert len(tree.body) == 2, ast.dump(tree)
        doc, imp = tree.body
        assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
        assert isinstance(imp, ast.ImportFrom) and imp.module == "nala_dit" and imp.level == 0
        assert [(a.name, a.asname) for a in imp.names] == [(cls, None)]
        # the docstring points to the route that runs no file of the folder
        assert "import nala_dit" in doc.value.value and "without running" in doc.value.value


# --- item 15: diffusers idioms ------------------------------------------------------------
def test_a_list_of_generators_gives_image_i_the_single_call_of_generator_i():
    pipe = pipeline_for(tiny("NaLaDiT-T/2"), id2label=NAMES)            # ddpm: stochastic inside the loop too
    labels, seeds = [1, 2, 0], [3, 4, 5]
    together = run(pipe, class_labels=labels, sampler="ddpm",
                   generator=[torch.Generator().manual_seed(s) for s in seeds])
    for i, (label, seed) in enumerate(zip(labels, seeds)):
        alone = run(pipe, class_labels=[label], sampler="ddpm", generator=torch.Generator().manual_seed(seed))
        np.testing.assert_array_equal(together[i], alone[0])
    # a list of int seeds follows the same rule
    ints = run(pipe, class_labels=labels, sampler="ddpm", generator=[7, 8, 9])
    np.testing.assert_array_equal(ints[1], run(pipe, class_labels=[2], sampler="ddpm", generator=8)[0])
    with pytest.raises(ValueError) as err:
        run(pipe, class_labels=labels, generator=[torch.Generator().manual_seed(0)] * 2)
    assert "2 generators" in one_line(err) and "3 images" in one_line(err)


def test_guidance_default_is_sample_py_and_the_docstring_says_why():
    import inspect

    import sample

    default = inspect.signature(NaLaDiTPipeline.__call__).parameters["guidance_scale"].default
    assert default == 1.0 == sample.build_parser().parse_args(["--ckpt", "x"]).cfg_scale
    doc = NaLaDiTPipeline.__call__.__doc__
    assert "DiTPipeline" in doc and "4.0" in doc and "sample.py" in doc
