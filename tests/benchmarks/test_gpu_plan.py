"""``benchmarks/warmup.py`` (the GPU check's compile stage) in its CPU smoke form: the items it
launches, in order, and its JSON written after each."""
import json

import pytest

from benchmarks import warmup


def test_items_cover_every_width_and_token_count():
    assert list(warmup.items(warmup.LAYERS, warmup.TOKENS))[:3] == [
        ("gated layer", 384, 6, 256), ("gated layer", 384, 6, 1024), ("gated layer", 384, 6, 4096)]
    got = list(warmup.items(warmup.LAYERS, warmup.TOKENS))
    assert len(got) == 12 and {(k, s) for k, s, _, _ in got} == {
        ("gated layer", 384), ("gated layer", 1152), ("nala", 64), ("nala", 72)}


def test_smoke_run_writes_each_item(tmp_path, capsys):
    out = tmp_path / "warmup.json"
    assert warmup.main(["--smoke", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [(r["kind"], r["size"], r["tokens"]) for r in record["rows"]] == [
        ("gated layer", 64, 16), ("gated layer", 64, 36), ("nala", 32, 16), ("nala", 32, 36)]
    assert record["meta"]["dtype"] == "fp32" and record["meta"]["first_use_checks"] == []   # no Triton on a CPU
    assert capsys.readouterr().out.count("warm-up ") == 4


def test_sweep_ab_cell_times_naladit_alone_with_its_gated_layers_unfused(tmp_path, monkeypatch):
    """The model-level A/B: --families NaLaDiT times only NaLaDiT, and --gated-layer unfused builds it
    with every gated layer on its plain composition (recompute off), recorded in the JSON."""
    from benchmarks import sweep

    seen = []

    def time_cell(model, family, *args):
        flags = {m.recompute for m in model.modules() if hasattr(m, "recompute")}
        seen.append((family, flags))
        return dict(wall_ms=1.0, gpu_ms=None, first_call_s=0.0)

    monkeypatch.setattr(sweep, "time_cell", time_cell)
    for layer, flag in (("fused", True), ("unfused", False)):
        seen.clear()
        sweep.main(["--smoke", "--modes", "eager", "--tasks", "train", "--families", "NaLaDiT",
                    "--gated-layer", layer, "--out", str(tmp_path / f"{layer}.json")])
        assert seen == [("NaLaDiT", {flag})]
        assert json.loads((tmp_path / f"{layer}.json").read_text())["meta"]["gated_layer"] == layer


# gpu_check.sh end to end with a stand-in python that writes each stage's --out file.

import os  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
PLAN_FILES = ["warmup.json", "launch.json", "kernels_fused.json", "kernels_baseline.json", "profile.json",
              "model_sweep.json", "model_ab_baseline.json", "model_ab_unfused.json", "model_compiled.json",
              "graphs.json"]


def fake_python(tmp_path) -> Path:
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\nwhile [[ $# -gt 0 ]]; do [[ "$1" == --out ]] && echo "{}" > "$2"; shift; done\n')
    fake.chmod(0o755)
    return fake


def test_gpu_check_runs_the_plan_and_packs_only_what_it_wrote(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake_python(tmp_path))}
    env.pop("ONLY", None)
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "results.tar"]
    with tarfile.open(out / "results.tar") as tar:
        assert sorted(tar.getnames()) == sorted(PLAN_FILES)
    log = (out / "gpu_check.log").read_text()
    order = [line.split(" (limit")[0][3:] for line in log.splitlines() if line.startswith("== ") and "(limit" in line]
    assert order == ["imports", "warm-up", "launch cost", "kernels fused", "kernels baseline", "profile", "model sweep",
                     "model ab baseline", "model ab unfused", "model compiled", "cuda graphs"]


def test_gpu_check_refuses_a_folder_that_holds_anything(tmp_path):
    """OUT holding a user's files (or an earlier run): one line, exit 2, nothing written, moved or deleted."""
    out = tmp_path / "out"
    out.mkdir()
    mine = {f"notes{i}.txt": f"mine {i}" for i in range(31)} | {"gpu_check.log": "an earlier log"}
    for name, text in mine.items():
        (out / name).write_text(text)
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake_python(tmp_path))}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and f"output folder {out} is not empty" in proc.stderr
    assert {p.name: p.read_text() for p in out.iterdir()} == mine


