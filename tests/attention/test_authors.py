"""The NaLa authors' released layer (ZacharyMeng/NaLaFormer, ``NormAwareLinearAttn``) as
``NaLaConfig.authors()`` builds it, and both RoPE angle layouts (NALA_SPEC.md §7): the angle
tables against their closed form, and the authors' variant against a quadratic reference
written here from the released formula (outputs and gradients, fp32 relative RMS ≤ 1e-5)."""

import math

import pytest
import torch

from nala_dit.attention import GatedLinearAttention, NaLaConfig, nala_attention, rope_angles
from tests.utils import assert_close

FP32_TOL = 1e-5


def closed_form_angles(h, w, head_dim, layout, base=10000.0):
    """(h·w, head_dim) angles, one per channel pair of the 2·head_dim-wide feature, from the formula."""
    table = []
    for r in range(h):
        for c in range(w):
            if layout == "released":       # D/4 frequencies 1/base^linspace(0, 1, D/4), per D-wide half
                k = head_dim // 4
                f = [1.0 / base ** (m / (k - 1) if k > 1 else 0.0) for m in range(k)]
                half = [r * x for x in f] + [c * x for x in f]
                table.append(half + half)
            else:                          # D/2 frequencies base^(-m/(D/2)) over the whole 2D-wide feature
                k = head_dim // 2
                f = [base ** (-m / k) for m in range(k)]
                table.append([r * x for x in f] + [c * x for x in f])
    return torch.tensor(table, dtype=torch.float64)


@pytest.mark.parametrize("layout", ["halves", "released"])
@pytest.mark.parametrize("head_dim", [4, 8, 24])
def test_rope_angle_tables_equal_their_closed_form(layout, head_dim):
    got = rope_angles((3, 5), 2 * head_dim, layout=layout)
    assert got.shape == (15, head_dim) and got.dtype == torch.float32
    assert_close(f"{layout} angles", closed_form_angles(3, 5, head_dim, layout).float(), got, 1e-6)


def test_rope_layouts_differ_and_halves_is_the_default():
    assert NaLaConfig().rope_layout == "halves"
    assert torch.equal(rope_angles((4, 4), 32), rope_angles((4, 4), 32, layout="halves"))
    assert not torch.allclose(rope_angles((4, 4), 32), rope_angles((4, 4), 32, layout="released"))
    with pytest.raises(ValueError, match="rope_layout must be one of"):
        NaLaConfig(rope=True, rope_layout="theirs")
    with pytest.raises(ValueError, match="head dim divisible by 4"):
        rope_angles((2, 2), 12, layout="released")                     # D = 6


def test_authors_preset_is_the_released_layer():
    c = NaLaConfig.authors()
    assert (c.kernel, c.direction, c.power, c.offset, c.norm_scale, c.lepe, c.gate, c.out_norm, c.rope,
            c.rope_layout, c.regions) == ("nala", "relu_split", 3.0, 0.5, 1.0, True, True, True, True,
                                          "released", 1)
    assert NaLaConfig.authors(rope=False).rope is False


def test_the_authors_layer_reaches_models_flags_and_the_shipped_config(capsys):
    """``create_model(name, **NaLaConfig.authors().model_options())`` builds that layer in every
    block; the shipped config and the flag triple resolve to it; ``--help-all`` names it."""
    from nala_dit.cli.config import resolve
    from nala_dit.cli.options import MODEL_OPTIONS, TrainConfig
    from nala_dit.models.dit import create_model
    from tests.utils import ROOT
    import train

    authors = NaLaConfig.authors()
    assert NaLaConfig.from_model("nala", **authors.model_options()) == authors   # round trip
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, **authors.model_options())
    assert {block.attn.config for block in model.blocks} == {authors}
    flags = ["--direction", "relu_split", "--rope", "true", "--rope-layout", "released"]
    for argv in (["--config", str(ROOT / "configs" / "digits_nala_dit_authors.yaml")], ["--model", "NaLaDiT-T/2", *flags]):
        cfg, _ = resolve(TrainConfig, argv)
        given = {key: getattr(cfg, key) for key in MODEL_OPTIONS if getattr(cfg, key) is not None}
        assert NaLaConfig.from_model("nala", **given) == authors, argv
    with pytest.raises(SystemExit):
        train.main(["--help-all"])
    help_all = " ".join(capsys.readouterr().out.split())
    assert "relu_split with --rope true --rope-layout released: the layer of the authors' released code, " \
           "NaLaConfig.authors()" in help_all
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`NaLaConfig.authors()`, flags `--direction relu_split --rope true --rope-layout released`" in readme


