"""A checkpoint's scores: held-out loss (fixed draws), samples scored by the digits classifier,
and the training log's loss and time up to a budget."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from .recipes import BANDS, HELDOUT_REPEATS, KID, TASKS, is_canvas

def train_log(run_dir: Path) -> list[dict]:
    """The log records by step; a resumed run's repeated steps keep the later record."""
    by_step = {}
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def log_summary(records: list[dict], budget: int, window: int) -> tuple[float, float]:
    """(training loss over the last ``window`` steps before ``budget``, summed step time)."""
    time_s, prev = 0.0, 0
    losses, weights = [], []
    for r in records:
        if r["step"] > budget:
            break
        steps = r["step"] - prev
        time_s += steps / r["steps_per_sec"]
        if r["step"] > budget - window:
            losses.append(r["loss"])
            weights.append(steps)
        prev = r["step"]
    loss = sum(l * w for l, w in zip(losses, weights)) / sum(weights) if weights else float("nan")
    return loss, time_s


def heldout_set(task: str):
    from nala_dit.data import datasets as data_lib

    if not is_canvas(task):
        return data_lib.DigitsDataset("heldout", TASKS[task].get("image_size", 8))
    return data_lib.DigitsCanvasDataset("heldout", TASKS[task].get("image_size", 32))


def heldout_loss(model, objective, dataset, seed: int = 1234, items: int | None = None,
                 repeats: int = HELDOUT_REPEATS) -> float:
    """The training objective on the held-out split, same (t, noise) draws for every model."""
    return heldout_losses(model, objective, dataset, seed, items, repeats)["heldout_loss"]


def band_edges(num_timesteps: int, bands: int) -> list[int]:
    """The timestep edges of ``bands`` equal noise bands: [0, 333, 667, 1000] for 3 of 1,000 steps."""
    return [round(k * num_timesteps / bands) for k in range(bands + 1)]


def heldout_losses(model, objective, dataset, seed: int = 1234, items: int | None = None,
                   repeats: int = HELDOUT_REPEATS, bands: int = 0) -> dict:
    """``{"heldout_loss": ...}``: the training objective on the held-out split, the same (t, noise)
    draws for every model (t uniform over the timesteps).

    With ``bands`` B (diffusion): the draws are stratified instead, draw i's t uniform in band
    i mod B of B equal timestep bands (``band_edges``; band 0 the least noise), and the mean loss
    of each band is added as ``BANDS[b]`` (for B = 3), so every band holds a third of the draws."""
    import torch

    if bands and model.config.objective != "diffusion":
        raise ValueError("held-out noise bands are defined on the diffusion objective's timesteps; "
                         f"this model's objective is {model.config.objective!r}: score it with bands=0")
    if bands and bands != len(BANDS):
        raise ValueError(f"bands={bands}: the table has {len(BANDS)} noise bands ({', '.join(BANDS)})")
    x, y = dataset.images[:items], dataset.labels[:items]
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    by_band = [[0.0, 0] for _ in range(bands)]
    with torch.no_grad():
        for _ in range(repeats):
            for start in range(0, len(x), 256):
                xb, yb = x[start:start + 256], y[start:start + 256]
                noise = torch.randn(xb.shape, generator=gen)
                if bands:
                    edges = torch.tensor(band_edges(objective.num_timesteps, bands))
                    band = (torch.arange(start, start + len(xb)) % bands)
                    u = torch.rand(len(xb), generator=gen, dtype=torch.float64)
                    t = edges[band] + (u * (edges[band + 1] - edges[band])).floor().long()
                    loss = objective.training_losses(model, xb, t, yb, noise=noise)["loss"]
                    for b in range(bands):
                        by_band[b][0] += loss[band == b].sum().item()
                        by_band[b][1] += int((band == b).sum())
                elif model.config.objective == "diffusion":
                    t = torch.randint(0, objective.num_timesteps, (len(xb),), generator=gen)
                    loss = objective.training_losses(model, xb, t, yb, noise=noise)["loss"]
                else:
                    t = objective.sample_t(len(xb), xb.device, gen)
                    loss = objective.training_losses(model, xb, yb, t=t, noise=noise)["loss"]
                total += loss.sum().item()
    out = dict(heldout_loss=total / (repeats * len(x)))
    out.update({BANDS[b]: s / n for b, (s, n) in enumerate(by_band)})
    return out


