"""The end of the GPU check's log: NaLaDiT / DiT per measured cell, the model-level A/B
(new kernels against the old ones and against the unfused gated layer) and every first-use
check of the run with its result, from the JSON files one ``gpu_check.sh`` run wrote.

    python benchmarks/gpu_summary.py runs/gpu_check/<run>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

from benchmarks.tables import DIT_NAMES, cell_times, naladit_times  # noqa: E402

SWEEPS = ("model_sweep.json", "model_compiled.json", "graphs.json")
AB_CELL = ("XL/2", 256, 32, "train", "eager")


def read(folder: Path, name: str) -> dict | None:
    path = folder / name
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        print(f"  {name}: not valid JSON (the stage was stopped while writing it?); left out")
        return None


def ratio_lines(data: dict) -> list[str]:
    """One line per cell: both families' times and NaLaDiT / DiT on DiT's first backend
    (``tables.cell_times``, as the tables give it)."""
    dits, cells = cell_times(data)
    lines = []
    for (size, px, batch, task, mode), dit, nala, ratio in cells:
        cell = f"{size} {px} px b{batch} {task} {mode}"
        first = dit[0] if dits else None
        if ratio is None:
            lines.append(f"  {cell}: not compared (NaLaDiT {nala or 'not measured'}, DiT {first or 'not measured'})")
            continue
        lines.append(f"  {cell}: NaLaDiT {nala:.2f} ms, {DIT_NAMES[dits[0]]} {first:.2f} ms: NaLaDiT / DiT {ratio:.2f}")
    return lines


def ab_lines(folder: Path, sweep: dict | None) -> list[str]:
    new = naladit_times(sweep).get(AB_CELL)
    others = {"old kernels": naladit_times(read(folder, "model_ab_baseline.json")).get(AB_CELL),
              "unfused gated layer": naladit_times(read(folder, "model_ab_unfused.json")).get(AB_CELL)}
    cell = "{} {} px b{} {} {}".format(*AB_CELL)
    if new is None:
        return [f"  A/B {cell}: the new kernels' row was not measured"]
    lines = [f"  A/B {cell}: NaLaDiT on the new kernels {new:.2f} ms"]
    for name, ms in others.items():
        lines.append(f"    {name}: " + (f"{ms:.2f} ms (new / {name} {new / ms:.2f})" if ms else "not measured"))
    return lines


def check_lines(datas: list[dict]) -> list[str]:
    seen = {}
    for data in datas:
        for check in data.get("meta", {}).get("first_use_checks", []):
            what = ", ".join(f"{k} {v}" for k, v in check.items() if k not in ("path", "result"))
            seen[(check["path"], what)] = check["result"]
    if not seen:
        return ["  first-use checks: none recorded"]
    return [f"  first-use check {path} ({what}): {result}" for (path, what), result in seen.items()]


def summary(folder: Path) -> list[str]:
    lines = ["== NaLaDiT / DiT per cell"]
    datas = {name: read(folder, name) for name in SWEEPS}
    for name, data in datas.items():
        if data is not None:
            lines += ratio_lines(data)
    if all(d is None for d in datas.values()):
        lines.append("  no model stage wrote its JSON")
    lines += ab_lines(folder, datas["model_sweep.json"])
    every = [d for d in (read(folder, p.name) for p in sorted(folder.glob("*.json"))) if d]
    return lines + ["== first-use checks"] + check_lines(every)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python benchmarks/gpu_summary.py RUN_FOLDER (the folder gpu_check.sh wrote)", file=sys.stderr)
        return 2
    print("\n".join(summary(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
