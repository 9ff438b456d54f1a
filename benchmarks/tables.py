"""The GPU tables of docs/performance.md, written from the JSON files of one gpu_check.sh run.

Reads what ``benchmarks/gpu_check.sh`` wrote (``RUN_FILES``: ``launch.json``,
``kernels_fused.json`` and ``kernels_baseline.json``, ``profile.json``, ``model_sweep.json``
with the A/B's ``model_ab_baseline.json`` and ``model_ab_unfused.json``,
``model_compiled.json``, ``graphs.json``, ``triton_configs_d72.json``; ``warmup.json`` only for
its first-use checks) and replaces the text
between ``<!-- gpu-tables:begin -->`` and ``<!-- gpu-tables:end -->`` in the page: measured
rows only (a cell not measured is "–"; a row with nothing measured is left out). Times are
GPU ms (CUDA events) where the run had a GPU, else wall ms, as each table says. Predicted
figures live outside the markers, labelled "predicted", and are never written here. A table
the page holds whose JSON the folder lacks is kept as it is, saying so (``keep_earlier``); a
JSON that lacks a key a table needs is one line naming the file and the key.

    python benchmarks/tables.py --results benchmarks/results/gpu_check            # rewrite the page
    python benchmarks/tables.py --results runs/gpu_check --print                  # print only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # as every entry point (docs/performance.md, Threads); this one loads no torch
BEGIN, END = "<!-- gpu-tables:begin -->", "<!-- gpu-tables:end -->"
NONE_YET = ("No run of the re-planned `benchmarks/gpu_check.sh` is committed yet: this section is empty "
            "until one is (`python benchmarks/tables.py --results DIR` fills it from the run's JSON files).")
SDPA_NAMES = {"sdpa_cudnn": "SDPA cuDNN", "sdpa_flash": "SDPA flash", "sdpa": "SDPA"}
DIT_NAMES = {"cudnn": "DiT cuDNN", "flash": "DiT flash", "default": "DiT"}


def fmt(x, digits=3):
    if x is None:
        return "–"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:.{digits}f}"


def row(cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header, rows, right=()):
    align = ["---:" if i in right else "---" for i in range(len(header))]
    return [row(header), row(align), *(row(r) for r in rows)]


def time_of(r, basis=("gpu_ms", "wall_ms")):
    """The first of ``basis`` the row measured (GPU time before wall time), None if skipped."""
    if r is None or r.get("skipped"):
        return None
    return next((r[k] for k in basis if r.get(k) is not None), None)


KERNEL_BASIS = ("kernel_ms", "gpu_ms", "wall_ms")


def unit(meta):
    return "GPU ms (CUDA events)" if meta["device"].startswith("cuda") else "wall ms"


def caption(title, meta):
    return f"**{title}** ({meta.get('device_name', meta['device'])}, {meta['dtype']}, torch {meta['torch']}; `{meta['command']}`):"


def launch_tables(data):
    meta, host = data["meta"], data["host"]
    gpu = "–" if host["gpu_us_per_op"] is None else f"{host['gpu_us_per_op']:.2f}"
    lines = [caption("Launch cost", meta), "",
             f"Host cost per launched op ({host['launches']:,} tiny adds): {host['wall_us_per_op']:.2f} µs wall, "
             f"{gpu} µs on the GPU.", ""]
    by = {(r["what"], r["family"], r["mode"]): r for r in data["counts"]}
    rows = []
    for what, family in dict.fromkeys((r["what"], r["family"]) for r in data["counts"]):
        fwd, both = by.get((what, family, "fwd")), by.get((what, family, "fwd+bwd"))
        rows.append([what, family,
                     *(f"{fmt(r['aten_ops'])} / {fmt(r['gpu_kernels'])}" if r else "–" for r in (fwd, both)),
                     *(fmt(r["host_ms_per_call"], 2) if r else "–" for r in (fwd, both))])
    return lines + table(["what", "model", "fwd: aten ops / GPU kernels", "fwd+bwd: aten ops / GPU kernels",
                          "host ms fwd", "host ms fwd+bwd"], rows, right=(2, 3, 4, 5))


def kernel_tables(fused, baseline):
    meta = fused["meta"]
    get = {(r["method"], r["mode"], r["batch"], r["heads"], r["tokens"], r["head_dim"]): r for r in fused["rows"]}
    old = {(r["mode"], r["batch"], r["heads"], r["tokens"], r["head_dim"]): r for r in (baseline or {}).get("rows", [])
           if r["method"] == "nala"}
    sdpas = [m for m in SDPA_NAMES if any(r["method"] == m for r in fused["rows"])]
    base = sdpas[0] if sdpas else None
    rows = []
    for key in dict.fromkeys((r["mode"], r["batch"], r["heads"], r["tokens"], r["head_dim"]) for r in fused["rows"]):
        mode, *shape = key
        nala, prev = get.get(("nala", *key)), old.get(key)
        refs = [get.get((m, *key)) for m in sdpas]
        kt = lambda r: time_of(r, KERNEL_BASIS)  # noqa: E731
        times = [kt(nala), kt(prev), *(kt(r) for r in refs)]
        if all(x is None for x in times):
            continue
        ref = get.get((base, *key)) if base else None
        ratio = kt(nala) / kt(ref) if kt(nala) and kt(ref) else None
        fraction = lambda r: None if kt(r) is None else 100 * r["roofline_fraction"]  # noqa: E731
        rows.append([", ".join(str(s) for s in shape), mode, *(fmt(x) for x in times), fmt(ratio, 2),
                     fmt(None if nala is None or nala.get("skipped") else nala["us_per_1k_token_heads"], 2),
                     f"{fmt(fraction(nala), 1)} / {fmt(fraction(ref), 1)}"])
    header = ["B, H, N, D", "mode", "NaLa", "NaLa baseline", *(SDPA_NAMES[m] for m in sdpas),
              f"NaLa / {SDPA_NAMES[base] if base else 'SDPA'}", "NaLa µs per 1K token-heads",
              f"% of roofline: NaLa / {SDPA_NAMES[base] if base else 'SDPA'}"]
    what = ("GPU ms: the kernels' own time (profiler), CUDA events where absent" if meta["device"].startswith("cuda")
            else "wall ms")
    return [caption(f"Kernel time, {what}", meta), ""] + table(header, rows, right=tuple(range(2, len(header))))


def profile_tables(data, top=3):
    meta = data["meta"]
    rows = []
    for r in data["rows"]:
        names = "; ".join(f"{k['name'][:48].replace('|', '/')} {100 * k['share']:.0f}%" for k in r["top"][:top]
                          if k["share"] is not None)
        rows.append([f"{r['what']}, {r['family']}", r["mode"], fmt(r["total_us_per_call"], 1),
                     fmt(r["kernels_per_call"], 0), names or "–"])
    return [caption(f"Per-kernel profile ({meta['unit']}, {meta['size']}, {meta['resolution']} px, batch {meta['batch']})",
                    meta), ""] + table(["subject", "mode", "µs per call", "kernels per call", f"top {top} (share)"],
                                       rows, right=(2, 3))


def cell_key(r) -> tuple:
    """A sweep row's cell: (size, px, batch, task, mode)."""
    return r["size"], r["resolution"], r["batch"], r["task"], r["mode"]


