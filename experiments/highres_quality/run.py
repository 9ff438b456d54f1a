"""What sampling away from the trained size does to quality, on the demo's digits models.

The demo trains on 8×8 digits (16 tokens). Each model is sampled at the trained size and at
2× the side (4× the tokens) directly, with DiT's integer positions (``extrapolate``) or with
PixArt's interpolated ones, and by progressive upscaling (sample at 8 px, upsample, re-noise
to a strength, denoise at 16 px). Every large sample is area-averaged back to 8×8 and scored
like the demo (digits classifier: class-consistency and Fréchet distance against the 360
held-out digits). A model that draws one coherent digit over the larger canvas scores as at
its own size; tiled or broken content scores low.

    make demo                                     # the three run folders under runs/demo
    python experiments/highres_quality/run.py --runs runs/demo --out experiments/highres_quality/digits.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

# (name, image side, pos_embed, upscale strength or None)
SETTINGS = [("trained size (8 px)", 8, "extrapolate", None),
            ("16 px, extrapolate", 16, "extrapolate", None),
            ("16 px, interpolate", 16, "interpolate", None),
            ("16 px, upscaled from 8, strength 0.1", 16, "extrapolate", 0.1),
            ("16 px, upscaled from 8, strength 0.3", 16, "extrapolate", 0.3)]
SAMPLERS = {"diffusion": ("ddpm", 40), "transport": ("ode-heun", 16)}  # the demo's


def score(source, setting, per_class: int, seed: int, ref: Path, classifier_dir: Path,
          steps: int | None = None) -> dict:
    import numpy as np
    import torch

    from nala_dit.evaluation import metrics
    from nala_dit.diffusion.generate import SampleSettings
    from nala_dit.pipelines.sample_files import sample_images

    name, side, pos, strength = setting
    model = source.model
    model.register_to_config(positions=pos)   # the policy is read per grid: no reload needed
    model.reset_pos_embed()
    sampler, demo_steps = SAMPLERS[model.config.objective]
    steps = demo_steps if steps is None else steps
    settings = SampleSettings(sampler, steps, cfg_scale=2.0)
    if side != model.config.input_size:
        settings = replace(settings, latent_size=(side, side))
        if strength is not None:
            settings = replace(settings, upscale_from=(model.config.input_size,) * 2, strength=strength)
    labels = [c for _ in range(per_class) for c in range(source.num_classes)]
    start = time.perf_counter()
    images, nfe = sample_images(source, labels, seed=seed, settings=settings, batch_size=100)
    x = images.permute(0, 3, 1, 2).float()                                # (B, 1, side, side) uint8 values
    k = side // 8
    small = torch.nn.functional.avg_pool2d(x, k).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    result = metrics.evaluate_samples([small.numpy()], ref, features="digits", digits_classifier_dir=classifier_dir,
                                      labels=np.asarray(labels))
    return dict(setting=name, side=side, pos_embed=pos, strength=strength, seed=seed, nfe=nfe,
                class_consistency=result["metrics"]["class_consistency"],
                frechet_distance=result["metrics"]["fd_digits"], seconds=round(time.perf_counter() - start, 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "demo", help="the demo's output folder")
    p.add_argument("--models", default="NaLaDiT,NaLaSiT,DiT")
    p.add_argument("--per-class", type=int, default=10)
    p.add_argument("--seeds", default="0,1,2", help="sampling seeds (the noise; one trained model each)")
    p.add_argument("--work", type=Path, default=ROOT / "experiments" / "ablation" / "results" / "work",
                   help="where the digits classifier and the held-out reference are built once")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, help="sampling steps of every setting (default: the demo's, 40 DDPM / 16 ODE "
                   "Heun); an upscaled setting adds round(strength × steps)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    import statistics

    import torch

    from experiments.ablation import study as ablation
    from nala_dit.pipelines.sources import load_source

    torch.set_num_threads(args.threads)
    classifier_dir = args.work / "digits_classifier"
    ref = ablation.reference("digits", args.work, classifier_dir)
    rows = []
    for name in args.models.split(","):
        run = args.runs / name
        if not run.exists():
            p.error(f"no run folder {run}: run `make demo` first, or pass --runs DIR")
        source = load_source(run)
        for setting in SETTINGS:
            for seed in map(int, args.seeds.split(",")):
                row = score(source, setting, args.per_class, seed, ref, classifier_dir, args.steps)
                rows.append(dict(model=name, **row))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n| model | setting | class-consistency | Fréchet distance | n (sampling seeds) |\n|---|---|---|---|---|")
    for name in args.models.split(","):
        for setting in SETTINGS:
            mine = [r for r in rows if r["model"] == name and r["setting"] == setting[0]]
            cc = [r["class_consistency"] for r in mine]
            fd = [r["frechet_distance"] for r in mine]
            spread = (lambda v: statistics.stdev(v) if len(v) > 1 else 0.0)
            print(f"| {name} | {setting[0]} | {statistics.mean(cc):.3f} ± {spread(cc):.3f} | "
                  f"{statistics.mean(fd):.1f} ± {spread(fd):.1f} | {len(mine)} |")
    if args.out:
        meta = dict(runs=str(args.runs), per_class=args.per_class, threads=args.threads, loadavg=os.getloadavg(),
                    command="python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *(argv or sys.argv[1:])]))
        args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
