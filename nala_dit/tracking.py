"""What a training run logs: ``log.jsonl`` and TensorBoard on the main process, the
window of losses between two log steps, and the check that stops a diverged run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .checkpoint import list_checkpoints


def exponent_log(layers) -> dict:
    """The NaLa exponent statistics of the last forward: the first layer's as
    ``nala/exponent_mean`` / ``nala/exponent_std`` / ``nala/saturated`` (as before), and the
    saturated share and mean exponent of every layer as ``nala/layer{i}/...``."""
    values = {}
    for i, layer in enumerate(layers):
        stats = getattr(layer, "last_stats", None)
        if not stats:
            continue
        if not values:
            values.update({f"nala/{k}": v for k, v in stats.items()})
        values[f"nala/layer{i}/exponent_mean"] = stats["exponent_mean"]
        values[f"nala/layer{i}/saturated"] = stats["saturated"]
    return values


class Logger:
    """JSON lines + TensorBoard on the main process, starting after ``step``: records of
    later steps (written by a run that died before its next checkpoint, or by an abandoned
    branch) are dropped, so a resumed run's log holds every step once."""

    def __init__(self, run_dir: Path, enabled: bool, step: int = 0):
        self.enabled = enabled
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            truncate_log(run_dir / "log.jsonl", step)
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=step + 1)
            self.file = open(run_dir / "log.jsonl", "a")

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        for k, v in values.items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            self.writer.close()


def truncate_log(path: Path, step: int) -> None:
    """Keep the JSON lines of steps <= ``step`` (atomic rewrite; a torn last line is dropped)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class LossWindow:
    """The losses of the steps since the last log step. They stay on the device: no host
    sync in the step itself. A non-finite loss is remembered by step and checked (across
    ranks, ``check_finite``) at every log step and before every sample grid and checkpoint,
    so no NaN weights are ever saved."""

    def __init__(self, accelerator, num_terms: int, start_step: int):
        device = accelerator.device
        self.accelerator, self.start_step = accelerator, start_step
        self.loss = torch.zeros((), device=device)
        self.terms = torch.zeros(num_terms, device=device)
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)
        self.steps, self.start = 0, time.perf_counter()

    def add(self, step: int, loss, parts) -> None:
        """Step ``step``'s loss, and its terms as the micro-batches' shares."""
        for part in parts:
            self.terms += part
        self.first_bad = torch.where((self.first_bad < 0) & ~torch.isfinite(loss), step, self.first_bad)
        self.loss += loss
        self.steps += 1

    def check_finite(self, ckpt_dir: Path, progress) -> None:
        """Stop (every rank) with the first non-finite step and the last good checkpoint."""
        bad = self.accelerator.gather(self.first_bad.unsqueeze(0))
        bad = bad[bad >= 0]
        if len(bad):
            progress.close()
            last = list_checkpoints(ckpt_dir)
            if int(bad.min()) == self.start_step + 1:  # no update had run yet: what the run started from is bad
                raise FloatingPointError(
                    f"non-finite loss at step {int(bad.min())}, the first of this run, before any update: the weights "
                    f"it started from (--resume / --init-from), or the data, hold NaN or inf; not the learning rate. "
                    f"Stopping without saving; check those files")
            raise FloatingPointError(
                f"non-finite loss at step {int(bad.min())}; stopping without saving. Last good checkpoint: "
                f"{last[-1] if last else 'none'}. Try a lower --lr, --max-grad-norm 1, or --mixed-precision no."
            )

    def values(self, global_batch_size: int, stat_layers, distilled: bool) -> dict:
        """The log record of the window (gathered over ranks) and the NaLa exponent
        statistics of ``stat_layers``' last forward."""
        per_rank = self.accelerator.gather((self.loss / self.steps).unsqueeze(0)).cpu()
        elapsed = time.perf_counter() - self.start
        values = dict(loss=per_rank.mean().item(), loss_per_rank=per_rank.tolist(),
                      steps_per_sec=self.steps / elapsed,
                      images_per_sec=self.steps * global_batch_size / elapsed)
        values.update(exponent_log(stat_layers))
        if distilled:
            terms = self.accelerator.gather((self.terms / self.steps).unsqueeze(0)).mean(0).tolist()
            values.update(loss_simple=terms[0], loss_distill=terms[1], loss_distill_sigma=terms[2])
        return values

    def reset(self) -> None:
        self.loss.zero_()
        self.terms.zero_()
        self.steps, self.start = 0, time.perf_counter()
