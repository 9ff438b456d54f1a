"""Exact predictions for Gaussian data, used as the "model" in sampler/objective tests.

Data x ~ N(mu, s^2) independently per dimension.  For any noising x_t = a x + b eps,
(x, eps, x_t) are jointly Gaussian with Var(x_t) = V = a^2 s^2 + b^2, so

    E[x | x_t]   = mu + a s^2 / V (x_t - a mu),   Var(x | x_t)   = s^2 b^2 / V
    E[eps | x_t] = b / V (x_t - a mu),            Var(eps | x_t) = a^2 s^2 / V
    score        = -(x_t - a mu) / V
"""

import math

import torch

MU, S = 0.3, 0.5


def posterior(xt, a, b, mu=MU, s=S):
    """(E[x|x_t], E[eps|x_t], score, V) for x_t = a x + b eps."""
    V = a ** 2 * s ** 2 + b ** 2
    centered = xt - a * mu
    return mu + a * s ** 2 / V * centered, b / V * centered, -centered / V, V


def _bcast(v, x):
    return torch.as_tensor(v).to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))


class DiffusionOracle:
    """Exact eps (and, with ``learn_sigma``, the exact reverse variance as v).

    ``base`` is the 1000-step diffusion whose timesteps the model receives;
    ``sampling`` the (respaced) diffusion whose learned-range interpolation v refers to.
    """

    def __init__(self, base, sampling=None, learn_sigma=True, mu=MU, s=S):
        self.base, self.sampling = base, sampling if sampling is not None else base
        self.learn_sigma, self.mu, self.s = learn_sigma, mu, s
        self.calls = 0

    def __call__(self, x, t, y):
        self.calls += 1
        tl = t.long()
        abar = _bcast(self.base.alphas_cumprod[tl], x)
        _, eps, _, V = posterior(x, abar.sqrt(), (1 - abar).sqrt(), self.mu, self.s)
        if not self.learn_sigma:
            return eps
        d = self.sampling
        # Step index of each original timestep in the sampling diffusion.
        idx = torch.searchsorted(d.timestep_map, t.double())
        var_x0 = self.s ** 2 * (1 - abar) / V
        var = (_bcast(d.posterior_variance[idx], x)
               + _bcast(d.posterior_mean_coef1[idx], x) ** 2 * var_x0)
        lo = _bcast(d.posterior_log_variance_clipped[idx], x)
        hi = _bcast(torch.log(d.betas[idx]), x)
        v = 2 * (torch.log(var) - lo) / (hi - lo) - 1
        return torch.cat([eps, v.expand_as(x)], dim=1)


class TransportOracle:
    """Exact velocity / score / noise prediction of a SiT path for Gaussian data."""

    def __init__(self, transport, mu=MU, s=S):
        self.transport, self.mu, self.s = transport, mu, s
        self.calls = 0

    def parts(self, x, t):
        te = _bcast(t, x)
        if te.shape[0] == 1:
            te = te.expand(x.shape[0], *te.shape[1:])
        a, da = self.transport.path.alpha(te)
        b, db = self.transport.path.sigma(te)
        x1, eps, score, V = posterior(x, a, b, self.mu, self.s)
        return {"velocity": da * x1 + db * eps, "score": score, "noise": eps}

    def __call__(self, x, t, y):
        self.calls += 1
        return self.parts(x, t)[self.transport.prediction]


def gaussian_logp(x, mu=MU, s=S):
    """Exact log N(x; mu, s^2 I) per sample, in nats."""
    D = x[0].numel()
    return (-0.5 * D * math.log(2 * math.pi * s ** 2)
            - 0.5 * ((x - mu) ** 2).flatten(1).sum(1) / s ** 2)


def check_moments(samples, tol=0.03, mu=MU, s=S):
    """Sample mean within tol*s of mu and sample std within a relative tol of s."""
    mean, std = samples.mean().item(), samples.std().item()
    assert abs(mean - mu) < tol * s, f"mean {mean:.4f} vs {mu} (tol {tol * s:.4f})"
    assert abs(std / s - 1) < tol, f"std {std:.4f} vs {s} (rel tol {tol})"
    return mean, std
