"""CIFAR-10 speedrun (issue 54): softmax / NaLa x MLP / Mix-FFN (identity init) x seeds, FID-5K.

One entry point, bounded and resumable: every cell writes ``cells/<variant>_s<seed>.json`` as it
finishes and is skipped when that file exists; ``summary.json`` is recomputed from the cell files.

    python experiments/cifar10_speedrun/run.py --cifar ~/.cache/nala_dit/cifar10 --out runs/cifar10_speedrun
    python experiments/cifar10_speedrun/run.py --smoke --cifar ... --out /tmp/smoke   # CPU, toy scale

Seeds run one after another (not yet batched with torch.func); see README.md for what is not built yet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nala_dit.cli.parse import passive_wait_policy  # noqa: E402  (torch-free)

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402

VARIANTS = {  # name -> (model, overrides): the repository's option names
    "softmax_mlp": ("DiT-T/2", {}),
    "softmax_mix": ("DiT-T/2", {"mlp": "mix", "mix_init": "identity"}),
    "nala_mlp": ("NaLaDiT-T/2", {}),
    "nala_mix": ("NaLaDiT-T/2", {"mlp": "mix", "mix_init": "identity"}),
}


def load_split(folder: Path, per_class: int | None = None):
    """(N, 3, 32, 32) uint8 images and labels of an ImageFolder (the repository's reader's class
    order and files), the first ``per_class`` files of each class (all when None)."""
    from nala_dit.data.datasets import ImageFolderDataset

    ds = ImageFolderDataset(folder, 32)
    keep, seen = [], {}
    for i, (_, label) in enumerate(ds.samples):
        if per_class is None or seen.get(label, 0) < per_class:
            keep.append(i)
            seen[label] = seen.get(label, 0) + 1
    images = torch.from_numpy(np.stack([ds.load(i) for i in keep])).permute(0, 3, 1, 2).contiguous()
    labels = torch.tensor([ds.samples[i][1] for i in keep])
    return images, labels


def batch_to_model(images_u8: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) on the device -> [-1, 1] float, flipped as DiT (``random_flip``)."""
    from nala_dit.data.datasets import random_flip

    return random_flip(images_u8.float() / 127.5 - 1.0)


def build(variant: str, seed: int, lr: float, tokens: int, device):
    from nala_dit.models.dit import create_model
    from nala_dit.training.checkpoint import build_objective
    from nala_dit.training.loop import param_groups

    name, overrides = VARIANTS[variant]
    if tokens == 1024:
        name = name.replace("/2", "/1")
    torch.manual_seed(seed)
    model = create_model(name, input_size=32, in_channels=3, num_classes=10, **overrides).to(device)
    ema = create_model(name, input_size=32, in_channels=3, num_classes=10, **overrides).to(device)
    ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)
    objective = build_objective(dict(model.config), {})
    optimizer = torch.optim.AdamW(param_groups(model, 0.0), lr=lr, betas=(0.9, 0.999))
    return model, ema, objective, optimizer


