"""Torch-free checks of what a user typed, shared by every package and the CLIs (below all
of them, like ``guards.py``, which holds the checks that need torch): a number in its range,
the nearest flag or path to a typo (``did you mean ...?``), and the words for a text file that is
binary or holds a number past Python's digit limit."""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
from pathlib import Path


def number_in(value, lo: float, hi: float, must: str) -> float:
    """``value`` (a number or numeric string, not a bool) as a float in [lo, hi] (NaN fails the
    comparison); anything else ``ValueError(f"{must}, got {value!r}")``."""
    if isinstance(value, bool):
        raise ValueError(f"{must}, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{must}, got {value!r}") from None
    if not (lo <= number <= hi):
        raise ValueError(f"{must}, got {value!r}")
    return number


# Names other training scripts use (DiT/SiT's train.py, Hugging Face, timm) for our flags;
# too far from ours in spelling for difflib to find.
SYNONYMS = {"learning-rate": "lr", "learningrate": "lr", "wd": "weight-decay", "batch-size": "global-batch-size",
            "steps": "max-steps", "train-steps": "max-steps", "max-train-steps": "max-steps",
            "gradient-accumulation-steps": "grad-accum", "grad-clip": "max-grad-norm", "clip-grad": "max-grad-norm",
            "precision": "mixed-precision", "workers": "num-workers", "data-path": "data", "global-seed": "seed",
            "output-dir": "results-dir", "save-every": "ckpt-every", "checkpoint-every": "ckpt-every",
            "log-interval": "log-every", "resolution": "image-size", "ema": "ema-decay"}


def closest(word: str, candidates, n: int = 1) -> list[str]:
    """The candidates nearest to ``word`` (``_`` and ``-`` count as the same character; a
    known synonym such as ``learning-rate`` for ``lr`` first)."""
    norm = {c.replace("_", "-").lower(): c for c in candidates}
    key = word.replace("_", "-").lower()
    bare = key.lstrip("-")
    synonym = key[: len(key) - len(bare)] + SYNONYMS.get(bare, "\0")  # same leading dashes as the word
    if synonym in norm:
        return [norm[synonym]]
    found = difflib.get_close_matches(key, list(norm), n=n, cutoff=0.6)
    return [norm[f] for f in found]


def nearest_path(path: str | os.PathLike) -> str | None:
    """An existing path that differs from a missing ``path`` by a typo in one or more of its
    parts (each part replaced by the closest name in its folder), or None."""
    from pathlib import Path

    path = Path(path)
    if path.exists():
        return None
    here = Path(path.anchor) if path.is_absolute() else Path(".")
    for part in path.parts[1:] if path.is_absolute() else path.parts:
        if part in ("..", "."):
            here = here / part
            continue
        if (here / part).exists():
            here = here / part
            continue
        try:
            names = [p.name for p in here.iterdir()]
        except OSError:
            return None
        near = closest(part, names)
        if not near:
            return None
        here = here / near[0]
    return str(here) if here.exists() else None


def did_you_mean(path: str | os.PathLike) -> str:
    """``" (did you mean X?)"`` for a mistyped path, else ''."""
    near = nearest_path(path)
    return f" (did you mean {near}?)" if near else ""


def check_number(flag: str, value, lo: float = 0.0, hi: float | None = None, why: str = "") -> float:
    """The one check of a numeric recipe knob: finite, ``lo <= value`` (and ``<= hi``), else a
    one-line ValueError naming the flag, the allowed range, ``why`` (what the values mean) and
    the value. NaN fails every comparison, so a plain ``value < 0`` test lets it through (a NaN
    ``--max-grad-norm`` read as "no clipping", a NaN ``--ema-decay`` trained to the end)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (lo <= value and (hi is None or value <= hi)):
        allowed = f"a number from {lo:g} to {hi:g}" if hi is not None else f"a finite number >= {lo:g}"
        raise ValueError(f"{flag} must be {allowed}{f' ({why})' if why else ''}, got {value!r}")
    return value


def read_text(path: str | os.PathLike, what: str) -> str:
    """``path``'s text (UTF-8); a binary file is a ValueError naming it, the first byte that is
    not UTF-8 and ``what`` the file should be (not the codec's wording)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a text file (byte {err.object[err.start]:#04x} at offset {err.start:,} is not "
                         f"UTF-8): {what}") from None


def too_many_digits(err: ValueError) -> str | None:
    """For ``int()`` of a number past Python's digit limit: the words for it, else None."""
    digits = re.search(r"value has (\d+) digits", str(err))
    if digits is None:
        return None
    return (f"holds a number of {int(digits.group(1)):,} digits (Python reads at most "
            f"{sys.get_int_max_str_digits():,}); no setting takes one that long")
