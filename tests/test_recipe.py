"""The 2025 training recipe (issue 32): logit-normal times, warm-up, β2, clipping, NaN
skips, validation during training, trackers. Each knob against a known answer."""

import math

import pytest
import torch

from nala_dit.diffusion import GaussianDiffusion
from nala_dit.transport import Transport

# Kolmogorov-Smirnov: at n draws, sup |F_n − F| exceeds 1.95/√n with probability 0.001.
KS_N = 20_000
KS_BOUND = 1.95 / math.sqrt(KS_N)


def logit_normal_cdf(u: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """P(sigmoid(mean + std·z) <= u), z ~ N(0, 1): Φ((logit u − mean) / std)."""
    u = u.double().clamp(1e-300, 1 - 1e-16)
    return 0.5 * (1 + torch.erf((torch.log(u) - torch.log1p(-u) - mean) / (std * math.sqrt(2))))


@pytest.mark.parametrize("mean,std", [(0.0, 1.0), (0.5, 0.8)])
def test_sit_logit_normal_times_follow_the_cdf(mean, std):
    """SiT's t = 1 is data: t = 1 − noise fraction, so P(t <= x) = 1 − F(1 − x)."""
    tr = Transport(t_sampling="logit-normal", t_mean=mean, t_std=std)
    t = tr.sample_t(KS_N, generator=torch.Generator().manual_seed(0)).double().sort().values
    model = 1 - logit_normal_cdf(1 - t, mean, std)
    n = torch.arange(1, KS_N + 1, dtype=torch.float64) / KS_N
    ks = torch.maximum((n - model).abs(), (n - 1 / KS_N - model).abs()).max().item()
    assert ks < KS_BOUND, ks
    # the orientation matters: the same draws read as noise fractions are far off (mean 0.5)
    flipped = logit_normal_cdf(t, mean, std)
    assert mean == 0 or torch.maximum((n - flipped).abs(), (n - 1 / KS_N - flipped).abs()).max() > 5 * KS_BOUND


def test_dit_logit_normal_index_follows_the_discretised_cdf():
    """DiT's index i = min(floor(T·u), T − 1): P(i <= k) = F((k + 1) / T) at every k."""
    T, mean, std = 1000, 0.5, 0.8
    diffusion = GaussianDiffusion.from_schedule("linear", T, t_sampling="logit-normal", t_mean=mean, t_std=std)
    torch.manual_seed(0)
    i = diffusion.sample_timesteps(KS_N)
    assert i.dtype == torch.long and 0 <= i.min() and i.max() <= T - 1
    empirical = torch.bincount(i, minlength=T).cumsum(0).double() / KS_N
    model = logit_normal_cdf(torch.arange(1, T + 1, dtype=torch.float64) / T, mean, std)
    model[-1] = 1.0
    assert (empirical - model).abs().max().item() < KS_BOUND


def test_uniform_times_are_the_official_draws():
    """The default draws exactly what DiT (randint) and SiT (rand) draw, stream for stream."""
    torch.manual_seed(3)
    a = GaussianDiffusion.from_schedule("linear", 1000).sample_timesteps(64)
    torch.manual_seed(3)
    assert torch.equal(a, torch.randint(0, 1000, (64,)))
    b = Transport().sample_t(64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(b, torch.rand(64, generator=torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError, match="t-std > 0"):
        Transport(t_sampling="logit-normal", t_std=0.0)
    with pytest.raises(ValueError, match="t_sampling 'lognormal'"):
        GaussianDiffusion.from_schedule("linear", 1000, t_sampling="lognormal")
