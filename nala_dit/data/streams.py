"""Sharded data read shard by shard: webdataset tar shards and Hugging Face ``datasets``
(parquet files, or a ``save_to_disk`` folder of Arrow files), each process reading its own
shards, each item still ``(x, label)`` with no randomness of its own (``sources.py``).

The read order (``ShardSampler``): each epoch the shards are shuffled (seeded by the run's
seed and the epoch) and dealt round-robin to the processes, so a process opens only its
shards; a process's rows are cut into blocks (a parquet row group, an Arrow record batch,
``BLOCK`` members of a tar), the blocks shuffled, and the rows of every ``MIXED_BLOCKS``
blocks shuffled together (webdataset's shuffle buffer, made a permutation so that it can be
resumed). Every process takes as many items per epoch as the process with the fewest has
(the others' surplus is skipped that epoch; the next deals the shards anew), so all take the
same number of steps. The position a checkpoint stores (micro-batches into the epoch) is a
place in this order: a resumed run reads on exactly where it stopped.

Splits: a shard's split is the word ``train``, ``validation``, ``val`` or ``test`` among the
parts of its name (``train-00000-of-00004.parquet``, ``imagenet-val-000012.tar``,
``validation/0000.parquet``; a file that names none is ``train``), a ``save_to_disk``
``DatasetDict``'s sub-folder, or a plain ``save_to_disk`` folder's recorded split. The
held-out data of ``--val-every`` is ``--val-data NAME`` (a split) or ``--val-data N`` (the last
N items of the training split, then not trained on).

A latent folder of ``extract_latents.py`` packed as tar shards (``pack_latents``) is read the
same way (``TarLatents``). Only the standard library (``tarfile``) and ``pyarrow`` (the
``stream`` extra) read these; the ``datasets`` package is not needed.
"""

from __future__ import annotations

import bisect
import io
import json
import os
import tarfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from .choices import tar_names

BLOCK = 100          # tar members per block (parquet and Arrow: their own row groups / record batches)
MIXED_BLOCKS = 8     # blocks whose rows are shuffled together (and cached per data-loader worker)
SPLITS = ("train", "validation", "val", "test")
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "bmp")   # a tar sample's image, by its extension (case ignored)
LABEL_KEY = "cls"                                    # a tar sample's class index, as text
COLUMNS = {"image", "label"}                         # a parquet / Arrow file's: Hugging Face's image datasets'
STREAM_HINT = "pip install -e '.[stream]' (pyarrow reads parquet and save_to_disk folders)"


def split_of(path: Path, root: Path) -> str:
    """The split a shard belongs to: the first of ``SPLITS`` among the words of its path below
    ``root`` (split at ``/``, ``-``, ``_`` and ``.``), else ``train``."""
    words = str(path.relative_to(root)).replace("\\", "/")
    for sep in "-_.":
        words = words.replace(sep, "/")
    found = [w for w in words.lower().split("/") if w in SPLITS]
    return found[0] if found else "train"


def held_out_count(val_data: str | None) -> int | None:
    """``--val-data N``: N items held out from the end of the training split; else None."""
    if val_data is not None and val_data.strip().isdigit() and not Path(val_data).exists():
        return int(val_data)
    return None


class ShardSampler(Sampler[int]):
    """One process's indices of one epoch (module doc), from ``start`` (a resumed run's place).
    ``per_rank``: the items every process takes this epoch."""

    def __init__(self, dataset: "ShardedDataset", rank: int, world: int, seed: int, epoch: int = 0, start: int = 0):
        shards = len(dataset.spans)
        if shards < world:
            raise ValueError(f"{dataset.root} has {shards} shard(s) for {world} processes: each process reads its "
                             f"own shards; write the data as at least {world} shards (more, to keep the processes' "
                             f"shares even), or train on fewer processes")
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        deal = torch.randperm(shards, generator=g).tolist()
        counts = [sum(dataset.spans[s][2] - dataset.spans[s][1] for s in deal[r::world]) for r in range(world)]
        self.per_rank = min(counts)
        g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 4099 + rank + 1)
        blocks = [block for s in deal[rank::world] for block in dataset.blocks(s)]
        order = []
        shuffled = [blocks[i] for i in torch.randperm(len(blocks), generator=g).tolist()]
        for i in range(0, len(shuffled), MIXED_BLOCKS):
            rows = np.concatenate([np.arange(a, b) for a, b in shuffled[i:i + MIXED_BLOCKS]])
            order.extend(rows[torch.randperm(len(rows), generator=g).numpy()].tolist())
        self.order, self.start = order[:self.per_rank], start

    def __iter__(self):
        return iter(self.order[self.start:])

    def __len__(self) -> int:
        return self.per_rank - self.start


