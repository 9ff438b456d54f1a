"""Samplers and guidance: samples of the Gaussian oracle have the data's moments.

With the exact predictions for data N(mu, s^2) (tests/diffusion/oracle.py) as the
model, every sampler must return samples whose mean is within 3 % of s from mu and
whose std is within 3 % of s (16k values: Monte-Carlo error about 0.6 %).  DDPM with
the exact learned variance is exact at any step count; deterministic samplers carry a
discretisation error that must shrink with more steps.  float64 throughout.
"""

import pytest
import torch

from nala_dit.diffusion.gaussian import GaussianDiffusion
from nala_dit.diffusion.guidance import cfg_model_fn
from nala_dit.diffusion.samplers import (
    SampleOutput,
    ddim_sample,
    ddpm_sample,
    likelihood,
    ode_sample,
    sde_sample,
)
from nala_dit.diffusion.transport import Transport
from tests.diffusion.oracle import (
    MU,
    DiffusionOracle,
    S,
    TransportOracle,
    check_moments,
)

BASE = GaussianDiffusion.from_schedule("linear", 1000)
N = 1024
NULL = 10


def _noise(seed=0, n=N):
    return torch.randn(n, 4, 2, 2, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _labels(n=N):
    return torch.zeros(n, dtype=torch.long)


def _gen(seed=123):
    return torch.Generator().manual_seed(seed)


def _std_err(samples):
    return abs(samples.std().item() / S - 1)


def test_ddpm_with_learned_variance_is_exact():
    sampling = BASE.respace(25)
    oracle = DiffusionOracle(BASE, sampling)
    out = ddpm_sample(BASE, oracle, _noise(), _labels(), num_steps=25, generator=_gen())
    assert isinstance(out, SampleOutput) and out.nfe == 25 == oracle.calls
    check_moments(out.samples)
    # Reproducible with the same generator seed, different with another.
    again = ddpm_sample(BASE, DiffusionOracle(BASE, sampling), _noise(), _labels(),
                        num_steps=25, generator=_gen())
    assert torch.equal(out.samples, again.samples)
    other = ddpm_sample(BASE, DiffusionOracle(BASE, sampling), _noise(), _labels(),
                        num_steps=25, generator=_gen(7))
    assert not torch.equal(out.samples, other.samples)


def test_ddim_deterministic_and_converges():
    oracle = lambda: DiffusionOracle(BASE, learn_sigma=False)
    runs = {n: ddim_sample(BASE, oracle(), _noise(), _labels(), num_steps=n) for n in (5, 50, 200)}
    assert all(runs[n].nfe == n for n in runs)
    again = ddim_sample(BASE, oracle(), _noise(), _labels(), num_steps=50)
    assert torch.equal(runs[50].samples, again.samples)  # eta = 0: no randomness
    assert _std_err(runs[50].samples) < _std_err(runs[5].samples) / 3
    check_moments(runs[200].samples)
    # The variance channels of a learned-sigma model are ignored by DDIM.
    learned = ddim_sample(BASE, DiffusionOracle(BASE), _noise(), _labels(), num_steps=50)
    torch.testing.assert_close(learned.samples, runs[50].samples)


def test_ddim_eta_one_is_ddpm_with_posterior_variance():
    run = lambda seed: ddim_sample(BASE, DiffusionOracle(BASE, learn_sigma=False), _noise(),
                                   _labels(), num_steps=20, eta=1.0, generator=_gen(seed))
    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a.samples, b.samples) and not torch.equal(a.samples, c.samples)
    # Song 2021, sec. 4.1: eta = 1 is ancestral DDPM with variance beta~ (fixed_small);
    # both draw one normal per step in the same order, so the samples coincide.
    small = GaussianDiffusion(BASE.betas, "fixed_small")
    ddpm = ddpm_sample(small, DiffusionOracle(BASE, learn_sigma=False), _noise(), _labels(),
                       num_steps=20, generator=_gen(1))
    torch.testing.assert_close(a.samples, ddpm.samples)


@pytest.mark.parametrize("kind,prediction", [("linear", "velocity"), ("gvp", "score"),
                                             ("vp", "noise")])
def test_ode_samplers_match_data_moments(kind, prediction):
    tr = Transport(kind, prediction)
    for method, steps in (("euler", 100), ("heun", 40), ("dopri5", None)):
        oracle = TransportOracle(tr)
        out = ode_sample(tr, oracle, _noise(), _labels(), method=method,
                         num_steps=steps or 0)
        check_moments(out.samples)
        assert out.nfe == oracle.calls
        if steps:
            assert out.nfe == steps


