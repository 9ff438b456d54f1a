"""From a loaded model (``sources.Source``) to image files: grids, PNGs and mass sampling.

Used by ``sample.py`` and ``evaluate_fid.py``. The batches come from
``generate.sample_batch``, which the pipelines (``pipeline.py``) call too, so one seed
gives the same images through either door.

Determinism (see ``generate.py``). Every sample has a *global index*; its starting
noise is seeded with ``(seed, index)``, so it does not depend on the batch it lands in,
the process that draws it or the process count. Stochastic samplers (ddpm, sde-*) also
draw noise inside the loop, seeded per batch, so for them the batch layout
(``--batch-size``) is part of the recipe. Deterministic samplers (ddim, dpm-solver,
ode-*) depend only on the per-index noise.

Mass sampling (``mass_sample``) for FID-50K: labels are ``i % num_classes`` over the
global index, shuffled by a permutation seeded with ``seed`` (exact class balance
whenever ``num_classes`` divides the sample count). The index range is cut into fixed
shards; shard ``k`` belongs to rank ``k % world_size``. Each finished shard is written
atomically (temporary name, fsync, rename, fsync of the folder) to ``<out>.parts/``, so a restarted run skips
what is done. Rank 0 then streams the shards into ADM's ``.npz`` (``arr_0`` uint8
NHWC, ``arr_1`` labels) without ever holding the whole array, and writes the JSON
sidecar ``<out>.json``. ``<out>.lock`` gives the output one run at a time; temporaries
that killed runs left behind are removed when the next run starts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from ..data.images import balanced_labels
from ..diffusion.generate import SampleSettings, sample_batch
from ..diffusion.registry import SAMPLER_SPECS
from ..guards import atomic_write, refuse_existing
from ..runlock import hold_lock
from .sources import Source


# ----------------------------------------------------------------- small runs
def sample_images(source: Source, labels: list[int], seed: int, settings: SampleSettings,
                  batch_size: int = 32, progress: bool = False) -> tuple[torch.Tensor, int]:
    """Images for ``labels`` (global indices 0..n-1) as uint8 (N, H, W, C), and the NFE."""
    from ..data.datasets import to_uint8
    from ..progress import progress_bar

    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if not labels:
        raise ValueError("no samples to make: pass at least one label (or --num-samples >= 1)")
    out, nfe = [], 0
    with progress_bar(total=len(labels), unit="img", desc="sample", disable=not progress) as bar:
        for start in range(0, len(labels), batch_size):
            idx = list(range(start, min(start + batch_size, len(labels))))
            y = torch.tensor([labels[i] for i in idx], dtype=torch.long)
            images, nfe = sample_batch(source.model, source.objective, y, idx, seed, settings,
                                       source.vae, source.latent_norm, progress)
            out.append(to_uint8(images))
            bar.update(len(idx))
    return torch.cat(out), nfe


# ----------------------------------------------------------------- mass sampling
SHARDS_PER_JOB = 20      # auto shard size: an interrupt loses at most ~1/20 of the job per process
MAX_SHARD_SIZE = 1000    # ... and at most this many samples (FID-50K: 50 shards)


def auto_shard_size(num_samples: int, batch_size: int) -> int:
    """Samples per shard when ``--shard-size`` is not given. It depends only on the job
    (not on the process count), so a resumed run with other processes finds the same shards."""
    return min(max(math.ceil(num_samples / SHARDS_PER_JOB), 1), MAX_SHARD_SIZE)


def shards_done(out: str | os.PathLike) -> tuple[int, int]:
    """(samples, shards) finished in ``<out>.parts/``: what an interrupted run keeps."""
    files = sorted(Path(f"{out}.parts").glob("shard-*.npz"))
    samples = 0
    for f in files:
        with np.load(f) as part:
            samples += len(part["labels"])
    return samples, len(files)





@contextlib.contextmanager
def _disk_full_line(path: Path, out: Path, then: str):
    """A failed write (disk full) as one line, as training's and export's: the file, what
    was kept and the rerun (``atomic_write`` has removed the partial file)."""
    try:
        yield
    except OSError as err:
        first = err.strerror or (str(err).splitlines()[0] if str(err) else type(err).__name__)   # no "[Errno 28]"
        samples, shards = shards_done(out)
        raise OSError(f"cannot write {path}: {first} (disk full?); removed the partial file, kept {shards} finished "
                      f"shard{'s' if shards != 1 else ''} ({samples} samples) in {out}.parts: free space and rerun "
                      f"the same command to {then}") from None


def _read_json(path: Path, fix: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: unreadable ({err}); {fix}") from None
    except RecursionError:
        raise ValueError(f"{path}: unreadable (nested too deeply to read); {fix}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object; {fix}")
    return value


def remove_temporaries(out: Path, parts: Path) -> list[Path]:
    """Delete what killed runs left half-written: ``.tmp-<pid>-<out name>`` beside ``out``
    and ``.tmp-*`` in the shard folder (call while holding the output's lock)."""
    stale = sorted(out.parent.glob(f".tmp-*-{out.name}")) + sorted(out.parent.glob(f".tmp-*-{out.name}.json"))
    stale += sorted(parts.glob(".tmp-*")) if parts.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def write_npz_streaming(out: Path, shards: list[Path], num_samples: int, image_shape: tuple[int, ...]) -> None:
    """ADM's sample ``.npz`` (``arr_0`` uint8 NHWC, ``arr_1`` int64 labels), one shard in
    memory at a time: each array's ``.npy`` header is written first, then the shards'
    bytes are appended to the zip member (stored, zip64 for > 4 GB)."""

    def write(f):
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, key, dtype, shape in (("arr_0", "images", np.uint8, (num_samples, *image_shape)),
                                            ("arr_1", "labels", np.int64, (num_samples,))):
                with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                              "shape": shape}
                    np.lib.format.write_array_header_2_0(member, header)
                    for shard in shards:
                        with np.load(shard) as part:
                            member.write(np.ascontiguousarray(part[key], dtype=dtype).tobytes())

    atomic_write(out, write)


