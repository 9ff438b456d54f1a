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
      --json runs/samples/metrics.json --device cuda
  python evaluate_fid.py calc --samples runs/digits/samples.npz --ref runs/ref/digits.npz

  # an ADM reference batch works as --ref directly (mu, sigma, mu_s, sigma_s + arr_0)
  python evaluate_fid.py calc --samples samples.npz --ref VIRTUAL_imagenet256_labeled.npz

Evaluation runs in one process (feature extraction is cheap next to sampling), so
there is no `accelerate launch` form. Nothing is downloaded: the Inception weights
come from --inception-weights or torch-fidelity's cache, else the command says
which file to fetch.
"""

import argparse
import json
import sys
from pathlib import Path

from nala_dit import metrics


def _add_common(p: argparse.ArgumentParser, features_default: str | None) -> None:
    p.add_argument("--features", choices=metrics.FEATURE_CHOICES, default=features_default,
                   help="feature extractor (calc: default = the one recorded in --ref)")
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--num-workers", type=int, default=0, help="image-folder decoding workers")
    p.add_argument("--inception-weights", default=None,
                   help=f"path to {metrics.INCEPTION_WEIGHTS_FILE} (default: torch-fidelity's cache)")
    p.add_argument("--digits-classifier", default=None,
                   help="folder of the digits classifier (default runs/digits_classifier; trained if absent)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    ref = sub.add_parser("ref", help="compute reference statistics")
    source = ref.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="image folder (recursive PNG/JPG) or .npz with arr_0")
    source.add_argument("--dataset", choices=metrics.DATASETS, help="an embedded dataset")
    ref.add_argument("--out", required=True, help="output .npz")
    _add_common(ref, "inception")

    calc = sub.add_parser("calc", help="score samples against reference statistics")
    calc.add_argument("--samples", required=True, help="image folder or .npz with arr_0 (and arr_1 labels)")
    calc.add_argument("--ref", required=True, help="reference .npz from `ref`, or an ADM reference batch")
    calc.add_argument("--kid", action="store_true", help="also compute KID")
    calc.add_argument("--json", default=None, help="write the result here")
    calc.add_argument("--split-size", type=int, default=5000, help="Inception Score split size (ADM: 5000)")
    _add_common(calc, None)

    sub.add_parser("gen", help="generate and score without writing images (not yet available)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "gen":
        print("evaluate_fid.py gen is not yet available: generate with sample.py into an .npz, "
              "then run `evaluate_fid.py calc --samples that.npz --ref stats.npz`.", file=sys.stderr)
        return 2

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    common = dict(batch_size=args.batch_size, device=device, num_workers=args.num_workers,
                  inception_weights=args.inception_weights, digits_classifier_dir=args.digits_classifier)
    try:
        if args.command == "ref":
            summary = metrics.make_reference(args.out, args.data, args.dataset, args.features, **common)
            print(f"wrote {summary['out']}: {summary['num_images']} images, {summary['extractor']}")
            return 0
        result = metrics.evaluate_samples(args.samples, args.ref, args.features, args.kid,
                                          split_size=args.split_size, **common)
    except (metrics.MissingWeightsError, FileNotFoundError, ValueError, KeyError) as err:
        # Expected user errors (missing weights, wrong paths, mismatched extractors): a message, no traceback.
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(metrics.format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
