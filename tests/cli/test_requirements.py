"""Tests of `nala_dit/cli/requirements.py`."""
import pytest

from tests.utils import ROOT, assert_names


@pytest.mark.parametrize("script, args", [("train.py", ["--config", "configs/digits_nala_dit.yaml"]),
                                          ("sample.py", ["--ckpt", "runs/demo/NaLaDiT", "--labels", "1"]),
                                          ("evaluate_fid.py", ["--help"]), ("export.py", ["--help"]),
                                          ("extract_latents.py", ["--help"]), ("demo.py", ["--quick"])])
def test_a_python_without_torch_gets_one_line_naming_the_venv(script, args):
    """``python -S`` (no site-packages: truly no torch, numpy or PyYAML),
    as the system python is; one line naming ``source .venv/bin/activate``, exit status 1."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-S", script, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert_names(lines[0], sys.executable, "no torch, numpy, yaml", "`source .venv/bin/activate`",
                 f"`.venv/bin/python {script} ...`", "`make`")
