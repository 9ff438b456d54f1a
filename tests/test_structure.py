"""The package's shape: imports only point down (no circle), and the CLIs answer
``--help``, ``--dry-run`` and argument errors without loading torch, diffusers or accelerate."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import assert_names

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nala_dit"
HEAVY = ("torch", "diffusers", "accelerate", "torchvision", "torch_fidelity")


def _module(path: Path) -> str:
    """``nala_dit/attention/layers.py`` → ``nala_dit.attention.layers``; a package's
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
            # `from . import data` and `from nala_dit import evaluation` name submodules.
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found.update(n for n in names if n in modules and n != here)
    return found


def test_import_graph_has_no_cycle():
    files = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"]
    modules = {_module(p) for p in files}
    graph = {_module(p): _imports(p, modules) for p in files}
    assert graph["nala_dit.attention.layers"] >= {"nala_dit.attention.nala", "nala_dit.attention.context_parallel"}, \
        "the walker must resolve relative imports inside the attention package"
    assert graph["nala_dit.pipelines.pipeline"] >= {"nala_dit.pipelines.sources"}, "the walker must see pipeline → sources"
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
    assert "nala_dit.pipelines.sample_files" not in graph["nala_dit.pipelines.pipeline"]
    assert "nala_dit.pipelines.pipeline" not in graph["nala_dit.pipelines.sample_files"]
    assert "nala_dit.pipelines.pipeline" not in graph["nala_dit.pipelines.sources"]
    assert "nala_dit.pipelines.sample_files" not in graph["nala_dit.pipelines.sources"]
    # Sampling stands below training: no pipeline module imports training (at the top or inside
    # a function), and no package below the CLIs imports them.
    assert [(m, d) for m in graph if m.startswith("nala_dit.pipelines.") for d in graph[m]
            if d.startswith("nala_dit.training")] == []
    assert [(m, d) for m in graph if not m.startswith("nala_dit.cli") for d in graph[m]
            if d.startswith("nala_dit.cli")] == []


# (script, argv, expected exit code, text the output must hold: a string, or a tuple of the words it names)
CLI_CASES = [
    ("train.py", ["--help"], 0, "--global-batch-size"),
    ("train.py", ["--help-all"], 0, "--repa-projector-dim"),   # every flag, in sections (--help: the common ones)
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
     ("--lepe applies to", "nala/relu/elu/softmax_gated", "not to DiT-T/2", "e.g. NaLaDiT-T/2")),
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
    assert_names(proc.stdout + proc.stderr, *((text,) if isinstance(text, str) else text))


ENTRY_POINTS = ["train.py", "sample.py", "evaluate_fid.py", "export.py", "extract_latents.py", "demo.py",
                *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*.py")   # its scripts, not
                        if '__name__ == "__main__"' in p.read_text()),                       # its modules
                *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "experiments").glob("*/*.py")), "tests/conftest.py"]
_HEAVY_IMPORT = ("torch", "numpy", "triton", "diffusers", "accelerate", "torchvision", "torch_fidelity", "nala_dit.")
# What the CLIs import before they parse (torch-free: test_cli_answers_without_heavy_imports).
_LIGHT = {"nala_dit", "nala_dit.cli", "nala_dit.cli.parse", "nala_dit.cli.config", "nala_dit.cli.options", "nala_dit.models.grid", "nala_dit.cli.requirements",
          "nala_dit.cli.sizes"}


def _first_heavy_import_and_passive_call(path: Path) -> tuple[int, int]:
    """Line of the first top-level import that may load torch (numpy too, for good measure;
    nala_dit.cli.parse is torch-free), and of the first top-level ``passive_wait_policy()`` call
    (the ``if __name__ == "__main__"`` block counts as top level). The CLIs' own torch-free
    modules (``_LIGHT``) may come first."""
    heavy = call = 10 ** 9
    body = list(ast.parse(path.read_text()).body)
    for node in list(body):
        if isinstance(node, ast.If):
            body.extend(node.body)
    for node in body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any((n == h or n.startswith(h if h.endswith(".") else h + ".")) and n not in _LIGHT
               for n in names for h in _HEAVY_IMPORT):
            heavy = min(heavy, node.lineno)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "id", None) == "passive_wait_policy":
            call = min(call, node.lineno)
    return heavy, call


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_entry_point_sets_passive_wait_policy_before_torch(script):
    heavy, call = _first_heavy_import_and_passive_call(ROOT / script)
    assert call < 10 ** 9, f"{script} never calls passive_wait_policy()"
    assert call < heavy, f"{script} imports torch (line {heavy}) before passive_wait_policy() (line {call})"


