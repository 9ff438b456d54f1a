"""MeanFlow (Geng, Deng, Bai, Kolter, He 2025, "Mean Flows for One-step Generative Modeling",
arXiv 2505.13447): a transport model that predicts the *average* velocity between two times,
so one step of it lands on the data.

In SiT's time (t = 0 noise, t = 1 data; the paper runs the other way, t_paper = 1 − t) a
MeanFlow network ``u(z_t, t, r)`` predicts, for an end time r ≥ t,

    u(z_t, t, r) = 1/(r − t) ∫_t^r v(z_τ, τ) dτ,    so    z_r = z_t + (r − t) · u(z_t, t, r),

with v the transport's (marginal) velocity; u(z, t, t) = v(z, t). Differentiating
(r − t)·u = ∫_t^r v dτ along the trajectory (dz_t/dt = v, r fixed) gives the MeanFlow identity

    u = v − (t − r) · du/dt,    du/dt = v·∂_z u + ∂_t u,

the same formula as the paper's in its own time. Training regresses u on that right-hand
side with the conditional velocity v_t = α'x₁ + σ'ε in place of v (its mean given z_t) and
the network's own du/dt, one ``torch.func.jvp`` of the network along the tangent (v, 1) in
(z, t) with r held, the target detached (stop-gradient, the paper's Eq. 10). NaLa's every
path has a forward-mode rule for it (``nala_dit/attention/nala/tangent.py``).

The network (``DiT(mean_flow=True)``) takes r as a second time, the interval r − t embedded
as t is (the paper's (t, t − r) embedding, Table 1c), its embedder's output layer
zero-initialised: a SiT checkpoint's weights give the SiT's velocity at every r, and a
MeanFlow model's u(z, t, t) is a velocity, so the transport's ODE and SDE samplers stay
valid for it; the ``meanflow`` sampler (``meanflow_sample``) takes 1 to few steps.

Constants (the paper's ImageNet 256 settings, its Table 4 and ablations Table 1):
``R_NEQ_T`` = 0.25 of the samples have r ≠ t (Table 1a: 25 % best; the rest r = t, plain
flow matching); times logit-normal with mean −0.4 and std 1.0 in the paper's time
(Table 1d), the larger of two draws is t_paper; the adaptive weight ``w = 1/(‖Δ‖² + c)^p``
(§4.3, Eq. 11: sg(w)·‖Δ‖², squared error summed over the dimensions) with p = 1.0
(Table 1e) and c = 1e-3; guidance folded into the target (§4.2 and Appendix B.1, Eq. 21):
ṽ = ω v + κ u(z_t, t, t | c) + (1 − ω − κ) u(z_t, t, t | ∅) for the samples that keep their
class, whose fixed point is CFG with the effective scale ω' = ω/(1 − κ) (B/2: ω = 1.0,
κ = 0.5, ω' = 2; XL/2: ω = 0.2, κ = 0.92, ω' = 2.5, applied for t_paper in [0, 0.75]); off
by default here (ω = 1, κ = 0).
"""

from __future__ import annotations

import torch

from .choices import check_meanflow
from .transport import Transport, _expand, noise_logits, shifted_grid

R_NEQ_T = 0.25                  # share of samples with r ≠ t (paper Table 1a)
MF_T_MEAN, MF_T_STD = -0.4, 1.0  # logit-normal (r, t), in the paper's time (Table 1d)
ADAPTIVE_P, ADAPTIVE_C = 1.0, 1e-3   # adaptive loss weight 1/(‖Δ‖² + c)^p (§4.3, Table 1e)


