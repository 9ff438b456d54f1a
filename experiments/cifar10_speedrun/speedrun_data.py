"""The speedrun's CIFAR-10: found (or unpacked from its archive) and read onto the device as uint8.

``find_cifar`` takes what ``--cifar`` names: a folder with ``train/<class>/`` and ``test/<class>/``,
a folder holding ``cifar10/`` of that layout, the archive ``cifar10_jpg.tar.gz`` or a folder
holding it. An archive is unpacked once into a folder the run names (``UNPACK_INTO``, or
``into``), atomically: into a temporary sibling first, renamed into place when complete, so a
kill never leaves a half folder that a rerun would take for the data set.
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nala_dit.cli.parse import passive_wait_policy  # noqa: E402  (torch-free)

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402

ARCHIVE = "cifar10_jpg.tar.gz"
UNPACK_INTO = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "nala_dit"
TAR_LINE = f"mkdir -p ~/.cache/nala_dit && tar -xzf {ARCHIVE} -C ~/.cache/nala_dit"


def _has_splits(folder: Path) -> bool:
    return (folder / "train").is_dir() and (folder / "test").is_dir()


def find_cifar(path: Path, into: Path | None = None, say=print) -> Path:
    """The folder of ``train/`` and ``test/`` that ``path`` names or holds, unpacking its archive
    if that is what it holds; otherwise one line with the tar command."""
    path = path.expanduser()
    for folder in (path, path / "cifar10"):
        if _has_splits(folder):
            return folder
    archive = path if path.is_file() else path / ARCHIVE
    if archive.is_file() and archive.name.endswith((".tar.gz", ".tgz", ".tar")):
        return unpack(archive, into or UNPACK_INTO, say)
    raise SystemExit(f"error: --cifar {path}: no train/ and test/ folders and no {ARCHIVE} there: pass the "
                     f"folder of the archive (it is unpacked once), or unpack it yourself with `{TAR_LINE}` and "
                     f"pass --cifar ~/.cache/nala_dit/cifar10")


def unpack(archive: Path, into: Path, say=print) -> Path:
    """``archive`` (``cifar10/train/...``, ``cifar10/test/...``) unpacked to ``into/cifar10``
    unless already there; the members are checked by tarfile's ``data`` filter (no links out,
    no absolute paths, no devices)."""
    target = into / "cifar10"
    if _has_splits(target):
        say(f"CIFAR-10: using {target} (unpacked from {archive.name} before)")
        return target
    if target.exists():
        raise SystemExit(f"error: {target} exists but has no train/ and test/: move it away, then rerun "
                         f"(the archive {archive} is unpacked there)")
    say(f"CIFAR-10: unpacking {archive} into {into} (once; about 20 s)")
    tmp = into / f".unpack-{os.getpid()}"
    try:
        into.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
    except (OSError, tarfile.TarError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"error: cannot unpack {archive} into {into}: {err}; check the archive "
                         f"(`tar -tzf {archive} | head`) and the free space, or unpack it yourself: `{TAR_LINE}`"
                         ) from None
    if not _has_splits(tmp / "cifar10"):
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"error: {archive} holds no cifar10/train/ and cifar10/test/ folders: it is not the "
                         f"CIFAR-10 archive this run reads")
    os.replace(tmp / "cifar10", target)
    shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_split(folder: Path, per_class: int | None = None):
    """(N, 3, 32, 32) uint8 images and labels of an ImageFolder (the repository's reader's class
    order and files), the first ``per_class`` files of each class (all when None). A folder
    without images or an unreadable image is one line naming it."""
    from nala_dit.data.datasets import ImageFolderDataset

    try:
        ds = ImageFolderDataset(folder, 32)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    keep, seen = [], {}
    for i, (_, label) in enumerate(ds.samples):
        if per_class is None or seen.get(label, 0) < per_class:
            keep.append(i)
            seen[label] = seen.get(label, 0) + 1
    arrays = []
    for i in keep:
        try:
            arrays.append(ds.load(i))
        except OSError as err:   # PIL's reason is the cause ``load`` chains
            raise SystemExit(f"error: {ds.samples[i][0]}: not a readable image ({err.__cause__ or err}); replace "
                             f"it from the archive (unpack it again) or remove it") from None
    images = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
    labels = torch.tensor([ds.samples[i][1] for i in keep])
    return images, labels
