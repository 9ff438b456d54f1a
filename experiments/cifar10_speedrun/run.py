"""CIFAR-10 speedrun (issue 54): softmax / NaLa x MLP / Mix-FFN (identity init) x seeds, FID-5K.

One entry point, bounded and resumable: every cell writes ``cells/<variant>_s<seed>.json`` as it
finishes and is skipped when that file exists; ``summary.json`` is recomputed from the cell files.

    python experiments/cifar10_speedrun/run.py --cifar ~/.cache/nala_dit/cifar10 --out runs/cifar10_speedrun
    python experiments/cifar10_speedrun/run.py --smoke --cifar ... --out runs/smoke     # CPU, toy scale, < 1 min

The seeds of a variant train side by side (``train_variant``: torch.func vmap over their stacked
weights; ``--sequential``: one after another, the reference it equals). See README.md.
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

from nala_dit.compile_cache import private_compile_cache  # noqa: E402
VARIANTS = {  # name -> (model, overrides): the repository's option names
    "softmax_mlp": ("DiT-T/2", {}),
    "softmax_mix": ("DiT-T/2", {"mlp": "mix", "mix_init": "identity"}),
    "nala_mlp": ("NaLaDiT-T/2", {}),
    "nala_mix": ("NaLaDiT-T/2", {"mlp": "mix", "mix_init": "identity"}),
}
# per token count: training steps per model, sampler steps, one variant's training cap (s); the sizing,
# from the cost model, is in README.md: each run's predicted stages fit --time-limit-s 480 on one H200
SIZING = {256: dict(steps=3000, sample_steps=50, train_cap_s=75.0),
          1024: dict(steps=800, sample_steps=25, train_cap_s=90.0)}
SMOKE_PER_CLASS = 2  # --smoke: 20 + 20 images; Inception at 299 px is most of a CPU smoke run's time
# --smoke's budget: training steps of ``batch`` images, samples a set (one a class; the cell's, and the
# first cell's second set: 10 + 10 + 10 through Inception) and sampler steps
SMOKE = dict(steps=5, batch=8, samples=10, sample_steps=2)


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


def build(variant: str, seed: int, tokens: int, device):
    """The model (seeded by ``seed``) and its EMA copy, and the objective: the repository's own."""
    from nala_dit.models.dit import create_model
    from nala_dit.training.checkpoint import build_objective

    name, overrides = VARIANTS[variant]
    if tokens == 1024:
        name = name.replace("/2", "/1")
    torch.manual_seed(seed)
    model = create_model(name, input_size=32, in_channels=3, num_classes=10, **overrides).to(device)
    ema = create_model(name, input_size=32, in_channels=3, num_classes=10, **overrides).to(device)
    ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)
    if model.config.objective != "diffusion":
        raise ValueError(f"{name}: the speedrun trains the diffusion objective")
    return model, ema, build_objective(dict(model.config), {})


def adamw(model_or_groups, lr: float, foreach: bool | None = None) -> torch.optim.AdamW:
    """The study's AdamW (``param_groups``, no weight decay, betas (0.9, 0.999))."""
    from nala_dit.training.build import param_groups

    groups = param_groups(model_or_groups, 0.0) if isinstance(model_or_groups, torch.nn.Module) else model_or_groups
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), foreach=foreach)