def test_ode_error_shrinks_with_steps():
    tr = Transport()
    err = {n: _std_err(ode_sample(tr, TransportOracle(tr), _noise(), _labels(),
                                  method="euler", num_steps=n).samples) for n in (5, 50)}
    assert err[50] < err[5] / 5
    heun = _std_err(ode_sample(tr, TransportOracle(tr), _noise(), _labels(), method="heun",
                               num_steps=50).samples)
    assert heun < err[50]  # second order beats first order at equal NFE


@pytest.mark.parametrize("method,steps,expected", [
    ("euler", 1, 1), ("euler", 17, 17), ("heun", 1, 1), ("heun", 2, 2), ("heun", 7, 7),
    ("heun", 8, 8),
])
def test_ode_fixed_step_nfe_is_num_steps(method, steps, expected):
    tr = Transport()
    oracle = TransportOracle(tr)
    out = ode_sample(tr, oracle, _noise(n=4), _labels(4), method=method, num_steps=steps)
    assert out.nfe == oracle.calls == expected


def test_dopri5_nfe_bounded():
    tr = Transport("gvp")
    with pytest.raises(RuntimeError, match="max_nfe=10"):
        ode_sample(tr, TransportOracle(tr), _noise(n=8), _labels(8), method="dopri5",
                   max_nfe=10)
    oracle = TransportOracle(tr)
    out = ode_sample(tr, oracle, _noise(n=8), _labels(8), method="dopri5", max_nfe=1000,
                     atol=1e-3, rtol=1e-3)
    assert 0 < out.nfe == oracle.calls <= 1000
    # torchdiffeq options pass through (here: at most 2 steps, which is too few).
    with pytest.raises(AssertionError, match="max_num_steps"):
        ode_sample(tr, TransportOracle(tr), _noise(n=8), _labels(8), method="dopri5",
                   options={"max_num_steps": 2})


@pytest.mark.parametrize("method", ["euler", "heun"])
def test_sde_samplers_match_data_moments(method):
    tr = Transport()
    oracle = TransportOracle(tr)
    out = sde_sample(tr, oracle, _noise(), _labels(), method=method, num_steps=100,
                     generator=_gen())
    check_moments(out.samples)
    # Euler: one call per step; Heun: two per step, one for the "Mean" last step.
    assert out.nfe == oracle.calls == (100 if method == "euler" else 2 * 99 + 1)
    again = sde_sample(tr, TransportOracle(tr), _noise(), _labels(), method=method,
                       num_steps=100, generator=_gen())
    assert torch.equal(out.samples, again.samples)


@pytest.mark.parametrize("last_step", ["Tweedie", "Euler", None])
def test_sde_last_steps(last_step):
    tr = Transport("gvp", "velocity")
    oracle = TransportOracle(tr)
    out = sde_sample(tr, oracle, _noise(), _labels(), num_steps=100, last_step=last_step,
                     generator=_gen())
    check_moments(out.samples)
    assert out.nfe == oracle.calls == 100


def test_sde_heun_without_last_step_nfe():
    tr = Transport()
    out = sde_sample(tr, TransportOracle(tr), _noise(n=4), _labels(4), method="heun",
                     num_steps=10, last_step=None, generator=_gen())
    assert out.nfe == 20


def test_likelihood_wrapper():
    """``likelihood`` is ``Transport.log_likelihood`` with every argument in its place: equal
    results bit for bit with non-default method, steps, estimator and tolerances (the
    log-likelihood's own known answer is tested in test_transport.py)."""
    tr = Transport()
    x = MU + S * _noise(n=16)
    kwargs = dict(method="heun", num_steps=7, estimator="gaussian", atol=1e-5, rtol=1e-2, max_nfe=40)
    out = likelihood(tr, TransportOracle(tr), x, _labels(16), generator=_gen(), **kwargs)
    ref = tr.log_likelihood(TransportOracle(tr), x, _labels(16), generator=_gen(), **kwargs)
    # Heun's num_steps counts evaluations: 3 Heun steps of 2 and one Euler step.
    assert out.keys() == ref.keys() and out["nfe"] == ref["nfe"] == 7
    for key in ("bpd", "logp", "prior_logp"):
        assert torch.equal(out[key], ref[key])


