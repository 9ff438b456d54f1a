"""Shared pytest fixtures. Session-scoped fixtures build expensive offline assets once.

First of all, as every entry point: ``OMP_WAIT_POLICY=PASSIVE`` unless set, before torch
loads, for this process and every subprocess a test starts (they inherit the environment)."""

from nala_dit.cli.parse import passive_wait_policy

passive_wait_policy()

import os
from pathlib import Path

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import nala_dit  # noqa: F401  (torch-free)

# torch, diffusers and the helpers below are imported where they are used: the pytest-xdist
# controller loads this file too and runs no test (measured: 8.5 s of imports there, now 0.2 s).

# The interpreter cases (run in subprocesses with TRITON_INTERPRET=1): the same kernels, without
# the interpreter's redundant re-patching at each helper call (tests/utils.py).
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.utils import quicker_triton_interpreter

    quicker_triton_interpreter()

# Under pytest-xdist each worker's torch gets its share of the cores (make test: two workers on
# two cores, one thread each) instead of all of them: two workers' threads on the same cores
# only wait for each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def pytest_configure(config):
    """pytest-xdist's loadscope sends the modules out by their number of tests, most first (its
    default ``--loadscope-reorder``), which put the long modules of few tests (the demo, FSDP,
    the benchmarks) last; the order below is kept instead."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test``: two workers, one test module at a time each), the
    modules go out in collection order (``pytest_configure``): the modules with the most slow
    tests first, so the longest ones do not end the run on one worker while the other idles.
    Each module's own test order is kept."""
    if not getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        return
    slow = {}
    for item in items:
        slow[item.module.__name__] = slow.get(item.module.__name__, 0) + bool(item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module.__name__])   # stable: a module's tests stay in order


@pytest.fixture(scope="session")
def inception_weights(tmp_path_factory):
    """A torch-fidelity Inception-v3 weights file with random but well-scaled weights.

    The real file cannot be downloaded here. torch-fidelity's default init leaves
    dead features (FID 0, IS 1), so convs get N(0, 2/fan_in) (He) and the fc layer
    N(0, 1/fan_in). About 95 MB in a temp dir: never commit it.
    """
    from unittest import mock

    import torch
    import torch_fidelity.feature_extractor_inceptionv3 as tfi

    with mock.patch.object(tfi, "load_state_dict_from_url", lambda *a, **k: None), \
            mock.patch.object(tfi.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd: None):
        model = tfi.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
                fan_in = module.weight[0].numel()
                std = (2.0 / fan_in) ** 0.5 if isinstance(module, torch.nn.Conv2d) else (1.0 / fan_in) ** 0.5
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
    path = tmp_path_factory.mktemp("inception") / "weights-inception-2015-12-05-6726825d.pth"
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope="session")
def digits_classifier_dir(tmp_path_factory):
    """The digits classifier, trained once per session (a few seconds on CPU)."""
    from nala_dit.data.digits import train_digits_classifier

    out = tmp_path_factory.mktemp("digits_classifier")
    train_digits_classifier(out)
    return out


@pytest.fixture(scope="session")
def tiny_dinov2(tmp_path_factory):
    """A REPA encoder: a DINOv2 of transformers with tiny random weights, saved as a folder."""
    import torch
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                          patch_size=4, image_size=16)
    folder = tmp_path_factory.mktemp("dinov2")
    Dinov2Model(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def image_sets():
    """Two visibly different sets of 12 uint8 NHWC 32x32 RGB images: smooth dark
    gradients with noise (a) and bright random blocks (b)."""
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 1, 32)[None, :, None, None] * np.linspace(0, 1, 32)[None, None, :, None]
    a = 40 + 120 * ramp * rng.uniform(0.5, 1.0, (12, 1, 1, 3)) + rng.normal(0, 8, (12, 32, 32, 3))
    blocks = rng.uniform(120, 255, (12, 4, 4, 3)).repeat(8, axis=1).repeat(8, axis=2)
    return {"a": np.clip(a, 0, 255).astype(np.uint8), "b": blocks.astype(np.uint8)}


@pytest.fixture(scope="session")
def digits_checkpoint(tmp_path_factory):
    """A train.py-style run folder: a tiny pixel-space digits DiT (8x8, 1 channel) with
    random weights, for end-to-end sampling tests."""
    import torch

    from nala_dit.cli.config import to_dict
    from nala_dit.cli.options import TrainConfig
    from nala_dit.models.dit import create_model
    from nala_dit.training.checkpoint import save_checkpoint

    run_dir = tmp_path_factory.mktemp("runs") / "digits-dit"
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    cfg = TrainConfig(model="NaLaDiT-T/2", data="digits", exp_name=run_dir.name, results_dir=str(run_dir.parent),
                      class_dropout_prob=model.config.class_dropout_prob)
    state = dict(step=5, epoch=0, position=5, world_size=1, config=to_dict(cfg), model_config=dict(model.config))
    save_checkpoint(run_dir / "checkpoints", model=model, ema=model, state=state,
                    optimizer=torch.optim.AdamW(model.parameters()), rng_states=[torch.get_rng_state()])
    return run_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from tests.scripts.test_sample import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("runs") / "dit")


@pytest.fixture(scope="module")
def pipe_dir(run_dir, tmp_path_factory):
    import export

    out = tmp_path_factory.mktemp("pipes") / "pipe"
    assert export.main(["checkpoint", str(run_dir), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def pipe_folder(tmp_path_factory):
    from nala_dit.pipelines.pipeline import pipeline_for
    from tests.pipelines.test_pipeline import NAMES, tiny

    folder = tmp_path_factory.mktemp("trusted") / "pipe"
    pipeline_for(tiny("NaLaDiT-T/2"), id2label=NAMES, sampler="ddim").save_pretrained(folder)
    return folder


# --- item 9: fsync before and after every rename into place -------------------------------
@pytest.fixture
def fsynced(monkeypatch):
    """The paths os.fsync was called on, in order (read back from /proc/self/fd)."""
    paths = []
    real = os.fsync

    def recording(fd):
        paths.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return paths
