"""Forward-mode derivatives through NaLa (``nala_dit/attention/nala/tangent.py``): every path's
``torch.func.jvp`` against the eager composition's (torch's own forward-mode rules) and a
float64 central finite difference of the quadratic reference; ``torch.func.jvp`` inside
``torch.func.grad``; the refusals. fp32 ≤ 1e-5 relative RMS, bf16 inputs ≤ 1e-2 (bf16
rounding is 2^-8); odd N, head dims 64 and 72. The Triton path runs in Triton's interpreter
in a subprocess (``triton_jvp_cases.py``)."""

import importlib.util

import pytest
import torch

from nala_dit.attention import nala_attention, nala_attention_reference
from nala_dit.attention.layers import GatedLinearAttention
from nala_dit.attention.regions import region_nala_attention
from tests.utils import assert_close, run_cases_file

HAS_TRITON = importlib.util.find_spec("triton") is not None


def inputs(d, n=33, h=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    primals = tuple(torch.randn(1, h, n, d, generator=g).to(dtype) for _ in range(3))
    tangents = tuple(torch.randn(1, h, n, d, generator=g).to(dtype) for _ in range(3))
    return primals, tangents


def finite_difference(f, primals, tangents, step=1e-5):
    """Central difference of ``f`` along the tangents, in float64: error O(step²)."""
    p64 = [p.double() for p in primals]
    t64 = [t.double() for t in tangents]
    plus = f(*(p + step * t for p, t in zip(p64, t64)))
    minus = f(*(p - step * t for p, t in zip(p64, t64)))
    return (plus - minus) / (2 * step)


@pytest.mark.parametrize("d,direction", [(64, "cosine"), (72, "cosine"), (64, "relu_split")])
def test_fused_jvp_matches_eager_and_finite_difference(d, direction):
    primals, tangents = inputs(d)
    fused = lambda q, k, v: nala_attention(q, k, v, impl="fused", direction=direction)
    eager = lambda q, k, v: nala_attention(q, k, v, impl="eager", direction=direction)
    out, tangent = torch.func.jvp(fused, primals, tangents)
    ref_out, ref_tangent = torch.func.jvp(eager, primals, tangents)
    assert_close("output", ref_out, out, 1e-5)
    assert_close("tangent vs eager", ref_tangent, tangent, 1e-5)
    reference = lambda q, k, v: nala_attention_reference(q, k, v, direction=direction)   # N × N, float64
    assert_close("tangent vs finite difference", finite_difference(reference, primals, tangents), tangent, 1e-5)


def test_fused_jvp_of_some_inputs_and_bf16():
    """Tangents for q only (None for k, v inside the rule), and bf16 inputs against the
    fp32 tangent on the same rounded inputs (≤ 1e-2)."""
    (q, k, v), (dq, _, _) = inputs(72, n=17)
    ref = torch.func.jvp(lambda x: nala_attention(x, k, v, impl="eager"), (q,), (dq,))[1]
    assert_close("q-only tangent", ref, torch.func.jvp(lambda x: nala_attention(x, k, v, impl="fused"), (q,), (dq,))[1],
                 1e-5)
    primals, tangents = inputs(64, dtype=torch.bfloat16)
    got = torch.func.jvp(lambda *a: nala_attention(*a, impl="fused"), primals, tangents)[1]
    assert got.dtype == torch.bfloat16
    ref = torch.func.jvp(lambda *a: nala_attention(*a, impl="eager"),
                         tuple(p.float() for p in primals), tuple(t.float() for t in tangents))[1]
    assert_close("bf16 tangent", ref, got, 1e-2)


def test_jvp_inside_grad_and_forward_ad():
    """Reverse over forward (an sCM-style loss differentiates through the tangent):
    ∂/∂q Σ o·ȯ on the fused path equals the eager composition's; ``forward_ad`` dual
    tensors run the eager composition and give its tangent."""
    (q, k, v), (dq, dk, dv) = inputs(64, n=17)

    def loss(impl):
        def f(x):
            o, do = torch.func.jvp(lambda a, b, c: nala_attention(a, b, c, impl=impl), (x, k, v), (dq, dk, dv))
            return (o * do).sum()
        return torch.func.grad(f)(q)

    assert_close("grad of jvp", loss("eager"), loss("fused"), 1e-5)
    from torch.autograd import forward_ad

    with forward_ad.dual_level():
        out = nala_attention(forward_ad.make_dual(q, dq), k, v)
        tangent = forward_ad.unpack_dual(out).tangent
    ref = torch.func.jvp(lambda x: nala_attention(x, k, v, impl="eager"), (q,), (dq,))[1]
    assert_close("forward_ad tangent", ref, tangent, 1e-5)


def test_refusals_are_one_line():
    (q, k, v), (dq, _, _) = inputs(8, n=5)
    grad = torch.func.grad(lambda x: nala_attention(x, k, v, impl="fused").sum())
    with pytest.raises(ValueError, match="forward-over-reverse .* impl='eager'") as err:
        torch.func.jvp(grad, (q,), (dq,))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="context-parallel NaLa are not supported") as err:
        torch.func.jvp(lambda x: nala_attention(x, k, v, shard=object()), (q,), (dq,))
    assert "\n" not in str(err.value)


def test_gated_layer_and_regions_jvp():
    """The gated layer (fused middle by default) under ``torch.func.jvp`` runs its plain
    composition: its tangent equals that of ``recompute=False`` and a float64 finite
    difference of the layer; region states (R = 2) against a float64 finite difference."""
    torch.manual_seed(0)
    grid = (3, 11)                                                    # N = 33, odd
    layer = GatedLinearAttention(144, 2)                               # head dim 72
    plain = GatedLinearAttention(144, 2, recompute=False)
    plain.load_state_dict(layer.state_dict())
    x, dx = torch.randn(2, 1, 33, 144).unbind(0)
    out, tangent = torch.func.jvp(lambda t: layer(t, grid), (x,), (dx,))
    assert_close("layer output", layer(x, grid), out, 1e-5)
    assert_close("layer tangent vs plain", torch.func.jvp(lambda t: plain(t, grid), (x,), (dx,))[1], tangent, 1e-5)
    layer64 = GatedLinearAttention(144, 2, recompute=False).double()
    layer64.load_state_dict(layer.state_dict())
    fd = finite_difference(lambda t: layer64(t, grid), (x,), (dx,))
    assert_close("layer tangent vs finite difference", fd, tangent, 1e-5)

    (q, k, v), tangents = inputs(64, n=36)
    logits = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))
    f = lambda q, k, v: region_nala_attention(q, k, v, (6, 6), logits, regions=2)
    out, tangent = torch.func.jvp(f, (q, k, v), tangents)
    assert_close("region output", f(q, k, v), out, 1e-5)
    ref = torch.func.jvp(lambda *a: region_nala_attention(*a, (6, 6), logits, regions=2, impl="eager"),
                         (q, k, v), tangents)[1]
    assert_close("region tangent", ref, tangent, 1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
def test_triton_jvp_under_the_interpreter():
    """The Triton path's tangent (head dims 64 and 72, N = 9) and ∂/∂q Σ o·ȯ against the
    eager composition, fp32 ≤ 1e-5."""
    stdout = run_cases_file("tests/attention/triton_jvp_cases.py", {"TRITON_INTERPRET": "1"})
    assert "3 passed" in stdout, stdout[-2000:]
