"""The EMA's defaults and what is left of its initial weights (torch-free): the end of
training warns with ``ema_warning`` (``training/loop.py``), sampling a checkpoint with
``checkpoint_ema_warning`` (``pipelines/sources.py``, through ``ema_warning_once``);
``training/step.py`` updates the EMA."""

from __future__ import annotations

import math

# The EMA's default decay (DiT's); given without --ema-warmup it means DiT's EMA, no warm-up.
EMA_DECAY = 0.9999
# The end of training warns when the EMA still holds more than this share of its initial
# (random) weights, whose samples are mostly noise (``ema_warning``; for a
# checkpoint, ``checkpoint_ema_warning``, what sampling calls).
EMA_INITIAL_SHARE_WARNING = 0.5

# What a checkpoint that lacks a key trained with, where the field's default is resolved by
# ``TrainConfig.validate`` (None = "auto"): before the automatic warm-up, DiT's EMA without one.
RECORDED_DEFAULTS = {"ema_decay": EMA_DECAY, "ema_warmup": False}


def ema_initial_share(decay: float, updates: int, warmup: bool) -> float:
    """The weight the EMA still gives its initial weights after ``updates`` updates of
    ``training/step.py``'s ``update_ema``: the product of its decays, ``decay ** updates``, or with the warm-up
    ``∏_t min(decay, (1 + t) / (10 + t))`` = ``1 / C(k + 9, 9) · decay ** (updates − k)``, k the
    updates before the cap is reached (in logs: exact for any count)."""
    if updates <= 0:
        return 1.0
    if decay <= 0:
        return 0.0
    k = 0
    if warmup:
        cap = updates if decay >= 1 else math.ceil((10 * decay - 1) / (1 - decay))  # first t with (1+t)/(10+t) >= decay
        k = max(0, min(updates, cap))
    log_share = math.lgamma(k + 1) + math.lgamma(10) - math.lgamma(k + 10) + (updates - k) * math.log(decay)
    return math.exp(log_share)


def ema_warning(decay: float | None, warmup: bool | None, updates: int) -> str | None:
    """The warning for an EMA that is still mostly its initial (random) weights (more than
    ``EMA_INITIAL_SHARE_WARNING`` of them: e.g. 30 updates at 0.9999 without the warm-up keep
    99.7%), naming the numbers and the ways out; None otherwise, or when the decay is unknown."""
    if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0 <= decay <= 1:
        return None
    share = ema_initial_share(decay, updates, bool(warmup))
    if share <= EMA_INITIAL_SHARE_WARNING:
        return None
    if decay == 1:
        horizon, fix = "it never moves", "train with a smaller --ema-decay"
    else:
        horizon = f"its horizon 1/(1 - decay) is {1 / (1 - decay):,.0f} updates"
        fix = "train longer, or with --ema-warmup true or a smaller --ema-decay"
    return (f"the EMA weights (what sample.py and exports use by default) are still {share:.2%} their initial random "
            f"weights after {updates} update{'' if updates == 1 else 's'} at --ema-decay {decay:g} "
            f"{'with' if warmup else 'without'} --ema-warmup ({horizon}): its samples are mostly noise; {fix}, or "
            f"sample the raw weights (sample.py --weights model)")


def checkpoint_ema_warning(ckpt) -> str | None:
    """``ema_warning`` for a training checkpoint (``read.Checkpoint``): its recorded EMA
    settings and update count (a checkpoint before the count was stored: one per step)."""
    config = ckpt.config
    return ema_warning(config.get("ema-decay", RECORDED_DEFAULTS["ema_decay"]),
                       config.get("ema-warmup", RECORDED_DEFAULTS["ema_warmup"]),
                       ckpt.state.get("ema_updates", ckpt.step))


_SAID: set[str] = set()   # the EMA warnings this process has printed (ema_warning_once)


def ema_warning_once(ckpt) -> str | None:
    """``checkpoint_ema_warning``, once per process for the same words: a process that loads
    several checkpoints trained alike (``demo.py --quick`` runs its 15 sampling and scoring
    steps in one process, every model at chance) says it once, not at every load."""
    warning = checkpoint_ema_warning(ckpt)
    if warning is None or warning in _SAID:
        return None
    _SAID.add(warning)
    return warning
