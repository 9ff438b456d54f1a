"""NaLa's fused CPU path (``attention/nala/fused.py``, the autograd function dynamo traces under
``torch.compile``): its hand-written backward against autograd of the float64 eager
composition, and a whole NaLaDiT block traced by ``torch.compile(fullgraph=True)`` with no
graph break, equal to eager mode."""
import pytest
import torch

from nala_dit.attention.config import NaLaConfig
from nala_dit.attention.nala.backend import _nala_eager, nala_attention
from nala_dit.models.dit import DiTBlock


def qkv(b=2, h=2, n=17, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_fused_backward_matches_eager_autograd(direction):
    """The fused path runs in fp32 inside, so it is held to the float64 eager composition at fp32
    rounding (gradcheck's finite differences would measure the fp32 noise instead)."""
    config = NaLaConfig(direction=direction)
    q, k, v = qkv()
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    out = nala_attention(q, k, v, config, impl="fused")
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = _nala_eager(q.double(), k.double(), v.double(), config)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    for g, w in zip(got, want):
        assert ((g - w).abs().max() / w.abs().max()).item() < 1e-5


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_eager_composition_passes_gradcheck_in_float64(direction):
    """The eager composition, which the fused backward above is held to, against finite
    differences in float64 (with the learned norm scale's gradient as well): gradcheck's
    central differences at eps 1e-6 leave about 1e-9 of rounding here."""
    config = NaLaConfig(direction=direction)
    q, k, v = (t.detach().double().requires_grad_() for t in qkv(b=1, h=2, n=5, d=4, seed=3))

    def eager(q, k, v):
        return _nala_eager(q, k, v, config)

    assert torch.autograd.gradcheck(eager, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def block_and_inputs():
    torch.manual_seed(0)
    block = DiTBlock(hidden_size=32, num_heads=2, mlp_ratio=2.0, attention="nala")
    for p in block.adaLN_modulation.parameters():   # adaLN-Zero would zero the attention branch
        torch.nn.init.normal_(p, std=0.1)
    x, c = torch.randn(2, 16, 32, requires_grad=True), torch.randn(2, 32)
    return block, x, c


def test_compiled_block_has_no_graph_break_and_matches_eager():
    block, x, c = block_and_inputs()
    torch._dynamo.reset()
    explain = torch._dynamo.explain(block)(x, c, (4, 4))
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    want = block(x, c, (4, 4))
    got = compiled(x, c, (4, 4))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    g_want, = torch.autograd.grad(want.square().sum(), x)
    g_got, = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-5)


