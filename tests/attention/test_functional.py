"""NaLa and the baselines against their quadratic references (NALA_SPEC.md §5)."""


import pytest
import torch

from nala_dit.attention import (
    GatedLinearAttention,
    SoftmaxAttention,
    build_attention,
    linear_attention,
    linear_attention_reference,
    nala_attention,
    nala_attention_reference,
    nala_features,
    nala_similarity_reference,
    softmax_attention,
    softmax_attention_reference,
)
from tests.utils import assert_close, assert_names

FP32_TOL = 1e-5


def qkv(b=2, h=3, n=63, d=24, scale=1.0, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(b, h, n, d, generator=g) * scale for _ in range(3)]
    return [t.requires_grad_(requires_grad) for t in ts]


def check_against_reference(fast, ref, n, d, **kw):
    q, k, v = qkv(n=n, d=d, requires_grad=True)
    out = fast(q, k, v, **kw)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected = ref(q2, k2, v2, **kw)
    expected_grads = torch.autograd.grad(expected.square().sum(), (q2, k2, v2))
    assert_close("output", expected, out, FP32_TOL)
    for name, g_ref, g in zip("qkv", expected_grads, grads):
        assert_close(f"grad {name}", g_ref, g, FP32_TOL)


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
@pytest.mark.parametrize("n,d", [(63, 24), (257, 64)])
def test_nala_linear_equals_reference(direction, n, d):
    check_against_reference(nala_attention, nala_attention_reference, n, d, direction=direction)


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_nala_linear_equals_reference_in_float64(direction):
    """In float64 the linear form and the quadratic §2 definition are one function: they
    agree to float64 rounding (1e-12), output and gradients; fp32 above only shows 1e-5."""
    q, k, v = (t.double().requires_grad_() for t in qkv(n=33, d=24))
    outs, grads = [], []
    for fn in (lambda *x: nala_attention(*x, impl="eager", direction=direction),
               lambda *x: nala_attention_reference(*x, direction=direction)):
        out = fn(q, k, v)
        assert out.dtype == torch.float64
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    assert_close("output", outs[1], outs[0], 1e-12)
    for name, g_ref, g in zip("qkv", grads[1], grads[0]):
        assert_close(f"grad {name}", g_ref, g, 1e-12)


@pytest.mark.parametrize("kernel", ["relu", "elu"])
@pytest.mark.parametrize("n,d", [(63, 24), (257, 64)])
def test_baselines_linear_equal_reference(kernel, n, d):
    check_against_reference(linear_attention, linear_attention_reference, n, d, kernel=kernel)


def test_softmax_matches_math_reference():
    q, k, v = qkv(n=63, d=24)
    assert_close("softmax", softmax_attention_reference(q, k, v), softmax_attention(q, k, v), FP32_TOL)


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
def test_feature_lift_gives_the_spec_similarity(direction):
    """φ_q·φ_k equals Σ_m a b cos(θ_q − θ_k) (cosine) / same-sign products, and ‖φ_q‖ = ‖a‖."""
    q, k, _ = qkv(n=31, d=16)
    phi_q, phi_k = nala_features(q, k, direction=direction)
    assert phi_q.shape == (2, 3, 31, 32) and phi_q.dtype == torch.float32
    sim = phi_q @ phi_k.transpose(-2, -1)
    assert_close("similarity", nala_similarity_reference(q, k, direction=direction), sim, 1e-6)
    assert (sim >= 0).all()
    if direction == "cosine":
        n = q.norm(dim=-1, keepdim=True)
        a = (q / n).abs().pow(3.0 * (0.5 + torch.tanh(n)))
        assert_close("norm of the lift", a.norm(dim=-1), phi_q.norm(dim=-1), 1e-6)


def test_cosine_mode_tends_to_relu_split_as_alpha_grows():
    q, k, v = qkv(n=40, d=16)
    split = nala_attention(q, k, v, direction="relu_split")
    err_lo = (nala_attention(q, k, v, alpha=20.0) - split).norm()
    err_hi = (nala_attention(q, k, v, alpha=1e5) - split).norm()
    assert err_hi < 1e-3 * split.norm() and err_hi < err_lo