class ShardedDataset(Dataset):
    """Items in shards: ``spans`` lists (shard file, first row, end row) in a fixed order and
    item ``i`` is a row of one of them (the index ``ShardSampler`` yields). A subclass reads
    a row (``row``) and says where its blocks end (``block_ends``)."""

    is_latent = False

    def __init__(self, root: Path, spans: list, classes: list[str], image_size: int):
        self.root, self.spans, self.classes, self.image_size = root, spans, classes, image_size
        self.num_classes, self.channels = len(classes), 3
        self.offsets = [0]
        for _, a, b in spans:
            self.offsets.append(self.offsets[-1] + b - a)
        self._cache: OrderedDict = OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.offsets[-1]

    def sampler(self, rank: int, world: int, seed: int, epoch: int = 0, start: int = 0) -> ShardSampler:
        return ShardSampler(self, rank, world, seed, epoch, start)

    def blocks(self, s: int) -> list[tuple[int, int]]:
        """Span ``s``'s blocks as ranges of item indices."""
        path, a, b = self.spans[s]
        cuts = [a] + [e for e in self.block_ends(path) if a < e < b] + [b]
        base = self.offsets[s] - a
        return [(base + lo, base + hi) for lo, hi in zip(cuts, cuts[1:])]

    def block_ends(self, path: Path) -> list[int]:
        return []

    def __getitem__(self, index: int):
        s = bisect.bisect_right(self.offsets, index) - 1
        path, a, _ = self.spans[s]
        return self.row(path, a + index - self.offsets[s])

    def image(self, data: bytes, where: str) -> torch.Tensor:
        """Encoded image bytes → (3, S, S) in [-1, 1], ADM's center crop (as an image folder)."""
        from PIL import Image

        from .datasets import center_crop_arr, to_model_range

        try:
            with Image.open(io.BytesIO(data)) as img:
                return to_model_range(center_crop_arr(img.convert("RGB"), self.image_size))
        except Exception as err:  # PIL raises several types for broken data
            raise OSError(f"cannot read the image of {where}: {err}") from err

    def cached(self, key, load):
        """A per-process (per data-loader worker) cache of the last ``MIXED_BLOCKS + 1`` things read;
        a forked worker starts its own (an inherited open file would share its offset)."""
        if self._pid != os.getpid():
            self._cache, self._pid = OrderedDict(), os.getpid()
        if key not in self._cache:
            self._cache[key] = load()
            if len(self._cache) > MIXED_BLOCKS + 1:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key]

    def __getstate__(self):  # open files and cached blocks stay in their process
        return {**self.__dict__, "_cache": OrderedDict()}


def _spans(files: list[Path], counts: list[int], split: str, val_data: str | None, data: Path):
    """(path, first, end) of every shard of ``split``; with ``--val-data N``, the training split
    without its last N items, and the held-out split those N items."""
    spans = [(p, 0, n) for p, n in zip(files, counts) if n > 0]
    hold = held_out_count(val_data)
    if hold is None or split not in ("train", "heldout"):
        return spans
    total = sum(n for _, _, n in spans)
    if not 0 < hold < total:
        raise ValueError(f"--val-data {hold}: the held-out count must be between 1 and {total - 1} (the training "
                         f"split of {data} holds {total} items)")
    keep, train, heldout = total - hold, [], []
    for p, a, b in spans:
        cut = min(max(keep, a), b)
        train += [(p, a, cut)] if cut > a else []
        heldout += [(p, cut, b)] if b > cut else []
        keep -= b - a
    return train if split == "train" else heldout


def _wanted_split(split: str, val_data: str | None) -> str | None:
    """The split ``open(split=...)`` reads: "train"; for "heldout" ``--val-data``'s split name,
    the training split for a count (its tail), or None for a folder of its own (all of it)."""
    if split != "heldout" or held_out_count(val_data) is not None:
        return "train"
    if val_data is not None and Path(val_data).exists():
        return None
    return (val_data or "").strip()


