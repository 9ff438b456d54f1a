"""SiT transport: paths, conversions, objectives and likelihood at known answers.

Gaussian data x_1 ~ N(mu, s^2) (tests/diffusion/oracle.py) gives every optimal
prediction and the exact log-likelihood in closed form.  float64 throughout.
"""

import math

import pytest
import torch

from nala_dit.diffusion.transport import PATHS, Path, Transport, integrate_ode
from tests.diffusion.oracle import MU, S, TransportOracle, gaussian_logp

TS = torch.tensor([0.05, 0.3, 0.5, 0.7, 0.95], dtype=torch.float64)


@pytest.mark.parametrize("kind", PATHS)
def test_path_values_and_derivatives(kind):
    p = Path(kind)
    t = TS.clone().requires_grad_(True)
    a, da = p.alpha(t)
    s, ds = p.sigma(t)
    # Derivatives against autograd.
    torch.testing.assert_close(da, torch.autograd.grad(a.sum(), t, retain_graph=True)[0])
    torch.testing.assert_close(ds, torch.autograd.grad(s.sum(), t)[0])
    one = torch.ones(1, dtype=torch.float64)
    if kind == "linear":
        torch.testing.assert_close(a, t.detach())
        torch.testing.assert_close(s, 1 - t.detach())
    else:
        # GVP and VP are variance preserving.
        torch.testing.assert_close(a ** 2 + s ** 2, torch.ones_like(a))
    torch.testing.assert_close(p.alpha_over_dalpha(t.detach()), (a / da).detach())
    # Data at t = 1 for every path.
    assert p.alpha(one)[0].item() == pytest.approx(1.0)
    if kind == "vp":
        # beta_t = 0.1 + (1-t) 19.9, so log alpha_0 = -(19.9/4 + 0.05).
        assert math.log(p.alpha(0 * one)[0].item()) == pytest.approx(-(19.9 / 4 + 0.05))
        torch.testing.assert_close(p.drift_var(t.detach()), 0.5 * (0.1 + (1 - t.detach()) * 19.9))


