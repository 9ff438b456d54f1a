"""One entry point from a trained model to images, shared by every caller.

``generate`` looks the sampler up by name in the registry (``registry.py``: its function,
family and default steps) and wraps the model for guidance; training grids, ``sample.py``,
``evaluate_fid.py gen`` and the pipelines all call it, so a given seed and setting produce
the same images everywhere. The samplers themselves are the plain functions of
``samplers.py``; ``scheduler_sample`` runs a diffusers scheduler (DDIM, DPM-Solver++) over
the same model function.

``sample_batch`` adds what every caller shares around it: per-index seeded noise
(``index_seed``, ``initial_noise``), the precision wrapper and ``SampleSettings``. Every
sample has a *global index*; its starting noise comes from its own generator seeded with
``(seed, index)``, so it does not depend on the batch, the process or the process count.
Stochastic samplers (ddpm, sde-*) also draw noise inside the loop from one generator per
batch, seeded with ``(seed, first index of the batch)``: for them ``--batch-size`` is part
of the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from .gaussian import GaussianDiffusion
from .guidance import cfg_model_fn
from ..data.latent_stats import denormalize
from .choices import DEFAULT_STEPS, DIFFUSION_SAMPLERS, ODE_ATOL, ODE_RTOL, PRECISIONS, SAMPLERS, TRANSPORT_SAMPLERS  # noqa: F401
from .choices import MAX_CONTINUOUS_STEPS, check_steps, parse_cfg_scale
from .registry import DEFAULT_SAMPLERS, SAMPLER_SPECS, sampler_names, sampler_spec
from .samplers import SampleOutput
from .transport import Transport
from ..models.tokenizer import decode_latents
from ..models.vae import decoding


OBJECTIVE_NAMES = {"diffusion": "diffusion (DiT)", "transport": "transport (SiT)"}


def objective_family(objective) -> str | None:
    """The family of samplers an objective takes: "diffusion" (``GaussianDiffusion``),
    "transport" (``Transport``), else None."""
    return "diffusion" if isinstance(objective, GaussianDiffusion) else \
        "transport" if isinstance(objective, Transport) else None


def default_sampler(objective) -> str:
    if getattr(objective, "mean_flow", False):   # a MeanFlow model: one step of its average velocity
        return "meanflow"
    return DEFAULT_SAMPLERS["diffusion" if isinstance(objective, GaussianDiffusion) else "transport"]


def check_sampler(sampler: str, objective) -> None:
    """A clear error for unknown names and for samplers of the other objective."""
    needs, family = sampler_spec(sampler).objective, objective_family(objective)
    if family is not None and needs != family:
        raise ValueError(f"sampler {sampler!r} is for {OBJECTIVE_NAMES[needs]} models; this is a "
                         f"{OBJECTIVE_NAMES[family]} model: use one of {sampler_names(family)}")
    if sampler == "meanflow" and family is not None and not getattr(objective, "mean_flow", False):
        from .meanflow import MEANFLOW_ONLY

        raise ValueError(MEANFLOW_ONLY)


def diffusers_scheduler(name: str, diffusion: GaussianDiffusion):
    """A diffusers scheduler with our training schedule (linear β 1e-4 → 0.02).

    ``trailing`` spacing keeps t = 999 (the first step starts from pure noise).
    """
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler

    common = dict(num_train_timesteps=diffusion.num_timesteps,
                  trained_betas=diffusion.betas.float().numpy().tolist(),
                  timestep_spacing="trailing")
    if name == "ddim":
        return DDIMScheduler(clip_sample=False, set_alpha_to_one=True, **common)
    if name == "dpm-solver":
        return DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2, **common)
    raise ValueError(f"no diffusers scheduler for {name!r}; choose 'ddim' or 'dpm-solver'")


def dpm_solver_sample(diffusion: GaussianDiffusion, model_fn, noise, labels, num_steps: int = 25,
                      progress: bool = False, time_shift: float = 1.0) -> SampleOutput:
    """DPM-Solver++ (2M): diffusers' scheduler with the diffusion's schedule (``diffusers_scheduler``),
    over ``scheduler_sample``; it places its own steps, so no time shift."""
    if time_shift != 1.0:
        raise ValueError(TIME_SHIFT_REFUSED)
    return scheduler_sample(diffusers_scheduler("dpm-solver", diffusion), model_fn, noise, labels, num_steps, progress)


TIME_SHIFT_REFUSED = ("a time shift applies to ddpm, ddim and the fixed-step ODE/SDE samplers, not to a diffusers "
                      "scheduler (dpm-solver); use --sampler ddim or ddpm, or drop --time-shift")


def chain_length(objective) -> int | None:
    """The training timesteps of a diffusion objective (what bounds its samplers' steps), else None."""
    return objective.num_timesteps if isinstance(objective, GaussianDiffusion) else None


def set_timesteps(scheduler, num_steps: int, device=None) -> None:
    """``scheduler.set_timesteps(num_steps)``, and exactly ``num_steps`` of them: diffusers'
    "trailing" spacing takes ``np.arange(T, 0, -T / n)``, whose float step leaves one value
    more for some n (61, 103, ... 998 of T = 1000), ending at t = -1 (an extra model call
    outside the trained range). Those n get the first n timesteps, as every other n has."""
    import inspect

    scheduler.set_timesteps(num_steps, device=device)
    if len(scheduler.timesteps) <= num_steps:
        return
    kept = scheduler.timesteps[:num_steps]
    if "timesteps" in inspect.signature(scheduler.set_timesteps).parameters:   # DPM-Solver: its sigmas with them
        scheduler.set_timesteps(timesteps=kept.tolist(), device=device)
    else:                                                                        # DDIM: the timesteps alone
        scheduler.timesteps = kept


def _plain_ddim(scheduler) -> bool:
    """A diffusers ``DDIMScheduler`` whose step is plain η = 0 DDIM on ε (no clipping, no
    thresholding): ``scheduler_sample`` steps it to the true next timestep (``_ddim_step``)."""
    from diffusers import DDIMScheduler

    config = scheduler.config
    return (isinstance(scheduler, DDIMScheduler) and config.prediction_type == "epsilon"
            and not config.clip_sample and not config.thresholding)


def _ddim_step(scheduler, eps, t: int, t_next: int, x):
    """``DDIMScheduler.step`` (η = 0, the same expressions, so the same bits where they agree)
    towards ``t_next``, the next timestep of the run: diffusers' step assumes the previous
    timestep is ``t - T // n``, which trailing spacing breaks wherever n does not divide T
    (gaps of 16 and 17 at n = 61): each step would land at one noise level and the next call
    read it as another (1 % off the exact answer at n = 61, tests/diffusion/test_samplers.py)."""
    alpha_prod_t = scheduler.alphas_cumprod[t]
    alpha_prod_t_prev = scheduler.alphas_cumprod[t_next] if t_next >= 0 else scheduler.final_alpha_cumprod
    beta_prod_t = 1 - alpha_prod_t
    pred_original_sample = (x - beta_prod_t ** (0.5) * eps) / alpha_prod_t ** (0.5)
    pred_sample_direction = (1 - alpha_prod_t_prev) ** (0.5) * eps
    return alpha_prod_t_prev ** (0.5) * pred_original_sample + pred_sample_direction


def scheduler_sample(scheduler, model_fn, noise, labels, num_steps: int, progress: bool = False) -> SampleOutput:
    """Run a diffusers ε-scheduler; the learned-variance half of the output is dropped. A plain
    DDIM scheduler steps to the run's own next timestep (``_ddim_step``), any other through its
    ``step``."""
    check_steps("ddim", num_steps, scheduler.config.num_train_timesteps, "num_inference_steps",
                label=f"a diffusers scheduler ({type(scheduler).__name__})")
    set_timesteps(scheduler, num_steps, noise.device)
    x, nfe = noise, 0
    steps = scheduler.timesteps
    following = [int(t) for t in steps[1:]] + [-1]
    ddim = _plain_ddim(scheduler)
    if progress:
        from ..progress import progress_bar
        steps = progress_bar(steps, leave=False, desc="steps")
    for t, t_next in zip(steps, following):
        eps = model_fn(x, t.expand(x.shape[0]).float(), labels)[:, : x.shape[1]]
        nfe += 1
        x = _ddim_step(scheduler, eps, int(t), t_next, x) if ddim else scheduler.step(eps, t, x).prev_sample
    return SampleOutput(x, nfe)


def _sampler_steps(objective, sampler: str | None, num_steps: int | None, scheduler) -> tuple[str | None, int]:
    """``generate``'s sampler (the objective's default when None) and step count, checked;
    with a diffusers ``scheduler`` the sampler stays as given and the steps default to DDIM's."""
    if scheduler is not None:
        return sampler, SAMPLER_SPECS["ddim"].steps if num_steps is None else num_steps
    sampler = sampler or default_sampler(objective)
    check_sampler(sampler, objective)
    steps = check_steps(sampler, SAMPLER_SPECS[sampler].steps if num_steps is None else num_steps,
                        chain_length(objective), "num_steps")
    return sampler, steps


def _check_init(init: torch.Tensor, noise: torch.Tensor, strength: float, sampler: str | None, scheduler) -> None:
    """Refuse an SDEdit start ``generate`` cannot run: the wrong shape, a strength outside
    [0, 1], or a sampler (or diffusers scheduler) that cannot start part-way."""
    if init.shape != noise.shape:
        raise ValueError(f"init {tuple(init.shape)} must have the shape of the noise {tuple(noise.shape)}")
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"strength must be in [0, 1] (0 = keep the image, 1 = from pure noise), got {strength}")
    if scheduler is not None or not SAMPLER_SPECS[sampler].renoise:
        raise ValueError(f"re-noising (--upscale-from) runs with {', '.join(sampler_names(renoise=True))}, not "
                         f"{sampler or 'a diffusers scheduler'}")


