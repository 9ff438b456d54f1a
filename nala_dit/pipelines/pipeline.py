"""diffusers pipelines for our models, and an adapter for diffusers' own ``DiTPipeline``.

    import torch, nala_dit
    from nala_dit.pipelines.pipeline import NaLaDiTPipeline
    pipe = NaLaDiTPipeline.from_pretrained("exported/nala-dit-s2")       # offline, local folder
    images = pipe(["golden retriever", 207], guidance_scale=1.5,
                  generator=torch.Generator().manual_seed(0)).images       # PIL images

* ``NaLaDiTPipeline`` (diffusion models): components ``transformer`` (our ``DiT``),
  ``scheduler`` (a diffusers ``DDIMScheduler`` with the training β schedule; it is what
  ``sampler="scheduler"`` runs, so swapping in e.g. ``DPMSolverMultistepScheduler`` works)
  and ``vae`` (None in pixel space). The named samplers (``ddpm``, ``ddim``,
  ``dpm-solver``) are the project's own (``nala_dit.diffusion.generate``).
* ``NaLaSiTPipeline`` (transport models): components ``transformer`` and ``vae``. There
  is no scheduler component: SiT's ODE/SDE samplers are not diffusers schedulers, so the
  sampler name, its step count and the transport settings (path, prediction, eps) live
  in the pipeline config.

Both record ``id2label``, the null class id, the objective settings, the VAE scaling
factor, the latent normalisation (``latent_norm``: the factor or per-channel mean and std
the transformer was trained with, ``nala_dit/data/latent_stats.py``; decoding undoes exactly it)
and where the weights came from with ``register_to_config``, so they survive
``save_pretrained``. A VAE can also be stored by reference (``vae_path``; loaded on first
use) instead of copied. Images come from ``nala_dit.diffusion.generate.sample_batch``, exactly as
``sample.py`` makes them: the same seed and settings give the same pixels.

Threads: a pipeline uses its process's torch threads. ``import nala_dit`` before torch sets
``OMP_WAIT_POLICY=PASSIVE`` (unless set), as every CLI of this repository does: with OpenMP's
default, idle threads spin, and beside other busy processes a step can take tens of times
longer (docs/performance.md, "Threads"). Imported after torch it is too late, and the first
call warns once with the fix (``warn_spinning_threads``).

diffusers resolves our components by module path (``nala_dit.models.dit.DiT``), which works
once ``nala_dit`` is imported, because each such module binds ``ModelMixin``.

``DiTPipelineTransformer`` wraps our DiT so that diffusers' ``DiTPipeline`` can drive it
(``config.sample_size``/``in_channels``/``out_channels`` and ``forward(x, timestep=,
class_labels=)`` returning ``.sample``). ``DiTPipeline`` hard-codes the null class 1000,
so only 1000-class models qualify.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, ImagePipelineOutput
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (diffusers finds our classes through it)

from ..checkpoints.read import build_objective
from ..data.datasets import to_uint8
from ..models.vae import load_vae
from ..diffusion.generate import (SampleSettings, _Precision, chain_length, decode, default_sampler, generate, index_seed,
                                  initial_noise, sample_batch, seed_from)
from ..diffusion.choices import check_steps
from ..models.grid import latent_for, parse_time_shift, vae_factor
from ..guards import check_finite_samples, check_sample_memory, refuse_non_finite
from ..data.latent_stats import LatentNorm
from ..models.compile import compile_model
from ..models.dit import DiT, config_keys
from .sources import (assert_no_meta, check_id2label, check_pipeline_folder, read_pipeline_index, resolve_labels,
                      resolve_scaling_factor)
from ..models.vae import check_tiling

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
_warned_threads = False


def warn_spinning_threads(device) -> None:
    """Once per process: a warning naming the fix when this process's CPU threads spin.
    ``import nala_dit`` before torch sets ``OMP_WAIT_POLICY=PASSIVE`` (``nala_dit/__init__.py``);
    unset now means torch loaded first, so OpenMP's default applies: idle threads spin at
    every op's barrier, and beside other busy processes a call can take many times longer
    (docs/performance.md, "Threads"). Not with one thread, on a GPU, or a policy the user chose."""
    global _warned_threads
    if _warned_threads or torch.device(device).type != "cpu" or "OMP_WAIT_POLICY" in os.environ:
        return
    if torch.get_num_threads() <= 1:
        return
    _warned_threads = True
    import warnings

    warnings.warn(f"torch was imported before nala_dit with OMP_WAIT_POLICY unset: its {torch.get_num_threads()} CPU "
                  f"threads spin while they wait, which can make sampling many times slower on a busy machine. Import "
                  f"nala_dit before torch, or start Python with OMP_WAIT_POLICY=PASSIVE, or call "
                  f"torch.set_num_threads(1) (docs/performance.md, Threads)", RuntimeWarning, stacklevel=3)
# Every saved folder holds <custom pipeline>.py: a docstring and one import of the pipeline
# class from this installed package, nothing else (tests/pipelines/test_pipeline.py), for
# diffusers' documented door for pipelines outside diffusers. No route of this package
# runs it: `nala_dit.register_with_diffusers()` lets DiffusionPipeline.from_pretrained(folder)
# find the class by name; only custom_pipeline= with trust_remote_code=True executes the file, whatever
# it then holds. One name per class: diffusers caches local custom pipelines by file name,
# so two classes behind one name would collide in a process that loads both.
CUSTOM_PIPELINES = {"NaLaDiTPipeline": "nala_dit_pipeline", "NaLaSiTPipeline": "nala_sit_pipeline"}
CUSTOM_PIPELINE_SOURCE = '''"""Names this folder's pipeline class for diffusers. Not needed where nala_dit is installed:

    import nala_dit
    nala_dit.register_with_diffusers()
    DiffusionPipeline.from_pretrained(folder)      # or {name}.from_pretrained(folder)

