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

The same goes for the folder checks: ``DiffusionPipeline.from_pretrained`` reads
``model_index.json`` and builds every component itself, never calling our class's
``from_pretrained``. So once ``diffusers.pipelines.pipeline_utils`` is loaded (now, or by
a one-shot hook when it is), its ``from_pretrained`` first runs
``sources.check_pipeline_folder`` on a local folder: a deep or non-object
``model_index.json`` or component config, and a transformer config that does not fit its
weights (``hidden_size: 65536``), are one line before diffusers reads or builds anything,
by every route: ``NaLaDiTPipeline.from_pretrained``, ``DiffusionPipeline.from_pretrained``,
``custom_pipeline=``. Hub ids and folders without ``model_index.json`` pass untouched.
"""

from __future__ import annotations

import functools
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


class _OnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loading of module ``name`` once (then ``then(module)``)
    and steps aside."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_and_then(module):
            exec_module(module)
            # diffusers' __init__ replaces itself in sys.modules by its lazy module.
            then(sys.modules.get(fullname, module))

        spec.loader.exec_module = exec_and_then
        return spec


PIPELINE_UTILS = "diffusers.pipelines.pipeline_utils"


def guard_from_pretrained(pipeline_utils) -> None:
    """``DiffusionPipeline.from_pretrained`` runs ``check_pipeline_folder`` first (once)."""
    cls = getattr(pipeline_utils, "DiffusionPipeline", None)
    original = cls.__dict__.get("from_pretrained") if cls is not None else None
    if not isinstance(original, classmethod) or getattr(original.__func__, "_nala_checked", False):
        return
    func = original.__func__

    @functools.wraps(func)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        from .sources import check_pipeline_folder

        check_pipeline_folder(pretrained_model_name_or_path, kwargs.get("subfolder"))
        return func(cls, pretrained_model_name_or_path, *args, **kwargs)

    from_pretrained._nala_checked = True
    cls.from_pretrained = classmethod(from_pretrained)


def _when_imported(name: str, then) -> None:
    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(f, _OnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport(name, then))


def install() -> None:
    """Called by ``import nala_dit``: teach diffusers now, or when it gets imported; guard
    ``DiffusionPipeline.from_pretrained`` now, or when diffusers' pipeline stack loads."""
    _when_imported("diffusers", teach)
    _when_imported(PIPELINE_UTILS, guard_from_pretrained)
