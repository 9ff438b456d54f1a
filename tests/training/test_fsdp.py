"""FSDP2 (``train.py --fsdp``, nala_dit/training/sharding.py) with real gloo processes:
it trains what DDP trains, resumes bit for bit after a rank is killed, composes with
context parallel, and its sharded checkpoints read, consolidate and refuse crafted files."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from nala_dit.training import checkpoint as ckpt_lib
from nala_dit.checkpoints import shards
from nala_dit.training import sharding
from tests.ranks import run_ranks
from tests.utils import ROOT, assert_names, free_port, launch

RUN = ["--model", "NaLaDiT-T/2", "--data", "digits", "--global-batch-size", "8", "--grad-accum", "2",
       "--num-workers", "0", "--sample-every", "0", "--log-every", "1", "--flip", "false", "--lr", "1e-3",
       "--max-grad-norm", "0.05", "--ema-decay", "0.9"]
TOL = 1e-5


def _weights(path, which="model"):
    return ckpt_lib.open_checkpoint(path).weights(which)


def _largest_difference(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _train(tmp_path, name, *extra, processes=2, config_file=None):
    """``train.py`` on ``processes`` ranks: forked from the preloaded server (tests/ranks.py), or
    with ``config_file`` by the real ``accelerate launch --config_file``."""
    args = (tmp_path, "train.py", *RUN, "--results-dir", tmp_path, "--exp-name", name, *extra)
    proc = run_ranks(*args, processes=processes) if config_file is None else \
        launch(*args, processes=processes, config_file=config_file)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory, digits_classifier_dir):
    """DDP and FSDP runs of the same 4 steps on 2 processes (grad-accum 2, clipped), with a
    sample grid, the held-out loss and FID while training. The counts leave the processes
    unequal work: 17 held-out items in batches of 8 (9 and 8: two batches and one), 9 FID
    samples in batches of 2 (5 and 4: three and two), which FSDP must run in step."""
    from nala_dit.evaluation import metrics

    tmp = tmp_path_factory.mktemp("fsdp")
    ref = tmp / "digits.npz"
    metrics.make_reference(ref, dataset="digits-heldout", features="digits", digits_classifier_dir=digits_classifier_dir)
    evaluate = ["--sample-every", "4", "--sample-steps", "4", "--val-every", "2", "--val-samples", "17",
                "--fid-every", "4", "--fid-ref", ref, "--fid-samples", "9", "--digits-classifier", digits_classifier_dir]
    out = {"root": tmp}
    out["ddp"] = _train(tmp, "ddp", "--max-steps", "4", "--ckpt-every", "4", *evaluate)
    out["fsdp"] = _train(tmp, "fsdp", "--fsdp", "--max-steps", "4", "--ckpt-every", "2", *evaluate)
    return out


@pytest.mark.slow
def test_fsdp_trains_what_ddp_trains(runs):
    root = runs["root"]
    assert_names(runs["fsdp"].stdout, "fsdp: parameters, gradients, AdamW state and EMA sharded over 2 processes",
                 "mesh 2 data-parallel × 1 context-parallel")
    for which in ("model", "ema"):
        diff = _largest_difference(_weights(root / "ddp", which), _weights(root / "fsdp", which))
        assert diff <= TOL, (which, diff)
    assert _weights(root / "ddp")["final_layer.linear.weight"].abs().max() > 1e-3   # the steps moved the weights
    # the log's losses and clipped gradient norms are the same numbers
    logs = [[json.loads(line) for line in (root / name / "log.jsonl").read_text().splitlines()] for name in ("ddp", "fsdp")]
    for a, b in zip(*logs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        # evaluation on the sharded model and EMA: the same held-out losses and FID-type scores
        scores = [k for k in a if k.startswith(("val/", "fid/"))]
        assert {k: b[k] for k in scores} == pytest.approx({k: a[k] for k in scores}, rel=1e-4, abs=1e-6)
    assert [r["step"] for r in logs[1] if "val/ema_loss_noise_high" in r] == [2, 4]
    assert [r["step"] for r in logs[1] if "fid/fd_digits" in r] == [4]
    # the EMA grid, sampled by every process and written by one: the DDP run's pixels (within a level)
    grids = [np.asarray(Image.open(root / name / "samples" / "0000004.png"), dtype=np.int16) for name in ("ddp", "fsdp")]
    assert np.abs(grids[0] - grids[1]).max() <= 1
    # AdamW's moments, read back in the single-file numbering
    opt_ddp, opt_fsdp = (ckpt_lib.open_checkpoint(root / n).optimizer_state() for n in ("ddp", "fsdp"))
    assert opt_ddp["state"].keys() == opt_fsdp["state"].keys()
    for i, moments in opt_ddp["state"].items():
        for key, value in moments.items():
            assert (value - opt_fsdp["state"][i][key]).abs().max() <= TOL, (i, key)


@pytest.mark.slow
def test_a_sharded_checkpoint_holds_shards_and_consolidates_to_the_single_file_one(runs):
    import consolidate

    root = runs["root"]
    ckpt = ckpt_lib.open_checkpoint(root / "fsdp")
    assert ckpt.sharded and ckpt.state["sharded"]["processes"] == 2
    assert sorted(p.name for p in (ckpt.path / "shards").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (ckpt.path / "model.safetensors").exists()
    assert consolidate.main([str(root / "fsdp")]) == 0
    plain = ckpt_lib.open_checkpoint(root / "fsdp" / "consolidated" / "0000004")
    assert not plain.sharded and plain.state["consolidated_from"] == str(ckpt.path)
    for which in ("model", "ema"):   # the same tensors, now in the single-file layout
        a, b = ckpt.weights(which), plain.weights(which)
        assert all(torch.equal(a[k], b[k]) for k in a)
    model, _ = ckpt_lib.load_model(plain.path)   # what sample.py and export.py load
    assert sum(p.numel() for p in model.parameters()) == sum(v.numel() for v in plain.weights("ema").values())
    assert consolidate.main([str(root / "fsdp")]) == 1   # never replaced


@pytest.mark.slow
def test_repa_under_fsdp_resumes_to_what_ddp_trains(tmp_path, tiny_dinov2):
    """REPA's projector is sharded beside the model (its own root unit). A DDP run's
    single-file checkpoint resumes under FSDP, launched the way accelerate's users launch
    (the config file, no ``--fsdp``), which says so in its own line; its sharded checkpoint
    resumes again (``--fsdp``); the optimizer state is keyed by ``model.`` / ``projector.``
    names throughout. The result is the uninterrupted DDP run's."""
    repa = ["--repa-encoder", tiny_dinov2, "--repa-projector-dim", "16"]
    _train(tmp_path, "ddp", *repa, "--max-steps", "4", "--ckpt-every", "4")
    _train(tmp_path, "fsdp", *repa, "--max-steps", "2", "--ckpt-every", "2")
    proc = _train(tmp_path, "fsdp", *repa, "--max-steps", "3", "--ckpt-every", "1", "--resume", "auto",
                  config_file=ROOT / "configs" / "accelerate" / "fsdp2.yaml")
    assert_names(proc.stdout, f"resumed from {tmp_path / 'fsdp' / 'checkpoints' / '0000002'}",
                 "sharded over 2 processes", "trained without --fsdp", "shards it")
    assert ckpt_lib.open_checkpoint(tmp_path / "fsdp").sharded
    proc = _train(tmp_path, "fsdp", *repa, "--fsdp", "--max-steps", "4", "--ckpt-every", "1", "--resume", "auto")
    assert f"resumed from {tmp_path / 'fsdp' / 'checkpoints' / '0000003'}" in proc.stdout
    assert "--fsdp, this run" not in proc.stdout   # trained with --fsdp, resumed with it: no line
    for which in ("model", "ema", "projector"):
        diff = _largest_difference(_weights(tmp_path / "ddp", which), _weights(tmp_path / "fsdp", which))
        assert diff <= TOL, (which, diff)
    import consolidate   # ... and the single-file checkpoint keeps the projector

    assert consolidate.main([str(tmp_path / "fsdp")]) == 0
    plain = ckpt_lib.open_checkpoint(tmp_path / "fsdp" / "consolidated" / "0000004")
    assert plain.has_projector and not plain.sharded
    sharded = _weights(tmp_path / "fsdp", "projector")
    assert all(torch.equal(v, plain.weights("projector")[k]) for k, v in sharded.items())