loads this folder without running any file in it. Only

    DiffusionPipeline.from_pretrained(folder, custom_pipeline="{module}", trust_remote_code=True)

runs this file: it must hold nothing but this docstring and the import below (of the
installed nala_dit package); a folder from elsewhere may hold anything here.
"""

from nala_dit import {name}  # noqa: F401
'''


class _NaLaPipeline(DiffusionPipeline):
    """What both pipelines share: settings, label lookup, VAE resolution, ``__call__``."""

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["vae", "scheduler"]
    _objective = "diffusion"

    def _register_settings(self, transformer, id2label, objective_config, scaling_factor, vae_path, sampler,
                           num_inference_steps, source, latent_norm=None):
        if transformer.config.objective != self._objective:
            other = "NaLaSiTPipeline" if transformer.config.objective == "transport" else "NaLaDiTPipeline"
            raise ValueError(f"{type(self).__name__} needs a {self._objective} model, but this transformer is a "
                             f"{transformer.config.objective} model: use {other}")
        # Checked here, not in from_pretrained, so that diffusers' generic
        # DiffusionPipeline.from_pretrained (which builds us through __init__) checks too.
        assert_no_meta(transformer, "transformer")
        refuse_non_finite(transformer, "transformer")
        if getattr(self, "vae", None) is not None:
            assert_no_meta(self.vae, "vae")
            refuse_non_finite(self.vae, "vae")
        num_classes = transformer.config.num_classes
        id2label = check_id2label(id2label, num_classes)
        self._vae_cache = None
        # JSON turns int keys into strings; store them as strings from the start.
        self.register_to_config(
            id2label={str(k): v for k, v in sorted(id2label.items())},
            null_class_id=transformer.null_label,
            objective_config=dict(objective_config or {}),
            scaling_factor=scaling_factor,
            vae_path=vae_path,
            sampler=sampler,
            num_inference_steps=num_inference_steps,
            source=dict(source or {}),
            latent_norm=None if latent_norm is None else LatentNorm.from_dict(dict(latent_norm)).to_dict(),
        )
        self.objective()  # fail now, not at the first call, on bad objective settings
        if sampler not in (None, "scheduler"):
            SampleSettings(sampler).resolved(self.objective())
            if num_inference_steps is not None:   # a stored count: bounded as every caller's (check_steps)
                check_steps(sampler, num_inference_steps, chain_length(self.objective()), "num_inference_steps")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """diffusers' ``from_pretrained``, after ``sources.check_pipeline_folder``: a local
        folder's JSON files read with the guarded reader and its transformer config checked
        against its weights (types, sizes), so an edited config is refused in one line
        before diffusers builds the model it describes."""
        check_pipeline_folder(pretrained_model_name_or_path, kwargs.get("subfolder"))
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def save_pretrained(self, save_directory, *, card_folder: str | None = None, **kwargs):
        """diffusers' save, plus the one-line file that names this class for
        ``DiffusionPipeline.from_pretrained(folder, custom_pipeline="nala_dit_pipeline")`` and
        the model card ``README.md`` (``card.py``: what the weights' run recorded; a README.md
        already in the folder is kept). ``card_folder``: the folder the card's commands name
        (default ``save_directory``; ``export.py`` saves under a temporary name first)."""
        from .card import pipeline_card, save_card

        super().save_pretrained(save_directory, **kwargs)
        module = CUSTOM_PIPELINES[type(self).__name__]
        shim = Path(save_directory) / f"{module}.py"
        shim.write_text(CUSTOM_PIPELINE_SOURCE.format(name=type(self).__name__, module=module))
        if not (Path(save_directory) / "README.md").exists():
            card, grid = pipeline_card(self, str(card_folder or save_directory))
            save_card(save_directory, card, grid)

    @property
    def id2label(self) -> dict[int, str]:
        return {int(k): v for k, v in self.config.id2label.items()}

    @property
    def labels(self) -> dict[str, int]:
        """Class name → id (as ``DiTPipeline.labels``)."""
        return {v: k for k, v in self.id2label.items()}

    def get_label_ids(self, labels) -> list[int]:
        """Ids for ids or class names (``"golden retriever"``, ``"golden_retriever"``)."""
        return resolve_labels(labels, self.id2label, self.transformer.config.num_classes)

    def objective(self):
        """The ``GaussianDiffusion`` or ``Transport`` the transformer was trained with."""
        return build_objective(dict(self.transformer.config), dict(self.config.objective_config or {}))

    @property
    def scaling_factor(self) -> float:
        return resolve_scaling_factor(self.config.scaling_factor, self.vae if self.vae is not None else self._vae_cache)

    @property
    def latent_norm(self) -> LatentNorm:
        """Model space ↔ VAE latents as the transformer was trained: the recorded per-channel
        statistics or factor, else the scalar ``scaling_factor`` (``output_type="latent"``
        returns model space: ``pipe.latent_norm.denormalize(latents)`` gives the VAE's)."""
        stored = getattr(self.config, "latent_norm", None)
        return LatentNorm.from_dict(stored) if stored is not None else LatentNorm.scalar(self.scaling_factor)

    def resolved_vae(self, device=None):
        """The VAE component, else the referenced one (``vae_path``, loaded once), else None."""
        if self.vae is not None:
            return self.vae
        if self._vae_cache is None and self.config.vae_path:
            self._vae_cache, _ = load_vae(self.config.vae_path, device or self.transformer.device)
        return self._vae_cache

    def vae_override(self, path: str) -> None:
        """Use the VAE at ``path`` instead of the stored one (e.g. a local copy offline); one of
        other latent channels than the transformer's is one line (``tokenizer.check_fits``)."""
        from ..models.tokenizer import check_fits

        vae, _ = load_vae(path, self.transformer.device)
        check_fits(vae, self.transformer.config.in_channels, path)
        self._vae_cache = vae
        self.register_modules(vae=None)

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent side (diffusers' name): 8 for the SD VAE, 1 in pixel space."""
        return vae_factor(self.resolved_vae())

    def latent_size(self, height: int | None, width: int | None) -> tuple[int, int] | None:
        """The latent (h, w) for an image size in pixels; None = the trained size."""
        if height is None and width is None:
            return None
        for name, value in (("height", height), ("width", width)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive number of pixels (None = the trained size), "
                                 f"got {value!r}")
        side = self.transformer.config.input_size * self.vae_scale_factor
        return latent_for(self.transformer, self.resolved_vae(),
                          (side if height is None else height, side if width is None else width))

    def precision_for(self, precision: str | None) -> str:
        """``precision`` checked against the transformer's weights: None = its dtype's
        ("fp32" for float32 weights, "bf16" for bfloat16 ones, as diffusers' ``dtype=``
        (formerly ``torch_dtype``) / ``pipe.to(dtype)`` leave them); fp32 needs fp32 weights."""
        dtype = self.transformer.dtype
        if dtype == torch.float32:
            return "fp32" if precision is None else precision
        if dtype == torch.bfloat16 and precision != "fp32":
            return "bf16" if precision is None else precision   # another name: _Precision's error
        if dtype == torch.bfloat16:
            raise ValueError(f"precision={precision!r} needs float32 weights, but the transformer holds bfloat16 "
                             f"ones (dtype= or pipe.to(torch.bfloat16)): pipe.to(torch.float32) first, "
                             f"or precision='bf16'")
        raise ValueError(f"the transformer holds {dtype} weights; these pipelines run float32 or bfloat16 weights "
                         f"(bf16 autocast; NaLa's state stays fp32): load with dtype=torch.bfloat16 or call "
                         f"pipe.to(torch.bfloat16)")

    def compile(self, mode: str = "default") -> "_NaLaPipeline":
        """``torch.compile`` the transformer in place (``nala_dit.models.compile``, as
        ``sample.py --compile``); ``mode="reduce-overhead"``: CUDA graphs (``--cuda-graphs``),
        one capture per batch shape. Returns the pipeline."""
        compile_model(self.transformer, mode)
        return self

    def _latents(self, labels, indices, seed, settings, progress):
        return sample_batch(self.transformer, self.objective(), labels, indices, seed, settings,
                            progress=progress, decode_output=False)

    @torch.no_grad()
    def __call__(
        self,
        class_labels,
        num_inference_steps: int | None = None,
        guidance_scale: float = 1.0,
        generator: torch.Generator | int | list | None = None,
        output_type: str = "pil",
        sampler: str | None = None,
        guidance_interval: tuple[float, float] | None = None,
        guide_channels: int | None = None,
        precision: str | None = None,
        return_dict: bool = True,
        height: int | None = None,
        width: int | None = None,
        time_shift: float | str | None = None,
        vae_tiling: str = "auto",
        vae_tile_size: int | None = None,
    ):
        """Class-conditional images.

        class_labels: an id, a class name, or a list of them (see ``labels``).
        num_inference_steps: sampler steps / NFE budget (default: the pipeline's, else the sampler's).
        guidance_scale: classifier-free guidance scale; 1 = none. The default 1.0 is
            ``sample.py``'s ``--cfg-scale`` default, so the same call and command give the same
            images; diffusers' ``DiTPipeline`` defaults to 4.0 (DiT's showcase samples; DiT's
            FID-50K used 1.5): pass ``guidance_scale=4.0`` for that look.
        generator: a ``torch.Generator`` or an int seed: sample b gets the noise of global
            index b under the seed drawn from it (the int itself), as ``sample.py --seed``
            does. Or a list of them, one per image (diffusers' convention): image i is exactly
            what ``pipe(class_labels[i], generator=generator[i])`` gives, so one image of a
            batch can be remade alone; the images are then sampled one at a time.
        output_type: "pil", "np" (float NHWC in [0, 1]), "pt" (NCHW in [0, 1]) or "latent".
        sampler: a name of ``nala_dit.diffusion.generate.SAMPLERS`` fitting the model, or (NaLaDiT)
            "scheduler" to run this pipeline's diffusers scheduler.
        guidance_interval: (lo, hi) in model time (DiT timesteps, SiT t) where guidance applies.
        guide_channels: guide only the first k channels (3 = the original DiT code).
        precision: "fp32" or "bf16" (the transformer under bf16 autocast: matmuls and convolutions
            in bf16, the sampler's arithmetic and NaLa's features, state and division in fp32).
            Default: the transformer's dtype, so a pipeline loaded with diffusers'
            ``dtype=torch.bfloat16`` or moved by ``pipe.to(torch.bfloat16)``
            (bf16 weights, half the memory) runs as "bf16" (docs/sampling.md, "Precision").
        height, width: image size in pixels (diffusers' convention; default: the trained
            size, ``sample_size × vae_scale_factor``); each a multiple of VAE factor × patch.
            Away from the trained size expect degraded content (docs/highres.md).
        time_shift: shift the sampler's steps toward noise, a number or "auto" (s = √(tokens /
            base tokens)); default: what the model was trained with.
        vae_tiling: "auto" (tile images above 1024² px, else as ``vae`` is set, e.g. by
            ``pipe.vae.enable_tiling()``), "on" or "off"; ``vae_tile_size``: tile side in
            image px (a multiple of 32 for f8 VAEs). See ``nala_dit.models.vae``.
        """
        warn_spinning_threads(self.device)
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
        if output_type != "latent":  # before sampling, not after
            check_tiling(vae_tiling, vae_tile_size, self.resolved_vae(), names=("vae_tiling", "vae_tile_size"))
        ids = self.get_label_ids(class_labels)
        if isinstance(generator, (list, tuple)):   # one per image: image i is its own call's image
            kwargs = dict(num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                          output_type=output_type, sampler=sampler, guidance_interval=guidance_interval,
                          guide_channels=guide_channels, precision=precision, height=height, width=width,
                          time_shift=time_shift, vae_tiling=vae_tiling, vae_tile_size=vae_tile_size)
            images = self._one_call_per_generator(ids, generator, kwargs)
            return ImagePipelineOutput(images=images) if return_dict else (images,)
        seed = seed_from(generator)
        settings = self._settings(len(ids), num_inference_steps, guidance_scale, sampler, guidance_interval,
                                  guide_channels, precision, height, width, time_shift)
        progress = not getattr(self, "_progress_bar_config", {}).get("disable", False)
        labels = torch.tensor(ids, dtype=torch.long, device=self.transformer.device)
        latents, nfe = self._latents(labels, list(range(len(ids))), seed, settings, progress)
        check_finite_samples(latents)
        images = self._output(latents, output_type, vae_tiling, vae_tile_size)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return ImagePipelineOutput(images=images)

    def _one_call_per_generator(self, ids: list[int], generators, kwargs: dict):
        """``__call__`` with a list of generators: image i is ``self(ids[i], generator=generators[i])``."""
        if len(generators) != len(ids):
            raise ValueError(f"generator: {len(generators)} generators for {len(ids)} images (class_labels); pass "
                             f"one per image, or one generator (or int seed) for all")
        parts = [self(label, generator=g, return_dict=False, **kwargs)[0] for label, g in zip(ids, generators)]
        if kwargs["output_type"] == "pil":
            return [image for part in parts for image in part]
        if kwargs["output_type"] == "np":
            import numpy as np

            return np.concatenate(parts)
        return torch.cat(parts)

    def _settings(self, n_images, num_inference_steps, guidance_scale, sampler, guidance_interval, guide_channels,
                  precision, height, width, time_shift) -> SampleSettings:
        """``__call__``'s arguments as ``SampleSettings``, checked in the call's own words
        (steps, memory) before any work."""
        if num_inference_steps is None and sampler is None:
            num_inference_steps = self.config.num_inference_steps
        settings = SampleSettings(sampler or self.config.sampler, num_inference_steps, guidance_scale,
                                  guidance_interval, guide_channels, self.precision_for(precision),
                                  latent_size=self.latent_size(height, width),
                                  time_shift=parse_time_shift(time_shift) if time_shift is not None else None)
        if settings.num_steps is not None and settings.sampler != "scheduler":
            check_steps(settings.sampler or default_sampler(self.objective()), settings.num_steps,
                        chain_length(self.objective()), "num_inference_steps")
        check_sample_memory(self.transformer, settings.latent_size, n_images, self.vae_scale_factor,
                            self.transformer.device, f"height={height}, width={width}",
                            "use a smaller height/width or fewer class_labels per call", guided=guidance_scale != 1)
        return settings

    def _output(self, latents: torch.Tensor, output_type: str, vae_tiling: str, vae_tile_size: int | None):
        """Sampled latents as ``output_type``: decoded by the VAE unless "latent"."""
        if output_type == "latent":
            return latents
        images = decode(latents, self.resolved_vae(), self.latent_norm,    # (B, C, H, W) in [-1, 1]
                        tiling=vae_tiling, tile_size=vae_tile_size)
        check_finite_samples(images)
        if output_type == "pil":
            from PIL import Image
            arr = to_uint8(images).numpy()
            return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in arr]
        if output_type == "np":
            return ((images + 1) / 2).permute(0, 2, 3, 1).cpu().numpy()
        return (images + 1) / 2


class NaLaDiTPipeline(_NaLaPipeline):
    """Class-conditional sampling for diffusion (DiT / NaLaDiT) models."""

    _objective = "diffusion"

    def __init__(self, transformer: DiT, scheduler=None, vae=None, id2label: dict | None = None,
                 objective_config: dict | None = None, scaling_factor: float | None = None,
                 vae_path: str | None = None, sampler: str | None = "ddpm", num_inference_steps: int | None = None,
                 source: dict | None = None, null_class_id: int | None = None, latent_norm: dict | None = None):
        # null_class_id is recorded for readers of model_index.json; it always comes
        # from the transformer, so a stored value is ignored here.
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)
        self._register_settings(transformer, id2label, objective_config, scaling_factor, vae_path, sampler,
                                num_inference_steps, source, latent_norm)

    def _latents(self, labels, indices, seed, settings, progress):
        if settings.sampler != "scheduler":
            return super()._latents(labels, indices, seed, settings, progress)
        if self.scheduler is None:
            raise ValueError("sampler='scheduler' needs a scheduler component; this pipeline has none")
        if settings.time_shift is not None:
            raise ValueError("time_shift applies to the named samplers, not to sampler='scheduler'")
        model = self.transformer
        noise = initial_noise(indices, (model.in_channels, *settings.noise_size(model)), seed, model.device)
        # Stochastic schedulers (DDPM, DDIM with eta > 0) draw from the global RNG, as
        # the scheduler loop passes them no generator: seed it from the batch, in a
        # fork so the caller's RNG state is left alone.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(index_seed(seed, indices[0], 1))
            out = generate(_Precision(model, settings.precision), None, noise, labels, scheduler=self.scheduler,
                           num_steps=settings.num_steps, cfg_scale=settings.cfg_scale,
                           guidance_interval=settings.guidance_interval, guide_channels=settings.guide_channels,
                           progress=progress)
        return out.samples, out.nfe

    @classmethod
    def from_model(cls, model: DiT, vae=None, train_config: dict | None = None, **settings) -> "NaLaDiTPipeline":
        """A pipeline around an in-memory model; ``train_config`` supplies the β schedule."""
        from ..diffusion.generate import diffusers_scheduler

        objective_config = _objective_config(model, train_config or {})
        scheduler = diffusers_scheduler("ddim", build_objective(dict(model.config), objective_config))
        return cls(model, scheduler=scheduler, vae=vae, objective_config=objective_config, **settings)


