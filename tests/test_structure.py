"""The package's shape: imports only point down (no circle), and the CLIs answer
``--help``, ``--dry-run`` and argument errors without loading torch, diffusers or accelerate."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nala_dit"
HEAVY = ("torch", "diffusers", "accelerate", "torchvision", "torch_fidelity")


def _module(path: Path) -> str:
    """``nala_dit/attention/nala.py`` → ``nala_dit.attention.nala``; a package's
    ``__init__.py`` is the package itself."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules that ``path`` imports anywhere (top level or inside functions)."""
    here = _module(path)
    package = here if path.stem == "__init__" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            if not node.level:
                base = node.module or ""
            elif node.module:
                base = f"{base}.{node.module}"
            # `from . import data` and `from nala_dit import metrics` name submodules.
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found.update(n for n in names if n in modules and n != here)
    return found


def test_import_graph_has_no_cycle():
    files = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"]
    modules = {_module(p) for p in files}
    graph = {_module(p): _imports(p, modules) for p in files}
    assert graph["nala_dit.attention.layers"] >= {"nala_dit.attention.nala", "nala_dit.options"}, \
        "the walker must resolve relative imports inside the attention package"
    assert graph["nala_dit.pipeline"] >= {"nala_dit.sources"}, "the walker must see pipeline → sources"
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " → ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    # The split the layout promises: loading sits below both pipeline and sampling.
    assert "nala_dit.sampling" not in graph["nala_dit.pipeline"]
    assert "nala_dit.pipeline" not in graph["nala_dit.sampling"]
    assert "nala_dit.pipeline" not in graph["nala_dit.sources"]
    assert "nala_dit.sampling" not in graph["nala_dit.sources"]


# (script, argv, expected exit code, text the output must hold)
CLI_CASES = [
    ("train.py", ["--help"], 0, "--global-batch-size"),
    ("train.py", ["--config", "configs/digits_nala_dit.yaml", "--dry-run"], 0, "model: NaLaDiT-T/2"),
    ("train.py", ["--max-steps", "ten"], 2, "--max-steps"),
    ("sample.py", ["--help"], 0, "--cfg-scale"),
    ("sample.py", ["--ckpt", "x", "--sampler", "nope"], 2, "invalid choice"),
    ("evaluate_fid.py", ["--help"], 0, "calc"),
    ("evaluate_fid.py", ["calc", "--help"], 0, "--inception-weights"),
    ("evaluate_fid.py", ["gen", "--help"], 0, "--num-samples"),
    ("evaluate_fid.py", ["ref", "--help"], 0, "--dataset"),
    ("export.py", ["--help"], 0, "official"),
    ("export.py", ["official", "--help"], 0, "--model-only"),
    ("extract_latents.py", ["--help"], 0, "--shard-size"),
    ("demo.py", ["--help"], 0, "--quick"),
    # typos name the nearest flag, with the same no-abbreviation rule in every CLI
    ("train.py", ["--max-step", "10"], 2, "--max-step (did you mean --max-steps?)"),
    ("sample.py", ["--ckpt", "x", "--cfg_scale", "2"], 2, "--cfg_scale (did you mean --cfg-scale?)"),
    ("sample.py", ["--ckpt", "x", "--cfg", "2"], 2, "--cfg (did you mean --cfg-scale?)"),
    ("evaluate_fid.py", ["calc", "--samples", "a", "--ref", "b", "--split_size", "3"], 2,
     "--split_size (did you mean --split-size?)"),
    ("export.py", ["checkpoint", "a", "b", "--weigths", "ema"], 2, "--weigths (did you mean --weights?)"),
    ("extract_latents.py", ["--data", "a", "--out", "b", "--vae", "c", "--shardsize", "1"], 2,
     "--shardsize (did you mean --shard-size?)"),
    # an option the chosen model ignores is an error before anything loads
    ("train.py", ["--model", "DiT-T/2", "--lepe", "true", "--dry-run"], 2,
     "--lepe applies to the gated layer (nala/relu/elu/softmax_gated attention), not to DiT-T/2"),
]

_PROBE = """
import json, runpy, sys, time
script, argv = sys.argv[1], sys.argv[2:]
sys.argv = [script] + argv
code = 0
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
print(json.dumps({"code": code, "heavy": sorted(m for m in %r if m in sys.modules)}), file=sys.__stderr__)
""" % (HEAVY,)


@pytest.mark.parametrize("script,argv,code,text", CLI_CASES, ids=[" ".join([c[0]] + c[1]) for c in CLI_CASES])
def test_cli_answers_without_heavy_imports(script, argv, code, text):
    proc = subprocess.run([sys.executable, "-c", _PROBE, script, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["code"] == code, proc.stdout + proc.stderr
    assert report["heavy"] == [], f"{script} {' '.join(argv)} imported {report['heavy']}"
    assert text in proc.stdout + proc.stderr
