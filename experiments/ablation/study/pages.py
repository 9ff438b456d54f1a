"""A page's generated blocks: the markers, and the block between them replaced in place.

``tables`` (the ablation tables) and ``flops`` (the FLOPs table) both write into the study's
record, so the writing lives here, below both."""

from __future__ import annotations

import os
from pathlib import Path

README_START, README_END = "<!-- ablation:start", "<!-- ablation:end -->"
PAGE = "experiments/ablation/README.md"   # the study's record, which holds the generated blocks


def fill_readme(path: Path, block: str, markers: tuple[str, str] = (README_START, README_END)) -> None:
    """Replace the text between the ablation markers (or other ``markers``) of ``path`` with ``block``."""
    first, last = markers
    if not path.is_file():
        raise SystemExit(f"{path}: no such file; pass --page the page that holds the ablation markers ({PAGE})")
    text = path.read_text()
    start, end = text.find(first), text.find(last)
    if start < 0 or end < start:
        raise SystemExit(f"{path}: no '{first} ... -->' ... '{last}' block to fill; "
                         "add the two marker lines where the tables belong")
    tmp = path.with_name(f".tmp{os.getpid()}-{path.name}")  # never a half-written README
    tmp.write_text(text[:start] + block + text[end + len(last):])
    os.replace(tmp, path)
