"""Reliability (issue 12): resume honours the command line, run folders have one writer,
bad files are named with the fix, image folders fail up front, nothing is left behind."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import train as train_cli
from nala_dit.training import checkpoint as ckpt_lib
from nala_dit.training import loop as training
from nala_dit.training.runlock import LOCK_NAME, LockedError, RunLock
from tests.test_training import TINY_RUN, make_image_folder, read_log, run_train, tiny_vae


class Evil:  # a pickled object in a checkpoint: refused, and no message may suggest unpickling it
    pass


def train_fails(tmp_path, capsys, *extra, name="run"):
    """Run train.py's main, expect exit code 1, return the one-line error."""
    code = train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", name, *extra])
    captured = capsys.readouterr()
    assert code == 1, captured.out + captured.err
    lines = [line[line.index("error:"):] for line in captured.err.splitlines() if "error:" in line]
    assert len(lines) == 1, captured.err  # one line (a progress bar may precede it)
    return lines[0]


def steps(run):
    return [p.name for p in ckpt_lib.list_checkpoints(run / "checkpoints")]


def test_resume_applies_new_lr_and_weight_decay(tmp_path, capsys):
    run = run_train(tmp_path, "--max-steps", "2", "--ckpt-every", "2", "--lr", "2e-3")
    before = ckpt_lib.open_checkpoint(run).weights("model")
    run_train(tmp_path, "--max-steps", "3", "--ckpt-every", "3", "--lr", "0", "--resume", "auto")
    assert "resume: --lr 0.0 replaces the checkpoint's 0.002" in capsys.readouterr().out
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
    assert "rolled back to step 2: moved this run's later checkpoints to" in out
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


def test_run_folder_lock(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = dict(pid=holder.pid, host=socket.gethostname(), time=time.time())
        (run / LOCK_NAME).write_text(json.dumps(lock))
        err = train_fails(tmp_path, capsys, "--max-steps", "1", "--ckpt-every", "1")
        assert f"run folder {run} is in use by pid {holder.pid} on host {socket.gethostname()}" in err
        assert "choose another --exp-name" in err and not (run / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder died (kill -9): its lock is stale and taken over; a killed save's
    # temporary folder is removed.
    (run / "checkpoints" / ".tmp-99999-0000003").mkdir(parents=True)
    run_train(tmp_path, "--max-steps", "1", "--ckpt-every", "1")
    assert f"taking over the stale lock {run / LOCK_NAME} (pid {holder.pid} is gone)" in capsys.readouterr().out
    assert not (run / LOCK_NAME).exists()  # released at the end
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000001"]


def test_lock_is_exclusive_and_released(tmp_path):
    path = tmp_path / "x.lock"
    with RunLock(path, "output x", "use another --out"):
        holder = json.loads(path.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(LockedError, match=f"output x is in use by pid {os.getpid()}.*use another --out"):
            RunLock(path, "output x", "use another --out").acquire()
    assert not path.exists()
    # A running pid that started after the lock was written is a reused pid: stale.
    path.write_text(json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), time=0.0)))
    with RunLock(path, "output x"):
        assert json.loads(path.read_text())["time"] > 0
    # A lock from another host cannot be checked: never taken over silently.
    path.write_text(json.dumps(dict(pid=1, host="elsewhere", time=0.0)))
    with pytest.raises(LockedError, match=f"on host elsewhere.*delete {path}"):
        RunLock(path, "output x").acquire()


def test_launcher_process_count_mismatch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = train_fails(tmp_path, capsys, "--max-steps", "1")
    assert "the launcher started 2 processes but Accelerate sees 1" in err
    assert ("ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 "
            "--mixed_precision no --dynamo_backend no train.py") in err
    assert not (tmp_path / "run").exists()