def released_reference(q, k, v, grid, rope=True, eps=1e-6):
    """The released NaLa attention, quadratic, in float64, from its formula: k ← k³; features
    [relu(q)/‖q‖, relu(−q)/‖q‖]^(3(0.5 + tanh‖q‖)) and [relu(k), relu(−k)]; each D-wide half
    rotated per channel pair by the released angles (numerator only);
    o_i = (1/N) Σ_j ⟨R_i φq_i, R_j φk_j⟩ v_j / (φq_i · mean_j φk_j + ε). ‖q‖ clamped at 1e-6."""
    q, k, v = q.double(), k.double(), v.double()
    d = q.shape[-1]
    norm = q.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    p = 3 * (0.5 + torch.tanh(norm))
    phi_q = torch.cat([(q.clamp_min(0) / norm) ** p, ((-q).clamp_min(0) / norm) ** p], dim=-1)
    k3 = k ** 3
    phi_k = torch.cat([k3.clamp_min(0), (-k3).clamp_min(0)], dim=-1)
    theta = closed_form_angles(*grid, d, "released") * (1.0 if rope else 0.0)   # (N, D) pairs
    cos, sin = theta.cos().repeat_interleave(2, -1), theta.sin().repeat_interleave(2, -1)

    def rotate(x):   # (x_2m, x_2m+1) -> (x_2m cos - x_2m+1 sin, x_2m+1 cos + x_2m sin)
        swapped = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
        return x * cos + swapped * sin

    n = q.shape[-2]
    num = rotate(phi_q) @ rotate(phi_k).transpose(-2, -1) / n                      # (B, H, N, N)
    den = phi_q @ phi_k.mean(-2, keepdim=True).transpose(-2, -1) + eps
    return (num / den) @ v


def _leaves(seed, d, n):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, n, d, generator=g).requires_grad_() for _ in range(3)]


def _compare(name, out, leaves, ref, ref_leaves):
    assert_close(name, ref.float(), out, FP32_TOL)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
    for i, (g_ref, g) in enumerate(zip(ref_grads, grads)):
        assert_close(f"{name}: grad {i}", g_ref.float(), g, FP32_TOL)


@pytest.mark.parametrize("head_dim", [8, 16])
def test_authors_layer_with_rope_equals_the_released_formula(head_dim):
    """The layer's attention under ``NaLaConfig.authors()`` (rope: the eager numerator-only
    path, the one code path rope has) against the quadratic released formula."""
    grid = (5, 7)
    q, k, v = _leaves(3, head_dim, 35)
    layer = GatedLinearAttention(2 * head_dim, 2, NaLaConfig.authors())
    out = layer.attend(q, k, v, grid)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _compare("authors rope", out, [q, k, v], released_reference(*ref_leaves, grid), ref_leaves)


@pytest.mark.parametrize("impl", ["fused", "eager"])
def test_authors_kernel_without_rope_equals_the_released_formula_on_every_path(impl):
    """Without rope the authors' settings run NaLa's kernels (fused, eager; Triton's own
    relu_split cases are in triton_cases.py): identity rotation in the released formula."""
    q, k, v = _leaves(4, 16, 35)
    out = nala_attention(q, k, v, NaLaConfig.authors(rope=False), impl=impl)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _compare(f"authors {impl}", out, [q, k, v], released_reference(*ref_leaves, (5, 7), rope=False), ref_leaves)


def test_default_layout_keeps_older_rope_configs_unchanged():
    """A config that does not name rope_layout (saved before the option) gets "halves", the
    layout rope had before: the same angles, and a rope model rebuilt from its config without
    the key gives the same outputs; "released" gives others."""
    from nala_dit.models.dit import create_model
    from nala_dit.training.checkpoint import build_model_from_config

    assert NaLaConfig.from_model("nala", rope=True).rope_layout == "halves"
    assert_close("halves", closed_form_angles(4, 6, 12, "halves").float(), rope_angles((4, 6), 24), 1e-6)
    torch.manual_seed(0)
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, rope=True).eval()
    for p in model.parameters():   # past adaLN-Zero's zero init, so attention reaches the output
        p.data.normal_(0, 0.05)
    old = {k: v for k, v in dict(model.config).items() if k != "rope_layout" and not k.startswith("_")}
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([3, 700]), torch.tensor([1, 4])
    with torch.no_grad():
        out = model(x, t, y)
        for layout, same in ((None, True), ("released", False)):
            rebuilt = build_model_from_config({**old, **({"rope_layout": layout} if layout else {})}).eval()
            rebuilt.load_state_dict(model.state_dict(), strict=True)
            assert torch.equal(rebuilt(x, t, y), out) is same, layout
