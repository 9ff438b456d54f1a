"""Gaussian diffusion: schedules, respacing, and the iDDPM loss terms at known answers.

Known answers come from Gaussian data x_0 ~ N(mu, s^2) (tests/diffusion/oracle.py),
where every optimum and every VLB term has a closed form.  Monte-Carlo checks state
their tolerance next to the sample count; float64 throughout.
"""

import math

import pytest
import torch

from nala_dit.diffusion.gaussian import (
    GaussianDiffusion,
    discretized_gaussian_log_likelihood,
    get_named_beta_schedule,
    space_timesteps,
)
from tests.diffusion.oracle import MU, DiffusionOracle, S

BASE = GaussianDiffusion.from_schedule("linear", 1000)


def test_linear_schedule_matches_ddpm_and_diffusers():
    from diffusers import DDIMScheduler, DDPMScheduler

    betas = get_named_beta_schedule("linear", 1000)
    torch.testing.assert_close(betas, torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64))
    for cls in (DDPMScheduler, DDIMScheduler):
        sched = cls(num_train_timesteps=1000, beta_schedule="linear")
        # diffusers keeps float32 schedules; ours are float64.
        torch.testing.assert_close(BASE.alphas_cumprod.float(), sched.alphas_cumprod,
                                   rtol=1e-5, atol=1e-7)


def test_cosine_schedule_matches_diffusers():
    from diffusers import DDPMScheduler

    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    torch.testing.assert_close(get_named_beta_schedule("cosine", 1000).float(), sched.betas,
                               rtol=1e-5, atol=1e-7)


def test_space_timesteps_keeps_endpoints():
    # ADM's rule for 250 of 1000 already gives 0 and 999 with 250 steps.
    steps = space_timesteps(1000, 250)
    assert steps == [round(j * 999 / 249) for j in range(250)]
    assert len(steps) == 250 and steps[0] == 0 and steps[-1] == 999
    # ADM's ddim50 would stop at 980; ours keeps 999 and still has 50 steps.
    steps = space_timesteps(1000, "ddim50")
    assert len(steps) == 50 and steps[0] == 0 and steps[-1] == 999
    # Sections: each section's first and last step, then endpoints added if missing.
    assert space_timesteps(1000, "2,2") == [0, 499, 500, 999]
    assert space_timesteps(1000, 1) == [0, 999]
    assert space_timesteps(1000, 1000) == list(range(1000))
    for n in (2, 3, 7, 25, 100):
        steps = space_timesteps(1000, n)
        assert steps[0] == 0 and steps[-1] == 999 and len(steps) == n


def test_respaced_diffusion_keeps_alphas_and_maps_timesteps():
    d = BASE.respace(10)
    keep = space_timesteps(1000, 10)
    torch.testing.assert_close(d.alphas_cumprod, BASE.alphas_cumprod[keep])
    assert d.timestep_map.tolist() == keep
    seen = []
    d.p_mean_variance(lambda x, t, y: seen.append(t) or torch.zeros(2, 8, 1, 1),
                      torch.zeros(2, 4, 1, 1), torch.tensor([9, 0]), None)
    # The model sees original timesteps (DiT's _WrappedModel), not rescaled ones.
    assert seen[0].tolist() == [999.0, 0.0] and seen[0].dtype == torch.float32


def test_bad_inputs():
    with pytest.raises(ValueError, match="linear, cosine"):
        get_named_beta_schedule("quadratic")
    with pytest.raises(ValueError, match="learned_range"):
        GaussianDiffusion(BASE.betas, model_var_type="learned")
    with pytest.raises(ValueError, match="cannot take"):
        space_timesteps(1000, 1001)
    with pytest.raises(ValueError, match=">= 1"):
        space_timesteps(1000, 0)


def test_q_posterior_is_bayes_rule():
    # beta~_t from Bayes: 1/beta~ = 1/(1-abar_{t-1}) + alpha_t/beta_t (Ho 2020, eq. 7).
    t = torch.arange(1, 1000)
    alpha = 1 - BASE.betas[t]
    expected = 1 / (1 / (1 - BASE.alphas_cumprod[t - 1]) + alpha / BASE.betas[t])
    torch.testing.assert_close(BASE.posterior_variance[t], expected)


def _t(i, n):
    return torch.full((n,), i, dtype=torch.long)