@pytest.mark.parametrize("attn", ["nala", "relu", "elu"])
def test_rows_non_negative_and_sum_to_one(attn):
    """Rows sum to 1 − N·ε/(Σ_j sim + N·ε) exactly (§3), i.e. to 1 within ε."""
    q, k, v = qkv(n=64, d=16)
    if attn == "nala":
        _, w = nala_attention_reference(q, k, v, return_weights=True)
        sim = nala_similarity_reference(q, k)
    else:
        _, w = linear_attention_reference(q, k, v, kernel=attn, return_weights=True)
        phi = (lambda x: torch.relu(x)) if attn == "relu" else (lambda x: torch.nn.functional.elu(x) + 1)
        sim = phi(q) @ phi(k).transpose(-2, -1)
    assert (w >= 0).all()
    n, eps = 64, 1e-6
    expected = 1 - n * eps / (sim.sum(-1) + n * eps)
    torch.testing.assert_close(w.sum(-1), expected, atol=1e-6, rtol=0)
    assert (1 - expected).max() < 1e-3  # "1 within ε" at this scale


def mean_row_entropy(w):
    return -(w * w.clamp_min(1e-30).log()).sum(-1).mean().item()


def test_query_norm_acts_as_inverse_temperature():
    """Spec §5: scaling ‖q‖ with directions fixed sharpens NaLa rows, not ReLU/ELU rows."""
    q, k, v = qkv(n=128, d=32, seed=3)
    q = q / q.norm(dim=-1, keepdim=True)
    nala = [mean_row_entropy(nala_attention_reference(q * s, k, v, return_weights=True)[1])
            for s in (0.05, 0.5, 1.0, 3.0)]
    assert all(a > b for a, b in zip(nala, nala[1:])), nala
    assert nala[0] - nala[-1] > 0.1
    for kernel in ("relu", "elu"):
        ent = [mean_row_entropy(linear_attention_reference(q * s, k, v, kernel=kernel, return_weights=True)[1])
               for s in (0.05, 0.5, 1.0, 3.0)]
        if kernel == "relu":  # exactly scale-invariant
            assert max(ent) - min(ent) < 1e-4, ent
        else:  # 1+ELU is not homogeneous, but still far less sensitive than NaLa
            assert max(ent) - min(ent) < 0.5 * (nala[0] - nala[-1]), (ent, nala)


@pytest.mark.parametrize("direction", ["cosine", "relu_split"])
@pytest.mark.parametrize("case", ["zeros", "huge"])
def test_no_nan_for_zero_or_huge_inputs(direction, case):
    q, k, v = qkv(n=33, d=16, requires_grad=False)
    if case == "zeros":
        q, k = torch.zeros_like(q), torch.zeros_like(k)
        q[:, :, ::2] = torch.randn_like(q[:, :, ::2])  # mix zero and non-zero tokens
    else:
        q, k, v = q * 1e3, k * 1e3, v * 1e3
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = nala_attention(q, k, v, direction=direction)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(g).all() for g in grads)


def test_bf16_autocast_keeps_fp32_inside_and_stays_finite():
    q, k, v = qkv(n=65, d=32, scale=30.0)  # |k|^3 would overflow fp16 well before this
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        phi_q, phi_k = nala_features(qb, kb)
        out = nala_attention(qb, kb, vb)
    assert phi_q.dtype == phi_k.dtype == torch.float32
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    grads = torch.autograd.grad(out.float().sum(), (qb, kb, vb))
    assert all(torch.isfinite(g).all() for g in grads)
    # bf16 inputs, fp32 math: close to the fp32 reference on the same rounded inputs.
    ref = nala_attention_reference(qb.float(), kb.float(), vb.float())
    assert_close("bf16 vs fp32 reference", ref, out.float(), 1e-2)


