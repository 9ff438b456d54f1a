"""Resume (`nala_dit/training/loop.py` `restore`, `checkpoint.config_changes`): what a resumed run keeps, applies and refuses."""

import pytest
import torch

from nala_dit.models.dit import create_model
from nala_dit.training import checkpoint as ckpt_lib
from tests.training.test_loop import (
    read_log,
    run_train,
)
from tests.utils import _train_main, assert_names, train_fails


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line[line.index("error:"):] for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_resume_with_a_new_structure_suggests_a_new_run_and_the_command_works(tmp_path, capsys):
    """--mlp mix on a plain run: --allow-changes cannot load the weights, so the error names
    --init-from into a new run; that command, as printed, trains."""
    import re

    from nala_dit.training import checkpoint as ckpt_lib

    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "1", "--ckpt-every", "1") == 0
    capsys.readouterr()
    ckpt = tmp_path / "run" / "checkpoints" / "0000001"
    for allow in ([], ["--allow-changes", "mlp"]):
        assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "2", "--resume", "auto", "--mlp", "mix",
                           *allow) == 1
        err = _one_error(capsys)
        assert_names(err, f"checkpoint {ckpt}", "'mlp' in the checkpoint, 'mix' now", "blocks.0.mlp.dwconv.weight",
                     "--allow-changes cannot help", "(--mlp mlp)", "drop --resume",
                     f"--init-from {ckpt} --exp-name run-mlp")
        assert "pass --allow-changes" not in err
    suggested = re.search(r"pass (--init-from \S+ --exp-name \S+)$", err).group(1).split()
    assert _train_main(tmp_path, "--max-steps", "1", "--mlp", "mix", *suggested) == 0
    assert ckpt_lib.open_checkpoint(tmp_path / "run-mlp").model_config["mlp"] == "mix"
    # the other advice works too: the checkpoint's own setting resumes
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "2", "--resume", "auto", "--mlp", "mlp") == 0


@pytest.mark.parametrize("source,now,own,reason", [
    (["--mlp", "mix"], ["--mlp", "mlp"], "--mlp mix", "Mix-FFN model (--mlp mix)"),
    (["--nala-regions", "2"], ["--nala-regions", "1"], "--nala-regions 2", "has 2x2 region states"),
    ([], ["--softmax-blocks", "1"], "--softmax-blocks none", "has no softmax blocks, the student 1"),
])
def test_resume_advice_never_suggests_what_fails(tmp_path, capsys, source, now, own, reason):
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "1", "--ckpt-every", "1", *source) == 0
    capsys.readouterr()
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "2", "--resume", "auto", *now) == 1
    err = _one_error(capsys)
    assert_names(err, f"checkpoint's settings ({own})", "new run cannot start from its weights")
    assert reason in err and "--allow-changes " not in err.replace("(--allow-changes cannot help)", "")
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "2", "--resume", "auto", *own.split()) == 0


def test_resume_across_context_parallel_sizes_says_fp32_close(tmp_path, capsys):
    """A 1-process run's checkpoint, its config edited as a --context-parallel 2 run's would
    be (world size 1 either way: one data-parallel group), resumed in one process."""
    import json

    from nala_dit.training import checkpoint as ckpt_lib

    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "1", "--ckpt-every", "1") == 0
    state_file = ckpt_lib.find_checkpoint(tmp_path / "run") / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state["config"]["context-parallel"] = 2
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "2", "--resume", "auto") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "context-parallel" in line]
    assert len(lines) == 1 and lines[0].startswith("resume: "), lines
    assert_names(lines[0], "--context-parallel 2", "this run uses 1", "fp32-close", "not bit for bit",
                 "docs/highres.md")
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "3", "--resume", "auto") == 0
    assert "context-parallel" not in capsys.readouterr().out  # same size: nothing to say