@torch.no_grad()
def generate(
    model,
    objective,
    noise: torch.Tensor,
    labels: torch.Tensor,
    *,
    sampler: str | None = None,
    num_steps: int | None = None,
    cfg_scale: float = 1.0,
    guidance_interval: tuple[float, float] | None = None,
    guide_channels: int | None = None,
    null_label: int | None = None,
    eta: float = 0.0,
    atol: float = ODE_ATOL,
    rtol: float = ODE_RTOL,
    max_nfe: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
    scheduler=None,
    time_shift: float = 1.0,
    init: torch.Tensor | None = None,
    strength: float = 1.0,
) -> SampleOutput:
    """Sample ``noise.shape`` outputs of ``model`` for ``labels`` (model space: latents
    or pixels). ``null_label`` defaults to the model's own (``num_classes``).

    ``scheduler``: a diffusers ε-scheduler to run instead of a named ``sampler`` (the
    pipelines' ``sampler="scheduler"``); guidance applies the same way.
    ``time_shift``: the resolution-aware step placement (``transport.shift_time``,
    ``diffusion.shift_timesteps``); 1 = the samplers' own uniform steps.
    ``init``/``strength`` (SDEdit, Meng et al. 2022): instead of starting from pure noise,
    put the clean ``init`` (model space, the shape of ``noise``) at noise level ``strength``
    with ``noise`` and run only that last part of the sampler (``renoise``): 0 returns
    ``init``, 1 starts from the sampler's first level.
    """
    if not time_shift > 0:
        raise ValueError(f"time shift must be > 0 (1 = none), got {time_shift}")
    cfg_scale = parse_cfg_scale(cfg_scale)
    if time_shift != 1.0 and scheduler is not None:
        raise ValueError(TIME_SHIFT_REFUSED)
    sampler, steps = _sampler_steps(objective, sampler, num_steps, scheduler)
    if null_label is None:
        null_label = getattr(model, "null_label", None)
    if cfg_scale != 1.0 and null_label is None:
        raise ValueError(
            f"cfg_scale={cfg_scale} needs an unconditional model, but this model has no null class "
            "(trained with num_classes=1 or class_dropout_prob=0); use --cfg-scale 1"
        )
    model_fn = cfg_model_fn(model, cfg_scale, null_label, interval=guidance_interval,
                            guide_channels=guide_channels, eps_channels=noise.shape[1])
    start = {}
    if init is not None:
        _check_init(init, noise, strength, sampler, scheduler)
        if strength == 0.0:
            return SampleOutput(init, 0)
        noise, start, steps = renoise(objective, init, noise, strength, steps, time_shift)
    if scheduler is not None:
        return scheduler_sample(scheduler, model_fn, noise, labels, steps, progress)
    spec = SAMPLER_SPECS[sampler]   # the registry's function, with the settings it takes (registry.py)
    given = dict(generator=generator, eta=eta, atol=atol, rtol=rtol, max_nfe=max_nfe)
    options = {**spec.options, **{key: given[key] for key in spec.takes}, **start}
    return spec.function()(objective, model_fn, noise, labels, num_steps=steps, progress=progress,
                           time_shift=time_shift, **options)


