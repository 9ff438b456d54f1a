"""Gaussian diffusion for DiT: DDPM / iDDPM training terms and DDPM / DDIM steps.

Notation (timesteps t = 0..T-1, T = 1000 for DiT; a batch of t is a ``(B,)`` tensor):

    alpha_t = 1 - beta_t,  abar_t = prod_{s<=t} alpha_s                   (DDPM, Ho 2020)
    q(x_t | x_0)       = N(sqrt(abar_t) x_0, (1 - abar_t) I)             (Ho 2020, eq. 4)
    q(x_{t-1}|x_t,x_0) = N(mu~_t, beta~_t I)                              (Ho 2020, eq. 6-7)
        mu~_t   = beta_t sqrt(abar_{t-1}) / (1-abar_t) x_0
                  + (1-abar_{t-1}) sqrt(alpha_t) / (1-abar_t) x_t
        beta~_t = beta_t (1-abar_{t-1}) / (1-abar_t)
    x_0 from eps: x_0 = (x_t - sqrt(1-abar_t) eps) / sqrt(abar_t)         (eq. 4 inverted)

The model predicts eps and, with ``learned_range`` variance (iDDPM, Nichol & Dhariwal
2021, eq. 15), an interpolation value v in [-1, 1]:

    log Sigma = (v+1)/2 * log beta_t + (1 - (v+1)/2) * log beta~_t

The iDDPM hybrid loss (Nichol & Dhariwal 2021, eq. 16) is
``L = ||eps - eps_hat||^2 + lambda * L_vlb`` where the VLB term sees the predicted
mean only through a stop-gradient, so it trains the variance alone.  Like ADM we
report ``vb`` per timestep in bits/dim, unscaled at any T as DiT trains (its
``create_diffusion`` picks ``LossType.MSE``; iDDPM's ``RESCALED_MSE`` would multiply it
by T/1000, which only differs from DiT when T != 1000):

    L_{t>0} = KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t))                   (Ho 2020, eq. 5)
    L_0     = -log p(x_0|x_1), a Gaussian discretised to 256 bins on [-1, 1]
              (Ho 2020, sec. 3.3).  This assumes pixel data; for latents it is kept
              as ADM computes it, which is what DiT trains with.
    L_T     = KL(q(x_T|x_0) || N(0, I))                                  (``prior_bpd``)

DDIM (Song et al. 2021, eq. 12) with sigma_t = eta * sqrt((1-abar_{t-1})/(1-abar_t))
* sqrt(1 - abar_t/abar_{t-1}):

    x_{t-1} = sqrt(abar_{t-1}) x_0_hat + sqrt(1-abar_{t-1}-sigma_t^2) eps_hat + sigma_t z

Respacing (iDDPM sec. 4): keep a subset S of timesteps and recompute
beta'_i = 1 - abar_{S_i} / abar_{S_{i-1}}; the model still receives the *original*
timestep S_i (DiT's ``_WrappedModel``), never a rescaled one.

Schedules are stored in float64 (as ADM's numpy arrays) and cast to the dtype of x
when gathered.  ``model_fn(x, t, y)`` receives t as a float tensor holding integer
values in the original 0..T-1 range.
"""

import math

import torch

from .choices import BETA_SCHEDULES, check_diffusion_steps  # noqa: F401  (plain data, shared with the CLIs)
from .transport import check_t_sampling, noise_logits

MODEL_VAR_TYPES = ("learned_range", "fixed_small", "fixed_large")


def get_named_beta_schedule(name, num_timesteps=1000):
    """Betas of ADM's named schedules, float64 ``(T,)``; T is checked first (``check_diffusion_steps``:
    every objective is built here, from a flag, a checkpoint or a pipeline, so an edited 10^10 is one
    line, not 80 GB)."""
    check_diffusion_steps(num_timesteps, "diffusion-steps")
    if name == "linear":
        # Ho et al. use 1e-4..0.02 for T = 1000; ADM scales the range so other T keep
        # the same total noise (for T = 1000 this is exactly linspace(1e-4, 0.02)).
        scale = 1000.0 / num_timesteps
        return torch.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=torch.float64)
    if name == "cosine":
        # iDDPM eq. 17, with betas clipped at 0.999 to avoid a singularity at t = T.
        def abar(s):
            return math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2

        betas = [min(1 - abar((i + 1) / num_timesteps) / abar(i / num_timesteps), 0.999)
                 for i in range(num_timesteps)]
        return torch.tensor(betas, dtype=torch.float64)
    raise ValueError(f"unknown beta schedule {name!r}; allowed: {', '.join(BETA_SCHEDULES)}")


