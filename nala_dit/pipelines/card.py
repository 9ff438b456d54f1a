"""The model card (``README.md``) of every exported folder, through huggingface_hub's
``ModelCard`` / ``ModelCardData``: YAML metadata the Hub reads, and a body built only from
what the weights and their training run recorded.

* ``run_record``: a checkpoint's run, read from its files: the training config and model
  config in the checkpoint, the latent statistics, ``log.jsonl`` (the last training loss,
  held-out loss and FID-type scores at or before the exported step), ``evaluate_fid.py
  --json`` results saved in the run folder and the last EMA sample grid (``samples/``).
* ``save_card``: ``README.md`` (and the grid, copied as ``sample_grid.png``) into a folder
  being exported; a README.md already there is left alone.

Nothing in a card is invented: a figure the run did not measure (no ``--val-every``, no
``--fid-every``, no evaluation JSON, no grid) is absent, not estimated. The license is left
for the user to set.

Metadata. No ``pipeline_tag``, as the Hub's own class-conditional DiT cards
(``facebook/DiT-XL-2-256``: library diffusers, no task): the Hub has no class-conditional task;
``text-to-image`` would offer a free-text prompt to a model that knows only its class names, and
``unconditional-image-generation`` would say there is no input. The conditioning is in the tags:
``class-conditional``, ``dit`` / ``sit``, ``linear-attention`` for the
NaLa / ReLU / ELU kernels. ``base_model`` only when the run started from another model
(``--init-from``) named by a Hub id; a local path is named in the body instead (the Hub
refuses a ``base_model`` that is not a model id).
"""

from __future__ import annotations

import html
import json
import os
import re
import shlex
import shutil
from pathlib import Path

from ..diffusion.registry import TRAINING_SAMPLERS

CARD_FILE = "README.md"
GRID_FILE = "sample_grid.png"
PIPELINE_TAG = None   # see the module doc: no Hub task fits a class-conditional model
LIBRARY = "diffusers"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What the body's "Use it" lines sample: the first classes, this many images each.
EXAMPLE_CLASSES, EXAMPLE_PER_CLASS = 4, 4


# ----------------------------------------------------------------- what the run recorded
def run_record(checkpoint: str | os.PathLike | None) -> dict | None:
    """Everything the card may say about training, from the files of ``checkpoint`` (a
    checkpoint folder) and its run folder; None when the checkpoint is not there (moved,
    or official weights)."""
    from ..checkpoints.read import open_checkpoint

    if not checkpoint or not Path(checkpoint).is_dir():
        return None
    from ..checkpoints.read import checkpoint_norm

    try:
        ckpt = open_checkpoint(checkpoint)
        config, step, norm = dict(ckpt.config), int(ckpt.step), checkpoint_norm(ckpt)
    except (ValueError, OSError, KeyError, TypeError):
        return None   # not a readable checkpoint any more: the card says only what the weights say
    path = Path(checkpoint).resolve()
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
    record = dict(checkpoint=str(checkpoint), step=step, config=config, latent_norm=norm,
                  run_dir=str(run_dir) if run_dir else None, log={}, evaluations=[], grid=None)
    if run_dir is None:
        return record
    record["log"] = _last_logged(run_dir / "log.jsonl", step)
    record["evaluations"] = _evaluations(run_dir)
    grids = sorted(p for p in (run_dir / "samples").glob("*.png") if p.stem.isdigit() and int(p.stem) <= step)
    record["grid"] = str(grids[-1]) if grids else None
    return record