def renoise(objective, init: torch.Tensor, noise: torch.Tensor, strength: float, num_steps: int,
            time_shift: float = 1.0):
    """SDEdit's starting point: ``(x at the start level, sampler start kwargs, steps)``.

    DiT: of the n respaced (and shifted) steps keep the last k = round(strength · n)
    (at least 1) and put ``init`` at the first kept level with q(x_t | x_0). SiT: start at
    the time a fraction ``strength`` of the (shifted) time line before the data end, with
    round(strength · steps) steps; at strength 1 that is t0, where the linear path is pure
    noise, so the result equals plain sampling from ``noise``.
    """
    if isinstance(objective, GaussianDiffusion):
        d = objective.respace(num_steps, time_shift)
        first = max(1, round(strength * d.num_timesteps)) - 1
        t = torch.full((init.shape[0],), first, device=init.device, dtype=torch.long)
        return d.q_sample(init, t, noise), dict(first_step=first), num_steps
    from .transport import _expand, shift_time

    t0, t1 = objective.interval()
    u = 1.0 - strength
    t_start = t0 + (t1 - t0) * (shift_time(u, time_shift) if time_shift != 1.0 else u)
    te = _expand(t_start, init)
    x = objective.path.alpha(te)[0] * init + objective.path.sigma(te)[0] * noise
    return x.to(noise.dtype), dict(t_start=t_start), max(1, round(strength * num_steps))


