"""NaLa as one op: every path that computes it, and the file that holds each.

The math: ``docs/NALA_SPEC.md`` (§2 the feature maps, §3 the linear form, §4 the gated layer)
and this folder's ``README.md``; the N×N references and the readable composition
``nala_features`` → §3: ``../functional.py``.

One call, ``nala_attention(q, k, v, config, impl=...)`` (``backend.py``), runs one of:

* ``eager`` -- the readable composition under plain autograd (``backend._nala_eager``; the
  reference, any device);
* ``fused`` -- the CPU path (``fused.py``): token-chunked feature lifts with a hand-written
  backward (``_FusedNaLa``) that saves q, k, v, the small state ``[S | z]`` and the
  denominator only; ``chunks.py`` sizes its token chunks;
* ``triton`` -- the GPU path (``triton/``): ``features.py`` the ``@triton.jit`` feature maps
  and their gradients, ``blocks.py`` the loads, stores and products every kernel shares,
  ``forward.py`` the state and output kernels, ``backward.py`` the dq and dkv kernels,
  ``launch.py`` the launch configs, grids, launches and the autograd function
  (``TritonNaLa``), checked on first use against ``eager`` (``backend.triton_passes_check``);
  ``triton/README.md`` says how the kernels work;

``backend.py`` also picks which (``backend``: ``select_nala_impl``'s ``fused`` on CPU,
``triton`` on CUDA where Triton takes the shape and the kernels passed their first-use
check, else ``eager``); ``nala_attention(impl="auto")`` chooses per call, the gated layer
once per device, dtype and length class (``GatedLinearAttention.backend``), passing
``impl=`` on. Around that choice:

* the gated layer's fused middle (qkvg → LePE, LayerNorm, gate → projection as one
  autograd function): on CPU ``../recompute.py``'s ``GatedMiddle`` over ``fused.py``'s
  passes, on Triton ``triton/gated.py``'s ``TritonGatedMiddle`` (NaLa's kernels and one
  epilogue kernel); the layer itself is ``../layers.py``'s ``GatedLinearAttention``;
* region states (``--nala-regions``): ``../regions.py``, over ``fused.py``'s passes;
* context parallel (one image's tokens over several ranks): ``../context_parallel.py``; the
  fused passes all-reduce their state (``shard=``), every other path runs the eager
  composition with the all-reduced state;
* forward-mode derivatives (``torch.func.jvp``, forward AD): ``tangent.py``, the tangent in
  two linear passes, used by ``fused._FusedNaLaJvp`` and ``tangent.TritonNaLaJvp``;
* ``torch.compile``: on the CPU dynamo traces ``fused._FusedNaLa`` whole (a compiled step ran
  about 15 % faster than with the passes as one opaque op); on CUDA ``nala_attention`` runs
  the ``torch.library`` custom op ``nala_dit::nala_triton`` (``triton_op.py``) while dynamo
  traces; either way a block traces with no graph break.

Nothing here imports Triton until a Triton path runs.
"""

from .backend import NALA_IMPLS, nala_attention, select_nala_impl, triton_available
from .fused import fused_opts

__all__ = ["NALA_IMPLS", "fused_opts", "nala_attention", "select_nala_impl", "triton_available"]
