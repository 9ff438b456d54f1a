"""What a training run logs: ``log.jsonl`` and TensorBoard on the main process, the
window of losses between two log steps, and the check that stops a diverged run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
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
    """``log.jsonl`` on the main process, and accelerate's trackers (``--report-to``:
    TensorBoard in ``<run>/tensorboard``, wandb in ``<run>/wandb``) with the resolved config
    as the run's config. Records of steps after ``step`` (written by a run that died before
    its next checkpoint, or by an abandoned branch) are dropped from the file and from
    TensorBoard (``purge_step``), so a resumed run's log holds every step once; a resumed
    wandb run continues the same wandb run (its id is kept in ``<run>/wandb-id``)."""

    def __init__(self, run_dir: Path, accelerator, step: int = 0, report_to: str = "tensorboard",
                 config: dict | None = None):
        self.accelerator = accelerator
        self.enabled = accelerator.is_main_process
        if not self.enabled:
            return
        self.path = run_dir / "log.jsonl"
        truncate_log(self.path, step)
        self.file = open(self.path, "a")
        trackers = make_trackers(report_to, run_dir, step)
        if trackers:
            accelerator.log_with = trackers
            accelerator.init_trackers("nala_dit", config=tracker_config(config or {}))

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        with write_failure(self.path, step):
            self.file.write(json.dumps({"step": step, **values}) + "\n")
            self.file.flush()
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        with write_failure(self.path.parent / "tensorboard", step):   # the trackers' files (or wandb's)
            self.accelerator.log(numbers, step=step)

    def close(self) -> None:
        """The file; the trackers finish with ``accelerator.end_training()``."""
        if self.enabled:
            self.file.close()


@contextlib.contextmanager
def write_failure(path: Path, step: int):
    """A log write that fails (disk full) as one line: what was being written, the system's
    reason without its errno, and the way on (the run's checkpoints are intact; a resume
    drops the log records past the checkpoint it resumes from)."""
    try:
        yield
    except OSError as err:
        reason = err.strerror or (str(err).splitlines()[0] if str(err) else type(err).__name__)
        raise OSError(f"cannot write {path} at step {step}: {reason} (disk full?); the checkpoints already written "
                      f"are intact: free space and rerun with --resume auto") from None


def make_trackers(report_to: str, run_dir: Path, step: int) -> list:
    """accelerate's tracker objects for ``--report-to`` (main process)."""
    from accelerate.tracking import TensorBoardTracker

    trackers = []
    if report_to in ("tensorboard", "all"):
        trackers.append(TensorBoardTracker("tensorboard", str(run_dir), purge_step=step + 1))
    if report_to in ("wandb", "all"):
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ValueError(f"--report-to {report_to} needs wandb: pip install 'nala_dit[wandb]' (or "
                             f"--report-to tensorboard)")
        from accelerate.tracking import WandBTracker

        id_file = run_dir / "wandb-id"
        if not id_file.is_file():
            import uuid

            id_file.write_text(uuid.uuid4().hex[:16] + "\n")
        trackers.append(WandBTracker(os.environ.get("WANDB_PROJECT", "nala_dit"), name=run_dir.name,
                                     dir=str(run_dir), id=read_wandb_id(id_file), resume="allow"))
    return trackers


WANDB_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def read_wandb_id(id_file: Path) -> str:
    """The wandb run id a run (and its resumes) logs to, as this package wrote it (16 hex
    digits; any id of letters, digits, ``-``, ``_`` and ``.``, at most 64, is taken); an
    edited file is one line naming it, not wandb's traceback at the tracker's start."""
    try:
        text = id_file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        text = f"<unreadable: {type(err).__name__}>"
    run_id = text.strip()
    if not WANDB_ID.fullmatch(run_id) or text.rstrip("\n") != run_id:
        raise ValueError(f"{id_file}: holds {text[:40]!r}{'…' if len(text) > 40 else ''}, not a wandb run id (letters, "
                         f"digits, '-', '_', '.', at most 64, on one line): put back the id of this run's wandb run "
                         f"(the end of its URL), or delete the file to log to a new wandb run")
    return run_id


def tracker_config(config: dict) -> dict:
    """The run's config as trackers take it: numbers, strings and booleans (None left out)."""
    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in config.items()
            if v is not None}