@pytest.mark.parametrize("step", [10, 300, 900])
def test_eps_mse_minimum_at_oracle(step):
    # Min over eps_hat of E||eps - eps_hat||^2 per dim = Var(eps|x_t) = abar s^2 / V.
    g = torch.Generator().manual_seed(step)
    x0 = MU + S * torch.randn(8192, 4, 2, 2, generator=g, dtype=torch.float64)
    terms = BASE.training_losses(DiffusionOracle(BASE), x0, _t(step, 8192), None, generator=g)
    abar = BASE.alphas_cumprod[step].item()
    expected = abar * S ** 2 / (abar * S ** 2 + 1 - abar)
    # 131k squared Gaussians: Monte-Carlo error about 0.4 %; tolerance 3 %.
    assert terms["mse"].mean().item() == pytest.approx(expected, rel=0.03)
    # E_{x0, x_t}[KL] with the exact reverse variance Sigma = beta~ + c1^2 Var(x0|x_t)
    # is 0.5 log(Sigma / beta~) per dim (the other terms cancel).
    var_x0 = S ** 2 * (1 - abar) / (abar * S ** 2 + 1 - abar)
    bt = BASE.posterior_variance[step].item()
    sigma2 = bt + BASE.posterior_mean_coef1[step].item() ** 2 * var_x0
    expected_vb = 0.5 * math.log(sigma2 / bt) / math.log(2)
    assert terms["vb"].mean().item() == pytest.approx(expected_vb, rel=0.03)
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["vb"])


def test_vb_kl_term_matches_closed_form_per_sample():
    g = torch.Generator().manual_seed(0)
    step, n = 500, 16
    x0 = MU + S * torch.randn(n, 4, 2, 2, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = _t(step, n)
    x_t = BASE.q_sample(x0, t, noise)
    vb, out = BASE.vb_terms_bpd(DiffusionOracle(BASE), x0, x_t, t, None)
    # Independent closed form: posterior from Ho eq. 7, model mean E[x_{t-1}|x_t].
    a, ap, b = (BASE.alphas_cumprod[step].item(), BASE.alphas_cumprod[step - 1].item(),
                BASE.betas[step].item())
    m_true = (b * ap ** 0.5 * x0 + (1 - ap) * (1 - b) ** 0.5 * x_t) / (1 - a)
    v_true = b * (1 - ap) / (1 - a)
    V = a * S ** 2 + 1 - a
    ex0 = MU + a ** 0.5 * S ** 2 / V * (x_t - a ** 0.5 * MU)
    m_model = (b * ap ** 0.5 * ex0 + (1 - ap) * (1 - b) ** 0.5 * x_t) / (1 - a)
    v_model = v_true + (b * ap ** 0.5 / (1 - a)) ** 2 * S ** 2 * (1 - a) / V
    kl = 0.5 * (math.log(v_model / v_true) + (v_true + (m_true - m_model) ** 2) / v_model - 1)
    torch.testing.assert_close(vb, kl.mean(dim=(1, 2, 3)) / math.log(2))


def test_vb_decoder_nll_at_t0_matches_exact_bins():
    # Data on the 256-level grid of [-1, 1]; the model's p(x_0|x_1) is a fixed Gaussian.
    g = torch.Generator().manual_seed(1)
    n = 32
    x0 = torch.randint(0, 256, (n, 3, 2, 2), generator=g).double() / 127.5 - 1
    x_t = BASE.q_sample(x0, _t(0, n), torch.randn(x0.shape, generator=g, dtype=torch.float64))
    v = 0.3
    model = lambda x, t, y: torch.cat([torch.full_like(x, 0.0), torch.full_like(x, v)], 1)
    vb, out = BASE.vb_terms_bpd(model, x0, x_t, _t(0, n), None)
    std = out["variance"].sqrt()
    # Exact normal CDF (ADM uses a tanh approximation: agreement to ~1e-3 relative).
    hi = torch.where(x0 > 0.999, torch.ones_like(x0),
                     torch.special.ndtr((x0 + 1 / 255 - out["mean"]) / std))
    lo = torch.where(x0 < -0.999, torch.zeros_like(x0),
                     torch.special.ndtr((x0 - 1 / 255 - out["mean"]) / std))
    nll = -torch.log((hi - lo).clamp_min(1e-12)).mean(dim=(1, 2, 3)) / math.log(2)
    torch.testing.assert_close(vb, nll, rtol=1e-2, atol=1e-3)
    # ADM's own formula (improved-diffusion's approx_standard_normal_cdf, written out here):
    # the same bins through its tanh approximation of the CDF, to float64 rounding.
    def adm_cdf(z):
        return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))
    hi = torch.where(x0 > 0.999, torch.ones_like(x0), adm_cdf((x0 + 1 / 255 - out["mean"]) / std))
    lo = torch.where(x0 < -0.999, torch.zeros_like(x0), adm_cdf((x0 - 1 / 255 - out["mean"]) / std))
    adm = -torch.log((hi - lo).clamp_min(1e-12)).mean(dim=(1, 2, 3)) / math.log(2)
    torch.testing.assert_close(vb, adm, rtol=1e-10, atol=0)


