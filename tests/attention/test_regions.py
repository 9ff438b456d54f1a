"""Region states (``--nala-regions``) and Mix-FFN (``--mlp mix``): exact against explicit references."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train as train_cli
from nala_dit.attention import GatedLinearAttention, nala_attention
from nala_dit.attention.nala.fused import fused_output
from nala_dit.attention.regions import (
    initial_region_logits,
    region_attention_reference,
    region_bounds,
    region_layout,
    region_nala_attention,
    remap_region_logits,
)
from nala_dit.models.dit import DiT, MixMlp, Mlp, count_params
from nala_dit.training.convert import inherit
from tests.utils import TINY, assert_close, assert_names, dry_run_error


def _qkv(grid, heads=2, dim=8, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1]
    return [torch.randn(batch, heads, n, dim, generator=g, dtype=torch.float64) for _ in range(3)]


def _logits(regions, heads, seed=1):
    g = torch.Generator().manual_seed(seed)
    r2 = regions * regions
    return initial_region_logits(regions, heads).double() + 0.5 * torch.randn(heads, r2, r2, generator=g,
                                                                              dtype=torch.float64)


def test_bands_and_layout_follow_the_floor_rule():
    assert region_bounds(8, 2) == [0, 4, 8]
    assert region_bounds(7, 3) == [0, 2, 4, 7]          # uneven: bands of 2, 2, 3 rows
    assert region_bounds(9, 4) == [0, 2, 4, 6, 9]
    order, region, sizes = region_layout((7, 9), 3)
    assert sizes == (6, 6, 6, 6, 6, 6, 9, 9, 9)           # rows 2/2/3 × columns 3/3/3
    grid = region.reshape(7, 9)
    assert grid[0, 0] == 0 and grid[1, 2] == 0 and grid[2, 3] == 4 and grid[6, 8] == 8 and grid[3, 8] == 5
    assert torch.equal(region[order], region.sort().values)           # order groups tokens by region
    assert torch.equal(order, torch.argsort(region, stable=True))


@pytest.mark.parametrize("impl", ["fused", "eager"])
@pytest.mark.parametrize("grid,regions", [((8, 8), 2), ((7, 9), 3), ((9, 6), 4), ((12, 12), 4), ((5, 11), 2)])
def test_outputs_and_gradients_equal_the_fp64_reference(grid, regions, impl):
    q, k, v = _qkv(grid)
    rho = _logits(regions, 2)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, rho)]
    ref = region_attention_reference(*ref_in[:3], grid, regions, ref_in[3])
    got_in = [t.float().clone().requires_grad_() for t in (q, k, v, rho)]
    got = region_nala_attention(*got_in[:3], grid, got_in[3], regions=regions, impl=impl)
    assert got.dtype == torch.float32
    assert_close("output", ref, got, 1e-5)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    got.backward(grad.float())
    for name, a, b in zip(("dq", "dk", "dv", "d_logits"), ref_in, got_in):
        assert_close(name, a.grad, b.grad, 1e-5)


def test_equal_weights_are_plain_nala_and_r1_is_plain_nala_bitwise():
    q, k, v = (t.float() for t in _qkv((6, 6)))
    plain = nala_attention(q, k, v)
    assert_close("w = 1", plain, region_nala_attention(q, k, v, (6, 6), torch.zeros(2, 9, 9), regions=3), 1e-6)
    torch.manual_seed(0)
    base = GatedLinearAttention(16, 2)
    torch.manual_seed(0)
    one = GatedLinearAttention(16, 2, regions=1)
    assert base.state_dict().keys() == one.state_dict().keys()
    x = torch.randn(2, 36, 16)
    assert torch.equal(base(x, (6, 6)), one(x, (6, 6)))


def test_fresh_weights_decay_with_region_distance():
    w = initial_region_logits(2, 3).exp()
    assert w.shape == (3, 4, 4)
    assert torch.allclose(w.diagonal(dim1=1, dim2=2), torch.ones(3, 4))
    assert w[0, 0, 1].item() == pytest.approx(torch.tensor(-0.5).exp().item())     # a neighbour: half a side
    assert w[0, 0, 3].item() == pytest.approx(torch.tensor(-0.5 * 2 ** 0.5).exp().item())  # the diagonal


def test_layer_with_regions_runs_through_the_gated_layer_and_learns_its_weights():
    layer = GatedLinearAttention(16, 2, regions=2)
    assert layer.region_logits.shape == (2, 4, 4)
    x = torch.randn(2, 35, 16)
    layer(x, (5, 7)).square().sum().backward()
    assert layer.region_logits.grad is not None and layer.region_logits.grad.abs().sum() > 0
    ref = GatedLinearAttention(16, 2, regions=2, recompute=False)
    ref.load_state_dict(layer.state_dict())
    assert_close("recompute vs plain composition", ref(x, (5, 7)), layer(x, (5, 7)), 1e-6)


def test_model_state_dict_round_trip_and_parameter_count():
    model = DiT(**TINY, attention="nala", nala_regions=2).eval()
    plain = DiT(**TINY, attention="nala")
    assert count_params(model) == count_params(plain) + TINY["depth"] * TINY["num_heads"] * 16
    with torch.no_grad():
        for block in model.blocks:
            block.attn.region_logits.normal_()
    again = DiT.from_config(model.config).eval()
    again.load_state_dict(model.state_dict())
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 2])
    assert torch.equal(model(x, t, y), again(x, t, y))
    assert again.config.nala_regions == 2


def test_fine_tune_rule_keeps_the_function_when_r_grows_by_a_whole_factor():
    torch.manual_seed(0)
    x, t, y = torch.randn(2, 4, 16, 16), torch.tensor([3, 500]), torch.tensor([1, 2])
    size = dict(TINY, input_size=16)
    source = DiT(**size, attention="nala").eval()
    with torch.no_grad():   # leave adaLN-Zero's zeros, so the attention matters to the output
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.requires_grad)    # pos_embed is recomputed, not copied
    two = DiT(**size, attention="nala", nala_regions=2).eval()
    inherit(two, source.state_dict(), "all")
    assert all(torch.equal(b.attn.region_logits, torch.zeros(2, 4, 4)) for b in two.blocks)
    assert_close("R 1 -> 2", source(x, t, y), two(x, t, y), 1e-5)
    with torch.no_grad():
        for block in two.blocks:
            block.attn.region_logits.normal_()
    four = DiT(**size, attention="nala", nala_regions=4).eval()
    inherit(four, two.state_dict(), "all")
    assert_close("R 2 -> 4", two(x, t, y), four(x, t, y), 1e-5)
    # Another grid, the same R: the logits are copied as they are (regions are image fractions).
    small = DiT(**TINY, attention="nala", nala_regions=4)
    inherit(small, four.state_dict(), "all")
    assert all(torch.equal(a.attn.region_logits, b.attn.region_logits) for a, b in zip(small.blocks, four.blocks))


def test_remap_takes_the_region_holding_each_new_centre():
    rho = torch.arange(16.0).reshape(1, 4, 4)                      # R = 2
    four = remap_region_logits(rho, 4)
    # new region 5 = (row 1, col 1) lies in old region 0; new region 15 in old region 3
    assert four[0, 5, 15] == rho[0, 0, 3] and four[0, 15, 5] == rho[0, 3, 0] and four[0, 2, 8] == rho[0, 1, 2]
    assert torch.equal(remap_region_logits(four, 2), rho)           # back down: the same numbers


@pytest.mark.parametrize("kwargs,message", [
    (dict(attention="nala", nala_regions=5), "use at most 4 regions per side at this size"),
    (dict(attention="relu", nala_regions=2), "applies to NaLa attention"),
    (dict(attention="softmax", nala_regions=2), "applies to NaLa attention"),
    (dict(attention="nala", nala_regions=0), "must be an integer >= 1"),
    (dict(attention="nala", mlp="conv"), "mlp must be one of"),
])
def test_bad_region_and_mlp_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        DiT(**TINY, **kwargs)(torch.randn(1, 4, 8, 8), torch.tensor([1]), torch.tensor([1]))
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ Mix-FFN


def test_mix_ffn_parameter_count_is_exact():
    for attention in ("softmax", "nala"):
        plain = DiT(**TINY, attention=attention)
        mix = DiT(**TINY, attention=attention, mlp="mix")
        hidden = 4 * TINY["hidden_size"]
        assert count_params(mix) - count_params(plain) == TINY["depth"] * (9 * hidden + hidden)
        assert set(mix.state_dict()) - set(plain.state_dict()) == {
            f"blocks.{i}.mlp.dwconv.{p}" for i in range(TINY["depth"]) for p in ("weight", "bias")}


def test_mix_ffn_known_answer_for_a_hand_set_conv():
    mlp = MixMlp(2, 2)
    with torch.no_grad():
        mlp.fc1.weight.copy_(torch.eye(2))
        mlp.fc1.bias.zero_()
        mlp.dwconv.weight.fill_(1.0)                        # a 3x3 box sum per channel, zero padding
        mlp.dwconv.bias.copy_(torch.tensor([0.5, -1.0]))
        mlp.fc2.weight.copy_(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
        mlp.fc2.bias.zero_()
    h, w = 3, 4
    x = torch.arange(2 * h * w, dtype=torch.float32).reshape(1, h * w, 2) / 10
    image = x[0].reshape(h, w, 2)
    box = torch.zeros(h, w, 2)
    for i in range(h):
        for j in range(w):
            box[i, j] = image[max(0, i - 1):i + 2, max(0, j - 1):j + 2].sum((0, 1))
    act = F.gelu(box + torch.tensor([0.5, -1.0]), approximate="tanh").reshape(h * w, 2)
    expected = torch.stack([act[:, 0], act[:, 0] + act[:, 1]], -1)
    assert torch.allclose(mlp(x, (h, w))[0], expected, atol=1e-6)


def test_mix_ffn_with_an_identity_conv_is_the_plain_mlp_and_inheritance_sets_it():
    torch.manual_seed(0)
    plain = DiT(**TINY, attention="nala").eval()
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.requires_grad)
    mix = DiT(**TINY, attention="nala", mlp="mix").eval()
    inherit(mix, plain.state_dict(), "all")
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 2])
    assert_close("identity conv", plain(x, t, y), mix(x, t, y), 1e-6)
    assert isinstance(plain.blocks[0].mlp, Mlp) and not isinstance(plain.blocks[0].mlp, MixMlp)


# --------------------------------------------------------------- with the rest of the repo


@pytest.mark.parametrize("name,sampler", [("NaLaDiT-T/2", "ddim"), ("NaLaSiT-T/2", "ode-euler")])
def test_pipelines_round_trip_regions_mix_and_hybrid_at_another_size(tmp_path, name, sampler):
    from nala_dit.models.dit import create_model
    from nala_dit.pipelines.pipeline import load_pipeline, pipeline_for

    torch.manual_seed(0)
    model = create_model(name, input_size=8, in_channels=1, num_classes=3, nala_regions=2, mlp="mix",
                         softmax_blocks="0")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.requires_grad)
    pipe = pipeline_for(model.eval())
    pipe.set_progress_bar_config(disable=True)
    kw = dict(class_labels=[1, 2], num_inference_steps=2, generator=7, output_type="np", sampler=sampler,
              height=12, width=16)                          # a 6 x 8 token grid: uneven 2 x 2 regions
    before = pipe(**kw).images
    assert before.shape == (2, 12, 16, 1) and before.std() > 0
    pipe.save_pretrained(tmp_path)
    loaded = load_pipeline(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    config = loaded.transformer.config
    assert (config.nala_regions, config.mlp, config.softmax_blocks) == (2, "mix", [0])
    np.testing.assert_array_equal(loaded(**kw).images, before)


def test_conversion_from_a_softmax_dit_into_regions_and_mix():
    """``--init-from`` a softmax DiT (LiT's recipe): the trunk is copied, the NaLa attention
    (with its region weights) is new, and a Mix-FFN conv the teacher lacks starts at identity."""
    torch.manual_seed(0)
    teacher = DiT(**TINY, attention="softmax")
    student = DiT(**TINY, attention="nala", nala_regions=2, mlp="mix")
    fresh = student.blocks[0].attn.region_logits.detach().clone()
    report = inherit(student, teacher.state_dict(), "all-but-attention")
    assert torch.equal(student.blocks[0].mlp.fc1.weight, teacher.blocks[0].mlp.fc1.weight)
    assert torch.equal(student.blocks[0].attn.region_logits, fresh)        # new: the distance init
    kernel = student.blocks[1].mlp.dwconv.weight
    assert kernel[:, 0, 1, 1].eq(1).all() and kernel.abs().sum() == kernel.shape[0]
    assert any(key.endswith("mlp.dwconv.weight") for key, _, _ in report.rows)


@pytest.mark.parametrize("grid,regions", [((8, 8), 2), ((7, 9), 3), ((12, 10), 4)])
def test_forward_without_gradients_runs_the_fused_passes_and_agrees(grid, regions, monkeypatch):
    import nala_dit.attention.regions as regions_mod

    q, k, v = (t.float() for t in _qkv(grid))
    rho = _logits(regions, 2).float()
    ref = region_attention_reference(*(t.double() for t in (q, k, v)), grid, regions, rho.double())
    calls = []
    monkeypatch.setattr(regions_mod, "fused_output", lambda *a, **kw: calls.append(1) or fused_output(*a, **kw))
    with torch.no_grad():
        got = region_nala_attention(q, k, v, grid, rho, regions=regions)
    assert len(calls) == 1             # every region is one "head" of a single query pass
    assert_close("no-grad output", ref, got, 1e-5)


@pytest.mark.parametrize("text,value", [("1e9", "1000000000"), ("1_000", "1000"), ("100", "100")])
def test_nala_regions_out_of_bound_is_one_line_in_yaml_and_flags(tmp_path, capsys, text, value):
    (tmp_path / "c.yaml").write_text(f"model: NaLaDiT-T/2\nnala-regions: {text}\n")
    line = dry_run_error(capsys, "--config", str(tmp_path / "c.yaml"))
    assert_names(line, f"nala-regions {value} ", "more than 16 regions per side", "H·R⁴", "use 2 to 16")
    if text == "100":
        assert "100,000,000 at R = 100;" in dry_run_error(capsys, "--model", "NaLaDiT-T/2", "--nala-regions", "100")


def test_nala_regions_against_the_grid_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    from nala_dit.training import loop as training

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before --nala-regions was checked against the grid")

    monkeypatch.setattr(training, "build_model", no_build)
    code = train_cli.main(["--model", "NaLaDiT-T/2", "--data", "digits", "--nala-regions", "5", "--num-workers", "0",
                           "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert_names(err, "error: ", "nala-regions 5", "token grid is 4x4", "use at most 4 regions")


def test_nala_regions_in_an_edited_stored_config_is_one_line(tmp_path, capsys):
    """A run's ``state.json`` and a pipeline's ``transformer/config.json`` with R = 10⁹:
    refused before any region weight is made (10⁹⁴ · H numbers per layer)."""
    import json

    import export
    import sample
    from nala_dit.training import checkpoint as ckpt_lib
    from tests.scripts.test_sample import FAST, write_checkpoint

    run = write_checkpoint(tmp_path / "run", nala_regions=2)
    pipe = tmp_path / "pipe"
    assert export.main(["checkpoint", str(run), str(pipe)]) == 0
    state_file = ckpt_lib.find_checkpoint(run) / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state["model_config"]["nala_regions"] = 10 ** 9
    state_file.write_text(json.dumps(state))
    config_file = pipe / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "nala_regions": 10 ** 9}))
    capsys.readouterr()
    for where, file in ((run, state_file), (pipe, config_file)):
        assert sample.main(["--ckpt", str(where), "--labels", "1", *FAST, "--grid", str(tmp_path / "g.png")]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert_names(err, str(file), "nala-regions 1000000000 ", "more than 16 regions per side",
                     "1.0e+36 at R = 1000000000", "use 2 to 16")
