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
    (folder / "shards").mkdir(parents=True)
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
