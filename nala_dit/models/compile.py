"""``torch.compile`` of a model, in one place for ``sample.py --compile`` / ``--cuda-graphs``,
the NaLa pipelines' ``compile()`` and ``train.py --compile``.

NaLa traces whole under the compiler (on the CPU its fused autograd function, on the GPU the
custom op of ``attention/nala/triton_op.py``: no graph break), so a NaLaDiT compiles into one graph as DiT does.
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
# What the first call of a compiled model costs on a CPU, said before it starts (train.py's first
# step, sample.py's first batch). Measured for NaLaDiT-T/2 (digits, batch 64 / 2 images of 40 ddpm
# steps) on 2-core CPUs: the first step 2.5 min on a user's machine and 5 min 8 s on one thread of
# the development machine beside 12-17 other busy processes; the first batch 104 s and 5.8 min (a
# 474 s run against 128 s eager). docs/sampling.md, docs/training.md.
COMPILE_COST = {"step": "2.5-5 minutes", "batch": "2-6 minutes"}
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


def compile_note(what: str) -> str:
    """The line said before the first ``what`` (``COMPILE_COST``'s keys) of a compiled model runs:
    a compiling run is silent for minutes on a CPU."""
    return (f"compiling the model (torch.compile): the first {what} takes it, on a CPU {COMPILE_COST[what]} for "
            f"NaLaDiT-T/2 on 2 cores, longer for larger models or beside other work")
