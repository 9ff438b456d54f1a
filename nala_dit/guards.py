"""Checks on what a user (or an attacker) hands us, made before anything is allocated or
written; each failure is one line naming the file or flag, the problem and the way out.
Ground floor: torch only, no model code (``models/files.py`` checks stored model configs).

* ``check_finite_samples`` / ``non_finite`` / ``refuse_non_finite``: NaN and inf in
  samples (never turned into images) and in weights (never sampled from).
* ``check_sample_memory``: a lower bound on what sampling at a size needs, against the
  memory this machine has, before the first allocation.
* ``check_writable``: an output path can be written, checked before the work that fills it.
* ``read_json``: a stored JSON file, invalid or nested too deeply to parse, as one line.
* ``torch_load_tensors`` / ``load_error_cause``: ``torch.load(weights_only=True)`` whose
  failures (a refused pickle that asks to run code, a damaged file) are one line;
  ``BuildCheckedUnpickler``: the base of this package's own restricted unpicklers (sharded
  checkpoint indexes, TorchScript module records).
* ``atomic_write`` / ``write_new_file`` / ``refuse_existing``: outputs written under a
  temporary name and renamed into place; a user's existing file is never replaced silently.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
from pathlib import Path

import torch

from .checks import read_text, too_many_digits


class NonFiniteError(FloatingPointError, ValueError):
    """Samples or weights holding NaN or inf (a ValueError too: the CLIs print it in one line)."""


class CheckpointError(ValueError):
    """A checkpoint or weights file that cannot be used; the message names the file, cause and fix."""


class TooLargeError(MemoryError, ValueError):
    """A request that cannot fit in this machine's memory, refused before allocating."""


def read_json(path: str | os.PathLike, fix: str):
    """The JSON in ``path``; a binary file, invalid JSON, a number past Python's digit limit,
    or lists and objects nested past Python's recursion limit (the parser recurses per level),
    is a ValueError naming the file and ``fix``."""
    path = Path(path)
    text = read_text(path, f"expected a JSON text file; {fix}")
    try:
        return json.loads(text)
    except ValueError as err:
        raise ValueError(f"{path}: {too_many_digits(err) or f'not valid JSON ({err})'}; {fix}") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to read (lists or objects inside each other thousands of "
                         f"levels deep); {fix}") from None


def check_finite_samples(x: torch.Tensor) -> None:
    """Refuse a batch of samples (B, ...) holding NaN or inf: cast to uint8 NaN becomes 0
    (a black image, scored as if real)."""
    finite = torch.isfinite(x).flatten(1).all(1)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        raise NonFiniteError(
            f"{len(bad)} of {len(x)} samples hold NaN or inf (first: sample {bad[0]} of its batch), so no image is "
            f"written: the weights hold non-finite values or the guidance is too strong for the precision; check "
            f"the model (export or train it again) and use a guidance scale of a few units")


def non_finite(tensors: dict, what: str) -> str | None:
    """``"<what> tensor <name> holds <n> non-finite value(s)"`` for the first tensor with a NaN or inf, else None."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{what} tensor {name} holds {int((~torch.isfinite(t)).sum())} non-finite value(s)"
    return None


def state_dict_mismatch(expected: dict, got: dict) -> str:
    """'' when ``got`` loads strictly into a module with ``expected``; else a short summary."""
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    shapes = [f"{k}: {tuple(got[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in got and tuple(got[k].shape) != tuple(v.shape)]
    parts = [f"{len(items)} {what} (e.g. {items[0]})" for what, items in
             (("missing", missing), ("unexpected", unexpected), ("shape mismatches, file vs model", shapes)) if items]
    return ", ".join(parts)


def assert_no_meta(module: torch.nn.Module, where: str) -> None:
    """diffusers leaves weights missing from a checkpoint on ``meta`` with only a warning."""
    meta = [name for name, p in module.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(f"{where}: {len(meta)} parameters were not in the saved weights and stayed on the "
                         f"meta device (e.g. {meta[:3]}); the folder does not match this model class")


def refuse_non_finite(module: torch.nn.Module, where: str) -> None:
    """A ValueError naming the first tensor of ``module`` holding a NaN or inf."""
    if problem := non_finite(module.state_dict(), "its"):
        raise ValueError(f"{where}: {problem}: the weights are damaged or come from a run that diverged; export "
                         f"them again from a good checkpoint")


# ------------------------------------------------------------------ sampling memory
def available_memory(device) -> tuple[int, str]:
    """(bytes free, what was asked) for a device: CUDA's free memory, else the host's
    ``MemAvailable`` (Linux) or total physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {torch.cuda.get_device_name(device)}"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available RAM"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "RAM"


