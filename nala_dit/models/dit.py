"""The DiT / SiT backbone with a swappable self-attention.

Follows Peebles & Xie, "Scalable Diffusion Models with Transformers" (DiT, 2023) and
its official code parameter for parameter: patchify, a fixed 2-D sin-cos position table,
timestep and label embedders (the label table has a "null" row at index
``num_classes`` for classifier-free guidance), adaLN-Zero blocks and the final layer.
SiT (Ma et al., 2024) is the same network with ``learn_sigma=False``.

The only change for NaLaDiT / NaLaSiT is the attention layer of each block, chosen by
one argument (``attention="nala"``; see ``nala_dit/attention/layers.py``). A softmax model has
the official checkpoint key names, so published DiT weights load with ``strict=True``.

One axis order throughout: tokens are ``(B, N, C)`` with ``N = h·w`` in row-major grid
order; images/latents are ``(B, C, H, W)``.
"""

from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin

from ..attention import NaLaConfig, build_attention
from ..attention.config import MODEL_OPTIONS
from ..attention.context_parallel import WHOLE_GRID, shard_of
from ..guards import assert_no_meta, refuse_non_finite
from .files import RENAMED_KEYS, check_transformer_folder, config_keys  # noqa: F401  (read here)
from .grid import GridPositions, check_positions
from .presets import FAMILIES, PATCHES, SIZES, check_attention_options, check_mix_init, parse_softmax_blocks, preset

OBJECTIVES = ("diffusion", "transport")


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: ``x·(1 + scale) + shift`` with per-sample (B, C) shift/scale over tokens."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class PatchEmbed(nn.Module):
    """Non-overlapping p×p patches → tokens (a conv with kernel = stride = p)."""

    def __init__(self, patch_size: int, in_channels: int, hidden_size: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)              # (B, N, C)


class TimestepEmbedder(nn.Module):
    """Sinusoidal frequency embedding of t (256-d) → Linear → SiLU → Linear.

    The frequencies divide by ``half`` as the original DiT does (diffusers' embedding
    divides by ``half - 1``). Works for integer DiT timesteps and continuous SiT times.
    """

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
        half = dim // 2
        freqs = torch.exp(
            -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
        )
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        emb = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))             # (B, C)


class LabelEmbedder(nn.Module):
    """Class labels → vectors, with label dropout for classifier-free guidance.

    With ``dropout_prob > 0`` the table has one extra row, the null class, at index
    ``num_classes`` (1000 for ImageNet, but derived, never hard-coded).
    """

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def token_drop(self, labels: torch.Tensor, force_drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        if force_drop_ids is None:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop = force_drop_ids == 1
        return torch.where(drop, self.num_classes, labels)

    def forward(self, labels: torch.Tensor, train: bool, force_drop_ids: torch.Tensor | None = None):
        if (train and self.dropout_prob > 0) or force_drop_ids is not None:
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)                           # (B, C)


