"""Tests of `nala_dit/cli/parse.py`."""

import pytest

from tests.utils import ROOT, assert_names


@pytest.mark.slow
def test_two_process_error_prints_once(tmp_path):
    """Every rank meets the same bad --data: one error line (rank 0), no traceback of ours;
    what follows is the launcher's own report of the exit."""
    from tests.utils import TINY_RUN, launch

    proc = launch(tmp_path, "train.py", *TINY_RUN, "--data", tmp_path / "nope", "--results-dir", tmp_path,
                  "--max-steps", "1")
    assert proc.returncode == 1
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert_names(errors[0], f"data folder not found: {tmp_path / 'nope'}", "--data takes digits",
                 "ChildFailedError report that follows only repeats")
    assert "train.py\", line" not in proc.stderr  # no traceback through our script


PEER_SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
from nala_dit.cli.parse import report_error, run_main
import torch.distributed as dist

def main():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=int(os.environ["RANK"]),
                            world_size=2)
    dist.barrier()                   # both set up (as a CLI is when its work starts)
    if os.environ["RANK"] == "0":   # rank 0 alone meets an error (a full disk, say): one line, then exits
        return report_error(OSError("cannot write shard-000000.npz: No space left on device"))
    dist.barrier()                   # ... while rank 1 waits for it
    return 0

sys.exit(run_main(main))
"""


@pytest.mark.slow
def test_other_ranks_do_not_print_a_gloo_traceback_after_one_rank_stops(tmp_path):
    """Two real gloo processes; rank 0 stops with its one-line error, rank 1,
    waiting in a barrier, loses its peer: one line, not torch's ~30-line traceback."""
    import os
    import subprocess
    import sys

    from tests.utils import free_port

    script = PEER_SCRIPT.format(root=str(ROOT), port=free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", OMP_NUM_THREADS="1"))
             for r in (0, 1)]
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [1, 1], (err0, err1)
    lines0, lines1 = err0.strip().splitlines(), err1.strip().splitlines()
    assert len(lines0) == 1 and lines0[0].startswith("error: "), err0
    assert_names(lines0[0], "cannot write shard-000000.npz", "No space left on device", "ChildFailedError")
    assert len(lines1) == 1, err1
    assert_names(lines1[0], "rank 1: stopped", "another process of this launch", "the line above from rank 0")


# --- rank 0 after a peer is killed ----------------------------------------------------------
@pytest.mark.parametrize("rank", ["0", "1"])
def test_after_a_peer_is_killed_rank_0_does_not_point_at_itself(monkeypatch, capsys, rank):
    from nala_dit.cli.parse import run_main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)

    def main():
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")

    assert run_main(main) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"rank {rank}: "), err
    assert_names(err, "stopped", "another process")
    if rank == "0":
        assert "from rank 0" not in err and "launcher's report" in err
    else:
        assert "the line above from rank 0" in err


def test_child_env_puts_the_repo_first_and_keeps_what_was_on_the_path(monkeypatch):
    """A benchmark's or study's child imports this checkout first and still sees the packages
    the caller put on PYTHONPATH (the GPU run's unpacked wheels were lost before); None removes
    a variable, a string sets one, the caller's environment is left alone."""
    import os

    from nala_dit.cli.parse import child_env

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/wheels", "/more"]))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = child_env(ROOT, OMP_NUM_THREADS="1", OMP_WAIT_POLICY=None)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/wheels", "/more"]
    assert env["OMP_NUM_THREADS"] == "1" and "OMP_WAIT_POLICY" not in env
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.delenv("PYTHONPATH")
    assert child_env(ROOT)["PYTHONPATH"] == str(ROOT)


@pytest.mark.parametrize("script", ["train", "sample"])
def test_device_flag_says_what_picks_the_device(capsys, script):
    """train.py and sample.py have no --device (accelerate's rule picks it): the error says so and
    names the variables that choose, not the nearest spelling (--fid-every, --vae)."""
    import importlib

    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as stop:
        module.main(["--ckpt", "run", "--device", "cuda"] if script == "sample" else ["--device", "cuda"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "has no --device: " in err and "did you mean" not in err, err
    assert_names(err, "CUDA_VISIBLE_DEVICES", "ACCELERATE_USE_CPU=1", "accelerate launch")


def test_a_parser_whose_subcommand_has_the_flag_keeps_the_spelling_hint():
    """evaluate_fid.py's subcommands have --device: the parser does not claim it has none."""
    import evaluate_fid

    assert "--device" in evaluate_fid.build_parser().all_flags()


def test_the_default_device_follows_accelerates_rule(monkeypatch):
    """sample.py and app.py: CUDA when visible, else the CPU; ACCELERATE_USE_CPU=1 forces the CPU
    (what the --device error says)."""
    import torch

    from nala_dit.cli.parse import ABSENT_FLAGS, default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert default_device() == "cuda"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    assert default_device() == "cpu" and "ACCELERATE_USE_CPU=1 forces the CPU" in ABSENT_FLAGS["--device"]
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == "cpu"
