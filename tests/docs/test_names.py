"""Names and maps stay current: every Python file a page or a docstring names exists, and the
two maps of the tree (the README's "Where things are", ``nala_dit/__init__.py``'s docstring)
name every script and sub-package where it lives now."""

import ast
import functools
import io
import os
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = {".venv", ".git", "__pycache__", "runs", "build", "dist", "node_modules"}

# Files of other repositories the pages cite (by their own names), and files that exist only
# in folders this code writes. Each entry says whose it is.
ELSEWHERE = {
    "calculate_metrics.py": "EDM2's metrics script",
    "training_loop.py": "EDM2's training loop",
    "evaluations/evaluator.py": "ADM's (guided-diffusion) evaluation suite",
    "sample_ddp.py": "DiT's multi-process sampler",
    "models.py": "DiT's / DiT-MoE's network file",
    "diffusion/model/nets/sana_multi_scale.py": "Sana's multi-scale linear attention",
    "NALA.py": "the NaLa authors' reference code",
    "nala_dit_pipeline.py": "written into an exported NaLaDiT pipeline folder (trust_remote_code)",
    "nala_sit_pipeline.py": "written into an exported NaLaSiT pipeline folder (trust_remote_code)",
    "script.py": "a placeholder for the user's script",
}

# A file name or path ending in .py, not part of a longer word, path or call (``x.py(``).
PY_NAME = re.compile(r"(?<![\w./-])((?:\.{1,2}/)?[\w-][\w.-]*(?:/[\w.-]+)*\.py)\b(?![\w(/-])")


@functools.lru_cache
def tree_files(root: Path = ROOT) -> list[str]:
    """Every .py file of the working tree, as a path relative to ``root``: in a git checkout what
    git tracks or would track (what the README's commands write, e.g. ``exported/``, is ignored),
    else every file but build outputs, virtual environments and runs/."""
    if (root / ".git").exists():
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard", "--", "*.py"], capture_output=True, text=True, check=True)
        return sorted(f for f in listed.stdout.split("\0") if f and (root / f).is_file())
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not (d in SKIPPED or d.startswith(".") or d.endswith(".egg-info"))]
        out += [(Path(folder) / n).relative_to(root).as_posix() for n in names if n.endswith(".py")]
    return sorted(out)


def markdown_mentions(text: str) -> set[str]:
    """The .py names inside the code spans and code blocks of a markdown page."""
    code = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M))
    return {name for chunk in [*code, *spans] for name in PY_NAME.findall(chunk)}


def python_texts(source: str) -> list[str]:
    """A module's docstrings (module, classes, functions) and comments."""
    texts = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            texts.append(ast.get_docstring(node, clean=False) or "")
    return texts


def python_mentions(source: str) -> set[str]:
    """The .py names in a module's docstrings and comments."""
    return {name for text in python_texts(source) for name in PY_NAME.findall(text)}


def resolves(name: str, where: Path, files: list[str], root: Path = ROOT) -> bool:
    """``name`` is a file relative to the repository root or to ``where``'s folder, or, a bare
    file name, the name of a file anywhere in the tree, or, a path, the tail of one."""
    if (root / name).is_file() or (where.parent / name).is_file():
        return True
    tail = name.lstrip("./")
    if "/" not in tail:
        return any(f.rsplit("/", 1)[-1] == tail for f in files)
    return any(f == tail or f.endswith("/" + tail) for f in files)


def stale_names(pages: list[Path], root: Path = ROOT) -> list[str]:
    """'file: name' for every .py name a page or module mentions that is neither in the tree
    nor in ELSEWHERE."""
    files = tree_files(root)
    bad = []
    for page in pages:
        text = page.read_text()
        names = markdown_mentions(text) if page.suffix == ".md" else python_mentions(text)
        bad += [f"{page.relative_to(root)}: {n}" for n in sorted(names)
                if n not in ELSEWHERE and not resolves(n, page, files, root)]
    return bad