def npz_problem(out: Path, done: dict) -> str | None:
    """Why a finished ``.npz`` is not what its sidecar ``done`` records, or None: a zip
    whose members' CRCs hold (the file is read once), with ``arr_0`` uint8 of shape
    ``(num_samples, *image_shape)`` and ``arr_1`` int64 of ``(num_samples,)``, each member
    exactly as long as its header says. A truncated or altered file is never "complete"."""
    n, image_shape = done.get("num_samples"), done.get("image_shape")
    if not isinstance(n, int) or not isinstance(image_shape, list):
        return "its sidecar records no num_samples / image_shape"
    try:
        with zipfile.ZipFile(out) as zf:
            for name, dtype, shape in (("arr_0.npy", np.uint8, (n, *image_shape)), ("arr_1.npy", np.int64, (n,))):
                try:
                    info = zf.getinfo(name)
                except KeyError:
                    return f"no {name} in it"
                with zf.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                        np.lib.format.read_array_header_2_0
                    got_shape, _, got_dtype = read(member)
                    header = member.tell()
                if tuple(got_shape) != tuple(shape) or np.dtype(got_dtype) != np.dtype(dtype):
                    return (f"{name} is {np.dtype(got_dtype)} {tuple(got_shape)}, the sidecar records "
                            f"{np.dtype(dtype)} {tuple(shape)}")
                if info.file_size != header + math.prod(shape) * np.dtype(dtype).itemsize:
                    return f"{name} holds {info.file_size - header:,} bytes of data, not {math.prod(shape):,} values"
            bad = zf.testzip()   # every member read to its end: CRC-32 and size
            if bad is not None:
                return f"{bad} fails its CRC check"
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"not a readable .npz: {first}"
    return None


# Recipe keys that only some runs record (dopri5's tolerances): compared when either side has them.
OPTIONAL_RECIPE_KEYS = ("atol", "rtol", "max_nfe")