def test_discretized_likelihood_sums_to_one():
    # The 256 bins partition the real line, so probabilities sum to 1.
    x = torch.arange(256, dtype=torch.float64) / 127.5 - 1
    p = discretized_gaussian_log_likelihood(x, torch.full_like(x, 0.1),
                                            torch.full_like(x, math.log(0.3))).exp()
    assert p.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_vb_stop_gradient_only_trains_variance():
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(4, 4, 2, 2, generator=g, dtype=torch.float64)
    out = torch.randn(4, 8, 2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    terms = BASE.training_losses(lambda x, t, y: out, x0, _t(100, 4), None, generator=g)
    (grad_vb,) = torch.autograd.grad(terms["vb"].sum(), out, retain_graph=True)
    (grad_mse,) = torch.autograd.grad(terms["mse"].sum(), out)
    assert grad_vb[:, :4].abs().max() == 0 and grad_vb[:, 4:].abs().max() > 0
    assert grad_mse[:, 4:].abs().max() == 0


@pytest.mark.parametrize("steps", [500, 1000])
def test_vb_is_not_rescaled_by_num_timesteps(steps):
    # DiT trains with LossType.MSE: the VLB term in bits/dim as is, at any T (iDDPM's
    # RESCALED_MSE, T/1000 times it, is not DiT's choice). Known case: the exact eps
    # (so both means agree) and v = 0, the log-variance halfway between log beta and
    # log beta~: per dimension KL = (log r + 1/r - 1) / 2 nats with r = sqrt(beta / beta~).
    d = GaussianDiffusion.from_schedule("linear", steps)
    step = 100
    betas = torch.linspace(1e-4 * 1000 / steps, 0.02 * 1000 / steps, steps, dtype=torch.float64)
    abar = torch.cumprod(1 - betas, 0)
    beta, beta_tilde = betas[step].item(), (betas[step] * (1 - abar[step - 1]) / (1 - abar[step])).item()
    r = math.sqrt(beta / beta_tilde)
    expected = 0.5 * (math.log(r) + 1 / r - 1) / math.log(2)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(4, 4, 2, 2, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    terms = d.training_losses(lambda x, t, y: torch.cat([noise, torch.zeros_like(noise)], 1), x0, _t(step, 4),
                              None, noise=noise)
    torch.testing.assert_close(terms["vb"], torch.full((4,), expected, dtype=torch.float64))
    torch.testing.assert_close(terms["loss"], terms["vb"])  # mse = 0: the exact eps


def test_prior_bpd_closed_form():
    x0 = torch.tensor([[-1.0, 0.0, 0.5, 1.0]], dtype=torch.float64)
    a = BASE.alphas_cumprod[-1].item()
    kl = 0.5 * (a * x0 ** 2 + (1 - a) - 1 - math.log(1 - a))
    torch.testing.assert_close(BASE.prior_bpd(x0), kl.mean(1) / math.log(2))
    assert BASE.prior_bpd(x0).item() < 1e-4  # T = 1000 leaves almost no signal


@pytest.mark.parametrize("var_type", ["fixed_small", "fixed_large"])
def test_fixed_variances(var_type):
    d = GaussianDiffusion(BASE.betas, var_type)
    x = torch.zeros(2, 4, 1, 1, dtype=torch.float64)
    out = d.p_mean_variance(lambda x, t, y: torch.zeros_like(x), x, torch.tensor([5, 0]), None)
    expect = {"fixed_small": BASE.posterior_variance[5], "fixed_large": BASE.betas[5]}[var_type]
    assert out["variance"][0, 0, 0, 0].item() == pytest.approx(expect.item())
    # Both use log beta~_1 at t = 0 (beta~_0 = 0 would make the log-variance -inf).
    assert out["log_variance"][1, 0, 0, 0].item() == pytest.approx(
        math.log(BASE.posterior_variance[1].item()))


@pytest.mark.parametrize("step", [999, 500, 1])
def test_learned_range_step_matches_diffusers_ddpm(step):
    from diffusers import DDPMScheduler

    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear",
                          variance_type="learned_range", clip_sample=False)
    sched.set_timesteps(1000)
    g = torch.Generator().manual_seed(step)
    x = torch.randn(2, 4, 3, 3, generator=g)
    out = torch.randn(2, 8, 3, 3, generator=g).clamp(-1, 1)  # eps and v
    ref = sched.step(out, step, x, generator=torch.Generator().manual_seed(5)).prev_sample
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    ours, _ = BASE.p_sample(lambda *_: out, x, _t(step, 2), None, noise)
    # diffusers runs the schedule in float32, ours in float64 cast to float32.
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
