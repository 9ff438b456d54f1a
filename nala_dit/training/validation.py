"""What a training run evaluates while it runs: EMA sample grids (``--sample-every``), the
held-out loss on fixed draws (``--val-every``) and FID-type scores of EMA samples
(``--fid-every``, the repo's own metrics: ``metrics.evaluate_samples``).

None of them touches the training's random streams: their draws come from their own
generators, seeded by item or sample index, inside ``own_rng`` (the global RNG state is
put back afterwards), so a run with validation trains bit for bit as one without.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Callable

import torch

from ..data import datasets as data_lib
from ..data.sources import data_source
from ..diffusion.registry import TRAINING_SAMPLERS
from ..diffusion.generate import SampleSettings, decode, generate, index_seed, sample_batch
from .config import TrainConfig
from ..data.images import balanced_labels, save_grid

# The held-out draws (t and noise per item) are the same for every run and seed, so the
# held-out losses of two runs (other seeds, other t-sampling) are scored on one set of draws.
VAL_SEED = 0
VAL_STREAM = 3        # (t, noise) of an item; generate.py uses streams 0-2 for sample noise
VAL_DATA_STREAM = 4   # the item's own draws into model space (a VAE or cached-latent sample)
# Noise bands of the held-out loss, by noise fraction u (0 = data, 1 = pure noise): DiT's
# u = index / T, SiT's u = 1 − t.
NOISE_BANDS = (("low", 0.0, 1 / 3), ("mid", 1 / 3, 2 / 3), ("high", 2 / 3, float("inf")))


def training_sampler(cfg: TrainConfig, model) -> str:
    """What the grids and FID during training sample with: ``--sample-sampler``, else DDIM (DiT) /
    Heun (SiT): a check during training, where 250 DDPM steps would dominate the step time."""
    if cfg.sample_sampler is None and getattr(model.config, "mean_flow", False):
        return "meanflow"   # a MeanFlow model: --sample-steps steps of its average velocity (1 = one-step)
    return cfg.sample_sampler or TRAINING_SAMPLERS[model.config.objective]


@contextlib.contextmanager
def own_rng(device: torch.device):
    """Evaluation draws that leave the global RNG (CPU and this CUDA device) as it was."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


class SampleGrid:
    """The EMA's sample grid of a step (``--sample-every``), ``<folder>/<step>.png``: 16
    fixed noises (seeded by ``--seed``) and labels 0, 1, ..., so a run's grids compare."""

    def __init__(self, ema, objective, cfg: TrainConfig, space, folder: Path, device, write: bool = True):
        """``space``: the run's ``run.Space`` (the VAE, the latent norm, the model input's size)."""
        self.ema, self.objective, self.cfg, self.vae, self.norm = ema, objective, cfg, space.vae, space.norm
        self.folder, self.write = folder, write   # FSDP: every process samples (the EMA is sharded), one writes
        shape = (16, space.channels, space.side, space.side)
        self.noise = torch.randn(shape, generator=torch.Generator().manual_seed(cfg.seed)).to(device)
        num_classes = space.dataset.num_classes
        self.labels = (torch.arange(16) % num_classes).to(device)
        self.nrow = min(num_classes, 8)

    def __call__(self, step: int) -> None:
        """The grid of step ``step``: the fixed noise and labels through the training sampler
        (``training_sampler``, ``--sample-steps``, ``--sample-cfg-scale``), decoded with the run's
        latent norm undone, written by one process."""
        model, cfg = self.ema, self.cfg
        was_training = model.training
        model.eval()
        gen = torch.Generator(self.noise.device).manual_seed(cfg.seed)
        out = generate(model, self.objective, self.noise, self.labels, sampler=training_sampler(cfg, model),
                       num_steps=cfg.sample_steps, cfg_scale=cfg.sample_cfg_scale, generator=gen)
        if self.write:
            save_grid(data_lib.to_uint8(decode(out.samples, self.vae, self.norm)), self.folder / f"{step:07d}.png",
                      nrow=self.nrow)
        model.train(was_training)


@dataclasses.dataclass
class Periodic:
    """An evaluation logged every ``every`` steps (a log step then): ``evaluate()`` → its
    log values, on every process."""
    every: int
    evaluate: Callable[[], dict]

    def due(self, step: int) -> bool:
        return step % self.every == 0