def classifier_view(task: str, images):
    """uint8 NHWC samples → what the digits classifier scores (canvas: the digit's crop)."""
    if is_canvas(task):
        from nala_dit.data.digits import canvas_crop

        return canvas_crop(images)
    return images


def reference(task: str, work: Path, classifier_dir: Path) -> Path:
    """Digits-classifier statistics of the held-out split (built once per output folder)."""
    from nala_dit.evaluation import metrics
    from nala_dit.data.datasets import to_uint8

    path = work / f"ref_{task}_heldout.npz"
    if path.is_file():
        return path
    images = classifier_view(task, to_uint8(heldout_set(task).images).numpy())
    from nala_dit.evaluation.features import build_extractor

    extractor = build_extractor("digits", digits_classifier_dir=classifier_dir)
    feats = metrics.compute_features(extractor, [images[i:i + 250] for i in range(0, len(images), 250)])
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    metrics.save_reference(tmp, metrics.reference_statistics(feats, extractor.describe()))
    os.replace(tmp, path)
    return path


def evaluate_checkpoint(task: str, ckpt: Path, recipe: dict, ref: Path, classifier_dir: Path,
                        sample: bool = True) -> dict:
    """Held-out loss of the EMA weights (with the recipe's ``heldout_bands``, also per noise
    band) and of the raw weights (an EMA of 0.99 lags about 100 steps, a third of a 300-step
    budget), and with ``sample`` class-consistency and Fréchet distance of the EMA weights (NaN
    without), and KID where the recipe asks (``kid``)."""
    import numpy as np

    from nala_dit.evaluation import metrics
    from nala_dit.diffusion.generate import SampleSettings
    from nala_dit.pipelines.sample_files import sample_images
    from nala_dit.pipelines.sources import load_source

    source = load_source(ckpt)
    source.model.eval()
    held = dict(items=recipe.get("heldout_items"), repeats=recipe.get("heldout_repeats", HELDOUT_REPEATS),
                bands=recipe.get("heldout_bands", 0))
    losses = heldout_losses(source.model, source.objective, heldout_set(task), **held)   # overall (+ bands)
    raw = load_source(ckpt, weights="model").model.eval()
    loss_raw = heldout_losses(raw, source.objective, heldout_set(task), **held)["heldout_loss"]
    if not sample:
        return dict(class_consistency=math.nan, frechet_distance=math.nan, **losses,
                    heldout_loss_raw=loss_raw, num_samples=0)
    labels = [c for _ in range(recipe["per_class"]) for c in range(source.num_classes)]
    settings = SampleSettings(sampler=recipe["sampler"], num_steps=recipe["sample_steps"], cfg_scale=recipe["cfg"])
    start = time.perf_counter()
    images, nfe = sample_images(source, labels, seed=1, settings=settings, batch_size=recipe["sample_batch"])
    sample_time = time.perf_counter() - start
    view = classifier_view(task, images.numpy())
    result = metrics.evaluate_samples([view], ref, features="digits", digits_classifier_dir=classifier_dir,
                                      labels=np.asarray(labels), with_kid=bool(recipe.get("kid")))
    kid = {KID: result["metrics"]["kid_digits"]} if recipe.get("kid") else {}
    return dict(class_consistency=result["metrics"]["class_consistency"],
                frechet_distance=result["metrics"]["fd_digits"], **kid, **losses, heldout_loss_raw=loss_raw,
                num_samples=len(labels), nfe=nfe, sample_time_s=round(sample_time, 2))
