"""Every name a CLI offers, gathered from the packages that own them: importing this module
costs no torch.

``--help``, ``--dry-run`` and argument errors of the CLIs need only these names, so they
answer at once. Each package keeps its own in a small torch-free module, and the code that
does the work imports them from there: the attention's in ``attention/config.py``
(``NaLaConfig``), the model presets in ``models/presets.py`` (positions and time shifts in
``models/grid.py``, VAE tiling in ``models/vae.py``), the data's in ``data/choices.py``, the
objectives' and samplers' in ``diffusion/choices.py``, the evaluator's in
``evaluation/choices.py``, the EMA's in ``checkpoints/ema.py``, and the training run's
(``TrainConfig``: each field a flag and a YAML key) in ``training/config.py`` with the
resume rules in ``training/resume_rules.py``. This module names them for the CLIs (and keeps
``from nala_dit.cli.options import TrainConfig`` working).
"""

from __future__ import annotations

from ..attention.config import ATTENTIONS, GATED_ATTENTIONS, LINEAR_KERNELS, MODEL_OPTIONS, NaLaConfig  # noqa: F401
from ..checkpoints.ema import EMA_DECAY, EMA_INITIAL_SHARE_WARNING, RECORDED_DEFAULTS  # noqa: F401
from ..checks import check_number  # noqa: F401
from ..data.choices import (  # noqa: F401
    CANVAS_SIZES, DIGITS_SIZES, IMAGE_FOLDER_SIZE, LATENT_NORMS, check_canvas_size, check_digits_size,
    default_num_workers,
)
from ..diffusion.choices import (  # noqa: F401
    BETA_SCHEDULES, CFG_SCALE_RANGE, DEFAULT_STEPS, DIFFUSION_SAMPLERS, LOSS_WEIGHTS, MAX_CONTINUOUS_STEPS,
    MAX_DIFFUSION_STEPS, MIN_STEPS, ODE_ATOL, ODE_RTOL, PATHS, PRECISIONS, PREDICTIONS, RENOISE_SAMPLERS, SAMPLERS,
    T_SAMPLINGS, TRANSPORT_SAMPLERS, check_diffusion_steps, check_steps, max_steps, parse_cfg_scale,
)
from ..evaluation.choices import DATASETS, FEATURE_CHOICES, INCEPTION_WEIGHTS_FILE  # noqa: F401
from ..models.grid import POS_EMBED_MODES, TIME_SHIFT_AUTO, TIME_SHIFT_RANGE, parse_time_shift  # noqa: F401
from ..models.presets import (  # noqa: F401
    ATTENTION_GROUPS, ATTENTION_OPTIONS, FAMILIES, MIX_INITS, MLP_KINDS, MODEL_NAMES, PATCHES, SIZES,
    SOFTMAX_BLOCKS_HELP, check_attention_options, check_class_dropout, check_mix_init, parse_softmax_blocks, preset,
)
from ..models.vae import VAE_AUTO_TILING_PIXELS, VAE_TILE_PIXELS, VAE_TILING_MODES  # noqa: F401
from ..training.config import (  # noqa: F401
    CONTEXT_PARALLEL_HELP, FSDP_HELP, HELP_COMMON, HELP_SECTIONS, INHERIT_MODES, MAX_TRAIN_SEED, MODEL_OVERRIDES,
    OBJECTIVE_OPTIONS, REPORT_TO, THREADS_HELP, TrainConfig, check_context_parallel,
)
from ..training.resume_rules import (  # noqa: F401
    RESUME_NOTES, RESUME_RULE, RESUME_RULE_MEANING, RESUME_RULES, RESUME_WHEN,
)


def cfg_scale_arg(text: str) -> float:
    """``parse_cfg_scale`` as an argparse ``type``: the reason, not "invalid value"."""
    import argparse

    try:
        return parse_cfg_scale(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
