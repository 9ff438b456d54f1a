"""The hybrid layer schedule: DiT's softmax layer in chosen blocks of a linear-attention model."""

import pytest
import torch

from nala_dit.cli.config import resolve
from nala_dit.cli.options import TrainConfig, parse_softmax_blocks
from nala_dit.models.dit import DiT, count_params, create_model
from nala_dit.training.convert import inherit
from tests.utils import TINY, assert_names

DEEP = dict(TINY, depth=4)
C = DEEP["hidden_size"]


def test_schedule_forms_resolve_to_block_indices():
    assert parse_softmax_blocks("every:4", 4) == [3]
    assert parse_softmax_blocks("every:4", 12) == [3, 7, 11]
    assert parse_softmax_blocks("every:2", 4) == [1, 3]
    assert parse_softmax_blocks("2,0,2", 4) == [0, 2]
    assert parse_softmax_blocks(3, 4) == parse_softmax_blocks([3], 4) == [3]
    assert parse_softmax_blocks("none", 4) is parse_softmax_blocks(None, 4) is parse_softmax_blocks([], 4) is None


@pytest.mark.parametrize("value,words", [
    ("every:1", ("every:1", "plain softmax model")),
    ("every:x", ("'every:K'", "must be an integer")),
    ("every:5", ("larger than the depth 4",)),
    ("4", ("block 4 does not exist", "use indices 0..3")),
    ("-1", ("block -1 does not exist",)),
    ("0,1,2,3", ("all 4 blocks softmax",)),
    ("last", ("last", "not a schedule", "use 'every:K'")),
    (True, ("not a schedule",)),
])
def test_bad_schedules_are_one_line_errors(value, words):
    with pytest.raises(ValueError) as err:
        parse_softmax_blocks(value, 4)
    assert "\n" not in str(err.value)
    assert_names(err, *words)


def test_hybrid_blocks_have_the_official_softmax_names_and_the_exact_count():
    nala = create_model("NaLaDiT-T/2", **DEEP)
    softmax = create_model("DiT-T/2", **DEEP)
    hybrid = create_model("NaLaDiT-T/2", softmax_blocks="every:4", **DEEP)
    assert hybrid.config.softmax_blocks == [3]                    # recorded resolved
    names = {k for k, _ in hybrid.named_parameters()}
    assert {"blocks.3.attn.qkv.weight", "blocks.3.attn.qkv.bias", "blocks.3.attn.proj.weight",
            "blocks.3.attn.proj.bias"} == {k for k in names if k.startswith("blocks.3.attn.")}
    for i in range(3):
        assert {k for k in names if k.startswith(f"blocks.{i}.")} == \
               {k for k, _ in nala.named_parameters() if k.startswith(f"blocks.{i}.")}
    block = lambda model, i: sum(p.numel() for p in model.blocks[i].parameters())  # noqa: E731
    assert count_params(hybrid) == count_params(nala) - block(nala, 3) + block(softmax, 3)
    # Closed form of the swap: DiT's attention is qkv (3C² + 3C) + proj (C² + C).
    softmax_attn = sum(p.numel() for p in hybrid.blocks[3].attn.parameters())
    assert softmax_attn == 4 * C * C + 4 * C
    assert count_params(hybrid) == count_params(nala) - sum(p.numel() for p in nala.blocks[3].attn.parameters()) \
        + softmax_attn
    every2 = create_model("NaLaDiT-T/2", softmax_blocks="every:2", **DEEP)
    assert count_params(every2) == 2 * block(nala, 0) + 2 * block(softmax, 0) + \
        count_params(nala) - sum(block(nala, i) for i in range(4))


def test_hybrid_rebuilds_from_its_config_and_round_trips(tmp_path):
    torch.manual_seed(0)
    hybrid = create_model("NaLaDiT-T/2", attention="relu", softmax_blocks="0,2", **DEEP)
    hybrid.save_pretrained(tmp_path)
    back = DiT.from_pretrained(tmp_path, low_cpu_mem_usage=False)
    assert back.config.softmax_blocks == [0, 2]
    assert [type(b.attn).__name__ for b in back.blocks] == ["SoftmaxAttention", "GatedLinearAttention"] * 2
    ours, theirs = hybrid.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # An old config without the key builds the plain model (the default: no softmax block).
    plain = DiT(**{k: v for k, v in dict(hybrid.config).items() if not k.startswith("_") and k != "softmax_blocks"})
    assert plain.config.softmax_blocks is None and all(hasattr(b.attn, "qkvg") for b in plain.blocks)


def test_softmax_teacher_fills_the_hybrid_softmax_blocks():
    """all-but-attention copies the softmax blocks' attention too (the same layer), so the
    student's block 3 computes exactly what the teacher's block 3 does."""
    torch.manual_seed(1)
    teacher = create_model("DiT-T/2", **DEEP)
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    student = create_model("NaLaDiT-T/2", softmax_blocks="every:4", **DEEP)
    fresh = {k: v.clone() for k, v in student.state_dict().items()}
    report = inherit(student, teacher.state_dict(), "all-but-attention")
    source, after = teacher.state_dict(), student.state_dict()
    for key, value in after.items():
        linear_attn = ".attn." in key and not key.startswith("blocks.3.")
        own = linear_attn or key == "pos_embed"         # the position table is recomputed, never copied
        assert torch.equal(value, fresh[key] if own else source[key]), key
    assert report.counts()["dropped"][0] == 4 * 3        # qkv/proj weight+bias of the 3 NaLa blocks
    x, c = torch.randn(2, 16, C), torch.randn(2, C)
    assert torch.equal(student.blocks[3](x, c, (4, 4)), teacher.blocks[3](x, c, (4, 4)))


def test_cli_flag_and_inapplicable_uses(capsys):
    cfg, _ = resolve(TrainConfig, ["--model", "NaLaDiT-T/2", "--softmax-blocks", "every:4"])
    assert cfg.softmax_blocks == "every:4"
    for argv, message in [(["--model", "NaLaDiT-T/2", "--softmax-blocks", "every:8"], "K is larger than the depth 4"),
                          (["--model", "DiT-T/2", "--softmax-blocks", "every:4"],
                           "--softmax-blocks applies to the gated layer")]:
        with pytest.raises(SystemExit):
            resolve(TrainConfig, argv)
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and message in errors[0]
    with pytest.raises(ValueError, match="needs a linear-attention model"):
        DiT(**DEEP, attention="softmax", softmax_blocks=[1])
