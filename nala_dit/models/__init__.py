"""The network: the DiT/SiT backbone and its presets (``dit.py``), the token grid and
positions (``grid.py``), one image over several processes (``context_parallel.py``), the
diffusers VAE (``vae.py``), transformer folders (``files.py``), query-norm diagnostics and
``torch.compile`` of a model (``compile.py``: ``--compile``, CUDA graphs)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "DiT": "dit", "DiTBlock": "dit", "MODELS": "dit", "create_model": "dit", "count_params": "dit",
    "count_flops": "dit", "TokenGrid": "grid", "compile_model": "compile",
})