def band_losses(noise_fraction: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """Per-band [sum, count] of ``losses`` (shape (len(NOISE_BANDS), 2)); a sample with
    noise fraction u is in the band lo <= u < hi."""
    out = torch.zeros(len(NOISE_BANDS), 2, dtype=torch.float64)
    for i, (_, lo, hi) in enumerate(NOISE_BANDS):
        inside = (noise_fraction >= lo) & (noise_fraction < hi)
        out[i] = torch.stack([losses[inside].double().sum(), inside.sum().double()])
    return out


def band_means(sums: torch.Tensor, prefix: str) -> dict:
    """``{prefix: overall mean, prefix_noise_low/mid/high: band means}`` of ``band_losses``
    totals (a band without samples is left out)."""
    values = {prefix: float(sums[:, 0].sum() / sums[:, 1].sum())}
    for (name, _, _), (total, count) in zip(NOISE_BANDS, sums.tolist()):
        if count:
            values[f"{prefix}_noise_{name}"] = total / count
    return values


def heldout_dataset(cfg: TrainConfig, train_dataset):
    """The held-out split ``--val-every`` scores: ``--val-data`` (a folder like ``--data``; for
    sharded ``--data``, also one of its splits or a count, ``DataSource.splits``), else the
    embedded data's own held-out split (``data/sources.py``: ``DataSource.heldout``), at the
    training set's image size."""
    source = data_source(cfg.data)
    if source.splits and cfg.val_data is not None and not Path(cfg.val_data).exists():
        return source.open(cfg.data, cfg, "heldout", size=train_dataset.image_size)   # a split name or a count
    if cfg.val_data is not None:
        heldout = data_source(cfg.val_data).open(cfg.val_data, cfg, "heldout", size=train_dataset.image_size)
        if heldout.is_latent != train_dataset.is_latent:
            kinds = ("a latent folder", "images") if heldout.is_latent else ("an image folder", "latents")
            raise ValueError(f"--val-data {cfg.val_data} is {kinds[0]} but --data {cfg.data} holds {kinds[1]}: "
                             f"pass held-out data of the kind the model trains on")
        return heldout
    if source.heldout:
        return source.open(cfg.data, cfg, "heldout", size=train_dataset.image_size)
    also = (", or one of its splits (validation) or a count of training items to hold out (1000)"
            if source.splits else "")
    raise ValueError(f"--val-every scores a held-out split: {cfg.data} is a folder, so pass --val-data with a "
                     f"held-out folder of the same kind{also}")


def val_samples_notice(cfg: TrainConfig, heldout) -> str | None:
    """The one line a run prints when ``--val-samples`` asks for more items than the held-out
    split holds (every item is scored then, ``HeldOutLoss``), naming both numbers; else None."""
    if cfg.val_samples <= len(heldout):
        return None
    split = cfg.val_data if cfg.val_data is not None else f"{cfg.data}'s held-out split"
    return (f"validation: --val-samples {cfg.val_samples} is more than the {len(heldout)} held-out items of {split}: "
            f"scoring all {len(heldout)} (pass --val-samples {len(heldout)} or less to say so)")


class HeldOutLoss:
    """The training loss on ``--val-samples`` held-out items (spread evenly over the split),
    each with its own (t, noise) drawn from ``index_seed(VAL_SEED, item, VAL_STREAM)``: t uniform (DiT's
    index, SiT's time in its training interval), whatever ``--t-sampling`` trains with, so
    the same draws at every evaluation, on resume, in every run. Each data-parallel rank
    scores every world-th of them; ``__call__`` returns the overall and
    per-noise-band means (``NOISE_BANDS``) on every process."""

    def __init__(self, dataset, objective, to_model, where, count: int, batch_size: int, context_parallel: int = 1):
        """``where``: the run's ``run.Placement`` (data rank and size, device; FSDP: lockstep)."""
        rank, world, lockstep = where.rank, where.world, where.sharding is not None
        self.objective, self.batch_size, self.duplicates = objective, batch_size, context_parallel
        self.dataset, self.to_model, self.device = dataset, to_model, (device := where.device)
        # ``count`` items spread evenly over the split (a folder is sorted by class), each rank its share
        total = min(count, len(dataset))
        self.items = [k * len(dataset) // total for k in range(rank, total, world)]
        draws = [self._draw(i) for i in self.items]
        self.x = torch.stack([d[0] for d in draws]) if draws else None   # None: fewer items than ranks
        self.y = torch.tensor([d[1] for d in draws], dtype=torch.long, device=device)
        self.t = torch.stack([d[2] for d in draws]).to(device) if draws else torch.zeros(0, device=device)
        self.noise = torch.stack([d[3] for d in draws]).to(device) if draws else None
        if hasattr(objective, "num_timesteps"):
            self.noise_fraction = self.t.double().cpu() / objective.num_timesteps
        else:
            self.noise_fraction = 1 - self.t.double().cpu()
        # FSDP (``lockstep``): each model call gathers the sharded weights, so every process makes
        # as many calls as the busiest one; a process with fewer batches scores item 0 again, unused.
        busiest = math.ceil(total / world)
        self.padding = math.ceil(busiest / batch_size) - math.ceil(len(self.items) / batch_size) if lockstep else 0
        self.pad = [torch.as_tensor(d).unsqueeze(0).to(device) for d in self._draw(0)] if self.padding else None

    def _draw(self, i: int) -> tuple:
        """Item ``i`` in model space with its own (t, noise): (x, y, t, noise)."""
        with own_rng(self.device):
            x, y = self.dataset[i]
            torch.manual_seed(index_seed(VAL_SEED, i, VAL_DATA_STREAM))
            x = self.to_model(torch.as_tensor(x).unsqueeze(0).to(self.device))[0]
            gen = torch.Generator().manual_seed(index_seed(VAL_SEED, i, VAL_STREAM))
            if hasattr(self.objective, "num_timesteps"):  # DiT: an index
                t = torch.randint(0, self.objective.num_timesteps, (1,), generator=gen)[0]
            else:
                t0, t1 = self.objective.interval(train=True)
                t = torch.rand((), generator=gen) * (t1 - t0) + t0
            return x, int(y), t, torch.randn(x.shape, generator=gen)

    def _losses(self, model, accelerator, x, y, t, noise) -> torch.Tensor:
        with accelerator.autocast():
            if hasattr(self.objective, "num_timesteps"):
                out = self.objective.training_losses(model, x, t, y, noise=noise)
            else:
                out = self.objective.training_losses(model, x, y, t=t, noise=noise)
        return out["loss"].float().cpu()

    @torch.no_grad()
    def __call__(self, model, accelerator, prefix: str = "val/loss") -> dict:
        was_training = model.training
        model.eval()
        losses = []
        with own_rng(accelerator.device):
            for s in range(0, len(self.items), self.batch_size):
                b = slice(s, s + self.batch_size)
                losses.append(self._losses(model, accelerator, self.x[b], self.y[b], self.t[b], self.noise[b]))
            for _ in range(self.padding):   # FSDP: the calls the busiest process makes, results unused
                self._losses(model, accelerator, *self.pad)
        model.train(was_training)
        local = band_losses(self.noise_fraction, torch.cat(losses) if losses else torch.zeros(0))
        # Processes of one context-parallel group score the same items: count them once.
        sums = accelerator.gather(local.to(accelerator.device).unsqueeze(0)).cpu().sum(0) / self.duplicates
        return band_means(sums, prefix)


class TrainingFID:
    """FID-type scores of ``--fid-samples`` EMA samples against ``--fid-ref``: labels
    balanced and shuffled with ``--seed`` (as ``sample.py``), noise seeded by sample index
    (``sample_batch``), the grid's sampler settings (``training_sampler``, ``--sample-steps``,
    ``--sample-cfg-scale``); process p generates samples p, p + P, ... (the first process
    shows a progress bar of its share); the first process scores them with
    ``metrics.evaluate_samples`` (Inception or the digits classifier, as the reference records)
    and returns the scores with the network that scored them (``fid_network``: name and
    sha256 of its weights file; the others {}).
    ``lockstep`` (FSDP): every process runs as many sampler batches as the busiest one."""

    def __init__(self, cfg: TrainConfig, num_classes: int, batch_size: int, lockstep: bool = False):
        # a missing or unreadable reference, and Inception weights that are absent or no known copy of the
        # network, are refused before training, not at the first --fid-every step
        reference = fid_reference(cfg)
        self.cfg, self.batch_size, self.lockstep = cfg, batch_size, lockstep
        self.labels = balanced_labels(cfg.fid_samples, num_classes, cfg.seed)
        if (cfg.fid_features or ("digits" if reference.get("extractor") == "digits-classifier" else "inception")) \
                == "inception":
            from ..evaluation.features import check_known_weights, file_sha256, find_inception_weights

            found = find_inception_weights(cfg.inception_weights)
            check_known_weights(found.path, file_sha256(found.path), cfg.allow_unknown_inception_weights)

    def settings(self, ema) -> SampleSettings:
        """The grid's sampler settings (``SampleGrid``): what the docs and the model card say."""
        return SampleSettings(training_sampler(self.cfg, ema), self.cfg.sample_steps, self.cfg.sample_cfg_scale)

    @torch.no_grad()
    def __call__(self, ema, objective, vae, scaling, accelerator) -> dict:
        from ..progress import progress_bar
        from ..evaluation.metrics import evaluate_samples

        p, world, n = accelerator.process_index, accelerator.num_processes, len(self.labels)
        mine = list(range(p, n, world))
        per_process = -(-n // world)
        settings = self.settings(ema)
        was_training = ema.training
        ema.eval()
        images = []
        desc = f"FID: {n} EMA samples" + (f" (this process: {len(mine)})" if world > 1 else "")
        with own_rng(accelerator.device), progress_bar(total=len(mine), unit="img", desc=desc,
                                                       disable=not accelerator.is_main_process) as bar:
            for s in range(0, len(mine), self.batch_size):
                idx = mine[s:s + self.batch_size]
                out, _ = sample_batch(ema, objective, self.labels[idx], idx, self.cfg.seed, settings, vae, scaling)
                images.append(data_lib.to_uint8(out))  # (B, H, W, C)
                bar.update(len(idx))
            if self.lockstep:   # FSDP: as many sampler runs as the busiest process (see HeldOutLoss), unused
                for _ in range(math.ceil(per_process / self.batch_size) - math.ceil(len(mine) / self.batch_size)):
                    sample_batch(ema, objective, self.labels[:1], [0], self.cfg.seed, settings, vae, scaling)
        ema.train(was_training)
        shape = images[0].shape[1:] if images else self._image_shape(ema, vae)
        local = torch.cat(images) if images else torch.zeros((0, *shape), dtype=torch.uint8)
        if len(local) < per_process:  # equal shapes for the gather
            local = torch.cat([local, torch.zeros((per_process - len(local), *shape), dtype=torch.uint8)])
        gathered = accelerator.gather(local.to(accelerator.device).unsqueeze(0)).cpu()  # (P, per, H, W, C)
        if not accelerator.is_main_process:
            return {}
        order = gathered.transpose(0, 1).reshape(-1, *gathered.shape[2:])[:n]  # sample j·P + p at row j·P + p
        result = evaluate_samples([order.numpy()], self.cfg.fid_ref, self.cfg.fid_features,
                                  device=str(accelerator.device), inception_weights=self.cfg.inception_weights,
                                  digits_classifier_dir=self.cfg.digits_classifier, labels=self.labels.numpy(),
                                  allow_unknown_weights=self.cfg.allow_unknown_inception_weights)
        return {**{f"fid/{k}": float(v) for k, v in result["metrics"].items()}, **fid_network(result),
                **fid_counts(result)}

    @staticmethod
    def _image_shape(ema, vae) -> tuple[int, int, int]:
        from ..models.grid import vae_factor

        side = ema.config.input_size * vae_factor(vae)
        return side, side, (ema.config.in_channels if vae is None else 3)


def fid_reference(cfg: TrainConfig) -> dict:
    """``--fid-ref`` loaded, or one line that says how to make it or to train without FID."""
    from ..evaluation.metrics import load_reference

    fix = (f"make it with `evaluate_fid.py ref --data <held-out image folder> --out {cfg.fid_ref}` (for the embedded "
           f"digits: `evaluate_fid.py ref --dataset digits-heldout --features digits --out {cfg.fid_ref}`), or pass "
           f"--fid-every 0 to train without FID")
    if not Path(cfg.fid_ref).is_file():
        raise FileNotFoundError(f"--fid-ref {cfg.fid_ref} not found: {fix}")
    try:
        return load_reference(cfg.fid_ref)
    except ValueError as err:
        raise ValueError(f"--fid-ref {err}") from None


def fid_counts(result: dict) -> dict:
    """What a score compared, for ``log.jsonl`` beside the ``fid/`` scores: ``fid_samples`` (the
    generated samples scored) and ``fid_ref_images`` (the reference's images; with
    ``fid_ref_subset`` where it was made from part of its data, ``evaluate_fid.py ref --limit``)."""
    counts = {"fid_samples": int(result["num_samples"])}
    if isinstance(result.get("reference_num_images"), int):
        counts["fid_ref_images"] = result["reference_num_images"]
    subset = (result.get("reference_provenance") or {}).get("data_subset")
    if isinstance(subset, str) and not subset.startswith("all "):
        counts["fid_ref_subset"] = subset
    return counts


def fid_network(result: dict) -> dict:
    """The network that scored a result, for ``log.jsonl`` beside the ``fid/`` scores:
    ``fid_network`` (its name; the digits classifier by its file) and ``fid_network_sha256``
    (its weights file's sha256, as ``evaluate_fid.py``'s JSON and the reference .npz record it)."""
    from ..evaluation.features import file_sha256

    sha = result.get("weights_sha256") or file_sha256(Path(result["weights_file"]))
    name = result.get("weights_name") or f"{result['extractor']} ({Path(result['weights_file']).name})"
    if result.get("weights_check"):
        name += f"; {result['weights_check']}"
    return {"fid_network": name, "fid_network_sha256": sha}
