"""SiT transport: interpolant paths, training objectives, drifts and likelihood.

Convention of SiT (Ma et al. 2024): t in [0, 1], t = 0 is noise, t = 1 is data,

    x_t = alpha_t x_1 + sigma_t eps,   x_1 ~ data, eps ~ N(0, I)     (SiT's compute_mu_t)

Paths (alpha_t, sigma_t):
    Linear: t, 1 - t
    GVP:    sin(pi t / 2), cos(pi t / 2)
    VP:     exp(-(1-t)^2 (b_max - b_min) / 4 - (1-t) b_min / 2), sqrt(1 - alpha_t^2),
            b_min = 0.1, b_max = 20, i.e. beta_t = b_min + (1-t)(b_max - b_min)  (VPCPlan)

The model predicts one of
    velocity  E[u_t | x_t], u_t = alpha'_t x_1 + sigma'_t eps      (SiT's compute_ut)
    score     grad log p_t(x_t) = -E[eps | x_t] / sigma_t
    noise     E[eps | x_t]
With r_t = alpha'_t / alpha_t and the drift variance w_t = r_t sigma_t^2 - sigma_t sigma'_t
(SiT's compute_drift):

    v = r_t x + w_t s                  (velocity from score)
    s = (v / r_t - x) / (w_t / r_t)    (score from velocity; alpha_t / alpha'_t is
                                        finite at t = 0, r_t is not)

Losses (SiT's training_losses), per sample averaged over dimensions:
    velocity  ||v_hat - u_t||^2
    noise     lambda_t ||eps_hat - eps||^2
    score     lambda_t ||sigma_t s_hat + eps||^2
with lambda_t = 1 ("none"), (w_t / sigma_t)^2 ("velocity") or w_t / sigma_t^2
("likelihood").

Sampling runs from noise (t0 ~ 0) to data (t1 ~ 1):
    ODE  dx = v dt                                    (probability flow)
    SDE  dx = (v + D_t s) dt + sqrt(2 D_t) dW         (any D_t >= 0 keeps p_t)
D_t is the "diffusion form" of SiT's compute_diffusion: constant, SBDM (w_t), sigma
(sigma_t, the default), linear (1 - t), decreasing, increasing-decreasing.

Likelihood (FFJORD, Grathwohl et al. 2019; SiT's ODE likelihood): along the ODE
d log p_t(x_t) / dt = -div v(x_t, t), so

    log p_1(x) = log N(x_0; 0, I) - int_0^1 div v(x_t, t) dt

integrated from t = 1 back to 0, with div v by Hutchinson's E_z[z^T (dv/dx) z], z
Gaussian or Rademacher.

Endpoints follow SiT's create_transport/check_interval: velocity models on Linear/GVP
are regular on [0, 1] (eps = 0); score/noise models and VP keep eps away from the
singular ends (see ``Transport.interval``).
"""

import math

import torch


class SolverBudgetExceeded(RuntimeError, ValueError):
    """An adaptive ODE solve needed more function evaluations than ``max_nfe`` allows.

    A ValueError too: the CLIs report it as the bad value it is (``--max-nfe`` too small),
    in one line."""

from .choices import LOSS_WEIGHTS, PATHS, PREDICTIONS, T_SAMPLINGS  # noqa: F401  (plain data, shared with the CLIs)

DIFFUSION_FORMS = ("constant", "SBDM", "sigma", "linear", "decreasing", "increasing-decreasing")
DIVERGENCE_ESTIMATORS = ("gaussian", "rademacher")


def _check(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(map(str, allowed))}")


def _time_dtype(x):
    # Times stay in at least float32: in bf16, 0.999 rounds to 1.0 where VP is singular.
    return torch.promote_types(x.dtype, torch.float32)


def _expand(t, x):
    """(B,) or scalar t -> broadcastable against x (B, ...)."""
    t = torch.as_tensor(t, dtype=_time_dtype(x), device=x.device)
    if t.ndim == 0:
        t = t.expand(x.shape[0])
    return t.reshape(-1, *([1] * (x.ndim - 1)))


def mean_flat(x):
    return x.mean(dim=tuple(range(1, x.ndim)))


