"""Data: image folders, latent caches and the embedded digits (``datasets.py``, ``digits.py``),
webdataset tar shards and Hugging Face parquet / save_to_disk data read shard by shard (``streams.py``),
each a line of the registry of what ``--data`` takes (``sources.py``), the latents' per-channel
statistics (``latent_stats.py``) and latent extraction (``extract.py``)."""

from .._lazy import lazy_exports
from ..models.vae import load_vae  # the VAE is the model's (models/vae.py, torch-free to import); named here too

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "ImageFolderDataset": "datasets", "LatentDataset": "datasets", "DigitsDataset": "datasets",
    "LatentNorm": "latent_stats", "extract_latents": "extract",
})
__all__ = sorted([*__all__, "load_vae"])
