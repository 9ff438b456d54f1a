"""nala_dit: DiT / SiT diffusion transformers with gated norm-aware linear attention.

Where things are: ``attention.py`` (NaLa and baselines), ``models.py`` (backbone and
presets), ``diffusion.py`` / ``transport.py`` (objectives), ``samplers.py`` (every
sampler as a plain function), ``pipeline.py`` (diffusers pipelines).
"""

from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (diffusers resolves our components through this module)

from .attention import nala_attention, nala_attention_reference, nala_features
from .models import MODELS, DiT, create_model

__all__ = ["MODELS", "DiT", "create_model", "nala_attention", "nala_attention_reference", "nala_features"]
__version__ = "0.1.0"


def __getattr__(name):
    # The pipelines pull in diffusers' pipeline stack; import them only when asked for.
    if name in ("NaLaDiTPipeline", "NaLaSiTPipeline", "DiTPipelineTransformer"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'nala_dit' has no attribute {name!r}")
