"""scripts/slurm/train.sbatch: its commands as rendered for a 4-node job (every start with
--resume auto), and the script run on this machine (srun and scontrol played by small
scripts) with the real launcher: SIGUSR1 before the time limit reaches every process through
srun and the launcher, and the job is requeued. (What train.py does with the signal, and that
the stopped run resumes bit for bit: tests/training/test_preempt.py.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils import free_port

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
# Slurm's commands on one machine: scontrol names the nodes and records a requeue; srun runs its
# command once as node 0 and passes USR1 / TERM to it (as srun passes signals to its tasks).
SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && { echo "${3%%,*}"; exit 0; }
echo "$*" >> "$FAKE_SCONTROL_LOG"
"""
SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
SLURM_NODEID=0 "$@" &
child=$!
trap 'kill -USR1 $child' USR1
trap 'kill -TERM $child' TERM
while :; do status=0; wait $child || status=$?; kill -0 $child 2>/dev/null || break; done
exit $status
"""


def _slurm(tmp_path, **env) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "FAKE_SCONTROL_LOG": str(tmp_path / "scontrol.log"),
            "SLURM_JOB_ID": "1234", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "gpu01,gpu02,gpu03,gpu04",
            "SLURM_SUBMIT_DIR": str(ROOT), **env}


def test_the_rendered_commands(tmp_path):
    header = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert {"#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --ntasks-per-node=1"} <= set(header)
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    out = subprocess.run(["bash", str(SBATCH), "--config", "configs/a b.yaml"], capture_output=True, text=True,
                         env=_slurm(tmp_path, NALA_DRY_RUN="1", SLURM_RESTART_COUNT="2"), check=True).stdout
    assert out.splitlines() == [
        "nala-dit: job 1234 start 2: 4 node(s) x 8, rendezvous gpu01:29734",
        "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c exec\\ \\\"\\$0\\\"\\ launch\\ --machine_rank\\ "
        "\\\"\\$SLURM_NODEID\\\"\\ \\\"\\$@\\\" accelerate --multi_gpu --num_machines 4 --num_processes 32 "
        "--main_process_ip gpu01 --main_process_port 29734 --rdzv_backend static --same_network --max_restarts 0 "
        "train.py --config configs/a\\ b.yaml --resume auto "]


# What each launched process runs here instead of train.py (whose signal handling, bitwise resume
# included, is tests/training/test_preempt.py's): it says it is ready, waits for SIGUSR1, records
# its arguments and exits as train.py does after its checkpoint.
WORKER = """import os, signal, sys, time
from pathlib import Path
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
out = Path(sys.argv[1])
(out / f"ready{os.environ['RANK']}").touch()
while not got:
    time.sleep(0.01)
(out / f"stopped{os.environ['RANK']}").write_text(" ".join(sys.argv[2:]))
sys.exit(75)
"""


@pytest.mark.slow
def test_usr1_reaches_every_process_and_the_job_is_requeued(tmp_path):
    """The real launcher (accelerate launch, 2 CPU processes) under the script: SIGUSR1 to the
    batch script reaches both processes through srun and the launcher; the job is requeued."""
    (tmp_path / "worker.py").write_text(WORKER)
    env = _slurm(tmp_path, SLURM_NNODES="1", SLURM_JOB_NODELIST="127.0.0.1", GPUS_PER_NODE="2",
                 MAIN_PORT=str(free_port()), ACCELERATE=str(Path(sys.executable).parent / "accelerate"),
                 SCRIPT=str(tmp_path / "worker.py"), ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1",
                 HF_HOME=str(tmp_path / "hf"))
    job = subprocess.Popen(["bash", str(SBATCH), str(tmp_path), "--config", "x.yaml"], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)) and job.poll() is None:
            assert time.monotonic() < deadline, "the processes did not start within 120 s"
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)   # Slurm's --signal=B:USR1@120: to the batch script
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0 and "stopped by USR1" in out and "requeueing job 1234" in out, out[-3000:]
    assert [(tmp_path / f"stopped{r}").read_text() for r in (0, 1)] == ["--config x.yaml --resume auto"] * 2
    assert (tmp_path / "scontrol.log").read_text() == "requeue 1234\n"
