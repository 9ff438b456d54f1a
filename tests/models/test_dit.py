"""The DiT/SiT backbone: exact DiT parity, presets, CFG, save/load, bad input."""

import functools

import pytest
import torch

from nala_dit.models.dit import MODELS, DiT, count_flops, count_params, create_model
from nala_dit.models.grid import sincos_pos_embed_2d
from tests.utils import TINY, assert_close, assert_names

# The DiT paper's numbers: learned σ, 1000 classes, 256 px (32×32 latents).
PAPER_PARAMS = {
    "S/2": 32.96e6, "S/4": 32.95e6, "S/8": 33.15e6,
    "B/2": 130.51e6, "B/4": 130.48e6, "B/8": 130.88e6,
    "L/2": 458.10e6, "L/4": 458.05e6, "L/8": 458.59e6,
    "XL/2": 675_129_632, "XL/4": 675.07e6, "XL/8": 675.68e6,
}


@pytest.mark.parametrize("size", list(PAPER_PARAMS))
def test_softmax_presets_have_the_paper_parameter_counts(size):
    with torch.device("meta"):
        model = MODELS[f"DiT-{size}"]()
    n = count_params(model)
    if size == "XL/2":
        assert n == 675_129_632
    else:  # the table gives 2 decimals in millions
        assert abs(n - PAPER_PARAMS[size]) < 0.005e6, n


# (depth, width, heads), written out here rather than read from options.SIZES, so the test
# pins the table too. G: the size of Hunyuan-DiT's DiT-g/2 and DiT-MoE's G (arXiv 2405.08748,
# 2407.11633); H: Sana's width and heads (arXiv 2410.10629) at SANA-1.5's 30-block depth
# (arXiv 2501.18427); both in DiT's block, with one dense MLP.
SIZES_BY_HAND = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16),
                 "G": (40, 1408, 16), "H": (30, 2240, 20)}
# The patch-2 counts, once more as numbers (docs/models.md prints them).
PAST_XL = {
    "DiT-G/2": 1_436_371_232, "NaLaDiT-G/2": 1_517_303_072, "SiT-G/2": 1_436_348_688, "NaLaSiT-G/2": 1_517_280_528,
    "DiT-H/2": 2_729_072_672, "NaLaDiT-H/2": 2_881_549_472, "SiT-H/2": 2_729_036_816, "NaLaSiT-H/2": 2_881_513_616,
}