class NaLaSiTPipeline(_NaLaPipeline):
    """Class-conditional sampling for transport (SiT / NaLaSiT) models (no scheduler component)."""

    _objective = "transport"

    def __init__(self, transformer: DiT, vae=None, id2label: dict | None = None,
                 objective_config: dict | None = None, scaling_factor: float | None = None,
                 vae_path: str | None = None, sampler: str | None = "ode-heun", num_inference_steps: int | None = None,
                 source: dict | None = None, null_class_id: int | None = None, latent_norm: dict | None = None):
        # null_class_id is recorded for readers of model_index.json; it always comes
        # from the transformer, so a stored value is ignored here.
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae)
        self._register_settings(transformer, id2label, objective_config, scaling_factor, vae_path, sampler,
                                num_inference_steps, source, latent_norm)

    @classmethod
    def from_model(cls, model: DiT, vae=None, train_config: dict | None = None, **settings) -> "NaLaSiTPipeline":
        return cls(model, vae=vae, objective_config=_objective_config(model, train_config or {}), **settings)


PIPELINES = {"diffusion": NaLaDiTPipeline, "transport": NaLaSiTPipeline}


OBJECTIVE_KEYS = {"diffusion": ("noise-schedule", "diffusion-steps"),
                  "transport": ("path-type", "prediction", "loss-weight", "train-eps", "sample-eps")}