def cell_times(data) -> tuple[list[str], list[tuple]]:
    """A sweep's DiT backends (in ``DIT_NAMES`` order) and, per cell in the run's order, (its key,
    DiT's time on each backend, NaLaDiT's time, NaLaDiT / DiT on the first backend); None where
    not measured."""
    dits = [s for s in DIT_NAMES if any(r["family"] == "DiT" and r["sdpa"] == s for r in data["rows"])]
    get = {(r["family"], r["sdpa"], *cell_key(r)): r for r in data["rows"]}
    cells = []
    for key in dict.fromkeys(cell_key(r) for r in data["rows"]):
        dit = [time_of(get.get(("DiT", s, *key))) for s in dits]
        nala = time_of(get.get(("NaLaDiT", None, *key)))
        cells.append((key, dit, nala, nala / dit[0] if nala and dits and dit[0] else None))
    return dits, cells


def naladit_times(data) -> dict[tuple, float | None]:
    """NaLaDiT's time per cell of a sweep (the model-level A/B's runs time it alone)."""
    return {} if data is None else {cell_key(r): time_of(r) for r in data["rows"] if r["family"] == "NaLaDiT"}


def sweep_tables(data, title):
    meta = data["meta"]
    dits, cells = cell_times(data)
    rows = []
    for key, dit, nala, ratio in cells:
        if nala is None and all(t is None for t in dit):
            continue
        rows.append([*key, *(fmt(t, 2) for t in dit), fmt(nala, 2), fmt(ratio, 2)])
    header = ["size", "px", "batch", "task", "mode", *(DIT_NAMES[s] for s in dits), "NaLaDiT",
              f"NaLaDiT / {DIT_NAMES[dits[0]] if dits else 'DiT'}"]
    return [caption(f"{title}, {unit(meta)} per call", meta), ""] + table(header, rows, right=(1, 2, *range(5, len(header))))