def test_non_finite_optimizer_state_is_refused_on_resume(tmp_path):
    model = create_model("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 1, 8, 8), torch.zeros(1), torch.zeros(1, dtype=torch.long)).sum().backward()
    optimizer.step()
    state = dict(step=1, epoch=0, position=1, world_size=1, config={}, model_config=dict(model.config))
    path = ckpt_lib.save_checkpoint(tmp_path, model=model, ema=model, optimizer=optimizer, state=state,
                                    rng_states=[torch.get_rng_state()])
    saved = torch.load(path / "optimizer.pt", weights_only=True)
    saved["state"][3]["exp_avg_sq"].view(-1)[0] = float("nan")
    torch.save(saved, path / "optimizer.pt")
    with pytest.raises(ckpt_lib.CheckpointError) as err:
        ckpt_lib.open_checkpoint(path).load_optimizer(torch.optim.AdamW(model.parameters()))
    message = str(err.value)
    assert_names(message, str(path / "optimizer.pt"), "exp_avg_sq of parameter 3", "1 non-finite value")
    assert "--lr" not in message and "last good" not in message


def test_resume_with_another_init_from_says_it_ignores_it(tmp_path, capsys):
    import train as train_cli

    tiny = ["--model", "NaLaDiT-T/2", "--data", "digits", "--global-batch-size", "8", "--num-workers", "0",
            "--sample-every", "0", "--log-every", "1", "--flip", "false", "--results-dir", str(tmp_path),
            "--exp-name", "run"]
    assert train_cli.main(tiny + ["--max-steps", "1", "--ckpt-every", "1"]) == 0
    capsys.readouterr()
    assert train_cli.main(tiny + ["--max-steps", "2", "--ckpt-every", "2", "--resume", "auto",
                                  "--init-from", "somewhere/else"]) == 0
    out = capsys.readouterr().out
    assert_names(out, "resume: --init-from somewhere/else", "ignored", "continues from")
    assert "(it started from random weights)" in out
    assert ckpt_lib.open_checkpoint(tmp_path / "run").config["init-from"] is None


def steps(run):
    return [p.name for p in ckpt_lib.list_checkpoints(run / "checkpoints")]


def test_resume_applies_new_lr_and_weight_decay(tmp_path, capsys):
    run = run_train(tmp_path, "--max-steps", "2", "--ckpt-every", "2", "--lr", "2e-3")
    before = ckpt_lib.open_checkpoint(run).weights("model")
    run_train(tmp_path, "--max-steps", "3", "--ckpt-every", "3", "--lr", "0", "--resume", "auto")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume: --lr 0.0 ")]
    assert len(lines) == 1
    assert_names(lines[0], "checkpoint's 0.002")
    after = ckpt_lib.open_checkpoint(run)
    assert after.step == 3 and after.config["lr"] == 0.0
    # AdamW with lr 0 moves nothing (decoupled decay is scaled by lr too): the step used lr 0.
    assert all(torch.equal(before[k], v) for k, v in after.weights("model").items())
    assert {g["lr"] for g in after.optimizer_state()["param_groups"]} == {0.0}
    run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "4", "--lr", "2e-3", "--weight-decay", "0.5",
              "--resume", "auto")
    groups = ckpt_lib.open_checkpoint(run).optimizer_state()["param_groups"]
    assert {(g["lr"], g["weight_decay"]) for g in groups} == {(2e-3, 0.5)}


def test_resume_with_another_batch_size_keeps_the_data_position(tmp_path, capsys):
    run = run_train(tmp_path, "--max-steps", "2", "--ckpt-every", "2")  # 2 micro-batches of 8 images
    assert ckpt_lib.open_checkpoint(run).state["position"] == 2
    run_train(tmp_path, "--max-steps", "3", "--ckpt-every", "3", "--global-batch-size", "4", "--resume", "auto")
    assert "data position 2 → 4 (16 images into epoch 0)" in capsys.readouterr().out
    assert ckpt_lib.open_checkpoint(run).state["position"] == 5  # 16 + 4 images = 5 batches of 4


