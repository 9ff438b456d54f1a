"""The samplers, by name: what each one samples, its default step count and the function that
runs it. Plain data: importing this module costs no torch (the CLIs' ``--help`` lists the
names), and a sampler's function is imported the first time it samples.

``generate`` (``generate.py``) looks a sampler up here and calls its function, so a new
sampler is its own function (any module) plus one line in ``SAMPLER_SPECS`` below, as DiT keeps
its presets in ``DiT_models``::

    "my-euler": SamplerSpec("transport", 50, "my_package.samplers:my_euler"),

Every sampler function is called as::

    fn(objective, model_fn, noise, labels, *, num_steps, progress, time_shift, **options)

``objective``: the ``GaussianDiffusion`` (DiT) or ``Transport`` (SiT) the model was trained
with; ``model_fn(x, t, y)``: the model under guidance (``samplers.py`` has the time
conventions); ``noise``: the start, (B, C, H, W); it returns ``samplers.SampleOutput(samples,
nfe)``. ``options``: the spec's fixed ``options`` (e.g. ``method="heun"``), the settings of
``generate`` it names in ``takes`` (``generator``, ``eta``, ``atol``, ``rtol``, ``max_nfe``),
and with ``renoise`` the SDEdit start (``first_step`` for diffusion, ``t_start`` for
transport) when a caller starts part-way (``--upscale-from``). A sampler that cannot apply a
``time_shift`` other than 1 raises a ValueError saying so.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

# The objective families a sampler may need (a model's ``config.objective``).
OBJECTIVES = ("diffusion", "transport")
# The settings of ``generate`` a sampler may read (``SamplerSpec.takes``).
SETTINGS = ("generator", "eta", "atol", "rtol", "max_nfe")
ODE_SETTINGS = ("atol", "rtol", "max_nfe")


@dataclass(frozen=True)
class SamplerSpec:
    """One sampler: the ``objective`` family it samples ("diffusion": DiT's ``GaussianDiffusion``,
    its steps bounded by the trained chain; "transport": SiT's ``Transport``, continuous time),
    its default ``steps``, and ``run``, its function as "module:function" (imported when it
    first samples) or the function itself. The rest as the module doc says: fixed keyword
    ``options``, the ``generate`` settings it ``takes``, ``min_steps``, ``renoise`` (it can start
    part-way: SDEdit, ``--upscale-from``) and ``adaptive`` (its steps are its own: ``--atol``,
    ``--rtol`` and ``--max-nfe`` are its settings)."""

    objective: str
    steps: int
    run: str | Callable
    options: dict = field(default_factory=dict)
    takes: tuple[str, ...] = ()
    min_steps: int = 1
    renoise: bool = False
    adaptive: bool = False

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"a sampler samples one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        unknown = sorted(set(self.takes) - set(SETTINGS))
        if unknown:
            raise ValueError(f"a sampler takes settings among {', '.join(SETTINGS)}, got {', '.join(unknown)}")
        if isinstance(self.run, str) and self.run.count(":") != 1:
            raise ValueError(f"run must be the function or 'module:function', got {self.run!r}")

    def function(self) -> Callable:
        """The sampling function (``run`` imported if named)."""
        if callable(self.run):
            return self.run
        module, name = self.run.split(":")
        return getattr(importlib.import_module(module), name)


_FNS, _GENERATE = "nala_dit.diffusion.samplers", "nala_dit.diffusion.generate"   # where the functions are
SAMPLER_SPECS: dict[str, SamplerSpec] = {
    "ddpm": SamplerSpec("diffusion", 250, f"{_FNS}:ddpm_sample", takes=("generator",), renoise=True),
    "ddim": SamplerSpec("diffusion", 50, f"{_FNS}:ddim_sample", takes=("eta", "generator"), renoise=True),
    "dpm-solver": SamplerSpec("diffusion", 25, f"{_GENERATE}:dpm_solver_sample"),
    "ode-euler": SamplerSpec("transport", 50, f"{_FNS}:ode_sample", dict(method="euler"), ODE_SETTINGS,
                             renoise=True),
    "ode-heun": SamplerSpec("transport", 50, f"{_FNS}:ode_sample", dict(method="heun"), ODE_SETTINGS,
                            renoise=True),
    "dopri5": SamplerSpec("transport", 50, f"{_FNS}:ode_sample", dict(method="dopri5"), ODE_SETTINGS,
                          renoise=True, adaptive=True),
    # an SDE sampler's last step (SiT's "Mean" of size 0.04) is one of its steps: it needs two
    "sde-euler": SamplerSpec("transport", 250, f"{_FNS}:sde_sample", dict(method="euler"), ("generator",),
                             min_steps=2),
    "sde-heun": SamplerSpec("transport", 250, f"{_FNS}:sde_sample", dict(method="heun"), ("generator",),
                            min_steps=2),
    # MeanFlow models (--mean-flow): 1 to few steps of the average velocity (diffusion/meanflow.py)
    "meanflow": SamplerSpec("transport", 1, "nala_dit.diffusion.meanflow:meanflow_sample"),
}
# What a model samples with when no sampler is named, per objective family (DiT's and SiT's own),
# and what the grids and FID during training sample with when --sample-sampler is not given (a
# check during training, where 250 DDPM steps would dominate the step time).
DEFAULT_SAMPLERS = {"diffusion": "ddpm", "transport": "ode-heun"}
TRAINING_SAMPLERS = {"diffusion": "ddim", "transport": "ode-heun"}


def sampler_spec(name: str) -> SamplerSpec:
    """The registered sampler ``name``; else one ValueError line listing the names."""
    if name not in SAMPLER_SPECS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLER_SPECS)}")
    return SAMPLER_SPECS[name]


def sampler_names(objective: str | None = None, **flags: bool) -> tuple[str, ...]:
    """The registered samplers' names (in ``SAMPLER_SPECS``' order), of one ``objective`` family when
    given, with the given spec flags (``renoise=True``, ``adaptive=True``)."""
    return tuple(name for name, spec in SAMPLER_SPECS.items() if objective in (None, spec.objective)
                 and all(getattr(spec, flag) == value for flag, value in flags.items()))
