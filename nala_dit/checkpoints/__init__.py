"""Reading training checkpoints, below both training and the pipelines: a checkpoint folder
opened and checked, its model rebuilt with its EMA or raw weights, its objective and latent
normalisation (``read.py``), FSDP's sharded files read without running code (``shards.py``),
and what the EMA still holds of its initial weights (``ema.py``). Writing them is training's
(``training/checkpoint.py``)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "Checkpoint": "read", "open_checkpoint": "read", "find_checkpoint": "read", "list_checkpoints": "read",
    "load_model": "read", "build_objective": "read", "checkpoint_norm": "read", "source_norm": "read",
    "checkpoint_ema_warning": "ema",
})
