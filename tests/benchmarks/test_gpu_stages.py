"""The stages of benchmarks/gpu_check.sh run end to end on the CPU at toy sizes (their
--smoke paths), write the keys benchmarks/tables.py reads, and the tables come out as
expected; the script parses, its stage limits sum to at most 8 minutes, and the docs page
holds exactly what tables.py makes of the committed results."""

import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import kernel_profile, kernels, launch, sweep, tables  # noqa: E402
from benchmarks.timing import device_events, kernel_ms, time_calls, timed_call  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STAGES = ["imports", "warm-up", "launch cost", "kernels fused", "kernels baseline", "profile", "model sweep",
          "model ab baseline", "model ab unfused", "model compiled", "cuda graphs"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run of every Python stage the script calls in-process, into one folder, named
    as gpu_check.sh names its files."""
    out = tmp_path_factory.mktemp("gpu_check")
    launch.main(["--smoke", "--out", str(out / "launch.json")])
    kernels.main(["--smoke", "--out", str(out / "kernels_fused.json")])
    kernels.main(["--smoke", "--methods", "nala", "--out", str(out / "kernels_baseline.json")])
    kernel_profile.main(["--smoke", "--out", str(out / "profile.json")])
    sweep.main(["--smoke", "--modes", "eager,default", "--out", str(out / "model_sweep.json")])
    return out


def load(folder, name):
    return json.loads((folder / name).read_text())


def test_timed_call_is_one_call_with_wall_time_and_no_gpu_time_on_the_cpu():
    calls = []
    wall, gpu = timed_call(lambda: (calls.append(1), time.sleep(0.02)), torch.device("cpu"))
    assert calls == [1] and wall >= 0.02 and gpu is None
    timing = time_calls(lambda: calls.append(1), torch.device("cpu"), repeats=3, warmup=2)
    assert len(calls) == 1 + 2 + 3 and timing["gpu_ms"] is None
    assert 0 < timing["wall_min_ms"] <= timing["wall_ms"]


def test_gpu_side_events_are_summed_per_call_by_name():
    """The CUDA half of the profiler tables on made-up events: only GPU-side events count,
    summed by name and divided by the profiled calls; kernel_ms is None on the CPU."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def event(name, device_type, us):
        return NS(name=name, device_type=device_type, time_range=NS(elapsed_us=lambda: us))

    prof = NS(events=lambda: [event("aten::mm", DeviceType.CPU, 50.0), event("gemm", DeviceType.CUDA, 30.0),
                              event("gemm", DeviceType.CUDA, 10.0), event("fill", DeviceType.CUDA, 2.0)])
    assert [e.name for e in device_events(prof)] == ["gemm", "gemm", "fill"]
    assert dict(kernel_profile.kernel_table(prof, torch.device("cuda"), steps=2)) == {"gemm": [1.0, 20.0], "fill": [0.5, 1.0]}
    assert kernel_ms(lambda: None, torch.device("cpu")) is None


def test_op_counter_counts_non_view_ops_and_leaves_bare_allocations_out():
    x = torch.zeros(4)
    with launch.CountOps() as counter:
        x.add_(1)                    # 1
        x.view(2, 2)                 # a view: 0
        torch.empty(3)               # an allocation: 0
        (x * 2).sum()                # 2
    assert counter.ops == 3


def test_launch_stage(smoke):
    data = load(smoke, "launch.json")
    host = data["host"]
    assert host["gpu_us_per_op"] is None and 0 < host["wall_us_per_op"] < 1e4 and host["launches"] == 50
    rows = {(r["what"], r["family"], r["mode"]): r for r in data["counts"]}
    assert len(rows) == 12 and all(r["gpu_kernels"] is None for r in rows.values())
    # Softmax attention forward: the qkv projection, SDPA, the output projection.
    assert rows[("attention layer", "DiT", "fwd")]["aten_ops"] == 3
    for (what, family, mode), r in rows.items():
        assert r["host_ms_per_call"] == pytest.approx(r["aten_ops"] * host["wall_us_per_op"] / 1e3)
        if mode == "fwd":
            assert rows[(what, family, "fwd+bwd")]["aten_ops"] > r["aten_ops"]
    for mode in ("fwd", "fwd+bwd"):   # the gated layer launches more than softmax attention; a model more than a block
        assert rows[("gated layer", "NaLaDiT", mode)]["aten_ops"] > rows[("attention layer", "DiT", mode)]["aten_ops"]
        assert rows[("model S/2 64px", "NaLaDiT", mode)]["aten_ops"] > rows[("block", "NaLaDiT", mode)]["aten_ops"]


@pytest.mark.parametrize("name, flops, bandwidth, label", [
    ("NVIDIA H200", 989e12, 4.8e12, "H200 bf16 dense"),
    ("NVIDIA H100 80GB HBM3", 989e12, 3.35e12, "H100 bf16 dense"),
    ("NVIDIA H100 NVL", 835e12, 3.9e12, "H100 NVL bf16 dense"),
    ("NVIDIA H100 PCIe", 756e12, 2.0e12, "H100 PCIe bf16 dense"),
    ("x86_64", 989e12, 4.8e12, "H200 bf16 dense (assumed: 'x86_64' is not in ROOFLINES)")])
def test_roofline_is_the_gpu_the_run_is_on(name, flops, bandwidth, label):
    """The device lent may be an H100 or an H200: each is scored against its own datasheet."""
    assert kernels.roofline_of(name) == dict(name=label, flops_per_s=flops, bytes_per_s=bandwidth)


def test_kernel_stage_counts_flops_and_bytes_in_closed_form(smoke):
    data = load(smoke, "kernels_fused.json")
    rows = data["rows"]
    assert {(r["method"], r["mode"]) for r in rows} == {(m, mode) for m in ("nala", "sdpa") for mode in ("fwd", "fwd+bwd")}
    assert len(rows) == 8 and data["meta"]["roofline"]["flops_per_s"] == 989e12
    for r in rows:
        b, h, n, d = r["batch"], r["heads"], r["tokens"], r["head_dim"]
        assert r["skipped"] is None and r["gpu_ms"] is None and r["kernel_ms"] is None and r["timing"] == "wall_ms"
        times = 1 if r["mode"] == "fwd" else 3      # backward: twice the forward's products
        # NaLa: state φ(k)ᵀv and output φ(q)S, features 2D wide; SDPA: q kᵀ and P v.
        per = 8 * b * h * n * d * d if r["method"] == "nala" else 4 * b * h * n * n * d
        assert r["flops"] == times * per
        assert r["bytes"] == (4 if r["mode"] == "fwd" else 11) * b * h * n * d * 4
        floor = 1e3 * max(r["flops"] / 989e12, r["bytes"] / 4.8e12)
        assert r["roofline_ms"] == pytest.approx(floor) and r["roofline_fraction"] == pytest.approx(floor / r["wall_ms"])
        assert r["us_per_1k_token_heads"] == pytest.approx(1e6 * r["wall_ms"] / (b * h * n))
        if r["method"] == "nala" and r["mode"] == "fwd+bwd":
            assert r["max_rel_rms_vs_eager"] < 1e-5      # fused vs eager, fp32
            assert r["nala/sdpa"] == pytest.approx(r["wall_ms"] / next(
                s["wall_ms"] for s in rows if s["method"] == "sdpa" and s["mode"] == r["mode"] and s["tokens"] == n))
    assert {r["method"] for r in load(smoke, "kernels_baseline.json")["rows"]} == {"nala"}


def test_kernel_stage_refuses_a_malformed_shape_in_one_line(capsys):
    for bad in ("4,16,4096", "4,16,x,72", "0,1,2,3"):
        with pytest.raises(SystemExit):
            kernels.main(["--shapes", bad])
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
            "expected B,H,N,D;B,H,N,D... of positive integers, e.g. 4,16,4096,72")


