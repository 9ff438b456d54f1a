"""Metrics: FID / sFID / IS / precision-recall / KID (``metrics.py``) and their inputs, the
Inception and digits feature extractors and streaming image / ``.npz`` readers (``features.py``), and the
Inception network rounded to fp16 or int8 for a machine that can receive little (``carried.py``)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "frechet_distance": "metrics", "inception_score": "metrics", "precision_recall": "metrics", "kid": "metrics",
    "evaluate_samples": "metrics", "make_reference": "metrics", "build_extractor": "features",
})
