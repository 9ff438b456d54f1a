"""NaLa's Triton path as the ``nala_dit::nala_triton`` custom op (``attention/nala/triton_op.py``),
run by ``tests/attention/test_triton_op.py`` in a subprocess with ``TRITON_INTERPRET=1``
(Triton reads it when the kernels are defined), or directly on CUDA:

    TRITON_INTERPRET=1 python -m pytest -q tests/attention/triton_op_cases.py    # CPU, interpreter

Sizes are tiny: the interpreter runs every program in Python.
"""
import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)

import nala_dit.attention.layers as layers  # noqa: E402
import nala_dit.attention.nala.backend as nala  # noqa: E402
from nala_dit.attention.nala.triton import gated as triton_gated, launch as triton_kernels  # noqa: E402
from nala_dit.attention.config import NaLaConfig  # noqa: E402
from nala_dit.attention.nala.backend import _nala_eager, fused_opts  # noqa: E402
from nala_dit.attention.nala.triton_op import nala_triton_attention  # noqa: E402
from nala_dit.models.dit import DiTBlock  # noqa: E402
from tests.utils import assert_close  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
FP32_TOL = 1e-5


def kernel_opts(direction):
    return {k: v for k, v in fused_opts(NaLaConfig(direction=direction), 16).items() if k != "norm_scale"}


def qkv(h=3, n=17, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, h, n, d, generator=g) * 0.5).to(DEVICE).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_registered_backward_matches_eager_autograd(direction):
    """Output and the gradients of q, k, v and of a per-head norm scale s (the learned
    scale's case) from the op and its registered backward, against autograd of the eager
    composition NaLa(q/s, s=1) == NaLa(q, s), fp32 relative RMS ≤ 1e-5. s is near ‖q‖ ≈ 2,
    where a learned scale starts (``reset_norm_scale``) and tanh is steep; a saturated
    head's ∂L/∂s is ~1e-3 of the terms it sums, and the op's own fp32 rounding
    would be what is measured there."""
    q, k, v = qkv()
    s = torch.tensor([1.5, 2.0, 3.0], device=DEVICE, requires_grad=True)
    out = nala_triton_attention(q, k, v, s, kernel_opts(direction))
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = torch.autograd.grad(out, (q, k, v, s), g_out)
    # q/s in float64: the eager composition then computes in float64 (in fp32 its own
    # rounding of the scale's gradient, a sum over every token, would be the larger part of
    # the error)
    q_s = (q.double() / s.double().view(1, -1, 1, 1))
    ref = _nala_eager(q_s, k, v, NaLaConfig(direction=direction, norm_scale=1.0))
    want = torch.autograd.grad(ref, (q, k, v, s), g_out)
    for name, r, x in zip(("output", "grad q", "grad k", "grad v", "grad s"), (ref, *want), (out, *got)):
        assert_close(name, r, x, FP32_TOL)


def test_op_is_the_autograd_function_bit_for_bit():
    """The op runs TritonNaLa's own launches: outputs and gradients identical to
    ``nala_attention_triton`` (a float scale: no scale gradient is asked for)."""
    q, k, v = qkv(h=2, n=9)
    opts = kernel_opts("cosine")
    outs = [fn(q, k, v, 1.5, opts) for fn in (nala_triton_attention, triton_kernels.nala_attention_triton)]
    grads = [torch.autograd.grad(o, (q, k, v), torch.ones_like(o)) for o in outs]
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("need_scale", [True, False])
def test_opcheck(need_scale):
    """Schema, fake (meta) implementations (strides included: q, k, v are strided views, as
    a layer's heads are), autograd registration, and the backward op itself."""
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in qkv(h=2, n=9))
    s = torch.tensor([0.5, 2.0], device=DEVICE, requires_grad=need_scale)
    opts = [*kernel_opts("cosine").values(), ""]   # precision "": resolved when the op runs
    torch.library.opcheck(torch.ops.nala_dit.nala_triton.default, (q, k, v, s, *opts))
    out, state, z, den = torch.ops.nala_dit.nala_triton(q, k, v, s, *opts)
    args = [t.detach() for t in (q, k, v, s, state, z, den, torch.ones_like(out))]
    torch.library.opcheck(torch.ops.nala_dit.nala_triton_backward.default, (*args, need_scale, *opts))


