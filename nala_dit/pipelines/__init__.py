"""Using a model: ``NaLaDiTPipeline`` / ``NaLaSiTPipeline`` and the diffusers ``DiTPipeline``
adapter (``pipeline.py``), found by diffusers' ``DiffusionPipeline.from_pretrained`` after
``register_with_diffusers()`` (``register.py``); loading any model source, class names included (``sources.py``);
writing pipeline folders (``export.py``); grids, PNGs and resumable ``.npz`` sampling
(``sample_files.py``)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "NaLaDiTPipeline": "pipeline", "NaLaSiTPipeline": "pipeline", "DiTPipelineTransformer": "pipeline",
    "load_pipeline": "pipeline", "load_source": "sources", "mass_sample": "sample_files",
    "register_with_diffusers": "register",
})