def hand_count(depth: int, hidden: int, heads: int, patch: int, in_channels: int = 4, num_classes: int = 1000,
               mlp_ratio: float = 4.0, input_size: int = 32, learn_sigma: bool = True, nala: bool = False) -> int:
    """A preset's parameters summed layer by layer from its sizes, without the model code:
    DiT's embedders and final layer, and per block the attention, the MLP and adaLN-Zero.
    The heads split the width and add no parameters (NaLa's defaults: a fixed norm scale, one
    region), so they enter only as a divisibility check."""
    c, h = hidden, int(hidden * mlp_ratio)
    assert c % heads == 0, (hidden, heads)
    out = 2 * in_channels if learn_sigma else in_channels
    embed = (in_channels * patch * patch * c + c)                # x_embedder: conv, kernel = stride = patch
    embed += (input_size // patch) ** 2 * c                      # pos_embed: the frozen sin-cos table
    embed += (256 * c + c) + (c * c + c)                         # t_embedder: 256 frequencies → C → C
    embed += (num_classes + 1) * c                               # y_embedder: the classes + the null label
    if nala:   # qkvg (the gate is the 4th projection), LePE's 5×5 depthwise conv + bias, LayerNorm, proj
        attn = (4 * c * c + 4 * c) + (25 * c + c) + 2 * c + (c * c + c)
    else:      # qkv, proj
        attn = (3 * c * c + 3 * c) + (c * c + c)
    mlp = (c * h + h) + (h * c + c)                               # fc1, fc2
    adaln = c * 6 * c + 6 * c                                     # SiLU → Linear(C, 6C)
    final = (c * patch * patch * out + patch * patch * out) + (c * 2 * c + 2 * c)  # linear, adaLN(C, 2C)
    return embed + depth * (attn + mlp + adaln) + final


def test_hand_count_reproduces_the_published_counts():
    """The formula is checked where the counts are known: the DiT paper's XL/2 (675,129,632) and
    docs/models.md's NaLaDiT-XL/2 (713.22M), SiT-XL/2 (675,111,184), SiT-S/2 and NaLaSiT-S/2."""
    assert hand_count(28, 1152, 16, 2) == 675_129_632
    assert hand_count(28, 1152, 16, 2, nala=True) == 713_223_968
    assert hand_count(28, 1152, 16, 2, learn_sigma=False) == 675_111_184
    assert hand_count(12, 384, 6, 2, learn_sigma=False) == 32_957_200
    assert hand_count(12, 384, 6, 2, learn_sigma=False, nala=True) == 34_860_304
    for size, n in PAPER_PARAMS.items():   # S/B/L/XL × 2/4/8 to the paper's two decimals
        (depth, hidden, heads), patch = SIZES_BY_HAND[size.split("/")[0]], int(size.split("/")[1])
        assert abs(hand_count(depth, hidden, heads, patch) - n) < 0.005e6, size


@pytest.mark.parametrize("size", ["G", "H"])
@pytest.mark.parametrize("family", ["DiT", "NaLaDiT", "SiT", "NaLaSiT"])
def test_presets_past_xl_have_the_hand_count(family, size):
    """Built on the meta device: no memory, a fraction of a second per preset. Patch 2 also at
    1024 px (128×128 latents), the size of configs/nala_*_imagenet1024_fsdp.yaml, whose headers
    print that count: the frozen 64×64 position table adds 3,840 · width."""
    from nala_dit.attention.config import TRITON_MAX_HEAD_DIM

    depth, hidden, heads = SIZES_BY_HAND[size]
    assert hidden // heads <= TRITON_MAX_HEAD_DIM   # NaLa's fused kernels take the head dim
    for patch in (2, 4, 8):
        name = f"{family}-{size}/{patch}"
        with torch.device("meta"):
            model = create_model(name)
        assert (model.config.depth, model.config.hidden_size, model.config.num_heads) == (depth, hidden, heads)
        n = count_params(model)
        assert n == hand_count(depth, hidden, heads, patch, learn_sigma=not family.endswith("SiT"),
                               nala=family.startswith("NaLa")), name
        if patch == 2:
            assert n == PAST_XL[name]
            with torch.device("meta"):
                big = count_params(create_model(name, input_size=128))
            assert big == n + 3840 * hidden == hand_count(depth, hidden, heads, patch, input_size=128,
                                                          learn_sigma=not family.endswith("SiT"),
                                                          nala=family.startswith("NaLa")), name
    low, high = {"G": (1.4e9, 1.5e9), "H": (2.7e9, 2.8e9)}[size]   # "about 1.5B" and "about 3B"
    assert low < PAST_XL[f"DiT-{size}/2"] < high


# Patch 1 on an f16/f32 tokenizer's 32-channel 16×16 latents (DC-AE f32c32 at 512 px, an f16 KL at
# 256 px: 256 tokens); docs/models.md prints these counts.
PATCH_1 = {"S": (32_981_824, 34_884_928), "B": (130_549_312, 137_894_464), "L": (458_152_000, 484_030_528),
           "XL": (675_184_960, 713_279_296), "G": (1_436_438_848, 1_517_370_688),
           "H": (2_729_180_224, 2_881_657_024)}


@pytest.mark.parametrize("size", list(PATCH_1))
def test_patch_1_presets_have_the_hand_count(size):
    """Every size has a /1 preset; on 32-channel 16×16 latents (256 tokens) its parameters are the
    formula's (DiT at every size, NaLaSiT at S; built on the meta device), and docs/models.md's
    numbers (DiT and NaLaDiT)."""
    depth, hidden, heads = SIZES_BY_HAND[size]
    count = functools.partial(hand_count, depth, hidden, heads, 1, in_channels=32, input_size=16)
    built = (("DiT", False, True), ("NaLaSiT", True, False)) if size == "S" else (("DiT", False, True),)
    for family, nala, sigma in built:   # NaLa and SiT's half-width output once: the formula's terms are per size
        with torch.device("meta"):
            model = create_model(f"{family}-{size}/1", in_channels=32, input_size=16)
        assert model.config.patch_size == 1 and model.pos_embed.shape[1] == 256   # tokens
        assert count_params(model) == count(learn_sigma=sigma, nala=nala), family
    assert (count(), count(nala=True)) == PATCH_1[size]


@pytest.mark.slow
def test_flops_match_the_paper_for_s2_and_b2():
    # DiT paper Gflops are multiply-accumulates: 6.06 (S/2), 23.01 (B/2) at 256 px. B/2 on the
    # meta device (the count is of shapes; S/2 keeps the CPU path): its 130M weights' random init
    # was most of this test's time.
    assert abs(count_flops(create_model("DiT-S/2")) / 2e9 - 6.06) < 0.01
    with torch.device("meta"):
        base = create_model("DiT-B/2")
    assert abs(count_flops(base) / 2e9 - 23.01) < 0.01


def test_flops_of_a_bf16_model_equal_its_fp32_twins():
    """count_flops feeds the model's own dtype (bf16 weights with fp32 inputs failed in the
    GPU benchmark); the count does not depend on the dtype."""
    for name in ("DiT-S/2", "NaLaDiT-S/2"):
        model = create_model(name, input_size=8)
        fp32 = count_flops(model)
        assert fp32 > 0 and count_flops(model.to(torch.bfloat16)) == fp32, name


def test_families_differ_in_one_argument():
    with torch.device("meta"):
        dit, nala, sit, nalasit = (MODELS[f"{f}-S/2"]() for f in ("DiT", "NaLaDiT", "SiT", "NaLaSiT"))
    assert dit.config.attention == "softmax" and nala.config.attention == "nala"
    assert dit.out_channels == 8 and sit.out_channels == 4 and nalasit.out_channels == 4
    assert sit.config.objective == nalasit.config.objective == "transport"
    assert dit.config.objective == "diffusion"
    strip = lambda m: {k: v for k, v in m.config.items() if k != "attention"}
    assert strip(dit) == strip(nala)


def test_official_key_layout():
    with torch.device("meta"):
        keys = set(create_model("DiT-XL/2").state_dict())
    for key in ["pos_embed", "x_embedder.proj.weight", "t_embedder.mlp.0.weight", "t_embedder.mlp.2.bias",
                "y_embedder.embedding_table.weight", "blocks.0.attn.qkv.weight", "blocks.27.attn.proj.bias",
                "blocks.3.mlp.fc1.weight", "blocks.3.mlp.fc2.weight", "blocks.0.adaLN_modulation.1.weight",
                "final_layer.linear.weight", "final_layer.adaLN_modulation.1.bias"]:
        assert key in keys, key
    # pos_embed, x_embedder (2), t_embedder (4), y_embedder, 28 blocks × 10, final layer (4)
    assert len(keys) == 1 + 2 + 4 + 1 + 28 * 10 + 4


@pytest.mark.parametrize("name", ["DiT-T/2", "NaLaDiT-T/2", "SiT-T/2", "NaLaSiT-T/2"])
def test_untrained_output_is_exactly_zero(name):
    model = create_model(name, **{k: v for k, v in TINY.items() if k in ("input_size", "num_classes")})
    x = torch.randn(3, 4, 8, 8)
    out = model(x, torch.tensor([1.0, 500.0, 999.0]), torch.tensor([0, 3, 10]))
    assert out.shape == (3, model.out_channels, 8, 8)
    assert torch.equal(out, torch.zeros_like(out))


def perturbed(**kw):
    torch.manual_seed(0)
    model = DiT(**{**TINY, **kw}).eval()
    with torch.no_grad():  # break the zero init so outputs depend on the input
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def test_unpatchify_inverts_patchify_layout():
    model = perturbed()
    p, c = 2, model.out_channels
    img = torch.arange(2 * c * 8 * 8, dtype=torch.float32).reshape(2, c, 8, 8)
    tokens = img.reshape(2, c, 4, p, 4, p).permute(0, 2, 4, 3, 5, 1).reshape(2, 16, p * p * c)
    assert torch.equal(model.unpatchify(tokens, 4, 4), img)


@pytest.mark.parametrize("guide_channels", [None, 3])
def test_cfg_equals_manual_two_pass(guide_channels):
    model = perturbed()
    x = torch.randn(2, 4, 8, 8)
    t = torch.tensor([10.0, 10.0, 10.0, 10.0])
    y = torch.tensor([1, 7, 10, 10])
    xx = torch.cat([x, x])
    out = model.forward_with_cfg(xx, t, y, cfg_scale=4.0, guide_channels=guide_channels)
    cond = model(x, t[:2], y[:2])
    uncond = model(x, t[2:], y[2:])
    g = 4 if guide_channels is None else guide_channels
    guided = uncond[:, :g] + 4.0 * (cond[:, :g] - uncond[:, :g])
    assert_close("guided channels", guided, out[:2, :g], 1e-6)
    assert_close("unguided channels", cond[:, g:], out[:2, g:], 1e-6)
    assert torch.equal(out[:2, :g], out[2:, :g])


@pytest.mark.parametrize("attention", ["softmax", "nala", "relu", "elu"])
def test_save_load_round_trip_is_bit_exact(tmp_path, attention):
    model = perturbed(attention=attention)
    model.save_pretrained(tmp_path)
    loaded = DiT.from_pretrained(tmp_path).eval()
    assert not any(p.is_meta for p in loaded.parameters())
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3.0, 700.0]), torch.tensor([2, 10])
    assert torch.equal(model(x, t, y), loaded(x, t, y))
    assert loaded.config.attention == attention


