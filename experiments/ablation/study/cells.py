"""The per-cell JSON store: ``<out>/cells/<task>/<variant>/seed<k>_lr<lr>.json``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .recipes import cell_name

def cell_path(out: Path, task: str, variant: str, seed: int, lr: float) -> Path:
    return out / "cells" / f"{cell_name(task, variant, seed, lr)}.json"


def _previous(out: Path, *cell) -> dict:
    """The cell's earlier successful result, or {}."""
    path = cell_path(out, *cell)
    data = json.loads(path.read_text()) if path.is_file() else {}
    return {} if "error" in data else data


def cell_done(out: Path, *cell, budgets=None) -> bool:
    """Finished successfully with every budget asked for (a failed cell's JSON holds its
    error and is retried on a rerun; a cell asked for a larger budget is continued)."""
    previous = _previous(out, *cell)
    have = {row["budget"] for row in previous.get("budgets", [])}
    return bool(previous) and (not budgets or set(budgets) <= have)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def load_cells(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "cells").rglob("*.json"))]