class Mlp(nn.Module):
    """Two-layer MLP with tanh-GELU (timm's ``Mlp`` names: ``fc1``, ``fc2``)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MixMlp(Mlp):
    """Mix-FFN (SegFormer, Sana): DiT's MLP with a 3×3 depthwise conv on the token grid
    between its two linears, ``fc2(GELU(DWConv3×3(fc1(x))))``. The conv (``dwconv``: one
    3×3 kernel and a bias per hidden channel, 10·hidden parameters) gives every token its
    neighbours' hidden features, a local term that a single global attention state lacks.
    ``fc1`` / ``fc2`` keep timm's names, so a plain MLP's weights load into it; a model
    inherited from one starts with the conv at identity (``convert.inherit``).

    ``init`` (``--mix-init``): ``"default"`` is PyTorch's random conv init; ``"identity"``
    is the centre tap 1, the other taps 0, bias 0, so a fresh Mix-FFN computes DiT's MLP
    exactly. The identity conv is built without drawing random numbers, so a model seeded
    alike gets the same ``fc1`` / ``fc2`` (and every other weight) as the plain-MLP model:
    the two start as the same function."""

    def __init__(self, dim: int, hidden: int, init: str = "default"):
        super().__init__(dim, hidden)
        check_mix_init("mix", init)
        self.init = init
        if init == "identity":
            self.dwconv = nn.utils.skip_init(nn.Conv2d, hidden, hidden, 3, padding=1, groups=hidden,
                                              device=torch.get_default_device())
            self.reset_identity()
        else:
            self.dwconv = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)

    @torch.no_grad()
    def reset_identity(self) -> None:
        """The conv as the identity: centre tap 1, every other tap 0, bias 0."""
        self.dwconv.weight.zero_()
        self.dwconv.weight[:, :, 1, 1] = 1
        self.dwconv.bias.zero_()

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        if grid is None or grid[0] * grid[1] != n:
            raise ValueError(f"Mix-FFN needs the token grid (h, w) with h*w == N={n}, got grid={grid}")
        x = self.fc1(x)                                                  # (B, N, hidden)
        image = x.transpose(1, 2).reshape(b, -1, *grid)                  # (B, hidden, h, w)
        shard = shard_of(grid)
        if shard is not None:   # context parallel: the neighbours' rows, zero padding along w only
            pad = self.dwconv.kernel_size[0] // 2
            image = F.conv2d(shard.halo_rows(image, pad), self.dwconv.weight, self.dwconv.bias, padding=(0, pad),
                             groups=self.dwconv.groups)
        else:
            image = self.dwconv(image)
        x = image.flatten(2).transpose(1, 2)                             # (B, N, hidden)
        return self.fc2(self.act(x))


MLPS = {"mlp": Mlp, "mix": MixMlp}


class DiTBlock(nn.Module):
    """adaLN-Zero transformer block; ``attn`` is softmax, NaLa or a linear baseline
    (``attention``, with the gated layer's settings ``nala``)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, attention: str,
                 nala: NaLaConfig | None = None, mlp: str = "mlp", mix_init: str = "default"):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = build_attention(attention, hidden_size, num_heads, nala)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = MLPS[mlp](hidden_size, int(hidden_size * mlp_ratio), **({"init": mix_init} if mlp == "mix" else {}))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self.adaLN_modulation(c).chunk(6, dim=1)                    # each (B, C)
        )
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), grid)
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp), grid)
        return x                                                         # (B, N, C)


class FinalLayer(nn.Module):
    """adaLN shift/scale, then a linear map from tokens to p·p·C_out pixels."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))  # (B, N, p·p·C_out)


def _attention_keywords(init):
    """``DiT.__init__`` takes NaLaConfig's model options (``MODEL_OPTIONS``: ``lepe``,
    ``power``, …, ``nala_regions``) as keyword arguments: its signature lists them from there,
    so diffusers records them as config keys and ``from_config`` passes them back, and
    ``models/files.py`` checks their types, without restating them here."""
    sig = inspect.signature(init)
    options = [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for key, f in MODEL_OPTIONS.items()]
    init.__signature__ = sig.replace(parameters=[*list(sig.parameters.values())[:-1], *options])
    return init


def check_model_keys(input_size: int, patch_size: int, hidden_size: int, num_heads: int, num_classes: int,
                     objective: str, attention: str, positions: str, base_size: int | None, softmax_blocks, mlp: str,
                     mix_init: str) -> None:
    """The checks of ``DiT``'s own keys (the attention's are ``NaLaConfig``'s), one-line errors."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if patch_size < 1 or input_size % patch_size:
        raise ValueError(f"input_size={input_size} must be divisible by patch_size={patch_size} "
                         f"(latent size = image size / 8 for the SD VAE: 256 px → 32)")
    check_positions(positions)
    if base_size is not None and (base_size < 1 or base_size % patch_size):
        raise ValueError(f"base_size={base_size} must be a positive multiple of patch_size={patch_size}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1 (1 = unconditional), got {num_classes}")
    if mlp not in MLPS:
        raise ValueError(f"mlp must be one of {tuple(MLPS)} ('mlp' = DiT's, 'mix' = Mix-FFN), got {mlp!r}")
    check_mix_init(mlp, mix_init)
    if hidden_size % num_heads:
        raise ValueError(f"num_heads={num_heads} must divide hidden_size={hidden_size}")
    if softmax_blocks is not None and attention == "softmax":
        raise ValueError(f"softmax_blocks={softmax_blocks!r} needs a linear-attention model; attention='softmax' "
                         f"is softmax in every block already")


