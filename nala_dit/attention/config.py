"""``NaLaConfig``: every setting of the gated attention layer and its kernels, in one place.

One frozen dataclass carries the settings from the training CLI (``TrainConfig``'s flags are
made from its fields) through the model (``DiT``'s config keys are its fields) to the layer
(``GatedLinearAttention``, ``SoftmaxGatedAttention``) and the kernels (``nala_attention``,
``nala_features``, ``region_nala_attention``, ``fused_opts``). It checks itself once, in
``__post_init__``. The math the constants mean is ``docs/NALA_SPEC.md`` (§2 / §3 / §4 / §7).

Torch-free: the CLIs import it to answer ``--help`` and argument errors at once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# The attention kinds of a model. "softmax" is DiT's own layer; the others live in the gated
# layer of spec §4 (qkvg, LePE, LayerNorm, gate), "softmax_gated" being softmax in that layer
# (to separate kernel from extras).
ATTENTIONS = ("softmax", "nala", "relu", "elu", "softmax_gated")
LINEAR_KERNELS = ("nala", "relu", "elu")
GATED_ATTENTIONS = tuple(a for a in ATTENTIONS if a != "softmax")
KERNELS = LINEAR_KERNELS + ("softmax",)      # what the gated layer runs; "softmax" = softmax_gated
DIRECTIONS = ("cosine", "relu_split")
# rope's angle layouts (functional.rope_angles): "halves" = this repository's [rows | cols]
# over the 2D-wide feature (the default, so configs saved before the option load unchanged);
# "released" = the NaLa authors' released code (ZacharyMeng/NaLaFormer), docs/NALA_SPEC.md §7.
ROPE_LAYOUTS = ("halves", "released")
# What the Triton kernels (attention/nala/triton/launch.py) take, known here so that nala/backend.py's
# dispatch can check a shape without importing Triton: head dims up to 128, and token
# blocks of 16 on a grid axis that holds at most 65535 of them.
TRITON_MAX_HEAD_DIM = 128
TRITON_MAX_TOKENS = 65535 * 16
# NaLa's norm scale s in p = λ(τ + tanh(‖q‖/s)): a positive number (1 = the paper), or
# one of these words: "sqrt_d" (s = √D) or "learned" (one s = exp(ρ) per head).
NORM_SCALE_MODES = ("sqrt_d", "learned")

# Spec §2 / §3 defaults.
POWER = 3.0          # λ
OFFSET = 0.5         # τ
NORM_SCALE = 1.0     # s
ALPHA = 20.0         # α
NORM_EPS = 1e-6      # ε_n
EPS = 1e-6           # ε_z

# Region states (regions.py): R x R regions of the token grid. Their mixing weights are
# (H, R², R²) per layer, H·R⁴ numbers: 65,536 per head at R = 16 (1.0 M in a NaLaDiT-XL/2
# block, 4 % of its 25 M weights), 16.8 M per block at R = 32, 6.4 G per block at R = 100
# (which also needs a grid of 100 token rows). The studies used R = 2 and 4.
MAX_NALA_REGIONS = 16
NALA_REGIONS_COST = ("the mixing weights grow as R⁴: H·R⁴ numbers per layer, 256 per head at R = 4, 65,536 at "
                     f"R = {MAX_NALA_REGIONS}")


def check_parallel_world(size: int, world: int) -> None:
    """``--context-parallel size`` over ``world`` processes: groups of ``size`` consecutive
    ranks, so it must divide them (checked from the launcher's WORLD_SIZE before torch loads,
    and again once the process group is up)."""
    if size < 1 or world % size:
        raise ValueError(f"--context-parallel {size} must divide the number of processes ({world}): launch "
                         f"a multiple of {size} processes (accelerate launch --num_processes N) or pick a "
                         f"divisor of {world}")


def parse_norm_scale(value) -> float | str:
    """``norm_scale`` as the model takes it: a positive finite float, "sqrt_d" or "learned".

    Accepts numbers and numeric strings (a CLI flag or YAML value); anything else is a
    ValueError that names the option and what it allows.
    """
    allowed = f"a positive number (1 = the paper's raw norm) or one of {NORM_SCALE_MODES}"
    if isinstance(value, str) and value in NORM_SCALE_MODES:
        return value
    if isinstance(value, bool):
        raise ValueError(f"norm_scale must be {allowed}, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"norm_scale must be {allowed}, got {value!r}") from None
    if not (number > 0 and number != float("inf")):
        raise ValueError(f"norm_scale must be {allowed}, got {value!r}")
    return number


def check_direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    return direction


def check_nala_regions(value) -> int:
    """R of ``--nala-regions``: an integer from 1 (one global state, plain NaLa) to
    ``MAX_NALA_REGIONS``; anything else a one-line ValueError that says what R costs.
    Whether R fits the token grid (R <= its shorter side) is ``regions.check_regions``'."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"nala-regions must be an integer >= 1 (1 = one global state, plain NaLa), got {value!r}")
    if value > MAX_NALA_REGIONS:
        per_head = f"{value ** 4:,}" if value < 10 ** 4 else f"{float(value) ** 4:.1e}"
        raise ValueError(f"nala-regions {value} is more than {MAX_NALA_REGIONS} regions per side: {NALA_REGIONS_COST}, "
                         f"{per_head} at R = {value}; use 2 to {MAX_NALA_REGIONS}, no more than the token "
                         f"grid's side (1 = plain NaLa)")
    return value


