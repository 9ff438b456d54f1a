"""``torch.compile`` of a model, in one place for ``sample.py --compile`` / ``--cuda-graphs``,
the NaLa pipelines' ``compile()`` and ``train.py --compile``.

NaLa traces whole under the compiler (``attention/op.py`` on the CPU, ``attention/triton_op.py``
on the GPU: custom ops, no graph break), so a NaLaDiT compiles into one graph as DiT does.
``mode="reduce-overhead"`` is inductor's CUDA-graph trees: each input shape is captured
once and replayed at every later call (a sampler step), the host's launch cost gone;
where capture is not possible inductor itself runs that graph without CUDA graphs and
logs why. Outputs of a replay that a sampler still holds (Heun's first slope,
DPM-Solver++'s history) are copied by inductor before the next replay overwrites them.
"""
from __future__ import annotations

import sys

import torch

from ..compile_cache import private_compile_cache

COMPILE_MODES = ("default", "reduce-overhead")
NO_CUDA_NOTE = ("note: CUDA graphs (--cuda-graphs, mode='reduce-overhead') need CUDA, and this machine has none: "
                "the model runs compiled without them")


def compile_model(model: torch.nn.Module, mode: str = "default", *, in_place: bool = True) -> torch.nn.Module:
    """``model`` compiled with ``torch.compile``'s ``mode`` (one of ``COMPILE_MODES``).

    ``in_place`` (sampling, pipelines): ``nn.Module.compile``, so the module keeps its
    class and attributes and every caller of ``model(...)`` runs the compiled forward;
    returns ``model``. Else (training) the compiled wrapper, the module itself left eager
    for what reads it besides the step (EMA, checkpoints). ``"reduce-overhead"`` on a
    machine without CUDA prints ``NO_CUDA_NOTE`` (one line, stderr) and compiles with
    ``"default"``."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    private_compile_cache()   # inductor imports what it cached: only from a folder no one else can write
    if mode == "reduce-overhead" and not torch.cuda.is_available():
        print(NO_CUDA_NOTE, file=sys.stderr)
        mode = "default"
    if not in_place:
        return torch.compile(model, mode=mode)
    model.compile(mode=mode)
    return model
