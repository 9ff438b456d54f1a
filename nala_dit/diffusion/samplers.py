"""Every sampler as a plain function ``(model_fn, noise, labels, ...) -> SampleOutput``.

``model_fn(x, t, y)`` follows the project convention: DiT models get the original
integer-valued timesteps 0..999 (as a float tensor), SiT models continuous t in [0, 1]
with t = 0 noise.  ``SampleOutput.nfe`` is the exact number of ``model_fn`` calls (a
classifier-free-guided model from ``guidance.cfg_model_fn`` counts as one call).

Step-count conventions:
- ``ddpm_sample`` / ``ddim_sample``: ``num_steps`` respaced steps (``space_timesteps``;
  t = 999 and t = 0 are always kept), one call each, so nfe == number of kept steps.
- ``ode_sample``: fixed-step methods take ``num_steps`` as the number of calls
  (Euler: num_steps steps; Heun: num_steps // 2 Heun steps plus one Euler step when
  num_steps is odd).  dopri5 is adaptive; bound it with ``max_nfe``.
- ``sde_sample``: ``num_steps`` steps in total, the last of which is the
  ``last_step`` (if not None) over ``last_step_size``, as in SiT.  Euler-Maruyama
  uses one call per step; Heun two per step except the last step, which uses one
  (so nfe = 2 (num_steps - 1) + 1 with a last step, 2 num_steps without).

References: DDPM (Ho et al. 2020), iDDPM (Nichol & Dhariwal 2021), DDIM (Song et al.
2021), SiT (Ma et al. 2024); equations are in ``gaussian.py`` and ``transport.py``.
"""

from dataclasses import dataclass

import torch

from .gaussian import GaussianDiffusion
from .transport import DIFFUSION_FORMS, Transport, _check, _expand, integrate_ode, shifted_grid

SDE_METHODS = ("euler", "heun")
LAST_STEPS = ("Mean", "Tweedie", "Euler", None)


@dataclass
class SampleOutput:
    samples: torch.Tensor
    nfe: int


class _Counted:
    """Wraps model_fn and counts its calls."""

    def __init__(self, model_fn):
        self.model_fn, self.nfe = model_fn, 0

    def __call__(self, x, t, y):
        self.nfe += 1
        return self.model_fn(x, t, y)


def _randn_like(x, generator):
    return torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)


def _maybe_tqdm(it, progress):
    """A step bar that disappears when done, under the caller's bar over images (silent off a terminal)."""
    if not progress:
        return it
    from ..progress import progress_bar

    return progress_bar(it, leave=False, desc="steps")


def _respaced(diffusion, num_steps, time_shift=1.0):
    if not isinstance(num_steps, str) and num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if num_steps == diffusion.num_timesteps and time_shift == 1.0:
        return diffusion
    return diffusion.respace(num_steps, time_shift)


def _first(d, first_step):
    if first_step is None:
        return d.num_timesteps - 1
    if not 0 <= first_step < d.num_timesteps:
        raise ValueError(f"first_step must be in [0, {d.num_timesteps - 1}], got {first_step}")
    return first_step


def ddpm_sample(diffusion: GaussianDiffusion, model_fn, noise, labels, num_steps=250,
                clip_denoised=False, generator=None, progress=False, time_shift=1.0, first_step=None):
    """Ancestral sampling (Ho 2020, alg. 2) with the diffusion's variance type.

    ``diffusion`` is the full (e.g. 1000-step) diffusion; it is respaced to
    ``num_steps`` here (an int, or any ``space_timesteps`` string), its steps moved by
    ``time_shift`` (``shift_timesteps``). ``first_step``: start at this index of the
    respaced chain with ``noise`` already at its level (SDEdit; default: the last, pure noise).
    """
    d = _respaced(diffusion, num_steps, time_shift)
    model = _Counted(model_fn)
    x = noise
    for i in _maybe_tqdm(reversed(range(_first(d, first_step) + 1)), progress):
        t = torch.full((x.shape[0],), i, device=x.device, dtype=torch.long)
        x, _ = d.p_sample(model, x, t, labels, _randn_like(x, generator), clip_denoised)
    return SampleOutput(x, model.nfe)


def ddim_sample(diffusion: GaussianDiffusion, model_fn, noise, labels, num_steps=50,
                eta=0.0, clip_denoised=False, generator=None, progress=False, time_shift=1.0, first_step=None):
    """DDIM (Song 2021, eq. 12); deterministic for eta = 0.  Uses the eps channels only."""
    d = _respaced(diffusion, num_steps, time_shift)
    model = _Counted(model_fn)
    x = noise
    for i in _maybe_tqdm(reversed(range(_first(d, first_step) + 1)), progress):
        t = torch.full((x.shape[0],), i, device=x.device, dtype=torch.long)
        z = _randn_like(x, generator) if eta > 0 else None
        x, _ = d.ddim_step(model, x, t, labels, z, eta, clip_denoised)
    return SampleOutput(x, model.nfe)