def size_recipe(s: SampleSettings, model, objective) -> dict:
    """Where a run sampled, resolved with its defaults: the latent size, the time shift as a
    number and the upscaling (None without). Recorded whether or not the flags were given,
    so a file made at another size never passes for the trained size's."""
    return dict(latent_size=list(s.noise_size(model)), time_shift=float(s.shift_for(model, objective)),
                upscale_from=list(s.upscale_from) if s.upscale_from is not None else None,
                strength=s.strength if s.upscale_from is not None else None)


def recipe_differences(stored: dict, recipe: dict, model, objective) -> dict:
    """``{key: (stored, now)}`` for every recipe setting that differs, looked at both ways.
    A sidecar of an older version recorded the size options only when given: their
    absence means the defaults, resolved here as this version records them."""
    stored = dict(stored)
    if any(k not in stored for k in ("latent_size", "time_shift", "upscale_from")):
        size = stored.get("latent_size")
        small = stored.get("upscale_from")
        old = SampleSettings(latent_size=tuple(size) if size else None, time_shift=stored.get("time_shift"),
                             upscale_from=tuple(small) if small else None, strength=stored.get("strength", 0.6))
        stored.update(size_recipe(old, model, objective))
    keys = list(recipe) + [k for k in OPTIONAL_RECIPE_KEYS if k in stored and k not in recipe]
    return {k: (stored.get(k), recipe.get(k)) for k in keys if stored.get(k) != recipe.get(k)}


def mass_sample(source: Source, out: str | os.PathLike, num_samples: int, seed: int, settings: SampleSettings,
                batch_size: int = 32, shard_size: int | None = None, stop_after: int | None = None,
                keep_parts: bool = False, progress: bool = True, state=None, context=None) -> Path | None:
    """Generate ``num_samples`` images into ``out`` (.npz) across all processes of ``state``
    (an accelerate ``PartialState``; None = this process alone). Returns the ``.npz``
    path, or None when this run stopped early (``stop_after`` shards per process).
    The shards are deleted once the ``.npz`` is complete unless ``keep_parts``.
    ``<out>.lock`` keeps a second run off the same output while this one works.
    ``shard_size`` None: the one of the run being resumed, else ``auto_shard_size``.
    ``context`` (``context_parallel.ContextParallel``, the model split by rows over it): the
    shards go to the data-parallel groups; each group's first process writes them."""
    out = Path(out)
    if shard_size is None:
        stored = Path(f"{out}.parts") / "settings.json"
        resumed = stored.is_file() and any(stored.parent.glob("shard-*.npz"))
        shard_size = auto_shard_size(num_samples, batch_size)
        if resumed:   # the resumed run's own shard size (read with its file named on failure)
            shard_size = _read_json(stored, f"delete {out}.parts to start over").get("shard_size")
            if not isinstance(shard_size, int) or isinstance(shard_size, bool):
                raise ValueError(f"{stored}: 'shard_size' must be an integer, got {shard_size!r}; delete "
                                 f"{out}.parts to start over")
    if num_samples < 1 or batch_size < 1 or shard_size < 1:
        raise ValueError("--num-samples, --batch-size and --shard-size must be >= 1")
    with hold_lock(Path(f"{out}.lock"), f"output {out}", "choose another --out", state):
        if state is None or state.is_main_process:
            for p in remove_temporaries(out, Path(f"{out}.parts")):
                print(f"removed {p}, left half-written by a killed run")
        if state is not None:
            state.wait_for_everyone()
        return _mass_sample(source, out, num_samples, seed, settings, batch_size, shard_size, stop_after,
                            keep_parts, progress, state, context)


