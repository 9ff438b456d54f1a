"""Multi-process runs of the repo's scripts without paying their start-up in every process.

``accelerate launch --multi_gpu --num_processes N script.py ...`` on CPUs (``ACCELERATE_USE_CPU=1``)
starts a launcher and N fresh Pythons, and each one imports torch, diffusers (which imports
torch._dynamo and transformers) and accelerate before its first step: about 5 s of CPU per
process, most of a small test run's cost. ``run_ranks`` starts the same N ranks as forks of one
server process (``multiprocessing``'s forkserver) that imported those modules once: each rank
gets the environment accelerate's launcher gives its workers (``LAUNCH_ENV``; that it matches a
real launch is pinned by tests/test_ranks.py), its own rank variables, a gloo process group of
its own making, and runs the script as ``python script.py ...`` would (``runpy``). The tests
whose subject is the launcher itself (its flags, config files, a killed worker) keep
``tests.utils.launch``, the real ``accelerate launch``.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the server imports once; every rank forked from it finds them loaded.
PRELOAD = ["torch", "accelerate", "nala_dit.training.loop", "nala_dit.diffusion.generate",
           "nala_dit.evaluation.metrics", "tests.ranks",
           # what a run imports on its way (the training log's TensorBoard writer, FSDP and its
           # sharded checkpoints, REPA's DINOv2 encoders): another 2-3 s a process
           "torch.utils.tensorboard", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "transformers.models.dinov2.modeling_dinov2",
           "transformers.models.dinov2_with_registers.modeling_dinov2_with_registers"]
# The variables accelerate's launcher (torchrun underneath) gives every worker of
# `--multi_gpu --mixed_precision no --dynamo_backend no` with ACCELERATE_USE_CPU=1, besides the
# per-rank ones below. Left out: torchrun's agent store (rank 0 hosts the store here), its
# error-file and restart bookkeeping.
LAUNCH_ENV = {"ACCELERATE_USE_CPU": "1", "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO",
              "ACCELERATE_DYNAMO_MODE": "default", "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
              "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
              "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
              "ROLE_NAME": "default", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
GRACE_S = 30   # after one rank fails, how long the others get to stop before they are killed (as torchrun)

_context = None


def context():
    """The forkserver context, started once per process with ``PRELOAD`` imported."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables that differ between the ranks of one launch (``LAUNCH_ENV`` holds the rest)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "MASTER_PORT": str(port)}


def _run_rank(script: str, args: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """One forked process: ``env`` as its whole environment, stdout and stderr into files, then the
    script as ``python script ...`` runs it (its ``sys.exit`` code is this process's exit status)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    import torch

    if "OMP_NUM_THREADS" in env:   # as a fresh process reads it (else torch's default, as the server's)
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


def run_ranks(tmp_path, script: str, *args, processes: int = 2, timeout: int = 300, cwd=ROOT, port: int | None = None,
              **env) -> subprocess.CompletedProcess:
    """``script`` (relative to the repo) on ``processes`` ranks, as ``tests.utils.launch`` runs it
    (same environment, one thread each, output captured as text), with each rank forked from
    the preloaded server. ``stdout`` / ``stderr`` hold the ranks' outputs in rank order; the
    return code is 1 when any rank failed (as the launcher's), else 0."""
    from tests.utils import free_port

    port = port or free_port()
    base = {**os.environ, "HF_HOME": str(Path(tmp_path) / "hf"), "PYTHONPATH": str(ROOT), **LAUNCH_ENV,
            **{k: str(v) for k, v in env.items()}}
    return _run(script, args, [{**base, **rank_env(r, processes, port)} for r in range(processes)], timeout, cwd)


def run_script(tmp_path, script: str, *args, timeout: int = 300, cwd=ROOT, **env) -> subprocess.CompletedProcess:
    """``python script ...`` (relative to the repo) in one process forked from the preloaded
    server: the caller's environment and no launcher's, ``HF_HOME`` in ``tmp_path``, output
    captured as text. For what needs a process of its own (accelerate fixes the precision of
    its first ``Accelerator`` in a process) without its start-up."""
    base = {**os.environ, "HF_HOME": str(Path(tmp_path) / "hf"), **{k: str(v) for k, v in env.items()}}
    return _run(script, args, [base], timeout, cwd, launcher=False)


def _run(script: str, args: tuple, envs: list[dict], timeout: int, cwd, launcher: bool = True) -> subprocess.CompletedProcess:
    """One forked process per environment in ``envs``, all running ``script``; the others are
    killed ``GRACE_S`` after one fails, all of them at ``timeout`` (then TimeoutExpired). The
    return code: the launcher's (1 when any failed) or, with ``launcher=False``, the one
    process's own (-N for a signal, as ``subprocess``); ``codes`` holds each process's."""
    ctx = context()
    script_path = str(ROOT / script)
    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        files = [(os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err")) for r in range(len(envs))]
        procs = [ctx.Process(target=_run_rank, args=(script_path, argv, env, str(cwd), *files[r]), daemon=False)
                 for r, env in enumerate(envs)]
        for proc in procs:
            proc.start()
        deadline, failed_at = time.monotonic() + timeout, None
        while running := [p for p in procs if p.exitcode is None]:
            wait([p.sentinel for p in running], timeout=1.0)
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
                if now > deadline:
                    for p in procs:
                        p.join()
                    raise subprocess.TimeoutExpired([script, *argv], timeout)
        for p in procs:
            p.join()
        codes = [p.exitcode for p in procs]
        outs, errs = ([_read(names[i]) for names in files] for i in (0, 1))
    code = int(any(codes)) if launcher else codes[0]
    done = subprocess.CompletedProcess([script, *argv], code, "".join(outs), "".join(errs))
    done.codes = codes   # each process's own exit status, in rank order
    return done


def _read(path: str) -> str:
    return Path(path).read_text(errors="replace") if os.path.exists(path) else ""


def spawn(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with the processes forked from the
    preloaded server instead of started fresh (``fn(rank, *args)`` in each; an exception in
    any of them is raised here)."""
    import torch.multiprocessing as mp

    context()   # the preload is set before the server starts
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
