"""SIGTERM / SIGUSR1 (training/preempt.py): the step ends, its checkpoint is written, exit
status 75, every process at the same step, and the resumed run is the uninterrupted one bit
for bit; a second signal during the save does not cut it."""

import json
import os
import signal
import threading
import time

import pytest
import torch

import train as train_cli
from nala_dit.cli.parse import run_main
from nala_dit.training import checkpoint as ckpt_lib
from nala_dit.training import step as step_lib
from nala_dit.training.preempt import PREEMPTED_EXIT, StopSignals
from tests.ranks import run_ranks
from tests.utils import TINY_RUN


def _same_weights(a, b) -> None:
    a, b = ckpt_lib.open_checkpoint(a), ckpt_lib.open_checkpoint(b)
    assert a.step == b.step and (a.state["epoch"], a.state["position"]) == (b.state["epoch"], b.state["position"])
    for which in ("model", "ema"):
        wa, wb = a.weights(which), b.weights(which)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), which


def test_stop_signals_are_noted_then_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert not stop.requested and signal.getsignal(signal.SIGTERM) == stop._note   # else the kill below kills
        os.kill(os.getpid(), signal.SIGUSR1)   # noted, the process lives on
        os.kill(os.getpid(), signal.SIGTERM)
        assert (stop.name, stop.count) == ("SIGUSR1", 2)
    assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_sigterm_mid_run_saves_exits_75_and_resumes_bitwise(tmp_path, monkeypatch, capsys):
    """A real SIGTERM in step 3 (while its batch is read) and another while its checkpoint
    is written: the run stops after step 3 with that checkpoint whole, exit status 75;
    resumed to 5 it equals a run straight to 5."""
    run = TINY_RUN + ["--results-dir", str(tmp_path), "--max-steps", "5", "--ckpt-every", "100"]
    assert train_cli.main([*run, "--exp-name", "straight"]) == 0

    calls, real_next, real_save = [0], step_lib.EpochBatches.next, ckpt_lib.save_file

    def next_with_signal(self):
        calls[0] += 1
        if calls[0] == 3:
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL   # the run's handler, or the kill would kill
            os.kill(os.getpid(), signal.SIGTERM)
        return real_next(self)

    def save_with_signal(tensors, path):
        assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)   # a second signal in the middle of the save
        real_save(tensors, path)

    monkeypatch.setattr(step_lib.EpochBatches, "next", next_with_signal)
    monkeypatch.setattr(ckpt_lib, "save_file", save_with_signal)
    capsys.readouterr()
    assert run_main(lambda: train_cli.main([*run, "--exp-name", "stopped"])) == PREEMPTED_EXIT == 75
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"stopped: SIGTERM at step 3: wrote checkpoint {tmp_path / 'stopped' / 'checkpoints' / '0000003'}; "
                   f"run the same command with --resume auto to continue from it")
    monkeypatch.undo()
    assert [p.name for p in ckpt_lib.list_checkpoints(tmp_path / "stopped" / "checkpoints")] == ["0000003"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # the handlers are the process's again
    assert train_cli.main([*run, "--exp-name", "stopped", "--resume", "auto"]) == 0
    _same_weights(tmp_path / "straight", tmp_path / "stopped")


def _signal_rank0_after(run_dir, step: int, sent: list, ended: threading.Event) -> None:
    """SIGTERM to rank 0 alone (its pid is in the run folder's lock) once checkpoint ``step`` is there."""
    while not ended.is_set():
        if (run_dir / "checkpoints" / f"{step:07d}").is_dir():
            try:
                pid = json.loads((run_dir / ".lock").read_text())["pid"]
            except (OSError, ValueError, KeyError):
                pid = None
            if pid:
                os.kill(pid, signal.SIGTERM)
                sent.append(pid)
                return
        time.sleep(0.01)


@pytest.mark.slow
def test_two_processes_stop_at_one_step_and_resume_bitwise(tmp_path):
    """SIGTERM to rank 0 alone: both ranks stop at the same step (the flag rides the step's
    gather), both exit 75; resumed, the run equals an uninterrupted one bit for bit."""
    run = TINY_RUN + ["--results-dir", str(tmp_path), "--ckpt-every", "2"]
    sent, ended = [], threading.Event()
    signaller = threading.Thread(target=_signal_rank0_after, args=(tmp_path / "stopped", 2, sent, ended))
    signaller.start()
    try:
        proc = run_ranks(tmp_path, "train.py", *run, "--exp-name", "stopped", "--max-steps", "100000", timeout=300)
    finally:
        ended.set()
        signaller.join()
    assert sent and proc.codes == [PREEMPTED_EXIT, PREEMPTED_EXIT], (proc.codes, proc.stderr[-2000:])
    stopped = ckpt_lib.list_checkpoints(tmp_path / "stopped" / "checkpoints")
    last = int(stopped[-1].name)
    assert last >= 2 and f"stopped: SIGTERM at step {last}: wrote checkpoint" in proc.stderr
    end = last + 2
    for name, extra in (("stopped", ["--resume", "auto"]), ("straight", [])):
        proc = run_ranks(tmp_path, "train.py", *run, "--exp-name", name, "--max-steps", str(end), *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    _same_weights(tmp_path / "straight", tmp_path / "stopped")
