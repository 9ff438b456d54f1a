"""The gated NaLa layer on Triton (``attention/nala/triton/gated.py``): the cases in
``tests/attention/triton_gated_cases.py`` run in a subprocess
under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before the kernels are
defined): output and every gradient against the plain autograd composition, fp32 and
bf16 autocast (NaLa's features kept for the backward and recomputed), head dims 16, 64 and
72, odd grids, several token ranges (the zeroed state buffers handed on), the learned norm
scale, the layers that keep the unfused middle, and its first-use check (a wrong result falls back once,
with one warning)."""
import importlib.util

import pytest

from tests.utils import run_cases_file


@pytest.mark.slow   # about a minute: the interpreter runs every program in Python (the launch counts stay fast)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (pip install triton)")
def test_triton_gated_layer_under_the_interpreter():
    stdout = run_cases_file("tests/attention/triton_gated_cases.py", {"TRITON_INTERPRET": "1"})
    assert "16 passed" in stdout, stdout[-2000:]