def block_tables(data):
    rows, default = [], None
    for r in data["rows"]:
        if "ms" not in r:
            continue
        if "default" in r:
            default = r["ms"]
            rows.append(["default (launch_config)", "", "", fmt(r["ms"]), "1.00"])
        elif "table" in r:   # launch_config(d, {"table": "previous"}): the configs before the register work
            rows.append([f"{r['table']} (launch_config)", "", "", fmt(r["ms"]), fmt(r["ms"] / default, 2) if default else "–"])
        else:
            rows.append([r["BLOCK_N"], r.get("BV", ""), r["num_warps"], fmt(r["ms"]), fmt(r["ms"] / default, 2) if default else "–"])
    shape = data["shape"]
    head = (f"**Block sizes**, head dim {', '.join(sorted({str(r['head_dim']) for r in data['rows']}))}, "
            f"B {shape['batch']}, H {shape['heads']}, N {shape['tokens']}, {data['dtype']}, {data['mode']}, "
            f"kernels {data['variant']} ({data.get('device', 'cuda')}):")
    return [head, ""] + table(["BLOCK_N", "BV", "warps", "ms", "vs default"], rows, right=(3, 4))


def fallback_lines(datas) -> list[str]:
    """A warning above the tables for every first-use check of the run that failed
    (``first_use_checks`` in each JSON's meta): NaLa rows measured after it timed the eager
    composition (or the gated layer's unfused tail), not the kernels."""
    failed = {}
    for data in datas:
        for check in data["meta"].get("first_use_checks", []):
            if check["result"] != "passed":
                what = ", ".join(f"{k} {v}" for k, v in check.items() if k not in ("path", "result"))
                failed[(check["path"], what)] = check["result"]
    return [f"**Fallback: the {path} failed their first-use check** ({what}: {cause}); the NaLa rows of that "
            "key are not the Triton kernels' times." for (path, what), cause in failed.items()]


RUN_FILES = ("warmup.json", "launch.json", "kernels_fused.json", "kernels_baseline.json", "profile.json",
             "model_sweep.json", "model_ab_baseline.json", "model_ab_unfused.json", "model_compiled.json",
             "graphs.json", "triton_configs_d72.json")


def ab_table(sweep, baseline, unfused):
    """The model-level A/B: NaLaDiT's rows of the A/B runs beside its row of the eager sweep (the
    new kernels, gated layers fused), at the cells the A/B runs measured."""
    new, old, plain = naladit_times(sweep), naladit_times(baseline), naladit_times(unfused)
    rows = [[*key[:4], fmt(new.get(key), 2), fmt(old.get(key), 2), fmt(plain.get(key), 2),
             fmt(new[key] / old[key], 2) if new.get(key) and old.get(key) else "–"]
            for key in dict.fromkeys([*old, *plain]) if key[4] == "eager"]
    meta = (baseline or unfused)["meta"]
    header = ["size", "px", "batch", "task", "new kernels", "old kernels", "unfused layer", "new / old"]
    return [caption(f"Model-level A/B, NaLaDiT eager, {unit(meta)} per step", meta), ""] + table(
        header, rows, right=(1, 2, 4, 5, 6, 7))


def render(results: Path) -> str:
    """The markdown between the markers, from the JSON files in ``results``; a file that lacks a
    key a table needs is a ValueError naming both."""
    files = _Loaded((name, json.loads((results / name).read_text())) for name in RUN_FILES
                    if (results / name).is_file())
    try:
        return _render(files)
    except KeyError as err:   # the file read last that lacks the key, else the file read last
        read = list(reversed(files.read))
        name = next((n for n in read if not _holds_key(files[n], err.args[0])), read[0] if read else None)
        where = results / name if name else f"a JSON file in {results}"
        raise ValueError(f"{where}: no {err.args[0]!r} where the tables need it (written by another version of its "
                         f"benchmark, or edited): rerun that benchmark") from None


