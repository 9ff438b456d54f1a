"""Memory of the attention, counted exactly with the benchmarks' storage tracker
(``benchmarks/attention.py`` ``PeakMemory``: every tensor storage an operator creates, freed
when it dies): what the gated layer keeps for backward, and linear growth with the tokens."""

import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.attention import PeakMemory  # noqa: E402
from nala_dit.attention import GatedLinearAttention, SoftmaxAttention  # noqa: E402
from nala_dit.models.dit import create_model  # noqa: E402
from tests.utils import TINY  # noqa: E402

F32 = 4


def held_after_forward(layer, x, grid):
    """Bytes alive after the forward: the output plus what autograd keeps for backward."""
    with PeakMemory() as tracker:
        y = layer(x, grid)
        held = tracker.current
    del y
    return held


def test_gated_layer_keeps_only_qkvg_and_the_state():
    """recompute=True keeps exactly the qkvg projection (4C per token), the output and
    NaLa's state (2, B, H, D, D+1); the composition keeps four more C-wide activations
    (LayerNorm input and output, SiLU(g), the projection's input) -- DiT's softmax layer
    keeps 4C per token as well (q, k, v and SDPA's output)."""
    b, n, c, h = 1, 15 * 17, 48, 3
    x = torch.randn(b, n, c, requires_grad=True)
    new = GatedLinearAttention(c, h)
    ref = GatedLinearAttention(c, h, recompute=False)
    token = b * n * c * F32
    state = 2 * b * h * (c // h) * (c // h + 1) * F32
    assert held_after_forward(new, x, (15, 17)) == 4 * token + token + state
    assert held_after_forward(ref, x, (15, 17)) >= 4 * token + token + state + 4 * token
    softmax = held_after_forward(SoftmaxAttention(c, h), x, (15, 17))
    assert 4 * token + token <= softmax <= 4 * token + token + b * h * n * F32   # + SDPA's logsumexp


def model_peak(model, latent, backward):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, model.in_channels, latent, latent, generator=g)
    t, y = torch.tensor([10.0]), torch.tensor([1])
    with PeakMemory() as tracker:
        out = model(x, t, y)
        if backward:
            out.square().mean().backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_nala_model_memory_is_linear_in_tokens(backward):
    """A NaLaDiT training forward (and step) at 4× the tokens (256 → 1024) uses ≤ 4.5× the
    memory; the same model with softmax attention through SDPA's math path (an explicit
    N×N matrix) uses far more than 4.5×, so the bound does tell linear from quadratic."""
    torch.manual_seed(0)
    nala = create_model("NaLaDiT-T/2", **TINY)
    ratio = model_peak(nala, 64, backward) / model_peak(nala, 32, backward)
    assert 3.0 < ratio <= 4.5, ratio
    softmax = create_model("DiT-T/2", **TINY)
    with sdpa_kernel(SDPBackend.MATH):
        quadratic = model_peak(softmax, 64, backward) / model_peak(softmax, 32, backward)
    assert quadratic > 6.0, quadratic