def test_progress_flag_changes_no_result():
    """A progress bar is display only: each sampler returns the same samples, bit for bit."""
    tr = Transport()
    runs = [
        lambda p: ode_sample(tr, TransportOracle(tr), _noise(n=2), _labels(2), "euler", 2, progress=p),
        lambda p: sde_sample(tr, TransportOracle(tr), _noise(n=2), _labels(2), num_steps=3,
                             generator=_gen(), progress=p),
        lambda p: ddim_sample(BASE, DiffusionOracle(BASE, learn_sigma=False), _noise(n=2), _labels(2),
                              num_steps=2, progress=p),
    ]
    for run in runs:
        quiet, shown = run(False), run(True)
        assert torch.equal(quiet.samples, shown.samples) and quiet.nfe == shown.nfe


def test_bad_inputs():
    tr = Transport()
    oracle = TransportOracle(tr)
    with pytest.raises(ValueError, match="ODE method 'rk45'.*euler, heun, dopri5"):
        ode_sample(tr, oracle, _noise(n=2), _labels(2), method="rk45")
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        ode_sample(tr, oracle, _noise(n=2), _labels(2), method="euler", num_steps=0)
    with pytest.raises(ValueError, match="SDE method 'dopri5'.*euler, heun"):
        sde_sample(tr, oracle, _noise(n=2), _labels(2), method="dopri5")
    with pytest.raises(ValueError, match="last_step 'mean'.*Mean, Tweedie, Euler, None"):
        sde_sample(tr, oracle, _noise(n=2), _labels(2), last_step="mean")
    with pytest.raises(ValueError, match="diffusion_form 'sbdm'"):
        sde_sample(tr, oracle, _noise(n=2), _labels(2), diffusion_form="sbdm")
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        sde_sample(tr, oracle, _noise(n=2), _labels(2), num_steps=1)
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        ddpm_sample(BASE, DiffusionOracle(BASE), _noise(n=2), _labels(2), num_steps=0)
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        ddim_sample(BASE, DiffusionOracle(BASE), _noise(n=2), _labels(2), num_steps=-3)


class _Recorder:
    """A label-dependent toy model with learned-sigma output that logs its calls."""

    def __init__(self):
        self.batches = []

    def __call__(self, x, t, y):
        self.batches.append(x.shape[0])
        yb = y.to(x.dtype).reshape(-1, 1, 1, 1)
        eps = 0.5 * x + 0.1 * yb + 0.001 * t.reshape(-1, 1, 1, 1)
        return torch.cat([eps, 0.01 * yb.expand_as(x)], dim=1)  # (B, 2C, H, W)


def test_guidance_combines_all_channels_in_one_call():
    model = _Recorder()
    x = _noise(n=3)
    t = torch.tensor([10.0, 500.0, 990.0])
    y = torch.tensor([1, 2, 3])
    guided = cfg_model_fn(model, 4.0, NULL)
    out = guided(x, t, y)
    assert model.batches == [6]  # cond + uncond batched: one NFE
    cond = model(x, t, y)
    uncond = model(x, t, torch.full_like(y, NULL))
    torch.testing.assert_close(out[:, :4], uncond[:, :4] + 4.0 * (cond[:, :4] - uncond[:, :4]))
    assert torch.equal(out[:, 4:], cond[:, 4:])  # variance from the conditional pass
    # DiT's legacy behaviour: only 3 of the 4 latent channels guided.
    legacy = cfg_model_fn(model, 4.0, NULL, guide_channels=3)(x, t, y)
    torch.testing.assert_close(legacy[:, :3], out[:, :3])
    assert torch.equal(legacy[:, 3:], cond[:, 3:])


def test_guidance_interval_and_scale_one():
    model = _Recorder()
    x = _noise(n=3)
    y = torch.tensor([1, 2, 3])
    guided = cfg_model_fn(model, 4.0, NULL, interval=(0.0, 500.0))
    t = torch.tensor([10.0, 500.0, 990.0])
    out = guided(x, t, y)
    full = cfg_model_fn(model, 4.0, NULL)(x, t, y)
    cond = model(x, t, y)
    torch.testing.assert_close(out[:2], full[:2])  # inside (inclusive): guided
    assert torch.equal(out[2], cond[2])  # outside: plain conditional prediction
    model.batches.clear()
    out = guided(x, torch.full((3,), 700.0), y)
    assert model.batches == [3]  # nobody inside: no batch doubling
    assert torch.equal(out, model(x, torch.full((3,), 700.0), y))
    assert cfg_model_fn(model, 1.0, NULL) is model
    assert cfg_model_fn(model, 1.0, None) is model  # no null class needed at scale 1