def test_single_process_accelerate_launch_is_recognised(monkeypatch):
    """What accelerate's one-process launcher leaves behind (checked against the real launcher
    in tests/test_training.py): ACCELERATE_USE_CPU, MASTER_ADDR, no WORLD_SIZE, its argv as our parent."""
    from nala_dit.training.runlock import single_process_launch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    launch = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--cpu"]
    assert single_process_launch(launch + ["--num_processes", "2", "train.py", "--num_processes", "5"]) == 2
    assert single_process_launch([launch[0], "-m", "accelerate.commands.launch", "--num_processes=3", "t.py"]) == 3
    assert single_process_launch(launch + ["train.py"]) == 0  # more than one, from a config file
    assert single_process_launch(launch + ["--num_processes", "1", "train.py"]) is None
    assert single_process_launch(["/bin/bash", "job.sh"]) is None  # not accelerate: never guessed
    monkeypatch.delenv("MASTER_ADDR")
    assert single_process_launch(launch + ["train.py"]) is None  # one process asked, one started
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert single_process_launch(launch + ["--num_processes", "2", "train.py"]) is None  # torchrun: counted


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
    assert "resume: power changes from 3.0 to 2.0 (--allow-changes)" in capsys.readouterr().out
    assert ckpt_lib.open_checkpoint(tmp_path / "run").model_config["power"] == 2.0
    # --lepe false against a LePE checkpoint: refused; forced, the weights do not fit: one line.
    err = train_fails(tmp_path, capsys, "--max-steps", "3", "--resume", "auto", "--power", "2",
                      "--allow-changes", "power", "--lepe", "false")
    assert "lepe: True in the checkpoint, False now" in err
    err = train_fails(tmp_path, capsys, "--max-steps", "3", "--resume", "auto", "--power", "2",
                      "--lepe", "false", "--allow-changes", "power,lepe")
    assert "Its weights do not fit the model these settings build (8 unexpected (e.g. blocks.0.attn.lepe" in err
    assert "(--allow-changes cannot help): resume with the checkpoint's settings (--lepe true)" in err


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


def test_bad_checkpoint_files_are_named(tmp_path, capsys, monkeypatch):
    run = run_train(tmp_path, "--max-steps", "2", "--ckpt-every", "1")
    first, last = ckpt_lib.list_checkpoints(run / "checkpoints")

    def resume_error():
        return train_fails(tmp_path, capsys, "--max-steps", "3", "--resume", "auto")

    model_file = last / "model.safetensors"
    good = model_file.read_bytes()
    model_file.write_bytes(good[: len(good) // 2])
    err = resume_error()
    assert f"{model_file}: unreadable, truncated or corrupt" in err and f"--resume {first}" in err
    model_file.write_bytes(good)

    state_file = last / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "step": "2"}))
    err = resume_error()
    assert f"{state_file}: 'step' must be an integer, got '2' (str)" in err
    state_file.write_text(json.dumps(state)[:100])
    assert f"{state_file}: unreadable, truncated or corrupt (JSONDecodeError" in resume_error()
    state_file.write_text(json.dumps(state))

    opt_file = last / "optimizer.pt"
    good_opt = opt_file.read_bytes()
    torch.save({"state": Evil()}, opt_file)
    err = resume_error()
    assert f"{opt_file}: holds pickled Python objects (tests.test_reliability.Evil), which are refused" in err
    assert "weights_only=False" not in err
    opt_file.write_bytes(np.random.default_rng(0).bytes(4096))  # random bytes: not a pickle at all
    err = resume_error()
    assert f"{opt_file}: not a file written by torch.save, or corrupt (UnpicklingError: Unsupported operand" in err
    assert "pickled Python objects" not in err and "weights_only" not in err
    # The optimizer.pt of another model (DiT-T/2: no LePE, no gate) and one with moments of another shape.
    from nala_dit.models.dit import create_model

    other = create_model("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    torch.save(torch.optim.AdamW(other.parameters()).state_dict(), opt_file)
    err = resume_error()
    here = len(ckpt_lib.open_checkpoint(run).weights("model"))
    assert err == (f"error: {opt_file}: does not fit this model's optimizer (parameter group 0 has "
                   f"{len(list(other.parameters()))} parameters in the file, {here} here): it was saved for another "
                   f"model; put back the optimizer.pt written with this checkpoint, or resume from another "
                   f"checkpoint (--resume {first})")
    state = torch.load(__import__("io").BytesIO(good_opt), weights_only=True)
    i = min(state["state"])  # the first parameter with moments (pos_embed is frozen)
    state["state"][i]["exp_avg"] = torch.zeros(3, 5)
    torch.save(state, opt_file)
    assert f"(exp_avg of parameter {i} is (3, 5) in the file, {tuple(state['state'][i]['exp_avg_sq'].shape)} here)" \
        in resume_error()
    opt_file.write_bytes(good_opt)

    # Disk full while saving: one line, the partial copy removed, the last checkpoint intact.
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_lib.torch, "save", full_disk)
    err = resume_error()
    monkeypatch.undo()
    assert f"cannot write checkpoint {run / 'checkpoints' / '0000003'}: [Errno 28] No space left on device" in err
    assert f"the previous checkpoint {last} is intact" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000001", "0000002"]


