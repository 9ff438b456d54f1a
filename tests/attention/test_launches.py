"""What one gated NaLa layer launches on the fused CPU path, counted exactly, so that a
change which adds per-call work fails here (issue 53, item 2).

Counted: every aten op that reaches the dispatcher and is not a view (``func.is_view``),
under a ``TorchDispatchMode``; on the CPU each is one kernel call. Today (a (2, 16, 32)
input, 2 heads, LePE + LayerNorm + gate, recompute on): 73 forward, 192 backward.

Issue 53's targets, for the Triton path on CUDA (not counted here): at most 5 kernels
forward and 15 forward + backward per gated layer (softmax attention: 3 / 13); today 12 / 43.
The Triton path's count under ``TRITON_INTERPRET=1`` is not yet held by a test.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nala_dit.attention.layers import build_attention

FORWARD, BACKWARD = 73, 192


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


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
