"""What one gated NaLa layer launches on the fused CPU path, counted exactly, so that a
change which adds per-call work fails here.

Counted: every aten op that reaches the dispatcher and is not a view (``func.is_view``),
under a ``TorchDispatchMode``; on the CPU each is one kernel call. Today (a (2, 16, 32)
input, 2 heads, LePE + LayerNorm + gate, recompute on): 63 forward, 140 backward.

The targets, for the Triton path on CUDA: at most 5 kernels forward and 15 forward
+ backward per gated layer (softmax attention: 3 / 13; before: 12 / 43). Counted here under
the interpreter: 4 / 15 (``nala/triton/gated.py``: NaLa's kernel and one epilogue kernel between
the two projections; 5 kernels backward). The NaLa call on the Triton path is counted under ``TRITON_INTERPRET=1`` (a subprocess: Triton
reads the variable at import), each kernel launch as one and the interpreter's own host copies
inside a launch not at all; allocations (``empty``) launch nothing and are left out. At
N = 67 (one token range): 2 forward (``full`` + the single-launch forward kernel; before
the reworked kernels: ``full`` + state + output), 3 backward (dq, state, dkv kernels). At
N ≥ 1,024 on a GPU the state passes split the tokens and add the ranges with atomics into
one zeroed buffer: one ``zeros`` launch per state pass where the baseline variant
(``NALA_TRITON_VARIANT=baseline``) launched two ``sum``.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nala_dit.attention.layers import build_attention

FORWARD, BACKWARD = 63, 140


TRITON_FORWARD = ["aten.full", "triton._forward_kernel"]
TRITON_BACKWARD = ["triton._dq_kernel", "triton._state_kernel", "triton._dkv_kernel"]
# One gated layer on the Triton path (nala/triton/gated.py): 4 forward, 11 backward, 15 in all
# (the target: at most 5 / 15; softmax attention 3 / 13). Each Linear is one addmm
# forward and mm, mm, sum backward.
LINEAR_BACKWARD = ["aten.mm", "aten.mm", "aten.sum"]
LAYER_FORWARD = ["aten.addmm", "triton._forward_kernel", "triton._epilogue_kernel", "aten.addmm"]
LAYER_BACKWARD = LINEAR_BACKWARD + ["triton._norm_backward_kernel", "triton._lepe_backward_kernel",
                                    *TRITON_BACKWARD] + LINEAR_BACKWARD
# With several token ranges (N ≥ 1,024 on a GPU; asked for 3 on 5 × 13 tokens here, 2 of 64) the state
# and output kernels launch apart, and each state pass adds into a buffer that an earlier
# kernel zeroed (the previous forward's epilogue, this backward's norm kernel): 5 / 11, 16 in
# all (the target: at most 5 / 16; before, a fill launch per state pass made it 6 / 12).
RANGES_FORWARD = ["aten.addmm", "triton._state_kernel", "triton._output_kernel", "triton._epilogue_kernel",
                  "aten.addmm"]
ALLOCATIONS = {"aten.empty", "aten.new_empty", "aten.empty_like"}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and not self.paused:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


class CountedKernel:
    """A Triton kernel whose launches ``kernel[grid](...)`` are recorded in ``mode``."""

    def __init__(self, name, kernel, mode_of):
        self.name, self.kernel, self.mode_of = name, kernel, mode_of

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            mode = self.mode_of()
            mode.ops.append(f"triton.{self.name}")
            mode.paused = True
            try:
                return launch(*args, **kwargs)
            finally:
                mode.paused = False
        return run


def count_kernels(tk, current: list) -> None:
    """Every NaLa kernel of ``tk.KERNELS`` counted into the last mode of ``current``."""
    for kind, k in list(tk.KERNELS.items()):
        k = k.kernel if isinstance(k, CountedKernel) else k   # counted once
        tk.KERNELS[kind] = CountedKernel(k.__name__, k, lambda: current[-1])


def count_triton_call() -> dict:
    """Under TRITON_INTERPRET=1: what ``nala_attention(impl="triton")`` launches, forward and
    backward from a given output gradient."""
    import nala_dit.attention.nala.triton.launch as tk
    from nala_dit.attention import nala_attention

    current = []
    count_kernels(tk, current)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 67, 32, generator=g).requires_grad_() for _ in range(3))
    grad = torch.ones(2, 2, 67, 32)
    counts = {}
    for phase in ("forward", "backward"):
        current.append(CountOps())
        with current[-1]:
            if phase == "forward":
                out = nala_attention(q, k, v, impl="triton")
            else:
                out.backward(grad)
        counts[phase] = [op for op in current[-1].ops if op not in ALLOCATIONS]
    return counts


def test_gated_nala_layer_launch_counts_on_the_fused_cpu_path():
    torch.manual_seed(0)
    layer = build_attention("nala", 32, 2)
    x = torch.randn(2, 16, 32, requires_grad=True)
    with CountOps() as fwd:
        y = layer(x, (4, 4))
    with CountOps() as bwd:
        y.sum().backward()
    assert (len(fwd.ops), len(bwd.ops)) == (FORWARD, BACKWARD), (fwd.ops, bwd.ops)
    assert fwd.ops[0] == "aten.addmm" and fwd.ops[-1] == "aten.addmm"   # qkvg in, projection out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_nala_call_and_gated_layer_launch_counts_on_the_triton_path_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "tests.attention.test_launches"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["call"] == {"forward": TRITON_FORWARD, "backward": TRITON_BACKWARD}
    assert counts["layer"] == {"forward": LAYER_FORWARD, "backward": LAYER_BACKWARD}
    assert len(LAYER_FORWARD) <= 4 and len(LAYER_FORWARD) + len(LAYER_BACKWARD) <= 15
    assert counts["ranges"] == {"forward": RANGES_FORWARD, "backward": LAYER_BACKWARD}
    assert len(RANGES_FORWARD) <= 5 and len(RANGES_FORWARD) + len(LAYER_BACKWARD) <= 16


def count_triton_layer(grid=(3, 5), ranges=None) -> dict:
    """Under TRITON_INTERPRET=1: what one gated NaLa layer (default settings, 2 heads of
    16, a ``grid`` of tokens) launches on the Triton path (``triton_gated``), forward and
    backward; ``ranges``: the state passes' token ranges asked for (as N ≥ 1,024 on a GPU;
    None: what the launcher picks, one range here). The first-use check and the per-layer
    options are built by a first call, not counted."""
    import nala_dit.attention.nala.backend as backend
    import nala_dit.attention.nala.triton.gated as tg
    import nala_dit.attention.nala.triton.launch as tk

    current = []
    count_kernels(tk, current)
    for name in [n for n in dir(tg) if n.endswith("_kernel")]:
        kernel = getattr(tg, name)
        kernel = kernel.kernel if isinstance(kernel, CountedKernel) else kernel   # counted once
        setattr(tg, name, CountedKernel(name, kernel, lambda: current[-1]))
    backend.select_nala_impl = lambda *a: "triton"
    if ranges is not None:
        tg.num_splits = lambda *a: ranges
    torch.manual_seed(0)
    layer = build_attention("nala", 32, 2)
    n = grid[0] * grid[1]
    x = torch.randn(2, n, 32, requires_grad=True)
    current.append(CountOps())
    layer(x, grid).sum().backward()            # first use: the check, the cached options
    layer.zero_grad(set_to_none=True)          # gradients assigned, not accumulated, as in a training step
    x.grad = None
    grad = torch.ones(2, n, 32)
    counts = {}
    for phase in ("forward", "backward"):
        current.append(CountOps())
        with current[-1]:
            if phase == "forward":
                y = layer(x, grid)
            else:
                y.backward(grad)
        counts[phase] = [op for op in current[-1].ops if op not in ALLOCATIONS]
    return counts


if __name__ == "__main__":
    from tests.utils import quicker_triton_interpreter

    quicker_triton_interpreter()
    print(json.dumps({"call": count_triton_call(), "layer": count_triton_layer(),
                      "ranges": count_triton_layer((5, 13), ranges=3)}))