def train_cell(variant, seed, images, labels, steps, batch, lr, tokens, device, cap_s):
    """One seed as a plain single-model run (``--sequential``; the reference the batched run equals):
    the repository's objective (``MicroBatchLoss``), AdamW and warm-up EMA; the data order is a
    function of the seed only (the same for every variant)."""
    from nala_dit.training.step import MicroBatchLoss, step_seed, update_ema

    model, ema, objective = build(variant, seed, tokens, device)
    optimizer = adamw(model, lr)
    loss_fn = MicroBatchLoss(objective, model, True)
    order = torch.Generator().manual_seed(seed)
    t0, done = time.time(), 0
    for step in range(steps):
        idx = torch.randint(len(images), (batch,), generator=order)
        torch.manual_seed(step_seed(seed, 0, step))
        x, y = batch_to_model(images[idx.to(images.device)]), labels[idx.to(labels.device)]
        loss, _ = loss_fn(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        update_ema(ema, model, 0.9999, step=step)
        done = step + 1
        if time.time() - t0 > cap_s:
            break
    return [(model, ema)], objective, timing(t0, done, batch, [float(loss.detach())], device)


def timing(t0, steps, batch, final_losses, device=None):
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.time() - t0
    return {"steps": steps, "seconds": seconds, "step_s": seconds / max(steps, 1),
            "images_per_s": steps * batch * len(final_losses) / max(seconds, 1e-9), "final_loss": final_losses}


class _Params:
    """Stacked tensors as ``update_ema`` reads a module: ``.parameters()``."""

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def parameters(self):
        return self.tensors


def train_variant(variant, seeds, images, labels, steps, batch, lr, tokens, device, cap_s, compile=False):
    """The seeds of one variant trained side by side: their weights stacked
    (``torch.func.stack_module_state``), one ``vmap`` of ``functional_call`` over the stacked
    weights per step (one kernel per op for all seeds, where one model per step is bound by kernel
    launches), AdamW (``foreach``) and ``update_ema`` on the stacked tensors: elementwise, so each
    seed's slice is updated as its own optimizer would. Each seed's random draws (flip, timesteps,
    noise, label dropout) are taken outside the vmap in the order and from the RNG state of its
    plain run (``train_cell``), so seed s ends with the weights ``train_cell`` gives it, to fp32
    rounding (tests/experiments/test_cifar10_speedrun.py). ``compile``: ``torch.compile`` of the
    batched loss and its backward."""
    import copy

    from torch.func import functional_call, stack_module_state, vmap

    from nala_dit.training.build import param_groups
    from nala_dit.training.step import step_seed, update_ema

    built = [build(variant, s, tokens, device) for s in seeds]
    models, objective = [m for m, _, _ in built], built[0][2]
    params, buffers = stack_module_state(models)
    ema = {k: v.detach().clone() for k, v in stack_module_state([e for _, e, _ in built])[0].items()}
    names = {id(p): n for n, p in models[0].named_parameters()}
    optimizer = adamw([dict(g, params=[params[names[id(p)]] for p in g["params"]])
                       for g in param_groups(models[0], 0.0)], lr, foreach=True)
    base = copy.deepcopy(models[0]).to("meta").train()
    for module in base.modules():  # attention layers: the plain autograd composition (vmap has no rule
        if hasattr(module, "recompute"):  # for their recompute autograd.Function)
            module.recompute = False
    labeler = models[0].y_embedder

    def loss(p, b, x, t, noise, y, drop):
        fn = lambda x_t, tt, yy: functional_call(base, (p, b), (x_t, tt, yy), {"force_drop_ids": drop})  # noqa: E731
        return objective.training_losses(fn, x, t, y, noise=noise)["loss"].mean()

    batched = vmap(loss)
    if compile:
        private_compile_cache()   # inductor imports what it cached: only from a folder no one else can write
        batched = torch.compile(batched)
    orders = [torch.Generator().manual_seed(s) for s in seeds]
    t0, done = time.time(), 0
    for step in range(steps):
        draws = []
        for seed, order in zip(seeds, orders):  # train_cell's draws, in its order
            idx = torch.randint(len(images), (batch,), generator=order)
            torch.manual_seed(step_seed(seed, 0, step))
            x, y = batch_to_model(images[idx.to(images.device)]), labels[idx.to(labels.device)]
            t = objective.sample_timesteps(batch, x.device)
            noise = torch.randn(x.shape, dtype=x.dtype, device=x.device)
            # the label dropout the model's forward would draw (``LabelEmbedder.token_drop``), as ids
            drop = ((labeler.token_drop(y) != y) if labeler.dropout_prob > 0 else torch.zeros_like(y)).long()
            draws.append((x, t, noise, y, drop))
        losses = batched(params, buffers, *(torch.stack(d) for d in zip(*draws)))
        optimizer.zero_grad(set_to_none=True)
        losses.sum().backward()
        optimizer.step()
        update_ema(_Params(ema.values()), _Params(params.values()), 0.9999, step=step)
        done = step + 1
        if time.time() - t0 > cap_s:
            break
    result = timing(t0, done, batch, losses.detach().tolist(), device)
    with torch.no_grad():
        for i, (model, ema_model, _) in enumerate(built):
            for name, p in model.named_parameters():
                p.copy_(params[name][i])
            for name, p in ema_model.named_parameters():
                p.copy_(ema[name][i])
    return [(m, e) for m, e, _ in built], objective, result


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
    p.add_argument("--smoke", action="store_true", help="the same code path at toy scale (CPU, under a minute): 2 cells, "
                   f"{SMOKE['steps']} steps of {SMOKE['batch']}, {SMOKE['samples']} samples a set, "
                   f"{SMOKE_PER_CLASS} images a class of each split")
    p.add_argument("--tokens", type=int, default=256, choices=(256, 1024))
    p.add_argument("--steps", type=int, default=None, help="training steps per model (default: 3000 at 256 tokens, "
                   "800 at 1024: SIZING, from the cost model in README.md)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--samples", type=int, default=5000)
    p.add_argument("--sample-steps", type=int, default=None, help="sampler steps (default: 50 at 256 tokens, 25 at 1024)")
    p.add_argument("--cfg-scale", type=float, default=1.5)
    p.add_argument("--train-cap-s", type=float, default=None, help="time cap of one variant's training, its seeds "
                   "together (default: 75 at 256 tokens, 90 at 1024; never past --time-limit-s)")
    p.add_argument("--time-limit-s", type=float, default=480.0, help="no stage starts after this (resume: run again)")
    p.add_argument("--sequential", action="store_true", help="train the seeds one after another (the reference "
                   "the batched run equals; to measure its speed-up)")
    p.add_argument("--compile", action="store_true", help="torch.compile the batched training step")
    p.add_argument("--inception-weights", default=None)
    p.add_argument("--allow-unknown-weights", action="store_true", help="accept an Inception file of unknown sha256 (tests)")
    args = p.parse_args(argv)
    cifar, out = Path(args.cifar).expanduser(), Path(args.out)
    if not (cifar / "train").is_dir() or not (cifar / "test").is_dir():
        raise SystemExit(f"error: {cifar} has no train/ and test/ folders: pass --cifar <folder of train/<class>/, test/<class>/>")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls (the cost model in README.md assumes them)
    for flag, value, least in (("--seeds", args.seeds, 1), ("--steps", args.steps, 1), ("--batch", args.batch, 1),
                               ("--samples", args.samples, 2), ("--sample-steps", args.sample_steps, 1)):
        if value is not None and value < least:
            raise SystemExit(f"error: {flag} {value}: pass {least} or more")
    per_class = SMOKE_PER_CLASS if args.smoke else None
    for name, value in SIZING[args.tokens].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    seeds, variants = list(range(args.seeds)), list(VARIANTS)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
        seeds, variants = [0], ["softmax_mlp", "nala_mlp"]
    cells = [(v, s) for v in variants for s in seeds]
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
        test_u8, _ = load_split(cifar / "test", per_class)
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
    for variant in variants:
        todo = [s for s in seeds if not (out / "cells" / f"{variant}_s{s}.json").is_file()]
        if not todo:
            continue
        if time.time() - t_start > args.time_limit_s:
            print(f"time limit reached before training {variant}: run again to go on", flush=True)
            break
        cap = min(args.train_cap_s, args.time_limit_s - (time.time() - t_start))
        if args.sequential:
            trained, train_s = [], []
            for s in todo:
                models, objective, timing_s = train_cell(variant, s, images, labels, args.steps, args.batch, args.lr,
                                                         args.tokens, device, cap / len(todo))
                trained += models
                train_s.append(timing_s)
        else:
            trained, objective, timing_s = train_variant(variant, todo, images, labels, args.steps, args.batch,
                                                         args.lr, args.tokens, device, cap, args.compile)
            train_s = [timing_s] * len(todo)
        for i, (seed, (_, ema)) in enumerate(zip(todo, trained)):
            if time.time() - t_start > args.time_limit_s:
                print(f"time limit reached before sampling {variant} seed {seed}: run again to go on", flush=True)
                break
            t0 = time.time()
            samples = sample(ema, objective, args.samples, seed, args.sample_steps, args.cfg_scale, device)
            feats = metrics.compute_features(extractor, [samples])
            cell = {"variant": variant, "seed": seed, "batched_seeds": 1 if args.sequential else len(todo),
                    "train": train_s[i], "samples": len(samples), "sample_and_score_s": time.time() - t0,
                    "fid": fid_against(feats["pool"], ref_pool)}
            cell["precision"], cell["recall"] = metrics.precision_recall(ref_pool, feats["pool"])
            if (variant, seed) == cells[0]:  # FID's own noise: a second sample set of the same model
                again = metrics.compute_features(extractor, [sample(ema, objective, args.samples, seed + 10_000,
                                                                    args.sample_steps, args.cfg_scale, device)])
                cell["fid_second_set"] = fid_against(again["pool"], ref_pool)
                cell["fid_between_sets"] = fid_against(again["pool"], feats["pool"])
            write_json(out / "cells" / f"{variant}_s{seed}.json", cell)
            print(json.dumps(cell), flush=True)
    print(json.dumps(summarize(out), indent=2))


if __name__ == "__main__":
    main()
