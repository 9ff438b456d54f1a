"""Writing an export folder (``export.py``) without touching anything a user made.

``check_out_dir`` refuses an existing export and a folder holding other files before any
work; ``write_folder`` saves into a temporary sibling (``.tmp-<pid>-<name>``), fsyncs its
files, and renames it into place when complete (the parent folder fsynced after), so an interrupted or failed export (disk full) leaves
nothing half-written at the destination, and removes its temporary copy. Every folder
gets its model card (``card.py``) before the rename.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TMP_PREFIX = ".tmp-"


def check_out_dir(out_dir: str | os.PathLike) -> None:
    """A ValueError (naming the folder and the way out) unless ``out_dir`` is new or empty."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; choose another output folder")
    if out.is_dir():
        inside = sorted(p.name for p in out.iterdir())
        if (out / "model_index.json").is_file() or (out / "config.json").is_file():
            raise FileExistsError(f"{out} already holds an export; not overwriting it: choose another output "
                                  f"folder, or move {out} away to export again")
        if inside:
            shown = ", ".join(inside[:3]) + (f", … ({len(inside)} in all)" if len(inside) > 3 else "")
            raise FileExistsError(f"{out} is not empty ({shown}); an export would mix with those files: choose a "
                                  f"new or empty output folder")
    for stale in out.parent.glob(f"{TMP_PREFIX}*-{out.name}") if out.parent.is_dir() else ():
        if stale.is_dir() and not _alive(stale.name):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed export


def _alive(name: str) -> bool:
    """Whether the process that made ``.tmp-<pid>-<name>`` still runs (on this host)."""
    try:
        pid = int(name[len(TMP_PREFIX):].split("-", 1)[0])
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def write_folder(obj, out_dir: str | os.PathLike, card=None) -> Path:
    """``obj.save_pretrained`` into a temporary sibling of ``out_dir``, then renamed into
    place; any failure (disk full surfaces as OSError or safetensors' SafetensorError)
    removes the temporary copy and is one line. The folder carries a model card
    (``README.md``): our pipelines write their own (naming ``out_dir`` in its commands);
    for anything else ``card`` is a ``huggingface_hub.ModelCard`` to write."""
    import inspect

    from ..guards import durable_replace
    from .card import save_card

    out = Path(out_dir)
    check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{TMP_PREFIX}{os.getpid()}-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if "card_folder" in inspect.signature(obj.save_pretrained).parameters:
            obj.save_pretrained(str(tmp), card_folder=str(out))
        else:
            obj.save_pretrained(str(tmp))
            if card is not None:
                save_card(tmp, card)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, Exception) and not isinstance(err, (ValueError, TypeError)):
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise OSError(f"cannot write {out}: {first} (disk full?); nothing was written there: free space and "
                          f"run the same command again") from None
        raise
    if out.is_dir():
        out.rmdir()  # empty (checked above)
    durable_replace(tmp, out)   # its files on disk before the name: a power loss leaves no empty export
    return out
