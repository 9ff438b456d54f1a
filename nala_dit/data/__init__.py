"""Data: image folders, latent caches and the embedded digits (``datasets.py``, ``digits.py``),
the latents' per-channel statistics (``latent_stats.py``) and latent extraction (``extract.py``)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "ImageFolderDataset": "datasets", "LatentDataset": "datasets", "DigitsDataset": "datasets",
    "load_vae": "datasets", "LatentNorm": "latent_stats", "extract_latents": "extract",
})
