"""Attention for diffusion transformers: NaLa (``docs/NALA_SPEC.md``), its baselines, the layers.

One concern per file, top (what a model builds) to bottom (the math):

* ``layers.py``: the ``nn.Module`` layers -- ``SoftmaxAttention`` (DiT's own, official
  parameter names ``qkv``/``proj``), ``GatedLinearAttention`` (the gated NaLa layer of §4;
  also hosts the ReLU / 1+ELU / softmax baselines) and ``build_attention``;
* ``recompute.py``: ``GatedMiddle``, the gated layer between its projections as one autograd
  function that keeps only the qkvg projection for backward, and ``gated_tail`` (§4 steps 3–4);
* ``nala.py``: ``nala_attention``, NaLa in linear time (the fused CPU autograd path, the
  eager / compiled composition, what ``impl="auto"`` runs, the Triton first-use check);
* ``regions.py``: region states (``--nala-regions``): one NaLa state per region of the token
  grid, mixed per query region by learned weights, and their explicit N×N reference;
* ``triton_kernels.py``: NaLa as Triton GPU kernels (imported only when they run);
* ``functional.py``: the math as pure functions over ``(B, H, N, D)`` tensors (feature maps,
  the §3 normalisation, the baselines, SDPA softmax, the §7 rotary embedding) and the
  explicit N×N references the tests compare against.

Every public name is re-exported here: ``from nala_dit.attention import nala_attention``.
"""

from ..cli.options import (  # the names live with the CLI options (torch-free)
    ATTENTIONS, DIRECTIONS, LINEAR_KERNELS, TRITON_MAX_HEAD_DIM, TRITON_MAX_TOKENS, parse_norm_scale,
)
from .functional import (
    ALPHA, EPS, NORM_EPS, NORM_SCALE, OFFSET, POWER, ROPE_BASE, SATURATION, Direction,
    apply_rope, kernel_features, linear_attention, linear_attention_reference,
    nala_attention_reference, nala_exponent, nala_features, nala_query_weights,
    nala_similarity_reference, normalized_attention_reference, normalized_linear_attention,
    rope_angles, rope_attention_reference, rope_linear_attention, saturated_share,
    softmax_attention, softmax_attention_reference,
)
from .layers import GatedLinearAttention, SoftmaxAttention, build_attention
from .nala import NALA_IMPLS, fused_opts, nala_attention, select_nala_impl, triton_available
from .recompute import GatedMiddle, gated_tail

__all__ = [
    "ALPHA", "ATTENTIONS", "DIRECTIONS", "Direction", "EPS", "GatedLinearAttention", "GatedMiddle",
    "LINEAR_KERNELS", "NALA_IMPLS", "NORM_EPS", "NORM_SCALE", "OFFSET", "POWER", "ROPE_BASE", "SATURATION",
    "SoftmaxAttention", "TRITON_MAX_HEAD_DIM", "TRITON_MAX_TOKENS", "apply_rope", "build_attention",
    "fused_opts", "gated_tail", "kernel_features", "linear_attention", "linear_attention_reference",
    "nala_attention", "nala_attention_reference", "nala_exponent", "nala_features", "nala_query_weights",
    "nala_similarity_reference", "normalized_attention_reference", "normalized_linear_attention",
    "parse_norm_scale", "rope_angles", "rope_attention_reference", "rope_linear_attention", "saturated_share",
    "select_nala_impl", "softmax_attention", "softmax_attention_reference", "triton_available",
]
