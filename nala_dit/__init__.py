"""nala_dit: DiT / SiT diffusion transformers with gated norm-aware linear attention.

Where things are: ``attention/`` (NaLa and baselines), ``models.py`` (backbone and
presets), ``diffusion.py`` / ``transport.py`` (objectives), ``samplers.py`` (every
sampler as a plain function), ``pipeline.py`` (diffusers pipelines), ``options.py``
(every name the CLIs offer, as plain data).

Importing the package costs nothing: the names below are looked up on first use, so a
CLI's ``--help`` (which imports ``nala_dit.options``) never loads torch or diffusers.
"""

__version__ = "0.1.0"

# name -> submodule that defines it (imported on first access).
_LAZY = {
    "MODELS": "models", "DiT": "models", "create_model": "models",
    "nala_attention": "attention", "nala_attention_reference": "attention", "nala_features": "attention",
    "NaLaDiTPipeline": "pipeline", "NaLaSiTPipeline": "pipeline", "DiTPipelineTransformer": "pipeline",
}
__all__ = sorted(_LAZY)

# diffusers' generic DiffusionPipeline.from_pretrained finds our pipelines by name.
from .register import install as _install  # noqa: E402

_install()


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'nala_dit' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