def _mass_sample(source, out: Path, num_samples, seed, settings, batch_size, shard_size, stop_after, keep_parts,
                 progress, state, context=None) -> Path | None:
    rank, world = (state.process_index, state.num_processes) if state is not None else (0, 1)
    is_main = rank == 0
    writes = True          # context parallel: the processes of a group make the same images
    if context is not None and context.size > 1:
        rank, world, writes = context.data_rank, context.data_size, context.rank == 0
    # Micro-batches start at multiples of batch_size inside each shard; aligning the
    # shard size to it keeps batch boundaries global, whatever the process count.
    shard_size = math.ceil(shard_size / batch_size) * batch_size
    s = settings.resolved(source.objective)
    parts = Path(f"{out}.parts")
    recipe = _recipe(source, s, seed, num_samples, batch_size, shard_size)
    if _already_complete(source, out, parts, recipe, is_main):
        return out
    num_classes = source.model.config.num_classes
    labels = balanced_labels(num_samples, num_classes, seed)
    num_shards = math.ceil(num_samples / shard_size)
    mine = [k for k in range(rank, num_shards, world) if not _shard_path(parts, k).is_file()]
    if stop_after is not None:
        mine = mine[:stop_after]
    if context is not None and context.size > 1:
        state.wait_for_everyone()   # a group's processes list the same shards before any is written
    _sample_shards(source, s, out, parts, mine, labels, seed, num_samples, batch_size, shard_size,
                   progress and is_main, writes, world)
    if state is not None:
        state.wait_for_everyone()
    if not is_main:
        return out
    shards = [_shard_path(parts, k) for k in range(num_shards)]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        print(f"{len(shards) - len(missing)} of {num_shards} shards done in {parts}; "
              f"rerun the same command to resume")
        return None
    _assemble(out, parts, shards, labels, num_samples, num_classes, recipe, world,
              context.size if context is not None and context.size > 1 else None, keep_parts)
    return out


def _shard_path(parts: Path, k: int) -> Path:
    return parts / f"shard-{k:06d}.npz"


def _recipe(source, s: SampleSettings, seed, num_samples, batch_size, shard_size) -> dict:
    """What decides a mass-sampling run's images (stored beside its shards and in its sidecar)."""
    recipe = dict(model=source.info.get("model"),
                  checkpoint=source.info.get("checkpoint") or source.info.get("pipeline"),
                  step=source.info.get("step"), weights=source.info.get("weights"), vae=source.info.get("vae"),
                  sampler=s.sampler, steps=s.num_steps, cfg_scale=s.cfg_scale,
                  guidance_interval=list(s.guidance_interval) if s.guidance_interval else None,
                  guide_channels=s.guide_channels, precision=s.precision, seed=seed, num_samples=num_samples,
                  num_classes=source.model.config.num_classes, batch_size=batch_size, shard_size=shard_size)
    if SAMPLER_SPECS[s.sampler].adaptive:   # dopri5: its tolerances decide the images
        recipe.update(atol=s.atol, rtol=s.rtol, max_nfe=s.max_nfe)
    recipe.update(size_recipe(s, source.model, source.objective))
    return recipe


def _already_complete(source, out: Path, parts: Path, recipe: dict, is_main: bool) -> bool:
    """True when ``out`` is finished with this ``recipe``. Otherwise checks that what is at
    ``out`` and in ``parts`` belongs to this run (else refuses, naming what to move), makes
    ``parts`` and stores the recipe there on a fresh start."""
    model, objective = source.model, source.objective
    sidecar = Path(f"{out}.json")
    keep = (f"not overwriting it: choose another --out, or move {out}{f' and {sidecar}' if sidecar.exists() else ''} "
            f"away to redo it")
    settings_file = parts / "settings.json"
    if out.is_file() and sidecar.is_file():
        done = _read_json(sidecar, f"delete it and {out} and rerun")
        diff = recipe_differences(done, recipe, model, objective)
        if diff:
            raise FileExistsError(f"{out} holds a finished run made with other settings {diff} (its {sidecar.name}, "
                                  f"now); {keep}")
        problem = npz_problem(out, done)
        if problem is None:
            if is_main:
                print(f"{out} is already complete with these settings; nothing to do")
            return True
        if not (settings_file.is_file() and any(parts.glob("shard-*.npz"))):
            raise ValueError(f"{out} is damaged ({problem}) though {sidecar.name} records it finished; nothing was "
                             f"changed: move {out} and {sidecar} away (or delete them) and rerun the same command to "
                             f"sample it again")
        if is_main:   # ours (the sidecar says so) and its shards are kept: made again from them
            print(f"{out} is damaged ({problem}); reassembling it from the shards kept in {parts}")
    stored = _read_json(settings_file, f"delete {parts} to start over") if settings_file.is_file() else None
    if stored is not None and not any(parts.glob("shard-*.npz")):
        stored = None  # a run refused before its first shard: nothing to keep, this run starts afresh
    if stored is not None and (diff := recipe_differences(stored, recipe, model, objective)):
        raise ValueError(f"{parts} holds shards made with other settings {diff} (stored, now); "
                         f"rerun with the same flags or delete {parts}")
    # A file at --out without its sidecar is ours only when this run's shards are there
    # (killed between writing the .npz and the sidecar): anything else a user made stays.
    if out.exists() and stored is None:
        raise FileExistsError(f"{out} exists and is not the output of this run (no {sidecar.name} or shards "
                              f"beside it); {keep}")
    parts.mkdir(parents=True, exist_ok=True)
    if stored is None and is_main:
        with _disk_full_line(settings_file, out, "start it"):
            atomic_write(settings_file, lambda f: f.write(json.dumps(recipe, indent=2).encode()))
    return False


