"""The size flags of the sampling CLIs (torch-free): ``--image-size``, ``--time-shift``,
``--upscale-from`` and ``--strength`` as ``sample.py`` and ``evaluate_fid.py gen`` offer them,
their checks that need no model, their values handed to ``nala_dit.models.grid.sized_settings``
(the model layer takes plain values and knows no flag), and the note that names the commands
to use when sampling away from the trained size."""

from __future__ import annotations

import sys

from ..models.grid import STRENGTH, format_size, parse_image_size, parse_time_shift, sized_settings, vae_factor


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


def sized(settings, source, args, batch: int, verbose: bool = True):
    """``settings`` at the size flags' values (``grid.sized_settings``; its memory check for a first
    batch of ``batch`` images names the flags), and with ``verbose`` the one-line notice on stderr
    when the size is not the trained one (``size_notice``)."""
    settings = sized_settings(settings, source, args.image_size, args.upscale_from, args.time_shift, args.strength,
                              batch=batch, what=f"--image-size {args.image_size}",
                              fix="use a smaller --image-size or --batch-size")
    if verbose and settings.latent_size is not None and settings.upscale_from is None:
        if note := size_notice(source.model.config, settings.latent_size, vae_factor(source.vae)):
            print(note, file=sys.stderr)
    return settings


def size_notice(config, latent_hw: tuple[int, int], vae_factor_: int) -> str | None:
    """A one-line notice when sampling away from the trained size (None at it)."""
    trained = config["input_size"]
    if tuple(latent_hw) == (trained, trained):
        return None
    mode = config.get("positions") or "extrapolate"
    hw = (latent_hw[0] * vae_factor_, latent_hw[1] * vae_factor_)
    px = format_size(hw)
    # train.py trains square images: a non-square request fine-tunes at its larger side.
    where = "at this size" if hw[0] == hw[1] else f"at {max(hw)} px, the larger side (train.py trains square images)"
    # --upscale-from starts at the trained size and only grows (SampleSettings.resolved): offered above it only
    upscale = (f" or use --upscale-from {trained * vae_factor_}" if min(latent_hw) >= trained else "")
    return (f"note: sampling at {px} px, not the trained {trained * vae_factor_} px ({mode} positions): expect "
            f"repeated or broken content, most of all far above the trained size. Fine-tune {where} "
            f"(train.py --init-from RUN --image-size {max(hw)} --pos-embed interpolate){upscale} (docs/highres.md)")
