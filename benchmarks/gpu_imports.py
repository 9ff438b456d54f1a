"""The GPU check's first stage: every module its later stages import, with versions; a
missing one is named with the line that fixes it, and the exit status says whether the
model stages can run (``benchmarks/gpu_check.sh`` skips them otherwise, saying why).

    python benchmarks/gpu_imports.py
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

# (module, what needs it); the wheels' script fetches the ones the GPU image lacks
NEEDED = (
    ("torch", "every stage"),
    ("triton", "the NaLa kernels"),
    ("diffusers", "the models (nala_dit.models.dit)"),
    ("torch_fidelity", "nala_dit's evaluation (imported by the package)"),
    ("nala_dit.attention", "the kernels and warm-up stages"),
    ("nala_dit.models.dit", "the launch, profile and model stages"),
    ("benchmarks.sweep", "the model stages"),
)
FIX = "bash benchmarks/gpu_wheels.sh on a machine with PyPI, then carry .gpu_wheels/ with the tree"


def main() -> int:
    missing = []
    for name, needed_by in NEEDED:
        try:
            module = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 — a missing wheel, or a module failing on this torch
            first = str(err).splitlines()[0] if str(err) else ""
            missing.append(name)
            print(f"imports: {name} MISSING, needed by {needed_by} ({type(err).__name__}: {first})", flush=True)
            continue
        print(f"imports: {name} {getattr(module, '__version__', '')}".rstrip(), flush=True)
    import torch

    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    print(f"imports: CUDA {torch.version.cuda}, {cuda}", flush=True)
    if missing:
        print(f"imports: {', '.join(missing)} missing: {FIX}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
