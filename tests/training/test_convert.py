"""Linearising a softmax DiT/SiT: weight inheritance, distillation, train.py --init-from / --teacher."""

import json
from pathlib import Path

import pytest
import torch

import train as train_cli
from nala_dit.cli.config import to_dict
from nala_dit.cli.options import TrainConfig
from nala_dit.diffusion.gaussian import GaussianDiffusion
from nala_dit.models.dit import count_params, create_model
from nala_dit.training import checkpoint as ckpt_lib
from nala_dit.training.convert import Distiller, Reference, check_compatible, inherit
from tests.ranks import run_ranks, run_script
from tests.utils import assert_names, copy_tree, poison

ROOT = Path(__file__).resolve().parents[2]
DIGITS = dict(input_size=8, in_channels=1, num_classes=10)  # what train.py builds for --data digits
TINY_RUN = ["--model", "NaLaDiT-T/2", "--data", "digits", "--global-batch-size", "8", "--num-workers", "0",
            "--sample-every", "0", "--log-every", "1", "--flip", "false"]


def randomised(preset, seed=0, **overrides):
    """A model whose every tensor is random (adaLN-Zero would leave many exactly 0)."""
    torch.manual_seed(seed)
    model = create_model(preset, **{**DIGITS, **overrides})
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return model


def write_checkpoint(run_dir, model, preset, **config):
    """A train.py checkpoint of ``model`` (EMA = raw weights), without training."""
    cfg = {**to_dict(TrainConfig(model=preset)), **config}
    ckpt_lib.save_checkpoint(run_dir / "checkpoints", model=model, ema=model,
                             optimizer=torch.optim.AdamW(model.parameters()),
                             state=dict(step=1, epoch=0, position=0, world_size=1, config=cfg,
                                        model_config=dict(model.config)),
                             rng_states=[torch.get_rng_state()])
    return run_dir


