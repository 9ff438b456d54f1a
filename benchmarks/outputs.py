"""The ``--out`` of every benchmark: a results file is new or refused, never overwritten.

``type=new_output`` on the argument: an existing path is refused when the flags are parsed,
before any measuring, in argparse's one-line error (a run's own rewrites of its file as it goes
are its own). An empty value (the scripts' "no file" default) stays empty.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # as every module here (a benchmark's entry point may import this one first)


def new_output(value: str) -> Path | str:
    """argparse ``type`` for ``--out``: ``Path(value)``, refused if something exists there."""
    if not value:
        return ""
    path = Path(value)
    if path.exists() or path.is_symlink():
        raise argparse.ArgumentTypeError(f"{path} exists; not overwriting it: choose another --out, or move {path} "
                                         f"away")
    return path
