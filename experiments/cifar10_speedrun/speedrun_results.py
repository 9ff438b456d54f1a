"""The speedrun's ``--out``: which files are the run's, the summary (equal steps) and its table.

A run folder is the run's own once ``settings.json`` is in it: that file records the settings,
the data (``--cifar``, resolved), the FID network (name and sha256) and a random ``run_id``
that every file the run writes carries. A rerun resumes only a folder of the same settings;
a file at one of the run's names without its ``run_id`` (a user's ``summary.json``, another
run's ``data_fid.json``) is refused, never overwritten and never taken as a result. Every write
is atomic (``nala_dit.guards.atomic_write``): a kill leaves the old file or none.

The equal-steps rule: a variant is compared only when each of its seeds trained the planned
number of steps at the planned batch; a variant the time cap cut short is listed with its
steps and no contrast.
"""

from __future__ import annotations

import io
import json
import secrets
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nala_dit.cli.parse import passive_wait_policy  # noqa: E402  (torch-free)

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import numpy as np  # noqa: E402

SETTINGS = "settings.json"
TOY_LINE = "toy scale: these FIDs measure nothing (a few images and steps: the code path only, not the models)"


def _refuse_foreign(path: Path) -> SystemExit:
    return SystemExit(f"error: {path} was not written by this run (its run_id differs or is missing): move it "
                      f"away or pass another --out; it is neither overwritten nor taken as a result")


class RunFolder:
    """``--out``: opened for ``settings`` (a new folder, an empty one, or the same run's)."""

    def __init__(self, out: Path, settings: dict):
        self.out = out
        path = out / SETTINGS
        if path.is_file():
            try:
                held = json.loads(path.read_text())
                run_id = held.pop("run_id")
            except (ValueError, KeyError, AttributeError):
                raise _refuse_foreign(path) from None
            if held != settings:
                diff = sorted(k for k in set(held) | set(settings) if held.get(k) != settings.get(k))
                shown = "; ".join(f"{k}: {held.get(k)!r} there, {settings.get(k)!r} now" for k in diff[:3])
                raise SystemExit(f"error: {out} holds a run of other settings ({shown}): pass another --out, or "
                                 f"the same settings to resume it")
            self.run_id = run_id
            return
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            held = sorted(p.name for p in out.iterdir())[:3] if out.is_dir() else [out.name]
            raise SystemExit(f"error: --out {out} holds files this run did not write ({', '.join(held)}): pass a new "
                             f"or empty folder")
        self.run_id = secrets.token_hex(8)
        self.write_json(SETTINGS, settings)

    def path(self, name: str) -> Path:
        return self.out / name

    def read_json(self, name: str) -> dict | None:
        """The run's own file ``name``, None when absent; another's is refused."""
        path = self.path(name)
        if not path.exists():
            return None
        try:
            obj = json.loads(path.read_text())
        except (OSError, ValueError):
            raise _refuse_foreign(path) from None
        if not isinstance(obj, dict) or obj.get("run_id") != self.run_id:
            raise _refuse_foreign(path)
        return obj

    def write_json(self, name: str, obj: dict) -> None:
        from nala_dit.guards import atomic_write

        if name != SETTINGS:
            self.read_json(name)   # a file there that is not the run's is refused, not overwritten
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({**obj, "run_id": self.run_id}, indent=2)
        atomic_write(path, lambda f: f.write(text.encode()))

    def write_text(self, name: str, text: str) -> None:
        """A rendered file (the table): replaced only when the run wrote the one there."""
        from nala_dit.guards import atomic_write

        path, mark = self.path(name), f"(speedrun run {self.run_id})"
        if path.exists() and mark not in path.read_text(errors="replace"):
            raise _refuse_foreign(path)
        atomic_write(path, lambda f: f.write(f"{text}\n{mark}\n".encode()))

    def read_npz(self, name: str, key: str) -> np.ndarray | None:
        path = self.path(name)
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                if str(data["run_id"]) != self.run_id:
                    raise _refuse_foreign(path)
                return data[key]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:   # damaged or foreign
            raise SystemExit(f"error: {path} is unreadable ({type(err).__name__}) or not this run's: move it away "
                             f"and rerun (it is computed again)") from None

    def write_npz(self, name: str, **arrays) -> None:
        from nala_dit.guards import atomic_write

        self.read_npz(name, "run_id")
        buffer = io.BytesIO()
        np.savez(buffer, run_id=np.array(self.run_id), **arrays)
        atomic_write(self.path(name), lambda f: f.write(buffer.getvalue()))

    def cells(self) -> list[dict]:
        return [self.read_json(f"cells/{p.name}") for p in sorted((self.out / "cells").glob("*.json"))]


