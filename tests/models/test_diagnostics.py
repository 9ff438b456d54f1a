"""NaLa diagnostics: exponent statistics, saturated share and row entropy."""

import json
import math

import numpy as np
import torch

from nala_dit.attention import nala_attention_reference
from nala_dit.models.diagnostics import LayerStats, binned, collect
from nala_dit.models.dit import create_model


def test_saturated_share_known_answer():
    p = np.array([[4.5, 4.46, 4.45, 3.0], [4.44, 1.5, 4.499, 4.455]])   # λ(τ+1) = 4.5; 1 % below: 4.455
    st = LayerStats(0, q_norm=np.ones_like(p), exponent=p)
    assert st.saturated().tolist() == [0.5, 0.5]


def test_binned_means():
    x = np.arange(10.0)
    centers, means = binned(x, 2 * x, bins=2)
    assert np.allclose(centers, [2.0, 7.0]) and np.allclose(means, [4.0, 14.0])


def test_collect_matches_the_forward_and_the_reference():
    """The captured queries give the exponent the layer itself logs in the same forward,
    and the entropy is that of the reference weights; with s = 1 at init every token is
    saturated (T/2: D = 32, ‖q‖ ≈ 3.6, > 95 %), with a learned scale almost none is."""
    torch.manual_seed(0)
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([10, 900]), torch.tensor([1, 2])
    for mode, (low, high) in ((1.0, (0.95, 1.0)), ("learned", (0.0, 0.05))):
        model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, norm_scale=mode).eval()
        attn = model.blocks[0].attn
        attn.record_stats = True
        stats = collect(model, x, t, y)
        assert len(stats) == 4
        assert math.isclose(stats[0].exponent.mean(), attn.last_stats["exponent_mean"], rel_tol=1e-5)
        assert all(low <= s.saturated().mean() <= high for s in stats), mode
        ent = stats[0].entropy
        assert ent.shape == (4, 2 * 16) and (ent >= 0).all() and (ent <= math.log(16) + 1e-4).all()
    # Entropy of a hand-built layer input against the reference's weights.
    layer = model.blocks[0].attn
    tokens = torch.randn(1, 16, 128)
    b, n, c = tokens.shape
    q, k, v = (p.reshape(b, n, 4, 32).transpose(1, 2) for p in layer.qkvg(tokens).chunk(4, -1)[:3])
    s = layer.norm_scale()
    _, w = nala_attention_reference(q / s, k, v, return_weights=True)
    expected = -(w * w.log()).sum(-1)[0]                           # (H, N)
    stats = collect(_single_block(layer), tokens, None, None)
    assert np.allclose(stats[0].entropy, expected.detach().numpy(), atol=1e-5)


def test_sampled_rows_are_the_reference_rows():
    """``rows=R`` (the 4,096-token path) gives, for the sampled query positions, exactly
    the rows of the full quadratic reference, their ‖q‖ pairing, and a seeded choice."""
    torch.manual_seed(0)
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, norm_scale="sqrt_d").eval()
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([10, 500, 900]), torch.tensor([1, 2, 3])
    full = collect(model, x, t, y)
    part = collect(model, x, t, y, rows=5, seed=3)
    again = collect(model, x, t, y, rows=5, seed=3)
    for f, s in zip(full, part):
        rows = s.rows
        assert len(rows) == 5 and len(set(rows.tolist())) == 5 and (np.diff(rows) > 0).all()
        h = f.entropy.shape[0]
        expected = f.entropy.reshape(h, 3, 16)[:, :, rows].reshape(h, -1)
        assert s.entropy.shape == (4, 3 * 5)
        assert np.allclose(s.entropy, expected, rtol=1e-5, atol=1e-6)
        assert np.array_equal(s.entropy_q_norm, f.q_norm.reshape(h, 3, 16)[:, :, rows].reshape(h, -1))
        assert np.array_equal(s.exponent, f.exponent)              # every token still counted
        assert s.summary()["entropy_rows"] == 5 and f.summary()["entropy_rows"] == "all"
    assert all(np.array_equal(a.rows, b.rows) for a, b in zip(part, again))
    assert collect(model, x, t, y, rows=16)[0].rows is None        # R >= N: the full reference


class _single_block(torch.nn.Module):
    """A stand-in 'model' whose one block's attention sees the given tokens."""

    def __init__(self, attn):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Module()])
        self.blocks[0].attn = attn

    def forward(self, x, t, y):
        return self.blocks[0].attn(x, (4, 4))


def test_cli_writes_plots_and_json(digits_checkpoint, tmp_path):
    import experiments.ablation.diagnostics as cli

    assert cli.main(["--ckpt", str(digits_checkpoint), "--out", str(tmp_path), "--batch", "2"]) == 0
    report = json.loads((tmp_path / "diagnostics.json").read_text())
    assert len(report["layers"]) == 4 and report["step"] == 5
    for layer in report["layers"]:
        assert len(layer["saturated"]) == 4 and all(0 <= v <= 1 for v in layer["saturated"])
    for png in ("distributions.png", "entropy.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert report["tokens"] == 16 and report["entropy_rows"] == "all"
    assert cli.main(["--ckpt", str(digits_checkpoint), "--out", str(tmp_path / "r"), "--batch", "2", "--rows", "3"]) == 0
    report = json.loads((tmp_path / "r" / "diagnostics.json").read_text())
    assert report["entropy_rows"] == 3 and all(layer["entropy_rows"] == 3 for layer in report["layers"])
    assert cli.main(["--ckpt", str(digits_checkpoint), "--out", str(tmp_path / "bad"), "--rows", "0"]) == 2
    assert not (tmp_path / "bad").exists()                       # refused before anything is written