def _last_logged(log: Path, step: int) -> dict:
    """From ``log.jsonl``, at or before ``step``: the last line's training loss, the last
    held-out losses (``val/``) and the last FID-type scores (``fid/``), each with its step."""
    found = {}
    if not log.is_file():
        return found
    for line in log.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a killed run
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] > step:
            continue
        if _number(row.get("loss")):
            found["loss"] = dict(step=row["step"], loss=row["loss"])
        for prefix in ("val", "fid"):
            values = {k: v for k, v in row.items() if k.startswith(prefix + "/") and _number(v)}
            if values:
                found[prefix] = dict(step=row["step"], values=values)
                if prefix == "fid" and isinstance(row.get("fid_network"), str):   # the network that scored it
                    found[prefix]["network"] = (row["fid_network"], str(row.get("fid_network_sha256", "")))
                if prefix == "fid":   # what it compared (validation.fid_counts); older logs lack them
                    found[prefix].update({k: row[k] for k in ("fid_samples", "fid_ref_images", "fid_ref_subset")
                                          if k in row and not isinstance(row[k], bool)
                                          and isinstance(row[k], (int, str))})
    return found


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _evaluations(run_dir: Path) -> list[dict]:
    """``evaluate_fid.py --json`` results saved in the run folder (a ``metrics`` object)."""
    found = []
    for path in sorted(run_dir.glob("*.json")) + sorted(run_dir.glob("eval*/*.json")):
        try:
            data = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
        if isinstance(data, dict) and isinstance(data.get("metrics"), dict):
            found.append(dict(data, file=str(path.relative_to(run_dir))))
    return found


# ----------------------------------------------------------------- the card
def card_data(model, record: dict | None, source: dict):
    """The YAML metadata (``ModelCardData``)."""
    from huggingface_hub import ModelCardData

    from ..attention.config import LINEAR_KERNELS

    cfg = dict(model.config)
    tags = ["class-conditional", "dit" if cfg["objective"] == "diffusion" else "sit"]
    if cfg.get("attention") in LINEAR_KERNELS:
        tags.append("linear-attention")
    if cfg.get("attention") == "nala":
        tags.append("nala")
    tags.append("nala_dit")
    config = (record or {}).get("config") or {}
    base = config.get("init-from")
    base_model = base if isinstance(base, str) and HUB_ID.match(base) and not Path(base).exists() else None
    data = config.get("data")
    return ModelCardData(library_name=LIBRARY, pipeline_tag=PIPELINE_TAG, tags=tags, base_model=base_model,
                         datasets=[dataset_name(data)] if data else None)


def dataset_name(data: str) -> str:
    """The name of the training data: the embedded sets by name, a folder by its name (its
    parent's too when it is a split such as ``train``)."""
    path = Path(data)
    if len(path.parts) <= 1 and not path.exists():
        return data
    name = path.resolve().name if path.exists() else path.name
    if name.lower() in ("train", "training", "images", "latents") and path.resolve().parent.name:
        return f"{path.resolve().parent.name}/{name}"
    return name


def build_card(model, folder: str, source: dict, kind: str, id2label: dict[int, str], record: dict | None,
               grid: bool, vae: str | None = None, sampler: tuple[str, int] | None = None,
               objective_config: dict | None = None):
    """The ``ModelCard`` of an exported folder. ``folder``: the path its commands name;
    ``kind``: the pipeline class name, or ``"model"`` for a transformer folder; ``grid``:
    whether ``sample_grid.png`` is saved beside it; ``sampler``: (name, steps) its
    pipeline defaults to; ``objective_config``: the β schedule / transport settings."""
    from huggingface_hub import ModelCard

    data = card_data(model, record, source)
    body = _body(model, folder, source, kind, id2label, record, grid, vae, sampler, data, objective_config or {})
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def _text(value) -> str:
    """A user-supplied string (a path, a name, a value from a config or JSON file) as plain
    markdown text: HTML's ``<``, ``>`` and ``&`` escaped, backticks, brackets, asterisks and
    backslashes escaped (no code span, link, image or emphasis can start in it), line breaks
    turned into spaces (no heading, list or table row can start)."""
    text = html.escape(" ".join(str(value).splitlines()), quote=False)
    return re.sub(r"([\\`*\[\]])", r"\\\1", text)


