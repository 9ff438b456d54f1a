"""A crafted ``shards/.metadata`` (the one file of a sharded checkpoint that is a plain pickle)
runs no code on any route that reads shards: the two readers of ``nala_dit/checkpoints/shards.py``
and every command that reaches them. Each payload would create a marker file; the tests assert
the marker is absent and that the refusal is one line naming the file and the refused name.

Pickle protocol 4 resolves dotted names (``find_class("torch.distributed.checkpoint.metadata",
"os.system")`` is ``os.system``, the module imports ``os``): the payloads reach the same
functions through every allowed module, by both opcodes that name a global."""

import json
import pickle
import shutil
import struct

import pytest

from nala_dit.checkpoints import read as ckpt_lib
from nala_dit.checkpoints import shards

ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem", "torch",
                   "torch.serialization", "pathlib", "collections")
# (module, name, what the call does with the marker path); every allowed module with a dotted
# name or attribute chain to os.system, and plain dangerous globals.
TARGETS = [*((module, "os.system", "touch {}") for module in ALLOWED_MODULES if module != "collections"),
           ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__", "{}"),
           ("torch", "serialization.os.system", "touch {}"),
           ("torch", "distributed.checkpoint.metadata.os.system", "touch {}"),
           ("torch.serialization", "pickle.loads", "{}"),
           ("pathlib", "os.system", "touch {}"),
           ("collections", "_sys.modules", "{}"),
           ("os", "system", "touch {}"), ("posix", "system", "touch {}"), ("subprocess", "call", "touch {}"),
           ("builtins", "eval", "__import__('os').system('touch {}')"), ("builtins", "exec", "open('{}', 'w')"),
           ("torch", "load", "{}"), ("torch", "float32.__class__", "{}")]


def _unicode(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + struct.pack("<B", len(data)) + data   # SHORT_BINUNICODE


def payloads(marker) -> list[tuple[str, bytes]]:
    """``(label, pickle bytes)``: each target called with its argument, named by STACK_GLOBAL
    (protocol 4) and by GLOBAL (the text opcode, read under protocol 4 too)."""
    out = []
    for module, name, arg in TARGETS:
        call = _unicode(arg.format(marker)) + b"\x85R."   # TUPLE1, REDUCE, STOP
        out.append((f"STACK_GLOBAL {module} {name}", b"\x80\x04" + _unicode(module) + _unicode(name) + b"\x93" + call))
        out.append((f"GLOBAL {module} {name}", b"\x80\x04c" + f"{module}\n{name}\n".encode() + call))
    return out


def _crafted_checkpoint(folder, payload: bytes):
    """A checkpoint folder as an FSDP run writes it (``state.json`` marking it sharded), whose
    ``shards/.metadata`` is ``payload``."""
    (folder / "shards").mkdir(parents=True, exist_ok=True)
    (folder / "shards" / ".metadata").write_bytes(payload)
    (folder / "state.json").write_text(json.dumps(dict(
        step=1, epoch=0, position=0, world_size=2, config={}, sharded=dict(processes=2),
        model_config=dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2,
                          num_classes=10))))
    return folder


def test_the_payloads_do_run_code_through_plain_pickle(tmp_path):
    """The payloads are live (so a passing test below means the reader stopped them): plain
    ``pickle.loads`` of the dotted-name ones runs the command."""
    marker = tmp_path / "ran"
    live = dict(payloads(marker))
    pickle.loads(live["STACK_GLOBAL torch.distributed.checkpoint.metadata os.system"])
    assert marker.exists()
    marker.unlink()
    pickle.loads(live["GLOBAL pathlib os.system"])
    assert marker.exists()


@pytest.mark.parametrize("label,payload", payloads("MARKER"), ids=[label for label, _ in payloads("MARKER")])
def test_the_metadata_unpickler_refuses_every_payload(tmp_path, monkeypatch, label, payload):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        shards._MetadataUnpickler(__import__("io").BytesIO(payload.replace(b"MARKER", str(tmp_path / "m").encode()))).load()
    assert not (tmp_path / "m").exists()


