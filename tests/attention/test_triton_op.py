"""NaLa's Triton path as the ``nala_dit::nala_triton`` custom op (``attention/nala/triton_op.py``):
the cases in ``tests/attention/triton_op_cases.py`` run in a subprocess
under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before the kernels are
defined, and would leak into every other test here): the registered backward against
autograd of the eager composition, ``opcheck`` of both ops, and a NaLaDiT block on the
Triton path compiled with ``fullgraph=True`` (no graph break, eager's numbers)."""
import importlib.util

import pytest

from tests.utils import run_cases_file


@pytest.mark.slow   # about 35 s: the interpreter runs every program in Python, first-use checks included
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (pip install triton)")
def test_triton_op_under_the_interpreter():
    stdout = run_cases_file("tests/attention/triton_op_cases.py", {"TRITON_INTERPRET": "1"})
    assert "8 passed" in stdout, stdout[-2000:]
