r"""Samples beside what the digits scorer reads of them: each sample above its 8 x 8 area average.

The digits classifier (``--features digits``) scores a larger whole-frame digit by
box-averaging it to 8 x 8 (``nala_dit.data.digits.digits_to_input``). This draws that view under
each sample, enlarged back to the sample's size with square pixels, so a figure shows what a
class-consistency score of the samples protocol can and cannot see.

    python sample.py --ckpt RUN --labels 0,1,2,3,4,5,6,7,8,9 --per-label 2 --sampler ddim --steps 20 \
        --cfg-scale 2 --out-dir samples/view
    python experiments/ablation/scorer_view.py samples/view --out experiments/ablation/figures/samples64_pilot.png

The folder holds ``sample.py --out-dir``'s PNGs (``000000_class3.png``, ...). Columns are the
classes in order, rows the samples of a class in file order, each row of samples followed
by the row of their views; 2 px black padding between tiles, as ``sample.py --grid``.
Several folders (one per model, the same labels and seed) stack into one figure, top to
bottom in the order given, 4 more black rows between them:

    python experiments/ablation/scorer_view.py samples/view_nala_mix samples/view_softmax_mix \
        --out experiments/ablation/figures/samples64_study.png
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

NAME = re.compile(r"^\d+_class(\d+)\.png$")


def read_samples(folder: Path) -> dict[int, list]:
    """``sample.py --out-dir``'s PNGs by class, in file order: {class: [uint8 (H, W) or (H, W, 3)]}."""
    import numpy as np
    from PIL import Image

    by_class: dict[int, list] = {}
    for path in sorted(folder.glob("*.png")):
        if match := NAME.match(path.name):
            by_class.setdefault(int(match[1]), []).append(np.array(Image.open(path)))
    if not by_class:
        raise FileNotFoundError(f"no samples in {folder}: expected sample.py --out-dir's files "
                                f"(000000_class3.png, ...); write them with sample.py --labels ... --out-dir {folder}")
    return by_class


def scorer_view(image):
    """uint8 (H, W) or (H, W, 3) → the scorer's 8 x 8 view of it, enlarged to (H, W) uint8 grey."""
    import torch

    from nala_dit.data.digits import digits_to_input

    x = torch.from_numpy(image)
    x = x[None, None] if x.dim() == 2 else x.permute(2, 0, 1)[None]
    small = digits_to_input(x)[0, 0]                                         # (8, 8) in [0, 1]
    scale = image.shape[0] // small.shape[0]
    if image.shape[0] != image.shape[1] or scale * small.shape[0] != image.shape[0]:
        raise ValueError(f"samples must be square with a side divisible by 8, got {image.shape[:2]}")
    return (small * 255).round().to(torch.uint8).repeat_interleave(scale, 0).repeat_interleave(scale, 1).numpy()


def figure(by_class: dict[int, list], pad: int = 2):
    """The figure as one uint8 (H, W) grey array (see the module docstring for the layout)."""
    import numpy as np

    classes = sorted(by_class)
    per_class = min(len(v) for v in by_class.values())
    side = by_class[classes[0]][0].shape[0]
    grey = {c: [im if im.ndim == 2 else np.asarray(_luma(im)) for im in by_class[c][:per_class]] for c in classes}
    rows = []
    for i in range(per_class):
        rows.append([grey[c][i] for c in classes])
        rows.append([scorer_view(by_class[c][i]) for c in classes])
    step = side + pad
    out = np.zeros((pad + step * len(rows), pad + step * len(classes)), np.uint8)
    for r, row in enumerate(rows):
        for c, tile in enumerate(row):
            out[pad + r * step: pad + r * step + side, pad + c * step: pad + c * step + side] = tile
    return out


def stack(figures: list, gap: int = 4):
    """Figures of equal width, top to bottom, ``gap`` black rows between them."""
    import numpy as np

    widths = {f.shape[1] for f in figures}
    if len(widths) > 1:
        raise ValueError(f"the folders' figures differ in width ({sorted(widths)} px): give each folder "
                         "the same --labels and sample size")
    rows = np.zeros((gap, figures[0].shape[1]), np.uint8)
    parts = [figures[0]]
    for f in figures[1:]:
        parts += [rows, f]
    return np.concatenate(parts, axis=0)


def _luma(image):
    from PIL import Image

    return Image.fromarray(image).convert("L")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("samples", type=Path, nargs="+", help="sample.py --out-dir folder(s), stacked top to bottom")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = p.parse_args(argv)
    from PIL import Image

    try:
        arr = stack([figure(read_samples(folder)) for folder in args.samples])
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(args.out)
    print(f"wrote {args.out} ({arr.shape[1]} x {arr.shape[0]} px)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
