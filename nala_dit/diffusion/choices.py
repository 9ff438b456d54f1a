"""The objectives' and samplers' names and bounds, as plain data: importing this module costs
no torch (the CLIs' ``--help``, ``--dry-run`` and argument errors read it): the β schedules
(``gaussian.py``), SiT's paths, predictions and loss weights (``transport.py``), the sampler
names and default step counts (from the samplers' registry, ``registry.py``), the guidance scale's range
(``guidance.py``), and ``check_steps`` / ``check_diffusion_steps``, the one check of every caller."""

from __future__ import annotations

import numbers

from ..checks import number_in
from .registry import SAMPLER_SPECS, sampler_names, sampler_spec

# Classifier-free guidance: ε = ε_uncond + s·(ε_cond − ε_uncond). 0 = unconditional,
# 1 = no guidance, DiT uses 1.5-4; far above, the difference term swamps the prediction
# (samples saturate), and near 1e30 it overflows to inf/NaN.
CFG_SCALE_RANGE = (0.0, 100.0)


def parse_cfg_scale(value) -> float:
    """A finite guidance scale in ``CFG_SCALE_RANGE``; anything else a ValueError saying why."""
    lo, hi = CFG_SCALE_RANGE
    allowed = (f"a number from {lo:g} (unconditional) to {hi:g}; 1 = no guidance, DiT uses 1.5-4, and far larger "
               f"scales saturate the samples or overflow to NaN")
    return number_in(value, lo, hi, f"guidance scale must be {allowed}")


# diffusion/gaussian.py / diffusion/transport.py: objective settings.
BETA_SCHEDULES = ("linear", "cosine")
PATHS = ("linear", "gvp", "vp")
PREDICTIONS = ("velocity", "score", "noise")
LOSS_WEIGHTS = ("none", "velocity", "likelihood")
# Training-time distribution of both objectives (transport.noise_logits): DiT/SiT's uniform, or
# SD3's logit-normal (LightningDiT, Sana).
T_SAMPLINGS = ("uniform", "logit-normal")

# The sampler names, their families and default step counts, as the registry (``registry.py``)
# holds them when the package loads: the CLIs' choices. The checks below read the registry itself.
DIFFUSION_SAMPLERS = sampler_names("diffusion")
TRANSPORT_SAMPLERS = sampler_names("transport")
SAMPLERS = tuple(SAMPLER_SPECS)
# the samplers that can start part-way, from a re-noised image (SDEdit: --upscale-from)
RENOISE_SAMPLERS = sampler_names(renoise=True)
DEFAULT_STEPS = {name: spec.steps for name, spec in SAMPLER_SPECS.items()}

# The longest diffusion chain a DiT objective may have (--diffusion-steps; a checkpoint's ``diffusion-steps``, a
# pipeline's ``objective_config``, a scheduler's ``num_train_timesteps``): DiT trains 1,000 timesteps, iDDPM at
# most 4,000. Each timestep costs a few float64 table entries, so an edited 10^10 would ask for about 80 GB.
MAX_DIFFUSION_STEPS = 10_000
# The most steps a sampler takes. ddpm, ddim and dpm-solver step through distinct timesteps of the trained chain,
# so at most its length (DiT's 1,000): past it respacing has nothing left to keep and diffusers' DPM-Solver++
# repeats timesteps (NaN samples) or indexes past its tables. The ODE/SDE samplers integrate continuous time and
# could take any number: MAX_CONTINUOUS_STEPS is a practical bound, 40x SiT's 250 SDE steps, where the fixed-step
# solvers' discretisation error (Euler's O(1/n): about 1e-4) is far below the model's own, while every step is a
# full model call (minutes per image for an XL/2 at 256 px). It also bounds dopri5's --max-nfe; dopri5 reads no
# step count (adaptive), its --steps is held to the same bound. Checked by ``check_steps``.
MAX_CONTINUOUS_STEPS = 10_000
# the samplers that need more than one step (an SDE sampler's last step is one of them)
MIN_STEPS = {name: spec.min_steps for name, spec in SAMPLER_SPECS.items() if spec.min_steps > 1}