def train_cell(variant, seed, images, labels, steps, batch, lr, tokens, device, cap_s):
    """The repository's objective (``MicroBatchLoss``), AdamW and warm-up EMA; the data order is a
    function of the seed only (the same for every variant)."""
    from nala_dit.training.step import MicroBatchLoss, update_ema

    model, ema, objective, optimizer = build(variant, seed, lr, tokens, device)
    loss_fn = MicroBatchLoss(objective, model, model.config.objective == "diffusion")
    order = torch.Generator().manual_seed(seed)
    t0, done = time.time(), 0
    for step in range(steps):
        idx = torch.randint(len(images), (batch,), generator=order)
        torch.manual_seed(seed * 1_000_003 + step)
        x, y = batch_to_model(images[idx.to(images.device)]), labels[idx.to(labels.device)]
        loss, _ = loss_fn(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        update_ema(ema, model, 0.9999, step=step)
        done = step + 1
        if time.time() - t0 > cap_s:
            break
    return model, ema, objective, {"steps": done, "seconds": time.time() - t0,
                                   "step_s": (time.time() - t0) / max(done, 1),
                                   "images_per_s": done * batch / max(time.time() - t0, 1e-9), "final_loss": float(loss.detach())}


@torch.no_grad()
def sample(ema, objective, n, seed, num_steps, cfg_scale, device, batch=500):
    from nala_dit.data.datasets import to_uint8
    from nala_dit.diffusion.generate import generate

    out, g = [], torch.Generator().manual_seed(seed)
    for start in range(0, n, batch):
        b = min(batch, n - start)
        noise = torch.randn(b, 3, 32, 32, generator=g).to(device)
        y = (torch.arange(start, start + b) % 10).to(device)
        x = generate(ema, objective, noise, y, num_steps=num_steps, cfg_scale=cfg_scale,
                     null_label=ema.null_label).samples
        out.append(to_uint8(x))
    return torch.cat(out).numpy()  # (N, H, W, C) uint8


def fid_against(features, ref_pool):
    from nala_dit.evaluation import metrics

    mu, sigma = metrics.feature_statistics(ref_pool)
    return metrics.frechet_distance_to_features(features, mu, sigma)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def summarize(out: Path) -> dict:
    cells = [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))]
    rows = {}
    for v in VARIANTS:
        mine = [c for c in cells if c["variant"] == v]
        if not mine:
            continue
        fids = np.array([c["fid"] for c in mine])
        rows[v] = {"n": len(mine), "fid_mean": float(fids.mean()),
                   "fid_spread": float(fids.std(ddof=1)) if len(mine) > 1 else 0.0,
                   "step_s": float(np.mean([c["train"]["step_s"] for c in mine])),
                   "images_per_s": float(np.mean([c["train"]["images_per_s"] for c in mine]))}
        base = {c["seed"]: c["fid"] for c in cells if c["variant"] == "softmax_mlp"}
        rows[v]["contrast_vs_softmax_mlp"] = {str(c["seed"]): c["fid"] - base[c["seed"]]
                                               for c in mine if c["seed"] in base}
    summary = {"variants": rows, "cells": len(cells)}
    write_json(out / "summary.json", summary)
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cifar", required=True, help="folder with train/<class>/ and test/<class>/")
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="2 cells, 20 steps, 64 samples, 200 images (CPU)")
    p.add_argument("--tokens", type=int, default=256, choices=(256, 1024))
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--samples", type=int, default=5000)
    p.add_argument("--sample-steps", type=int, default=50)
    p.add_argument("--cfg-scale", type=float, default=1.5)
    p.add_argument("--cell-cap-s", type=float, default=120.0)
    p.add_argument("--time-limit-s", type=float, default=600.0)
    p.add_argument("--inception-weights", default=None)
    p.add_argument("--allow-unknown-weights", action="store_true", help="accept an Inception file of unknown sha256 (tests)")
    args = p.parse_args(argv)
    cifar, out = Path(args.cifar).expanduser(), Path(args.out)
    if not (cifar / "train").is_dir() or not (cifar / "test").is_dir():
        raise SystemExit(f"error: {cifar} has no train/ and test/ folders: pass --cifar <folder of train/<class>/, test/<class>/>")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    per_class = 10 if args.smoke else None
    cells = [(v, s) for s in range(args.seeds) for v in VARIANTS]
    if args.smoke:
        args.steps, args.samples, args.batch, args.sample_steps = 20, 64, 16, 2
        cells = [("softmax_mlp", 0), ("nala_mlp", 0)]
    settings = {k: getattr(args, k) for k in ("smoke", "tokens", "steps", "batch", "lr", "samples", "sample_steps",
                                                "cfg_scale")}
    settings_path = out / "settings.json"
    if settings_path.is_file() and json.loads(settings_path.read_text()) != settings:
        raise SystemExit(f"error: {out} holds cells of other settings ({settings_path}): pass another --out, "
                         f"or the same settings to resume")
    write_json(settings_path, settings)
    t_start = time.time()
    images, labels = load_split(cifar / "train", per_class)
    images, labels = images.to(device), labels.to(device)
    from nala_dit.evaluation.features import InceptionExtractor
    from nala_dit.evaluation import metrics

    extractor = InceptionExtractor(args.inception_weights, device=str(device), allow_unknown=args.allow_unknown_weights)
    ref_path = out / "test_features.npz"
    if not ref_path.is_file():
        test_u8, _ = load_split(cifar / "test", 10 if args.smoke else None)
        feats = metrics.compute_features(extractor, [test_u8.permute(0, 2, 3, 1).numpy()])
        out.mkdir(parents=True, exist_ok=True)
        np.savez(ref_path, pool=feats["pool"])
    ref_pool = np.load(ref_path)["pool"]
    data_path = out / "data_fid.json"
    if not data_path.is_file():  # the evaluator's train-vs-test figure (published: 3.1 at 10,000 / 50,000)
        train_feats = metrics.compute_features(extractor, [images[i:i + 500].permute(0, 2, 3, 1).cpu().numpy()
                                                           for i in range(0, len(images), 500)])["pool"]
        sizes = sorted({n // 10 * 10 for n in (len(train_feats), len(train_feats) // 5, len(train_feats) // 25) if n >= 20})
        per = len(train_feats) // 10
        first = lambda n: np.concatenate([train_feats[c * per: c * per + n // 10] for c in range(10)])  # noqa: E731
        write_json(data_path, {"n_test": len(ref_pool), "published_10000_50000": 3.1,
                               "fid_test_vs_train": {str(n): fid_against(ref_pool, first(n)) for n in sizes}})
    for variant, seed in cells:
        path = out / "cells" / f"{variant}_s{seed}.json"
        if path.is_file():
            continue
        if time.time() - t_start > args.time_limit_s:
            print(f"time limit reached before {variant} seed {seed}", flush=True)
            break
        _, ema, objective, train = train_cell(variant, seed, images, labels, args.steps, args.batch, args.lr,
                                              args.tokens, device, args.cell_cap_s)
        t0 = time.time()
        samples = sample(ema, objective, args.samples, seed, args.sample_steps, args.cfg_scale, device)
        feats = metrics.compute_features(extractor, [samples])
        cell = {"variant": variant, "seed": seed, "train": train, "samples": len(samples),
                "sample_and_score_s": time.time() - t0, "fid": fid_against(feats["pool"], ref_pool)}
        cell["precision"], cell["recall"] = metrics.precision_recall(ref_pool, feats["pool"])
        if (variant, seed) == cells[0]:  # FID's own noise: a second sample set of the same model
            again = metrics.compute_features(extractor, [sample(ema, objective, args.samples, seed + 10_000,
                                                                args.sample_steps, args.cfg_scale, device)])
            cell["fid_second_set"] = fid_against(again["pool"], ref_pool)
            cell["fid_between_sets"] = fid_against(again["pool"], feats["pool"])
        write_json(path, cell)
        print(json.dumps(cell), flush=True)
    print(json.dumps(summarize(out), indent=2))


if __name__ == "__main__":
    main()