def read_log(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("attention", ["nala", "relu"])
def test_all_but_attention_copies_exactly_the_reported_tensors(attention):
    teacher = randomised("DiT-T/2", seed=1)
    student = create_model("NaLaDiT-T/2", attention=attention, **DIGITS)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    report = inherit(student, teacher.state_dict(), "all-but-attention")
    after, source = student.state_dict(), teacher.state_dict()
    attn = [k for k in after if ".attn." in k]
    for key, value in after.items():
        # the position table is the student's own (a function of its grid), never copied
        expected = before[key] if ".attn." in key or key == "pos_embed" else source[key]
        assert torch.equal(value, expected), key
    counts = report.counts()
    kept = [k for k in after if k not in attn and k != "pos_embed"]
    assert counts["inherited"] == (len(kept), sum(source[k].numel() for k in kept))
    assert report.recomputed == [("pos_embed", after["pos_embed"].numel())]
    assert counts["new"] == (len(attn), sum(after[k].numel() for k in attn))
    assert counts["dropped"][0] == 4 * teacher.config.depth  # qkv and proj, weight and bias
    assert "blocks.*.attn.qkvg" in report.table() and "total" in report.table()


def test_attention_qkv_maps_qkv_rows_and_proj_and_zeroes_lepe():
    teacher = randomised("DiT-T/2", seed=2)
    student = create_model("NaLaDiT-T/2", **DIGITS)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    report = inherit(student, teacher.state_dict(), "attention-qkv")
    s, t, c = student.state_dict(), teacher.state_dict(), student.config.hidden_size
    for i in range(student.config.depth):
        pre = f"blocks.{i}.attn."
        for part in ("weight", "bias"):
            assert torch.equal(s[pre + f"qkvg.{part}"][:3 * c], t[pre + f"qkv.{part}"])
            assert torch.equal(s[pre + f"qkvg.{part}"][3 * c:], before[pre + f"qkvg.{part}"][3 * c:])  # gate: fresh
            assert torch.equal(s[pre + f"proj.{part}"], t[pre + f"proj.{part}"])
            assert not s[pre + f"lepe.{part}"].any()
            assert torch.equal(s[pre + f"out_norm.{part}"], before[pre + f"out_norm.{part}"])
    assert report.counts()["dropped"] == (0, 0)
    assert report.counts()["partial"] == (2 * student.config.depth,)


def test_sit_final_layer_keeps_the_prediction_channels():
    """SiT's released weights have DiT's 8 output channels; a 4-channel SiT student keeps the first 4."""
    teacher = randomised("SiT-T/2", seed=3, in_channels=4, learn_sigma=True)
    student = create_model("NaLaSiT-T/2", **{**DIGITS, "in_channels": 4})
    inherit(student, teacher.state_dict(), "all-but-attention")
    x = torch.randn(3, 5, teacher.config.hidden_size)
    p, c = 2, 4
    full = teacher.final_layer.linear(x).reshape(3, 5, p, p, 2 * c)[..., :c].reshape(3, 5, -1)
    assert torch.equal(student.final_layer.linear(x), full)


def test_official_xl2_state_dict_converts_with_the_expected_counts():
    """An official-layout DiT-XL/2 state dict (meta tensors: names and shapes, no memory)."""
    with torch.device("meta"):
        official = create_model("DiT-XL/2").state_dict()
        student = create_model("NaLaDiT-XL/2")
    assert sum(v.numel() for v in official.values()) == 675_129_632  # the DiT paper's count
    report = inherit(student, official, "all-but-attention")
    c, depth = 1152, 28
    softmax_attn = 4 * c * c + 4 * c                                   # qkv + proj
    nala_attn = (4 * c * c + 4 * c) + (25 * c + c) + 2 * c + (c * c + c)  # qkvg + lepe + LayerNorm + proj
    counts = report.counts()
    table = 256 * c                                                    # pos_embed: 16×16 tokens, recomputed
    assert counts["inherited"] == (292 - 4 * depth - 1, 675_129_632 - depth * softmax_attn - table)
    assert counts["new"] == (8 * depth, depth * nala_attn)
    assert counts["dropped"] == (4 * depth, depth * softmax_attn)
    assert counts["recomputed"] == (1, table)
    assert counts["inherited"][1] + counts["new"][1] + counts["recomputed"][1] == count_params(student)


@pytest.mark.parametrize("family", ["DiT", "SiT"])
def test_every_preset_pair_converts(family):
    """DiT-X/p → NaLaDiT-X/p and SiT-X/p (released with 8 output channels) → NaLaSiT-X/p, ReLU/ELU too."""
    from nala_dit.models.dit import MODELS

    for name in [n for n in MODELS if n.startswith(f"{family}-")]:
        with torch.device("meta"):
            source = create_model(name, learn_sigma=True).state_dict()
            dropped = sum(v.numel() for k, v in source.items() if ".attn." in k)
            if family == "SiT":  # the variance half of the released 8-channel final layer
                dropped += sum(v.numel() for k, v in source.items() if k.startswith("final_layer.linear.")) // 2
            for attention in ("nala", "relu", "elu") if name.endswith("XL/2") else ("nala",):
                student = create_model(f"NaLa{name}", attention=attention)
                counts = inherit(student, source).counts()
                assert counts["dropped"][1] == dropped, (name, attention)
                total = counts["inherited"][1] + counts["new"][1] + counts["recomputed"][1]
                assert total == count_params(student), (name, attention)
                assert counts["partial"] == (0,)


def test_shape_mismatch_names_the_keys():
    teacher = randomised("DiT-T/2", num_classes=7)
    student = create_model("NaLaDiT-T/2", **DIGITS)
    with pytest.raises(ValueError) as err:
        inherit(student, teacher.state_dict())
    assert_names(err, "y_embedder.embedding_table.weight", "source (8, 128)", "student (11, 128)")
    partial = {k: v for k, v in create_model("DiT-T/2", **DIGITS).state_dict().items() if ".mlp.fc" not in k}
    with pytest.raises(ValueError) as err:
        inherit(student, partial)
    assert_names(err, "16 mismatches", "blocks.0.mlp.fc1.weight", "missing from the source")
    with pytest.raises(ValueError) as err:
        inherit(student, teacher.state_dict(), "attention")
    assert_names(err, "--inherit 'attention'", "all-but-attention, attention-qkv")


@pytest.mark.parametrize("change, message", [
    (dict(preset="SiT-T/2"), "objective=transport vs diffusion"),
    (dict(num_classes=7), "num_classes=7 vs 10"),
    (dict(input_size=16), "input_size=16 vs 8"),
    (dict(preset="DiT-T/4"), "patch_size=4 vs 2"),
])
def test_incompatible_teacher_names_both_sides(change, message):
    preset = change.pop("preset", "DiT-T/2")
    ref = Reference(create_model(preset, **{**DIGITS, **change}), {}, "teacher-path", "checkpoint")
    with pytest.raises(ValueError, match=f"--teacher teacher-path .*{message}"):
        check_compatible(ref, create_model("NaLaDiT-T/2", **DIGITS), {}, "--teacher")
    other = Reference(create_model("DiT-T/2", **DIGITS), {"noise-schedule": "cosine"}, "t", "checkpoint")
    with pytest.raises(ValueError) as err:
        check_compatible(other, create_model("NaLaDiT-T/2", **DIGITS), {}, "--teacher")
    assert_names(err, "--teacher t", "noise-schedule=cosine vs linear", "a teacher trained on the same data")
    with pytest.raises(ValueError) as err:
        check_compatible(other, create_model("NaLaDiT-T/2", **DIGITS), {}, "--init-from")
    assert_names(err, "--init-from t", "noise-schedule=cosine vs linear",
                 "an --init-from model trained on the same data")


def test_student_equal_to_teacher_gives_zero_terms_and_grads_only_in_the_student():
    teacher = randomised("DiT-T/2", seed=4, class_dropout_prob=0.5)
    student = randomised("DiT-T/2", seed=4, class_dropout_prob=0.5).train()  # a softmax "student" = its teacher
    distiller = Distiller(teacher, student, weight=0.5, sigma_weight=None)
    assert distiller.sigma_weight == 0.05  # LiT's default when both learn the variance
    diffusion = GaussianDiffusion.from_schedule("linear", 1000)
    torch.manual_seed(0)
    x, y, t = torch.randn(16, 1, 8, 8), torch.arange(16) % 10, torch.randint(0, 1000, (16,))
    loss = diffusion.training_losses(distiller.watch(student), x, t, y)["loss"].mean()
    extra, terms = distiller.terms()
    # Exactly 0 only if the teacher saw the same noisy input, time and dropped labels (half are dropped).
    assert extra.item() == 0.0 and terms.tolist() == [0.0, 0.0]
    (loss + extra).backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)

    # A different student: the terms are the known mean squared errors, and their gradient reaches it.
    other = randomised("NaLaDiT-T/2", seed=5, class_dropout_prob=0.5).train()
    distiller = Distiller(teacher, other, weight=0.5, sigma_weight=0.05)
    drop = (torch.arange(16) % 2).long()
    distiller._last = (x, t.float(), y, drop, other(x, t.float(), y, force_drop_ids=drop))
    extra, terms = distiller.terms()
    with torch.no_grad():
        want, got = teacher(x, t.float(), y, force_drop_ids=drop), other(x, t.float(), y, force_drop_ids=drop)
    assert terms[0].item() == pytest.approx(((want[:, :1] - got[:, :1]) ** 2).mean().item(), rel=1e-5)
    assert terms[1].item() == pytest.approx(((want[:, 1:] - got[:, 1:]) ** 2).mean().item(), rel=1e-5)
    extra.backward()
    assert other.final_layer.linear.weight.grad.abs().sum() > 0