def progress_values(values: dict) -> dict:
    """The progress line's part of a log record: loss, images/s, and the held-out loss
    and first FID-type score (with the first 8 hex digits of its network's sha256) when they
    were computed at this step. Under REPA the line's
    ``loss`` is the diffusion loss alone (``loss_simple``) and ``cos`` the alignment's
    cosine (``align_cos``): the combined loss (diffusion − λ·cos, negative once aligned)
    hides both, and stays in ``log.jsonl`` as ``loss``."""
    loss = values["loss_simple"] if "align_cos" in values else values["loss"]
    shown = dict(loss="-" if loss is None else f"{loss:.4f}", img_s=f"{values['images_per_sec']:.1f}")
    if "align_cos" in values:
        shown["cos"] = f"{values['align_cos']:.3f}"
    if "val/loss" in values:
        shown["val"] = f"{values['val/loss']:.4f}"
    fid = next((k for k in values if k.startswith("fid/")), None)
    if fid is not None:
        shown[fid.split("/", 1)[1]] = f"{values[fid]:.3f}"
        if "fid_network_sha256" in values:   # the network that scored it, briefly (log.jsonl: name and sha256)
            shown["net"] = values["fid_network_sha256"][:8]
    return shown


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
    """The steps since the last log step: loss, terms and gradient norm of the updates
    (on the device: no host sync for them), the learning rate of the last one, and the
    count of skipped (non-finite) steps. ``stat_layers``: the NaLa layers whose exponent
    statistics are logged; ``distilled`` / ``aligned``: the terms a teacher / REPA add."""

    def __init__(self, accelerator, global_batch_size: int, stat_layers, distilled: bool, aligned: bool = False):
        device = accelerator.device
        self.accelerator, self.global_batch_size, self.stat_layers = accelerator, global_batch_size, stat_layers
        self.distilled, self.aligned = distilled, aligned
        self.loss = torch.zeros((), device=device)
        self.terms = torch.zeros(1 + (2 if distilled else 0) + (2 if aligned else 0), device=device)
        self.grad_norm = torch.zeros((), device=device)
        self.lr = None
        self.steps, self.skipped, self.start = 0, 0, time.perf_counter()

    def add(self, result) -> None:
        """One ``step.StepResult``."""
        self.lr = result.lr
        if result.skipped:
            self.skipped += 1
            return
        for part in result.parts:
            self.terms += part
        self.loss += result.loss
        self.grad_norm += result.grad_norm
        self.steps += 1

    def values(self) -> dict:
        """The log record of the window (gathered over ranks) and the NaLa exponent
        statistics of ``stat_layers``' last forward; with ``aligned`` (REPA) the diffusion
        loss alone, the alignment loss −cos (unweighted, REPA's ``proj_loss``) and cos."""
        per_rank = self.accelerator.gather((self.loss / max(1, self.steps)).unsqueeze(0)).cpu()
        elapsed = time.perf_counter() - self.start
        done = self.steps + self.skipped
        values = dict(loss=per_rank.mean().item() if self.steps else None,
                      loss_per_rank=per_rank.tolist() if self.steps else None,
                      steps_per_sec=done / elapsed, images_per_sec=done * self.global_batch_size / elapsed,
                      lr=self.lr, grad_norm=(self.grad_norm / self.steps).item() if self.steps else None)
        if self.skipped:
            values["skipped_steps"] = self.skipped
        values.update(exponent_log(self.stat_layers))
        if (self.distilled or self.aligned) and self.steps:
            terms = self.accelerator.gather((self.terms / self.steps).unsqueeze(0)).mean(0).tolist()
            values.update(loss_simple=terms[0])
            if self.distilled:
                values.update(loss_distill=terms[1], loss_distill_sigma=terms[2])
            if self.aligned:
                values.update(loss_align=terms[-2], align_cos=terms[-1])
        return values

    def reset(self) -> None:
        self.loss.zero_()
        self.terms.zero_()
        self.grad_norm.zero_()
        self.steps, self.skipped, self.start = 0, 0, time.perf_counter()


class NanStreak:
    """Skipped steps in a row (``step.shared_verdicts`` skips a non-finite loss). The run stops, on
    every process at the same step, once ``max_steps`` are skipped in a row, or at once
    when no update has run since the run started (then the weights it started from, or
    the data, are to blame: skipping cannot help)."""

    def __init__(self, max_steps: int, start_step: int, ckpt_dir: Path, print=print):
        self.max_steps, self.start_step, self.ckpt_dir, self.print = max_steps, start_step, ckpt_dir, print
        self.first, self.count = None, 0

    def update(self, step: int, result, progress) -> None:
        """After step ``step`` (1-based: the step just taken)."""
        if not result.skipped:
            self.first, self.count = None, 0
            return
        self.first = step if self.first is None else self.first
        self.count += 1
        if self.first == self.start_step + 1:  # no update had run yet: what the run started from is bad
            progress.close()
            raise FloatingPointError(
                f"non-finite loss at step {self.first}, the first of this run, before any update: the weights "
                f"it started from (--resume / --init-from), or the data, hold NaN or inf; not the learning rate. "
                f"Stopping without saving; check those files")
        if self.count >= self.max_steps:
            progress.close()
            last = list_checkpoints(self.ckpt_dir)
            raise FloatingPointError(
                f"non-finite loss at step {step} (lr {result.lr:g}), {self.count} step(s) in a row skipped since step "
                f"{self.first} (--max-nan-steps {self.max_steps}); stopping without saving. Last good checkpoint: "
                f"{last[-1] if last else 'none'}. Try a lower --lr, --max-grad-norm 1, or --mixed-precision no.")
        self.print(f"step {step}: non-finite loss (lr {result.lr:g}), step skipped: no update of the weights, "
                   f"EMA or optimizer ({self.count} in a row; the run stops at --max-nan-steps {self.max_steps})")
