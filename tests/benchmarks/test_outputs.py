"""Benchmarks never delete or overwrite what a user has: every ``benchmarks/*.py --out`` refuses
an existing file when its flags are parsed (``benchmarks/outputs.py``); ``tables.py`` keeps a
table of the page whose JSON a rerun's folder lacks, and a JSON without a key it needs is one
line naming both. (``gpu_check.sh``'s own folder rule: tests/benchmarks/test_gpu_plan.py.)"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_benchmark_out_is_new_output():
    """Each script's ``--out`` argument goes through ``new_output`` (a new script copying an
    older one's plain ``--out`` is caught here)."""
    plain = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        for line in script.read_text().splitlines():
            if re.search(r"add_argument\(\s*\"--out\"", line) and "type=new_output" not in line:
                plain.append(f"{script.name}: {line.strip()}")
    assert plain == []


def test_an_existing_out_is_refused_before_measuring(tmp_path, capsys):
    from benchmarks import launch

    out = tmp_path / "launch.json"
    out.write_text("the user's results")
    with pytest.raises(SystemExit) as exit_:
        launch.main(["--smoke", "--out", str(out)])
    assert exit_.value.code == 2 and out.read_text() == "the user's results"
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument --out: {out} exists; not overwriting it" in err, err


def test_tables_keep_an_earlier_table_whose_json_is_missing(tmp_path, capsys):
    from benchmarks import tables
    from tests.benchmarks.test_gpu_stages import HAND_KERNELS, HAND_SWEEP

    doc = tmp_path / "page.md"
    doc.write_text(f"# Page\n{tables.BEGIN}\n{tables.NONE_YET}\n{tables.END}\n")
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, files in ((first, dict(kernels_fused=HAND_KERNELS, model_sweep=HAND_SWEEP)),
                          (second, dict(model_sweep=HAND_SWEEP))):
        folder.mkdir()
        for name, data in files.items():
            (folder / f"{name}.json").write_text(json.dumps(data))
    assert tables.main(["--results", str(first), "--doc", str(doc)]) == 0
    both = doc.read_text()
    assert tables.main(["--results", str(second), "--doc", str(doc)]) == 0   # a folder without kernels_fused.json
    assert doc.read_text() == both
    assert (f"kept the page's earlier table of kernels_fused.json: {second} has no such file"
            in capsys.readouterr().out)


def test_tables_name_the_json_that_lacks_a_key(tmp_path, capsys):
    from benchmarks import tables

    meta = dict(device="cuda", device_name="H200", dtype="bf16", torch="2.11", command="python l.py")
    (tmp_path / "launch.json").write_text(json.dumps(dict(meta=meta, host=dict(
        launches=2000, wall_us_per_op=5.0, gpu_us_per_op=1.25), counts=[
        dict(what="gated layer", family="NaLaDiT", mode="fwd", aten_ops=12, gpu_kernels=10)])))
    doc = tmp_path / "page.md"
    doc.write_text(f"{tables.BEGIN}\nold\n{tables.END}\n")
    assert tables.main(["--results", str(tmp_path), "--doc", str(doc)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'launch.json'}: no 'host_ms_per_call' where the tables need it (written by another "
        f"version of its benchmark, or edited): rerun that benchmark")
    assert doc.read_text() == f"{tables.BEGIN}\nold\n{tables.END}\n"