@pytest.mark.slow
def test_a_killed_rank_then_the_same_command_resumes_bitwise(tmp_path):
    steps = ["--max-steps", "8", "--ckpt-every", "2", "--resume", "auto"]
    _train(tmp_path, "straight", "--fsdp", *steps)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "HF_HOME": str(tmp_path / "hf")}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           str(ROOT / "train.py"), *RUN, "--results-dir", str(tmp_path), "--exp-name", "killed", "--fsdp", *steps]
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = tmp_path / "killed" / "checkpoints" / "0000002" / "state.json"
    deadline = time.time() + 120
    while not first.is_file() and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    workers = _children(launcher.pid)
    assert first.is_file() and launcher.poll() is None and workers, "the run ended before a rank could be killed"
    os.kill(workers[-1], signal.SIGKILL)
    assert launcher.wait(timeout=120) != 0
    killed_at = ckpt_lib.open_checkpoint(tmp_path / "killed").step
    assert killed_at < 8
    # the resume through the real launcher too: "the same command" the user runs after the kill
    proc = launch(tmp_path, "train.py", *RUN, "--results-dir", tmp_path, "--exp-name", "killed", "--fsdp", *steps)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {tmp_path / 'killed' / 'checkpoints' / f'{killed_at:07d}'}" in proc.stdout
    for which in ("model", "ema"):
        a, b = _weights(tmp_path / "straight", which), _weights(tmp_path / "killed", which)
        assert all(torch.equal(a[k], b[k]) for k in a), which


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (the launcher's workers), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


@pytest.mark.slow
def test_fsdp_with_context_parallel_2_trains_what_one_process_trains(tmp_path):
    import train as train_cli

    one_image_group = ["--global-batch-size", "4", "--grad-accum", "1", "--max-steps", "3", "--ckpt-every", "3"]
    proc = _train(tmp_path, "split", "--fsdp", "--context-parallel", "2", *one_image_group)
    assert_names(proc.stdout, "mesh 1 data-parallel × 2 context-parallel", "4 token rows split as [2, 2]")
    assert train_cli.main([*RUN, "--results-dir", str(tmp_path), "--exp-name", "one", *one_image_group]) == 0
    for which in ("model", "ema"):
        one = _weights(tmp_path / "one", which)
        scale = max(v.abs().max().item() for v in one.values())
        assert _largest_difference(one, _weights(tmp_path / "split", which)) <= TOL * max(1.0, scale), which


@pytest.mark.slow
def test_fsdp_on_a_2x2_mesh_trains_what_2_data_parallel_processes_train(runs, tmp_path):
    """4 processes: 2 data-parallel groups × 2 context-parallel rows, sharded over all 4; the
    2-process DDP run of the same steps sees the same images with the same draws."""
    proc = _train(tmp_path, "mesh", "--fsdp", "--context-parallel", "2", "--max-steps", "4", "--ckpt-every", "4",
                  processes=4)
    assert_names(proc.stdout, "sharded over 4 processes", "mesh 2 data-parallel × 2 context-parallel")
    for which in ("model", "ema"):
        diff = _largest_difference(_weights(runs["root"] / "ddp", which), _weights(tmp_path / "mesh", which))
        assert diff <= TOL, (which, diff)


# ------------------------------------------------------------------ without processes
def test_an_fsdp1_accelerate_config_is_refused_and_fsdp2_is_read():
    assert sharding.fsdp_from_launcher({}) is False
    assert sharding.fsdp_from_launcher({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}) is True
    with pytest.raises(ValueError) as err:
        sharding.fsdp_from_launcher({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})
    assert_names(str(err.value), "FSDP version 1", "fsdp_version: 2", "configs/accelerate/fsdp2.yaml")
    assert sharding.reshard_after_forward({"FSDP_RESHARD_AFTER_FORWARD": "false"}) is False
    assert sharding.reshard_after_forward({}) is True


def test_what_fsdp_cannot_do_is_one_line_naming_the_fix():
    with pytest.raises(ValueError) as err:
        sharding.check_fsdp(1, "no")
    assert_names(str(err.value), "one", "--num_processes", "drop --fsdp")
    with pytest.raises(ValueError) as err:
        sharding.check_fsdp(2, "fp16")
    assert_names(str(err.value), "fp16", "--mixed-precision bf16")
    with pytest.raises(ValueError) as err:   # the mesh: data-parallel groups x context-parallel processes
        sharding.check_fsdp(2, "no", context_parallel=3)
    assert_names(err, "--context-parallel 3", "number of processes (2)", "multiple of 3", "divisor of 2")
    sharding.check_fsdp(2, "bf16")
    sharding.check_fsdp(4, "no", context_parallel=2)


def test_fsdp_on_one_process_is_refused_before_anything_is_built(tmp_path, capsys):
    import train as train_cli

    assert train_cli.main([*RUN, "--results-dir", str(tmp_path), "--exp-name", "one", "--fsdp", "--max-steps", "1"]) == 1
    err = capsys.readouterr().err
    assert_names(err, "--fsdp shards the model over processes", "drop --fsdp")
    assert not (tmp_path / "one").exists()


def test_optimizer_state_numbering_round_trips():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW([dict(params=[model[1].weight, model[0].weight]),
                             dict(params=[model[0].bias, model[1].bias], weight_decay=0.0)])
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    plain = opt.state_dict()
    names = ["1.weight", "0.weight", "0.bias", "1.bias"]   # the optimizer's order, not the model's
    named = shards.by_name(plain, names)
    assert named["param_groups"][1]["params"] == ["0.bias", "1.bias"]
    assert torch.equal(named["state"]["1.weight"]["exp_avg"], plain["state"][0]["exp_avg"])
    back = shards.by_number(named)
    assert back["param_groups"] == plain["param_groups"]
    assert all(torch.equal(back["state"][i]["exp_avg_sq"], plain["state"][i]["exp_avg_sq"]) for i in plain["state"])
    with pytest.raises(ValueError, match="4 parameters"):
        shards.by_name(plain, names[:3])


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_crafted_shards_metadata_runs_no_code(tmp_path, monkeypatch):
    """torch.distributed.checkpoint unpickles ``.metadata`` with plain pickle: the reader
    here accepts only the format's own classes."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "0000001"
    (folder / "shards").mkdir(parents=True)
    (folder / "shards" / ".metadata").write_bytes(pickle.dumps(_Payload()))
    (folder / "state.json").write_text(json.dumps(dict(
        step=1, epoch=0, position=0, world_size=2, config={}, sharded=dict(processes=2),
        model_config=dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2,
                          num_classes=10))))
    ckpt = ckpt_lib.open_checkpoint(folder)
    with pytest.raises(ckpt_lib.CheckpointError) as err:
        ckpt.weights("ema")
    assert_names(str(err.value), "shards", "posix.system")
    assert not (tmp_path / "PWNED").exists()