def test_non_finite_weights_are_never_saved_nor_loaded(tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file, save_file

    real_update, calls = training.update_ema, []

    def diverging_ema(ema, model, decay, step=None):  # the step-2 update leaves one NaN, with a finite step-2 loss
        real_update(ema, model, decay, step)
        calls.append(decay)
        if len(calls) == 3:  # the initial copy, step 1, step 2
            ema.final_layer.linear.bias.data[0] = float("nan")

    monkeypatch.setattr(training, "update_ema", diverging_ema)
    err = train_fails(tmp_path, capsys, "--max-steps", "2", "--ckpt-every", "1")
    monkeypatch.undo()
    ckpts = tmp_path / "run" / "checkpoints"
    assert err == (f"error: not writing checkpoint {ckpts / '0000002'}: ema tensor final_layer.linear.bias holds 1 "
                   f"non-finite value(s) (the run diverged); the last good checkpoint is {ckpts / '0000001'}. "
                   f"Try a lower --lr, --max-grad-norm 1, or --mixed-precision no")
    assert sorted(p.name for p in ckpts.iterdir()) == ["0000001"]
    # A NaN checkpoint (written elsewhere, or by an older version): resume and sampling name the file and tensor.
    for which in ("model", "ema"):
        file = ckpts / "0000001" / f"{which}.safetensors"
        tensors = load_file(str(file))
        tensors["blocks.1.mlp.fc2.weight"][0, :3] = float("inf")
        save_file(tensors, str(file))
    cause = "its tensor blocks.1.mlp.fc2.weight holds 3 non-finite value(s): written by a run that diverged"
    err = train_fails(tmp_path, capsys, "--max-steps", "3", "--resume", "auto")
    assert err.startswith(f"error: {ckpts / '0000001' / 'model.safetensors'}: {cause}; use another checkpoint")
    with pytest.raises(ckpt_lib.CheckpointError, match=re.escape(f"ema.safetensors: {cause}")):
        ckpt_lib.load_model(tmp_path / "run")


def test_killed_run_log_holds_each_step_once(tmp_path, monkeypatch):
    straight = run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "2", name="straight")
    real_save = training.save_checkpoint

    def killed_at_4(*args, state, **kwargs):
        if state["step"] == 4:
            raise KeyboardInterrupt("killed before the step-4 checkpoint")
        return real_save(*args, state=state, **kwargs)

    monkeypatch.setattr(training, "save_checkpoint", killed_at_4)
    with pytest.raises(KeyboardInterrupt):
        run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "2")
    monkeypatch.undo()
    run = tmp_path / "run"
    assert [r["step"] for r in read_log(run)] == [1, 2, 3, 4]
    run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "2", "--resume", "auto")  # redoes steps 3 and 4
    assert [r["step"] for r in read_log(run)] == [1, 2, 3, 4]
    assert [r["loss"] for r in read_log(run)] == [r["loss"] for r in read_log(straight)]


def test_image_folder_problems_are_found_up_front(tmp_path, capsys):
    images = make_image_folder(tmp_path / "images", per_class=2)
    for name in ("a.png", "b.png"):
        (images / "cat" / name).write_bytes(b"not a png")
    common = ["--data", str(images), "--image-size", "16", "--global-batch-size", "2", "--max-steps", "1"]
    err = train_fails(tmp_path, capsys, *common, "--check-data", "true")
    assert f"2 unreadable image(s) in {images}: {images / 'cat' / 'a.png'}, {images / 'cat' / 'b.png'}" in err
    assert not (tmp_path / "run").exists()  # a run that failed at once leaves no folder
    with pytest.warns(UserWarning, match="leaving out 2 unreadable image"):
        run_train(tmp_path, *common, "--check-data", "true", "--skip-corrupt", "true", "--ckpt-every", "1",
                  name="skipped")

    (images / "bird").mkdir()
    err = train_fails(tmp_path, capsys, *common, name="empty")
    assert f"data folder {images}: class folders without images: bird" in err

    broken = tmp_path / "broken"
    for c in ("x", "y"):
        (broken / c).mkdir(parents=True)
        (broken / c / "0.png").write_bytes(b"junk")
    with pytest.warns(UserWarning, match="skipping corrupt image"):
        err = train_fails(tmp_path, capsys, "--data", str(broken), "--image-size", "16", "--global-batch-size", "2",
                          "--max-steps", "1", "--skip-corrupt", "true", name="broken")
    assert f"no readable image in {broken}: all 2 files failed to open" in err