def sample_memory(model, latent_hw: tuple[int, int], batch: int, vae_factor: int = 1, guided: bool = False) -> int:
    """A lower bound on the bytes one sampling batch holds at once (fp32): the noise and
    the model output per latent pixel; per token, at the MLP's activation, the block's
    input, the MLP's input, its first layer's output and the activation's (``Mlp``
    keeps all four alive); the decoded RGB pixels. Guidance runs the model on 2× the
    batch. Weights, attention buffers and the VAE decoder's activations come on top."""
    h, w = latent_hw
    cfg = model.config
    tokens = (h // cfg.patch_size) * (w // cfg.patch_size)
    runs = 2 * batch if guided else batch
    model_bytes = runs * (h * w * (model.in_channels + model.out_channels)
                          + tokens * cfg.hidden_size * (2 + 2 * cfg.mlp_ratio))
    return int(4 * (model_bytes + batch * 3 * h * w * vae_factor ** 2))


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def check_sample_memory(model, latent_hw: tuple[int, int] | None, batch: int, vae_factor: int, device,
                        what: str, fix: str, guided: bool = False) -> None:
    """Refuse, before any allocation, a sampling batch whose lower-bound memory
    (``sample_memory``) exceeds what ``device`` has free."""
    if latent_hw is None:
        return
    need = sample_memory(model, latent_hw, batch, vae_factor, guided)
    have, kind = available_memory(device)
    if need > have:
        h, w = latent_hw
        raise TooLargeError(f"{what}: sampling {batch} image(s) of {h * vae_factor}x{w * vae_factor} px needs at least "
                          f"{_bytes(need)} of memory, this machine has {_bytes(have)} {kind}; {fix}")


# ------------------------------------------------------------------ outputs
def check_writable(path: str | os.PathLike, flag: str, folder: bool = False, image: bool = False) -> None:
    """Refuse an output path that cannot be written, before the work that fills it: an
    existing folder where a file goes (or a file where a folder goes), a parent that is
    a file, no write permission, or (``image``) a file name PIL cannot save to. Creates nothing."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        kind = "a folder" if path.is_dir() else "a file"
        raise ValueError(f"{flag} {path}: {kind} is in the way; choose another {flag}")
    if image:
        from PIL import Image

        if path.suffix.lower() not in Image.registered_extensions():
            raise ValueError(f"{flag} {path}: {path.suffix or 'no extension'} is not an image format PIL can write; "
                             f"use e.g. .png")
    parent = path if folder and path.exists() else path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder; choose another {flag}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{flag} {path}: cannot write in {parent} (permission denied); choose another {flag}")


# ------------------------------------------------------------------ durable renames
def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's or a folder's entries to the disk (``os.fsync``). A folder that cannot
    be opened for it (not POSIX) is skipped: the rename stays atomic, only not durable."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if Path(path).is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if Path(path).is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not Path(path).is_dir():
            raise
    finally:
        os.close(fd)


def durable_replace(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """``os.replace(tmp, final)`` that survives a power loss: every file under ``tmp`` (or
    ``tmp`` itself) and its folders are fsynced before the rename, ``final``'s folder
    after it. Without this a rename can reach the disk before the data it names, and a
    crash leaves a complete-looking file or folder of empty or truncated files."""
    tmp, final = Path(tmp), Path(final)
    if tmp.is_dir():
        for folder, _, files in os.walk(tmp):
            for name in files:
                fsync_path(Path(folder) / name)
            fsync_path(folder)
    else:
        fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


def durable_publish(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """``durable_replace`` for a name that must be new: ``os.link`` publishes ``tmp`` as ``final``
    only while no file of that name exists (a file created there since the command's first check
    is never replaced), then ``tmp`` goes. A filesystem without hard links claims the name with
    ``O_EXCL`` first. A name taken meanwhile raises ``FileExistsError``, ``tmp`` left in place."""
    tmp, final = Path(tmp), Path(final)
    fsync_path(tmp)
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        os.close(os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))   # the name is ours from here
        os.replace(tmp, final)
    else:
        tmp.unlink()
    fsync_path(final.parent)


def atomic_write(path: Path, write) -> None:
    """``write(f)`` into a temporary sibling, fsynced, renamed into place, the folder fsynced:
    a kill leaves the old file or none, a power loss never a complete-looking empty one."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            write(f)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    durable_replace(tmp, path)


def refuse_existing(path: str | os.PathLike, flag: str) -> None:
    """A user's file is never replaced without a word: an existing output is refused in one
    line naming it and the fix (as ``--out``'s .npz, which a run only resumes when it is its own)."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{flag} {path} exists; not overwriting it: choose another {flag}, or move {path} away")


def write_new_file(path: str | os.PathLike, write, flag: str = "the output", overwrite: bool = False) -> None:
    """``write(f)`` into ``path`` atomically (``atomic_write``); an existing ``path`` is refused
    (``refuse_existing``) unless ``overwrite``; a failed write (disk full) is one line naming
    ``path``, with nothing left there."""
    path = Path(path)
    if not overwrite:
        refuse_existing(path, flag)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(path, write)
    except OSError as err:
        raise OSError(f"cannot write {path}: {err.strerror or err} (disk full?); nothing was left there: free space "
                      f"and rerun the same command") from None


def load_error_cause(err: Exception) -> str:
    """Why a file could not be read, in one line. A refused pickle names the refused
    global only: torch's own text advises ``weights_only=False``, which would run the
    file's code, so it is never passed on."""
    # torch's wording for a global of a module it never loads (os, posix, subprocess, ...)
    blocked = re.search(r"unsupported GLOBAL (\S+) whose module \S+ is blocked", str(err))
    if isinstance(err, pickle.UnpicklingError) and blocked:
        return (f"blocked: not a plain tensor file (possibly malicious): it asks to run {blocked.group(1)}, which "
                f"torch.load(weights_only=True) refuses; nothing in it was run")
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
    if isinstance(err, pickle.UnpicklingError) and refused:
        return (f"holds pickled Python objects ({refused.group(1)}), which are refused because loading them could "
                f"run code; only tensors and plain containers are read")
    if isinstance(err, pickle.UnpicklingError):  # random bytes or a damaged pickle: the unpickler's own reason
        reason = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(err))
        detail = reason.group(1) if reason else str(err).splitlines()[0] if str(err) else ""
        if detail.startswith("Weights only load failed"):
            detail = ""
        return f"not a file written by torch.save, or corrupt ({type(err).__name__}{': ' + detail if detail else ''})"
    first = str(err).splitlines()[0] if str(err) else ""
    first = first.split(". This is an internal miniz error")[0]   # torch's zip reader: its guesses follow
    return f"unreadable, truncated or corrupt ({type(err).__name__}{': ' + first if first else ''})"


