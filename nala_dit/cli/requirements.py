"""The one check every entry script makes first: is this the python that ``make`` set up?

The CLIs need torch (and numpy, PyYAML, ...), which ``make`` installs into ``.venv``; the
system python usually has none of them. Without this check a command run with it ends in a
``No module named 'torch'`` traceback from deep inside the script. ``require_installed``
looks the packages up without importing them (milliseconds), so it costs ``--help`` nothing,
and answers with one line naming the way out. Standard library only: it must run where
nothing else is installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# What an entry script needs before it can do anything (the rest comes with torch's install).
NEEDED = ("torch", "numpy", "yaml")


def missing_modules() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def require_installed() -> None:
    """Exit with one line (status 1) when this python lacks what the CLIs need."""
    missing = missing_modules()
    if not missing:
        return
    script = os.path.basename(sys.argv[0]) or "the script"
    sys.exit(f"error: {sys.executable} has no {', '.join(missing)} (the packages live in the project's .venv): "
             f"run `source .venv/bin/activate` first, or `.venv/bin/python {script} ...`; `make` creates .venv")