class _Loaded(dict):
    """The run's JSON files by name, recording the names ``get`` returned, in order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = []

    def get(self, name, default=None):
        if name in self:
            self.read.append(name)
        return super().get(name, default)


def _holds_key(data, key) -> bool:
    """Whether ``key`` is a key anywhere in ``data`` (a JSON value)."""
    if isinstance(data, dict):
        return key in data or any(_holds_key(v, key) for v in data.values())
    if isinstance(data, list):
        return any(_holds_key(v, key) for v in data)
    return False


def _render(files: dict) -> str:
    load = files.get

    parts = []
    if warnings := fallback_lines([data for data in files.values() if "meta" in data]):
        parts.append(warnings)
    if (data := load("launch.json")) and data["host"]:
        parts.append(launch_tables(data))
    if (data := load("kernels_fused.json")):
        parts.append(kernel_tables(data, load("kernels_baseline.json")))
    if (data := load("profile.json")):
        parts.append(profile_tables(data))
    if (data := load("model_sweep.json")):
        parts.append(sweep_tables(data, "Model sweep"))
    if load("model_ab_baseline.json") or load("model_ab_unfused.json"):
        parts.append(ab_table(load("model_sweep.json"), load("model_ab_baseline.json"), load("model_ab_unfused.json")))
    if (data := load("model_compiled.json")):
        parts.append(sweep_tables(data, "Compiled models"))
    if (data := load("graphs.json")):
        parts.append(sweep_tables(data, "Sampling with CUDA graphs"))
    if (data := load("triton_configs_d72.json")):
        parts.append(block_tables(data))
    if not parts:
        return NONE_YET
    return "\n\n".join("\n".join(p) for p in parts)


# Each table's caption starts with its title; the JSON files that make it. A table of the page whose
# files a rerun's folder lacks is kept (``keep_earlier``), never dropped for a file not copied along.
TABLE_FILES = (("**Launch cost**", ("launch.json",)), ("**Kernel time", ("kernels_fused.json",)),
               ("**Per-kernel profile", ("profile.json",)), ("**Model sweep", ("model_sweep.json",)),
               ("**Model-level A/B", ("model_ab_baseline.json", "model_ab_unfused.json")),
               ("**Compiled models", ("model_compiled.json",)), ("**Sampling with CUDA graphs", ("graphs.json",)),
               ("**Block sizes**", ("triton_configs_d72.json",)))


def sections(body: str) -> list[tuple[tuple[str, ...] | None, str]]:
    """``body`` cut before each table's caption: (the JSON files that make it, its text); the lines
    above the first caption (the fallback warnings, or the "no run yet" line) come with None."""
    out, files, lines = [], None, []
    for line in body.splitlines():
        made_by = next((names for title, names in TABLE_FILES if line.startswith(title)), None)
        if made_by is not None and made_by != files:
            if any(line.strip() for line in lines):
                out.append((files, "\n".join(lines).strip("\n")))
            files, lines = made_by, []
        lines.append(line)
    if any(line.strip() for line in lines):
        out.append((files, "\n".join(lines).strip("\n")))
    return out


def keep_earlier(old: str, new: str, results: Path) -> tuple[str, list[str]]:
    """``new`` (``render``'s) with the tables of ``old`` (the page's) whose JSON files are not in
    ``results`` and so made no new table, each in its place; and the files of those kept."""
    fresh = [] if new == NONE_YET else sections(new)
    made = {files for files, _ in fresh}
    kept = [(files, text) for files, text in sections(old) if files is not None and files not in made
            and not any((results / name).is_file() for name in files)]
    order = {files: i for i, (_, files) in enumerate(TABLE_FILES)}
    parts = [s for s in fresh if s[0] is None] + sorted([s for s in fresh if s[0] is not None] + kept,
                                                        key=lambda s: order[s[0]])
    return "\n\n".join(text for _, text in parts) or NONE_YET, [" or ".join(files) for files, _ in kept]


def replace_between_markers(page: str, body: str) -> str:
    if page.count(BEGIN) != 1 or page.count(END) != 1 or page.index(BEGIN) > page.index(END):
        raise ValueError(f"the page must hold {BEGIN} and then {END}, once each")
    before, rest = page.split(BEGIN)
    _, after = rest.split(END)
    return f"{before}{BEGIN}\n{body}\n{END}{after}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "gpu_check"),
                        help="folder with one gpu_check.sh run's JSON files")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "performance.md"))
    parser.add_argument("--print", action="store_true", help="print the tables, change no file")
    args = parser.parse_args(argv)
    results = Path(args.results)
    if not args.print and not any((results / name).is_file() for name in RUN_FILES):
        # A mistyped folder would otherwise replace the page's tables with the "no run yet" line.
        print(f"error: {results} holds none of gpu_check.sh's JSON files ({', '.join(RUN_FILES)}): "
              "name the folder the run wrote (its $OUT)", file=sys.stderr)
        return 2
    try:
        body = render(results)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.print:
        print(body)
        return 0
    doc = Path(args.doc)
    try:
        page = doc.read_text()
        body, kept = keep_earlier(page.split(BEGIN, 1)[-1].split(END, 1)[0].strip("\n"), body, results)
        page = replace_between_markers(page, body)
    except (OSError, ValueError) as err:
        print(f"error: {doc}: {err}", file=sys.stderr)
        return 2
    doc.write_text(page)
    for files in kept:
        print(f"kept the page's earlier table of {files}: {results} has no such file")
    print(f"wrote the tables into {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
