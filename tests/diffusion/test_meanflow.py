"""MeanFlow (``nala_dit/diffusion/meanflow.py``) against closed forms on Gaussian data, where
the linear path's flow is affine: x ~ N(μ, s²) per dimension, x_t = t x + (1 − t) ε has
mean m_t = tμ and std σ_t = √(t²s² + (1 − t)²), the flow maps x_t to
x_r = m_r + (σ_r/σ_t)(x_t − m_t), so the average velocity is
u*(x, t, r) = (m_r − m_t + (σ_r/σ_t − 1)(x − m_t)) / (r − t) and u*(x, t, t) = v(x, t).
Then the MeanFlow models on the tiny NaLaSiT and SiT."""

import pytest
import torch

from nala_dit.diffusion.generate import check_sampler, generate
from nala_dit.diffusion.meanflow import MeanFlow, meanflow_sample
from nala_dit.diffusion.transport import Transport
from nala_dit.models import create_model
from nala_dit.training.convert import inherit
from tests.utils import TINY

MU, S = torch.tensor([1.5, -0.5]).double(), torch.tensor([0.5, 2.0]).double()


def stats(t):
    """Mean, std and d std/dt of x_t per dimension, (B, 2, 1, 1), for t (B,)."""
    t, mu, s = t.view(-1, 1, 1, 1), MU.view(1, 2, 1, 1), S.view(1, 2, 1, 1)
    sigma = torch.sqrt(t**2 * s**2 + (1 - t) ** 2)
    return t * mu, sigma, (t * s**2 - (1 - t)) / sigma


def u_star(x, t, r):
    """The exact average velocity (x: (B, 2, 1, 1), t, r: (B,)), differentiable in x and t."""
    (m_t, s_t, ds_t), (m_r, s_r, _) = stats(t), stats(r)
    gap = (r - t).view(-1, 1, 1, 1)
    same = gap.abs() < 1e-12
    average = (m_r - m_t + (s_r / s_t - 1) * (x - m_t)) / torch.where(same, torch.ones_like(gap), gap)
    instant = MU.view(1, 2, 1, 1) + ds_t / s_t * (x - m_t)
    return torch.where(same, instant, average)


def exact_model(theta=None, h=None):
    def model_fn(x, t, y, r=None, force_drop_ids=None):
        out = u_star(x, t, t if r is None else r)
        return out if theta is None else out + theta.view(-1, 1, 1, 1) * h(x, t, r)
    return model_fn


def test_target_is_the_average_velocity_given_the_marginal_velocity():
    """With the marginal velocity v(x_t, t) as v and the exact u, MeanFlow's target
    v − (t − r)(v·∂_x u + ∂_t u) is u itself (the identity; float64)."""
    g = torch.Generator().manual_seed(0)
    mf = MeanFlow()
    t, r = mf.sample_times(64, generator=g)
    t, r = t.double(), r.double()
    assert (r >= t).all() and (r > t).any() and (r == t).any()
    x = torch.randn(64, 2, 1, 1, generator=g, dtype=torch.float64)
    v = u_star(x, t, t)
    u, target = mf.target(exact_model(), x, t, r, v, torch.zeros(64, dtype=torch.long))
    torch.testing.assert_close(u, u_star(x, t, r), rtol=0, atol=1e-12)
    torch.testing.assert_close(target, u, rtol=0, atol=1e-10)


def test_loss_minimiser_is_the_closed_form():
    """On the loss itself (plain L2, p = 0; conditional velocities x₁ − ε): along a direction
    θ·h away from u*, ∂L/∂θ is 0 at θ = 0 within 4 standard errors and pushes back to it at
    θ = ±0.3 (beyond 10 standard errors)."""
    n = 40_000
    g = torch.Generator().manual_seed(1)
    x1 = MU.view(1, 2, 1, 1) + S.view(1, 2, 1, 1) * torch.randn(n, 2, 1, 1, generator=g, dtype=torch.float64)
    mf = MeanFlow(adaptive_p=0.0, r_neq_t=0.5)
    h = lambda x, t, r: (r - t).view(-1, 1, 1, 1) * x + t.view(-1, 1, 1, 1)   # noqa: E731
    y = torch.zeros(n, dtype=torch.long)

    def grad_at(value):
        theta = torch.full((n,), value, dtype=torch.float64, requires_grad=True)
        loss = mf.training_losses(exact_model(theta, h), x1, y, generator=torch.Generator().manual_seed(2))["loss"]
        (per_sample,) = torch.autograd.grad(loss.sum(), theta)
        return per_sample.mean().item(), per_sample.std().item() / n**0.5

    g0, se0 = grad_at(0.0)
    assert abs(g0) < 4 * se0, (g0, se0)
    g_plus, se_plus = grad_at(0.3)
    g_minus, se_minus = grad_at(-0.3)
    assert g_plus > 10 * se_plus and g_minus < -10 * se_minus, (g_plus, g_minus)


