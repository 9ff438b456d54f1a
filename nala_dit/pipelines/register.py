"""How diffusers' generic ``DiffusionPipeline.from_pretrained(folder)`` finds our pipelines.

diffusers resolves a folder's ``model_index.json`` in two ways. Each component is a
``[library, class]`` pair that it imports itself: our transformer is
``["nala_dit.models.dit", "DiT"]``, which needs nothing from us. The pipeline class,
``"_class_name": "NaLaDiTPipeline"``, it looks up as an attribute of the ``diffusers`` module
(``getattr(diffusers, name)``, diffusers 0.42). diffusers has no registry for pipeline
classes that live outside it; its other doors (``custom_pipeline=``, or a ``[file, class]``
``_class_name`` naming a ``.py`` file of the folder) run a file from the folder and need
``trust_remote_code=True``, which a folder from elsewhere must not get. So the one thing
done to diffusers is ``pipeline.add_to_diffusers``, called where our classes are defined:
two attributes on the ``diffusers`` module, then a check, through diffusers' own resolution,
that a ``_class_name`` now finds each class (a one-line warning naming the diffusers version
if not).
 ``import nala_dit`` must load neither
torch nor diffusers (every CLI's ``--help`` would pay seconds for it), so ``install`` (run by
``import nala_dit``) only makes sure ``pipeline.py`` is imported once diffusers'
``DiffusionPipeline`` exists: at once if ``diffusers.pipelines.pipeline_utils`` is loaded,
else by a one-shot import hook (Python's ``sys.meta_path``; it steps aside after that one
module). Nothing of diffusers is wrapped or replaced: ``DiffusionPipeline.from_pretrained``
is diffusers' own for every caller, and our folder checks (``sources.check_pipeline_folder``)
run on our routes (``NaLaDiTPipeline.from_pretrained``, ``load_pipeline``, ``sample.py``).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

PIPELINE_UTILS = "diffusers.pipelines.pipeline_utils"   # where DiffusionPipeline is defined
PIPELINE_MODULE = "nala_dit.pipelines.pipeline"          # our classes; adds them to diffusers


def _import_pipelines(_pipeline_utils=None) -> None:
    """Import ``pipeline.py`` (which adds its classes to diffusers), unless it is being
    imported already: then its own last line does it."""
    if PIPELINE_MODULE not in sys.modules:
        from . import pipeline  # noqa: F401


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when module ``name`` is first imported, it removes itself, lets the
    usual finder load it and then calls ``then(module)``."""

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
            then(module)

        spec.loader.exec_module = exec_and_then
        return spec


def install() -> None:
    """Called by ``import nala_dit``: our pipeline classes are imported (and so added to
    diffusers) as soon as diffusers' ``DiffusionPipeline`` is, or now if it already is."""
    if PIPELINE_UTILS in sys.modules:
        _import_pipelines()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(PIPELINE_UTILS, _import_pipelines))