def _of_split(files: list[Path], root: Path, wanted: str | None, kind: str) -> list[Path]:
    """The files of split ``wanted`` (None: all), or one line saying which splits there are."""
    found = sorted(p for p in files if wanted is None or split_of(p, root) == wanted)
    if not found:
        have = sorted({split_of(p, root) for p in files})
        raise ValueError(f"{root} has no {wanted!r} {kind} (a file's split is a word of its name or folder: "
                         f"{', '.join(SPLITS)}; none is train); it has {', '.join(have) or 'none'}")
    return found


def _check_labels(labels: np.ndarray, names: list[str] | None, where: str) -> list[str]:
    """The class names: ``names`` (checked against the labels), else ``0``..``max``."""
    if len(labels) and labels.min() < 0:
        raise ValueError(f"{where} holds label {int(labels.min())}: every item needs its class index (0, 1, ...); a "
                         f"split without labels (a test split) cannot be trained or scored on")
    top = int(labels.max()) if len(labels) else -1
    if names is None:
        return [str(i) for i in range(top + 1)]
    if top >= len(names):
        raise ValueError(f"{where} holds label {top} but names {len(names)} classes")
    return names


# ------------------------------------------------------------------ webdataset tar shards
class TarShards(ShardedDataset):
    """A folder of webdataset tar shards: samples ``<key>.<jpg|png|...>`` + ``<key>.cls`` (the
    class index as text); the class names from ``classes.txt`` beside the shards (one a line),
    else ``0``..``max``. Members are read where the shard's index puts them (the standard
    library's ``tarfile``, uncompressed ``.tar`` only)."""

    payloads = IMAGE_KEYS

    def __init__(self, root, image_size: int, split: str = "train", val_data: str | None = None, files=None,
                 names: list[str] | None = None):
        root = Path(root)
        wanted = _wanted_split(split, val_data)
        files = files or _of_split(list(root.glob("*.tar")), root, wanted, "tar shards")
        self.index, labels = {}, []
        for path in files:
            self.index[path], shard_labels = _tar_index(path, self.payloads)
            labels.append(shard_labels)
        classes = _check_labels(np.concatenate(labels), names or tar_names(str(root)), str(root))
        super().__init__(root, _spans(files, [len(i) for i in self.index.values()], split, val_data, root),
                         classes, image_size)

    def block_ends(self, path):
        return list(range(BLOCK, len(self.index[path]), BLOCK))

    def row(self, path: Path, row: int):
        (offset, size), label, key = self.index[path][row]
        handle = self.cached(("file", path), lambda: open(path, "rb"))
        handle.seek(offset)
        return self.decode(handle.read(size), f"{path} sample {key!r}"), label

    def decode(self, data: bytes, where: str) -> torch.Tensor:
        return self.image(data, where)


class TarLatents(TarShards):
    """A latent cache as tar shards (``pack_latents``): ``meta.json`` as ``extract_latents.py``
    writes it, its ``shards`` the tar files, each sample ``<key>.npy`` (the moments of the image
    and of its mirror, (2, 2, C, h, w), as ``datasets.LatentDataset`` gives them) + ``<key>.cls``.
    Read as tar shards are (each process its own), with the latent cache's attributes."""

    is_latent = True
    payloads = ("npy",)

    def __init__(self, root):
        from .datasets import read_latent_meta

        root = Path(root)
        self.meta = read_latent_meta(root)
        missing = [name for name in self.meta["shards"] if not (root / name).is_file()]
        if missing:
            raise FileNotFoundError(f"latent folder {root} is incomplete: missing {missing[:3]}; pack it again")
        super().__init__(root, 0, files=[root / name for name in self.meta["shards"]], names=self.meta["classes"])
        self.scaling_factor, self.stats = self.meta["scaling_factor"], self.meta.get("latent_stats")
        self.vae_fingerprint, self.channels = self.meta.get("vae_fingerprint"), self.meta["latent_channels"]
        self.image_size = self.meta["image_size"]

    def decode(self, data: bytes, where: str) -> torch.Tensor:
        moments = torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False)).float()
        if moments.ndim != 5 or moments.shape[:3] != (2, 2, self.channels):
            raise ValueError(f"{where}: moments of shape {tuple(moments.shape)}, expected (2, 2, {self.channels}, h, "
                             f"w); pack the cache again with pack_latents")
        return moments