def upsample_latents(latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Model-space samples resized to ``size`` (h, w): bilinear, as the hires-fix recipes."""
    return torch.nn.functional.interpolate(latents, size=tuple(size), mode="bilinear", align_corners=False)


def decode(latents: torch.Tensor, vae=None, scaling_factor: float = 0.18215, tiling: str | None = None,
           tile_size: int | None = None) -> torch.Tensor:
    """Model space → pixels in [-1, 1]: the VAE decoder for latent models, identity otherwise.

    ``scaling_factor``: how model space maps to the VAE's latents, a number f (``z = x / f``)
    or the ``latent_norm.LatentNorm`` the model was trained with (per-channel statistics).

    ``tiling`` ("auto", "on", "off") and ``tile_size`` (image px): tiled/sliced decoding,
    see ``nala_dit.models.vae``; None takes the surrounding ``vae.decode_settings`` (default auto:
    tiles above 1024² px). The VAE's own settings are restored afterwards.
    """
    if vae is None:
        return latents.clamp(-1, 1)
    with decoding(vae, latents.shape, tiling, tile_size):
        out = decode_latents(vae, denormalize(latents, scaling_factor))
    return out.float().clamp(-1, 1)


# ----------------------------------------------------------------- seeds and noise
NOISE_STREAM, LOOP_STREAM, SMALL_STREAM = 0, 1, 2  # SMALL: the first stage of --upscale-from


def index_seed(seed: int, index: int, stream: int = NOISE_STREAM) -> int:
    """A 63-bit seed for one global sample index (numpy's SeedSequence mixes the words)."""
    state = np.random.SeedSequence([seed, index, stream]).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


def initial_noise(indices, shape: tuple[int, ...], seed: int, device="cpu", stream: int = NOISE_STREAM) -> torch.Tensor:
    """(B, *shape) standard normal noise, row b drawn from its own ``(seed, indices[b])`` stream."""
    rows = [torch.randn(shape, generator=torch.Generator().manual_seed(index_seed(seed, int(i), stream)))
            for i in indices]
    return torch.stack(rows).to(device)


def seed_from(generator) -> int:
    """The integer seed behind a pipeline's ``generator`` argument (None: a fresh random one)."""
    if generator is None:
        return int(torch.randint(0, 2**62, ()).item())
    if isinstance(generator, int):
        if generator < 0:
            raise ValueError(f"generator: an int seed must be >= 0, got {generator}")
        return generator
    if isinstance(generator, torch.Generator):
        # Drawing from the caller's generator keeps diffusers' convention: the same
        # manual_seed gives the same images, and a used generator gives new ones.
        return int(torch.randint(0, 2**62, (), generator=generator, device=generator.device).item())
    raise TypeError(f"generator must be None, an int seed or a torch.Generator (or, for a pipeline, a list of them: "
                    f"one per image), got {type(generator).__name__}")


class _Precision:
    """The model under autocast, returning fp32 so the sampler arithmetic stays fp32."""

    def __init__(self, model, precision: str):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.model, self.precision = model, precision
        self.null_label = getattr(model, "null_label", None)

    def __call__(self, x, t, y, **kw):
        if self.precision == "fp32":
            return self.model(x, t, y, **kw)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.model(x, t, y, **kw).float()


@dataclass
class SampleSettings:
    """Everything besides labels and indices that decides the images."""

    sampler: str | None = None
    num_steps: int | None = None
    cfg_scale: float = 1.0
    guidance_interval: tuple[float, float] | None = None
    guide_channels: int | None = None
    precision: str = "fp32"
    # the adaptive dopri5 solver only: tolerances and a bound on function evaluations
    atol: float = ODE_ATOL
    rtol: float = ODE_RTOL
    max_nfe: int | None = None
    # where the model runs: latent (h, w) (None = the trained size) and the time shift
    # (a number, "auto" = √(tokens / base tokens), None = what the model was trained with)
    latent_size: tuple[int, int] | None = None
    time_shift: float | str | None = None
    # progressive upscaling (SDEdit): sample at this latent (h, w) first, upsample, re-noise
    # to ``strength``, denoise at ``latent_size``
    upscale_from: tuple[int, int] | None = None
    strength: float = 0.6

    def resolved(self, objective) -> "SampleSettings":
        sampler = self.sampler or default_sampler(objective)
        check_sampler(sampler, objective)
        adaptive = (self.atol, self.rtol, self.max_nfe) != (ODE_ATOL, ODE_RTOL, None)
        if adaptive and not SAMPLER_SPECS[sampler].adaptive:
            which = sampler_names(adaptive=True)
            raise ValueError(f"--atol/--rtol/--max-nfe apply to the adaptive {' / '.join(which)} sampler only, not to "
                             f"{sampler}; drop them or use --sampler {which[0]}")
        if self.max_nfe is not None and not 1 <= self.max_nfe <= MAX_CONTINUOUS_STEPS:
            raise ValueError(f"--max-nfe must be from 1 to {MAX_CONTINUOUS_STEPS:,} (dopri5's bound on model "
                             f"calls, as the fixed-step samplers' steps), got {self.max_nfe}")
        steps = check_steps(sampler, SAMPLER_SPECS[sampler].steps if self.num_steps is None else self.num_steps,
                            chain_length(objective))
        interval = tuple(self.guidance_interval) if self.guidance_interval is not None else None
        size = tuple(self.latent_size) if self.latent_size is not None else None
        small = tuple(self.upscale_from) if self.upscale_from is not None else None
        if small is not None:
            if size is None or small[0] > size[0] or small[1] > size[1] or small == size:
                raise ValueError(f"--upscale-from must be smaller than the image size on some side and larger on "
                                 f"none (upscaling from latent {small} to {size or 'the trained size'})")
            if not 0.0 <= self.strength <= 1.0:
                raise ValueError(f"--strength must be in [0, 1] (0 = keep the upsampled image, 1 = from pure "
                                 f"noise), got {self.strength}")
            if not SAMPLER_SPECS[sampler].renoise:
                raise ValueError(f"--upscale-from re-noises and denoises with one of "
                                 f"{', '.join(sampler_names(renoise=True))}, not {sampler}")
        return replace(self, sampler=sampler, num_steps=steps, cfg_scale=parse_cfg_scale(self.cfg_scale),
                       guidance_interval=interval, latent_size=size, upscale_from=small)

    def shift_for(self, model, objective, size: tuple[int, int] | None = None) -> float:
        """The time shift at a latent size (default ``noise_size``): the setting, or the training's."""
        if self.time_shift is None:
            return getattr(objective, "time_shift", 1.0)
        return model.grid(*(size or self.noise_size(model))).time_shift(self.time_shift)

    def noise_size(self, model) -> tuple[int, int]:
        return self.latent_size or (model.config.input_size,) * 2


@torch.no_grad()
def sample_batch(model, objective, labels: torch.Tensor, indices, seed: int, settings: SampleSettings,
                 vae=None, scaling_factor: float = 0.18215, progress: bool = False,
                 decode_output: bool = True) -> tuple[torch.Tensor, int]:
    """One batch: pixels in [-1, 1] (B, C, H, W) (or latents) and the NFE per sample."""
    device = next(model.parameters()).device
    s = settings.resolved(objective)
    noise = initial_noise(indices, (model.in_channels, *s.noise_size(model)), seed, device)
    loop_gen = torch.Generator(device).manual_seed(index_seed(seed, int(indices[0]), LOOP_STREAM))
    common = dict(sampler=s.sampler, num_steps=s.num_steps, cfg_scale=s.cfg_scale,
                  guidance_interval=s.guidance_interval, guide_channels=s.guide_channels,
                  null_label=model.null_label, atol=s.atol, rtol=s.rtol, max_nfe=s.max_nfe, progress=progress)
    fn, labels = _Precision(model, s.precision), labels.to(device)
    init, nfe = None, 0
    if s.upscale_from is not None:  # stage 1: the trained (smaller) size, its own noise stream
        small = initial_noise(indices, (model.in_channels, *s.upscale_from), seed, device, SMALL_STREAM)
        first = generate(fn, objective, small, labels, generator=loop_gen,
                         time_shift=s.shift_for(model, objective, s.upscale_from), **common)
        init, nfe = upsample_latents(first.samples, s.noise_size(model)), first.nfe
    out = generate(fn, objective, noise, labels, generator=loop_gen, time_shift=s.shift_for(model, objective),
                   init=init, strength=s.strength if init is not None else 1.0, **common)
    out = SampleOutput(out.samples, out.nfe + nfe)
    if not decode_output:
        return out.samples, out.nfe
    return decode(out.samples, vae, scaling_factor), out.nfe