def _option(default, help: str, applies: tuple[str, ...], key: str | None = None, **flag):
    """A field that is also a model option: a ``DiT`` config key and a ``train.py`` flag
    (``key``, default the field's name), read by the attentions in ``applies``."""
    return field(default=default, metadata=dict(help=help, applies=applies, key=key, **flag))


@dataclass(frozen=True)
class NaLaConfig:
    """The gated attention layer of spec §4 and its kernel.

    ``kernel``: ``nala`` (the default), the ReLU / 1+ELU baselines (``relu``, ``elu``) or
    ``softmax`` (SDPA inside the gated layer, the model's ``softmax_gated``). ``norm_scale``
    s: a positive number (1 = the paper), ``"sqrt_d"`` (s = √D, resolved per head dim by
    ``norm_scale_for``) or ``"learned"`` (the layer's per-head ``exp(ρ)``, applied to q before
    the kernel, which then runs with s = 1). ``regions`` R: R × R region states (NaLa only;
    1 = one global state). ``rope``: the numerator-only rotary embedding of §7 (linear
    kernels only, not with regions).
    """

    kernel: str = "nala"
    direction: str = _option("cosine", "NaLa direction map (relu_split with --rope true --rope-layout released: the "
                                       "layer of the authors' released code, NaLaConfig.authors(), "
                                       "configs/digits_nala_dit_authors.yaml)", ("nala",), choices=list(DIRECTIONS))
    lepe: bool = _option(True, "NaLa/linear: depthwise-conv positional term on v", GATED_ATTENTIONS)
    gate: bool = _option(True, "NaLa/linear: SiLU output gate", GATED_ATTENTIONS)
    out_norm: bool = _option(True, "NaLa/linear: LayerNorm before the gate", GATED_ATTENTIONS)
    power: float = _option(POWER, "NaLa λ", ("nala",))
    offset: float = _option(OFFSET, "NaLa τ", ("nala",))
    norm_scale: float | str = _option(NORM_SCALE, "NaLa s in p = λ(τ + tanh(‖q‖/s)): a positive number (1 = the "
                                      "paper), 'sqrt_d' (s = √D) or 'learned' (one exp(ρ) per head)", ("nala",),
                                      flag_type=str)
    alpha: float = _option(ALPHA, "NaLa α (direction sharpness)", ("nala",))
    rope: bool = _option(False, "linear kernels: 2-D rotary embedding on the numerator features only (angle "
                                "layout: --rope-layout)", LINEAR_KERNELS)
    rope_layout: str = _option("halves", "rope's angle layout: 'halves' (this repository's [rows | cols] over the "
                                         "2D-wide feature) or 'released' (the NaLa authors' released code: D/4 "
                                         "frequencies, rows and cols per D-wide half); docs/NALA_SPEC.md §7",
                               LINEAR_KERNELS, choices=list(ROPE_LAYOUTS))
    regions: int = _option(1, "NaLa region states: cut the token grid into R x R regions, one key-value state each, "
                              "mixed per query region by learned weights (1 = one global state, plain NaLa); R from "
                              f"1 to {MAX_NALA_REGIONS} and at most the token grid's side: {NALA_REGIONS_COST}; "
                              "docs/training.md", ("nala",), key="nala_regions")
    norm_eps: float = NORM_EPS
    eps: float = EPS

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        check_direction(self.direction)
        object.__setattr__(self, "norm_scale", parse_norm_scale(self.norm_scale))
        check_nala_regions(self.regions)
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}")
        if self.rope and self.kernel not in LINEAR_KERNELS:
            raise ValueError(f"rope applies to the linear kernels {LINEAR_KERNELS} (numerator-only rotary "
                             f"embedding), not to kernel={self.kernel!r}; use rope=False")
        if self.regions != 1 and self.kernel != "nala":
            raise ValueError(f"nala_regions={self.regions} applies to NaLa attention, not to kernel={self.kernel!r}; "
                             f"use nala_regions=1")
        if self.regions != 1 and self.rope:
            raise ValueError("region states and rope do not combine (both rewrite NaLa's state); use one of them")

    @classmethod
    def of(cls, config: NaLaConfig | None = None, **overrides) -> NaLaConfig:
        """``config`` (default: the spec's defaults) with keyword ``overrides``, checked:
        what the functional API takes (``nala_attention(q, k, v, power=2)``)."""
        config = cls() if config is None else config
        def same(k, v):   # True == 1.0 in Python: a value of another type is a change (and checked)
            return hasattr(config, k) and type(getattr(config, k)) is type(v) and getattr(config, k) == v

        changed = {k: v for k, v in overrides.items() if not same(k, v)}
        return dataclasses.replace(config, **changed) if changed else config   # unchanged: the same object

    @classmethod
    def authors(cls, **overrides) -> NaLaConfig:
        """The NaLa layer as the authors' released code runs it (``NormAwareLinearAttn`` in
        ZacharyMeng/NaLaFormer): relu_split direction, λ = 3, τ = 0.5, s = 1, LePE, SiLU gate,
        output LayerNorm and the numerator-only RoPE in the released angle layout. One
        difference stays: ‖q‖ is clamped at ``norm_eps`` (the released code divides by it,
        NaN at q = 0). ``overrides`` as in ``of``; docs/NALA_SPEC.md §7, docs/differences.md."""
        return cls.of(cls(kernel="nala", direction="relu_split", power=3.0, offset=0.5, norm_scale=1.0,
                          lepe=True, gate=True, out_norm=True, rope=True, rope_layout="released"), **overrides)

    def model_options(self) -> dict:
        """The model options (``MODEL_OPTIONS``: model config keys = ``train.py`` fields) this
        config sets, for ``create_model(name, **config.model_options())``; ``from_model`` reads
        them back (``NaLaConfig.from_model("nala", **c.model_options()) == c``)."""
        return {key: getattr(self, f.name) for key, f in MODEL_OPTIONS.items()}

    @classmethod
    def from_model(cls, attention: str, **options) -> NaLaConfig:
        """The config of a model's attention from its config keys (``MODEL_OPTIONS``: ``lepe``,
        ``power``, ..., ``nala_regions``); ``softmax`` and ``softmax_gated`` run the kernel
        ``softmax``. An unknown key is a TypeError, as for any keyword argument."""
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        unknown = sorted(set(options) - set(MODEL_OPTIONS))
        if unknown:
            raise TypeError(f"unexpected model option(s) {unknown}; the attention takes {', '.join(MODEL_OPTIONS)}")
        kernel = "softmax" if attention.startswith("softmax") else attention
        return cls(kernel=kernel, **{MODEL_OPTIONS[k].name: v for k, v in options.items()})

    def norm_scale_for(self, head_dim: int) -> float:
        """The scale s the kernels divide ‖q‖ by: the number, √D for ``"sqrt_d"``, and 1 for
        ``"learned"`` (the layer has applied its learned scale to q: NaLa(q/s, 1) == NaLa(q, s))."""
        if self.norm_scale == "sqrt_d":
            return math.sqrt(head_dim)
        return 1.0 if self.norm_scale == "learned" else float(self.norm_scale)


# The fields that are model options, by their model-config key (= train.py's field): the
# DiT keyword arguments and config keys, the TrainConfig flags and the table of which
# attentions read each (``options.ATTENTION_OPTIONS``) are made from this.
MODEL_OPTIONS = {f.metadata["key"] or f.name: f for f in dataclasses.fields(NaLaConfig) if "applies" in f.metadata}