def _objective_config(model: DiT, train_config: dict) -> dict:
    """The training-config keys ``build_objective`` reads, for this model's objective."""
    keys = OBJECTIVE_KEYS[model.config.objective]
    return {k: train_config[k] for k in keys if train_config.get(k) is not None}


def pipeline_for(model: DiT, vae=None, train_config: dict | None = None, **settings):
    """``NaLaDiTPipeline`` or ``NaLaSiTPipeline``, whichever fits ``model.config.objective``."""
    settings.setdefault("sampler", default_sampler(build_objective(
        dict(model.config), _objective_config(model, train_config or {}))))
    return PIPELINES[model.config.objective].from_model(model, vae=vae, train_config=train_config, **settings)


def load_pipeline(path: str | os.PathLike, **kwargs):
    """Open a saved pipeline folder with the class recorded in its ``model_index.json``."""
    name = read_pipeline_index(path)["_class_name"]
    classes = {cls.__name__: cls for cls in PIPELINES.values()}
    return classes[name].from_pretrained(str(path), **kwargs)


class DiTPipelineTransformer(ModelMixin, ConfigMixin):
    """Our DiT as the ``transformer`` of diffusers' ``DiTPipeline``.

        adapter = DiTPipelineTransformer.from_dit(model)          # shares model's weights
        pipe = diffusers.DiTPipeline(transformer=adapter, vae=vae, scheduler=DDIMScheduler(...))

    The weights sit under ``dit.`` and the config carries the DiT config, so the adapter
    saves and loads as any diffusers model.
    """

    @register_to_config
    def __init__(self, dit_config: dict, sample_size: int, in_channels: int, out_channels: int):
        super().__init__()
        self.dit = DiT(**config_keys(dit_config))

    @classmethod
    def from_dit(cls, model: DiT) -> "DiTPipelineTransformer":
        if model.config.objective != "diffusion":
            raise ValueError("DiTPipeline runs ε-prediction diffusion models; this is a transport (SiT) model: "
                             "use NaLaSiTPipeline")
        if model.config.num_classes != 1000 or model.null_label != 1000:
            raise ValueError(f"diffusers' DiTPipeline hard-codes the null class as 1000, so it needs a 1000-class "
                             f"model with label dropout; this one has num_classes={model.config.num_classes}, "
                             f"null class {model.null_label}: use NaLaDiTPipeline")
        with torch.device("meta"):  # skip a second full init; the real model is put in below
            adapter = cls(dict(model.config), model.config.input_size, model.in_channels, model.out_channels)
        adapter.dit = model
        return adapter

    def forward(self, hidden_states: torch.Tensor, timestep=None, class_labels=None, return_dict: bool = True):
        t = torch.as_tensor(timestep, device=hidden_states.device)
        if t.ndim == 0:
            t = t.expand(hidden_states.shape[0])
        out = self.dit(hidden_states, t, class_labels)                     # (B, C_out, H, W)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