def pack_latents(cache, out, per_shard: int = 1000) -> list[Path]:
    """A latent folder of ``extract_latents.py`` as tar shards of ``per_shard`` latents each in a
    new folder ``out`` (``TarLatents``; ``--data out`` trains on it): each shard written under a
    temporary name and renamed, ``meta.json`` last. ``out`` must not exist (nothing is
    overwritten). Returns the shards."""
    from .choices import LATENT_META
    from .datasets import LatentDataset

    source, out = LatentDataset(cache), Path(out)
    store = np.dtype(source.meta.get("dtype", "float16"))   # as the cache holds them (the dataset gives fp32)
    if out.exists():
        raise FileExistsError(f"{out} exists: pack_latents writes a new folder; choose another")
    out.mkdir(parents=True)
    shards = []
    for first in range(0, len(source), per_shard):
        path, tmp = out / f"latents-{len(shards):06d}.tar", out / f".tmp-latents-{len(shards):06d}.tar"
        with tarfile.open(tmp, "w") as tar:
            for i in range(first, min(first + per_shard, len(source))):
                moments, label = source[i]
                buffer = io.BytesIO()
                np.save(buffer, moments.numpy().astype(store))
                for ext, data in (("npy", buffer.getvalue()), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{i:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        tmp.replace(path)
        shards.append(path)
    (out / LATENT_META).write_text(json.dumps({**source.meta, "shards": [p.name for p in shards]}, indent=2))
    return shards


def _tar_index(path: Path, payloads=IMAGE_KEYS) -> tuple[list, np.ndarray]:
    """A tar shard's samples in order: ((payload offset, size), label, key) each, and the labels;
    the payload is the member whose extension is one of ``payloads`` (an image, or latents)."""
    samples: dict[str, dict] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                name = member.name.rsplit("/", 1)[-1]
                if name.startswith(".") or "." not in name:
                    continue
                key, ext = member.name[:-len(name)] + name.split(".", 1)[0], name.split(".", 1)[1].lower()
                sample = samples.setdefault(key, {})
                if ext == LABEL_KEY:
                    sample[LABEL_KEY] = tar.extractfile(member).read()
                elif ext in payloads:
                    sample["image"] = (member.offset_data, member.size)
    except (tarfile.TarError, OSError) as err:
        raise ValueError(f"{path}: not a readable uncompressed tar shard ({err}); .tar.gz shards cannot be read "
                         f"at random: unpack them to .tar") from None
    rows = []
    for key, sample in samples.items():
        if "image" not in sample or LABEL_KEY not in sample:
            missing = f"a .{' / .'.join(payloads)} member" if "image" not in sample else "a .cls label"
            raise ValueError(f"{path}: sample {key!r} has no {missing}; every sample needs both")
        try:
            label = int(sample[LABEL_KEY].decode().strip())
        except ValueError:
            raise ValueError(f"{path}: sample {key!r}'s .cls is {sample[LABEL_KEY][:20]!r}, not a class "
                             f"index") from None
        rows.append((sample["image"], label, key))
    return rows, np.array([r[1] for r in rows], dtype=np.int64)


# ------------------------------------------------------------------ Hugging Face datasets (pyarrow)
def pyarrow():
    """pyarrow, or one line (a ValueError, as the CLIs print bad input) naming the extra that installs it."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ValueError(f"reading parquet or save_to_disk data needs pyarrow: {STREAM_HINT}") from None
    return pyarrow


class TableShards(ShardedDataset):
    """Hugging Face ``datasets`` data: parquet files (``kind="parquet"``) or the Arrow files of
    a ``save_to_disk`` folder (``kind="arrow"``) with an ``image`` column (``datasets``' Image:
    the encoded bytes) and a ``label`` column (class indices; ``ClassLabel`` names when the
    files record them)."""

    def __init__(self, root, image_size: int, kind: str, split: str = "train", val_data: str | None = None):
        pa, root = pyarrow(), Path(root)
        wanted = _wanted_split(split, val_data)
        self.kind = kind
        files, names = (parquet_files if kind == "parquet" else arrow_files)(root, wanted)
        self.ends, counts, labels = {}, [], []
        for path in files:
            table = self._table(path, columns=["label"], pa=pa)
            labels.append(table["label"].to_numpy())
            counts.append(table.num_rows)
            self.ends[path] = self._ends(path, pa)
        classes = _check_labels(np.concatenate(labels) if labels else np.zeros(0, np.int64), names, str(root))
        super().__init__(root, _spans(files, counts, split, val_data, root), classes, image_size)

    def _table(self, path: Path, columns: list[str], pa=None):
        """The file's ``columns`` (parquet: read; Arrow: memory-mapped); a file without ``COLUMNS``
        or unreadable is one line naming it."""
        pa = pa or pyarrow()
        try:
            if self.kind == "parquet":
                names = pa.parquet.read_schema(path).names
                table = pa.parquet.read_table(path, columns=columns) if COLUMNS <= set(names) else None
            else:
                with pa.memory_map(str(path)) as source:
                    table = pa.ipc.open_stream(source).read_all()
                names = table.column_names
                table = table.select(columns) if COLUMNS <= set(names) else None
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{path}: unreadable {self.kind} file ({str(err).splitlines()[0]})") from None
        if table is None:
            raise ValueError(f"{path}: has the columns {', '.join(names)}; needs 'image' (encoded images) and "
                             f"'label' (class indices), as Hugging Face image datasets have")
        return table

    def _ends(self, path: Path, pa) -> list[int]:
        """Where the file's row groups (parquet) or record batches (Arrow) end."""
        if self.kind == "parquet":
            meta = pa.parquet.ParquetFile(path).metadata
            sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        else:
            with pa.memory_map(str(path)) as source:
                sizes = [batch.num_rows for batch in pa.ipc.open_stream(source)]
        return list(np.cumsum(sizes)[:-1])

    def block_ends(self, path):
        return self.ends[path]

    def row(self, path: Path, row: int):
        ends = [0, *self.ends[path]]
        block = bisect.bisect_right(ends, row) - 1
        images, labels = self.cached((path, block), lambda: self._block(path, ends, block))
        value = images[row - ends[block]]
        data = value.get("bytes") if isinstance(value, dict) else value
        if not data:
            raise OSError(f"{path} row {row}: the image column holds no bytes (a path only?): save the dataset with "
                          f"its images embedded (datasets' Image feature does so by default)")
        return self.image(data, f"{path} row {row}"), int(labels[row - ends[block]])

    def _block(self, path: Path, ends: list[int], block: int):
        """One row group (parquet: read alone) or record batch (Arrow: a slice of the memory-mapped file)."""
        if self.kind == "parquet":
            part = pyarrow().parquet.ParquetFile(path).read_row_group(block, columns=["image", "label"])
        else:
            stop = self.ends[path][block] if block < len(self.ends[path]) else None
            table = self.cached(("table", path), lambda: self._table(path, columns=["image", "label"]))
            part = table.slice(ends[block], None if stop is None else stop - ends[block])
        return part["image"].to_pylist(), part["label"].to_numpy()


def _hf_names(metadata: dict | None) -> list[str] | None:
    """The label column's ``ClassLabel`` names from ``datasets``' features, if recorded."""
    try:
        feature = metadata["label"]
        return list(feature["names"]) if feature.get("_type") == "ClassLabel" else None
    except (KeyError, TypeError):
        return None


def parquet_files(root: Path, wanted: str):
    files = _of_split([*root.glob("*.parquet"), *root.glob("*/*.parquet")], root, wanted, "parquet files")
    meta = pyarrow().parquet.read_schema(files[0]).metadata or {}
    try:
        features = json.loads(meta.get(b"huggingface", b"{}")).get("info", {}).get("features")
    except ValueError:
        features = None
    return files, _hf_names(features)


def arrow_files(root: Path, wanted: str):
    """A ``save_to_disk`` folder's Arrow files of one split: a ``DatasetDict`` (``dataset_dict.json``,
    one sub-folder a split) or one ``Dataset`` (``state.json``; its recorded split, else train)."""
    folder = root
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if wanted is None and len(splits) == 1:
            wanted = splits[0]
        if wanted not in splits:
            raise ValueError(f"{root} has no {wanted!r} split (it has {', '.join(splits)}); pass --val-data with one "
                             f"of them, or a count")
        folder = root / wanted
    state = json.loads((folder / "state.json").read_text())
    if folder is root and wanted is not None and (state.get("_split") or "train") != wanted:
        raise ValueError(f"{root} holds the {state.get('_split')!r} split only, not {wanted!r}")
    files = [folder / f["filename"] for f in state.get("_data_files", [])]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"{folder}/state.json names no Arrow files, or ones that are missing: save it again with "
                         f"save_to_disk")
    info = folder / "dataset_info.json"
    features = json.loads(info.read_text()).get("features") if info.is_file() else None
    return files, _hf_names(features)