def test_guidance_in_samplers():
    labels = _labels()
    sampling = BASE.respace(20)
    plain = ddpm_sample(BASE, DiffusionOracle(BASE, sampling), _noise(), labels,
                        num_steps=20, generator=_gen())
    same = ddpm_sample(BASE, cfg_model_fn(DiffusionOracle(BASE, sampling), 1.0, NULL),
                       _noise(), labels, num_steps=20, generator=_gen())
    assert torch.equal(plain.samples, same.samples)
    # Guidance only inside t in [0, 500]: half-ish of the 20 DiT steps run batched.
    model = _Recorder()
    out = ddpm_sample(BASE, cfg_model_fn(model, 3.0, NULL, interval=(0, 500)), _noise(n=4),
                      labels[:4], num_steps=20, generator=_gen())
    steps = BASE.respace(20).timestep_map
    assert out.nfe == 20
    assert model.batches == [8 if s <= 500 else 4 for s in reversed(steps.tolist())]
    # SiT time units: interval in [0, 1].
    tr = Transport()
    model = _Recorder()
    ode_sample(tr, cfg_model_fn(model, 3.0, NULL, interval=(0.5, 1.0)), _noise(n=4),
               labels[:4], "euler", 4)
    assert model.batches == [4, 4, 8, 8]  # t = 0, 0.25, 0.5, 0.75


def test_guidance_without_null_class_is_an_error():
    with pytest.raises(ValueError, match="trained without a null class"):
        cfg_model_fn(_Recorder(), 1.5, None)
    with pytest.raises(ValueError, match="t_lo <= t_hi"):
        cfg_model_fn(_Recorder(), 1.5, NULL, interval=(1.0, 0.0))


# --- a diffusers scheduler takes exactly the steps asked for
@pytest.mark.parametrize("name", ["dpm-solver", "ddim"])
@pytest.mark.parametrize("n", [61, 103, 998, 25, 1000])
def test_a_scheduler_takes_exactly_n_trailing_steps(name, n):
    """diffusers' trailing spacing (np.arange with a float step) gave 62 steps for 61, the last
    at t = -1 (outside the trained range). Each count now calls the model exactly n times, at
    round((n - i) · T / n) - 1 for i < n (no ties at these n), ending at t = 0 for n = T."""
    from fractions import Fraction

    from nala_dit.diffusion.generate import diffusers_scheduler, scheduler_sample

    T, seen = 1000, []

    def model_fn(x, t, y):
        seen.append(int(t[0]))
        return torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:])

    diffusion = GaussianDiffusion.from_schedule("linear", T)
    noise = torch.randn(1, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    out = scheduler_sample(diffusers_scheduler(name, diffusion), model_fn, noise, None, n)
    assert out.nfe == n and seen == [round(Fraction((n - i) * T, n)) - 1 for i in range(n)]
    # ε = 0 everywhere: every step predicts x0 = x_t / √ᾱ_t, so the chain ends at
    # x_T / √ᾱ_999 whatever the steps (DDIM: √ᾱ_prev / √ᾱ_t telescopes, ᾱ before t = 0 is 1;
    # DPM-Solver++ is exact for a constant x0). diffusers keeps ᾱ as an fp32 cumulative
    # product of 1,000 factors: about 1e-5 relative from the float64 value.
    want = noise.double() / diffusion.alphas_cumprod[T - 1] ** 0.5
    torch.testing.assert_close(out.samples.double(), want, rtol=1e-4, atol=0)


def test_samplers_refuse_steps_past_their_bound():
    """``generate`` (every caller's entry point) holds each sampler to ``check_steps``: ddpm/ddim/
    dpm-solver to the chain's length, the ODE/SDE samplers to MAX_CONTINUOUS_STEPS."""
    from nala_dit.diffusion.generate import generate

    model = lambda x, t, y: torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:])  # noqa: E731
    noise, labels = torch.zeros(1, 1, 2, 2), torch.zeros(1, dtype=torch.long)
    short = GaussianDiffusion.from_schedule("linear", 100)
    for sampler in ("ddpm", "ddim", "dpm-solver"):
        with pytest.raises(ValueError, match=f"num_steps 101: {sampler} takes at most one step per training "
                                             f"timestep .the model's 100 training timesteps"):
            generate(model, short, noise, labels, sampler=sampler, num_steps=101)
    for sampler in ("ode-euler", "ode-heun", "dopri5", "sde-euler", "sde-heun"):
        with pytest.raises(ValueError, match=f"num_steps 10001: {sampler} takes at most 10000 steps"):
            generate(model, Transport(), noise, labels, sampler=sampler, num_steps=10_001)
    with pytest.raises(ValueError, match="diffusion-steps must be a whole number of timesteps >= 1 and <= 10,000"):
        GaussianDiffusion.from_schedule("linear", 10**10)