@pytest.mark.parametrize("code, outcome", [(1, "FAILED rc=1"), (124, "TIME LIMIT")])
def test_imports_stage_failing_skips_the_model_stages(tmp_path, code, outcome):
    """A missing diffusers (the GPU image's case without the wheels), or an import stopped at its limit
    (timeout's status 124): every stage that builds a model says why it did not run; the kernel stages
    still run."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/bash\n[[ "$1" == benchmarks/gpu_imports.py ]] && exit {code}\n'
                    'while [[ $# -gt 0 ]]; do [[ "$1" == --out ]] && echo "{}" > "$2"; shift; done\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake)}
    env.pop("ONLY", None)
    assert subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, timeout=120).returncode == 0
    summary = (out / "gpu_check.log").read_text().split("== summary")[1].splitlines()
    assert summary[1].startswith(f"  imports: {outcome}")
    skipped = [s.split(":")[0].strip() for s in summary if "not run (the imports stage failed" in s]
    assert skipped == ["launch cost", "profile", "model sweep", "model ab baseline", "model ab unfused",
                       "model compiled", "cuda graphs"]
    assert any(s.startswith("  kernels fused: ok") for s in summary)


def test_summary_gives_ratios_ab_and_checks(tmp_path):
    from benchmarks import gpu_summary

    def row(family, sdpa, ms, cell=("XL/2", 256, 32, "train", "eager"), skipped=None):
        size, px, batch, task, mode = cell
        return dict(family=family, sdpa=sdpa, size=size, resolution=px, batch=batch, task=task, mode=mode,
                    gpu_ms=ms, wall_ms=ms + 1, skipped=skipped)

    checks = [dict(path="gated layer kernels", device="cuda:0", width=1152, heads=16, result="passed")]
    (tmp_path / "model_sweep.json").write_text(json.dumps(dict(meta=dict(first_use_checks=checks), rows=[
        row("DiT", "cudnn", 100.0), row("DiT", "flash", 90.0), row("NaLaDiT", None, 125.0),
        row("NaLaDiT", None, 10.0, cell=("S/2", 256, 8, "sample", "eager"))])))
    (tmp_path / "model_ab_baseline.json").write_text(json.dumps(dict(meta={}, rows=[row("NaLaDiT", None, 250.0)])))
    lines = gpu_summary.summary(tmp_path)
    assert "  XL/2 256 px b32 train eager: NaLaDiT 125.00 ms, DiT cuDNN 100.00 ms: NaLaDiT / DiT 1.25" in lines
    assert "  S/2 256 px b8 sample eager: not compared (NaLaDiT 10.0, DiT not measured)" in lines
    assert "    old kernels: 250.00 ms (new / old kernels 0.50)" in lines
    assert "    unfused gated layer: not measured" in lines
    assert "  first-use check gated layer kernels (device cuda:0, width 1152, heads 16): passed" in lines


def test_tables_render_the_ab_and_the_compiled_models(tmp_path):
    from benchmarks import tables

    meta = dict(device="cuda", device_name="NVIDIA H100 80GB HBM3", dtype="bf16", torch="2.11", command="python s.py")

    def row(family, sdpa, ms, mode="eager"):
        return dict(family=family, sdpa=sdpa, size="XL/2", resolution=256, batch=32, task="train", mode=mode,
                    gpu_ms=ms, wall_ms=ms, skipped=None)

    files = {"model_sweep.json": [row("DiT", "cudnn", 100.0), row("NaLaDiT", None, 125.0)],
             "model_ab_baseline.json": [row("NaLaDiT", None, 250.0)],
             "model_compiled.json": [row("DiT", "cudnn", 80.0, "default"), row("NaLaDiT", None, 60.0, "default")]}
    for name, rows in files.items():
        (tmp_path / name).write_text(json.dumps(dict(meta=meta, rows=rows)))
    text = tables.render(tmp_path)
    assert "| XL/2 | 256 | 32 | train | 125.00 | 250.00 | – | 0.50 |" in text
    assert "**Compiled models, GPU ms (CUDA events) per call**" in text
    assert "| XL/2 | 256 | 32 | train | default | 80.00 | 60.00 | 0.75 |" in text
