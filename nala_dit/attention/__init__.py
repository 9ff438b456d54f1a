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
* ``nala.py``: ``nala_attention``, NaLa in linear time (the fused CPU autograd path, the
  eager / compiled composition, what ``impl="auto"`` runs, the Triton first-use check);
* ``tangent.py``: NaLa's forward-mode derivative (``torch.func.jvp``, forward AD) in two
  linear passes, and the Triton path's autograd function that carries it;
* ``chunks.py``: the token ranges the CPU passes and the tangent walk;
* ``regions.py``: region states (``--nala-regions``): one NaLa state per region of the token
  grid, mixed per query region by learned weights, and their explicit N×N reference;
* ``context_parallel.py``: one image's tokens over a group of ranks (NaLa's state and the
  softmax keys all-reduced or gathered, LePE's halo rows);
* ``op.py``, ``triton_op.py``: NaLa's fused CPU path and its Triton path as ``torch.library``
  custom ops, so ``torch.compile(fullgraph=True)`` traces a block whole;
* ``triton_gated.py``: the gated layer between its projections on Triton (NaLa, then one
  epilogue kernel for LePE, LayerNorm and gate; 4 launches forward with the projections);
* ``triton_kernels.py``: NaLa as Triton GPU kernels (imported only when they run);
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
