"""The NaLa Triton kernels before the rework, for the GPU A/B (``benchmarks/gpu_check.sh``).

``baseline_nala_kernels.py`` is the one-module kernel file of ``nala_dit/attention/`` as it was
at commit ``b008a8e`` (``SOURCE``; the last commit with the kernels in one module), written by
``regenerate`` below with a few edits: its import of ``config`` made absolute, its default variant ``"baseline"`` (partial
states summed by ``torch.sum``, token ranges of ≥ 512 tokens, state and output as two
launches, D = 72 padded to 128 lanes, TF32 products and libdevice sin/cos/log for half
inputs), the gated layer's file named where it is now, and a note. ``opts["variant"] = "fused"`` still runs that commit's fused kernels,
and ``launch_config(d, {"table": "previous"})`` its launch configs from before the register
work (``benchmarks/triton_configs.py`` times both). The module is committed (the working
tree that travels to a GPU machine has no ``.git``).

``install()`` makes it NaLa's Triton path in this process: it takes the place of
``nala_dit.attention.nala.triton.launch`` (configs, launches, the autograd function), so
``nala_attention``, the custom op and the gated layer's ``TritonGatedMiddle`` all run the old
kernels. The benchmarks call it where ``NALA_TRITON_VARIANT=baseline`` is set
(``install_if_asked``); it must run before anything imports the Triton path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LAUNCH = "nala_dit.attention.nala.triton.launch"
COMMIT = "b008a8e"
SOURCE = "nala_dit/attention/triton_kernels.py"
EDITS = (("from .config import", "from nala_dit.attention.config import"),
         ('VARIANT = os.environ.get("NALA_TRITON_VARIANT", "fused")', 'VARIANT = "baseline"'),
         ('variant: str = "fused"', 'variant: str = "baseline"'),
         ("``triton_gated.py``", "``nala_dit/attention/nala/triton/gated.py``"))


def regenerate(commit: str = COMMIT) -> str:
    """``baseline_nala_kernels.py``'s text from git, written there (in a checkout:
    ``python -c 'import benchmarks.baseline_nala as b; b.regenerate()'``)."""
    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{commit}:{SOURCE}"], cwd=root, check=True, capture_output=True,
                          text=True).stdout
    for old, new in EDITS:
        if old not in text:
            raise ValueError(f"{SOURCE} at {commit} has no {old!r}")
        text = text.replace(old, new)
    note = f'"""The NaLa Triton kernels at commit {COMMIT}, for the GPU A/B: see ``benchmarks/baseline_nala.py``.\n\n'
    text = note + text.removeprefix('"""')
    (Path(__file__).parent / "baseline_nala_kernels.py").write_text(text)
    return text


def install():
    """Make the old kernels NaLa's Triton path in this process; returns their module."""
    current = sys.modules.get(LAUNCH)
    from benchmarks import baseline_nala_kernels as kernels

    if current is not None and current is not kernels:
        raise RuntimeError("baseline_nala.install() must run before NaLa's Triton path is imported")
    import nala_dit.attention.nala.triton as package

    sys.modules[LAUNCH] = package.launch = kernels
    return kernels


def install_if_asked():
    """``install()`` where ``NALA_TRITON_VARIANT=baseline``; the variant's name ("fused" otherwise)."""
    variant = os.environ.get("NALA_TRITON_VARIANT", "fused")
    if variant not in ("fused", "baseline"):
        raise ValueError(f"NALA_TRITON_VARIANT={variant!r}: expected fused or baseline")
    if variant == "baseline":
        install()
    return variant
