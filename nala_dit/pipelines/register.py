"""``register_with_diffusers()``: the one call that lets diffusers' generic
``DiffusionPipeline.from_pretrained(folder)`` find our pipeline classes by name.

diffusers resolves a folder's ``model_index.json`` in two ways. Each component is a
``[library, class]`` pair that it imports itself: our transformer is
``["nala_dit.models.dit", "DiT"]``, which needs nothing from us. The pipeline class,
``"_class_name": "NaLaDiTPipeline"``, it looks up as an attribute of the ``diffusers`` module
(``getattr(diffusers, name)``, diffusers 0.42). diffusers has no registry for pipeline
classes that live outside it; its other doors (``custom_pipeline=``, or a ``[file, class]``
``_class_name`` naming a ``.py`` file of the folder) run a file from the folder and need
``trust_remote_code=True``, which a folder from elsewhere must not get.

So registering is two attributes on the ``diffusers`` module, then a check, through
diffusers' own resolution, that a ``_class_name`` now finds each class (a one-line warning
naming the diffusers version if not). It is done only when asked: ``import nala_dit`` and
importing our classes change nothing of diffusers. Routes that need no registering:
``NaLaDiTPipeline.from_pretrained(folder)`` (and ``NaLaSiTPipeline``'s, ``load_pipeline``,
``sample.py``), which also run our folder checks (``sources.check_pipeline_folder``), and
``custom_pipeline=`` with the folder's ``nala_dit_pipeline.py``. Nothing of diffusers is
wrapped or replaced: ``DiffusionPipeline.from_pretrained`` stays diffusers' own.
"""

from __future__ import annotations


def register_with_diffusers() -> bool:
    """Make ``DiffusionPipeline.from_pretrained(folder)`` open folders whose ``_class_name``
    is ``NaLaDiTPipeline`` or ``NaLaSiTPipeline`` (loads torch and diffusers). Returns whether
    diffusers now resolves both names; calling it again changes nothing."""
    from .pipeline import NaLaDiTPipeline, NaLaSiTPipeline

    return add_to_diffusers(NaLaDiTPipeline, NaLaSiTPipeline)


def add_to_diffusers(*classes) -> bool:
    """``diffusers.<Name> = cls`` for each class, so that a ``model_index.json`` whose
    ``_class_name`` names it loads with ``DiffusionPipeline.from_pretrained``. It relies on
    diffusers resolving ``_class_name`` as ``getattr(diffusers, name)``
    (``pipeline_loading_utils._get_pipeline_class`` in diffusers 0.42) and checks that through
    that very function. If a release resolves names otherwise, it warns in one line naming the
    diffusers version and returns False: ``NaLaDiTPipeline.from_pretrained`` keeps working."""
    import warnings

    import diffusers
    from diffusers import DiffusionPipeline

    for cls in classes:
        setattr(diffusers, cls.__name__, cls)
    try:
        from diffusers.pipelines.pipeline_loading_utils import _get_pipeline_class

        lost = [c.__name__ for c in classes
                if _get_pipeline_class(DiffusionPipeline, config={"_class_name": c.__name__}) is not c]
    except Exception as err:   # the function moved, or changed what it takes
        lost = [f"{', '.join(c.__name__ for c in classes)} ({type(err).__name__}: {str(err).partition(chr(10))[0]})"]
    if lost:
        warnings.warn(f"diffusers {diffusers.__version__} does not look up a model_index.json's _class_name "
                      f"({', '.join(lost)}) as diffusers 0.42 does, so DiffusionPipeline.from_pretrained cannot "
                      f"open nala_dit folders: use NaLaDiTPipeline / NaLaSiTPipeline.from_pretrained(folder), or "
                      f"the diffusers version pyproject.toml pins", RuntimeWarning, stacklevel=2)
    return not lost
