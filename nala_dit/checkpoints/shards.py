"""Sharded checkpoints on disk (``<step>/shards/``, written by an FSDP run, ``sharding.py``),
read without running code.

``torch.distributed.checkpoint`` unpickles its ``.metadata`` file with ``pickle.load`` and its
non-tensor items with ``torch.load(weights_only=False)``: either runs whatever code a crafted
file names. The readers here accept only the classes the format itself writes (and plain
values), fill only fresh instances of them, and read only files of the ``shards/`` folder
within their real size (``check_storage``). ``read_shards`` gives one process the full tensors (what ``read.Checkpoint``
serves to ``sample.py``, ``export.py`` and the pipelines); ``load_sharded`` loads every process
its shards (an FSDP resume). The optimizer state is keyed by parameter name there and numbered
in ``optimizer.state_dict()``: ``by_name`` / ``by_number`` convert.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import stat
from pathlib import Path

import torch

from ..guards import BuildCheckedUnpickler

SHARDS = "shards"


def by_name(plain: dict, names: list[str]) -> dict:
    """A plain optimizer state dict (parameters numbered in group order, what
    ``optimizer.state_dict()`` writes) keyed by parameter name instead (what
    ``torch.distributed.checkpoint.state_dict`` reads); ``names`` in the optimizer's order."""
    order = [i for group in plain["param_groups"] for i in group["params"]]
    if len(order) != len(names):
        raise ValueError(f"the optimizer state holds {len(order)} parameters, the model {len(names)}")
    name_of = dict(zip(order, names))
    return dict(state={name_of[i]: s for i, s in plain["state"].items()},
                param_groups=[{**g, "params": [name_of[i] for i in g["params"]]} for g in plain["param_groups"]])


def by_number(named: dict) -> dict:
    """``by_name``'s inverse: parameters numbered 0, 1, ... in group order."""
    number = {n: i for i, n in enumerate(n for group in named["param_groups"] for n in group["params"])}
    return dict(state={number[n]: s for n, s in named["state"].items()},
                param_groups=[{**g, "params": [number[n] for n in g["params"]]} for g in named["param_groups"]])


# ---------------------------------------------------------------- reading without running code
# Exact (module, name) pairs: what the format pickles into ``.metadata`` and nothing else. Never
# a module "with any name": pickle protocol 4 resolves dotted names (``os.system`` reached as an
# attribute of a module that imports ``os``), so a name is looked up only if it is listed here.
_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),   # a lookup in torch's table of layouts by name
    *(("pathlib", name) for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")),
    ("collections", "OrderedDict"),
})


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and name.isidentifier() and isinstance(vars(torch).get(name), torch.dtype)


class ShardIndexError(ValueError):
    """A ``shards/.metadata`` refused for what it asks (not for a damaged byte): its message is
    the one line to show."""


@functools.cache
def _built_types() -> dict[type, frozenset[str]]:
    """The classes whose fresh instances the format fills with BUILD, and the fields each may set."""
    import dataclasses

    from torch.distributed.checkpoint import filesystem, metadata

    classes = (metadata.Metadata, metadata.MetadataIndex, metadata.StorageMeta, metadata.TensorProperties,
               metadata.TensorStorageMetadata, metadata.ChunkStorageMetadata, metadata.BytesStorageMetadata,
               filesystem._StorageInfo)
    return {c: frozenset(f.name for f in dataclasses.fields(c)) for c in classes}


