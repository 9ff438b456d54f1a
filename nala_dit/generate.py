"""One entry point from a trained model to images, shared by every caller.

``generate`` picks the sampler by name and wraps the model for guidance; training
grids, ``sample.py``, ``evaluate_fid.py gen`` and the pipelines all call it, so a given
seed and setting produce the same images everywhere. The samplers themselves are the
plain functions of ``samplers.py``; ``scheduler_sample`` runs a diffusers scheduler
(DDIM, DPM-Solver++) over the same model function.
"""

from __future__ import annotations

import torch

from .diffusion import GaussianDiffusion
from .guidance import cfg_model_fn
from .samplers import SampleOutput, ddim_sample, ddpm_sample, ode_sample, sde_sample
from .transport import Transport

DIFFUSION_SAMPLERS = ("ddpm", "ddim", "dpm-solver")
TRANSPORT_SAMPLERS = ("ode-euler", "ode-heun", "dopri5", "sde-euler", "sde-heun")
SAMPLERS = DIFFUSION_SAMPLERS + TRANSPORT_SAMPLERS
DEFAULT_STEPS = {"ddpm": 250, "ddim": 50, "dpm-solver": 25, "ode-euler": 50, "ode-heun": 50,
                 "dopri5": 50, "sde-euler": 250, "sde-heun": 250}


def default_sampler(objective) -> str:
    return "ddpm" if isinstance(objective, GaussianDiffusion) else "ode-heun"


def check_sampler(sampler: str, objective) -> None:
    """A clear error for unknown names and for samplers of the other objective."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {SAMPLERS}")
    if isinstance(objective, GaussianDiffusion) and sampler not in DIFFUSION_SAMPLERS:
        raise ValueError(
            f"sampler {sampler!r} is for transport (SiT) models; this is a diffusion (DiT) "
            f"model: use one of {DIFFUSION_SAMPLERS}"
        )
    if isinstance(objective, Transport) and sampler not in TRANSPORT_SAMPLERS:
        raise ValueError(
            f"sampler {sampler!r} is for diffusion (DiT) models; this is a transport (SiT) "
            f"model: use one of {TRANSPORT_SAMPLERS}"
        )


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


def scheduler_sample(scheduler, model_fn, noise, labels, num_steps: int, progress: bool = False) -> SampleOutput:
    """Run a diffusers ε-scheduler; the learned-variance half of the output is dropped."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler.set_timesteps(num_steps, device=noise.device)
    x, nfe = noise, 0
    steps = scheduler.timesteps
    if progress:
        from tqdm.auto import tqdm
        steps = tqdm(steps, leave=False)
    for t in steps:
        eps = model_fn(x, t.expand(x.shape[0]).float(), labels)[:, : x.shape[1]]
        nfe += 1
        x = scheduler.step(eps, t, x).prev_sample
    return SampleOutput(x, nfe)


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
    atol: float = 1e-6,
    rtol: float = 1e-3,
    max_nfe: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
    scheduler=None,
) -> SampleOutput:
    """Sample ``noise.shape`` outputs of ``model`` for ``labels`` (model space: latents
    or pixels). ``null_label`` defaults to the model's own (``num_classes``).

    ``scheduler``: a diffusers ε-scheduler to run instead of a named ``sampler`` (the
    pipelines' ``sampler="scheduler"``); guidance applies the same way.
    """
    if scheduler is None:
        sampler = sampler or default_sampler(objective)
        check_sampler(sampler, objective)
        steps = DEFAULT_STEPS[sampler] if num_steps is None else num_steps
    else:
        steps = DEFAULT_STEPS["ddim"] if num_steps is None else num_steps
    if null_label is None:
        null_label = getattr(model, "null_label", None)
    if cfg_scale != 1.0 and null_label is None:
        raise ValueError(
            f"cfg_scale={cfg_scale} needs an unconditional model, but this model has no null class "
            "(trained with num_classes=1 or class_dropout_prob=0); use --cfg-scale 1"
        )
    model_fn = cfg_model_fn(model, cfg_scale, null_label, interval=guidance_interval,
                            guide_channels=guide_channels, eps_channels=noise.shape[1])
    if scheduler is not None:
        return scheduler_sample(scheduler, model_fn, noise, labels, steps, progress)
    if sampler == "ddpm":
        return ddpm_sample(objective, model_fn, noise, labels, num_steps=steps, generator=generator, progress=progress)
    if sampler == "ddim":
        return ddim_sample(objective, model_fn, noise, labels, num_steps=steps, eta=eta,
                           generator=generator, progress=progress)
    if sampler == "dpm-solver":
        scheduler = diffusers_scheduler(sampler, objective)
        return scheduler_sample(scheduler, model_fn, noise, labels, steps, progress)
    if sampler in ("ode-euler", "ode-heun", "dopri5"):
        method = {"ode-euler": "euler", "ode-heun": "heun", "dopri5": "dopri5"}[sampler]
        return ode_sample(objective, model_fn, noise, labels, method=method, num_steps=steps,
                          atol=atol, rtol=rtol, max_nfe=max_nfe, progress=progress)
    method = "euler" if sampler == "sde-euler" else "heun"
    return sde_sample(objective, model_fn, noise, labels, method=method, num_steps=steps,
                      generator=generator, progress=progress)


def decode(latents: torch.Tensor, vae=None, scaling_factor: float = 0.18215) -> torch.Tensor:
    """Model space → pixels in [-1, 1]: the VAE decoder for latent models, identity otherwise."""
    if vae is None:
        return latents.clamp(-1, 1)
    out = vae.decode((latents / scaling_factor).to(vae.dtype)).sample
    return out.float().clamp(-1, 1)
