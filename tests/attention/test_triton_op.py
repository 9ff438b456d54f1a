"""NaLa's Triton path as the ``nala_dit::nala_triton`` custom op (``attention/triton_op.py``;
issue 53, item 3): the cases in ``tests/attention/triton_op_cases.py`` run in a subprocess
under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before the kernels are
defined, and would leak into every other test here): the registered backward against
autograd of the eager composition, ``opcheck`` of both ops, and a NaLaDiT block on the
Triton path compiled with ``fullgraph=True`` (no graph break, eager's numbers)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (pip install triton)")
def test_triton_op_under_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/attention/triton_op_cases.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    assert "8 passed" in proc.stdout, proc.stdout[-2000:]