class Path:
    """alpha_t, sigma_t and their time derivatives for one interpolant."""

    def __init__(self, kind="linear", beta_min=0.1, beta_max=20.0):
        _check("path", kind, PATHS)
        self.kind, self.beta_min, self.beta_max = kind, beta_min, beta_max

    def alpha(self, t):
        """(alpha_t, d alpha_t / dt)."""
        if self.kind == "linear":
            return t, torch.ones_like(t)
        if self.kind == "gvp":
            return torch.sin(t * math.pi / 2), math.pi / 2 * torch.cos(t * math.pi / 2)
        a = torch.exp(self._log_mean(t))
        return a, a * self._d_log_mean(t)

    def sigma(self, t):
        """(sigma_t, d sigma_t / dt)."""
        if self.kind == "linear":
            return 1 - t, -torch.ones_like(t)
        if self.kind == "gvp":
            return torch.cos(t * math.pi / 2), -math.pi / 2 * torch.sin(t * math.pi / 2)
        a2 = torch.exp(2 * self._log_mean(t))
        s = torch.sqrt(1 - a2)
        return s, -a2 * self._d_log_mean(t) / s

    def alpha_over_dalpha(self, t):
        """alpha_t / alpha'_t, finite at t = 0 for every path (1 / r_t)."""
        if self.kind == "linear":
            return t
        if self.kind == "gvp":
            return torch.tan(t * math.pi / 2) * 2 / math.pi
        return 1 / self._d_log_mean(t)

    def drift_var(self, t):
        """w_t = r_t sigma_t^2 - sigma_t sigma'_t (SiT's ``compute_drift`` second term)."""
        if self.kind == "vp":
            # Simplifies to beta_t / 2 because sigma^2 + alpha^2 = 1.
            return 0.5 * (self.beta_min + (1 - t) * (self.beta_max - self.beta_min))
        s, ds = self.sigma(t)
        return s ** 2 / self.alpha_over_dalpha(t) - s * ds

    def _log_mean(self, t):
        return (-0.25 * (1 - t) ** 2 * (self.beta_max - self.beta_min)
                - 0.5 * (1 - t) * self.beta_min)

    def _d_log_mean(self, t):
        return 0.5 * (1 - t) * (self.beta_max - self.beta_min) + 0.5 * self.beta_min


def shift_time(t, s: float):
    """The resolution-aware time shift of SD3 / Sana in SiT's time (t = 1 is data).

    With u = 1 − t the noise fraction, SD3 maps u ↦ s·u / (1 + (s − 1)·u); in t that is
    t ↦ t / (t + s·(1 − t)). On the linear path it divides the SNR (t / (1 − t))² by s²,
    i.e. shifts log-SNR by −2·log s, the same rule ``diffusion.shift_timesteps`` applies to
    DiT. s > 1 spends more of the time line near noise; 0 and 1 stay fixed.
    """
    return t / (t + s * (1 - t))


def noise_logits(batch: int, mean: float, std: float, device=None, generator=None) -> torch.Tensor:
    """Logit-normal training times (SD3, §3.1; LightningDiT; Sana) as logits: the noise
    fraction is ``sigmoid(mean + std·z)``, z ~ N(0, 1), so a positive ``mean`` spends more
    steps near noise. SiT's time is ``sigmoid(−logit)`` (t = 1 is data); DiT's index
    ``floor(T·sigmoid(logit))`` (``GaussianDiffusion.sample_timesteps``)."""
    return mean + std * torch.randn(batch, device=device, generator=generator)


def check_t_sampling(t_sampling: str, t_mean: float, t_std: float) -> None:
    """Raise unless the training-time distribution is one this repo draws."""
    _check("t_sampling", t_sampling, T_SAMPLINGS)
    if not (math.isfinite(t_mean) and math.isfinite(t_std) and t_std > 0):
        raise ValueError(f"logit-normal t needs a finite t-mean and a t-std > 0, got t-mean {t_mean}, t-std {t_std}")


def shifted_grid(t0: float, t1: float, n: int, s: float = 1.0) -> list[float]:
    """n + 1 times from t0 to t1: uniform, or with ``shift_time`` applied to the fraction
    of the interval covered (endpoints exact)."""
    if s == 1.0:
        return torch.linspace(t0, t1, n + 1, dtype=torch.float64).tolist()
    u = shift_time(torch.linspace(0.0, 1.0, n + 1, dtype=torch.float64), s)
    grid = (t0 + (t1 - t0) * u).tolist()
    grid[0], grid[-1] = t0, t1
    return grid