def test_extract_latents_lists_unreadable_files(tmp_path, capsys):
    from extract_latents import main as extract_main
    from nala_dit.data.datasets import LatentDataset

    images = make_image_folder(tmp_path / "images", per_class=2, size=16)
    for path in (images / "cat" / "bad1.png", images / "dog" / "bad2.jpg"):
        path.write_bytes(b"\x89PNG truncated")
    argv = ["--data", str(images), "--out", str(tmp_path / "lat"), "--vae", str(tiny_vae(tmp_path / "vae")),
            "--image-size", "16", "--num-workers", "0", "--dtype", "float32"]
    assert extract_main(argv) == 1
    err = capsys.readouterr().err
    assert f"{images / 'cat' / 'bad1.png'}, {images / 'dog' / 'bad2.jpg'}; fix or remove them" in err
    assert not (tmp_path / "lat").exists()
    with pytest.warns(UserWarning, match="leaving out 2 unreadable"):
        assert extract_main(argv + ["--skip-corrupt"]) == 0
    assert len(LatentDataset(tmp_path / "lat")) == 4  # the readable ones, none duplicated
    shard = tmp_path / "lat" / "latents-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(ValueError, match=f"{shard}: unreadable latent shard .*delete it and rerun extract_latents"):
        LatentDataset(tmp_path / "lat")


def sample_cli(*args):
    import sample

    return sample.main([str(a) for a in args])


def test_mass_sampling_lock_and_leftovers(tmp_path, digits_checkpoint, capsys, monkeypatch):
    common = ["--ckpt", digits_checkpoint, "--num-samples", 4, "--sampler", "ddim", "--steps", 2,
              "--batch-size", 2, "--shard-size", 2]
    out = tmp_path / "s.npz"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        Path(f"{out}.lock").write_text(json.dumps(dict(pid=holder.pid, host=socket.gethostname(), time=time.time())))
        assert sample_cli(*common, "--out", out) == 1
        err = capsys.readouterr().err
        assert f"output {out} is in use by pid {holder.pid}" in err and "choose another --out" in err
        assert not Path(f"{out}.parts").exists()
    finally:
        holder.kill()
        holder.wait()
    # Killed runs left a half-written .npz and shard: removed on the next start (stale lock taken over).
    Path(f"{out}.parts").mkdir()
    leftovers = [tmp_path / f".tmp-{holder.pid}-s.npz", Path(f"{out}.parts") / f".tmp-{holder.pid}-shard-000000.npz"]
    for p in leftovers:
        p.write_bytes(b"half")
    # This run is killed while assembling the .npz: its own temporary goes too.
    real_header = np.lib.format.write_array_header_2_0

    def killed(*args, **kwargs):
        real_header(*args, **kwargs)
        raise KeyboardInterrupt("killed during assembly")

    monkeypatch.setattr(np.lib.format, "write_array_header_2_0", killed)
    with pytest.raises(KeyboardInterrupt):
        sample_cli(*common, "--out", out)
    monkeypatch.undo()
    assert "taking over the stale lock" in capsys.readouterr().out
    assert not any(p.exists() for p in leftovers) and not list(tmp_path.glob(".tmp-*")) and not out.exists()
    assert sample_cli(*common, "--out", out) == 0
    assert not Path(f"{out}.lock").exists()
    with np.load(out) as done:
        assert done["arr_0"].shape == (4, 8, 8, 1)
    # An interrupted run's settings file damaged by hand: named, with the way out.
    assert sample_cli(*common, "--out", tmp_path / "t.npz", "--stop-after", 1) == 0
    (tmp_path / "t.npz.parts" / "settings.json").write_text("{")
    assert sample_cli(*common, "--out", tmp_path / "t.npz") == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 't.npz.parts' / 'settings.json'}: unreadable" in err and "to start over" in err


def test_export_official_pickle_is_named_without_unsafe_advice(tmp_path, capsys):
    import export

    torch.save({"model": Evil()}, tmp_path / "evil.pt")
    (tmp_path / "trunc.pt").write_bytes((tmp_path / "evil.pt").read_bytes()[:100])
    for name, cause in (("evil.pt", "holds pickled Python objects (tests.test_reliability.Evil), which are refused"),
                        ("trunc.pt", "unreadable, truncated or corrupt")):
        assert export.main(["official", str(tmp_path / name), str(tmp_path / "out"), "--model", "DiT-T/4"]) == 1
        err = capsys.readouterr().err
        assert f"{tmp_path / name}: {cause}" in err and "weights_only=False" not in err, err
        assert len(err.strip().splitlines()) == 1


