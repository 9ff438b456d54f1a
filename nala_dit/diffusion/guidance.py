"""Classifier-free guidance (Ho & Salimans 2022) as a wrapper around ``model_fn``.

    out = uncond + scale * (cond - uncond)        on the guided channels

DiT, SiT and fast-DiT guide only the first 3 of the 4 latent channels (a leftover of
pixel-space ADM); here all eps/velocity channels are guided by default and
``guide_channels=3`` reproduces the old behaviour.  Extra output channels (the learned
variance v of DiT) are always taken from the conditional pass.

The conditional and unconditional passes run as one batched call of ``model_fn``
(batch 2B), so a guided model counts as one function evaluation (nfe) in the
samplers, while costing twice the compute of an unguided one.
"""

import torch


def cfg_model_fn(model_fn, scale, null_label, interval=None, guide_channels=None,
                 eps_channels=None):
    """A guided ``model_fn(x, t, y)``.

    scale: guidance scale; 1 returns ``model_fn`` itself (no batch doubling).
    null_label: the label id of the "no class" embedding (``num_classes``).
    interval: ``(t_lo, t_hi)``, inclusive, in the model's own time units (DiT: timesteps
        0..999; SiT: t in [0, 1]).  Samples whose t lies outside get the plain
        conditional prediction; when no sample of the batch is inside, the model runs
        on the batch once, unbatched.
    eps_channels: number of eps/velocity channels in the output; default: the input
        channel count of x (so the learned-variance half is excluded).
    guide_channels: how many of the leading channels to guide; default all
        ``eps_channels``.
    """
    if scale == 1:
        return model_fn
    if null_label is None:
        raise ValueError(
            f"guidance scale {scale} needs a null label, but null_label is None: the "
            "model was trained without a null class (num_classes=1 / no label dropout), "
            "so there is no unconditional prediction to guide with; use scale 1")
    if interval is not None and interval[0] > interval[1]:
        raise ValueError(f"guidance interval must be (t_lo, t_hi) with t_lo <= t_hi, "
                         f"got {interval}")

    def guided(x, t, y, **kw):   # kw: per-sample tensors the model also takes (a MeanFlow model's end time r)
        if interval is not None:
            inside = (t >= interval[0]) & (t <= interval[1])  # (B,)
            if not bool(inside.any()):
                return model_fn(x, t, y, **kw)
        y_null = torch.full_like(y, null_label)
        kw = {key: torch.cat([val, val]) for key, val in kw.items()}
        out = model_fn(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, y_null]), **kw)
        cond, uncond = out.chunk(2)
        n_eps = x.shape[1] if eps_channels is None else eps_channels
        n = n_eps if guide_channels is None else guide_channels
        mixed = uncond[:, :n] + scale * (cond[:, :n] - uncond[:, :n])
        if interval is not None:
            mixed = torch.where(inside.reshape(-1, *([1] * (x.ndim - 1))), mixed, cond[:, :n])
        return torch.cat([mixed, cond[:, n:]], dim=1)

    return guided
