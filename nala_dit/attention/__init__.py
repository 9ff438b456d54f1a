"""Attention for diffusion transformers: NaLa (``docs/NALA_SPEC.md``), its baselines, the layers.

One concern per file, top (what a model builds) to bottom (the math):

* ``config.py``: ``NaLaConfig``, every setting of the gated layer and its kernels in one
  frozen dataclass, checked once (torch-free: the CLIs build their flags from it);
* ``layers.py``: the ``nn.Module`` layers -- ``SoftmaxAttention`` (DiT's own, official
  parameter names ``qkv``/``proj``), the gated layer of §4 (``GatedAttention``: qkvg, LePE,
  LayerNorm, gate, projection) with its two kernels, ``GatedLinearAttention`` (NaLa and the
  ReLU / 1+ELU baselines) and ``SoftmaxGatedAttention`` (SDPA softmax), and ``build_attention``;
* ``recompute.py``: ``GatedMiddle``, the gated layer between its projections as one autograd
  function that keeps only the qkvg projection for backward, and ``gated_tail`` (§4 steps 3–4);
* ``nala/``: NaLa as one op -- ``nala_attention`` and every path that computes it (the eager
  composition, the fused CPU path, the Triton kernels, the forward-mode tangent, the
  ``torch.library`` custom ops), each named with its file in ``nala/__init__.py``;
* ``regions.py``: region states (``--nala-regions``): one NaLa state per region of the token
  grid, mixed per query region by learned weights, and their explicit N×N reference;
* ``context_parallel.py``: one image's tokens over a group of ranks (NaLa's state and the
  softmax keys all-reduced or gathered, LePE's halo rows);
* ``functional.py``: the math as pure functions over ``(B, H, N, D)`` tensors (feature maps,
  the §3 normalisation, the baselines, SDPA softmax, the §7 rotary embedding) and the
  explicit N×N references the tests compare against.

Every public name is exported here, imported on first use (``NaLaConfig`` costs no torch):
``from nala_dit.attention import nala_attention``.
"""

from .._lazy import lazy_exports

_CONFIG = ("ALPHA", "ATTENTIONS", "DIRECTIONS", "EPS", "KERNELS", "LINEAR_KERNELS", "NORM_EPS", "NORM_SCALE",
           "NaLaConfig", "OFFSET", "POWER", "ROPE_LAYOUTS", "parse_norm_scale")
_FUNCTIONAL = ("ROPE_BASE", "SATURATION", "Direction", "apply_rope", "kernel_features", "linear_attention",
               "linear_attention_reference", "nala_attention_reference", "nala_exponent", "nala_features",
               "nala_query_weights", "nala_similarity_reference", "normalized_attention_reference",
               "normalized_linear_attention", "rope_angles", "rope_attention_reference", "rope_linear_attention",
               "saturated_share", "softmax_attention", "softmax_attention_reference")
_LAYERS = ("GatedAttention", "GatedLinearAttention", "SoftmaxAttention", "SoftmaxGatedAttention", "build_attention",
           "first_use_checks")
_NALA = ("NALA_IMPLS", "fused_opts", "nala_attention", "select_nala_impl", "triton_available")

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    **dict.fromkeys(_CONFIG, "config"), **dict.fromkeys(_FUNCTIONAL, "functional"),
    **dict.fromkeys(_LAYERS, "layers"), **dict.fromkeys(_NALA, "nala"),
    "GatedMiddle": "recompute", "gated_tail": "recompute",
})
