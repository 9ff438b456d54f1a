"""Lazy re-exports for the package ``__init__`` files.

``import nala_dit`` (and every CLI's ``--help``) must not load torch or diffusers, so each
``__init__`` names its public objects and the module that defines them; a name is imported
the first time it is used.
"""

from __future__ import annotations

import importlib


def lazy_exports(package: str, names: dict[str, str]):
    """``(__getattr__, __dir__, __all__)`` for ``package`` exporting ``names`` (name -> module,
    relative to the package)."""

    def __getattr__(name):
        if name in names:
            value = getattr(importlib.import_module(f".{names[name]}", package), name)
            setattr(importlib.import_module(package), name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(vars(importlib.import_module(package))) | set(names))

    return __getattr__, __dir__, sorted(names)