def _sample_shards(source, s: SampleSettings, out: Path, parts: Path, mine: list[int], labels, seed, num_samples,
                   batch_size, shard_size, progress: bool, writes: bool, world: int) -> None:
    """Sample the shards ``mine`` in micro-batches; each shard written atomically when ``writes``."""
    from ..data.datasets import to_uint8
    from ..progress import progress_bar

    with progress_bar(total=sum(min(shard_size, num_samples - k * shard_size) for k in mine),
                      disable=not progress, desc=f"sample (rank 0 of {world})", unit="img") as bar:
        for k in mine:
            lo, hi = k * shard_size, min((k + 1) * shard_size, num_samples)
            images, nfes = [], []
            for start in range(lo, hi, batch_size):
                idx = list(range(start, min(start + batch_size, hi)))
                pixels, nfe = sample_batch(source.model, source.objective, labels[idx], idx, seed, s,
                                           source.vae, source.latent_norm)
                images.append(to_uint8(pixels).numpy())
                nfes.append(nfe)
                bar.update(len(idx))
            if writes:
                with _disk_full_line(_shard_path(parts, k), out, "resume"):
                    atomic_write(_shard_path(parts, k), lambda f: np.savez(f, images=np.concatenate(images),
                                                                              labels=labels[lo:hi].numpy(),
                                                                              nfe=np.array(nfes)))


def _assemble(out: Path, parts: Path, shards: list[Path], labels, num_samples, num_classes, recipe: dict,
              world: int, context_parallel: int | None, keep_parts: bool) -> None:
    """Every shard into ``out`` and its sidecar (``recipe`` + the NFE, the processes and the
    class counts); the shards removed unless ``keep_parts``."""
    with np.load(shards[0]) as first:
        image_shape = first["images"].shape[1:]
    nfe = []
    for p in shards:
        with np.load(p) as part:
            nfe.extend(part["nfe"].tolist())
    with _disk_full_line(out, out, "assemble it"):
        write_npz_streaming(out, shards, num_samples, image_shape)
    counts = torch.bincount(labels, minlength=num_classes)
    sidecar = Path(f"{out}.json")
    meta = dict(recipe, nfe=max(nfe), nfe_mean=float(np.mean(nfe)), image_shape=list(image_shape),
                world_size=world, per_class_min=int(counts.min()), per_class_max=int(counts.max()),
                npz=str(out))
    if context_parallel is not None:
        meta.update(context_parallel=context_parallel)   # world_size counts the data-parallel groups
    with _disk_full_line(sidecar, out, "finish it"):
        atomic_write(sidecar, lambda f: f.write(json.dumps(meta, indent=2).encode()))
    if not keep_parts:
        import shutil
        shutil.rmtree(parts)
    print(f"wrote {out} and {sidecar}")