def test_memory_is_linear_in_tokens():
    """N = 16384: an N×N fp32 matrix per head would need 1 GiB; NaLa needs a few MB."""
    n, d = 16384, 64
    q, k, v = (torch.randn(1, 1, n, d) for _ in range(3))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = nala_attention(q, k, v)
    peak_alloc = max(e.cpu_memory_usage for e in prof.key_averages())
    assert out.shape == (1, 1, n, d)
    assert peak_alloc < 64 * 2**20, f"largest single op allocation {peak_alloc / 2**20:.1f} MiB"
    assert n * n * 4 > 16 * peak_alloc


def test_bad_shapes_and_options_name_the_argument():
    q, k, v = qkv(n=8, d=4)
    with pytest.raises(ValueError, match="q must be a 4-D tensor"):
        nala_attention(q[0], k, v)
    with pytest.raises(ValueError) as err:
        nala_attention(q, k[..., :2], v)
    assert_names(err, "q and k", "same shape", "(2, 3, 8, 4)", "(2, 3, 8, 2)")
    with pytest.raises(ValueError, match="direction must be one of"):
        nala_attention(q, k, v, direction="sine")
    with pytest.raises(ValueError, match="num_heads=5 must divide"):
        GatedLinearAttention(32, 5)
    with pytest.raises(ValueError, match="attention must be one of"):
        build_attention("flash", 32, 4)
    layer = GatedLinearAttention(32, 4)
    with pytest.raises(ValueError, match="LePE needs the token grid"):
        layer(torch.randn(1, 16, 32), grid=(3, 5))


def test_gated_layer_matches_spec_section_4():
    """The layer equals the §4 recipe written out by hand around the reference attention."""
    torch.manual_seed(0)
    c, heads, grid = 32, 4, (3, 5)
    layer = GatedLinearAttention(c, heads)
    x = torch.randn(2, 15, c)
    q, k, v, g = layer.qkvg(x).chunk(4, dim=-1)
    split = lambda t: t.reshape(2, 15, heads, c // heads).transpose(1, 2)
    o = nala_attention_reference(split(q), split(k), split(v)).transpose(1, 2).reshape(2, 15, c)
    o = o + layer.lepe(v.transpose(1, 2).reshape(2, c, *grid)).flatten(2).transpose(1, 2)
    expected = layer.proj(layer.out_norm(o) * torch.nn.functional.silu(g))
    assert_close("gated layer", expected, layer(x, grid), FP32_TOL)


@pytest.mark.parametrize("autocast", [False, True])
def test_lepe_weight_gradient_has_the_parameter_strides(autocast):
    """DDP copies, and warns about ("Grad strides do not match bucket view strides"), every
    gradient whose strides differ from its parameter's. The LePE conv runs on a channels-last
    view of the tokens, which without care gives its (C, 1, 5, 5) weight a (25, 1, 5, 1)
    gradient; is_contiguous() ignores the size-1 dim, so compare the strides themselves.
    Under bf16 autocast the weight's cast must not carry the conv's layout back either."""
    torch.manual_seed(0)
    layer = GatedLinearAttention(32, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = layer(torch.randn(2, 15, 32), grid=(3, 5))
    out.float().square().sum().backward()
    for p in layer.parameters():
        assert p.grad.stride() == p.stride(), (p.shape, p.grad.stride(), p.stride())


def test_layer_switches_change_the_parameters():
    full = GatedLinearAttention(32, 4)
    bare = GatedLinearAttention(32, 4, lepe=False, gate=False, out_norm=False)
    assert full.qkvg.out_features == 128 and bare.qkvg.out_features == 96
    assert bare.lepe is None and bare.out_norm is None
    x = torch.randn(1, 16, 32)
    assert torch.isfinite(bare(x)).all()  # no grid needed without LePE
    assert set(dict(SoftmaxAttention(32, 4).named_parameters())) == {
        "qkv.weight", "qkv.bias", "proj.weight", "proj.bias"}
