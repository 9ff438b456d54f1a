"""nala_dit: DiT / SiT diffusion transformers with gated norm-aware linear attention (NaLa).

The package, top (what a user runs) to bottom (the math); imports only point down:

* ``cli/``: what the command lines share: every option they offer (gathered from the packages
  that own them), YAML configs, parsing; torch-free;
* ``training/``: the run's settings (``TrainConfig``), the loop and one step, EMA, logging,
  validation, REPA, conversion, writing checkpoints;
* ``pipelines/``: the diffusers pipelines, loading every model source, exported folders, sample files;
* ``checkpoints/``: reading a training checkpoint (model, objective, latent normalisation, shards);
* ``evaluation/``: FID / sFID / IS / precision-recall / KID and their feature extractors;
* ``data/``: datasets (image folders, latent caches, the embedded digits, tar shards, parquet), latent statistics, extraction;
* ``diffusion/``: Gaussian diffusion (DiT), transport (SiT), every sampler, guidance, ``generate``;
* ``models/``: the DiT/SiT network and its presets, the token grid, the VAE;
* ``attention/``: NaLa (``nala_attention``), its baselines and layers, region states, context parallel
  (one image over several processes), the Triton kernels;
* below them all, the modules every package uses: ``guards.py`` (checks on what a user or a
  file hands us), ``checks.py`` (torch-free: numbers in range, ``did you mean``), ``progress.py``
  (the one progress display), ``runlock.py`` (one writer per folder).

Importing the package costs nothing and changes nothing of other libraries: the names below
are imported on first use, so a CLI's ``--help`` never loads torch or diffusers, and diffusers
learns our pipeline names only from ``nala_dit.register_with_diffusers()``
(``pipelines/register.py``).
"""

import os as _os
import sys as _sys

from ._lazy import lazy_exports

# OpenMP reads OMP_WAIT_POLICY once, when torch loads: imported before torch, the package sets
# PASSIVE (unless the variable is set), as every entry point of the repository does, so idle
# torch threads sleep instead of spinning (spinning threads made the README's pipeline call
# several times slower on two busy cores; docs/performance.md, "Threads"). Imported after torch, it is too late to set:
# the pipelines then warn once, naming the fix (pipelines/pipeline.py).
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

# The public API (tests/test_api.py pins it): name -> module that defines it.
__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    # the network
    "DiT": "models.dit", "MODELS": "models.dit", "create_model": "models.dit",
    "count_params": "models.dit", "count_flops": "models.dit",
    # the attention
    "nala_attention": "attention", "nala_attention_reference": "attention", "nala_features": "attention",
    "GatedLinearAttention": "attention", "SoftmaxAttention": "attention",
    # objectives and samplers
    "GaussianDiffusion": "diffusion.gaussian", "Transport": "diffusion.transport",
    "ddpm_sample": "diffusion.samplers", "ddim_sample": "diffusion.samplers",
    "ode_sample": "diffusion.samplers", "sde_sample": "diffusion.samplers",
    "cfg_model_fn": "diffusion.guidance",
    "generate": "diffusion.generate", "sample_batch": "diffusion.generate", "SampleSettings": "diffusion.generate",
    # metrics
    "frechet_distance": "evaluation.metrics", "inception_score": "evaluation.metrics",
    "precision_recall": "evaluation.metrics", "evaluate_samples": "evaluation.metrics",
    # pipelines and model sources
    "NaLaDiTPipeline": "pipelines.pipeline", "NaLaSiTPipeline": "pipelines.pipeline",
    "DiTPipelineTransformer": "pipelines.pipeline", "load_source": "pipelines.sources",
    # diffusers' generic DiffusionPipeline.from_pretrained(folder) finds our pipelines once this is called
    "register_with_diffusers": "pipelines.register",
})