class DiT(GridPositions, ModelMixin, ConfigMixin):
    """Diffusion transformer (DiT/SiT), softmax or linear attention.

    ``forward(x, t, y)``: x ``(B, C_in, H, W)``, t ``(B,)`` integer DiT timesteps or
    continuous SiT times, y ``(B,)`` labels in ``[0, num_classes]`` (``num_classes`` is the
    null label). Returns ``(B, C_out, H, W)``, ``C_out = 2·C_in`` when ``learn_sigma`` (DiT).
    ``attention``: every block's layer, with NaLaConfig's settings (keywords ``lepe``, ``power``,
    …, ``nala_regions``); ``positions``: the policy at other grids (``grid.py``);
    ``softmax_blocks``: the hybrid schedule (DiT's softmax layer in those blocks).
    """

    _supports_gradient_checkpointing = True
    # The hook ``context_parallel.enable`` sets: which rows of the token grid this process runs.
    context_parallel = WHOLE_GRID

    @register_to_config
    @_attention_keywords
    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4, hidden_size: int = 1152,
                 depth: int = 28, num_heads: int = 16, mlp_ratio: float = 4.0, class_dropout_prob: float = 0.1,
                 num_classes: int = 1000, learn_sigma: bool = True, objective: str = "diffusion",
                 attention: str = "softmax", positions: str = "extrapolate", base_size: int | None = None,
                 softmax_blocks: list[int] | str | None = None, mlp: str = "mlp", mix_init: str = "default",
                 mean_flow: bool = False, **attention_options):
        super().__init__()
        if mean_flow and objective != "transport":
            raise ValueError(f"mean_flow needs a transport model (SiT / NaLaSiT: objective 'transport'), got "
                             f"objective {objective!r}")
        nala = NaLaConfig.from_model(attention, **attention_options)   # the attention's settings, checked
        check_model_keys(input_size, patch_size, hidden_size, num_heads, num_classes, objective, attention,
                         positions, base_size, softmax_blocks, mlp, mix_init)
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.gradient_checkpointing = False
        self._pos_cache: dict = {}   # TokenGrid -> its table, for grids other than the trained one (grid.py)

        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # MeanFlow (diffusion/meanflow.py): the interval r − t to the end time r, embedded as t is
        # and added to the condition; its output layer starts at zero (initialize_weights), so
        # a SiT's weights loaded into it give the SiT's outputs at every r.
        self.r_embedder = TimestepEmbedder(hidden_size) if mean_flow else None
        # Fixed sin-cos table of the trained grid (grid.py); a frozen Parameter as in DiT, so
        # the official key ``pos_embed`` loads and the parameter counts match the paper's.
        side = input_size // patch_size
        self.pos_embed = nn.Parameter(torch.zeros(1, side * side, hidden_size), requires_grad=False)
        # Recorded resolved ("every:4" -> [3]) so a checkpoint's config rebuilds the same stack.
        softmax_blocks = parse_softmax_blocks(softmax_blocks, depth)
        self.register_to_config(softmax_blocks=softmax_blocks)
        self.blocks = nn.ModuleList(
            DiTBlock(hidden_size, num_heads, mlp_ratio, "softmax" if i in (softmax_blocks or ()) else attention,
                     nala, mlp, mix_init) for i in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    @classmethod
    def extract_init_dict(cls, config_dict, **kwargs):   # diffusers' from_config / from_pretrained
        return super().extract_init_dict(config_keys(config_dict), **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' loader, with a local folder checked first (``files.check_transformer_folder``:
        config typed and sized like its safetensors, so an edited ``hidden_size`` is refused, not
        allocated) and missing or non-finite weights refused after; on every route, diffusers'
        ``DiffusionPipeline.from_pretrained`` included (it calls this for the transformer)."""
        folder = Path(pretrained_model_name_or_path) / (kwargs.get("subfolder") or "")
        if folder.is_dir():
            check_transformer_folder(folder, cls)
        model = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        assert_no_meta(model, str(folder))
        refuse_non_finite(model, str(folder))
        return model

    @property
    def null_label(self) -> int | None:
        """The label that means "no class" (guidance), or None if the model has none."""
        return self.config.num_classes if self.config.class_dropout_prob > 0 else None

    def initialize_weights(self) -> None:
        """DiT's init: xavier linears, N(0, 0.02) embeddings, zero adaLN and output."""
        def _basic_init(module):
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)
        self.apply(_basic_init)

        self.reset_pos_embed()

        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.constant_(self.x_embedder.proj.bias, 0)

        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        if self.r_embedder is not None:
            nn.init.normal_(self.r_embedder.mlp[0].weight, std=0.02)
            nn.init.zeros_(self.r_embedder.mlp[2].weight)
            nn.init.zeros_(self.r_embedder.mlp[2].bias)

        # A learned NaLa norm scale starts from the (just re-initialised) query weights;
        # an identity-initialised Mix-FFN conv is the identity again.
        for block in self.blocks:
            if getattr(block.mlp, "init", None) == "identity":
                block.mlp.reset_identity()
            if hasattr(block.attn, "reset_norm_scale"):
                block.attn.reset_norm_scale()

        # adaLN-Zero: every block starts as the identity and the output as exactly 0.
        for block in self.blocks:
            nn.init.constant_(block.adaLN_modulation[-1].weight, 0)
            nn.init.constant_(block.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].weight, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.linear.weight, 0)
        nn.init.constant_(self.final_layer.linear.bias, 0)

    def unpatchify(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, h·w, p·p·C) → (B, C, h·p, w·p)."""
        p, c = self.patch_size, self.out_channels
        x = x.reshape(x.shape[0], h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                force_drop_ids: torch.Tensor | None = None, r: torch.Tensor | None = None) -> torch.Tensor:
        """``force_drop_ids`` (B,) 1 = null label: fixes the label dropout (a distillation
        teacher must see the labels its student saw) instead of drawing it. ``r`` (B,): a
        MeanFlow model's end time (its output is the average velocity from t to r; None: r = t,
        the instantaneous velocity)."""
        check_inputs(self, x, t, y)
        if r is not None and self.r_embedder is None:
            raise ValueError("r (an end time) is for MeanFlow models (mean_flow=True); this model predicts the "
                             "velocity at t only")
        grid = self.grid(x.shape[2], x.shape[3])
        # this process's rows of the grid (context parallel: a ShardGrid; else the whole grid)
        x, pos, rows = self.context_parallel.shard(x, self.position_embedding(grid), grid, self.patch_size)
        x = self.x_embedder(x) + pos                                   # (B, N, C)
        c = self.t_embedder(t) + self.y_embedder(y, self.training, force_drop_ids)  # (B, C)
        if self.r_embedder is not None:
            c = c + self.r_embedder(torch.zeros_like(t) if r is None else r - t)
        for block in self.blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, c, rows, use_reentrant=False)
            else:
                x = block(x, c, rows)                                  # (B, N, C)
        x = self.context_parallel.gather(self.final_layer(x, c), rows)  # (B, N, p·p·C_out), every row
        return self.unpatchify(x, *grid)                               # (B, C_out, H, W)

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, cfg_scale: float,
                         guide_channels: int | None = None) -> torch.Tensor:
        """DiT's batched classifier-free guidance: the first half of the batch is conditional,
        the second carries the null label; both get ``uncond + s·(cond − uncond)`` on the first
        ``guide_channels`` (default all ``in_channels``; DiT's code: 3), never on learned variances."""
        guide_channels = self.in_channels if guide_channels is None else guide_channels
        half = x[: len(x) // 2]
        out = self.forward(torch.cat([half, half]), t, y)
        eps, rest = out[:, :guide_channels], out[:, guide_channels:]
        cond, uncond = eps.chunk(2)
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat([torch.cat([guided, guided]), rest], dim=1)


def check_inputs(model: DiT, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> None:
    """``DiT.forward``'s inputs: one-line errors naming the shapes it takes."""
    if x.ndim != 4 or x.shape[1] != model.in_channels:
        raise ValueError(f"x must be (B, {model.in_channels}, H, W) for this model, got shape {tuple(x.shape)}")
    p = model.patch_size
    if x.shape[2] % p or x.shape[3] % p:
        raise ValueError(f"x spatial size {tuple(x.shape[2:])} must be divisible by patch_size={p}")
    if t.shape != (x.shape[0],) or y.shape != (x.shape[0],):
        raise ValueError(f"t and y must be (B,) = ({x.shape[0]},), got t {tuple(t.shape)} and y {tuple(y.shape)}")


# ---------------------------------------------------------------------------- presets
# The preset tables (SIZES, PATCHES, FAMILIES) are plain data in presets.py, where the
# CLIs read the names without importing torch.
#
# The two sizes past XL take their depth, width and heads from published models, and are this
# file's DiT block at that size (class-conditional adaLN-Zero, one adaLN per block, MLP ratio 4,
# 2-D sin-cos positions), not the source's architecture, so their counts are this block's:
#   G (40 blocks, width 1408, 16 heads of 88): the size of Hunyuan-DiT's 1.5B DiT-g/2 (Li et al.,
#     arXiv 2405.08748; text-conditioned, MLP ratio 4.3637) and of DiT-MoE's DiT-G/2 (Fei et al.,
#     arXiv 2407.11633, github.com/feizc/DiT-MoE models.py: DiT's class-conditional block with each
#     MLP a mixture of experts); both are ViT-g/14's (Zhai et al., arXiv 2106.04560). One dense MLP
#     here: 1,436,371,232 at G/2.
#   H (30 blocks, width 2240, 20 heads of 112): Sana's width and heads (Sana-1.6B: 20 blocks; Xie et
#     al., arXiv 2410.10629) at the 30-block depth of SANA-1.5's 2.4B model (arXiv 2501.18427;
#     SanaMS_2400M_P1_D30 in github.com/NVlabs/Sana). Sana is text-conditioned, with cross-attention,
#     a GLU Mix-FFN of ratio 2.5 and one shared adaLN; DiT's block here has none of those and MLP
#     ratio 4 with a 6·C² adaLN per block, hence 2,729,072,672 at H/2 against Sana's "2.4B".
# Both head dims are within the Triton NaLa kernels' limit (TRITON_MAX_HEAD_DIM = 128; the
# kernels pad 88 and 112 to 128 lanes).


def _constructor(family: str, size: str, patch: int):
    objective, learn_sigma, attention = FAMILIES[family]
    defaults = dict(SIZES[size], patch_size=patch, objective=objective,
                    learn_sigma=learn_sigma, attention=attention)

    def build(**overrides) -> DiT:
        return DiT(**{**defaults, **overrides})

    build.__name__ = f"{family}_{size}_{patch}"
    build.__doc__ = f"{family}-{size}/{patch}: {defaults}; keyword overrides win."
    return build


MODELS = {
    f"{family}-{size}/{patch}": _constructor(family, size, patch)
    for family in FAMILIES for size in SIZES for patch in PATCHES[size]
}


def create_model(name: str, **overrides) -> DiT:
    """Build the preset ``name`` (a key of ``MODELS``) with keyword overrides.

    An override the model's attention ignores (``lepe`` on a softmax model) is an error.
    Keywords of older versions (``RENAMED_KEYS``: ``pos_embed`` is now ``positions``) still
    work, with a ``FutureWarning`` naming the new one.
    """
    for old, new in RENAMED_KEYS.items():
        if old in overrides:
            if new in overrides:
                raise TypeError(f"create_model got both {old}= and {new}=; {old} is the old name of {new}: pass "
                                f"{new} only")
            warnings.warn(f"create_model({old}=...) is deprecated: the keyword is now {new}= ({old} is the name of "
                          f"the position table parameter)", FutureWarning, stacklevel=2)
            overrides[new] = overrides.pop(old)
    attention = overrides.get("attention", preset(name)[2])
    check_attention_options(name, attention, overrides)
    return MODELS[name](**overrides)


def count_params(model: nn.Module) -> int:
    """All parameters, the frozen position table included (as the DiT paper counts)."""
    return sum(p.numel() for p in model.parameters())


def count_flops(model: DiT, image_size: int | None = None, batch_size: int = 1) -> int:
    """Forward FLOPs of one sample (2 per multiply-accumulate, torch's flop counter).

    The DiT paper's "Gflops" are multiply-accumulates: divide by 2 to compare.
    ``image_size`` is the model's input (latent) side, default the configured one.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    size = image_size or model.config.input_size
    x = torch.zeros(batch_size, model.in_channels, size, size, device=model.device, dtype=model.dtype)
    t = torch.zeros(batch_size, device=model.device, dtype=model.dtype)
    y = torch.zeros(batch_size, dtype=torch.long, device=model.device)
    counter = FlopCounterMode(display=False)
    # The math backend decomposes SDPA into matmuls the counter sees on every device
    # (the fused CPU kernel is not registered with it).
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        model(x, t, y)
    return counter.get_total_flops() // batch_size
