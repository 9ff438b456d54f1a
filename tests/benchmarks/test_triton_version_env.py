"""``benchmarks/triton_version_env.sh``: it builds its throwaway Triton only in a folder that is
new, empty or its own, and touches nothing else (the download itself, and its one-line
failure offline, need pip and a network: not run here)."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "triton_version_env.sh"


def run(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True)


def test_a_folder_holding_other_files_is_refused_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    done = run("3.6.0", str(tmp_path))
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "did not put there" in done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "mine"


def test_a_version_that_is_not_x_y_z_is_one_usage_line(tmp_path):
    done = run("3.6", str(tmp_path / "new"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "usage:" in done.stderr
    assert not (tmp_path / "new").exists()