# A dotted name in the package: nala_dit.<package>.<module>.<name>... (not torch.ops.nala_dit...),
# and the names a `from <module> import a, b` takes from it.
DOTTED = re.compile(r"(?<![\w.])nala_dit(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"\bfrom (nala_dit(?:\.\w+)*) import \(?([\w, ]+)")


def module_names(path: Path) -> set[str]:
    """What ``from <module> import X`` can find in a module file: its top-level definitions,
    assignments and imports, and, for a package, its sub-modules and the names it exports
    lazily (the string keys of its ``lazy_exports`` table)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.glob("*.py")} | {p.parent.name for p in path.parent.glob("*/__init__.py")}
        if any(isinstance(c, ast.Call) and getattr(c.func, "id", "") == "lazy_exports" for c in ast.walk(tree)):
            # the table's keys, written out or gathered from tuples of names
            names |= {c.value for c in ast.walk(tree) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                      and c.value.isidentifier()}
    return names


def dotted_is_stale(dotted: str, root: Path = ROOT) -> bool:
    """A dotted name's longest prefix that is a package or module exists, and the part after it
    (if any) is a name that module defines, imports or exports."""
    parts = dotted.split(".")
    folder = root
    for i, part in enumerate(parts):
        if (folder / part / "__init__.py").is_file():
            folder = folder / part
            continue
        if (folder / f"{part}.py").is_file():
            if i + 1 < len(parts):
                return parts[i + 1] not in module_names(folder / f"{part}.py")
            return False
        return part not in module_names(folder / "__init__.py")
    return False


def stale_modules(pages: list[Path], root: Path = ROOT) -> list[str]:
    """'file: name' for every dotted nala_dit name in a page's code or a module's docstrings
    and comments that names no module, or no name in its module."""
    bad = []
    for page in pages:
        text = page.read_text()
        if page.suffix == ".md":
            chunks = [*re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M),
                      *re.findall(r"`([^`\n]+)`", re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M))]
        else:
            chunks = python_texts(text)
        names = {n for chunk in chunks for n in DOTTED.findall(chunk)}
        names |= {f"{module}.{name.split(' as ')[0].strip()}" for chunk in chunks
                  for module, imported in FROM_IMPORT.findall(chunk) for name in imported.split(",") if name.strip()}
        bad += [f"{page.relative_to(root)}: {n}" for n in sorted(names) if dotted_is_stale(n, root)]
    return bad


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "experiments").rglob("*.md")),
         *sorted((ROOT / "benchmarks").rglob("*.md"))]
MODULES = [ROOT / f for f in tree_files() if f.split("/")[0] in ("nala_dit", "benchmarks", "experiments", "tests")
           or "/" not in f]


def test_the_name_checker_finds_what_is_stale(tmp_path):
    (tmp_path / "pkg" / "training").mkdir(parents=True)
    (tmp_path / "pkg" / "training" / "step.py").write_text('"""One step; see ``loop.py`` and ``step.py``."""\n')
    (tmp_path / "pkg" / "training" / "loop.py").write_text(
        "# the flat layout's train_step.py and sampling.py are gone; EDM2's training_loop.py is not ours\n"
        "def f():\n    '''Calls ``training/step.py`` and ``pkg/training/step.py``, not ``models/step.py``.'''\n"
        "x = 'gone.py'  # a string, not a docstring: not read\n")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "a.md"
    page.write_text("`train_step.py` and `python ../pkg/training/loop.py --x`; `.py` files; loop.py unquoted\n"
                    "```bash\npython train.py --config x.yaml\n```\n")
    assert stale_names([page, *sorted((tmp_path / "pkg").rglob("*.py"))], tmp_path) == [
        "docs/a.md: train.py",
        "docs/a.md: train_step.py",
        "pkg/training/loop.py: models/step.py",
        "pkg/training/loop.py: sampling.py",
        "pkg/training/loop.py: train_step.py",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_file_a_page_names_exists(page):
    assert stale_names([page]) == []


def test_every_python_file_a_docstring_or_comment_names_exists():
    assert stale_names(MODULES) == []


def test_the_module_checker_finds_what_moved(tmp_path):
    pkg = tmp_path / "nala_dit"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__getattr__, __dir__, __all__ = lazy_exports(__name__, {"DiT": "models.dit"})\n')
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "data" / "datasets.py").write_text("from x import to_uint8 as u8\nSIZES = {}\ndef load(): ...\nclass Set: ...\n")
    page = tmp_path / "a.md"
    page.write_text("`nala_dit.data.datasets.load()` `nala_dit.data.datasets.Set.x` `nala_dit.data.datasets.u8` "
                    "`nala_dit.data` `nala_dit.DiT` `torch.ops.nala_dit.fused.default`\n"
                    "```python\nfrom nala_dit.data.datasets import load_vae\nimport nala_dit.training.loop\n```\n"
                    "`nala_dit.data.datasets.to_uint8` `nala_dit.generate`\n")
    assert stale_modules([page], tmp_path) == [
        "a.md: nala_dit.data.datasets.load_vae", "a.md: nala_dit.data.datasets.to_uint8", "a.md: nala_dit.generate",
        "a.md: nala_dit.training.loop"]
    assert not dotted_is_stale("nala_dit.data.datasets.SIZES", tmp_path)
    assert dotted_is_stale("nala_dit.data.datasets.load_vae", tmp_path)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_a_page_names_exists(page):
    """Dotted names in the pages' code, imports included, name what lives there now."""
    assert stale_modules([page]) == []


def test_every_module_a_docstring_or_comment_names_exists():
    assert stale_modules(MODULES) == []


def test_tree_files_leave_out_what_git_ignores(tmp_path):
    """The README's own commands write .py files into ignored folders (export.py's
    ``exported/<name>/nala_dit_pipeline.py``): in a checkout they are not files of the tree."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/exported/\n")
    (tmp_path / "exported" / "demo").mkdir(parents=True)
    (tmp_path / "exported" / "demo" / "nala_dit_pipeline.py").write_text("x = 1\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    assert tree_files(tmp_path) == ["pkg/mod.py"]
    (tmp_path / ".git").rename(tmp_path / "not-git")   # no checkout: every file but the skipped folders
    assert tree_files.__wrapped__(tmp_path) == ["exported/demo/nala_dit_pipeline.py", "pkg/mod.py"]   # uncached


def test_the_allow_list_names_no_file_of_ours():
    """A name that is ours cannot hide behind ELSEWHERE (the exported pipeline files are only
    written into exported folders, never kept in the tree)."""
    ours = {f.rsplit("/", 1)[-1] for f in tree_files()} | set(tree_files())
    assert sorted(set(ELSEWHERE) & ours) == []


# --- the maps -------------------------------------------------------------------------------
def readme_map() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Where things are")
    return text[start:text.index("\n## ", start + 1)]


def subpackages() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "nala_dit").glob("*/__init__.py"))


def package_map() -> dict[str, str]:
    """``nala_dit/__init__.py``'s map: sub-package -> its bullet's text."""
    doc = ast.get_docstring(ast.parse((ROOT / "nala_dit" / "__init__.py").read_text()))
    bullets = re.findall(r"^\* ``(\w+)/``: (.*?)(?=^\* |^\s*$)", doc, re.S | re.M)
    return {name: " ".join(text.split()) for name, text in bullets}


def test_the_readme_map_names_every_script_and_sub_package():
    table = readme_map()
    scripts = sorted(p.name for p in ROOT.glob("*.py"))
    assert "train.py" in scripts and "consolidate.py" in scripts
    assert [s for s in scripts if f"`{s}`" not in table] == []
    assert [p for p in subpackages() if f"`nala_dit/{p}/`" not in table] == []


def test_the_package_map_names_every_sub_package_once():
    assert sorted(package_map()) == subpackages()


def test_the_package_map_puts_each_part_in_the_package_that_holds_it():
    """What the map says a package holds is there: a phrase -> the module that implements it (a
    top-level module, such as the run lock's, is in no sub-package's bullet and named by file)."""
    holds = {"context parallel": "context_parallel.py", "one writer per folder": "runlock.py",
             "Triton kernels": "nala/triton/launch.py", "``generate``": "generate.py", "REPA": "repa.py"}
    where = {}
    for phrase, module in holds.items():
        [path] = [p for p in (ROOT / "nala_dit").glob(f"*/{module}")] or [ROOT / "nala_dit" / module]
        top = path.relative_to(ROOT / "nala_dit").parts
        where[phrase] = [top[0]] if len(top) > 1 else []
    said = {phrase: sorted(pkg for pkg, text in package_map().items() if phrase.lower() in text.lower())
            for phrase in holds}
    assert said == where
    doc = ast.get_docstring(ast.parse((ROOT / "nala_dit" / "__init__.py").read_text()))
    assert [m for p, m in holds.items() if not where[p] and f"``{m}`` ({p})" not in " ".join(doc.split())] == []