def test_init_from_official_pt_through_train_py(tmp_path, capsys):
    """An official-format .pt (a plain state dict): with lr 0 the saved student holds it bitwise."""
    teacher = randomised("DiT-T/2", seed=6)
    torch.save(teacher.state_dict(), tmp_path / "DiT-T-2.pt")
    argv = TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "conv", "--max-steps", "1",
                       "--ckpt-every", "1", "--lr", "0", "--init-from", str(tmp_path / "DiT-T-2.pt")]
    assert train_cli.main(argv) == 0
    assert "inheritance (all-but-attention)" in capsys.readouterr().out
    saved = ckpt_lib.open_checkpoint(tmp_path / "conv").weights("ema")
    for key, value in teacher.state_dict().items():
        if ".attn." not in key and key != "pos_embed":
            assert torch.equal(saved[key], value), key
    assert torch.equal(saved["pos_embed"], create_model("NaLaDiT-T/2", **DIGITS).pos_embed)  # recomputed, not copied
    # The converted run is an ordinary NaLaDiT run: sample.py and the pipeline export take it.
    import export
    import sample

    assert sample.main(["--ckpt", str(tmp_path / "conv"), "--labels", "1,2", "--sampler", "ddim", "--steps", "2",
                        "--grid", str(tmp_path / "grid.png")]) == 0
    assert (tmp_path / "grid.png").is_file()
    assert export.main(["checkpoint", str(tmp_path / "conv"), str(tmp_path / "pipe")]) == 0
    from nala_dit.pipelines.pipeline import load_pipeline

    pipe = load_pipeline(tmp_path / "pipe")
    assert pipe.transformer.config.attention == "nala"
    assert len(pipe(class_labels=[3], num_inference_steps=2, generator=0).images) == 1


