"""The samplers' registry (``nala_dit/diffusion/registry.py``): a sampler is its function plus one
line in ``SAMPLER_SPECS``, and every caller reaches it through ``generate`` by name.

The toy sampler here is a plain Euler ODE solver written in this file and registered with one
line. On a linear velocity field v(x) = a·x, n Euler steps of h = 1/n multiply the start by
(1 + a/n)^n exactly (the closed form of Euler's recursion), which is also what the built-in
``ode-euler`` must give."""

from types import SimpleNamespace

import pytest
import torch

from nala_dit.diffusion.gaussian import GaussianDiffusion
from nala_dit.diffusion.generate import SampleSettings, generate, initial_noise, sample_batch
from nala_dit.diffusion.registry import SAMPLER_SPECS, SamplerSpec, sampler_names
from nala_dit.diffusion.samplers import SampleOutput
from nala_dit.diffusion.transport import Transport

A = 0.75   # the linear model's velocity v(x) = A x


def toy_euler(transport, model_fn, noise, labels, num_steps, progress=False, time_shift=1.0):
    """Forward Euler on dx/dt = v(x, t) from the transport's t0 to t1, ``num_steps`` equal steps."""
    t0, t1 = transport.interval()
    h, x = (t1 - t0) / num_steps, noise
    for i in range(num_steps):
        x = x + h * transport.velocity(model_fn, x, t0 + i * h, labels)
    return SampleOutput(x, num_steps)


class LinearVelocity(torch.nn.Module):
    """A stand-in SiT: v(x, t, y) = A·x, one channel, 4×4 latents, no null class."""

    in_channels, null_label, config = 1, None, SimpleNamespace(input_size=4, objective="transport")

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(A))

    def forward(self, x, t, y):
        return self.a * x


@pytest.fixture
def toy(monkeypatch):
    # the one registry line a new sampler adds (monkeypatch removes it after the test)
    monkeypatch.setitem(SAMPLER_SPECS, "toy-euler", SamplerSpec("transport", 8, toy_euler))


def test_a_registered_sampler_samples_through_sample_batch(toy):
    model, transport, seed, indices = LinearVelocity(), Transport("linear"), 3, [5, 6]
    labels = torch.zeros(2, dtype=torch.long)
    noise = initial_noise(indices, (1, 4, 4), seed)
    with torch.no_grad():
        out, nfe = sample_batch(model, transport, labels, indices, seed, SampleSettings(sampler="toy-euler"),
                                decode_output=False)
        # its default steps (8) from the registry line; the closed form of 8 Euler steps
        assert nfe == 8
        torch.testing.assert_close(out, noise * (1 + A / 8) ** 8, rtol=1e-6, atol=0)
        assert not torch.allclose(out, noise * torch.exp(torch.tensor(A)), rtol=1e-3)   # Euler's, not the exact flow
        # the same as the built-in ode-euler at the same steps, and the step count a caller sets
        euler, _ = sample_batch(model, transport, labels, indices, seed, SampleSettings(sampler="ode-euler",
                                num_steps=8), decode_output=False)
        torch.testing.assert_close(out, euler, rtol=1e-6, atol=0)
        out3, nfe3 = sample_batch(model, transport, labels, indices, seed,
                                  SampleSettings(sampler="toy-euler", num_steps=3), decode_output=False)
        assert nfe3 == 3
        torch.testing.assert_close(out3, noise * (1 + A / 3) ** 3, rtol=1e-6, atol=0)


def test_a_registered_sampler_gets_every_callers_checks(toy):
    """Family, step bound and SDEdit start read the registry line: a transport sampler is refused
    for a DiT objective, past MAX_CONTINUOUS_STEPS, and for --upscale-from (no ``renoise``)."""
    noise, labels = torch.zeros(1, 1, 2, 2), torch.zeros(1, dtype=torch.long)
    assert "toy-euler" in sampler_names("transport") and "toy-euler" not in sampler_names("diffusion")
    with pytest.raises(ValueError, match=r"sampler 'toy-euler' is for transport \(SiT\) models; this is a diffusion "
                                         r"\(DiT\) model: use one of \('ddpm', 'ddim', 'dpm-solver'\)"):
        generate(lambda x, t, y: x, GaussianDiffusion.from_schedule("linear", 100), noise, labels, sampler="toy-euler")
    with pytest.raises(ValueError, match="num_steps 10001: toy-euler takes at most 10000 steps"):
        generate(lambda x, t, y: x, Transport(), noise, labels, sampler="toy-euler", num_steps=10_001)
    with pytest.raises(ValueError, match="re-noising .--upscale-from. runs with ddpm, ddim, ode-euler, ode-heun, "
                                         "dopri5, not toy-euler"):
        generate(lambda x, t, y: x, Transport(), noise, labels, sampler="toy-euler", init=noise, strength=0.5)


def test_unknown_names_and_bad_lines_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown sampler 'euler'; choose one of ddpm, ddim, dpm-solver, ode-euler"):
        generate(lambda x, t, y: x, Transport(), torch.zeros(1, 1, 2, 2), torch.zeros(1), sampler="euler")
    with pytest.raises(ValueError, match="a sampler samples one of diffusion, transport, got 'flow'"):
        SamplerSpec("flow", 10, toy_euler)
    with pytest.raises(ValueError, match="takes settings among generator, eta, atol, rtol, max_nfe, got seed"):
        SamplerSpec("transport", 10, toy_euler, takes=("seed",))
    with pytest.raises(ValueError, match="run must be the function or 'module:function', got 'samplers.euler'"):
        SamplerSpec("transport", 10, "samplers.euler")


def test_the_built_in_lines_name_functions_that_exist():
    """Every registry line's "module:function" imports (a renamed function shows up here, not at a
    user's first sample), and the CLIs' names are the registry's."""
    from nala_dit.diffusion.choices import DEFAULT_STEPS, DIFFUSION_SAMPLERS, SAMPLERS, TRANSPORT_SAMPLERS

    from nala_dit.diffusion.registry import DEFAULT_SAMPLERS, TRAINING_SAMPLERS

    assert all(callable(spec.function()) for spec in SAMPLER_SPECS.values())
    # each family's default (sample.py, pipelines) and training-grid sampler is one of its own
    assert DEFAULT_SAMPLERS == {"diffusion": "ddpm", "transport": "ode-heun"}
    assert TRAINING_SAMPLERS == {"diffusion": "ddim", "transport": "ode-heun"}
    assert all(SAMPLER_SPECS[name].objective == family for table in (DEFAULT_SAMPLERS, TRAINING_SAMPLERS)
               for family, name in table.items())
    assert SAMPLERS == tuple(SAMPLER_SPECS) == DIFFUSION_SAMPLERS + TRANSPORT_SAMPLERS
    assert DEFAULT_STEPS == {"ddpm": 250, "ddim": 50, "dpm-solver": 25, "ode-euler": 50, "ode-heun": 50,
                             "dopri5": 50, "sde-euler": 250, "sde-heun": 250, "meanflow": 1}
