"""Shared test helpers: comparisons, the tiny model config, free ports and `accelerate launch`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import nala_dit  # noqa: F401  (teaches diffusers our pipeline names)
import sample
import train as train_cli

ROOT = Path(__file__).resolve().parents[1]
# A digits run in a few steps (train.py flags): the base of most training tests.
TINY_RUN = ["--model", "NaLaDiT-T/2", "--data", "digits", "--global-batch-size", "8", "--num-workers", "0",
            "--sample-every", "0", "--log-every", "1", "--flip", "false"]


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
           cwd=ROOT, config_file=None, **env) -> subprocess.CompletedProcess:
    """``accelerate launch`` of the repo's ``script`` with ``processes`` CPU processes (a gloo
    group: ``--multi_gpu`` with ``ACCELERATE_USE_CPU=1``, the command the README gives for CPUs),
    one thread each. ``cpu_flag`` runs the common mistake instead, ``--cpu --num_processes N``
    (which starts one process); ``config_file`` launches with an accelerate config file instead
    of the flags. ``env`` adds variables; output is captured as text."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), **env}
    if cpu_flag:
        env.pop("ACCELERATE_USE_CPU")
        how = ["--cpu", "--num_processes", str(processes)]
    elif config_file is not None:
        how = ["--config_file", str(config_file), "--num_processes", str(processes)]
    else:
        how = ["--multi_gpu", "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *how, "--main_process_port", str(free_port()),
           str(ROOT / script), *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def dry_run_error(capsys, *argv) -> str:
    """``train.py --dry-run ARGV``: expect the parser's refusal; return its one error line."""
    with pytest.raises(SystemExit) as exc:
        train_cli.main([*argv, "--dry-run"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def _train_main(tmp_path, *argv):
    return train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), *argv])


def cli(*args) -> int:
    return sample.main([str(a) for a in args])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def poison(file: Path, key: str | None = None) -> str:
    """Put a NaN into one tensor of a safetensors file; returns the tensor's name."""
    tensors = load_file(str(file))
    key = key or next(k for k, v in tensors.items() if v.is_floating_point() and v.numel() > 1)
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, str(file))
    return key


def copy_tree(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def train_fails(tmp_path, capsys, *extra, name="run"):
    """Run train.py's main, expect exit code 1, return the one-line error."""
    code = train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", name, *extra])
    captured = capsys.readouterr()
    assert code == 1, captured.out + captured.err
    lines = [line[line.index("error:"):] for line in captured.err.splitlines() if "error:" in line]
    assert len(lines) == 1, captured.err  # one line (a progress bar may precede it)
    return lines[0]


class Evil:  # a pickled object in a checkpoint: refused, and no message may suggest unpickling it
    pass


def assert_names(message, *words: str) -> str:
    """Assert that ``message`` (a string, or a ``pytest.raises`` info / exception: its text)
    names every one of ``words`` (case-sensitive substrings: the problem and the fix, not whole
    sentences); the failure shows the missing words and the message. Returns the text."""
    text = str(message.value) if hasattr(message, "value") else str(message)
    missing = [word for word in words if word not in text]
    assert not missing, f"message lacks {missing!r}:\n{text}"
    return text


def one_line(err) -> str:
    text = str(err.value) if hasattr(err, "value") else str(err)
    assert "\n" not in text, text
    return text


DEEP = "[" * 100_000 + "]" * 100_000   # past the JSON parser's recursion limit


def count_dit_builds(monkeypatch) -> list:
    """The ``hidden_size`` of every DiT built from now on: a test that a bad config is refused
    before anything is allocated expects none."""
    import functools

    from nala_dit.models import dit as models

    built = []
    real_init = models.DiT.__init__

    @functools.wraps(real_init)
    def counting_init(self, *args, **kwargs):
        built.append(kwargs.get("hidden_size"))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(models.DiT, "__init__", counting_init)
    return built


def record_results(monkeypatch, module, name: str, note) -> list:
    """``module.name`` wrapped so that every call also appends ``note(its result)`` to the
    returned list (the call itself unchanged)."""
    real, seen = getattr(module, name), []

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(note(out))
        return out

    monkeypatch.setattr(module, name, recording)
    return seen


def run_cases_file(path: str, env: dict, *pytest_args) -> str:
    """``python -m pytest path`` in a subprocess with ``env`` added (e.g. ``TRITON_INTERPRET=1``,
    which Triton reads when the kernels are defined and which would leak into every other test
    in this process); asserts it passed and returns its output."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path, *pytest_args]
    proc = subprocess.run(cmd, cwd=root, env=full, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def quicker_triton_interpreter() -> None:
    """Skip Triton's interpreter re-patching ``triton.language`` on every call of a
    ``@triton.jit`` helper inside a kernel (the result is the same; the kernels run as they were).

    The interpreter patches the language (``inspect.getmembers`` over three modules, ~1 ms)
    when a kernel starts, and again at each helper call, without ever restoring the helper's
    patches: the kernel's restore at its end undoes both. A helper whose modules the running
    kernel already patched gets the same patches again; that is 40 % of the interpreter
    cases' time (the chunked D = 72 kernels call helpers in their loops). Only a re-patch of
    modules already patched in the same kernel run is skipped (the first helper that sees
    another module, ``triton.language.core``, patches it as before), and outside a kernel
    nothing changes. Installed by ``tests/conftest.py`` where ``TRITON_INTERPRET=1``."""
    from triton.runtime import interpreter as ti

    if getattr(ti, "_nala_quicker", False):
        return
    patch_lang, grid_call = ti._patch_lang, ti.GridExecutor.__call__
    running = []   # per kernel run: ids of the modules patched so far in it

    def langs(fn) -> set:
        return {id(value) for value in fn.__globals__.values() if value is ti.tl or value is ti.tl.core}

    def _patch_lang(fn):
        if running and langs(fn) <= running[-1]:
            return ti._LangPatchScope()      # already patched in this kernel run: nothing to undo
        scope = patch_lang(fn)
        if running:                          # the kernel's own patch, or a helper's of other modules
            running[-1] |= langs(fn)
        return scope

    def __call__(self, *args, **kwargs):
        running.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            running.pop()

    ti._patch_lang, ti.GridExecutor.__call__ = _patch_lang, __call__
    ti._nala_quicker = True