def ode_sample(transport: Transport, model_fn, noise, labels, method="dopri5", num_steps=50,
               atol=1e-6, rtol=1e-3, max_nfe=None, options=None, progress=False, time_shift=1.0, t_start=None):
    """Probability-flow ODE dx = v dt from noise (t0) to data (t1); see module doc for nfe.

    ``t_start``: begin there instead of t0, ``noise`` being x at that time (SDEdit)."""
    model = _Counted(model_fn)
    t0, t1 = transport.interval()
    t0 = t0 if t_start is None else t_start

    def f(state, t):
        return (transport.velocity(model, state[0], t, labels),)

    (x,), _ = integrate_ode(f, (noise,), t0, t1, method, num_steps, atol=atol, rtol=rtol,
                            max_nfe=max_nfe, options=options, progress=progress, time_shift=time_shift)
    return SampleOutput(x, model.nfe)


def sde_sample(transport: Transport, model_fn, noise, labels, method="euler", num_steps=250,
               diffusion_form="sigma", diffusion_norm=1.0, last_step="Mean",
               last_step_size=0.04, generator=None, progress=False, time_shift=1.0):
    """SDE dx = [v + D s] dt + sqrt(2 D) dW from noise to data (SiT's ``sample_sde``).

    Integrates t0 -> 1 - last_step_size on a uniform grid of num_steps - 1 steps
    (num_steps without a last step, up to 1 - sample_eps), then takes ``last_step``:
    "Mean" (one drift step, no noise), "Tweedie" (E[x_1 | x_t] from the score),
    "Euler" (one ODE step) or None. ``time_shift`` places the grid (``shifted_grid``).
    """
    _check("SDE method", method, SDE_METHODS)
    _check("last_step", last_step, LAST_STEPS)
    _check("diffusion_form", diffusion_form, DIFFUSION_FORMS)
    if num_steps < 1 or (last_step is not None and num_steps < 2):
        raise ValueError(f"num_steps must be >= 1 (>= 2 with a last step), got {num_steps}")
    if last_step is None:
        last_step_size = 0.0
    model = _Counted(model_fn)
    t0, t1 = transport.interval(sde=True, diffusion_form=diffusion_form,
                                last_step_size=last_step_size)
    n = num_steps if last_step is None else num_steps - 1
    grid = shifted_grid(t0, t1, n, time_shift)

    def drift(x, t):
        return transport.sde_drift(model, x, t, labels, diffusion_form, diffusion_norm)

    x = noise
    for i in _maybe_tqdm(range(n), progress):
        t, h = grid[i], grid[i + 1] - grid[i]
        dw = _randn_like(x, generator) * h ** 0.5
        if method == "euler":
            b, d = drift(x, t)
            x = x + b * h + torch.sqrt(2 * d) * dw
        else:
            # SiT's stochastic Heun: add the noise first, then a Heun step of the drift.
            d = transport.diffusion_coefficient(x, t, diffusion_form, diffusion_norm)
            x_hat = x + torch.sqrt(2 * d) * dw
            k1, _ = drift(x_hat, t)
            k2, _ = drift(x_hat + h * k1, grid[i + 1])
            x = x_hat + 0.5 * h * (k1 + k2)

    t = grid[-1]
    if last_step == "Mean":
        x = x + drift(x, t)[0] * last_step_size
    elif last_step == "Euler":
        x = x + transport.velocity(model, x, t, labels) * last_step_size
    elif last_step == "Tweedie":
        te = _expand(t, x)
        alpha, sigma = transport.path.alpha(te)[0], transport.path.sigma(te)[0]
        x = (x + sigma ** 2 * transport.score(model, x, t, labels)) / alpha
    # Path coefficients are at least float32, so low-precision noise got promoted.
    return SampleOutput(x.to(noise.dtype), model.nfe)


def likelihood(transport: Transport, model_fn, x, labels, method="dopri5", num_steps=50,
               estimator="rademacher", atol=1e-6, rtol=1e-3, max_nfe=None, generator=None):
    """Bits/dim of x under the probability-flow ODE; see ``Transport.log_likelihood``."""
    return transport.log_likelihood(model_fn, x, labels, method, num_steps, estimator,
                                    atol, rtol, max_nfe, generator)
