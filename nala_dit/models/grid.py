"""The token grid and its positions: one owner for "what size is this image, in tokens".

A model is trained on latents (or pixels) of side ``input_size``; it runs on any (H, W)
that patches evenly. Every caller — the model's forward, the pipelines, sampling,
training, fine-tuning up the resolution ladder — asks this module instead of re-deriving
sizes:

    image pixels (H, W)  --÷ vae_factor-->  latent (h, w)  --÷ patch-->  tokens (gh, gw)

``vae_factor`` is 8 for the SD VAE and 1 for a pixel-space model (the embedded digits).

Positions for a grid that is not the trained one follow the model's ``positions`` policy
(config key ``positions``, flag ``--pos-embed``: ``POS_EMBED_MODES``; docs/highres.md
collects what PixArt, Sana and DiT do):

- ``extrapolate`` (DiT, the default): integer positions 0…g−1. Exact for published
  weights at their own size; a larger grid reaches positions never seen in training.
- ``interpolate`` (PixArt's rule): position i ↦ i · base / g, base = the grid side the
  model was first trained at (``base_size / patch``). A larger image gets *finer*
  positions in the trained range instead of new ones; the trained grid is unchanged.
- ``none``: no absolute positions at all (neither the sin-cos table nor RoPE); the
  model relies on the LePE depthwise conv for position, as Sana's 1K model relies on
  its conv.

The positions themselves are here too: DiT's fixed 2-D sin-cos table of a grid
(``TokenGrid.table``, ``sincos_pos_embed_2d``) and the model's side of them
(``GridPositions``: the stored table of the trained grid, the others computed once per
grid). Torch is imported only where a table is computed: the CLIs read this module first.

The resolution-aware noise-schedule shift (``time_shift``) is resolved here too: the
conventional ``"auto"`` is s = √(N_tokens / N_base) (SD3, Sana), N_base the token count
of the base grid.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from ..checks import number_in

# Positions at a grid other than the trained one (--pos-embed, the model config
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
    return number_in(value, lo, hi, f"time shift must be {allowed}")


_SIZE = re.compile(r"^\s*(\d+)\s*(?:[x×]\s*(\d+))?\s*$")


def parse_image_size(value) -> tuple[int, int]:
    """``512``, ``"512"``, ``"512x768"`` (height × width) or ``(512, 768)`` → (H, W) pixels.

    Zero, negative and malformed sizes are a ValueError naming the value and the forms."""
    forms = "a positive side N (square) or HxW in pixels, e.g. 512 or 512x768"
    if isinstance(value, bool):
        raise ValueError(f"image size must be {forms}, got {value!r}")
    if isinstance(value, int):
        hw = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        hw = (int(value[0]), int(value[1]))
    elif isinstance(value, str) and _SIZE.match(value):
        a, b = _SIZE.match(value).groups()
        hw = (int(a), int(b if b is not None else a))
    else:
        raise ValueError(f"image size must be {forms}, got {value!r}")
    if min(hw) < 1:
        raise ValueError(f"image size must be {forms}, got {value!r}")
    return hw


def format_size(hw: tuple[int, int]) -> str:
    return str(hw[0]) if hw[0] == hw[1] else f"{hw[0]}x{hw[1]}"


def latent_size(image_size, vae_factor: int, patch_size: int) -> tuple[int, int]:
    """Image (H, W) pixels → model input (h, w); each side must be a multiple of
    ``vae_factor × patch_size`` (one token per patch of the latent)."""
    h, w = parse_image_size(image_size)
    step = vae_factor * patch_size
    if h % step or w % step:
        if h == w:
            valid = ", ".join(str(step * k) for k in range(max(1, h // step - 1), max(1, h // step) + 3))
        else:  # the valid sizes next to each side, nearest first: 8x15 → 8x14, 8x16
            near = sorted(((a, b) for a in _nearest_multiples(h, step) for b in _nearest_multiples(w, step)),
                          key=lambda ab: (abs(ab[0] - h) + abs(ab[1] - w), ab))
            valid = ", ".join(f"{a}x{b}" for a, b in near)
        raise ValueError(
            f"image size {format_size((h, w))} is not a multiple of VAE factor {vae_factor} × patch {patch_size} "
            f"= {step} on each side; choose e.g. {valid}")
    return h // vae_factor, w // vae_factor


def _nearest_multiples(side: int, step: int) -> list[int]:
    """``side`` itself if it is a multiple of ``step``, else the multiples just below (if
    any) and above it."""
    if side % step == 0:
        return [side]
    below = side // step * step
    return [v for v in (below, below + step) if v >= step]


def check_positions(mode: str) -> str:
    if mode not in POS_EMBED_MODES:
        raise ValueError(f"positions must be one of {', '.join(POS_EMBED_MODES)} (--pos-embed), got {mode!r}")
    return mode


@dataclass(frozen=True)
class TokenGrid:
    """An h×w token grid of a model whose base (first trained) grid is base_h×base_w.

    Unpacks like the ``(h, w)`` tuple the blocks have always received; hashable, so
    tables computed for it are cached per grid."""

    h: int
    w: int
    base_h: int
    base_w: int
    positions: str = "extrapolate"

    def __post_init__(self):
        check_positions(self.positions)
        if min(self.h, self.w, self.base_h, self.base_w) < 1:
            raise ValueError(f"grid sides must be >= 1, got {self.h}x{self.w} (base {self.base_h}x{self.base_w})")

    def __iter__(self):
        return iter((self.h, self.w))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i):
        return (self.h, self.w)[i]

    @property
    def tokens(self) -> int:
        return self.h * self.w

    @property
    def is_base(self) -> bool:
        return (self.h, self.w) == (self.base_h, self.base_w)

    def position_scale(self) -> tuple[float, float] | None:
        """Multipliers (row, column) turning indices into positions; None: no positions."""
        if self.positions == "none":
            return None
        if self.positions == "interpolate":
            return self.base_h / self.h, self.base_w / self.w
        return 1.0, 1.0

    def table(self, dim: int):
        """DiT's fixed sin-cos table for this grid under its policy: (1, h·w, dim) fp32,
        zeros for ``none``."""
        import torch

        scale = self.position_scale()
        if scale is None:
            return torch.zeros(1, self.tokens, dim)
        return sincos_pos_embed_2d(dim, self.h, self.w, scale).unsqueeze(0)

    def time_shift(self, value) -> float:
        """A ``time_shift`` setting resolved for this grid: a number as it is, ``"auto"``
        as √(tokens / base tokens)."""
        return resolve_time_shift(value, self.tokens, self.base_h * self.base_w)


def resolve_time_shift(value, tokens: int, base_tokens: int) -> float:
    if value is None:
        return 1.0
    if isinstance(value, str) and value.strip() == TIME_SHIFT_AUTO:
        return math.sqrt(tokens / base_tokens)
    return parse_time_shift(value)


def model_grid(config, latent_hw: tuple[int, int] | None = None) -> TokenGrid:
    """The token grid of a model (its diffusers config) for a latent (h, w); default the
    trained size. Older configs without ``base_size`` / ``positions`` mean base = trained
    size and DiT's integer positions (a stored config is read through ``dit.config_keys``)."""
    p = config["patch_size"]
    base = config.get("base_size") or config["input_size"]
    h, w = latent_hw if latent_hw is not None else (config["input_size"],) * 2
    if h % p or w % p:
        raise ValueError(f"latent size {h}x{w} must be divisible by patch_size={p}")
    return TokenGrid(h // p, w // p, base // p, base // p, config.get("positions") or "extrapolate")


# ------------------------------------------------------------------ the position table
def sincos_pos_embed_1d(dim: int, pos):
    """(M,) positions → (M, dim): [sin(pos·ω), cos(pos·ω)], ω_i = 10000^(−2i/dim)."""
    import torch

    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    out = pos.double().reshape(-1, 1) * omega
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def sincos_pos_embed_2d(dim: int, h: int, w: int, scale: tuple[float, float] = (1.0, 1.0)):
    """DiT's 2-D table for an h×w grid, (h·w, dim) in row-major order, fp32.

    As in the original (MAE) code, the first half of the channels encodes the column
    position and the second half the row position; position = index × ``scale`` (row,
    column): 1 is DiT's integer grid, base / side PixArt's interpolation (``TokenGrid``).
    """
    import torch

    rows, cols = torch.meshgrid(torch.arange(h, dtype=torch.float64) * scale[0],
                                torch.arange(w, dtype=torch.float64) * scale[1], indexing="ij")
    emb = torch.cat([sincos_pos_embed_1d(dim // 2, cols), sincos_pos_embed_1d(dim // 2, rows)], dim=1)
    return emb.float()


class GridPositions:
    """The positions of a model (``DiT``'s, which holds the frozen parameter ``pos_embed``,
    (1, tokens, C), the official DiT key, its ``config`` and a ``_pos_cache`` dict): the
    stored table at the trained grid, every other grid's computed once under the policy."""

    def grid(self, h: int, w: int) -> TokenGrid:
        """The token grid of an (h, w) latent under this model's ``positions`` policy."""
        return model_grid(self.config, (h, w))

    def reset_pos_embed(self) -> None:
        """Fill ``pos_embed`` for the trained grid (under the policy: ``interpolate`` keeps a base range)."""
        import torch

        side = self.config.input_size
        with torch.no_grad():
            self.pos_embed.copy_(self.grid(side, side).table(self.pos_embed.shape[-1]))
        self._pos_cache.clear()

    def rebase(self, base_size: int) -> None:
        """Set the base grid (latent side) positions are relative to: a model fine-tuned up the
        ladder keeps its source's (``interpolate`` maps every size onto its range; ``convert.init_from``)."""
        if base_size < 1 or base_size % self.config.patch_size:
            raise ValueError(f"base_size={base_size} must be a positive multiple of "
                             f"patch_size={self.config.patch_size}")
        self.register_to_config(base_size=int(base_size))
        self.reset_pos_embed()

    def position_embedding(self, grid: TokenGrid):
        """The table for the token grid, (1, h·w, C): the stored ``pos_embed`` at the trained
        size, else computed once per grid, on the table's device and dtype (so a checkpoint
        runs at any size)."""
        side = self.config.input_size // self.config.patch_size
        if (grid.h, grid.w) == (side, side):
            return self.pos_embed
        table = self._pos_cache.get(grid)
        if table is None or table.device != self.pos_embed.device or table.dtype != self.pos_embed.dtype:
            table = self._pos_cache[grid] = grid.table(self.pos_embed.shape[-1]).to(self.pos_embed)
        return table

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The position table is a function of the grid, not a learned weight: a state dict
        # saved at another size (a 256-px checkpoint loaded into a 512-px model) keeps this
        # model's own table instead of failing on its shape. Same shape: loaded as saved.
        key = prefix + "pos_embed"
        if key in state_dict and state_dict[key].shape != self.pos_embed.shape:
            state_dict[key] = self.pos_embed.detach().clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def vae_factor(vae) -> int:
    """Pixels per latent side of any diffusers tokenizer (``tokenizer.spatial_factor``: 8 for the SD
    VAE, 32 for DC-AE f32c32), 1 without a VAE."""
    from .tokenizer import spatial_factor

    return spatial_factor(vae)


def latent_for(model, vae, image_size) -> tuple[int, int] | None:
    """The latent (h, w) a model samples for an image size in pixels (None: the trained size)."""
    if image_size is None:
        return None
    if vae is not None:   # an RAE decodes its one size only
        from .tokenizer import check_fixed_size

        check_fixed_size(vae, parse_image_size(image_size))
    return latent_size(image_size, vae_factor(vae), model.config.patch_size)


# ------------------------------------------------------------ sampling at a size
STRENGTH = 0.6  # the re-noise strength of progressive upscaling when none is given


def sized_settings(settings, source, image_size=None, upscale_from=None, time_shift=None, strength=None, *,
                   batch: int = 1, what: str | None = None, fix: str = "use a smaller image size or batch"):
    """``settings`` for sampling ``source`` (its ``model`` and ``vae``) at ``image_size`` pixels
    (None: the trained size), with ``time_shift`` (a number or ``"auto"``) and progressive
    upscaling from ``upscale_from`` pixels re-noised to ``strength`` (default ``STRENGTH``).

    Before any allocation, a first batch of ``batch`` images that cannot fit the device's
    memory is refused (``guards.check_sample_memory``: ``what`` names the size, ``fix`` says
    what to change)."""
    model = source.model
    latent = latent_for(model, source.vae, image_size)
    small = latent_for(model, source.vae, upscale_from)
    shift = parse_time_shift(time_shift) if time_shift is not None else None
    if latent is not None:  # before the first allocation, not as its traceback
        from ..guards import check_sample_memory

        check_sample_memory(model, latent, max(1, batch), vae_factor(source.vae), next(model.parameters()).device,
                            what or f"image size {image_size}", fix, guided=settings.cfg_scale != 1)
    strength = STRENGTH if strength is None else strength
    return replace(settings, latent_size=latent, time_shift=shift, upscale_from=small, strength=strength)