def test_rollback_keeps_the_new_branch(tmp_path, capsys):
    run = run_train(tmp_path, "--max-steps", "6", "--ckpt-every", "1")
    old = {s: ckpt_lib.open_checkpoint(run / "checkpoints" / s).weights("model") for s in ("0000004", "0000006")}
    # Roll back to step 2 with different settings (a new branch), keeping 2 checkpoints.
    run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "1", "--keep-last", "2", "--lr", "5e-3",
              "--resume", str(run / "checkpoints" / "0000002"))
    out = capsys.readouterr().out
    assert_names(out, "rolled back to step 2", "later checkpoints")
    assert steps(run) == ["0000003", "0000004"]  # the new branch, pruned among itself
    new4 = ckpt_lib.open_checkpoint(run).weights("model")
    assert not all(torch.equal(old["0000004"][k], v) for k, v in new4.items())
    # The abandoned branch is kept, inert, where --resume auto does not look.
    (aside,) = (run / "checkpoints" / ckpt_lib.ABANDONED).iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["0000003", "0000004", "0000005", "0000006"]
    assert all(torch.equal(old["0000006"][k], v)
               for k, v in ckpt_lib.open_checkpoint(aside / "0000006").weights("model").items())
    run_train(tmp_path, "--max-steps", "5", "--ckpt-every", "5", "--lr", "5e-3", "--resume", "auto")
    assert "resumed from" in capsys.readouterr().out and ckpt_lib.open_checkpoint(run).step == 5
    assert [r["step"] for r in read_log(run)] == [1, 2, 3, 4, 5]  # log follows the live branch


def test_resume_refuses_changed_model_and_objective(tmp_path, capsys):
    run_train(tmp_path, "--max-steps", "1", "--ckpt-every", "1")
    err = train_fails(tmp_path, capsys, "--max-steps", "2", "--resume", "auto", "--power", "2",
                      "--direction", "relu_split", "--noise-schedule", "cosine", "--diffusion-steps", "500")
    for change in ("power: 3.0 in the checkpoint, 2.0 now", "direction: 'cosine' in the checkpoint, 'relu_split' now",
                   "noise-schedule: 'linear' in the checkpoint, 'cosine' now",
                   "diffusion-steps: 1000 in the checkpoint, 500 now"):
        assert change in err, err
    assert "--allow-changes direction,power,noise-schedule,diffusion-steps" in err
    # Deliberate: named in --allow-changes, announced, and recorded as used.
    run_train(tmp_path, "--max-steps", "2", "--ckpt-every", "2", "--resume", "auto", "--power", "2",
              "--allow-changes", "power")
    assert_names(capsys.readouterr().out, "resume: power", "from 3.0 to 2.0", "(--allow-changes)")
    assert ckpt_lib.open_checkpoint(tmp_path / "run").model_config["power"] == 2.0
    # --lepe false against a LePE checkpoint: refused; forced, the weights do not fit: one line.
    err = train_fails(tmp_path, capsys, "--max-steps", "3", "--resume", "auto", "--power", "2",
                      "--allow-changes", "power", "--lepe", "false")
    assert "lepe: True in the checkpoint, False now" in err
    err = train_fails(tmp_path, capsys, "--max-steps", "3", "--resume", "auto", "--power", "2",
                      "--lepe", "false", "--allow-changes", "power,lepe")
    assert_names(err, "do not fit the model", "8 unexpected", "blocks.0.attn.lepe", "--allow-changes cannot help",
                 "(--lepe true)")


def test_distillation_settings_are_compared_on_resume(tmp_path):
    model_config = {"objective": "diffusion", "power": 3.0}
    stored = dict(teacher="runs/dit", **{"distill-weight": 0.5, "distill-sigma-weight": None})
    ckpt = ckpt_lib.Checkpoint(tmp_path, dict(config=stored, model_config=model_config))
    now = dict(teacher="runs/dit", **{"distill-weight": 1.0, "distill-sigma-weight": None})
    assert ckpt_lib.config_changes(ckpt, now, model_config) == {"distill-weight": (0.5, 1.0)}
    assert ckpt_lib.config_changes(ckpt, dict(now, teacher=None), model_config) == {
        "teacher": ("runs/dit", None), "distill-weight": (0.5, 1.0)}
    # Without a teacher on either side the distillation flags are unused and not compared.
    plain = ckpt_lib.Checkpoint(tmp_path, dict(config={"distill-weight": 0.5}, model_config=model_config))
    assert ckpt_lib.config_changes(plain, {"distill-weight": 1.0}, model_config) == {}


def test_sit_checkpoint_into_a_dit_run(tmp_path, capsys):
    run_train(tmp_path, "--model", "SiT-T/2", "--max-steps", "1", "--ckpt-every", "1")
    err = train_fails(tmp_path, capsys, "--model", "DiT-T/2", "--max-steps", "2", "--resume", "auto")
    assert "objective: 'transport' in the checkpoint, 'diffusion' now" in err
    assert "learn-sigma: False in the checkpoint, True now" in err
