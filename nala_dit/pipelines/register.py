"""Lets diffusers' generic loader find our pipelines: ``DiffusionPipeline.from_pretrained``.

``DiffusionPipeline.from_pretrained(folder)`` reads ``_class_name`` from the folder's
``model_index.json`` and looks that name up as an attribute of the ``diffusers`` module.
Our classes live in ``nala_dit.pipelines.pipeline``, and importing it loads torch and diffusers'
pipeline stack, which ``import nala_dit`` must not do (every CLI's ``--help`` would pay
for it). So ``import nala_dit`` only teaches the ``diffusers`` module the two names; the
classes are imported the first time diffusers asks for one. If diffusers is not imported
yet, a one-shot import hook teaches it as soon as it is.

diffusers 0.42's top-level module is a ``_LazyModule`` whose ``__getattr__`` first looks
in its ``_objects`` dict; a dict that resolves our names on demand is all it takes. Any
other diffusers gets the classes bound directly.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

PIPELINE_CLASSES = ("NaLaDiTPipeline", "NaLaSiTPipeline")


class _WithOurPipelines(dict):
    """diffusers' ``_objects`` plus our pipeline names, imported on first access."""

    def __contains__(self, name):
        return name in PIPELINE_CLASSES or dict.__contains__(self, name)

    def __missing__(self, name):
        if name not in PIPELINE_CLASSES:
            raise KeyError(name)
        from . import pipeline

        self[name] = getattr(pipeline, name)
        return self[name]


def teach(diffusers_module) -> None:
    """Make ``getattr(diffusers, "NaLaDiTPipeline")`` (and NaLaSiT) work."""
    objects = getattr(diffusers_module, "_objects", None)
    if isinstance(objects, _WithOurPipelines):
        return
    if isinstance(objects, dict):
        diffusers_module._objects = _WithOurPipelines(objects)
        return
    from . import pipeline

    for name in PIPELINE_CLASSES:
        setattr(diffusers_module, name, getattr(pipeline, name))


class _TeachOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loading of ``diffusers`` once, then steps aside."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "diffusers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_teach(module):
            exec_module(module)
            # diffusers' __init__ replaces itself in sys.modules by its lazy module.
            teach(sys.modules.get(fullname, module))

        spec.loader.exec_module = exec_and_teach
        return spec


def install() -> None:
    """Called by ``import nala_dit``: teach diffusers now, or when it gets imported."""
    if "diffusers" in sys.modules:
        teach(sys.modules["diffusers"])
    elif not any(isinstance(finder, _TeachOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TeachOnImport())