def _code(value) -> str:
    """A user-supplied string as inline code: delimited by one backtick more than its longest
    run of backticks (so none of them closes the span; CommonMark), line breaks turned into
    spaces. Inside a code span HTML and markdown are shown as typed."""
    text = " ".join(str(value).splitlines())
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _fenced(code: str, language: str) -> list[str]:
    """A code block whose fence is longer than any run of backticks in ``code`` (a line of
    backticks inside cannot close it)."""
    fence = "`" * max(3, max((len(run) for run in re.findall("`+", code)), default=0) + 1)
    return [fence + language, code, fence]


def _escaped(config: dict) -> dict:
    """A run's config (read from its checkpoint: any value may have been edited) with every
    value that is not a number, a bool or None as ``_text``."""
    return {k: v if v is None or isinstance(v, (bool, int, float)) else _text(v) for k, v in config.items()}


def _fmt(value) -> str:
    """A table cell: markdown already escaped where it holds user text (``_text``, ``_code``);
    here only what breaks a row, ``|`` and line breaks."""
    if isinstance(value, str):
        return " ".join(value.splitlines()).replace("|", "\\|")
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(rows: list[tuple[str, object]]) -> list[str]:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows if v is not None]
    return lines


def _rope(cfg: dict) -> str:
    """RoPE with its angle layout (a config saved before ``rope_layout`` existed used 'halves')."""
    layout = cfg.get("rope_layout") or "halves"
    return "RoPE in the NaLa authors' released layout" if layout == "released" else f"RoPE in the {layout} layout"


def _attention(cfg: dict) -> str:
    kind = cfg.get("attention")
    if kind == "nala":
        opts = [f"direction {cfg.get('direction')}", f"λ = {cfg.get('power')}", f"τ = {cfg.get('offset')}",
                f"s = {cfg.get('norm_scale')}", f"α = {cfg.get('alpha')}"]
        opts += [name for name, key in (("LePE", "lepe"), ("output gate", "gate"), ("output norm", "out_norm"),
                                        (_rope(cfg), "rope")) if cfg.get(key)]
        if (cfg.get("nala_regions") or 1) > 1:
            opts.append(f"{cfg['nala_regions']}×{cfg['nala_regions']} region states")
        text = f"nala ({', '.join(opts)})"
    elif kind in ("relu", "elu"):
        opts = [name for name, key in (("LePE", "lepe"), ("output gate", "gate"), ("output norm", "out_norm"),
                                       (_rope(cfg), "rope")) if cfg.get(key)]
        text = f"{kind} linear attention" + (f" ({', '.join(opts)})" if opts else "")
    else:
        text = str(kind)
    if cfg.get("softmax_blocks"):
        text += f"; softmax in blocks {cfg['softmax_blocks']}"
    return text


def _objective(cfg: dict, objective_config: dict) -> str:
    from ..checkpoints.read import build_objective

    obj = build_objective(cfg, objective_config)
    if cfg["objective"] == "diffusion":
        return (f"diffusion (ε-prediction{', learned variance' if cfg.get('learn_sigma') else ''}), "
                f"{objective_config.get('noise-schedule', 'linear')} β schedule, {obj.num_timesteps} steps")
    return f"transport (SiT): {obj.path.kind} path, {obj.prediction} prediction"