def test_calc_validates_samples_and_reference(tmp_path, digits_classifier_dir, capsys):
    import evaluate_fid
    from nala_dit.data.digits import load_digits_split

    common = ["--digits-classifier", str(digits_classifier_dir), "--device", "cpu"]
    ref = tmp_path / "ref.npz"
    assert evaluate_fid.main(["ref", "--dataset", "digits-heldout", "--features", "digits", "--out", str(ref),
                              *common]) == 0
    images, labels = load_digits_split("heldout")
    images = images[:20, :, :, None]  # (20, 8, 8, 1) uint8

    def calc(samples, reference=ref):
        code = evaluate_fid.main(["calc", "--samples", str(samples), "--ref", str(reference), *common])
        return code, capsys.readouterr().err

    def npz(name, *arrays):
        path = tmp_path / name
        np.savez(path, *arrays)
        return path

    cases = [
        (npz("labels.npz", images, np.arange(100, 120) % 10 + 100),
         "(labels): labels range over [100, 109] but the digits-classifier knows classes [0, 10)"),
        (npz("wide.npz", np.zeros((20, 8, 12, 1), np.uint8)), "(arr_0): images must be square, got 8x12"),
        (npz("tiny.npz", images[:, ::2, ::2]), "the digits classifier reads 8x8 images"),
        (npz("nchw.npz", images.transpose(0, 3, 1, 2)), "it looks like NCHW: transpose it"),
        (npz("five.npz", images[:, None]), "images must be (N, H, W, C) with C = 1 or 3"),
        (npz("float.npz", images / 255.0), "images must be uint8 in [0, 255], got float64"),
        (npz("fractional.npz", images, labels[:20] + 0.5), "(labels): labels must be whole class ids, got 20 "
         "fractional or non-finite value(s) (e.g. "),
        (npz("objects.npz", images, np.array(list(labels[:20]), dtype=object)),
         ": arr_1 is an array of Python objects, which is refused"),
        (npz("empty.npz"), "empty.npz: no array 'arr_0' (it holds no arrays at all)"),
    ]
    good = npz("good.npz", images, labels[:20])
    (tmp_path / "trunc.npz").write_bytes(good.read_bytes()[:-200])
    cases.append((tmp_path / "trunc.npz", "not a readable .npz (truncated or not a zip archive"))
    for samples, rule in cases:
        code, err = calc(samples)
        assert code == 1 and f"{samples}" in err and rule in err, (samples, err)
        errors = [line for line in err.splitlines() if "error" in line]
        assert len(errors) == 1 and errors[0].startswith(f"error: {samples}"), err  # one line, no stray quotes
    assert calc(npz("whole.npz", images, labels[:20].astype(np.float64)))[0] == 0  # 3.0 is class 3

    stats = dict(np.load(ref))
    stats["sigma"][3, 3] = np.nan
    np.savez(tmp_path / "nan_ref.npz", **stats)
    code, err = calc(good, tmp_path / "nan_ref.npz")
    assert code == 1 and f"{tmp_path / 'nan_ref.npz'}: sigma holds 1 non-finite value(s)" in err
    stats = dict(np.load(ref))
    stats["sigma"][3, 3] = -1.0  # not a covariance: a negative variance
    np.savez(tmp_path / "npsd_ref.npz", **stats)
    code, err = calc(good, tmp_path / "npsd_ref.npz")
    assert code == 1 and err.splitlines()[-1] == (f"error: {tmp_path / 'npsd_ref.npz'}: sigma is not positive semi-definite (smallest "
                                 f"eigenvalue {np.linalg.eigvalsh(stats['sigma']).min():.6g}), so it is not a "
                                 f"covariance matrix (a Frechet distance to it means nothing); rebuild the reference "
                                 f"with `evaluate_fid.py ref`")
    stats["sigma"][3, 3], stats["sigma"][0, 1] = np.load(ref)["sigma"][3, 3], 5.0  # not symmetric
    np.savez(tmp_path / "asym_ref.npz", **stats)
    assert "sigma is not symmetric" in calc(good, tmp_path / "asym_ref.npz")[1]
    stats = dict(np.load(ref), sigma=np.array([None], dtype=object))
    np.savez(tmp_path / "obj_ref.npz", **stats)
    assert f"{tmp_path / 'obj_ref.npz'}: sigma is an array of Python objects" in calc(good, tmp_path / "obj_ref.npz")[1]
    stats = dict(np.load(ref), mu=np.zeros(64), sigma=np.eye(64))
    np.savez(tmp_path / "dim_ref.npz", **stats)
    code, err = calc(good, tmp_path / "dim_ref.npz")
    assert code == 1 and "do not match the digits-classifier features of dimension 128" in err
    assert calc(good)[0] == 0  # the valid pair still scores