def test_any_class_count_and_unconditional():
    model = perturbed(num_classes=1, class_dropout_prob=0.0)
    assert model.null_label is None and model.y_embedder.embedding_table.num_embeddings == 1
    cond = perturbed(num_classes=37)
    assert cond.null_label == 37 and cond.y_embedder.embedding_table.num_embeddings == 38


def test_other_grid_sizes_use_their_own_position_table():
    model = perturbed()
    assert torch.equal(model.position_embedding(model.grid(8, 8)), model.pos_embed)
    table = model.position_embedding(model.grid(4, 12))
    assert torch.equal(table[0], sincos_pos_embed_2d(32, 2, 6))
    out = model(torch.randn(1, 4, 4, 12), torch.tensor([5.0]), torch.tensor([1]))
    assert out.shape == (1, 8, 4, 12)


def test_position_table_closed_form():
    # Channel 0 of the first half is sin(col · 1) and of the second half sin(row · 1).
    table = sincos_pos_embed_2d(16, 3, 5).reshape(3, 5, 16)
    cols = torch.arange(5, dtype=torch.float32)
    rows = torch.arange(3, dtype=torch.float32)
    torch.testing.assert_close(table[1, :, 0], torch.sin(cols))
    torch.testing.assert_close(table[:, 2, 8], torch.sin(rows))
    torch.testing.assert_close(table[:, 2, 12], torch.cos(rows))


