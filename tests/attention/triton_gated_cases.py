"""The gated NaLa layer on the Triton path (``attention/nala/triton/gated.py``), run by
``tests/attention/test_triton_gated.py`` in a subprocess with ``TRITON_INTERPRET=1``, or
directly on CUDA:

    TRITON_INTERPRET=1 python -m pytest -q tests/attention/triton_gated_cases.py    # CPU, interpreter

Each case holds the layer's output and the gradients of its input and of every parameter
against the plain autograd composition (``recompute=False``: NaLa's eager composition,
``F.conv2d``, ``F.layer_norm``, ``F.silu``) of the same layer. Sizes are tiny: the
interpreter runs every program in Python.
"""
import os
import warnings

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)

import nala_dit.attention.layers as layers  # noqa: E402
import nala_dit.attention.nala.backend as nala  # noqa: E402
from nala_dit.attention.nala.triton import gated as triton_gated  # noqa: E402
from nala_dit.attention.layers import GatedLinearAttention  # noqa: E402
from nala_dit.attention.nala.backend import select_nala_impl, triton_available  # noqa: E402  (before any patch)
from tests.utils import assert_close, record_results  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


# NaLa's first-use checks (real kernels, 67 and 1,031 tokens) under the patched selection:
# once per key for this module, as a process runs them, not once per test.
_NALA_CHECKS: dict = {}


@pytest.fixture
def on_triton(monkeypatch):
    """What ``impl="auto"`` picks on CUDA, here on the interpreter too, for the layer under
    test (the plain reference keeps its own choice: ``layers_pair``); the fused middle's uses
    counted."""
    monkeypatch.setattr(nala, "select_nala_impl", lambda *a: "triton")
    monkeypatch.setattr(nala, "_TRITON_CHECKS", _NALA_CHECKS)
    monkeypatch.setattr(layers, "_GATED_CHECKS", {})
    monkeypatch.setattr(layers, "gated_triton_passes_check", lambda *a: True)   # its own tests below
    calls = []
    apply = triton_gated.TritonGatedMiddle.apply
    monkeypatch.setattr(triton_gated.TritonGatedMiddle, "apply", lambda *a: calls.append(1) or apply(*a))
    return calls


def layers_pair(dim, heads, seed=0, reference_impl=None, **overrides):
    """(the layer under test, its plain composition). The plain one runs NaLa on what
    ``impl="auto"`` picks unpatched (the fused CPU path under the interpreter, the Triton
    kernels on CUDA), so the Triton layer is held against another implementation of NaLa;
    ``reference_impl`` names another."""
    torch.manual_seed(seed)
    fused = GatedLinearAttention(dim, heads, **overrides).to(DEVICE)
    for name, p in fused.named_parameters():   # away from the initial values (LayerNorm 1/0, zero biases);
        if p.dim() == 1 and name != "log_norm_scale":  # a learned s keeps its own (s ≈ ‖q‖, as it starts)
            torch.nn.init.normal_(p, std=0.3)
    plain = GatedLinearAttention(dim, heads, recompute=False, **overrides).to(DEVICE)
    plain.load_state_dict(fused.state_dict())
    plain.backend = lambda q: (reference_impl or select_nala_impl(q.device.type, q.shape[-1], q.dtype,
                                                                  triton_available(), q.shape[-2]), False)
    return fused, plain


def run(layer, x, grid, grad, dtype):
    x = x.clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=dtype, enabled=dtype != torch.float32):
        y = layer(x, grid)
    y.float().backward(grad)
    return [y.float(), x.grad] + [p.grad for p in layer.parameters()]


def compare(fused, plain, grid, dtype=torch.float32, batch=2, seed=1):
    n = grid[0] * grid[1]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n, fused.proj.in_features, generator=g).to(DEVICE)
    grad = torch.randn(batch, n, fused.proj.in_features, generator=g).to(DEVICE)
    got, want = run(fused, x, grid, grad, dtype), run(plain, x, grid, grad, torch.float32)
    names = ["output", "x"] + [name for name, _ in fused.named_parameters()]
    for name, w, o in zip(names, want, got):
        assert o is not None, f"no gradient for {name}"
        assert_close(name, w, o, TOL[dtype])


# (9, 8) at width 80: 72 tokens, two token ranges of the LePE backward (64 + 8) and two
# channel blocks (64 + 16).
@pytest.mark.parametrize("grid, heads, dim", [((3, 5), 2, 32), ((1, 1), 1, 16), ((2, 3), 2, 128), ((4, 4), 2, 144),
                                              ((9, 8), 5, 80)])