def diffusers_dit_pipeline(model: DiT, vae, scheduler=None, id2label: dict | None = None, latent_norm=None):
    """diffusers' own ``DiTPipeline`` around our model (DDIM with our β schedule by default).

    ``DiTPipeline`` decodes ``latents / vae.config.scaling_factor``, nothing else: a model
    trained with other latent statistics (``latent_norm``: its ``LatentNorm``, e.g.
    ``source.latent_norm``) is refused rather than decoded wrongly."""
    from diffusers import DiTPipeline

    from ..diffusion.gaussian import GaussianDiffusion
    from ..diffusion.generate import diffusers_scheduler

    if vae is None:
        raise ValueError("diffusers' DiTPipeline always decodes with a VAE; pixel-space models need NaLaDiTPipeline")
    if latent_norm is not None and (latent_norm.mode != "scalar"
                                    or latent_norm.scale != float(vae.config.scaling_factor)):
        raise ValueError(f"diffusers' DiTPipeline decodes with the VAE's scaling_factor "
                         f"{vae.config.scaling_factor} only, and this model was trained with latent norm "
                         f"{latent_norm.to_dict()}: use NaLaDiTPipeline (export.py checkpoint), which decodes with it")
    if scheduler is None:
        scheduler = diffusers_scheduler("ddim", GaussianDiffusion.from_schedule("linear", 1000, "learned_range"))
    return DiTPipeline(transformer=DiTPipelineTransformer.from_dit(model), vae=vae, scheduler=scheduler,
                       id2label=id2label)