class MeanFlow(Transport):
    """A ``Transport`` trained with the MeanFlow objective (see the module doc). Sampling
    with the transport's samplers uses u(z, t, t) = v; ``training_losses`` is MeanFlow's.

    ``r_neq_t``, ``t_mean``/``t_std`` (logit-normal, paper time), ``adaptive_p``/``adaptive_c``,
    ``cfg_omega``/``cfg_kappa`` and ``cfg_interval`` (in the paper's time t_paper = 1 − t) as
    the module doc; ``null_label`` is the model's "no class" label and ``drop_prob`` its label
    dropout (with guidance in the target the labels are dropped here, the model's own dropout
    fixed off)."""

    mean_flow = True

    def __init__(self, *, r_neq_t: float = R_NEQ_T, mf_t_mean: float = MF_T_MEAN, mf_t_std: float = MF_T_STD,
                 adaptive_p: float = ADAPTIVE_P, adaptive_c: float = ADAPTIVE_C, cfg_omega: float = 1.0,
                 cfg_kappa: float = 0.0, cfg_interval: tuple[float, float] = (0.0, 1.0), null_label: int | None = None,
                 drop_prob: float = 0.0, **transport):
        super().__init__(**transport)
        if self.prediction != "velocity":
            raise ValueError(f"MeanFlow predicts (average) velocities: use --prediction velocity, got "
                             f"{self.prediction!r}")
        check_meanflow(r_neq_t, adaptive_p, adaptive_c, cfg_omega, cfg_kappa, tuple(cfg_interval))
        self.r_neq_t, self.mf_t_mean, self.mf_t_std = float(r_neq_t), float(mf_t_mean), float(mf_t_std)
        self.adaptive_p, self.adaptive_c = float(adaptive_p), float(adaptive_c)
        self.cfg_omega, self.cfg_kappa, self.cfg_interval = float(cfg_omega), float(cfg_kappa), tuple(cfg_interval)
        self.null_label, self.drop_prob = null_label, float(drop_prob)

    @property
    def guided(self) -> bool:
        return (self.cfg_omega, self.cfg_kappa) != (1.0, 0.0)

    def sample_times(self, batch: int, device=None, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(t, r) in SiT's time, r ≥ t: two logit-normal draws in the paper's time, the larger
        t_paper; r = t for all but a share ``r_neq_t`` of the samples (paper §4.3, Table 1)."""
        a = torch.sigmoid(noise_logits(batch, self.mf_t_mean, self.mf_t_std, device, generator))
        b = torch.sigmoid(noise_logits(batch, self.mf_t_mean, self.mf_t_std, device, generator))
        t_paper, r_paper = torch.maximum(a, b), torch.minimum(a, b)
        keep = torch.rand(batch, device=device, generator=generator) < self.r_neq_t
        r_paper = torch.where(keep, r_paper, t_paper)
        t0, t1 = self.interval(train=True)
        to_sit = lambda u: (1 - u) * (t1 - t0) + t0       # noqa: E731
        return to_sit(t_paper), to_sit(r_paper)

    def target(self, model_fn, x_t, t, r, v, y, **model_kw) -> tuple[torch.Tensor, torch.Tensor]:
        """``(u, u_tgt)``: the network's u(x_t, t, r) (differentiable) and the detached target
        ``v − (t − r)(v·∂_z u + ∂_t u)`` from one ``torch.func.jvp`` along (v, 1)."""
        c = x_t.shape[1]
        fn = lambda z, tt: model_fn(z, tt, y, r=r, **model_kw)[:, :c]   # noqa: E731
        u, du_dt = torch.func.jvp(fn, (x_t, t), (v, torch.ones_like(t)))
        gap = _expand(t - r, x_t)
        return u, (v - gap * du_dt).detach()

    def guided_velocity(self, model_fn, x_t, t, v, y, dropped, null_label) -> torch.Tensor:
        """ṽ = ω v + κ u(z_t, t, t | c) + (1 − ω − κ) u(z_t, t, t | ∅) for the samples that keep
        their class and whose t_paper lies in ``cfg_interval``; v elsewhere (detached)."""
        c = x_t.shape[1]
        with torch.no_grad():
            null = torch.full_like(y, null_label)
            both = model_fn(torch.cat([x_t, x_t]), torch.cat([t, t]), torch.cat([y, null]),
                            force_drop_ids=torch.zeros(2 * len(y), dtype=torch.long, device=y.device))[:, :c]
            cond, uncond = both.chunk(2)
        mixed = self.cfg_omega * v + self.cfg_kappa * cond + (1 - self.cfg_omega - self.cfg_kappa) * uncond
        t_paper = 1 - t
        inside = (~dropped) & (t_paper >= self.cfg_interval[0]) & (t_paper <= self.cfg_interval[1])
        return torch.where(inside.view(-1, *[1] * (x_t.ndim - 1)), mixed, v)

    def training_losses(self, model_fn, x1, y, t=None, noise=None, generator=None, r=None):
        """Per-sample ``{"loss": sg(w)·‖u − u_tgt‖², "mse": ‖u − u_tgt‖² / dims}``.

        ``t``/``r`` None: drawn (``sample_times``); ``t`` given and ``r`` None: r = t."""
        if t is None:
            t, r = self.sample_times(x1.shape[0], x1.device, generator)
        elif r is None:
            r = t
        if noise is None:
            noise = torch.randn(x1.shape, generator=generator, dtype=x1.dtype, device=x1.device)
        x_t, v = self.interpolate(t, noise, x1)
        t = t.to(x_t.dtype) if t.dtype != x_t.dtype and x_t.dtype == torch.float64 else t
        model_kw = {}
        if self.guided:
            null_label = self.null_label
            if null_label is None:
                raise ValueError("MeanFlow guidance in the target (--mf-cfg-omega / --mf-cfg-kappa) needs a model with "
                                 "a null class (--class-dropout-prob > 0)")
            dropped = torch.rand(len(y), device=y.device, generator=generator) < self.drop_prob
            y = torch.where(dropped, torch.full_like(y, null_label), y)
            model_kw["force_drop_ids"] = torch.zeros(len(y), dtype=torch.long, device=y.device)
            v = self.guided_velocity(model_fn, x_t, t, v, y, dropped, null_label)
        u, u_tgt = self.target(model_fn, x_t, t, r, v, y, **model_kw)
        sq = (u - u_tgt).pow(2).flatten(1).sum(1)
        weight = (sq.detach() + self.adaptive_c).pow(-self.adaptive_p) if self.adaptive_p else 1.0
        return {"loss": weight * sq, "mse": sq.detach() / x1[0].numel()}


def meanflow_sample(objective, model_fn, noise, labels, num_steps: int = 1, progress: bool = False,
                    time_shift: float = 1.0):
    """``num_steps`` MeanFlow steps z_r = z_t + (r − t)·u(z_t, t, r) over the sampling
    interval (``shifted_grid``: uniform, or placed by ``time_shift``); one model call each."""
    from .samplers import SampleOutput, _maybe_tqdm

    if not getattr(objective, "mean_flow", False):
        raise ValueError(MEANFLOW_ONLY)
    t0, t1 = objective.interval()
    grid = shifted_grid(t0, t1, num_steps, time_shift)
    x, c = noise, noise.shape[1]
    for i in _maybe_tqdm(range(num_steps), progress):
        t = torch.full((x.shape[0],), grid[i], dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        r = torch.full_like(t, grid[i + 1])
        x = x + (grid[i + 1] - grid[i]) * model_fn(x, t, labels, r=r)[:, :c].to(x.dtype)
    return SampleOutput(x, num_steps)


MEANFLOW_ONLY = ("the meanflow sampler takes the average velocity of a MeanFlow model (trained with --mean-flow); "
                 "this model predicts the velocity at t only: use ode-heun, ode-euler, dopri5, sde-euler or sde-heun")
