"""Objectives and sampling: Gaussian diffusion as in DiT (``gaussian.py``), SiT's transport
(``transport.py``), every sampler as a plain function (``samplers.py``) named in the
samplers' registry (``registry.py``: one line a sampler), classifier-free
guidance (``guidance.py``), and ``generate`` / ``sample_batch`` (``generate.py``), which the
training grids, ``sample.py``, ``evaluate_fid.py gen`` and the pipelines all call."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "GaussianDiffusion": "gaussian", "Transport": "transport",
    "ddpm_sample": "samplers", "ddim_sample": "samplers", "ode_sample": "samplers", "sde_sample": "samplers",
    "likelihood": "samplers", "cfg_model_fn": "guidance",
    "sample_batch": "generate", "SampleSettings": "generate", "decode": "generate",
})
