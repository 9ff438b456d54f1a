"""NaLa's fused CPU path as the ``nala_dit::nala_fused`` custom op (``attention/nala/op.py``,
what ``nala_attention`` runs on the CPU while dynamo traces): its registered backward against
autograd of the eager composition, and a whole NaLaDiT block traced by
``torch.compile(fullgraph=True)`` with no graph break and NaLa as that one op."""
import pytest
import torch

from nala_dit.attention.config import NaLaConfig
from nala_dit.attention.nala.backend import _nala_eager, fused_opts, nala_attention
from nala_dit.attention.nala.op import nala_fused_attention
from nala_dit.models.dit import DiTBlock


def qkv(b=2, h=2, n=17, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_op_backward_matches_eager_autograd(direction):
    """The op runs in fp32 inside, so it is held to the float64 eager composition at fp32
    rounding (gradcheck's finite differences would measure the fp32 noise instead)."""
    config = NaLaConfig(direction=direction)
    q, k, v = qkv()
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    out = nala_fused_attention(q, k, v, fused_opts(config, q.shape[-1]))
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = _nala_eager(q.double(), k.double(), v.double(), config)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    for g, w in zip(got, want):
        assert ((g - w).abs().max() / w.abs().max()).item() < 1e-5


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_eager_composition_passes_gradcheck_in_float64(direction):
    """The eager composition, which the op's backward above is held to, against finite
    differences in float64 (with the learned norm scale's gradient as well): gradcheck's
    central differences at eps 1e-6 leave about 1e-9 of rounding here."""
    config = NaLaConfig(direction=direction)
    q, k, v = (t.detach().double().requires_grad_() for t in qkv(b=1, h=2, n=5, d=4, seed=3))

    def eager(q, k, v):
        return _nala_eager(q, k, v, config)

    assert torch.autograd.gradcheck(eager, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_opcheck_schema_fake_and_autograd_registration():
    q, k, v = qkv()
    opts = fused_opts(NaLaConfig(), q.shape[-1])
    torch.library.opcheck(torch.ops.nala_dit.nala_fused.default, (q, k, v, *opts.values()))


def test_op_equals_the_fused_autograd_function():
    q, k, v = qkv()
    opts = fused_opts(NaLaConfig(), q.shape[-1])
    torch.testing.assert_close(nala_fused_attention(q, k, v, opts), nala_attention(q, k, v, impl="fused"),
                               rtol=0, atol=0)


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
    nala_ops = [n.target for n in explain.graphs[0].graph.nodes if "nala_dit" in str(n.target)]
    assert nala_ops == [torch.ops.nala_dit.nala_fused.default]   # NaLa is the custom op, once per block
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    want = block(x, c, (4, 4))
    got = compiled(x, c, (4, 4))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    g_want, = torch.autograd.grad(want.square().sum(), x)
    g_got, = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("what", ["direction", "head dim"])
def test_the_op_and_its_fake_refuse_what_the_passes_cannot_run(what):
    """A direction the passes do not know (any other string ran the relu_split lift) and a v
    head dim other than q's (the state is D x (D + 1): the real passes fail in a GEMM while the
    fake gave shapes) are one line from the op and from its fake (``FakeTensorMode``, what
    torch.compile traces with)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nala_dit.attention.nala.op import nala_fused

    q, k, v = (t.detach() for t in qkv())
    opts = fused_opts(NaLaConfig(), q.shape[-1])
    if what == "direction":
        opts["direction"], expect = "bogus", "direction must be one of ('cosine', 'relu_split'), got 'bogus'"
    else:
        v, expect = torch.randn(*v.shape[:3], 12), "v's head dim must be q's"
    args = [opts[name] for name in ("direction", "power", "offset", "norm_scale", "alpha", "norm_eps", "eps")]
    with pytest.raises(ValueError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        nala_fused(q, k, v, *args)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        nala_fused(*(mode.from_tensor(t) for t in (q, k, v)), *args)