_ENV_PROBE = """
import os, runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
print("OMP_WAIT_POLICY=%s" % os.environ.get("OMP_WAIT_POLICY"), file=sys.__stderr__)
"""


@pytest.mark.parametrize("user", [None, "ACTIVE"])
def test_cli_sets_passive_unless_the_user_chose(user):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if user:
        env["OMP_WAIT_POLICY"] = user
    proc = subprocess.run([sys.executable, "-c", _ENV_PROBE, "train.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.stderr.strip().splitlines()[-1] == f"OMP_WAIT_POLICY={user or 'PASSIVE'}"


@pytest.mark.parametrize("script", [s for s in ENTRY_POINTS if s != "tests/conftest.py"])
def test_help_examples_keep_their_line_continuations(script):
    """A lone backslash at a line end inside a docstring joins the lines (``--upscale-from 256
    --strength 0.6`` printed as one line with a run of spaces): examples need ``\\\\``."""
    doc = ast.get_docstring(ast.parse((ROOT / script).read_text()), clean=False) or ""
    joined = [line for line in doc.splitlines() if re.search(r"\S {3,}--\w", line)]
    assert not joined, f"{script}: a continuation was lost: {joined[0]!r}"


# The packages bottom-up: a module imports only from its own package, from the packages before
# it, and from the top-level helpers (guards, checks, progress, runlock, _lazy), with no
# exception. Reading a checkpoint sits below both the pipelines (sampling, export) and training
# (which writes checkpoints, and takes any model source for --init-from through the pipelines);
# the CLIs parse for every package, so they sit on top. README's map lists them top-down.
LAYERS = ("attention", "models", "data", "diffusion", "evaluation", "checkpoints", "pipelines", "training", "cli")


def test_packages_import_only_downwards():
    files = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"]
    modules = {_module(p) for p in files}
    rank = {name: i for i, name in enumerate(LAYERS)}
    assert {m.split(".")[1] for m in modules if m.count(".") >= 2} == set(LAYERS), "a package is missing from LAYERS"
    wrong = []
    for path in files:
        here = _module(path)
        if here.count(".") < 1 or here.split(".")[1] not in rank:
            continue   # guards, _lazy: below everything
        for dep in _imports(path, modules):
            if dep.count(".") >= 1 and dep.split(".")[1] in rank and rank[dep.split(".")[1]] > rank[here.split(".")[1]]:
                wrong.append(f"{here} → {dep}")
    assert wrong == []


# Each package's names (presets, choices, defaults, bounds) in its own torch-free module, which
# the CLIs import: ``--help`` reads them without loading torch, and the code that does the work
# imports them from its own package, never from cli/.
NAME_MODULES = ("nala_dit.attention.config", "nala_dit.models.presets", "nala_dit.models.grid", "nala_dit.models.vae",
                "nala_dit.data.choices", "nala_dit.diffusion.choices", "nala_dit.evaluation.choices",
                "nala_dit.checkpoints.ema", "nala_dit.training.config", "nala_dit.training.resume_rules")


def test_each_package_keeps_its_names_in_a_torch_free_module():
    code = (f"import importlib, json, sys\nfor m in {NAME_MODULES!r}: importlib.import_module(m)\n"
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    # cli/options.py gathers the names and defines none of its own (no constant, table or dataclass)
    tree = ast.parse((PACKAGE / "cli" / "options.py").read_text())
    own = [getattr(t, "id", "?") for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
           for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    own += [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    assert own == [], f"cli/options.py defines {own}: put them in the package that owns them"


# No function in the package longer than a screen and a half (training/'s own
# layout: tests/training/test_layout.py).
MAX_FUNCTION_LINES = 80
# The attention package's Python, all lines: 4,671 when NaLa was ten paths chosen in three
# places, 5,204 at its most; now one op folder with the math in READMEs beside the code.
ATTENTION_LINES = 4671


def test_the_attention_package_stays_under_its_line_budget():
    files = sorted((ROOT / "nala_dit" / "attention").rglob("*.py"))
    lines = sum(len(f.read_text().splitlines()) for f in files)
    assert lines < ATTENTION_LINES, (f"nala_dit/attention has {lines} lines of Python (budget {ATTENTION_LINES}): "
                                     "move derivations to the op's README.md, or find what is said twice")


def test_no_function_over_80_lines():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and child.end_lineno - child.lineno + 1 > MAX_FUNCTION_LINES:
                    owner = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
                    long[f"{path.relative_to(PACKAGE)}:{owner}{child.name}"] = child.end_lineno - child.lineno + 1
    assert long == {}, f"split these below {MAX_FUNCTION_LINES} lines: {long}"
