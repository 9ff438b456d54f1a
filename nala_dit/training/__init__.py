"""Training: the run's construction, its loop and one training step (``loop.py``), the pieces a
run is built from (``build.py``), the built run (``run.py``), resuming it (``resume.py``, its
rules in ``resume_rules.py``), the step's pieces and the EMA (``step.py``), logs
(``tracking.py``), evaluation while training (``validation.py``), representation alignment
(``repa.py``), softmax → NaLa conversion (``convert.py``), atomic checkpoints (``checkpoint.py``)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "train": "loop", "TrainStep": "loop", "update_ema": "step",
    "save_checkpoint": "checkpoint", "open_checkpoint": "checkpoint", "load_model": "checkpoint",
})