def test_profile_stage(smoke):
    data = load(smoke, "profile.json")
    rows = data["rows"]
    assert [(r["what"], r["family"], r["mode"]) for r in rows] == [
        (what, family, mode) for family, layer in (("NaLaDiT", "gated layer"), ("DiT", "attention layer"))
        for what in (layer, "block") for mode in ("fwd", "fwd+bwd")]
    for r in rows:
        us = [k["us_per_call"] for k in r["top"]]
        assert us == sorted(us, reverse=True) and 0 < sum(us) <= r["total_us_per_call"] * (1 + 1e-9)
        assert sum(k["share"] for k in r["top"]) <= 1 + 1e-9 and r["kernels_per_call"] >= len(r["top"])
    assert any("addmm" in k["name"] for k in rows[0]["top"])    # the layer's projections


def test_sweep_stage(smoke):
    data = load(smoke, "model_sweep.json")
    rows = data["rows"]
    assert [(r["mode"], r["task"], r["family"]) for r in rows] == [
        (mode, task, family) for mode in ("eager", "default") for task in ("train", "sample")
        for family in ("DiT", "NaLaDiT")]
    for r in rows:
        assert r["skipped"] is None, r
        assert r["gpu_ms"] is None and r["images_per_s"] == pytest.approx(r["batch"] / r["wall_ms"] * 1e3)
        assert math.isfinite(r["first_call_s"]) and (r["size"], r["resolution"], r["batch"]) == ("S/2", 64, 2)
    assert data["meta"]["compile_backend"] == "eager"