def block_and_inputs():
    torch.manual_seed(0)
    block = DiTBlock(hidden_size=32, num_heads=2, mlp_ratio=2.0, attention="nala").to(DEVICE)
    for p in block.adaLN_modulation.parameters():   # adaLN-Zero would zero the attention branch
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 16, 32, device=DEVICE, requires_grad=True)
    return block, x, torch.randn(2, 32, device=DEVICE)


@pytest.fixture
def triton_path(monkeypatch):
    """The block's NaLa forced onto the Triton path (what ``impl="auto"`` picks on CUDA),
    eager and compiled, with an empty first-use check cache; the Triton calls counted."""
    monkeypatch.setattr(nala, "select_nala_impl", lambda *a: "triton")
    monkeypatch.setattr(nala, "_TRITON_CHECKS", {})
    monkeypatch.setattr(layers, "gated_triton_passes_check", lambda *a: True)   # tested in triton_gated_cases.py
    calls = []
    kernel = triton_kernels.nala_attention_triton
    monkeypatch.setattr(triton_kernels, "nala_attention_triton", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    # eager mode's gated layer runs NaLa inside triton_gated's fused middle: counted too
    middle = triton_gated.TritonGatedMiddle.apply
    monkeypatch.setattr(triton_gated.TritonGatedMiddle, "apply", lambda *a: calls.append(1) or middle(*a))
    return calls


def test_compiled_block_on_the_triton_path(triton_path):
    """``torch.compile(fullgraph=True)`` of a NaLaDiT block whose NaLa runs the Triton
    kernels: no graph break, the first-use check ran while tracing (the op was not called
    by the check's eager kernel call afterwards), and outputs and input gradients equal
    eager mode's within fp32 rounding."""
    block, x, c = block_and_inputs()
    torch._dynamo.reset()
    explain = torch._dynamo.explain(block)(x, c, (4, 4))
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    key = (str(x.device), torch.float32, 16, "cosine")
    assert nala._TRITON_CHECKS == {key: None}, "the first-use check did not run (or failed) while tracing"
    checks = len(nala.CHECK_CASES)                   # the check calls the kernels once per case
    assert len(triton_path) == checks, "only the check called the eager kernels while tracing"
    assert "nala_dit.nala_triton" in str(explain.graphs[0].graph)

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got = compiled(x, c, (4, 4))
    g_got, = torch.autograd.grad(got.square().sum(), x)
    assert len(triton_path) == checks, "the compiled block ran the eager kernel function"
    want = block(x, c, (4, 4))
    g_want, = torch.autograd.grad(want.square().sum(), x)
    assert len(triton_path) == checks + 1, "eager mode did not run the Triton path"
    assert_close("output", want, got, FP32_TOL)
    assert_close("grad x", g_want, g_got, FP32_TOL)


def test_a_failed_check_compiles_the_eager_composition(triton_path, monkeypatch):
    """A kernel that fails its first-use check while tracing: the compiled block runs the
    eager composition (no op in the graph, still no break) and warns once."""
    monkeypatch.setattr(nala, "_triton_kernel", lambda *a: (_ for _ in ()).throw(RuntimeError("ptxas (injected)")))
    block, x, c = block_and_inputs()
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="ptxas"):
        explain = torch._dynamo.explain(block)(x, c, (4, 4))
    assert explain.graph_break_count == 0, explain.break_reasons
    assert "nala_triton" not in str(explain.graphs[0].graph)


def test_dynamic_shapes_compile_whole(triton_path):
    """``dynamic=True`` (symbolic sizes, and the layer's §2 constants symbolic floats): still
    one graph with the op, eager's output at two batch sizes."""
    block, x, c = block_and_inputs()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        for b in (2, 3):
            xb, cb = x.detach()[:1].expand(b, -1, -1) * torch.arange(1, b + 1).view(-1, 1, 1), c[:1].expand(b, -1)
            assert_close(f"batch {b}", block(xb, cb, (4, 4)), compiled(xb, cb, (4, 4)), FP32_TOL)
    assert len(triton_path) == len(nala.CHECK_CASES) + 2, "the check (once per case) and the two eager calls only"