def normal_kl(mean1, logvar1, mean2, logvar2):
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approx_standard_normal_cdf(x):
    # The tanh approximation ADM uses; kept so decoder NLLs match ADM's numbers.
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def discretized_gaussian_log_likelihood(x, means, log_scales):
    """Log-probability of x in [-1, 1] under a Gaussian discretised into 256 bins.

    The outermost bins extend to -inf and +inf (Ho 2020, eq. 13).
    """
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus,
                       torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def mean_flat(x):
    return x.mean(dim=tuple(range(1, x.ndim)))


def space_timesteps(num_timesteps, section_counts):
    """Timesteps kept when respacing a ``num_timesteps`` diffusion (a sorted list).

    ``section_counts`` is an int, a list of ints or a string ``"10,15,20"``: the
    timeline is cut into equal sections and each gets that many evenly spaced steps
    (ADM's rule; for ``250`` out of 1000 this keeps 0 and 999).  ``"ddimN"`` gives N
    evenly spaced steps over the whole range.  Unlike ADM's ``ddimN`` (stride
    ``T // N``, which for ``ddim50`` stops at 980), and unlike a section of a single
    step, the result here always contains both endpoints 0 and T-1: sampling must
    start from the fully noised level the model saw during training.
    """
    if isinstance(section_counts, str):
        if section_counts.startswith("ddim"):
            section_counts = [int(section_counts[len("ddim"):])]
        else:
            section_counts = [int(x) for x in section_counts.split(",")]
    elif isinstance(section_counts, int):
        section_counts = [section_counts]
    if any(c < 1 for c in section_counts):
        raise ValueError(f"section counts must be >= 1, got {section_counts}")
    size_per, extra = divmod(num_timesteps, len(section_counts))
    steps, start = set(), 0
    for i, count in enumerate(section_counts):
        size = size_per + (1 if i < extra else 0)
        if size < count:
            raise ValueError(f"cannot take {count} steps from a section of {size} timesteps")
        stride = 1.0 if count <= 1 else (size - 1) / (count - 1)
        steps.update(start + round(stride * j) for j in range(count))
        start += size
    steps.update((0, num_timesteps - 1))
    return sorted(steps)


def shift_timesteps(timesteps, alphas_cumprod, s: float) -> list[int]:
    """Move timesteps so that log-SNR drops by 2·log s (the DDPM form of SD3's shift;
    ``transport.shift_time`` is the same rule for SiT's linear path).

    Each interior t goes to the integer t' whose log SNR(t') = log(abar / (1 − abar)) is
    nearest to log SNR(t) − 2·log s; 0 and T − 1 stay (sampling still starts at the
    training's noisiest level and ends at its cleanest). Steps that land on the same t'
    merge, so a strong shift can return fewer steps. s = 1 is the identity.
    """
    timesteps = [int(t) for t in timesteps]
    if s == 1.0:
        return timesteps
    acp = torch.as_tensor(alphas_cumprod, dtype=torch.float64)
    logsnr = torch.log(acp) - torch.log1p(-acp)              # decreasing in t
    last = len(acp) - 1
    out = set()
    for t in timesteps:
        if t in (0, last):
            out.add(t)
            continue
        target = logsnr[t] - 2 * math.log(s)
        out.add(int(torch.argmin((logsnr - target).abs())))
    return sorted(out)


def _gather(arr, t, x):
    """arr[t] broadcast to x's shape and dtype."""
    out = arr.to(x.device)[t.long()].to(x.dtype)
    return out.reshape(-1, *([1] * (x.ndim - 1)))