def test_gradient_checkpointing_gives_the_same_gradients():
    model = perturbed(attention="nala").train()
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3.0, 7.0]), torch.tensor([2, 4])
    torch.manual_seed(1)
    g1 = torch.autograd.grad(model(x, t, y).square().sum(), list(model.parameters())[1:])
    model.gradient_checkpointing = True
    torch.manual_seed(1)
    g2 = torch.autograd.grad(model(x, t, y).square().sum(), list(model.parameters())[1:])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="unknown model 'DiT-Q/2'; choose one of"):
        create_model("DiT-Q/2")
    with pytest.raises(ValueError, match="attention must be one of"):
        DiT(**{**TINY, "attention": "flash"})
    with pytest.raises(ValueError, match="input_size=9 must be divisible by patch_size=2"):
        DiT(**{**TINY, "input_size": 9})
    with pytest.raises(ValueError, match="num_heads=3 must divide hidden_size=32"):
        DiT(**{**TINY, "num_heads": 3})
    model = perturbed()
    with pytest.raises(ValueError, match="must be divisible by patch_size=2"):
        model(torch.randn(1, 4, 7, 8), torch.tensor([1.0]), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"x must be \(B, 4, H, W\)"):
        model(torch.randn(1, 3, 8, 8), torch.tensor([1.0]), torch.tensor([1]))


# --------------------------------------------------------------- Mix-FFN's start (--mix-init)