def summarize(cells: list[dict], variants: list[str], planned_steps: int, batch: int, network: dict) -> dict:
    """Per variant: seeds, steps and images seen, time a seed-step, FID mean ± spread (sample std
    over seeds); the per-seed contrast against softmax + MLP only between variants that trained
    the planned steps (the equal-steps rule), the others marked ``not_compared``."""
    rows = {}
    for v in variants:
        mine = [c for c in cells if c["variant"] == v]
        if not mine:
            continue
        steps = [c["train"]["steps"] for c in mine]
        fids = np.array([c["fid"] for c in mine])
        rows[v] = {"n": len(mine), "steps": steps, "planned_steps": planned_steps,
                   "images_seen": [s * batch for s in steps], "fid_mean": float(fids.mean()),
                   "fid_spread": float(fids.std(ddof=1)) if len(mine) > 1 else 0.0,
                   "seed_step_s": float(np.mean([c["train"]["seed_step_s"] for c in mine])),
                   "images_per_s": float(np.mean([c["train"]["images_per_s"] for c in mine])),
                   "seeds_together": sorted({c["seeds_together"] for c in mine})}
        if min(steps) < planned_steps:
            rows[v]["not_compared"] = (f"the time cap cut its training at {min(steps)} of {planned_steps} steps: "
                                       f"FID at unequal steps says nothing about the attention")
    base = rows.get("softmax_mlp")
    base_fid = {c["seed"]: c["fid"] for c in cells if c["variant"] == "softmax_mlp"}
    for v, row in rows.items():
        if base is not None and "not_compared" not in row and "not_compared" not in base:
            row["contrast_vs_softmax_mlp"] = {str(c["seed"]): c["fid"] - base_fid[c["seed"]] for c in cells
                                              if c["variant"] == v and c["seed"] in base_fid}
    return {"variants": rows, "cells": len(cells), "planned_steps": planned_steps, "batch": batch,
            "fid_network": network}


def render_table(summary: dict, smoke: bool) -> str:
    """The summary as a Markdown table, the FID network below it; in smoke mode the toy-scale line."""
    lines = ["| variant | seeds | steps | images seen | ms a step (one seed) | FID ± spread | vs softmax + MLP |",
             "|---|---|---|---|---|---|---|"]
    for v, row in summary["variants"].items():
        steps = f"{row['planned_steps']}" if "not_compared" not in row else \
            f"{min(row['steps'])} of {row['planned_steps']} (cut)"
        contrast = row.get("contrast_vs_softmax_mlp")
        vs = ("not compared: cut short" if "not_compared" in row else "base" if v == "softmax_mlp" else
              "-" if not contrast else f"{np.mean(list(contrast.values())):+.2f}")
        lines.append(f"| {v} | {row['n']} | {steps} | {sum(row['images_seen']):,} | {row['seed_step_s'] * 1e3:.1f} "
                     f"| {row['fid_mean']:.2f} ± {row['fid_spread']:.2f} | {vs} |")
    net = summary["fid_network"]
    lines += ["", f"FID network: {net['weights_name']} (sha256 {net['weights_sha256'][:16]}…); against the full "
                  f"network: {net['fid_vs_full_network']}"]
    if smoke:
        lines += ["", TOY_LINE]
    return "\n".join(lines) + "\n"