def test_checkpoint_and_pipeline_folder_sources(tmp_path):
    """A run folder and its exported pipeline give the same teacher with its objective settings."""
    import export
    from nala_dit.training.convert import load_reference, objective_settings

    teacher = randomised("DiT-T/2", seed=10)
    run = write_checkpoint(tmp_path / "run", teacher, "DiT-T/2", **{"noise-schedule": "cosine"})
    assert export.main(["checkpoint", str(run), str(tmp_path / "pipe")]) == 0
    student = create_model("NaLaDiT-T/2", **DIGITS)
    for path, kind in ((run, "checkpoint"), (tmp_path / "pipe", "pipeline")):
        ref = load_reference(path, student, "NaLaDiT-T/2")
        assert ref.kind == kind and not ref.model.training
        loaded = ref.model.state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in teacher.state_dict().items()), kind
        assert objective_settings("diffusion", ref.objective_config)["noise-schedule"] == "cosine", kind


def test_bad_conversion_inputs_give_clear_errors(tmp_path, capsys):
    relu = write_checkpoint(tmp_path / "relu", randomised("NaLaDiT-T/2", attention="relu"), "NaLaDiT-T/2",
                            attention="relu")
    sit = write_checkpoint(tmp_path / "sit", randomised("SiT-T/2"), "SiT-T/2")

    def fails(*extra, words):
        code = train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "bad", "--max-steps", "1",
                                          *extra])
        assert code == 1
        assert_names(capsys.readouterr().err, *words)

    fails("--init-from", str(relu), words=("relu-attention model", "its own attention", "softmax DiT/SiT"))
    fails("--teacher", str(sit), words=("objective=transport vs diffusion",))
    fails("--init-from", str(tmp_path / "DiT-XL-2-256x256.pt"),
          words=(f"{tmp_path / 'DiT-XL-2-256x256.pt'}", "not found",
                 "https://dl.fbaipublicfiles.com/DiT/models/DiT-XL-2-64x64.pt"))
    fails("--init-from", str(tmp_path / "nowhere"),
          words=(f"{tmp_path / 'nowhere'}", "no official .pt", "run folder", "pipeline folder"))
    fails("--teacher", str(sit), "--model", "NaLaSiT-T/2", "--distill-sigma-weight", "0.05",
          words=("--distill-sigma-weight 0.05", "learn_sigma on both", "set it to 0"))
    with pytest.raises(SystemExit):
        train_cli.main(TINY_RUN + ["--inherit", "attention"])
    assert "invalid choice: 'attention'" in capsys.readouterr().err


