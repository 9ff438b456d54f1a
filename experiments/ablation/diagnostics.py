"""NaLa diagnostics of a checkpoint: ‖q‖ and exponent histograms, saturated share, and
attention-row entropy against ‖q‖ (``nala_dit/models/diagnostics.py``).

The inputs are held-out images of the data the checkpoint was trained on (the embedded
``digits`` / ``digits-canvas``; other data: ``--noise`` feeds pure Gaussian inputs),
noised to the diffusion timestep ``--t`` (SiT: time in [0, 1]).

    python experiments/ablation/diagnostics.py --ckpt runs/ablation/work/runs/digits/nala/seed0_lr2e-3 --out diag/
    python experiments/ablation/diagnostics.py --ckpt RUN --init --out diag_init/      # same architecture, fresh init

Above 1,024 tokens the row entropy uses ``--rows`` sampled query rows per image (256 by
default), each built exactly against all keys.

Writes ``<out>/distributions.png``, ``<out>/entropy.png`` and ``<out>/diagnostics.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)


ALL_ROWS_UP_TO = 1024   # tokens; above, the entropy uses sampled rows (the N×N·D reference does not fit)
SAMPLED_ROWS = 256


def inputs(ckpt, model, batch: int, t_value: float, seed: int, noise_only: bool):
    import torch

    from nala_dit.data import datasets as data_lib
    from nala_dit.training.checkpoint import build_objective

    gen = torch.Generator().manual_seed(seed)
    c, size = model.in_channels, model.config.input_size
    data = ckpt.config.get("data")
    if noise_only:
        x0 = torch.randn(batch, c, size, size, generator=gen)
        y = torch.randint(0, model.config.num_classes, (batch,), generator=gen)
    elif data in ("digits", "digits-canvas"):
        ds = (data_lib.DigitsDataset("heldout") if data == "digits"
              else data_lib.DigitsCanvasDataset("heldout", size=ckpt.config.get("image-size") or 32))
        idx = torch.randperm(len(ds), generator=gen)[:batch]
        x0, y = ds.images[idx], ds.labels[idx]
    else:
        raise ValueError(f"--ckpt was trained on {data!r}: diagnostics read the embedded digits data only; "
                         f"pass --noise to use Gaussian inputs instead")
    objective = build_objective(ckpt.model_config, ckpt.config)
    noise = torch.randn(x0.shape, generator=gen)
    if model.config.objective == "diffusion":
        t = torch.full((batch,), int(t_value), dtype=torch.long)
        return objective.q_sample(x0, t, noise), objective.model_timesteps(t), y
    t = torch.full((batch,), float(t_value))
    x_t, _ = objective.interpolate(t, noise, x0)
    return x_t, t, y


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, required=True, help="run folder, checkpoints/ folder or checkpoint")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=8, help="images (the entropy needs N×N weights per layer)")
    parser.add_argument("--t", type=float, default=500, help="diffusion timestep (SiT: time in [0, 1])")
    parser.add_argument("--rows", type=int, default=None,
                        help="query rows per image for the entropy, sampled (default: every row up to "
                             f"{ALL_ROWS_UP_TO} tokens, else {SAMPLED_ROWS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", action="store_true", help="Gaussian inputs instead of held-out images")
    parser.add_argument("--init", action="store_true", help="the checkpoint's architecture at initialisation")
    parser.add_argument("--weights", choices=["ema", "model"], default="ema")
    args = parser.parse_args(argv)

    import torch

    from nala_dit.training.checkpoint import build_model_from_config, load_model, open_checkpoint
    from nala_dit.training.checkpoint import find_checkpoint
    from nala_dit.models.diagnostics import collect, plot_distributions, plot_entropy

    torch.set_num_threads(max(1, torch.get_num_threads()))
    ckpt = open_checkpoint(find_checkpoint(args.ckpt))
    if args.init:
        torch.manual_seed(args.seed)
        model = build_model_from_config(ckpt.model_config)
    else:
        model, _ = load_model(ckpt.path, args.weights)
    model.eval()
    x, t, y = inputs(ckpt, model, args.batch, args.t, args.seed, args.noise)
    tokens = (x.shape[-2] // model.patch_size) * (x.shape[-1] // model.patch_size)
    rows = args.rows if args.rows is not None else (None if tokens <= ALL_ROWS_UP_TO else SAMPLED_ROWS)
    if rows is not None and rows < 1:
        print(f"error: --rows must be at least 1, got {rows}", file=sys.stderr)
        return 2
    try:
        stats = collect(model, x, t, y, rows=rows, seed=args.seed)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = ckpt.model_config
    what = "init" if args.init else f"step {ckpt.step}"
    title = (f"{ckpt.config.get('model')} attention={cfg.get('attention')} norm_scale={cfg.get('norm_scale')} "
             f"({what}), {ckpt.config.get('data')}, "
             f"t={args.t:g}, {args.batch} images, {tokens} tokens"
             + ("" if rows is None or rows >= tokens else f" ({rows} sampled rows each)"))
    plot_distributions(stats, args.out / "distributions.png", title)
    plot_entropy(stats, args.out / "entropy.png", title)
    report = dict(checkpoint=str(ckpt.path), step=None if args.init else ckpt.step, init=args.init,
                  norm_scale=cfg.get("norm_scale"), t=args.t, batch=args.batch, tokens=tokens,
                  entropy_rows="all" if rows is None or rows >= tokens else rows,
                  layers=[s.summary() for s in stats])
    (args.out / "diagnostics.json").write_text(json.dumps(report, indent=1))
    for s in report["layers"]:
        print(f"layer {s['layer']}: ‖q‖ median {['%.2f' % v for v in s['q_norm_median']]}, "
              f"p {['%.3f±%.3f' % mv for mv in zip(s['exponent_mean'], s['exponent_std'])]}, "
              f"saturated {['%.2f' % v for v in s['saturated']]}, "
              f"corr(entropy, ‖q‖) {['%.2f' % v for v in s['entropy_vs_norm_corr']]}")
    print(f"wrote {args.out}/distributions.png, entropy.png, diagnostics.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
