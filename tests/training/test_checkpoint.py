"""Tests of `nala_dit/training/checkpoint.py`."""
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import export
from nala_dit.models.dit import create_model
from nala_dit.training import checkpoint as ckpt_lib
from nala_dit.training import loop as training
from tests.scripts.test_sample import FAST, write_checkpoint
from tests.training.test_loop import (
    run_train,
)
from tests.utils import Evil, assert_names, cli, copy_tree, one_line_error, train_fails


def test_resume_of_a_missing_step_lists_the_steps_that_exist(digits_checkpoint, tmp_path, capsys):
    import train as train_cli
    from tests.utils import TINY_RUN

    missing = digits_checkpoint / "checkpoints" / "0000009"
    assert train_cli.main(TINY_RUN + ["--resume", str(missing), "--max-steps", "10", "--results-dir", str(tmp_path),
                                      "--exp-name", "again"]) == 1
    err = capsys.readouterr().err
    assert_names(err, str(digits_checkpoint / "checkpoints"), "steps 5",
                 f"--resume {digits_checkpoint / 'checkpoints' / '0000005'}")


# minors
class EvilReduce:   # runs a command when unpickled
    def __reduce__(self):
        return (os.system, ("echo pwned",))


# 4. wrong types in stored model configs
def test_wrong_type_in_state_json_model_config(run_dir, tmp_path, capsys):
    run = copy_tree(run_dir, tmp_path / "run")
    state_file = ckpt_lib.find_checkpoint(run) / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state["model_config"]["hidden_size"] = "128"
    state_file.write_text(json.dumps(state))
    assert cli("--ckpt", run, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
    assert_names(one_line_error(capsys), str(state_file), "'hidden_size'", "integer", "got '128'")


# 8. disk full while writing safetensors
def test_disk_full_in_a_safetensors_write_is_one_line(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    model = create_model("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    kwargs = dict(model=model, ema=model, optimizer=torch.optim.AdamW(model.parameters()),
                  rng_states=[torch.get_rng_state()])
    ckpt_lib.save_checkpoint(tmp_path, state=dict(step=1), **kwargs)

    def full(tensors, path):
        Path(path).write_bytes(b"partial")
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(ckpt_lib, "save_file", full)
    with pytest.raises(OSError) as err:
        ckpt_lib.save_checkpoint(tmp_path, state=dict(step=2), **kwargs)
    message = str(err.value)
    assert "\n" not in message and f"cannot write checkpoint {tmp_path / '0000002'}" in message
    assert "No space left on device" in message and f"{tmp_path / '0000001'} is intact" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000001"]


def test_malicious_pickle_is_called_blocked_not_corrupt(tmp_path, capsys):
    torch.save({"model": EvilReduce()}, tmp_path / "evil.pt")
    assert export.main(["official", str(tmp_path / "evil.pt"), str(tmp_path / "out"), "--model", "DiT-T/4"]) == 1
    err = one_line_error(capsys)
    assert_names(err, str(tmp_path / "evil.pt"), "blocked", "not a plain tensor file", "possibly malicious")
    assert f"{os.system.__module__}.system" in err or "posix.system" in err
    assert "corrupt" not in err and "download it again" not in err and "weights_only=False" not in err
    with open(tmp_path / "plain.pkl", "wb") as f:  # the same, pickled without torch.save
        pickle.dump({"model": EvilReduce()}, f, protocol=2)
    assert export.main(["official", str(tmp_path / "plain.pkl"), str(tmp_path / "out"), "--model", "DiT-T/4"]) == 1
    assert_names(one_line_error(capsys), "blocked", "not a plain tensor file", "possibly malicious")


def test_bad_checkpoint_files_are_named(tmp_path, capsys, monkeypatch):
    run = run_train(tmp_path, "--max-steps", "2", "--ckpt-every", "1")
    first, last = ckpt_lib.list_checkpoints(run / "checkpoints")

    def resume_error():
        return train_fails(tmp_path, capsys, "--max-steps", "3", "--resume", "auto")

    model_file = last / "model.safetensors"
    good = model_file.read_bytes()
    model_file.write_bytes(good[: len(good) // 2])
    err = resume_error()
    assert_names(err, str(model_file), "corrupt", f"--resume {first}")
    model_file.write_bytes(good)

    state_file = last / ckpt_lib.STATE
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "step": "2"}))
    err = resume_error()
    assert_names(err, str(state_file), "'step'", "integer", "got '2'")
    state_file.write_text(json.dumps(state)[:100])
    assert_names(resume_error(), str(state_file), "corrupt", "JSONDecodeError")
    state_file.write_text(json.dumps(state))

    opt_file = last / "optimizer.pt"
    good_opt = opt_file.read_bytes()
    torch.save({"state": Evil()}, opt_file)
    err = resume_error()
    assert_names(err, str(opt_file), "pickled Python objects", "tests.utils.Evil", "refused")
    assert "weights_only=False" not in err
    opt_file.write_bytes(np.random.default_rng(0).bytes(4096))  # random bytes: not a pickle at all
    err = resume_error()
    assert_names(err, str(opt_file), "not a file written by torch.save", "corrupt", "UnpicklingError")
    assert "pickled Python objects" not in err and "weights_only" not in err
    # The optimizer.pt of another model (DiT-T/2: no LePE, no gate) and one with moments of another shape.
    from nala_dit.models.dit import create_model

    other = create_model("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    torch.save(torch.optim.AdamW(other.parameters()).state_dict(), opt_file)
    err = resume_error()
    here = len(ckpt_lib.open_checkpoint(run).weights("model"))
    assert err.startswith("error: "), err
    assert_names(err, str(opt_file), "does not fit this model's optimizer",
                 f"{len(list(other.parameters()))} parameters in the file, {here} here",
                 "optimizer.pt written with this checkpoint", f"--resume {first}")
    state = torch.load(__import__("io").BytesIO(good_opt), weights_only=True)
    i = min(state["state"])  # the first parameter with moments (pos_embed is frozen)
    state["state"][i]["exp_avg"] = torch.zeros(3, 5)
    torch.save(state, opt_file)
    assert_names(resume_error(), f"exp_avg of parameter {i}", "(3, 5) in the file",
                 f"{tuple(state['state'][i]['exp_avg_sq'].shape)} here")
    opt_file.write_bytes(good_opt)

    # Disk full while saving: one line, the partial copy removed, the last checkpoint intact.
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_lib.torch, "save", full_disk)
    err = resume_error()
    monkeypatch.undo()
    assert_names(err, f"cannot write checkpoint {run / 'checkpoints' / '0000003'}", "No space left on device",
                 f"previous checkpoint {last} is intact")
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
    assert err.startswith("error: "), err
    assert_names(err, f"not writing checkpoint {ckpts / '0000002'}", "ema tensor final_layer.linear.bias",
                 "1 non-finite value", f"last good checkpoint is {ckpts / '0000001'}",
                 "lower --lr", "--max-grad-norm 1", "--mixed-precision no")
    assert sorted(p.name for p in ckpts.iterdir()) == ["0000001"]
    # A NaN checkpoint (written elsewhere, or by an older version): resume and sampling name the file and tensor.
    for which in ("model", "ema"):
        file = ckpts / "0000001" / f"{which}.safetensors"
        tensors = load_file(str(file))
        tensors["blocks.1.mlp.fc2.weight"][0, :3] = float("inf")
        save_file(tensors, str(file))
    cause = ("tensor blocks.1.mlp.fc2.weight", "3 non-finite value", "diverged")
    err = train_fails(tmp_path, capsys, "--max-steps", "3", "--resume", "auto")
    assert err.startswith("error: "), err
    assert_names(err, str(ckpts / "0000001" / "model.safetensors"), *cause, "another checkpoint")
    with pytest.raises(ckpt_lib.CheckpointError) as failure:
        ckpt_lib.load_model(tmp_path / "run")
    assert_names(failure, str(ckpts / "0000001" / "ema.safetensors"), *cause)


def test_a_checkpoint_is_fsynced_file_by_file_then_its_folder(tmp_path, fsynced):
    run = write_checkpoint(tmp_path / "run")
    final = next((run / "checkpoints").iterdir())
    names = {p.name for p in final.iterdir()}
    tmp_dirs = {p.parent for p in fsynced if p.name in names}
    assert {p.name for p in fsynced if p.parent in tmp_dirs} == names     # every file, under its temporary name
    assert fsynced.index(run / "checkpoints") > max(i for i, p in enumerate(fsynced) if p.parent in tmp_dirs)


# --- a damaged sharded checkpoint (train.py --fsdp): one line on every route that reads it ---

@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A real 2-process FSDP run of 2 steps with a sharded checkpoint at step 2."""
    from tests.ranks import run_ranks
    from tests.utils import TINY_RUN

    tmp = tmp_path_factory.mktemp("sharded_run")
    proc = run_ranks(tmp, "train.py", *TINY_RUN, "--fsdp", "--max-steps", "2", "--ckpt-every", "2",
                     "--results-dir", tmp, "--exp-name", "run", processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run"


def _damage(run: Path, how: str) -> Path:
    shards = run / "checkpoints" / "0000002" / "shards"
    if how == "truncated .distcp":
        (shards / "__1_0.distcp").write_bytes((shards / "__1_0.distcp").read_bytes()[:100_000])
    elif how == "missing .distcp":
        (shards / "__0_0.distcp").unlink()
    elif how == "truncated .metadata":
        (shards / ".metadata").write_bytes((shards / ".metadata").read_bytes()[:100])
    return shards


# What each damage is refused as: a shard read past its file's end or a missing shard file is caught by
# the index's own check (checkpoints/shards.py, before torch.distributed.checkpoint reads anything); a
# damaged index by the reader.
_DAMAGE_NAMED = {
    "truncated .distcp": lambda shards: (f"error: {shards}/.metadata: refused: it reads bytes",
                                         "of '__1_0.distcp', which holds 100000 bytes (truncated or crafted)"),
    "missing .distcp": lambda shards: (f"error: {shards}/.metadata: it reads '__0_0.distcp', which is missing",),
    "truncated .metadata": lambda shards: (f"error: {shards}: ",),
}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated .distcp", "missing .distcp", "truncated .metadata"])
def test_a_damaged_sharded_checkpoint_is_one_line_for_consolidate_and_sample(sharded_run, tmp_path, capsys, how):
    """torch.distributed.checkpoint's CheckpointException is a BaseException holding every rank's
    traceback: it is reported as one line naming the shards folder, never as a traceback."""
    import consolidate
    import sample

    run = copy_tree(sharded_run, tmp_path / "run")
    shards = _damage(run, how)
    for call in (lambda: consolidate.main([str(run)]),
                 lambda: sample.main(["--ckpt", str(run), "--labels", "1", *FAST, "--grid", str(tmp_path / "g.png")])):
        assert call() == 1, how
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and "CheckpointException" not in err, err
        assert_names(err.splitlines()[-1], *_DAMAGE_NAMED[how](shards), "use another checkpoint or delete")
    assert not (run / "consolidated").exists() and not (tmp_path / "g.png").exists()


@pytest.mark.slow
def test_an_fsdp_resume_over_a_truncated_shard_is_one_line(sharded_run, tmp_path):
    from tests.ranks import run_ranks
    from tests.utils import TINY_RUN

    run = copy_tree(sharded_run, tmp_path / "run")
    shards = _damage(run, "truncated .distcp")
    proc = run_ranks(tmp_path, "train.py", *TINY_RUN, "--fsdp", "--max-steps", "4", "--ckpt-every", "2",
                     "--results-dir", tmp_path, "--exp-name", "run", "--resume", "auto", processes=2)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "CheckpointException" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert_names(errors[0], *_DAMAGE_NAMED["truncated .distcp"](shards), "use another checkpoint or delete")


@pytest.mark.slow
def test_consolidate_on_a_full_disk_says_free_space_and_rerun_it(sharded_run, tmp_path, capsys, monkeypatch):
    """Not training's `--resume auto`: consolidate.py's own rerun, the sharded checkpoint untouched."""
    import consolidate

    run = copy_tree(sharded_run, tmp_path / "run")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_lib, "save_file", full)
    assert consolidate.main([str(run)]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "--resume" not in err, err
    assert_names(err.splitlines()[-1], "cannot write checkpoint", "No space left on device",
                 f"the sharded checkpoint {run / 'checkpoints' / '0000002'} is untouched", "free space",
                 "rerun the same command")
    assert list((run / "consolidated").iterdir()) == []
    monkeypatch.undo()
    assert consolidate.main([str(run)]) == 0 and (run / "consolidated" / "0000002" / "ema.safetensors").is_file()