def test_both_readers_refuse_every_payload_in_one_line(tmp_path):
    marker = tmp_path / "ran"
    for i, (label, payload) in enumerate(payloads(marker)):
        folder = _crafted_checkpoint(tmp_path / f"{i:07d}", payload)
        with pytest.raises(ckpt_lib.CheckpointError) as err:
            ckpt_lib.open_checkpoint(folder).weights("ema")          # read_shards: sample, export, app, consolidate
        message = str(err.value)
        assert "\n" not in message and str(folder / "shards") in message and "refused" in message, (label, message)
        with pytest.raises(Exception, match="Unsupported global"):  # load_sharded: the FSDP resume
            shards.load_sharded({}, folder / "shards")
        assert not marker.exists(), label


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """A real 2-process FSDP run of 2 steps with a sharded checkpoint at step 2."""
    from tests.ranks import run_ranks
    from tests.utils import TINY_RUN

    tmp = tmp_path_factory.mktemp("fsdp_run")
    proc = run_ranks(tmp, "train.py", *TINY_RUN, "--fsdp", "--max-steps", "2", "--ckpt-every", "2",
                     "--results-dir", tmp, "--exp-name", "run", processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run"


def test_no_command_runs_the_payload(fsdp_run, tmp_path, monkeypatch, capsys):
    """consolidate.py, sample.py --ckpt, export.py checkpoint, app.py's model loader and
    train.py --resume: each refuses the crafted file in one line, and nothing ran."""
    import app
    import consolidate
    import export
    import sample
    import train

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    payload = dict(payloads(marker))["STACK_GLOBAL torch.distributed.checkpoint.metadata os.system"]
    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    ckpt = run / "checkpoints" / "0000002"
    assert ckpt_lib.open_checkpoint(ckpt).weights("ema")   # the real checkpoint reads ...
    (ckpt / "shards" / ".metadata").write_bytes(payload)   # ... and then its metadata is crafted
    commands = {
        "consolidate.py": lambda: consolidate.main([str(run)]),
        "sample.py --ckpt": lambda: sample.main(["--ckpt", str(ckpt), "--labels", "1", "--steps", "2", "--grid", str(tmp_path / "g.png")]),
        "export.py checkpoint": lambda: export.main(["checkpoint", str(ckpt), str(tmp_path / "exported")]),
        "app.py --ckpt": lambda: app.main(["--ckpt", str(run)]),
        "train.py --resume auto": lambda: train.main([
            "--model", "NaLaDiT-T/2", "--data", "digits", "--results-dir", str(tmp_path), "--exp-name", "run",
            "--resume", "auto", "--num-workers", "0", "--max-steps", "2", "--global-batch-size", "4"]),
    }
    for command, call in commands.items():
        try:
            status = call()
        except SystemExit as exit_:
            status = exit_.code
        err = capsys.readouterr().err.strip()
        assert status not in (0, None), command
        assert "Traceback" not in err and "refused" in err, (command, err)
        assert not marker.exists(), command


# ---------------------------------------------------------------- an index that runs no code but asks too much
@pytest.fixture(scope="module")
def real_index(tmp_path_factory):
    """A sharded checkpoint written by torch.distributed.checkpoint on one process (the format an
    FSDP run writes), and the plain ``(ema weights, .metadata object)`` to craft variants from."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("index") / "0000001"
    ema = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "assuming the intent is to save in a single process"
        dcp.save({"ema": ema, "model": {k: -v for k, v in ema.items()}}, checkpoint_id=folder / "shards", no_dist=True)
    _crafted_checkpoint(folder, (folder / "shards" / ".metadata").read_bytes())
    return folder, ema, pickle.loads((folder / "shards" / ".metadata").read_bytes())


def _refusal(folder) -> str:
    with pytest.raises(ckpt_lib.CheckpointError) as err:
        ckpt_lib.open_checkpoint(folder).weights("ema")
    message = str(err.value)
    assert "\n" not in message and str(folder / "shards" / ".metadata") in message and "refused" in message, message
    return message


def test_the_real_index_reads(real_index):
    import torch

    folder, ema, _ = real_index
    got = ckpt_lib.open_checkpoint(folder).weights("ema")
    assert got.keys() == ema.keys() and all(torch.equal(got[k], ema[k]) for k in ema)


def test_build_on_a_class_function_or_shared_object_is_refused(real_index, tmp_path):
    """BUILD sets attributes: on ``pathlib.PosixPath`` (an allowed global) it would replace
    ``Path.exists`` for the whole process, on ``_get_layout`` its defaults, on an enum member its value."""
    import pathlib

    import torch

    folder = real_index[0]
    before = {name: dict(vars(obj)) for name, obj in (("PosixPath", pathlib.PosixPath), ("Path", pathlib.Path))}
    layout_defaults = torch.serialization._get_layout.__defaults__
    crafted = {
        "PosixPath": _unicode("pathlib") + _unicode("PosixPath") + b"\x93"
                     + b"N}" + _unicode("exists") + _unicode("pathlib") + _unicode("PosixPath") + b"\x93s\x86b.",
        "_get_layout": _unicode("torch.serialization") + _unicode("_get_layout") + b"\x93"
                       + b"N}" + _unicode("__defaults__") + b"K\x01\x85s\x86b.",
        "enum member": _unicode("torch.distributed.checkpoint.metadata") + _unicode("_MEM_FORMAT_ENCODING") + b"\x93"
                       + b"K\x00\x85R" + b"}" + _unicode("_value_") + b"K\x07sb.",
        "extra field": _unicode("torch.distributed.checkpoint.filesystem") + _unicode("_StorageInfo") + b"\x93)\x81"
                       + b"}" + _unicode("__class__") + b"Nsb.",
    }
    try:
        for label, body in crafted.items():
            case = tmp_path / label.replace(" ", "_")
            shutil.copytree(folder, case)
            (case / "shards" / ".metadata").write_bytes(b"\x80\x04" + body)
            _refusal(case)
            assert pathlib.Path(case).exists() is True, label
    finally:   # were the reader to let one through, later tests must not see a changed pathlib
        for name, obj in (("PosixPath", pathlib.PosixPath), ("Path", pathlib.Path)):
            for key in set(vars(obj)) - set(before[name]):
                delattr(obj, key)
        torch.serialization._get_layout.__defaults__ = layout_defaults
    assert {name: dict(vars(obj)) for name, obj in (("PosixPath", pathlib.PosixPath), ("Path", pathlib.Path))} == before
    assert torch.serialization._get_layout.__defaults__ == layout_defaults


@pytest.mark.parametrize("where", ["absolute", "dotdot", "link out", "/dev/zero", "past the end", "negative"])
def test_every_read_stays_inside_the_shards_folder_and_its_files(real_index, tmp_path, where):
    """An index pointing at another run's shards (absolute or ``../``, or a link out) would take
    its weights silently; at ``/dev/zero`` it would read whatever length it names."""
    import os

    folder, _, index = real_index
    other = tmp_path / "other_run"
    shutil.copytree(folder, other)
    case = tmp_path / "case"
    shutil.copytree(folder, case)
    infos = list(index.storage_data.values())
    name = infos[0].relative_path
    if where == "link out":
        os.symlink(other / "shards" / name, case / "shards" / "linked.distcp")
    if where == "/dev/zero":
        os.symlink("/dev/zero", case / "shards" / "zero.distcp")
    new_path, offset, length = {
        "absolute": (str(other / "shards" / name), None, None),
        "dotdot": (f"../../other_run/shards/{name}", None, None),
        "link out": ("linked.distcp", None, None),
        "/dev/zero": ("zero.distcp", 0, 1 << 26),
        "past the end": (name, None, (case / "shards" / name).stat().st_size + 1),
        "negative": (name, -1, None),
    }[where]
    saved = [(i.relative_path, i.offset, i.length) for i in infos]
    try:
        for info in infos:
            info.relative_path = new_path
            info.offset = info.offset if offset is None else offset
            info.length = info.length if length is None else length
        (case / "shards" / ".metadata").write_bytes(pickle.dumps(index))
    finally:
        for info, (path, off, size) in zip(infos, saved):
            info.relative_path, info.offset, info.length = path, off, size
    message = _refusal(case)
    assert ("outside" in message) == (where in ("absolute", "dotdot", "link out", "/dev/zero")), message