class GaussianDiffusion:
    """A discrete Gaussian diffusion with T = ``len(betas)`` steps.

    ``timestep_map`` gives, for each of the T (possibly respaced) steps, the original
    timestep passed to the model; identity when None.
    """

    def __init__(self, betas, model_var_type="learned_range", timestep_map=None, time_shift: float = 1.0,
                 t_sampling: str = "uniform", t_mean: float = 0.0, t_std: float = 1.0):
        if model_var_type not in MODEL_VAR_TYPES:
            raise ValueError(f"unknown model_var_type {model_var_type!r}; "
                             f"allowed: {', '.join(MODEL_VAR_TYPES)}")
        betas = torch.as_tensor(betas, dtype=torch.float64)
        if betas.ndim != 1 or not bool(((betas > 0) & (betas <= 1)).all()):
            raise ValueError("betas must be a 1-D tensor with values in (0, 1]")
        if not time_shift > 0:
            raise ValueError(f"time_shift must be > 0 (1 = no shift), got {time_shift}")
        self.betas = betas
        self.model_var_type = model_var_type
        # training timesteps (``sample_timesteps``); samplers pass their own to ``respace``
        self.time_shift = float(time_shift)
        check_t_sampling(t_sampling, t_mean, t_std)
        self.t_sampling, self.t_mean, self.t_std = t_sampling, float(t_mean), float(t_std)
        self.num_timesteps = len(betas)
        self.timestep_map = (torch.arange(self.num_timesteps, dtype=torch.float64)
                             if timestep_map is None
                             else torch.as_tensor(timestep_map, dtype=torch.float64))

        alphas = 1.0 - betas
        self.alphas_cumprod = torch.cumprod(alphas, 0)
        self.alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64),
                                              self.alphas_cumprod[:-1]])
        self.sqrt_alphas_cumprod = self.alphas_cumprod.sqrt()
        self.sqrt_one_minus_alphas_cumprod = (1.0 - self.alphas_cumprod).sqrt()
        self.sqrt_recip_alphas_cumprod = (1.0 / self.alphas_cumprod).sqrt()
        self.sqrt_recipm1_alphas_cumprod = (1.0 / self.alphas_cumprod - 1.0).sqrt()

        acp, acp_prev = self.alphas_cumprod, self.alphas_cumprod_prev
        self.posterior_variance = betas * (1.0 - acp_prev) / (1.0 - acp)
        # beta~_0 = 0: clip its log to beta~_1 as ADM does (only used at t = 0).
        self.posterior_log_variance_clipped = torch.log(
            torch.cat([self.posterior_variance[1:2], self.posterior_variance[1:]]))
        self.posterior_mean_coef1 = betas * acp_prev.sqrt() / (1.0 - acp)
        self.posterior_mean_coef2 = (1.0 - acp_prev) * alphas.sqrt() / (1.0 - acp)

    @classmethod
    def from_schedule(cls, schedule="linear", num_timesteps=1000, model_var_type="learned_range", time_shift=1.0,
                      t_sampling="uniform", t_mean=0.0, t_std=1.0):
        return cls(get_named_beta_schedule(schedule, num_timesteps), model_var_type, time_shift=time_shift,
                   t_sampling=t_sampling, t_mean=t_mean, t_std=t_std)

    def respace(self, section_counts, time_shift: float = 1.0):
        """A diffusion over the kept timesteps (``space_timesteps``, then ``shift_timesteps``)."""
        keep = shift_timesteps(space_timesteps(self.num_timesteps, section_counts), self.alphas_cumprod, time_shift)
        betas, last = [], 1.0
        for i in keep:
            acp = float(self.alphas_cumprod[i])
            betas.append(1.0 - acp / last)
            last = acp
        return GaussianDiffusion(torch.tensor(betas, dtype=torch.float64),
                                 self.model_var_type, self.timestep_map[keep])

    def sample_timesteps(self, batch: int, device=None) -> torch.Tensor:
        """Training timesteps: uniform over 0..T-1 (DiT), or logit-normal: the index
        ``min(floor(T·u), T − 1)`` of the noise fraction u = sigmoid(``noise_logits``), the
        draw SiT's times come from; each moved by ``time_shift``."""
        if self.t_sampling == "uniform":
            t = torch.randint(0, self.num_timesteps, (batch,), device=device)
        else:
            u = torch.sigmoid(noise_logits(batch, self.t_mean, self.t_std, device).double())
            t = (u * self.num_timesteps).floor().long().clamp_(max=self.num_timesteps - 1)
        if self.time_shift == 1.0:
            return t
        if getattr(self, "_shift_table", None) is None:  # t -> shifted t, for every t
            self._shift_table = torch.tensor([shift_timesteps([i], self.alphas_cumprod, self.time_shift)[0]
                                              for i in range(self.num_timesteps)])
        return self._shift_table.to(t.device)[t]

    def model_timesteps(self, t):
        """The original timesteps (float) the model sees for step indices t."""
        return self.timestep_map.to(t.device)[t.long()].float()

    def q_mean_variance(self, x_start, t):
        mean = _gather(self.sqrt_alphas_cumprod, t, x_start) * x_start
        var = _gather(1.0 - self.alphas_cumprod, t, x_start)
        log_var = _gather(torch.log(1.0 - self.alphas_cumprod), t, x_start)
        return mean, var, log_var

    def q_sample(self, x_start, t, noise=None, generator=None):
        if noise is None:
            noise = torch.randn(x_start.shape, generator=generator, dtype=x_start.dtype,
                                device=x_start.device)
        return (_gather(self.sqrt_alphas_cumprod, t, x_start) * x_start
                + _gather(self.sqrt_one_minus_alphas_cumprod, t, x_start) * noise)

    def q_posterior_mean_variance(self, x_start, x_t, t):
        mean = (_gather(self.posterior_mean_coef1, t, x_t) * x_start
                + _gather(self.posterior_mean_coef2, t, x_t) * x_t)
        return (mean, _gather(self.posterior_variance, t, x_t),
                _gather(self.posterior_log_variance_clipped, t, x_t))

    def predict_xstart_from_eps(self, x_t, t, eps):
        return (_gather(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t
                - _gather(self.sqrt_recipm1_alphas_cumprod, t, x_t) * eps)

    def predict_eps_from_xstart(self, x_t, t, x_start):
        return ((_gather(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t - x_start)
                / _gather(self.sqrt_recipm1_alphas_cumprod, t, x_t))

    def p_mean_variance(self, model_fn, x, t, y, clip_denoised=False, model_output=None):
        """Mean and variance of p(x_{t-1} | x_t) from one model call.

        Returns a dict with ``mean``, ``variance``, ``log_variance``, ``pred_xstart``
        and ``eps``.  ``model_output`` skips the call (used by the stop-gradient VLB).
        """
        C = x.shape[1]
        if model_output is None:
            model_output = model_fn(x, self.model_timesteps(t), y)
        if self.model_var_type == "learned_range":
            if model_output.shape[1] != 2 * C:
                raise ValueError(f"learned_range variance needs {2 * C} output channels "
                                 f"(eps and v), got {model_output.shape[1]}")
            eps, v = model_output[:, :C], model_output[:, C:]
            min_log = _gather(self.posterior_log_variance_clipped, t, x)
            max_log = _gather(torch.log(self.betas), t, x)
            frac = (v + 1) / 2
            log_variance = frac * max_log + (1 - frac) * min_log
            variance = torch.exp(log_variance)
        else:
            eps = model_output[:, :C]
            if self.model_var_type == "fixed_large":
                # beta_t, except beta~_1 at t = 0 for a better decoder likelihood (ADM).
                var_arr = torch.cat([self.posterior_variance[1:2], self.betas[1:]])
                variance = _gather(var_arr, t, x).expand_as(x)
                log_variance = _gather(torch.log(var_arr), t, x).expand_as(x)
            else:
                variance = _gather(self.posterior_variance, t, x).expand_as(x)
                log_variance = _gather(self.posterior_log_variance_clipped, t, x).expand_as(x)
        pred_xstart = self.predict_xstart_from_eps(x, t, eps)
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1, 1)
        mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x, t)
        return {"mean": mean, "variance": variance, "log_variance": log_variance,
                "pred_xstart": pred_xstart, "eps": eps}

    def vb_terms_bpd(self, model_fn, x_start, x_t, t, y, model_output=None):
        """L_{t-1} of the VLB in bits/dim per sample: KL for t > 0, decoder NLL at t = 0."""
        true_mean, _, true_log_var = self.q_posterior_mean_variance(x_start, x_t, t)
        out = self.p_mean_variance(model_fn, x_t, t, y, model_output=model_output)
        kl = mean_flat(normal_kl(true_mean, true_log_var, out["mean"], out["log_variance"]))
        nll = -mean_flat(discretized_gaussian_log_likelihood(
            x_start, out["mean"], 0.5 * out["log_variance"]))
        return torch.where(t == 0, nll, kl) / math.log(2.0), out

    def training_losses(self, model_fn, x_start, t, y, noise=None, generator=None):
        """iDDPM hybrid loss per sample: dict with ``loss``, ``mse`` and ``vb``."""
        if noise is None:
            noise = torch.randn(x_start.shape, generator=generator, dtype=x_start.dtype,
                                device=x_start.device)
        x_t = self.q_sample(x_start, t, noise)
        model_output = model_fn(x_t, self.model_timesteps(t), y)
        C = x_start.shape[1]
        terms = {"mse": mean_flat((noise - model_output[:, :C]) ** 2)}
        if self.model_var_type == "learned_range":
            # Stop-gradient on eps: the VLB only trains the variance (iDDPM sec. 3.1).
            frozen = torch.cat([model_output[:, :C].detach(), model_output[:, C:]], dim=1)
            vb, _ = self.vb_terms_bpd(None, x_start, x_t, t, y, model_output=frozen)
            terms["vb"] = vb
            terms["loss"] = terms["mse"] + terms["vb"]
        else:
            terms["vb"] = torch.zeros_like(terms["mse"])
            terms["loss"] = terms["mse"]
        return terms

    def prior_bpd(self, x_start):
        """KL(q(x_T | x_0) || N(0, I)) in bits/dim per sample (L_T)."""
        t = torch.full((x_start.shape[0],), self.num_timesteps - 1, device=x_start.device)
        mean, _, log_var = self.q_mean_variance(x_start, t)
        kl = normal_kl(mean, log_var, torch.zeros_like(mean), torch.zeros_like(log_var))
        return mean_flat(kl) / math.log(2.0)

    def p_sample(self, model_fn, x, t, y, noise, clip_denoised=False):
        """One ancestral step x_t -> x_{t-1} (no noise added at t = 0)."""
        out = self.p_mean_variance(model_fn, x, t, y, clip_denoised=clip_denoised)
        nonzero = (t != 0).to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
        return out["mean"] + nonzero * torch.exp(0.5 * out["log_variance"]) * noise, out

    def ddim_step(self, model_fn, x, t, y, noise=None, eta=0.0, clip_denoised=False):
        """One DDIM step x_t -> x_{t-1} (Song 2021, eq. 12); ``noise`` unused if eta == 0."""
        # DDIM needs eps only: any variance channels of the output are ignored.
        eps = model_fn(x, self.model_timesteps(t), y)[:, :x.shape[1]]
        pred_xstart = self.predict_xstart_from_eps(x, t, eps)
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1, 1)
            # Re-derive eps from the clipped x_0 so both stay consistent.
            eps = self.predict_eps_from_xstart(x, t, pred_xstart)
        out = {"pred_xstart": pred_xstart, "eps": eps}
        abar = _gather(self.alphas_cumprod, t, x)
        abar_prev = _gather(self.alphas_cumprod_prev, t, x)
        sigma = eta * torch.sqrt((1 - abar_prev) / (1 - abar)) * torch.sqrt(1 - abar / abar_prev)
        mean = abar_prev.sqrt() * pred_xstart + torch.sqrt(1 - abar_prev - sigma ** 2) * eps
        if eta == 0:
            return mean, out
        nonzero = (t != 0).to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
        return mean + nonzero * sigma * noise, out