@pytest.mark.parametrize("kind", PATHS)
def test_conversions_match_closed_forms_and_round_trip(kind):
    tr = Transport(kind)
    oracle = TransportOracle(tr)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(TS), 3, 2, 2, generator=g, dtype=torch.float64)
    exact = oracle.parts(x, TS)
    v, s, n = exact["velocity"], exact["score"], exact["noise"]
    # Independent closed forms of the oracle agree with the conversion formulas.
    torch.testing.assert_close(tr.velocity_to_score(v, x, TS), s)
    torch.testing.assert_close(tr.score_to_velocity(s, x, TS), v)
    torch.testing.assert_close(tr.noise_to_score(n, x, TS), s)
    torch.testing.assert_close(tr.score_to_noise(s, x, TS), n)
    torch.testing.assert_close(tr.velocity_to_noise(v, x, TS), n)
    torch.testing.assert_close(tr.noise_to_velocity(n, x, TS), v)
    # Round trips on arbitrary (non-oracle) predictions.
    r = torch.randn(x.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(tr.score_to_velocity(tr.velocity_to_score(r, x, TS), x, TS), r)
    torch.testing.assert_close(tr.noise_to_velocity(tr.velocity_to_noise(r, x, TS), x, TS), r)
    torch.testing.assert_close(tr.score_to_noise(tr.noise_to_score(r, x, TS), x, TS), r)


def _min_loss(tr, t):
    """Per-dim minimum of each objective at time t for Gaussian data (closed form)."""
    te = torch.tensor(t, dtype=torch.float64)
    a, da = (v.item() for v in tr.path.alpha(te))
    s, ds = (v.item() for v in tr.path.sigma(te))
    V = a ** 2 * S ** 2 + s ** 2
    if tr.prediction == "velocity":
        # Var(u | x_t) with u = a' x_1 + s' eps jointly Gaussian with x_t.
        return da ** 2 * S ** 2 + ds ** 2 - (da * a * S ** 2 + ds * s) ** 2 / V
    var_eps = a ** 2 * S ** 2 / V  # both noise and sigma*score targets reduce to eps
    w = tr.path.drift_var(te).item()
    weight = {"none": 1.0, "velocity": (w / s) ** 2, "likelihood": w / s ** 2}[tr.loss_weight]
    return weight * var_eps


@pytest.mark.parametrize("kind,prediction,weight", [
    ("linear", "velocity", "none"), ("gvp", "velocity", "none"), ("vp", "velocity", "none"),
    ("linear", "noise", "none"), ("gvp", "score", "likelihood"), ("vp", "score", "velocity"),
])
def test_training_loss_minimum_at_oracle(kind, prediction, weight):
    tr = Transport(kind, prediction, weight)
    g = torch.Generator().manual_seed(1)
    x1 = MU + S * torch.randn(8192, 4, 2, 2, generator=g, dtype=torch.float64)
    for t in (0.2, 0.7):
        tt = torch.full((8192,), t, dtype=torch.float64)
        loss = tr.training_losses(TransportOracle(tr), x1, None, t=tt, generator=g)["loss"]
        # 131k squared Gaussians: Monte-Carlo error about 0.4 %; tolerance 3 %.
        assert loss.mean().item() == pytest.approx(_min_loss(tr, t), rel=0.03)


def test_linear_velocity_loss_closed_form_and_t_sampling():
    # Linear path: u = x_1 - eps; min = (1 + s^2) - (t s^2 - (1-t))^2 / (t^2 s^2 + (1-t)^2).
    tr = Transport()
    t = 0.4
    expected = 1 + S ** 2 - (t * S ** 2 - (1 - t)) ** 2 / (t ** 2 * S ** 2 + (1 - t) ** 2)
    assert _min_loss(tr, t) == pytest.approx(expected)
    # SiT's uniform training times: U(0, 1) on the linear path, U(0, 1 - 1e-5) on VP (its
    # train_eps), drawn from the generator given, one number per sample.
    u = torch.rand(10000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tr.sample_t(10000, generator=torch.Generator().manual_seed(0)), u)
    vp = Transport("vp").sample_t(10000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(vp, u * (1 - 1e-5))


def test_intervals_follow_sit():
    assert Transport("linear").interval() == (0.0, 1.0)
    assert Transport("gvp", "velocity").interval() == (0.0, 1.0)
    assert Transport("linear", "noise").interval() == (1e-3, 1 - 1e-3)
    assert Transport("vp").interval() == (0.0, 1 - 1e-3)
    assert Transport("vp").interval(train=True) == (0.0, 1 - 1e-5)
    assert Transport("linear").interval(sde=True, last_step_size=0.04) == (0.0, 0.96)
    # SBDM's diffusion is infinite at t = 0 on Linear/GVP: start at eps.
    assert Transport("linear").interval(sde=True, diffusion_form="SBDM",
                                        last_step_size=0.04) == (1e-3, 0.96)


def test_diffusion_forms():
    tr = Transport()
    x = torch.zeros(1, 1)
    t = 0.3
    expect = {"constant": 2.0, "SBDM": 2.0 * (0.7 ** 2 / 0.3 + 0.7), "sigma": 2.0 * 0.7,
              "linear": 2.0 * 0.7, "decreasing": 0.25 * (2.0 * math.cos(0.3 * math.pi) + 1) ** 2,
              "increasing-decreasing": 2.0 * math.sin(0.3 * math.pi) ** 2}
    for form, value in expect.items():
        got = tr.diffusion_coefficient(x, t, form, norm=2.0).item()
        assert got == pytest.approx(value, rel=1e-6), form


def test_bad_inputs():
    with pytest.raises(ValueError, match="path 'cosine'.*linear, gvp, vp"):
        Transport("cosine")
    with pytest.raises(ValueError, match="prediction 'eps'.*velocity, score, noise"):
        Transport(prediction="eps")
    with pytest.raises(ValueError, match="loss_weight 'lambda'.*none, velocity, likelihood"):
        Transport(prediction="score", loss_weight="lambda")
    with pytest.raises(ValueError, match="only applies to score/noise"):
        Transport(prediction="velocity", loss_weight="likelihood")
    with pytest.raises(ValueError, match="diffusion_form 'SDBM'"):
        Transport().diffusion_coefficient(torch.zeros(1, 1), 0.5, "SDBM")
    with pytest.raises(ValueError, match="ODE method 'rk4'.*euler, heun, dopri5"):
        integrate_ode(lambda s, t: s, (torch.zeros(1),), 0, 1, "rk4")
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        integrate_ode(lambda s, t: s, (torch.zeros(1),), 0, 1, "euler", 0)
    with pytest.raises(ValueError, match="estimator 'normal'"):
        Transport().log_likelihood(None, torch.zeros(1, 1), None, estimator="normal")


@pytest.mark.parametrize("kind,prediction,estimator", [
    ("linear", "velocity", "rademacher"), ("linear", "velocity", "gaussian"),
    ("gvp", "score", "rademacher"),
])
def test_likelihood_of_gaussian_oracle(kind, prediction, estimator):
    tr = Transport(kind, prediction)
    g = torch.Generator().manual_seed(3)
    x = MU + S * torch.randn(256, 4, 2, 2, generator=g, dtype=torch.float64)
    out = tr.log_likelihood(TransportOracle(tr), x, None, estimator=estimator, generator=g)
    exact = -gaussian_logp(x) / (x[0].numel() * math.log(2))
    # Mean bits/dim within 2 % (Gaussian probes are noisy per sample; Rademacher
    # probes are exact for the oracle's diagonal Jacobian).
    assert out["bpd"].mean().item() == pytest.approx(exact.mean().item(), rel=0.02)
    if estimator == "rademacher":
        assert (out["bpd"] - exact).abs().max().item() < 0.02 * exact.abs().mean().item()
    assert out["nfe"] > 0
    # The exact prior term: log N(z; 0, I).
    z = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(tr.prior_logp(z),
                               torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(1))