class Transport:
    """A SiT transport: a path, what the model predicts, and how the loss is weighted.

    ``train_eps``/``sample_eps`` default to SiT's values: 1e-5 / 1e-3 on VP, 1e-3 / 1e-3
    for score or noise prediction on Linear/GVP, 0 / 0 for velocity on Linear/GVP.
    """

    def __init__(self, path="linear", prediction="velocity", loss_weight="none",
                 train_eps=None, sample_eps=None, time_shift: float = 1.0, t_sampling: str = "uniform",
                 t_mean: float = 0.0, t_std: float = 1.0):
        if not time_shift > 0:
            raise ValueError(f"time_shift must be > 0 (1 = no shift), got {time_shift}")
        self.time_shift = float(time_shift)  # training times (``sample_t``); samplers take their own
        check_t_sampling(t_sampling, t_mean, t_std)
        self.t_sampling, self.t_mean, self.t_std = t_sampling, float(t_mean), float(t_std)
        _check("prediction", prediction, PREDICTIONS)
        _check("loss_weight", loss_weight, LOSS_WEIGHTS)
        if prediction == "velocity" and loss_weight != "none":
            # SiT silently ignores the weight for velocity models; say so instead.
            raise ValueError(f"loss_weight {loss_weight!r} only applies to score/noise "
                             "prediction; allowed for velocity: none")
        self.path = Path(path)
        self.prediction, self.loss_weight = prediction, loss_weight
        if path == "vp":
            default = (1e-5, 1e-3)
        elif prediction != "velocity":
            default = (1e-3, 1e-3)
        else:
            default = (0.0, 0.0)
        self.train_eps = default[0] if train_eps is None else train_eps
        self.sample_eps = default[1] if sample_eps is None else sample_eps

    def interval(self, *, train=False, sde=False, diffusion_form="sigma", last_step_size=0.0):
        """(t0, t1) integrated over, after SiT's ``check_interval``.

        VP is singular at t = 1 (sigma = 0), score/noise models on Linear/GVP at both
        ends.  For SDEs the last ``last_step_size`` is covered by a separate step.
        """
        eps = self.train_eps if train else self.sample_eps
        t0, t1 = 0.0, 1.0
        if self.path.kind == "vp":
            t1 = 1 - eps if (not sde or last_step_size == 0) else 1 - last_step_size
        elif self.prediction != "velocity" or sde:
            if self.prediction != "velocity" or (sde and diffusion_form == "SBDM"):
                # SBDM's D_t = w_t blows up at t = 0 on Linear/GVP; SiT uses eps = 0
                # for velocity models there, which would start at infinity.
                t0 = eps if eps > 0 else 1e-3
            t1 = 1 - eps if (not sde or last_step_size == 0) else 1 - last_step_size
        return t0, t1

    def sample_t(self, batch, device=None, generator=None):
        """Training times in the training interval: uniform (SiT), or logit-normal
        (``noise_logits``), then moved by ``time_shift``."""
        t0, t1 = self.interval(train=True)
        if self.t_sampling == "uniform":
            u = torch.rand(batch, device=device, generator=generator)
        else:
            u = torch.sigmoid(-noise_logits(batch, self.t_mean, self.t_std, device, generator))
        if self.time_shift != 1.0:
            u = shift_time(u, self.time_shift)
        return u * (t1 - t0) + t0

    def interpolate(self, t, noise, x1):
        """(x_t, u_t): the point on the path and the conditional velocity target."""
        te = _expand(t, x1)
        a, da = self.path.alpha(te)
        s, ds = self.path.sigma(te)
        return a * x1 + s * noise, da * x1 + ds * noise

    def training_losses(self, model_fn, x1, y, t=None, noise=None, generator=None):
        """Per-sample loss dict {``loss``} (SiT's ``training_losses``)."""
        if t is None:
            t = self.sample_t(x1.shape[0], x1.device, generator)
        if noise is None:
            noise = torch.randn(x1.shape, generator=generator, dtype=x1.dtype, device=x1.device)
        x_t, u_t = self.interpolate(t, noise, x1)
        out = model_fn(x_t, t, y)[:, :x1.shape[1]]
        if self.prediction == "velocity":
            return {"loss": mean_flat((out - u_t) ** 2)}
        te = _expand(t, x1)
        sigma, _ = self.path.sigma(te)
        w = self.path.drift_var(te)
        weight = {"none": 1.0, "velocity": (w / sigma) ** 2, "likelihood": w / sigma ** 2}
        weight = weight[self.loss_weight]
        if self.prediction == "noise":
            return {"loss": mean_flat(weight * (out - noise) ** 2)}
        # Score target -eps / sigma, scaled by sigma to keep the loss O(1).
        return {"loss": mean_flat(weight * (out * sigma + noise) ** 2)}

    def velocity_to_score(self, v, x, t):
        te = _expand(t, x)
        ratio = self.path.alpha_over_dalpha(te)
        s, ds = self.path.sigma(te)
        return (ratio * v - x) / (s ** 2 - ratio * s * ds)

    def score_to_velocity(self, score, x, t):
        te = _expand(t, x)
        return x / self.path.alpha_over_dalpha(te) + self.path.drift_var(te) * score

    def noise_to_score(self, noise, x, t):
        return -noise / self.path.sigma(_expand(t, x))[0]

    def score_to_noise(self, score, x, t):
        return -score * self.path.sigma(_expand(t, x))[0]

    def velocity_to_noise(self, v, x, t):
        return self.score_to_noise(self.velocity_to_score(v, x, t), x, t)

    def noise_to_velocity(self, noise, x, t):
        return self.score_to_velocity(self.noise_to_score(noise, x, t), x, t)

    def _call(self, model_fn, x, t, y):
        t = torch.as_tensor(t, dtype=_time_dtype(x), device=x.device)
        if t.ndim == 0:
            t = t.expand(x.shape[0])
        return model_fn(x, t, y)[:, :x.shape[1]]

    def velocity(self, model_fn, x, t, y):
        """ODE drift v(x, t) from one model call, whatever the prediction."""
        out = self._call(model_fn, x, t, y)
        if self.prediction == "velocity":
            return out
        if self.prediction == "noise":
            out = self.noise_to_score(out, x, t)
        return self.score_to_velocity(out, x, t)

    def score(self, model_fn, x, t, y):
        out = self._call(model_fn, x, t, y)
        if self.prediction == "score":
            return out
        if self.prediction == "noise":
            return self.noise_to_score(out, x, t)
        return self.velocity_to_score(out, x, t)

    def diffusion_coefficient(self, x, t, form="sigma", norm=1.0):
        """D_t of the SDE (SiT's ``compute_diffusion``); noise enters as sqrt(2 D_t)."""
        _check("diffusion_form", form, DIFFUSION_FORMS)
        te = _expand(t, x)
        if form == "constant":
            return torch.full_like(te, norm)
        if form == "SBDM":
            return norm * self.path.drift_var(te)
        if form == "sigma":
            return norm * self.path.sigma(te)[0]
        if form == "linear":
            return norm * (1 - te)
        if form == "decreasing":
            return 0.25 * (norm * torch.cos(math.pi * te) + 1) ** 2
        return norm * torch.sin(math.pi * te) ** 2

    def sde_drift(self, model_fn, x, t, y, form="sigma", norm=1.0):
        """(drift, D_t) of dx = [v + D_t s] dt + sqrt(2 D_t) dW, from one model call."""
        out = self._call(model_fn, x, t, y)
        if self.prediction == "velocity":
            v, s = out, self.velocity_to_score(out, x, t)
        else:
            s = self.noise_to_score(out, x, t) if self.prediction == "noise" else out
            v = self.score_to_velocity(s, x, t)
        d = self.diffusion_coefficient(x, t, form, norm)
        return v + d * s, d

    def prior_logp(self, z):
        """Exact log N(z; 0, I) per sample, in nats."""
        D = z[0].numel()
        return -0.5 * D * math.log(2 * math.pi) - 0.5 * z.flatten(1).pow(2).sum(1)

    def log_likelihood(self, model_fn, x1, y, method="dopri5", num_steps=50,
                       estimator="rademacher", atol=1e-6, rtol=1e-3, max_nfe=None,
                       generator=None):
        """Bits/dim of data x1 by the augmented probability-flow ODE (see module doc).

        Integrates (x, delta) from t1 (data) down to t0 (noise) with
        d delta / dt = div v, so delta(t0) = -int_{t0}^{t1} div v dt and
        log p(x1) = log N(x_t0; 0, I) + delta(t0).  One Hutchinson probe
        z per sample is drawn once and reused along the trajectory (FFJORD).
        Returns a dict: ``bpd``, ``logp`` (nats), ``prior_logp``, ``nfe``.
        """
        _check("estimator", estimator, DIVERGENCE_ESTIMATORS)
        z = torch.randn(x1.shape, generator=generator, dtype=x1.dtype, device=x1.device)
        if estimator == "rademacher":
            z = torch.sign(z)
            z[z == 0] = 1

        def f(state, t):
            x = state[0]
            with torch.enable_grad():
                x = x.detach().requires_grad_(True)
                v = self.velocity(model_fn, x, t, y)
                (vjp,) = torch.autograd.grad(v, x, z)
            div = (vjp * z).flatten(1).sum(1)
            return v.detach(), div.detach()

        t0, t1 = self.interval()
        state0 = (x1, torch.zeros(x1.shape[0], dtype=x1.dtype, device=x1.device))
        (x0, delta), nfe = integrate_ode(f, state0, t1, t0, method, num_steps,
                                         atol=atol, rtol=rtol, max_nfe=max_nfe)
        prior = self.prior_logp(x0)
        logp = prior + delta
        D = x1[0].numel()
        return {"bpd": -logp / (D * math.log(2.0)), "logp": logp, "prior_logp": prior,
                "nfe": nfe}


