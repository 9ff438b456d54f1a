"""Benchmarks never delete or overwrite what a user has: every ``benchmarks/*.py --out`` refuses
an existing file when its flags are parsed (``benchmarks/outputs.py``), and ``gpu_check.sh``
refuses an ``$OUT`` that holds anything, touching nothing in it."""
import re
import subprocess
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


def test_gpu_check_refuses_a_folder_that_holds_anything(tmp_path):
    """31 files of the user's (the script packed and deleted such a folder's files) and an earlier
    gpu_check.log: all kept byte for byte, nothing added, one line naming the folder."""
    for i in range(31):
        (tmp_path / f"mine_{i}.txt").write_text(str(i))
    (tmp_path / "gpu_check.log").write_text("an earlier run's log")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env={"OUT": str(tmp_path),
                          "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert len(proc.stderr.strip().splitlines()) == 1 and str(tmp_path) in proc.stderr, proc.stderr