__all__ = ["NaLaDiTPipeline", "NaLaSiTPipeline", "DiTPipelineTransformer", "diffusers_dit_pipeline",
           "load_pipeline", "pipeline_for"]


def pipeline_from_checkpoint(path: str | os.PathLike, weights: str = "ema", vae: str | None = None,
                             copy_vae: bool = False, id2label: dict | None = None):
    """A pipeline from a training checkpoint: its EMA (default) weights, the β schedule or
    transport settings it was trained with, class names and the VAE (copied or referenced)."""
    from ..checkpoints.read import checkpoint_norm, load_model
    from .sources import default_id2label

    model, ckpt = load_model(path, weights)
    vae_path = vae or ckpt.config.get("vae")
    if copy_vae and not vae_path:
        raise ValueError(f"--copy-vae: {path} holds a pixel-space model (trained without --vae), so there is no "
                         f"VAE to copy; drop --copy-vae")
    vae_model, scaling, norm = None, None, None
    if vae_path:
        vae_model, scaling = load_vae(vae_path)   # also checks that a referenced VAE exists now
        norm = checkpoint_norm(ckpt)              # what it was trained with: decoded with exactly that
        scaling = norm.scale if norm is not None and norm.mode == "scalar" else scaling
    source = dict(model=ckpt.config.get("model"), checkpoint=str(ckpt.path), step=ckpt.step, weights=weights,
                  vae=vae_path)
    return pipeline_for(model, vae=vae_model if copy_vae else None, train_config=ckpt.config,
                        id2label=id2label or default_id2label(ckpt.config, model.config.num_classes),
                        scaling_factor=scaling, vae_path=None if copy_vae or not vae_path else str(vae_path),
                        source=source, latent_norm=None if norm is None else norm.to_dict())
