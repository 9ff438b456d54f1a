"""Token chunks: the ranges NaLa's CPU passes (and the tangent's) walk, so each chunk's
features stay in cache (CPU) or its scratch stays bounded (GPU)."""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 2**16        # about a core's L2 of fp32 features per chunk
CHUNK_ELEMENTS_GPU = 2**25


def token_chunks(shape: torch.Size, device: torch.device, cpu_elements: int = CHUNK_ELEMENTS,
                 gpu_elements: int = CHUNK_ELEMENTS_GPU) -> list[slice]:
    """Token ranges of at most about ``cpu_elements`` (on a GPU ``gpu_elements``) elements each
    (64 tokens at least), as few as that allows and of near-equal length, the first the longest
    (the scratch is sized by it): 256 tokens at 6 × 64 are 128 + 128, not 170 + 86 (4-7 % less
    CPU time at 200-300 tokens, one thread: benchmarks/cpu_path.py)."""
    b, h, n, d = shape
    elements = cpu_elements if device.type in ("cpu", "meta") else gpu_elements
    size = max(64, elements // max(1, b * h * d))
    size = -(-n // -(-n // size))               # ceil(n / count): the first chunk is the longest
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
