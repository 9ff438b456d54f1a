"""The run lock (`nala_dit/runlock.py`): one writer per run folder, and the launcher's process count."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from nala_dit.runlock import LOCK_NAME, LockedError, RunLock
from tests.training.test_loop import (
    run_train,
)
from tests.utils import assert_names, train_fails


def test_run_folder_lock(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = dict(pid=holder.pid, host=socket.gethostname(), time=time.time())
        (run / LOCK_NAME).write_text(json.dumps(lock))
        err = train_fails(tmp_path, capsys, "--max-steps", "1", "--ckpt-every", "1")
        assert_names(err, f"run folder {run}", f"pid {holder.pid}", f"host {socket.gethostname()}",
                     "choose another --exp-name")
        assert not (run / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder died (kill -9): its lock is stale and taken over; a killed save's
    # temporary folder is removed.
    (run / "checkpoints" / ".tmp-99999-0000003").mkdir(parents=True)
    run_train(tmp_path, "--max-steps", "1", "--ckpt-every", "1")
    assert_names(capsys.readouterr().out, "stale lock", str(run / LOCK_NAME), f"pid {holder.pid} is gone")
    assert not (run / LOCK_NAME).exists()  # released at the end
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000001"]


def test_lock_is_exclusive_and_released(tmp_path):
    path = tmp_path / "x.lock"
    with RunLock(path, "output x", "use another --out"):
        holder = json.loads(path.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(LockedError) as err:
            RunLock(path, "output x", "use another --out").acquire()
        assert_names(err, "output x", f"pid {os.getpid()}", "use another --out")
    assert not path.exists()
    # A running pid that started after the lock was written is a reused pid: stale.
    path.write_text(json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), time=0.0)))
    with RunLock(path, "output x"):
        assert json.loads(path.read_text())["time"] > 0
    # A lock from another host cannot be checked: never taken over silently.
    path.write_text(json.dumps(dict(pid=1, host="elsewhere", time=0.0)))
    with pytest.raises(LockedError) as err:
        RunLock(path, "output x").acquire()
    assert_names(err, "host elsewhere", f"delete {path}")


def test_launcher_process_count_mismatch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = train_fails(tmp_path, capsys, "--max-steps", "1")
    assert_names(err, "started 2 processes", "Accelerate sees 1", "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu",
                 "--num_processes 2", "train.py")
    assert not (tmp_path / "run").exists()


def test_single_process_accelerate_launch_is_recognised(monkeypatch):
    """What accelerate's one-process launcher leaves behind (checked against the real launcher
    in tests/training/test_loop.py): ACCELERATE_USE_CPU, MASTER_ADDR, no WORLD_SIZE, its argv as our parent."""
    from nala_dit.runlock import single_process_launch

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


def test_launch_mistakes_are_refused_before_torch_loads(tmp_path, monkeypatch):
    """``check_launch`` reads the launcher's environment alone: a --context-parallel that does
    not divide WORLD_SIZE is refused with the numbers and the fix, a divisor passes; train.py
    and sample.py (mass sampling) ask it before importing torch, so the error comes without
    torch's ~5 s of imports."""
    from nala_dit.runlock import check_launch
    from tests.utils import ROOT, TINY_RUN

    monkeypatch.setenv("WORLD_SIZE", "4")
    check_launch("train.py", 2)
    with pytest.raises(ValueError) as err:
        check_launch("train.py", 3)
    assert_names(str(err.value), "--context-parallel 3", "number of processes (4)", "multiple of 3 processes",
                 "divisor of 4")
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0"}
    for script, argv in (("train", [*TINY_RUN, "--results-dir", str(tmp_path)]),
                         ("sample", ["--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "s.npz"),
                                     "--num-samples", "4"])):
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {script}; "
                f"code = {script}.main({[*argv, '--context-parallel', '3']!r}); print(code, 'torch' in sys.modules)")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
        assert proc.stdout.split() == ["1", "False"], (script, proc.stderr)
        assert_names(proc.stderr, "error: --context-parallel 3 must divide the number of processes (2)")
        assert not any(tmp_path.iterdir()), script