def _body(model, folder, source, kind, id2label, record, grid, vae, sampler, data, objective_config) -> str:
    cfg = dict(model.config)
    config = (record or {}).get("config") or {}
    params = sum(p.numel() for p in model.parameters())
    name = source.get("model") or config.get("model") or "model"
    side = cfg["input_size"]
    space = f"latents {side}×{side} of the VAE {_code(vae)}" if vae else f"{side}×{side} px (pixel space)"
    where = source.get("checkpoint")
    step = source.get("step")
    weights = source.get("weights")
    if weights == "official":
        origin = f"the published weights {_code(Path(where).name)}" if where else "published weights"
    elif where:
        origin = _code(where) + (f" (step {_fmt(step)}, {_text(weights)} weights)" if step is not None else "")
    else:
        origin = "a model built in Python"
    what = {"NaLaDiTPipeline": "a `NaLaDiTPipeline` (diffusers) folder",
            "NaLaSiTPipeline": "a `NaLaSiTPipeline` (diffusers) folder",
            "model": "the transformer alone (`nala_dit.models.dit.DiT.from_pretrained`)"}[kind]
    lines = [f"# {_text(name)}", "",
             f"A class-conditional diffusion transformer, {params:,} parameters, saved by `nala_dit` "
             f"(`export.py`, `save_pretrained`) from {origin} as {what}.", "",
             "**License: not set.** Add a `license:` field to the metadata above (the terms of the data and of "
             "any weights this model started from apply) before publishing.", ""]
    if data.base_model:
        lines += [f"Started from {_code(data.base_model)} (`--init-from`, {_text(config.get('inherit'))}).", ""]
    elif config.get("init-from"):
        lines += [f"Started from {_code(config['init-from'])} (`--init-from`, inherit {_text(config.get('inherit'))}): a local "
                  f"path; set `base_model:` to its Hub id if it has one.", ""]

    lines += ["## Model", ""]
    lines += _table([("preset", _text(name)), ("parameters", params), ("attention", _attention(cfg)),
                     ("MLP", cfg.get("mlp") if cfg.get("mlp") not in (None, "mlp") else None),
                     ("positions", cfg.get("positions", cfg.get("pos_embed"))),
                     ("objective", _objective(cfg, objective_config)), ("input", space),
                     ("patch / depth / width / heads", f"{cfg['patch_size']} / {cfg['depth']} / {cfg['hidden_size']}"
                                                       f" / {cfg['num_heads']}"),
                     ("classes", f"{cfg['num_classes']}" + (" (+ a null class for guidance)"
                                                             if (cfg.get('class_dropout_prob') or 0) > 0 else
                                                             " (no null class: no guidance)"))])
    lines.append("")
    if record is not None:
        lines += _training(record, cfg, objective_config)
    if grid:
        lines += _samples(record, cfg)
    lines += _use(folder, kind, id2label, sampler, vae)
    return "\n".join(lines) + "\n"


def _samples(record: dict, cfg: dict) -> list[str]:
    """The run's last EMA grid (``SampleGrid``: 16 samples, class i mod N, DDIM / Heun
    unless --sample-sampler)."""
    c = _escaped(record["config"])
    sampler = c.get("sample-sampler") or TRAINING_SAMPLERS[cfg["objective"]]
    step = int(Path(record["grid"]).stem)
    return ["## Samples", "", f"![EMA samples at step {step:,}]({GRID_FILE})", "",
            f"The run's own grid ({_code('samples/' + Path(record['grid']).name)}, copied here as `{GRID_FILE}`): 16 EMA "
            f"samples at step {step:,}, sample i of class i mod {cfg['num_classes']}, {sampler} "
            f"{c.get('sample-steps')} steps, guidance {c.get('sample-cfg-scale')}.", ""]


