"""``benchmarks/gpu_wheels.sh``: the wheels a GPU machine's image lacks are the versions this
repository installs (pyproject's pins, and what the pinned diffusers brings), and the script
fetches nothing it was not asked for."""
import importlib.metadata
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_wheels.sh"


def listed() -> dict[str, str]:
    out = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    return dict(line.split("==") for line in out.split())


def test_the_wheels_are_the_versions_installed_here():
    wheels = listed()
    assert set(wheels) == {"diffusers", "torch-fidelity", "importlib_metadata", "lazy-importer"}
    for name, version in wheels.items():
        assert importlib.metadata.version(name) == version, name
    pins = (ROOT / "pyproject.toml").read_text()
    assert '"torch-fidelity==' + wheels["torch-fidelity"] + '"' in pins
    low, high = re.search(r'"diffusers>=([\d.]+),<([\d.]+)"', pins).groups()
    as_tuple = lambda v: tuple(int(p) for p in v.split("."))  # noqa: E731
    assert as_tuple(low) <= as_tuple(wheels["diffusers"]) < as_tuple(high)


def test_what_diffusers_needs_beyond_the_image_is_listed():
    """diffusers' own requirements: each is either among the wheels or in the image's list that the
    script's header names (the GPU image holds the rest)."""
    header = SCRIPT.read_text().split("set -euo pipefail")[0]
    wheels = {n.lower().replace("_", "-") for n in listed()}
    for requirement in importlib.metadata.requires("diffusers"):
        if "extra ==" in requirement:
            continue
        name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("_", "-")
        assert name in wheels or name in header.lower(), requirement


def test_unknown_argument_is_one_line():
    done = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "unknown argument '--bogus'" in done.stderr