def test_fp32_matches_the_plain_composition(on_triton, grid, heads, dim):
    fused, plain = layers_pair(dim, heads)
    compare(fused, plain, grid)
    assert len(on_triton) == 1


def test_several_token_ranges_add_into_the_buffer_the_last_epilogue_zeroed(on_triton, monkeypatch):
    """Several token ranges (as N ≥ 1,024 runs on a GPU; 2 of 64 on 5 × 13 tokens): the first call zeroes
    its state buffer, the second adds into the one the first's epilogue zeroed, a third of
    another batch size zeroes its own; each equals the plain composition."""
    monkeypatch.setattr(triton_gated, "num_splits", lambda *a: 3)
    monkeypatch.setattr(triton_gated, "_ZEROED", {})
    taken = record_results(monkeypatch, triton_gated, "_take_zeroed",
                           lambda buf: None if buf is None else (buf.numel(), bool(buf.any())))
    fused, plain = layers_pair(32, 2)
    for batch in (2, 2, 1):
        compare(fused, plain, (5, 13), batch=batch)
    assert len(on_triton) == 3
    # (numel, any nonzero) of the buffer each forward took: the second call's, zeroed by the first's epilogue
    assert taken == [None, (2 * 2 * 2 * 16 * 17, False), None]


@pytest.mark.parametrize("dim,grid,keep_features", [(128, (3, 4), True), (32, (2, 3), False)])
def test_bf16_autocast(on_triton, monkeypatch, dim, grid, keep_features):
    """bf16 autocast, head dims 64 and 16: NaLa's kernels store φ_q and φ_k for the backward
    (the default) or, with the layer's ``keep_features=False``, recompute them."""
    kept = record_results(monkeypatch, triton_gated, "feature_buffers", lambda out: out is not None)
    fused, plain = layers_pair(dim, 2, keep_features=keep_features)
    compare(fused, plain, grid, torch.bfloat16)
    assert len(on_triton) == 1 and kept == [keep_features]


def test_relu_split(on_triton):
    fused, plain = layers_pair(32, 2, direction="relu_split")
    compare(fused, plain, (2, 3))
    assert len(on_triton) == 1


def test_learned_scale(on_triton):
    """The reference runs NaLa on the same Triton kernels (``reference_impl``): the gradient
    of s sums per-token terms of both signs, so two fp32 NaLa implementations differ there by
    up to ~3e-5 relative (measured), while the fused layer and the plain composition over the
    same kernels agree to rounding."""
    fused, plain = layers_pair(32, 2, reference_impl="triton", norm_scale="learned")
    compare(fused, plain, (2, 3))
    assert len(on_triton) == 1


@pytest.mark.parametrize("overrides", [dict(lepe=False), dict(gate=False), dict(out_norm=False), dict(rope=True)])
def test_other_layers_keep_the_unfused_middle(on_triton, overrides):
    fused, plain = layers_pair(32, 2, **overrides)
    compare(fused, plain, (2, 3))
    assert on_triton == []


def test_first_use_check_passes_once_per_key(monkeypatch):
    monkeypatch.setattr(nala, "select_nala_impl", lambda *a: "triton")
    monkeypatch.setattr(layers, "_GATED_CHECKS", {})
    fused, plain = layers_pair(32, 2)
    compare(fused, plain, (2, 3))
    assert list(layers._GATED_CHECKS.values()) == [None]


def test_a_wrong_fused_middle_falls_back_once_with_a_warning(monkeypatch):
    """An injected fault (the fused middle's output doubled) fails the first-use check: one
    warning naming the cause, and the layer gives the plain composition's numbers."""
    monkeypatch.setattr(nala, "select_nala_impl", lambda *a: "triton")
    monkeypatch.setattr(layers, "_GATED_CHECKS", {})
    apply = triton_gated.TritonGatedMiddle.apply
    monkeypatch.setattr(triton_gated.TritonGatedMiddle, "apply", lambda *a: 2 * apply(*a))
    fused, plain = layers_pair(32, 2)
    with pytest.warns(RuntimeWarning, match="first-use check .* output differs from the plain composition"):
        compare(fused, plain, (2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no second warning: the cause is kept for the process
        compare(fused, plain, (2, 3), seed=2)
    assert len(layers._GATED_CHECKS) == 1 and list(layers._GATED_CHECKS.values())[0].startswith("output")