def _training(record: dict, cfg: dict, objective_config: dict) -> list[str]:
    raw = record["config"]
    c = _escaped(raw)
    t = c.get("t-sampling")
    if t == "logit-normal":
        t = f"logit-normal (mean {c.get('t-mean')}, std {c.get('t-std')})"
    norm = record.get("latent_norm")
    lines = ["## Training", "",
             f"From the run's own record ({_code(record['checkpoint'])}"
             + (f", {_code(Path(record['run_dir']).name + '/log.jsonl')}" if record.get("log") else "") + "):", ""]
    lines += _table([
        ("steps", f"{record['step']:,} (of --max-steps {c.get('max-steps'):,})" if isinstance(c.get("max-steps"), int)
         else record["step"]),
        ("global batch", f"{c.get('global-batch-size')} images per step (grad-accum {c.get('grad-accum')})"),
        ("optimizer", f"AdamW, lr {c.get('lr')}, β2 {c.get('adam-beta2')}, weight decay {c.get('weight-decay')}, "
                      f"warm-up {c.get('warmup-steps')} steps, grad clip "
                      f"{c.get('max-grad-norm') or 'off'}"),
        ("EMA", f"decay {c.get('ema-decay')}, warm-up {_fmt(bool(c.get('ema-warmup')))}"),
        ("t sampling", t),
        ("time shift", c.get("time-shift")),
        ("data", f"{c.get('data')}" + (f", {c.get('image-size')} px" if c.get("image-size") else "")
         + f", horizontal flips {_fmt(bool(c.get('flip')))}, label dropout {c.get('class-dropout-prob')}"),
        ("VAE", c.get("vae")),
        ("latent statistics", norm.describe() if norm is not None else None),
        ("mixed precision", c.get("mixed-precision")),
        ("seed", c.get("seed")),
        ("distilled from", c.get("teacher")),
        ("REPA encoder", c.get("repa-encoder")),
    ])
    lines.append("")
    log = record.get("log") or {}
    if log:
        lines += ["## Measured during training", ""]
        if "loss" in log:
            lines.append(f"- training loss {log['loss']['loss']:.4f} at step {log['loss']['step']:,} (the last "
                         f"logged mean over --log-every {c.get('log-every')} steps)")
        if "val" in log:
            v = log["val"]
            where = c.get("val-data") or "the embedded data's held-out split"
            lines.append(f"- held-out loss at step {v['step']:,} ({c.get('val-samples')} items of {where}, fixed "
                         f"draws of t and noise): " + ", ".join(f"{_text(k)} {x:.4f}" for k, x in v["values"].items()))
        if "fid" in log:
            f = log["fid"]
            sampler = c.get("sample-sampler") or TRAINING_SAMPLERS[cfg["objective"]]  # the grid's
            scorer = (f"scored by {_text(f['network'][0])}, sha256 {_code(f['network'][1])}" if "network" in f
                      else f"features {c.get('fid-features') or 'as the reference records'}")
            samples = f["fid_samples"] if isinstance(f.get("fid_samples"), int) else c.get("fid-samples")
            lines.append(f"- FID-type scores at step {f['step']:,} ({_fmt_count(samples)} EMA samples, {sampler} "
                         f"{c.get('sample-steps')} steps, guidance {c.get('sample-cfg-scale')}, against "
                         f"{_code(Path(str(raw.get('fid-ref'))).name)}{_subset(f.get('fid_ref_subset'))}, {scorer}): "
                         + ", ".join(f"{_text(k.removeprefix('fid/'))} {x:.4g}" for k, x in f["values"].items()))
        lines.append("")
    for ev in record.get("evaluations") or []:
        if not any(line.startswith("## Evaluations") for line in lines):
            lines += ["## Evaluations in the run folder", ""]
        lines.append(f"- {_code(ev['file'])} ({_evaluation_settings(ev)}): "
                     + ", ".join(f"{_text(k)} {v:.4g}" if isinstance(v, float) else f"{_text(k)} {_text(v)}"
                                 for k, v in ev["metrics"].items()))
    if record.get("evaluations"):
        lines.append("")
    return lines


def _evaluation_settings(ev: dict) -> str:
    """What an ``evaluate_fid.py --json`` result says it scored: samples, their checkpoint
    step and sampler (``gen``, or the samples' sidecar), the reference and the features."""
    parts = [f"{_text(ev['num_samples'])} samples" if ev.get("num_samples") else None]
    s = ev.get("sampler")
    if isinstance(s, dict):
        parts.append(f"from step {s['step']:,}" if isinstance(s.get("step"), int) else None)
        steps = s.get("num_steps", s.get("steps"))
        parts.append(" ".join(_text(v) for v in (s.get("sampler"), f"{steps} steps" if steps else None) if v) or None)
        cfg = s.get("cfg_scale")
        parts.append(f"guidance {_text(cfg)}" if cfg is not None else None)
    if ev.get("reference"):
        subset = (ev.get("reference_provenance") or {}).get("data_subset")
        parts.append(f"against {_code(Path(str(ev['reference'])).name)}{_subset(subset)}")
    parts.append(f"{_text(ev['extractor'])} features" if ev.get("extractor") else None)
    return ", ".join(p for p in parts if p)