@pytest.mark.parametrize("steps", [1, 2])
def test_exact_average_velocity_samples_the_data_in_one_step(steps):
    """The ``meanflow`` sampler with the exact u: each noise ε lands on μ + s·ε (the flow
    map), so the samples are N(μ, s²): 1 and 2 steps, one model call each."""
    noise = torch.randn(20_000, 2, 1, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = meanflow_sample(MeanFlow(), exact_model(), noise, torch.zeros(20_000, dtype=torch.long), num_steps=steps)
    assert out.nfe == steps
    torch.testing.assert_close(out.samples, MU.view(1, 2, 1, 1) + S.view(1, 2, 1, 1) * noise, rtol=0, atol=1e-12)
    mean, std = out.samples.mean((0, 2, 3)), out.samples.std((0, 2, 3))
    assert ((mean - MU).abs() < 5 * S / 20_000**0.5).all() and ((std / S - 1).abs() < 0.03).all()


def test_guidance_in_the_target_mixes_the_velocities_where_the_paper_does():
    """``guided_velocity`` (Eq. 21): ω v + κ u(·|c) + (1 − ω − κ) u(·|∅) for the samples that
    keep their class with t_paper in the interval, v itself for the dropped ones and those
    outside; with a model whose conditional and unconditional outputs are known constants.
    Then one guided loss through ``training_losses`` (it once failed on a float mask)."""
    mf = MeanFlow(cfg_omega=1.0, cfg_kappa=0.5, cfg_interval=(0.0, 0.75), null_label=9, drop_prob=0.5)
    cond, uncond = 3.0, -1.0
    model_fn = lambda x, t, y, r=None, force_drop_ids=None: torch.where(   # noqa: E731
        (y == 9).view(-1, 1, 1, 1), torch.full_like(x, uncond), torch.full_like(x, cond))
    x = torch.zeros(4, 2, 1, 1)
    v = torch.arange(8.0).view(4, 2, 1, 1)
    t = torch.tensor([0.9, 0.9, 0.1, 0.9])           # t_paper 0.1, 0.1, 0.9 (outside), 0.1
    dropped = torch.tensor([False, True, False, False])
    out = mf.guided_velocity(model_fn, x, t, v, torch.tensor([2, 9, 4, 5]), dropped, 9)
    mixed = 1.0 * v + 0.5 * cond + (1 - 1.0 - 0.5) * uncond
    expected = torch.stack([mixed[0], v[1], v[2], mixed[3]])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    x1 = torch.randn(6, 2, 1, 1, generator=torch.Generator().manual_seed(4))
    loss = mf.training_losses(exact_model(), x1.double(), torch.tensor([0, 1, 2, 3, 4, 5]),
                              generator=torch.Generator().manual_seed(5))["loss"]
    assert loss.shape == (6,) and torch.isfinite(loss).all()


def test_meanflow_sampler_refuses_a_plain_transport_model():
    with pytest.raises(ValueError, match="the meanflow sampler takes the average velocity of a MeanFlow model"):
        check_sampler("meanflow", Transport())
    with pytest.raises(ValueError, match="velocity at t only"):
        meanflow_sample(Transport(), exact_model(), torch.zeros(1, 2, 1, 1), torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("name", ["NaLaSiT-T/2", "SiT-T/2"])
def test_meanflow_model_starts_as_its_sit_trains_and_samples(name):
    """``mean_flow=True``: a SiT's weights (``convert.inherit``, what ``--init-from`` runs) give
    the SiT's velocity at any r (the interval embedder's output starts at zero); one MeanFlow loss's gradients on the default path (NaLa:
    the fused CPU path with its forward-mode rule; SiT: the explicit softmax under the
    transform) equal those with NaLa's eager composition; 1 and 2 step sampling through
    ``generate`` (the default sampler of a MeanFlow objective is ``meanflow``)."""
    torch.manual_seed(0)
    sit = create_model(name, **TINY).eval()
    model = create_model(name, **TINY, mean_flow=True).eval()
    report = inherit(model, sit.state_dict(), "all")        # train.py --mean-flow --init-from a SiT run
    assert {key for key, copied, _ in report.rows if not copied} == {f"r_embedder.mlp.{i}.{p}" for i in (0, 2)
                                                                      for p in ("weight", "bias")}
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([0.2, 0.7]), torch.tensor([1, 3])
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y, r=torch.tensor([0.9, 1.0])), sit(x, t, y), rtol=0, atol=0)
    with pytest.raises(ValueError, match="r \\(an end time\\) is for MeanFlow models"):
        sit(x, t, y, r=t)

    for p in model.r_embedder.parameters():          # a trained interval embedding
        torch.nn.init.normal_(p, std=0.05)
    mf = MeanFlow()
    x1 = torch.randn(4, 4, 8, 8)
    labels = torch.tensor([0, 1, 2, 3])

    def grads(impl):
        import nala_dit.attention.nala.backend as nala

        original = nala.select_nala_impl
        nala.select_nala_impl = lambda *a, **k: impl if impl else original(*a, **k)
        for layer in model.modules():    # each layer keeps its choice: choose again under the new selection
            getattr(layer, "_backends", {}).clear()
        try:
            model.zero_grad()
            loss = mf.training_losses(model, x1, labels, generator=torch.Generator().manual_seed(4))["loss"].mean()
            loss.backward()
        finally:
            nala.select_nala_impl = original
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    loss, got = grads(None)
    ref_loss, ref = grads("eager")
    assert torch.isfinite(loss) and got.keys() == ref.keys() and "r_embedder.mlp.2.weight" in got
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-6, msg=key)

    with torch.no_grad():
        for steps in (1, 2):
            out = generate(model, mf, torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), num_steps=steps)
            assert out.nfe == steps and out.samples.shape == (2, 4, 8, 8) and torch.isfinite(out.samples).all()
