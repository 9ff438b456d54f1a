"""The op's folder is its own map: ``nala_dit/attention/nala/__init__.py``'s docstring names
every module file in the folder (and the folder holds exactly these files)."""

import ast
import re
from pathlib import Path

NALA = Path(__file__).resolve().parents[2] / "nala_dit" / "attention" / "nala"
FILES = {"backend.py", "chunks.py", "fused.py", "tangent.py", "triton_op.py", "triton/backward.py",
         "triton/blocks.py", "triton/features.py", "triton/forward.py", "triton/gated.py", "triton/launch.py"}


def test_the_op_folder_docstring_names_every_module_file():
    files = {p.relative_to(NALA).as_posix() for p in NALA.rglob("*.py") if p.name != "__init__.py"}
    assert files == FILES
    doc = ast.get_docstring(ast.parse((NALA / "__init__.py").read_text()))
    named = set(re.findall(r"``(?:triton/)?(\w+\.py)", doc))
    assert {f.rsplit("/", 1)[-1] for f in FILES} <= named, sorted({f.rsplit("/", 1)[-1] for f in FILES} - named)
