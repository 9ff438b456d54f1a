"""The size flags of the sampling CLIs (torch-free): ``--image-size``, ``--time-shift``,
``--upscale-from`` and ``--strength`` as ``sample.py`` and ``evaluate_fid.py gen`` offer them,
their checks that need no model, and their values as the keywords of
``nala_dit.models.grid.sized_settings`` (the model layer takes plain values and knows no flag)."""

from __future__ import annotations

from ..models.grid import STRENGTH, parse_image_size, parse_time_shift


def add_size_arguments(parser) -> None:
    """``--image-size``, ``--time-shift``, ``--upscale-from``, ``--strength``: sample.py and
    ``evaluate_fid.py gen`` take the same flags and mean the same by them."""
    size = parser.add_argument_group("image size (docs/highres.md)")
    size.add_argument("--image-size", help="pixels, N or HxW (each side a multiple of VAE factor × patch; "
                      "default: the trained size)")
    size.add_argument("--time-shift", help="shift the sampler's steps toward noise: a number s in 0.01..100 "
                      "(1 = none) or 'auto' (s = √(tokens / base tokens)); default: what the model was trained with")
    size.add_argument("--upscale-from", metavar="SIZE", help="progressive upscaling: sample at SIZE pixels "
                      "(e.g. the trained size) first, upsample, re-noise to --strength and denoise at --image-size")
    size.add_argument("--strength", type=float, help="--upscale-from: noise level to re-noise to, "
                      f"0 (keep the upsampled image) … 1 (from pure noise) (default: {STRENGTH})")


def check_size_args(args) -> None:
    """Size flags that are wrong whatever the model: one-line errors before loading it."""
    for flag in ("image_size", "upscale_from"):
        if getattr(args, flag) is not None:
            try:
                parse_image_size(getattr(args, flag))
            except ValueError as err:
                raise ValueError(f"--{flag.replace('_', '-')}: {err}") from None
    if args.time_shift is not None:
        parse_time_shift(args.time_shift)
    if args.upscale_from is not None and args.image_size is None:
        raise ValueError("--upscale-from needs --image-size (the size to upscale to)")
    if args.strength is not None and args.upscale_from is None:
        raise ValueError("--strength applies to progressive upscaling only: add --upscale-from SIZE (e.g. the "
                         "trained size) with --image-size, or drop --strength")


def size_values(args, batch: int) -> dict:
    """The size flags as ``sized_settings``' keywords, for a first batch of ``batch`` images
    (the memory check's), with the flags a refusal names."""
    return dict(image_size=args.image_size, upscale_from=args.upscale_from, time_shift=args.time_shift,
                strength=args.strength, batch=batch, what=f"--image-size {args.image_size}",
                fix="use a smaller --image-size or --batch-size")
