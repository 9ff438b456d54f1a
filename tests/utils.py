"""Shared test helpers: one comparison function and the tiny model config."""

from __future__ import annotations

import socket

import torch


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Relative RMS error ‖out − ref‖ / ‖ref‖ in float64."""
    ref, out = ref.double(), out.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float) -> None:
    """Relative-RMS comparison that names what failed and by how much."""
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    err = rel_rms(ref, out)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"


# One tiny model shared by all model tests (diffusers' get_init_dict style):
# depth 2, 2 heads, hidden 32, 8×8 latents with 4 channels, 10 classes.
TINY = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2,
            num_heads=2, num_classes=10)


def free_port() -> int:
    """A TCP port nothing listens on now (for a process group or accelerate launch)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