def test_sweep_cell_over_its_time_cap_is_recorded_as_skipped(tmp_path, monkeypatch):
    """A cell that outlasts --cell-cap-s is stopped there and recorded as skipped; the next runs."""
    slept = []
    monkeypatch.setattr(sweep, "run_cell", lambda *args: slept.append(1) or time.sleep(5))
    start = time.perf_counter()
    sweep.main(["--smoke", "--modes", "eager", "--tasks", "sample", "--cell-cap-s", "0.1",
                "--out", str(tmp_path / "s.json")])
    assert time.perf_counter() - start < 2 and len(slept) == 2
    rows = load(tmp_path, "s.json")["rows"]
    assert [r["skipped"] for r in rows] == ["CellTimeout: cell took > --cell-cap-s 0.1 s"] * 2


def test_sweep_plan_compiles_only_its_compile_cells_with_dit_on_one_backend(tmp_path, monkeypatch, capsys):
    """The GPU plan without a GPU: cell by cell, every eager cell for DiT on cuDNN and flash
    and NaLaDiT, then the compiled modes only at --compile-cells, DiT on cuDNN alone, CUDA
    graphs for sampling only; eager cells share one model per family and resolution."""
    monkeypatch.setattr(sweep, "variants", lambda device: [("DiT", "cudnn"), ("DiT", "flash"), ("NaLaDiT", None)])
    built, serials = [], itertools.count()

    def time_cell(model, *args):
        # A serial number per model object (id() is reused once a model is freed: flaky).
        if not hasattr(model, "_plan_serial"):
            model._plan_serial = next(serials)
        built.append(model._plan_serial)
        return dict(wall_ms=1.0, gpu_ms=None, first_call_s=0.0)

    monkeypatch.setattr(sweep, "time_cell", time_cell)
    sweep.main(["--smoke", "--modes", "eager,default,reduce-overhead", "--cells", "S/2:64:2,S/2:64:4",
                "--compile-cells", "S/2:64:4", "--out", str(tmp_path / "plan.json")])
    rows = load(tmp_path, "plan.json")["rows"]
    eager = [("eager", b, task, family, sdpa) for b in (2, 4) for task in ("train", "sample")
             for family, sdpa in (("DiT", "cudnn"), ("DiT", "flash"), ("NaLaDiT", None))]
    compiled = [(mode, 4, task, family, sdpa) for mode, tasks in (("default", ("train", "sample")), ("reduce-overhead", ("sample",)))
                for task in tasks for family, sdpa in (("DiT", "cudnn"), ("NaLaDiT", None))]
    assert [(r["mode"], r["batch"], r["task"], r["family"], r["sdpa"]) for r in rows] == eager[:6] + eager[6:] + compiled
    assert len(set(built[:12])) == 2 and len(set(built[12:])) == 6    # eager: one model per family; compiled: fresh
    with pytest.raises(SystemExit):
        sweep.main(["--smoke", "--cells", "S/2:64:2", "--compile-cells", "S/2:64:4"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("not among --cells; add them there")


@pytest.mark.slow   # a process under Triton's interpreter
def test_block_size_sweep_runs_under_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_configs.py"), "--smoke", "--head-dims", "72",
                           "--out", str(tmp_path / "triton_configs_d72.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = load(tmp_path, "triton_configs_d72.json")
    assert data["device"] == "cpu" and len(data["rows"]) == 2 and "default" in data["rows"][0]
    for r in data["rows"]:
        assert r["max_rel_rms_vs_default"] < 1e-5 and r["ms"] > 0
    lines = tables.block_tables(data)
    assert lines[4].startswith("| default (launch_config) |") and lines[4].endswith(" | 1.00 |")
    assert lines[5].startswith(f"| 32 |  | 4 | {data['rows'][1]['ms']:.3f} |")     # BV: the runs before the tiles


def test_tables_from_the_smoke_run(smoke):
    text = tables.render(smoke)
    assert "| gated layer | NaLaDiT |" in text and "| attention layer | DiT | 3 / – |" in text
    assert "| 2, 2, 64, 24 | fwd+bwd |" in text and "**Kernel time, wall ms**" in text
    assert "| S/2 | 64 | 2 | train | default |" in text and "| NaLaDiT / DiT |" in text
    assert "| gated layer, NaLaDiT | fwd+bwd |" in text


HAND_KERNELS = dict(meta=dict(device="cuda", device_name="H200", dtype="bf16", torch="2.11", command="python k.py"), rows=[
    dict(method="nala", mode="fwd", batch=4, heads=16, tokens=4096, head_dim=72, gpu_ms=0.5, wall_ms=0.6,
         roofline_fraction=0.25, us_per_1k_token_heads=1.9073, skipped=None),
    dict(method="sdpa_cudnn", mode="fwd", batch=4, heads=16, tokens=4096, head_dim=72, gpu_ms=2.2, kernel_ms=2.0, wall_ms=2.1,
         roofline_fraction=0.35, us_per_1k_token_heads=7.63, skipped=None),
    dict(method="sdpa_flash", mode="fwd", batch=4, heads=16, tokens=4096, head_dim=72, skipped="RuntimeError: no"),
    dict(method="nala", mode="fwd", batch=64, heads=16, tokens=256, head_dim=72, skipped="budget"),
    dict(method="sdpa_cudnn", mode="fwd", batch=64, heads=16, tokens=256, head_dim=72, skipped="budget"),
    dict(method="sdpa_flash", mode="fwd", batch=64, heads=16, tokens=256, head_dim=72, skipped="budget"),
])
HAND_BASELINE = dict(meta=HAND_KERNELS["meta"], rows=[
    dict(method="nala", mode="fwd", batch=4, heads=16, tokens=4096, head_dim=72, gpu_ms=1.25, wall_ms=1.3, skipped=None)])
HAND_SWEEP = dict(meta=dict(device="cuda", device_name="H200", dtype="bf16", torch="2.11", command="python s.py"), rows=[
    dict(family="DiT", sdpa="cudnn", size="XL/2", resolution=256, batch=32, task="train", mode="eager", gpu_ms=100.0,
         wall_ms=101.0, skipped=None),
    dict(family="DiT", sdpa="flash", size="XL/2", resolution=256, batch=32, task="train", mode="eager",
         skipped="OutOfMemoryError: x"),
    dict(family="NaLaDiT", sdpa=None, size="XL/2", resolution=256, batch=32, task="train", mode="eager", gpu_ms=150.0,
         wall_ms=151.0, skipped=None),
    dict(family="DiT", sdpa="cudnn", size="XL/2", resolution=512, batch=32, task="train", mode="default",
         skipped="--budget-s 170 s spent"),
    dict(family="NaLaDiT", sdpa=None, size="XL/2", resolution=512, batch=32, task="train", mode="default",
         skipped="--budget-s 170 s spent"),
])


def test_tables_from_hand_made_json(tmp_path):
    (tmp_path / "kernels_fused.json").write_text(json.dumps(HAND_KERNELS))
    (tmp_path / "kernels_baseline.json").write_text(json.dumps(HAND_BASELINE))
    (tmp_path / "model_sweep.json").write_text(json.dumps(HAND_SWEEP))
    assert tables.render(tmp_path).splitlines() == [
        "**Kernel time, GPU ms: the kernels' own time (profiler), CUDA events where absent** "
        "(H200, bf16, torch 2.11; `python k.py`):",
        "",
        "| B, H, N, D | mode | NaLa | NaLa baseline | SDPA cuDNN | SDPA flash | NaLa / SDPA cuDNN "
        "| NaLa µs per 1K token-heads | % of roofline: NaLa / SDPA cuDNN |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| 4, 16, 4096, 72 | fwd | 0.500 | 1.250 | 2.000 | – | 0.25 | 1.91 | 25.0 / 35.0 |",   # all-skipped shape left out
        "",
        "**Model sweep, GPU ms (CUDA events) per call** (H200, bf16, torch 2.11; `python s.py`):",
        "",
        "| size | px | batch | task | mode | DiT cuDNN | DiT flash | NaLaDiT | NaLaDiT / DiT cuDNN |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |",
        "| XL/2 | 256 | 32 | train | eager | 100.00 | – | 150.00 | 1.50 |",
    ]
    assert tables.render(tmp_path / "none") == tables.NONE_YET


def test_tables_warn_above_them_where_a_kernel_fell_back(tmp_path):
    """A failed first-use check in any JSON of the run (meta.first_use_checks) is one warning
    line above the tables, per key; passed checks add nothing."""
    passed = dict(path="NaLa kernels", device="cuda:0", dtype="bfloat16", head_dim=64, direction="cosine",
                  result="passed")
    failed = dict(passed, head_dim=72, result="RuntimeError: ptxas error")
    gated = dict(path="gated layer kernels", device="cuda:0", dtype="bfloat16", width=1152, heads=16,
                 result="output differs from the eager path by relative RMS 3.1e-01 (> 3e-02)")
    kernels = dict(HAND_KERNELS, meta=dict(HAND_KERNELS["meta"], first_use_checks=[passed, failed]))
    sweep = dict(HAND_SWEEP, meta=dict(HAND_SWEEP["meta"], first_use_checks=[failed, gated]))
    (tmp_path / "kernels_fused.json").write_text(json.dumps(kernels))
    (tmp_path / "model_sweep.json").write_text(json.dumps(sweep))
    lines = tables.render(tmp_path).splitlines()
    assert lines[:2] == [
        "**Fallback: the NaLa kernels failed their first-use check** (device cuda:0, dtype bfloat16, head_dim 72, "
        "direction cosine: RuntimeError: ptxas error); the NaLa rows of that key are not the Triton kernels' times.",
        "**Fallback: the gated layer kernels failed their first-use check** (device cuda:0, dtype bfloat16, width 1152, "
        "heads 16: output differs from the eager path by relative RMS 3.1e-01 (> 3e-02)); the NaLa rows of that "
        "key are not the Triton kernels' times."]
    assert lines[2] == "" and lines[3].startswith("**Kernel time")
    (tmp_path / "kernels_fused.json").write_text(json.dumps(dict(kernels, meta=dict(kernels["meta"],
                                                                               first_use_checks=[passed]))))
    (tmp_path / "model_sweep.json").unlink()
    assert tables.render(tmp_path).splitlines()[0].startswith("**Kernel time")


def test_launch_and_profile_tables_from_hand_made_json(tmp_path):
    meta = dict(device="cuda", device_name="H200", dtype="bf16", torch="2.11", command="python l.py")
    (tmp_path / "launch.json").write_text(json.dumps(dict(meta=meta, host=dict(launches=2000, wall_us_per_op=5.0,
                                                                                gpu_us_per_op=1.25), counts=[
        dict(what="gated layer", family="NaLaDiT", mode="fwd", aten_ops=12, gpu_kernels=10, host_ms_per_call=0.06),
        dict(what="gated layer", family="NaLaDiT", mode="fwd+bwd", aten_ops=1043, gpu_kernels=40, host_ms_per_call=5.215),
        dict(what="attention layer", family="DiT", mode="fwd", aten_ops=3, gpu_kernels=None, host_ms_per_call=0.015)])))
    (tmp_path / "profile.json").write_text(json.dumps(dict(meta=dict(meta, unit="GPU kernels", size="XL/2", resolution=256,
                                                                      batch=32), rows=[
        dict(what="block", family="DiT", mode="fwd", total_us_per_call=200.0, kernels_per_call=13.0, top=[
            dict(name="sm90_gemm|bf16", us_per_call=150.0, share=0.75), dict(name="cudnn_sdpa", us_per_call=50.0, share=0.25)])])))
    assert tables.render(tmp_path).splitlines() == [
        "**Launch cost** (H200, bf16, torch 2.11; `python l.py`):",
        "",
        "Host cost per launched op (2,000 tiny adds): 5.00 µs wall, 1.25 µs on the GPU.",
        "",
        "| what | model | fwd: aten ops / GPU kernels | fwd+bwd: aten ops / GPU kernels | host ms fwd | host ms fwd+bwd |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        "| gated layer | NaLaDiT | 12 / 10 | 1,043 / 40 | 0.06 | 5.21 |",
        "| attention layer | DiT | 3 / – | – | 0.01 | – |",
        "",
        "**Per-kernel profile (GPU kernels, XL/2, 256 px, batch 32)** (H200, bf16, torch 2.11; `python l.py`):",
        "",
        "| subject | mode | µs per call | kernels per call | top 3 (share) |",
        "| --- | --- | ---: | ---: | --- |",
        "| block, DiT | fwd | 200.0 | 13 | sm90_gemm/bf16 75%; cudnn_sdpa 25% |",    # a | in a name would split the cell
    ]


def test_tables_rewrite_only_between_the_markers(tmp_path, capsys):
    doc = tmp_path / "page.md"
    doc.write_text(f"# Page\nmine\n{tables.BEGIN}\nold table\n{tables.END}\nafter, mine too\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model_sweep.json").write_text(json.dumps(HAND_SWEEP))
    assert tables.main(["--results", str(tmp_path / "run"), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Page\nmine\n" + tables.BEGIN + "\n**Model sweep")
    assert text.endswith("| 1.50 |\n" + tables.END + "\nafter, mine too\n") and "old table" not in text
    doc.write_text("no markers here\n")
    assert tables.main(["--results", str(tmp_path / "run"), "--doc", str(doc)]) == 2
    assert doc.read_text() == "no markers here\n"                          # left as it was
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and tables.BEGIN in err[0]
    # A folder without the run's files (a typo) is one error line; the page's tables stay.
    doc.write_text(f"{tables.BEGIN}\nold table\n{tables.END}\n")
    assert tables.main(["--results", str(tmp_path / "runn"), "--doc", str(doc)]) == 2
    assert doc.read_text() == f"{tables.BEGIN}\nold table\n{tables.END}\n"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "runn" in err[0]
    assert set(tables.RUN_FILES) - {"warmup.json"} == set(     # warm-up: read for its first-use checks only
        re.findall(r'load\("([a-z0-9_]+\.json)"\)', (ROOT / "benchmarks" / "tables.py").read_text()))


def test_performance_page_holds_what_tables_makes_of_the_committed_results():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert tables.replace_between_markers(page, tables.render(ROOT / "benchmarks" / "results" / "gpu_check")) == page


def test_gpu_check_parses_and_its_stage_limits_fit_eight_minutes():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    text = SCRIPT.read_text().split("# Outside the plan")[0]
    stages = re.findall(r'^(?:model_)?stage "([^"]+)" (\d+)', text, flags=re.M)
    assert [name for name, _ in stages] == STAGES
    assert sum(int(limit) for _, limit in stages) <= 480
    # Every JSON a stage of the plan writes is one tables.py reads (warmup.json for its checks).
    written = set(re.findall(r'\$DEST/([a-z0-9_]+\.json)', text))
    assert written == set(tables.RUN_FILES) - {"triton_configs_d72.json"}


def test_gpu_check_runs_its_plan_in_order(tmp_path):
    """With no stage selected (ONLY names none) the script still sets up, lists every stage
    in order in its summary, and writes its log."""
    env = {**os.environ, "OUT": str(tmp_path), "ONLY": "no-such-stage", "PYTHON": "true"}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "gpu_check.log").read_text()
    summary = log.split("== summary")[1].splitlines()[1:1 + len(STAGES)]
    assert summary == [f"  {name}: not run (ONLY=no-such-stage)" for name in STAGES]
    assert "  first-use checks: no fallback seen in the log" in log.split("== summary")[1].splitlines()


def test_gpu_check_summary_names_a_fallback(tmp_path):
    """A kernel that failed its first-use check (its warning anywhere in the log) is named in
    the summary, once, whatever printed it."""
    warning = ("RuntimeWarning: NaLa: the Triton kernels failed their first-use check on cuda:0 "
               "(torch.bfloat16, head dim 72, cosine): RuntimeError: ptxas error")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho '{warning}'\necho '{warning}'\n")
    fake.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "ONLY": "no-such-stage", "PYTHON": str(fake)}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "out" / "gpu_check.log").read_text().split("== summary")[1].splitlines()
    at = summary.index("  FALLBACK: the NaLa rows of these keys are not the Triton kernels' times:")
    assert summary[at + 1] == "    " + warning and not summary[at + 2].startswith("    RuntimeWarning")