ODE_METHODS = ("euler", "heun", "dopri5")


def integrate_ode(f, state, t0, t1, method="euler", num_steps=50, atol=1e-6, rtol=1e-3,
                  max_nfe=None, options=None, progress=False, time_shift=1.0):
    """Integrate d state / dt = f(state, t) from t0 to t1 (either direction).

    ``state`` is a tuple of tensors; f gets it and a scalar time tensor and returns a
    tuple of derivatives.  Returns ``(state, nfe)`` where nfe counts calls of f.

    ``num_steps`` is the number of evaluations of f for the fixed-step methods:
    Euler takes num_steps steps; Heun takes num_steps // 2 Heun steps (2 evaluations
    each) and, when num_steps is odd, one final Euler step, on a uniform grid of
    ceil(num_steps / 2) intervals.  It is ignored by dopri5 (adaptive, via
    torchdiffeq), whose evaluations are counted and, with ``max_nfe``, bounded: the
    solve stops with a RuntimeError once it would exceed that many.  ``options`` is
    passed to ``torchdiffeq.odeint`` (e.g. ``{"max_num_steps": 100}``). ``time_shift``
    places the fixed-step grid with ``shifted_grid`` (an adaptive solver has no grid).
    """
    _check("ODE method", method, ODE_METHODS)
    state = tuple(state)
    x_ref = state[0]
    nfe = 0

    def call(s, t):
        nonlocal nfe
        if max_nfe is not None and nfe >= max_nfe:
            raise SolverBudgetExceeded(f"ODE solver needed more than max_nfe={max_nfe} function "
                                       "evaluations; raise max_nfe (--max-nfe) or loosen atol/rtol")
        nfe += 1
        return tuple(f(s, torch.as_tensor(t, dtype=_time_dtype(x_ref), device=x_ref.device)))

    if method == "dopri5":
        from torchdiffeq import odeint

        if time_shift != 1.0:
            raise ValueError(f"a time shift ({time_shift}) places the steps of a fixed-step solver; dopri5 chooses "
                             "its own steps: use --sampler ode-heun or ode-euler, or drop --time-shift")

        ts = torch.tensor([t0, t1], dtype=_time_dtype(x_ref), device=x_ref.device)
        # torchdiffeq steps past the end and interpolates back; the paths are not
        # defined beyond [0, 1] (VP's sigma is NaN there), so make it land on t1.
        options = {"step_t": ts[1:], **(options or {})}
        out = odeint(lambda t, s: call(s, t), state, ts, method="dopri5",
                     atol=atol, rtol=rtol, options=options)
        return tuple(o[-1] for o in out), nfe

    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    n_heun, n_euler = (0, num_steps) if method == "euler" else divmod(num_steps, 2)
    grid = shifted_grid(t0, t1, n_heun + n_euler, time_shift)
    steps = range(n_heun + n_euler)
    if progress:
        from ..progress import progress_bar

        steps = progress_bar(steps, leave=False, desc="steps")
    for i in steps:
        t, t_next = grid[i], grid[i + 1]
        h = t_next - t
        k1 = call(state, t)
        euler = tuple(s + h * k for s, k in zip(state, k1))
        if i < n_heun:
            k2 = call(euler, t_next)
            state = tuple(s + 0.5 * h * (a + b) for s, a, b in zip(state, k1, k2))
        else:
            state = euler
    return state, nfe