class BuildCheckedUnpickler(pickle._Unpickler):
    """Python's own unpickler (its opcodes can be overridden, the C one's cannot) whose BUILD
    runs only once ``check_build(inst, state)`` accepts it: a BUILD calls ``__setstate__`` or
    sets attributes, and on a class, a function or a shared object that changes it for the
    whole process. Subclasses also narrow ``find_class`` to the globals their format needs."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def check_build(self, inst, state) -> None:
        raise NotImplementedError   # each format says what it fills

    def load_build(self):
        self.check_build(self.stack[-2], self.stack[-1])
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def torch_load_tensors(path: str | os.PathLike, safe_globals: tuple = ()):
    """``torch.load(weights_only=True)`` whose failures are one line naming the file."""
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # zip reader / unpickler raise many types
        cause = load_error_cause(err)
        fix = ("use weights from a source you trust, saved as a plain state dict of tensors" if refused_pickle(cause)
               else "re-save it as a plain state dict of tensors (torch.save(model.state_dict(), path)) where it "
                    "was made, or download it again")
        raise CheckpointError(f"{path}: {cause}; {fix}") from None


def refused_pickle(cause: str) -> bool:
    """Whether a ``load_error_cause`` says the file asked to run code (not that it is damaged)."""
    return cause.startswith(("blocked:", "holds pickled Python objects"))