def test_teacher_with_zero_weights_leaves_training_bitwise_unchanged(tmp_path):
    """The teacher shares the student's label dropout draw instead of making its own: with
    zero weights a distillation run is the inheritance-only run, bit for bit."""
    write_checkpoint(tmp_path / "teacher", randomised("DiT-T/2", seed=11), "DiT-T/2")
    common = TINY_RUN + ["--results-dir", str(tmp_path), "--max-steps", "3", "--ckpt-every", "3",
                         "--init-from", str(tmp_path / "teacher")]
    assert train_cli.main(common + ["--exp-name", "plain"]) == 0
    assert train_cli.main(common + ["--exp-name", "zero", "--teacher", str(tmp_path / "teacher"),
                                    "--distill-weight", "0", "--distill-sigma-weight", "0"]) == 0
    a, b = (ckpt_lib.open_checkpoint(tmp_path / name).weights("model") for name in ("plain", "zero"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(r["loss_distill"] > 0 for r in read_log(tmp_path / "zero"))  # the teacher did run


def test_sit_student_distils_the_velocity(tmp_path):
    """NaLaSiT from a SiT teacher released DiT-style with 8 output channels: velocity term only."""
    write_checkpoint(tmp_path / "teacher", randomised("SiT-T/2", seed=12, learn_sigma=True), "SiT-T/2")
    argv = TINY_RUN + ["--model", "NaLaSiT-T/2", "--results-dir", str(tmp_path), "--exp-name", "sit",
                       "--max-steps", "2", "--ckpt-every", "2", "--init-from", str(tmp_path / "teacher"),
                       "--teacher", str(tmp_path / "teacher")]
    assert train_cli.main(argv) == 0
    for record in read_log(tmp_path / "sit"):
        assert record["loss_distill"] > 0 and record["loss_distill_sigma"] == 0
        assert record["loss"] == pytest.approx(record["loss_simple"] + 0.5 * record["loss_distill"], rel=1e-6)


@pytest.mark.slow
def test_distillation_lowers_the_teacher_student_gap(tmp_path):
    """The same student recipe with and without the teacher term: only the former tracks the teacher."""
    teacher = randomised("DiT-T/2", seed=7)
    write_checkpoint(tmp_path / "teacher", teacher, "DiT-T/2")
    common = ["--results-dir", str(tmp_path), "--max-steps", "30", "--ckpt-every", "30", "--log-every", "30",
              "--global-batch-size", "16", "--lr", "2e-3", "--class-dropout-prob", "0"]
    gaps = {}
    for name, extra in (("plain", []), ("distil", ["--teacher", str(tmp_path / "teacher"), "--distill-weight", "1"])):
        assert train_cli.main(TINY_RUN + common + ["--exp-name", name, *extra]) == 0
        student = ckpt_lib.load_model(tmp_path / name, "model")[0]
        torch.manual_seed(0)
        x, t, y = torch.randn(64, 1, 8, 8), torch.randint(0, 1000, (64,)).float(), torch.arange(64) % 10
        with torch.no_grad():
            gaps[name] = ((student(x, t, y) - teacher.eval()(x, t, y))[:, :1] ** 2).mean().item()
    assert read_log(tmp_path / "distil")[-1]["loss_distill"] > 0
    print(gaps)
    assert gaps["distil"] < 0.5 * gaps["plain"], gaps


@pytest.mark.slow
def test_two_process_distillation_resumes_bitwise(tmp_path):
    """accelerate, 2 CPU processes, grad accumulation, a teacher: 4 steps straight = resumed at 2 + 2 more."""
    write_checkpoint(tmp_path / "teacher", randomised("DiT-T/2", seed=8), "DiT-T/2")
    base = TINY_RUN + ["--results-dir", str(tmp_path), "--grad-accum", "2", "--teacher", str(tmp_path / "teacher"),
                       "--init-from", str(tmp_path / "teacher"), "--max-steps", "4", "--ckpt-every", "2"]
    for extra in (["--exp-name", "straight"],
                  ["--exp-name", "resumed", "--resume", str(tmp_path / "straight" / "checkpoints" / "0000002")]):
        # One launch per run: accelerate tears its process group down at the end of a run.
        proc = run_ranks(tmp_path, "train.py", *base, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a = ckpt_lib.open_checkpoint(tmp_path / "straight")
    b = ckpt_lib.open_checkpoint(tmp_path / "resumed")
    assert a.step == b.step == 4 and a.state["world_size"] == 2 and b.path.parent.parent.name == "resumed"
    for which in ("model", "ema"):
        wa, wb = a.weights(which), b.weights(which)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), which
    la, lb = read_log(tmp_path / "straight"), read_log(tmp_path / "resumed")
    assert [r["step"] for r in lb] == [3, 4]
    assert [(r["loss"], r["loss_distill"]) for r in la[2:]] == [(r["loss"], r["loss_distill"]) for r in lb]
    assert all(len(r["loss_per_rank"]) == 2 and r["loss_distill"] > 0 for r in la)


@pytest.mark.slow
def test_bf16_distillation_run(tmp_path):
    write_checkpoint(tmp_path / "teacher", randomised("DiT-T/2", seed=9), "DiT-T/2")
    # A process of its own: accelerate fixes the precision of its first Accelerator per process.
    proc = run_script(tmp_path, "train.py", *TINY_RUN, "--results-dir", tmp_path, "--exp-name", "bf16",
                      "--max-steps", "2", "--ckpt-every", "2", "--mixed-precision", "bf16", "--teacher", tmp_path / "teacher")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for record in read_log(tmp_path / "bf16"):
        assert all(torch.isfinite(torch.tensor(record[k])) for k in ("loss", "loss_distill", "loss_distill_sigma"))
        assert record["loss"] == pytest.approx(record["loss_simple"] + 0.5 * record["loss_distill"]
                                               + 0.05 * record["loss_distill_sigma"], rel=1e-6)


def test_init_from_help_names_both_uses():
    from nala_dit.cli.config import build_parser

    (action,) = [a for a in build_parser(TrainConfig)._actions if a.dest == "init_from"]
    for words in ("softmax DiT/SiT", "official .pt", "this repo's own runs, checkpoints or pipeline folders",
                  "up the ladder", "--init-from runs/demo/NaLaDiT --image-size 16 --pos-embed interpolate"):
        assert words in action.help, words


def test_init_from_a_smaller_source_names_the_model_size_to_pass(digits_checkpoint, tmp_path, capsys):
    """train.py's default preset is NaLaDiT-S/2; a T/2 source gets the --model to pass."""
    import train as train_cli

    code = train_cli.main(["--init-from", str(digits_checkpoint), "--data", "digits", "--image-size", "8",
                           "--max-steps", "1", "--num-workers", "0", "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1, err
    assert_names(err, "hidden_size=128 vs 384", "T/2-sized", "--model NaLaDiT-T/2", "--config")


def _source_run(path, **model_kwargs):
    """A train.py-style run folder: a NaLaDiT-T/2 on 8-px digits with ``model_kwargs``."""
    import torch

    from nala_dit.cli.config import to_dict
    from nala_dit.models.dit import create_model
    from nala_dit.training.checkpoint import save_checkpoint

    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, **model_kwargs)
    cfg = TrainConfig(model="NaLaDiT-T/2", data="digits", **{k: str(v) if k == "softmax_blocks" else v
                                                              for k, v in model_kwargs.items()})
    state = dict(step=1, epoch=0, position=1, world_size=1, config=to_dict(cfg), model_config=dict(model.config))
    save_checkpoint(path / "checkpoints", model=model, ema=model, state=state,
                    optimizer=torch.optim.AdamW(model.parameters()), rng_states=[torch.get_rng_state()])
    return path


@pytest.mark.parametrize("source,student,words", [
    (dict(mlp="mix"), {}, ("Mix-FFN", "blocks.*.mlp.dwconv, 20,480 numbers", "pass --mlp mix")),
    (dict(nala_regions=2), {}, ("2x2 region states", "blocks.*.attn.region_logits, 256 numbers",
                                "pass --nala-regions 2")),
    (dict(softmax_blocks="1,3"), {}, ("softmax blocks 1,3", "the student none", "pass --softmax-blocks 1,3")),
    ({}, dict(softmax_blocks="every:2"), ("no softmax blocks", "the student 1,3", "pass --softmax-blocks none")),
    (dict(lepe=True), dict(lepe=False), ("blocks.*.attn.lepe.bias", "blocks.*.attn.lepe.weight: 13,312 numbers",
                                         "dropped", "pass --lepe true")),
    (dict(softmax_blocks="1"), dict(softmax_blocks="3"), ("softmax blocks 1", "the student 3",
                                                          "pass --softmax-blocks 1")),
])
def test_init_from_a_structure_the_student_lacks_is_refused_naming_the_flag(tmp_path, source, student, words):
    from nala_dit.cli.config import to_dict
    from nala_dit.models.dit import create_model
    from nala_dit.training import convert

    run = _source_run(tmp_path / "src", **source)
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, **student)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = TrainConfig(model="NaLaDiT-T/2", data="digits")
    with pytest.raises(ValueError) as err:
        convert.init_from(str(run), model, "NaLaDiT-T/2", "all-but-attention", to_dict(cfg))
    assert "\n" not in str(err.value)
    assert_names(err, *words)
    assert all(v.equal(before[k]) for k, v in model.state_dict().items())  # nothing was copied


def test_init_from_that_adds_structure_keeps_the_function_and_the_refusal_reaches_train_py(tmp_path, capsys):
    """The other way round is growth, not loss: a plain source into a Mix-FFN / 2x2-region
    student starts as the source's function (identity conv, w = 1: test_regions); and
    train.py says the refusal in one line, the flag to pass included."""
    from nala_dit.cli.config import to_dict
    from nala_dit.models.dit import create_model
    from nala_dit.training import convert

    run = _source_run(tmp_path / "plain")
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, mlp="mix", nala_regions=2)
    report = convert.init_from(str(run), model, "NaLaDiT-T/2", "all-but-attention",
                               to_dict(TrainConfig(model="NaLaDiT-T/2")))
    assert report.counts()["dropped"] == (0, 0)
    mix = _source_run(tmp_path / "mix", mlp="mix")
    code = train_cli.main(["--model", "NaLaDiT-T/2", "--init-from", str(mix), "--data", "digits", "--max-steps", "1",
                           "--num-workers", "0", "--results-dir", str(tmp_path), "--exp-name", "student"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "; pass --mlp mix" in err, err
    assert not (tmp_path / "student").exists()


def test_non_finite_init_from_source_is_refused(pipe_dir, tmp_path):
    from nala_dit.training.convert import init_from

    bad = copy_tree(pipe_dir, tmp_path / "bad")
    poison(bad / "transformer" / "diffusion_pytorch_model.safetensors")
    student = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10)
    with pytest.raises(ValueError) as err:
        init_from(bad, student, "NaLaDiT-T/2", "all-but-attention", {})
    assert "non-finite" in str(err.value) and "--lr" not in str(err.value)
