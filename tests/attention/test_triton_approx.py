"""The hardware approximations of the Triton kernels' feature map:
``sin.approx``, ``cos.approx``, ``lg2.approx`` and ``tanh.approx`` (the MUFU unit), used
in the half-precision mode (``PREC == "bf16"``) only (tanh for the angle θ = (π/4)·tanh(α x̂)).

On a GPU: each approximation's worst error over its input range against the exact
function in float64. Without one (the interpreter runs no PTX): the sm_90a compile of the
same helpers shows the MUFU instructions in the bf16 mode and none in the exact mode.
"""

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not HAS_TRITON or INTERPRET,
                                reason="needs Triton compiled kernels (not installed, or TRITON_INTERPRET=1)")

ROOT = Path(__file__).resolve().parents[2]
# Bounds (PTX ISA, sin/cos.approx.f32 and lg2.approx.f32), with margin: sin and cos within
# 2^-20 absolute on θ ∈ [-π/4, π/4] (θ = (π/4)·tanh(·)); ln = ln 2 · lg2 within
# 2^-21·(1 + |ln x|) for x over the magnitudes |q̂| and |k| take (1e-30 to 1e4); tanh
# (about 2^-11 relative; measured on sm_75+ by others: 1.1e-5, "about 16 bits",
# https://stackoverflow.com/questions/41251698) within 2^-10.5 relative on the angle's
# argument α x̂ ∈ [-α, α] (|x̂| ≤ 1, α = 20 by default) and the small |α x̂| of near-zero lanes.
SIN_COS_BOUND = 2.0 ** -20
LOG_BOUND = 2.0 ** -21
TANH_BOUND = 2.0 ** -10.5


def _approx_kernel():
    import triton
    import triton.language as tl

    from nala_dit.attention.nala.triton import features as tk

    @triton.jit
    def approx(X, SIN, COS, LOG, TANH, n, PREC: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + offs, mask=mask, other=1.0)
        tl.store(SIN + offs, tk._sin(x, PREC), mask=mask)
        tl.store(COS + offs, tk._cos(x, PREC), mask=mask)
        tl.store(LOG + offs, tk._log(x, PREC), mask=mask)
        tl.store(TANH + offs, tk._tanh(x, PREC), mask=mask)

    return approx


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the interpreter cannot run PTX approximations")
def test_each_approximation_worst_error_over_its_range():
    from nala_dit.attention.config import ALPHA

    kernel = _approx_kernel()
    theta = torch.linspace(-math.pi / 4, math.pi / 4, 1 << 20, dtype=torch.float64)
    mags = torch.cat([torch.logspace(-30, 4, 1 << 20, dtype=torch.float64),
                      torch.linspace(0.5, 2.0, 1 << 20, dtype=torch.float64)])
    small = torch.logspace(-30, 0, 1 << 18, dtype=torch.float64)
    tanh_args = torch.cat([torch.linspace(-ALPHA, ALPHA, 1 << 20, dtype=torch.float64), small, -small])
    worst = {}
    for prec in ("bf16", "ieee"):
        for name, x in (("angle", theta), ("magnitude", mags), ("tanh", tanh_args)):
            x32 = x.float().cuda()
            outs = [torch.empty_like(x32) for _ in range(4)]
            kernel[(triton.cdiv(x32.numel(), 1024),)](x32, *outs, x32.numel(), PREC=prec, BLOCK=1024)
            exact = x32.double().cpu()
            sin, cos, log, tanh = (o.double().cpu() for o in outs)
            if name == "angle":
                worst[prec, "sin"] = (sin - exact.sin()).abs().max().item()
                worst[prec, "cos"] = (cos - exact.cos()).abs().max().item()
            elif name == "magnitude":
                worst[prec, "log"] = ((log - exact.log()).abs() / (1 + exact.log().abs())).max().item()
            else:
                nonzero = exact != 0
                err = (tanh - exact.tanh()).abs()
                worst[prec, "tanh"] = (err[nonzero] / exact.tanh().abs()[nonzero]).max().item()
                worst[prec, "tanh_abs"] = err.max().item()
    print(worst)
    assert worst["bf16", "sin"] <= SIN_COS_BOUND and worst["bf16", "cos"] <= SIN_COS_BOUND, worst
    assert worst["bf16", "log"] <= LOG_BOUND, worst
    assert worst["bf16", "tanh"] <= TANH_BOUND, worst
    # The exact path: libdevice, a few fp32 ulps; tanh's exp and IEEE division a few ulps of 1
    # absolute (relative, 1 − exp(−2|x|) cancels at small |x|: not held).
    assert max(worst["ieee", f] for f in ("sin", "cos", "log")) <= 2.0 ** -22, worst
    assert worst["ieee", "tanh_abs"] <= 2.0 ** -21, worst


import triton  # noqa: E402  (after the skip marker: only used where Triton is installed)


@pytest.mark.slow
def test_bf16_mode_compiles_to_mufu_and_the_exact_mode_does_not():
    """sm_90a SASS of the helpers: MUFU.SIN, MUFU.COS, MUFU.LG2, MUFU.TANH in the bf16 mode;
    in the exact mode none of sin, cos, tanh (libdevice's software sin/cos/log, tanh from
    exp and a division), so fp32 inputs keep the exact functions. Needs Triton's ptxas and
    nvdisasm, no GPU."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from triton_compile_check import compile_kernel, resources

    pointers = dict(X="*fp32", SIN="*fp32", COS="*fp32", LOG="*fp32", TANH="*fp32")
    found = {}
    for prec in ("bf16", "ieee"):
        r = resources(*compile_kernel(_approx_kernel(), pointers, dict(PREC=prec, BLOCK=256), 4, arch=90), 4)
        found[prec] = r["mufu"]
    assert {"SIN", "COS", "LG2", "TANH"} <= set(found["bf16"]), found
    assert not {"SIN", "COS", "TANH"} & set(found["ieee"]), found