def max_steps(sampler: str, chain: int | None = None) -> int:
    """The most steps ``sampler`` takes: the trained chain's length ``chain`` for the discrete
    samplers (``MAX_DIFFUSION_STEPS`` when the chain is not known yet), else ``MAX_CONTINUOUS_STEPS``."""
    spec = SAMPLER_SPECS.get(sampler)
    if spec is not None and spec.objective == "diffusion":
        return MAX_DIFFUSION_STEPS if chain is None else chain
    return MAX_CONTINUOUS_STEPS


def check_steps(sampler: str, steps, chain: int | None = None, flag: str = "--steps", label: str | None = None,
                chain_flag: str | None = None) -> int:
    """``steps`` for ``sampler`` (a name of ``registry.SAMPLER_SPECS``) as an int from its ``min_steps`` to
    ``max_steps(sampler, chain)``; else one ValueError line naming ``flag``, the value and the
    sampler's limit. ``chain``: the diffusion's training timesteps (None: not known yet, then the
    discrete samplers are held to ``MAX_DIFFUSION_STEPS``). The one check of every caller: the
    CLIs, the web page (through ``sample.py``), the pipelines and ``generate``. ``label``: what
    the message calls the sampler (default its name); ``chain_flag``: the flag that set ``chain``."""
    spec = sampler_spec(sampler)
    least, most = spec.min_steps, max_steps(sampler, chain)
    label = label or sampler
    if spec.objective == "diffusion":
        why = (f"the {chain} {chain_flag}" if chain is not None and chain_flag
               else f"the model's {chain} training timesteps" if chain is not None
               else f"a model's training timesteps, at most {MAX_DIFFUSION_STEPS}")
        limit = f"{label} takes at most one step per training timestep ({why})"
    else:
        limit = f"{label} takes at most {most} steps (a practical bound: far finer than the model's own error)"
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise ValueError(f"{flag} must be a whole number of steps, got {steps!r}; {limit}")
    steps = int(steps)
    if steps < least:
        last = " (its last step is one of them)" if least > 1 else ""
        raise ValueError(f"{flag} must be >= {least} for {label}{last}, got {steps}")
    if steps > most:
        raise ValueError(f"{flag} {steps}: {limit}; use at most {most}")
    return steps


def check_diffusion_steps(value, where: str = "--diffusion-steps", fix: str = "") -> int:
    """A diffusion chain's length: an int from 1 to ``MAX_DIFFUSION_STEPS``, checked before any
    table of that length is allocated; else one ValueError line naming ``where`` and the value
    (``fix``: how to get a good one, e.g. restore the file)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIFFUSION_STEPS:
        raise ValueError(f"{where} must be a whole number of timesteps >= 1 and <= {MAX_DIFFUSION_STEPS:,} (DiT "
                         f"1,000), got {value!r}{f'; {fix}' if fix else ''}")
    return value


# MeanFlow's settings (meanflow.py), checked by train.py before torch loads
def check_meanflow(r_neq_t: float, adaptive_p: float, adaptive_c: float, cfg_omega: float, cfg_kappa: float,
                   cfg_interval: tuple[float, float]) -> None:
    """One ValueError line for a setting the objective cannot use."""
    if not 0.0 <= r_neq_t <= 1.0:
        raise ValueError(f"--mf-ratio (the share of samples with r != t) must be in [0, 1] (paper 0.25), got {r_neq_t}")
    if not (adaptive_p >= 0 and adaptive_c > 0):
        raise ValueError(f"--mf-adaptive-p must be >= 0 (0 = plain L2, paper 1.0) and --mf-adaptive-c > 0 (paper "
                         f"1e-3), got {adaptive_p} and {adaptive_c}")
    if not (cfg_kappa < 1 and cfg_omega >= 0 and 0 <= cfg_interval[0] <= cfg_interval[1] <= 1):
        raise ValueError(f"MeanFlow guidance needs --mf-cfg-omega >= 0, --mf-cfg-kappa < 1 (the effective scale is "
                         f"omega / (1 - kappa)) and an interval within [0, 1], got omega {cfg_omega}, kappa "
                         f"{cfg_kappa}, interval {cfg_interval}")


PRECISIONS = ("fp32", "bf16")
# dopri5 tolerances, as SiT's sample.py
ODE_ATOL, ODE_RTOL = 1e-6, 1e-3