def test_softmax_mix_parameter_count_is_the_hand_count():
    """DiT-T/2 with DiT's softmax layer and Mix-FFN, as the study builds it (64-px canvas, 1
    channel, 10 classes + the null label), counted by hand: C = 128, 4 blocks, MLP hidden 4C."""
    c, depth, tokens = 128, 4, 32 * 32
    embed = (c * 1 * 2 * 2 + c) + tokens * c + (256 * c + c + c * c + c) + 11 * c   # patch, pos, t, y
    block = (3 * c * c + 3 * c) + (c * c + c)          # qkv, proj
    block += (c * 4 * c + 4 * c) + (4 * c * c + c)     # fc1, fc2
    block += 4 * c * 9 + 4 * c                         # Mix-FFN's 3x3 depthwise conv and its bias
    block += c * 6 * c + 6 * c                         # adaLN
    final = (c * 2 * 2 * 2 + 2 * 2 * 2) + (c * 2 * c + 2 * c)
    assert embed + depth * block + final == 1_424_392
    for init in ("default", "identity"):
        model = create_model("DiT-T/2", input_size=64, in_channels=1, num_classes=10, mlp="mix", mix_init=init)
        assert count_params(model) == 1_424_392


@pytest.mark.parametrize("attention", ["softmax", "softmax_gated", "nala"])
def test_identity_mix_ffn_is_dits_mlp_on_the_same_weights(attention):
    """Known answer: seeded alike, an identity-initialised Mix-FFN model holds exactly the plain
    model's weights (the identity conv draws no random numbers) plus a conv that is the identity
    (centre tap 1, the rest 0, bias 0), and computes the same function."""
    def build(**mlp):
        torch.manual_seed(3)
        model = DiT(**TINY, attention=attention, **mlp).eval()
        return model

    def perturb(model):   # leave adaLN-Zero's zeros, so the blocks (and their MLPs) do something
        torch.manual_seed(4)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".mlp.dwconv." not in name:
                    p.add_(0.05 * torch.randn_like(p) * p.requires_grad)
        return model

    plain, mix = build(), build(mlp="mix", mix_init="identity")
    ours = mix.state_dict()
    conv = {k: ours.pop(k) for k in list(ours) if ".mlp.dwconv." in k}
    assert ours.keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in ours.items())
    for i in range(TINY["depth"]):
        w, b = mix.state_dict()[f"blocks.{i}.mlp.dwconv.weight"], mix.state_dict()[f"blocks.{i}.mlp.dwconv.bias"]
        assert w.shape == (4 * TINY["hidden_size"], 1, 3, 3) and w.sum() == w.shape[0] and torch.all(w[:, 0, 1, 1] == 1)
        assert torch.all(b == 0)
    assert len(conv) == 2 * TINY["depth"]
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 2])
    assert_close("identity Mix-FFN vs MLP", perturb(plain)(x, t, y), perturb(mix)(x, t, y), 1e-6)
    # PyTorch's default init is random: the same seed gives another function.
    torch.manual_seed(3)
    assert not torch.equal(DiT(**TINY, attention=attention, mlp="mix").blocks[0].mlp.dwconv.bias, torch.zeros(4 * 32))


def test_mix_init_is_refused_without_mix_ffn():
    from nala_dit.cli.options import TrainConfig

    with pytest.raises(ValueError) as err:
        DiT(**TINY, mix_init="identity")
    assert_names(err, "mix_init='identity'", "mlp='mix'", "not to mlp='mlp'")
    with pytest.raises(ValueError) as err:
        DiT(**TINY, mlp="mix", mix_init="zeros")
    assert_names(err, "mix_init", "('default', 'identity')", "got 'zeros'")
    with pytest.raises(ValueError) as err:
        TrainConfig(model="DiT-T/2", mix_init="identity").validate()
    assert_names(err, "--mix-init identity", "Mix-FFN", "add --mlp mix", "drop --mix-init")


def test_create_model_takes_the_old_pos_embed_keyword_with_a_warning():
    """``create_model(pos_embed=...)`` (before ``positions=``) still builds the same model and says
    the new name; both at once is an error."""
    with pytest.warns(FutureWarning, match=r"create_model\(pos_embed=...\) is deprecated: the keyword is now "
                                           r"positions="):
        old = create_model("NaLaDiT-T/2", input_size=8, pos_embed="interpolate")
    assert old.config.positions == "interpolate"
    assert dict(old.config) == dict(create_model("NaLaDiT-T/2", input_size=8, positions="interpolate").config)
    with pytest.raises(TypeError, match="both pos_embed= and positions="):
        create_model("NaLaDiT-T/2", pos_embed="none", positions="none")
