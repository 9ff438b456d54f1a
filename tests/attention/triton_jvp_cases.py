"""The Triton path's forward-mode rule (``tangent.TritonNaLaJvp``) against the eager
composition, run by ``test_tangent.py`` in a subprocess with ``TRITON_INTERPRET=1``
(Triton reads it when the kernels are defined), or on CUDA directly:

    TRITON_INTERPRET=1 python -m pytest -q tests/attention/triton_jvp_cases.py
"""

import os

import pytest
import torch

from nala_dit.attention import nala_attention
from tests.utils import assert_close

pytest.importorskip("triton", reason="Triton is not installed")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"


def qkv_tangents(d):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 1, 9, d, generator=g).to(DEVICE) for _ in range(6)]


@pytest.mark.parametrize("d", [64, 72])
def test_triton_jvp(d):
    q, k, v, dq, dk, dv = qkv_tangents(d)
    ref = torch.func.jvp(lambda *a: nala_attention(*a, impl="eager"), (q, k, v), (dq, dk, dv))
    got = torch.func.jvp(lambda *a: nala_attention(*a, impl="triton"), (q, k, v), (dq, dk, dv))
    assert_close("output", ref[0], got[0], 1e-5)
    assert_close("tangent", ref[1], got[1], 1e-5)


def test_triton_grad_of_jvp():
    q, k, v, dq, _, _ = qkv_tangents(64)

    def grad_of_jvp(impl):
        def loss(x):
            o, do = torch.func.jvp(lambda a: nala_attention(a, k, v, impl=impl), (x,), (dq,))
            return (o * do).sum()
        return torch.func.grad(loss)(q)

    assert_close("grad of jvp", grad_of_jvp("eager"), grad_of_jvp("triton"), 1e-5)
