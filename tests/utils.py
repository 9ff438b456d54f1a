"""Shared test helpers: comparisons, the tiny model config, free ports and `accelerate launch`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Relative RMS error ‖out − ref‖ / ‖ref‖ in float64."""
    ref, out = ref.double(), out.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float) -> None:
    """Relative-RMS comparison that names what failed and by how much."""
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    err = rel_rms(ref, out)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"


# One tiny model shared by all model tests (diffusers' get_init_dict style):
# depth 2, 2 heads, hidden 32, 8×8 latents with 4 channels, 10 classes.
TINY = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2,
            num_heads=2, num_classes=10)


def free_port() -> int:
    """A TCP port nothing listens on now (for a process group or accelerate launch)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(tmp_path, script: str, *args, processes: int = 2, cpu_flag: bool = False, timeout: int = 300,
           cwd=ROOT, **env) -> subprocess.CompletedProcess:
    """``accelerate launch`` of the repo's ``script`` with ``processes`` CPU processes (a gloo
    group: ``--multi_gpu`` with ``ACCELERATE_USE_CPU=1``, the command the README gives for CPUs),
    one thread each. ``cpu_flag`` runs the common mistake instead, ``--cpu --num_processes N``
    (which starts one process). ``env`` adds variables; output is captured as text."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), **env}
    if cpu_flag:
        env.pop("ACCELERATE_USE_CPU")
        how = ["--cpu", "--num_processes", str(processes)]
    else:
        how = ["--multi_gpu", "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *how, "--main_process_port", str(free_port()),
           str(ROOT / script), *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