SUBSET = re.compile(r"^(\d+) of (\d+) images")   # a reference's data_subset (evaluation/metrics.py make_reference)


def _subset(subset) -> str:
    """`` (1,000 of the 10,000 images it was made from)`` for a reference made from part of its
    data (``evaluate_fid.py ref --limit``), else ''."""
    m = SUBSET.match(subset) if isinstance(subset, str) else None
    return f" ({int(m[1]):,} of the {int(m[2]):,} images it was made from)" if m and m[1] != m[2] else ""


def _fmt_count(value) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else _text(value)


def _use(folder: str, kind: str, id2label: dict[int, str], sampler, vae) -> list[str]:
    ids = sorted(id2label)[:EXAMPLE_CLASSES]
    where = shlex.quote(folder)
    lines = ["## Use it", ""]
    if kind == "model":
        lines += ["The transformer alone: wrap it in a pipeline with the VAE it was trained with (or export a "
                  "pipeline folder with `export.py official` for `sample.py`):", "", "```python",
                  "from nala_dit.models.dit import DiT",
                  "from nala_dit.pipelines.pipeline import pipeline_for",
                  f"pipe = pipeline_for(DiT.from_pretrained({folder!r}), vae_path={vae or 'stabilityai/sd-vae-ft-ema'!r})",
                  f"images = pipe({ids!r}, generator=0).images", "```", ""]
        return lines
    name, steps = sampler
    command = (f"python sample.py --ckpt {where} --labels {','.join(map(str, ids))} --per-label {EXAMPLE_PER_CLASS} "
               f"--sampler {name} --steps {steps} --grid grid.png")   # the folder quoted: a line break stays in it
    lines += ["From a clone of the code (`pip install -e .` in it), the repository's command line:", "",
              *_fenced(command, "bash"), "",
              "or in Python (class ids or names; `generator` seeds the noise as `sample.py --seed` does):", "",
              "```python",
              f"from nala_dit.pipelines.pipeline import {kind}",
              f"pipe = {kind}.from_pretrained({folder!r})",
              f"images = pipe({[id2label[i] for i in ids]!r}, generator=0).images", "```", "",
              "`nala_dit.register_with_diffusers()` lets diffusers' `DiffusionPipeline.from_pretrained` open the "
              "folder too. Published with `hf upload USER/REPO <this folder>`, it loads back with "
              "`DiffusionPipeline.from_pretrained(\"USER/REPO\")` after that call.", ""]
    return lines


def save_card(directory: str | os.PathLike, card, grid: str | None = None) -> Path | None:
    """``README.md`` (and ``sample_grid.png``, a copy of ``grid``) into ``directory``;
    nothing when a README.md is already there (a user's own, kept)."""
    directory = Path(directory)
    path = directory / CARD_FILE
    if path.exists():
        return None
    if grid:
        shutil.copyfile(grid, directory / GRID_FILE)
    card.save(str(path))
    return path


def pipeline_card(pipe, folder: str):
    """``(card, grid path or None)`` for a ``NaLaDiTPipeline`` / ``NaLaSiTPipeline``."""
    from ..diffusion.generate import SampleSettings

    source = dict(pipe.config.source or {})
    record = run_record(source.get("checkpoint")) if source.get("weights") != "official" else None
    grid = (record or {}).get("grid")
    s = SampleSettings(pipe.config.sampler, pipe.config.num_inference_steps).resolved(pipe.objective())
    vae = pipe.config.vae_path or (source.get("vae") if pipe.vae is not None else None)
    card = build_card(pipe.transformer, folder, source, type(pipe).__name__, pipe.id2label, record, bool(grid),
                      vae=vae, sampler=(s.sampler, s.num_steps), objective_config=dict(pipe.config.objective_config or {}))
    return card, grid


def model_card(model, folder: str, source: dict, vae: str | None = None):
    """The card of a transformer-only folder (``export.py official --model-only``)."""
    ids = {i: str(i) for i in range(model.config.num_classes)}
    return build_card(model, folder, source, "model", ids, None, False, vae=vae)