class _MetadataUnpickler(BuildCheckedUnpickler):
    """Looks up only the listed globals, and lets BUILD fill only a fresh instance of the format's
    classes with its declared fields: BUILD on a class, function or shared object sets attributes
    process-wide (``(None, {"exists": PosixPath})`` on ``pathlib.PosixPath`` would replace
    ``Path.exists``)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")

    def check_build(self, inst, state) -> None:
        built = _built_types()
        fields = built.get(type(inst))
        what = getattr(inst, "__qualname__", None) or type(inst).__qualname__
        if fields is None:
            raise ShardIndexError(f"refused: it asks to set attributes of {what} ({type(inst).__name__}), which "
                                  f"changes it for the whole process; nothing in it was run")
        if "__setstate__" in vars(type(inst)):   # TensorProperties: a tuple of its five fields
            if not (isinstance(state, tuple) and len(state) == len(fields)):
                raise ShardIndexError(f"refused: a malformed {what} ({state!r:.60}); nothing in it was run")
        elif not (isinstance(state, dict) and all(type(k) is str and k in fields for k in state)):
            raise ShardIndexError(f"refused: it sets {what} attributes other than its fields {sorted(fields)} "
                                  f"({state!r:.60}); nothing in it was run")


def check_storage(folder: Path, storage_data: dict) -> None:
    """Every shard read the index asks for stays inside ``folder`` (a plain relative name, no
    ``..``, no link out) and within its file's real size (a regular file): a crafted index can
    neither take another run's weights nor read gigabytes from ``/dev/zero``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    root = Path(folder).resolve()
    sizes: dict[str, int] = {}
    for index, info in storage_data.items():
        if type(info) is not _StorageInfo or type(info.relative_path) is not str:
            raise ShardIndexError(f"refused: the entry for {getattr(index, 'fqn', index)!r} is not a shard "
                                  f"location ({type(info).__name__})")
        name = info.relative_path
        if name not in sizes:
            path = Path(name)
            file = (root / path).resolve()
            if path.is_absolute() or ".." in path.parts or not name or file.parent != root:
                raise ShardIndexError(f"refused: it reads {name!r}, outside {folder} (only files of the shards "
                                      f"folder itself are read)")
            try:
                st = file.stat()
            except OSError as err:
                raise ShardIndexError(f"it reads {name!r}, which is missing ({err.strerror}): the sharded "
                                      f"checkpoint is incomplete") from None
            if not stat.S_ISREG(st.st_mode):
                raise ShardIndexError(f"refused: it reads {name!r}, which is not a regular file")
            sizes[name] = st.st_size
        offset, length = info.offset, info.length
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 \
                or offset + length > sizes[name]:
            raise ShardIndexError(f"refused: it reads bytes {offset!r}+{length!r} of {name!r}, which holds "
                                  f"{sizes[name]} bytes (truncated or crafted)")
        if info.transform_descriptors:
            raise ShardIndexError(f"refused: {name!r} is stored through transforms "
                                  f"{list(info.transform_descriptors)!r:.80}, which this reader does not apply")


def _readers():
    """(storage reader class, load planner mixin) that never run a file's code."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            path = Path(self._get_metadata_path(kwargs.get("rank")))
            if not path.is_file():
                raise ShardIndexError(f"{path.name} is missing or not a regular file")
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            check_storage(Path(self.path), getattr(metadata, "storage_data", None) or {})
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class PlainBytes:
        def load_bytes(self, read_item, value) -> None:   # DefaultLoadPlanner's, weights_only
            from torch.distributed.checkpoint._traverse import set_element

            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeReader, PlainBytes


@contextlib.contextmanager
def first_failure():
    """torch.distributed.checkpoint raises a ``CheckpointException`` (a ``BaseException``, so
    ``except Exception`` misses it) whose text is every rank's traceback: raise the first
    rank's own exception instead, for the callers' one-line messages."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        failure = next(iter(err.failures.values()), None)
        failure = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(failure, Exception):
            raise failure from None
        raise RuntimeError(str(err).splitlines()[0]) from None


def load_sharded(state: dict, folder: Path) -> None:
    """``torch.distributed.checkpoint.load`` of ``folder`` into ``state`` (in place, every
    process its shards), through the readers above."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    reader, plain = _readers()
    reader = reader(str(folder))
    reader.read_metadata()   # a refused file fails here, by name (dcp.load would fall back and hide why)
    planner = type("SafeLoadPlanner", (plain, DefaultLoadPlanner), {})()
    with first_failure():
        dcp.load(state, storage_reader=reader, planner=planner)


def read_shards(folder: Path, key: str) -> dict:
    """The full tensors under ``key`` (``model``, ``ema``, ``projector``, ``optimizer``) of a
    sharded checkpoint's ``shards/`` folder, read on one process without a process group
    (as torch's ``dcp_to_torch_save`` reads), through the readers above."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader, plain = _readers()
    reader = reader(str(folder))
    reader.read_metadata()   # a refused file fails here, by name
    planner = type("SafeEmptyPlanner", (plain, _EmptyStateDictLoadPlanner), {})(keys={key})
    out: dict = {}
    with first_failure():
        _load_state_dict(out, storage_reader=reader, planner=planner, no_dist=True)
    if key not in out:
        raise KeyError(f"no {key!r} in the sharded checkpoint")
    return out[key]
