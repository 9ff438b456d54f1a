"""Linearise a trained softmax DiT / SiT: weight inheritance and teacher distillation.

Following LiT (Wang et al., arXiv 2501.12976, "Delving into a Simplified Linear
Diffusion Transformer"), a NaLa (or ReLU / 1+ELU) student starts from a softmax model:

* ``inherit(student, state, "all-but-attention")`` copies every tensor except the
  attention's (LiT's recipe: patch/time/label embedders, adaLN, MLPs, final layer);
* ``"attention-qkv"`` also maps the softmax ``attn.qkv`` onto the q, k, v rows of the
  student's ``attn.qkvg`` and ``attn.proj`` onto ``attn.proj``; the gate rows and the
  output LayerNorm keep their fresh init and LePE starts at zero, so the block begins
  as close to the teacher's as a different kernel allows.

The softmax blocks of a hybrid student (``softmax_blocks``) hold the teacher's own layer,
so their ``attn.qkv`` / ``attn.proj`` are copied in either mode.

``Distiller`` adds LiT's teacher terms to the training loss: on the same noisy input,
time and (dropped) label, ``weight·‖out_t − out_s‖²`` over the prediction channels
(ε for DiT, the velocity / model output for SiT) and ``sigma_weight·‖Σ_t − Σ_s‖²``
over the learned-variance channels (LiT: L_simple + 0.5·ε + 0.05·Σ).

A source or teacher is an official ``.pt`` (DiT-XL-2-256x256.pt, SiT-XL-2-256.pt),
a training run / checkpoint folder (EMA weights) or an exported pipeline folder.

Up the resolution ladder (``train.py --init-from RUN --image-size 512``): a source of the
student's own architecture is copied whole (``inherit(..., "all")``), and a softmax source
converts as above; either way the source may be at another image size. The position
table is never copied (it is a fixed function of the grid, ``grid.sincos_pos_embed_2d``):
the student recomputes it under its ``positions`` policy with the source's base grid
(``base_size``), so ``interpolate`` keeps the positions the source learned on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..attention.config import MODEL_OPTIONS
from ..attention.regions import remap_region_logits
from ..checks import did_you_mean
from ..models.dit import DiT
from ..models.presets import SIZES
from ..pipelines.sources import load_official_state_dict, model_from_official, read_pipeline_index
from .config import INHERIT_MODES
LIT_DISTILL_WEIGHT, LIT_SIGMA_WEIGHT = 0.5, 0.05
_ATTN = re.compile(r"^blocks\.(\d+)\.attn\.")
# What must agree between a student and the model it inherits from or distils from.
_SAME_IO = ("objective", "num_classes", "in_channels", "patch_size")
_POSITIONAL = ("pos_embed",)   # recomputed for the student's grid, never copied
_SAME_TRUNK = ("hidden_size", "depth", "mlp_ratio")


@dataclass
class Reference:
    """A trained model to inherit from or distil from, with its objective settings."""

    model: DiT
    objective_config: dict          # flag-named keys (``noise-schedule``, ``path-type``, ...)
    path: str
    kind: str                       # "official", "checkpoint" or "pipeline"

    def describe(self) -> str:
        c = self.model.config
        return f"{self.path} ({self.kind}, {c.attention} attention, {c.objective})"


def softmax_preset(student_preset: str) -> str:
    """The softmax preset a student's weights come from: NaLaDiT-XL/2 → DiT-XL/2."""
    return student_preset.replace("NaLa", "", 1) if student_preset.startswith("NaLa") else student_preset


def _official_file(preset: str, input_size: int) -> str:
    """The published file for a softmax preset (DiT/SiT released only XL/2)."""
    px = input_size * 8
    if preset.startswith("SiT"):
        return f"SiT-XL-2-{px}.pt (linked from github.com/willisma/SiT's README)"
    return f"DiT-XL-2-{px}x{px}.pt (https://dl.fbaipublicfiles.com/DiT/models/DiT-XL-2-{px}x{px}.pt)"


def _official_image_size(state: dict, student: DiT) -> int:
    """The pixel size an official file was trained at, read off its position table (so a
    256-px file can start a 512-px student); the student's size when the table is absent."""
    table = state.get("pos_embed")
    if table is None or table.ndim != 3:
        return student.config.input_size * 8
    side = round(table.shape[1] ** 0.5)
    return side * student.config.patch_size * 8


def load_reference(path: str | os.PathLike, student: DiT, student_preset: str) -> Reference:
    """An official ``.pt``, a checkpoint / run folder (EMA weights) or a pipeline folder
    (its transformer only: a teacher needs no VAE)."""
    from .checkpoint import OBJECTIVE_KEYS, load_model

    p = Path(path)
    if p.is_file() or (not p.exists() and p.suffix in (".pt", ".pth")):
        preset = softmax_preset(student_preset)
        if not p.exists():
            raise FileNotFoundError(
                f"official checkpoint not found: {p}. Nothing is downloaded at run time: fetch "
                f"{_official_file(preset, student.config.input_size)} on a connected machine and pass its path")
        state = load_official_state_dict(p)
        model = model_from_official(state, preset, image_size=_official_image_size(state, student),
                                    num_classes=student.config.num_classes)
        return Reference(model, {}, str(p), "official")
    if not p.exists():
        raise FileNotFoundError(f"no official .pt, checkpoint, run folder or pipeline folder at {p}{did_you_mean(p)}")
    if (p / "model_index.json").is_file():
        index = read_pipeline_index(p)
        model = DiT.from_pretrained(str(p / "transformer"))
        return Reference(model.eval(), dict(index.get("objective_config") or {}), str(p), "pipeline")
    model, ckpt = load_model(p, "ema")
    keys = OBJECTIVE_KEYS[model.config.objective]
    objective_config = {k: ckpt.config[k] for k in keys if ckpt.config.get(k) is not None}
    return Reference(model, objective_config, str(ckpt.path), "checkpoint")


def objective_settings(objective_kind: str, objective_config: dict) -> dict:
    """The settings that define a training target, with the project's defaults filled in."""
    from .checkpoint import build_objective

    obj = build_objective({"objective": objective_kind, "learn_sigma": False}, objective_config)
    if objective_kind == "diffusion":
        return {"noise-schedule": objective_config.get("noise-schedule", "linear"),
                "diffusion-steps": obj.num_timesteps}
    return {"path-type": obj.path.kind, "prediction": obj.prediction, "train-eps": obj.train_eps}


def check_compatible(ref: Reference, student: DiT, student_objective_config: dict, role: str,
                     trunk: bool = False) -> None:
    """Raise naming both sides if ``ref`` cannot serve ``student`` as ``role``."""
    s, r = student.config, ref.model.config
    # a source for --init-from may be at another size (up the ladder); a teacher sees the student's inputs
    keys = _SAME_IO + (_SAME_TRUNK if trunk else ("input_size",))
    problems = [f"{k}={r[k]} vs {s[k]}" for k in keys if r[k] != s[k]]
    if not problems:
        ours = objective_settings(s.objective, student_objective_config)
        theirs = objective_settings(r.objective, ref.objective_config)
        problems = [f"{k}={theirs[k]} vs {ours[k]}" for k in ours if ours[k] != theirs[k]]
    if problems:
        raise ValueError(f"{role} {ref.describe()} does not match the student (theirs vs student's): "
                         f"{'; '.join(problems)}. Use {'a teacher' if role == '--teacher' else 'an ' + role + ' model'} "
                         f"trained on the same data, "
                         f"objective and patch size, or change the student's flags to match{_size_hint(r, s)}")


def _size_hint(source_config, student_config) -> str:
    """'' or, when the trunk's width or depth differ, the --model size that matches the source
    (train.py's default preset is S/2, a digits source is T/2)."""

    if all(source_config[k] == student_config[k] for k in ("hidden_size", "depth")):
        return ""
    size = next((name for name, v in SIZES.items()
                 if (v["hidden_size"], v["depth"]) == (source_config["hidden_size"], source_config["depth"])), None)
    if size is None:
        return ""
    return (f" (the source is {size}/{source_config['patch_size']}-sized: pass --model NaLaDiT-{size}/"
            f"{source_config['patch_size']}, or another family at that size, or the source run's --config)")


# ------------------------------------------------------------------ inheritance
@dataclass
class InheritReport:
    """What ``inherit`` did, per tensor: copied / new element counts and dropped keys."""

    mode: str
    rows: list = field(default_factory=list)       # (student key, inherited elements, new elements)
    dropped: list = field(default_factory=list)    # (source key, elements)
    recomputed: list = field(default_factory=list)  # (student key, elements): positions for the student's grid
    sizes: tuple | None = None                      # (source input size, student's, base size, positions, patch)

    def counts(self) -> dict:
        """Tensor and element counts: inherited (whole), partial, new, dropped, recomputed (positions)."""
        out = {k: [0, 0] for k in ("inherited", "partial", "new", "dropped")}
        for _, got, new in self.rows:
            kind = "inherited" if new == 0 else "new" if got == 0 else "partial"
            out[kind][0] += 1
        for _, n in self.dropped:
            out["dropped"][0] += 1
            out["dropped"][1] += n
        out["inherited"][1] = sum(got for _, got, _ in self.rows)  # copied elements, partial ones included
        out["new"][1] = sum(new for _, _, new in self.rows)
        del out["partial"][1]
        out["recomputed"] = [len(self.recomputed), sum(n for _, n in self.recomputed)]
        return {k: tuple(v) for k, v in out.items()}

    def table(self) -> str:
        """Inherited / new / dropped parameters (elements) by module, blocks folded together."""
        groups: dict[str, list[int]] = {}

        def group(key):
            return groups.setdefault(re.sub(r"\.\d+\.", ".*.", key.rsplit(".", 1)[0]), [0, 0, 0])

        for key, got, new in self.rows:
            g = group(key)
            g[0] += got
            g[1] += new
        for key, n in self.dropped:
            group(key)[2] += n
        width = max(len(k) for k in groups)
        lines = [f"inheritance ({self.mode}):", f"{'module':<{width}}  {'inherited':>12}  {'new':>12}  {'dropped':>12}"]
        for name, (got, new, drop) in groups.items():
            lines.append(f"{name:<{width}}  {got:>12,}  {new:>12,}  {drop:>12,}")
        total = [sum(v[i] for v in groups.values()) for i in range(3)]
        lines.append(f"{'total':<{width}}  {total[0]:>12,}  {total[1]:>12,}  {total[2]:>12,}")
        for key, n in self.recomputed:
            lines.append(f"{key} ({n:,}): recomputed for the student's grid, not copied")
        if self.sizes is not None:
            src, dst, base, mode, patch = self.sizes
            change = "same size" if src == dst else f"{src} → {dst}"
            lines.append(f"model input (latent side): {change}; positions: {mode}, base size {base} "
                         f"(grid side {base // patch} at patch {patch})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """What ``train.py`` records in the run folder (``init_from.json``)."""
        counts = self.counts()
        out = dict(mode=self.mode, counts={k: list(v) for k, v in counts.items()},
                   recomputed=[k for k, _ in self.recomputed])
        if self.sizes is not None:
            src, dst, base, mode, patch = self.sizes
            out.update(source_input_size=src, input_size=dst, base_size=base, base_grid_side=base // patch,
                       pos_embed=mode)
        return out


def _variance_free_rows(student: DiT) -> torch.Tensor:
    """Rows of a learned-sigma final layer that hold the prediction channels.

    The output of a patch is laid out (p, p, C_out) with channels fastest (``unpatchify``),
    so SiT's released 8-channel layer maps onto a 4-channel SiT student by keeping the first
    C of every 2C rows.
    """
    p, c = student.patch_size, student.in_channels
    return torch.arange(p * p * 2 * c).view(p * p, 2 * c)[:, :c].reshape(-1)


@torch.no_grad()
def inherit(student: DiT, source: dict[str, torch.Tensor], mode: str = "all-but-attention") -> InheritReport:
    """Copy ``source`` (a softmax model's state dict; with ``mode="all"`` one of the student's
    own architecture, every tensor) into ``student`` in place; see the module doc.

    A missing tensor outside the attention or a shape mismatch is an error naming the keys;
    nothing is copied then.
    """
    if mode not in INHERIT_MODES + ("all",):
        raise ValueError(f"--inherit {mode!r} is not one of {', '.join(INHERIT_MODES)}")
    target = student.state_dict()
    report = InheritReport(mode)
    plan, problems, used = [], [], set()
    dim = student.config.hidden_size
    same_layer = set(student.config.get("softmax_blocks") or ())  # a hybrid's softmax blocks
    for key, dst in target.items():
        if key in _POSITIONAL:
            report.recomputed.append((key, dst.numel()))
            used.add(key)
            continue
        grown = _grown(key, dst, source, mode)   # region states, Mix-FFN conv: the source's function kept
        if grown is not None:
            plan.append((key, "set", grown))
            used.add(key)
            continue
        if key.startswith("r_embedder.") and key not in source:
            # a MeanFlow student of a SiT: its interval embedder stays as initialised, output zero,
            # so the student starts as the source at every end time r (diffusion/meanflow.py)
            plan.append((key, "new", None))
            continue
        attn = _ATTN.match(key)
        if attn and mode != "all" and int(attn.group(1)) not in same_layer:
            src_key = key.replace(".attn.qkvg.", ".attn.qkv.") if mode == "attention-qkv" else None
            if mode == "attention-qkv" and ".attn.lepe." in key:
                plan.append((key, "zero", None))
                continue
            if src_key is None or src_key not in source:
                plan.append((key, "new", None))
                continue
            src = source[src_key]
            if ".qkvg." in key and src.shape[0] == 3 * dim and dst.shape[0] in (3 * dim, 4 * dim) \
                    and src.shape[1:] == dst.shape[1:]:
                plan.append((key, "rows", (src_key, slice(0, 3 * dim))))  # q, k, v rows; the gate rows stay fresh
                used.add(src_key)
                continue
        else:
            src_key = key
            if src_key not in source:  # everything outside the attention is promised to come from the source
                problems.append(f"{key}: missing from the source")
                continue
            src = source[src_key]
        if src.shape == dst.shape:
            plan.append((key, "copy", src_key))
        elif key.startswith("final_layer.linear.") and not student.config.learn_sigma \
                and src.shape[0] == 2 * dst.shape[0] and src.shape[1:] == dst.shape[1:]:
            plan.append((key, "rows", (src_key, _variance_free_rows(student))))
        else:
            problems.append(f"{key}: source {tuple(src.shape)} vs student {tuple(dst.shape)}")
        used.add(src_key)
    if problems:
        raise ValueError(f"cannot inherit: {len(problems)} mismatches between the source and the student: "
                         f"{'; '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}")
    _apply(plan, target, source, report)
    report.dropped += [(k, v.numel()) for k, v in source.items() if k not in used]
    return report


def _apply(plan: list, target: dict[str, torch.Tensor], source: dict[str, torch.Tensor],
           report: InheritReport) -> None:
    """Carry out ``inherit``'s checked plan on the student's tensors ``target``: copy a tensor,
    copy rows of it, set a grown one, zero one, or leave one new; each recorded in ``report``."""
    for key, how, arg in plan:
        dst = target[key]
        if how == "copy":
            dst.copy_(source[arg])
            report.rows.append((key, dst.numel(), 0))
        elif how == "rows":
            src_key, rows = arg
            if isinstance(rows, slice):
                dst[rows].copy_(source[src_key])
            else:
                dst.copy_(source[src_key][rows])
            got = source[src_key].numel() if isinstance(rows, slice) else dst.numel()
            report.rows.append((key, got, dst.numel() - got))
            if not isinstance(rows, slice):
                report.dropped.append((src_key, source[src_key].numel() - got))  # the variance rows
        elif how == "set":
            dst.copy_(arg)
            report.rows.append((key, 0, dst.numel()))
        elif how == "zero":
            # LePE at zero: the block's output starts as the inherited attention path alone.
            dst.zero_()
            report.rows.append((key, 0, dst.numel()))
        else:
            report.rows.append((key, 0, dst.numel()))


def _grown(key: str, dst: torch.Tensor, source: dict[str, torch.Tensor], mode: str) -> torch.Tensor | None:
    """The value of a student tensor that a source of the student's own attention lacks or
    holds at another shape, chosen so the student starts as the source's function:

    * ``attn.region_logits`` (``--nala-regions``): the source's logits remapped to the
      student's R (``regions.remap_region_logits``: exact when R grows by a whole factor),
      or 0 (w = 1, plain NaLa exactly) from a source with one global state;
    * ``mlp.dwconv`` (``--mlp mix``) from a plain MLP: the identity kernel, bias 0.

    None: the tensor is handled by the general rules (copied, or an error)."""
    if key.endswith(".attn.region_logits") and mode == "all":
        src = source.get(key)
        if src is not None and src.shape == dst.shape:
            return None
        regions = math.isqrt(dst.shape[-1])
        return torch.zeros_like(dst) if src is None else remap_region_logits(src.to(dst.dtype), regions)
    if ".mlp.dwconv." in key and key not in source:
        value = torch.zeros_like(dst)
        if key.endswith(".weight"):
            value[:, :, 1, 1] = 1
        return value
    return None


def init_from(path: str | os.PathLike, student: DiT, student_preset: str, mode: str,
              student_objective_config: dict) -> InheritReport:
    """``train.py --init-from``: check the source, then ``inherit`` its (EMA) weights."""
    if mode not in INHERIT_MODES:
        raise ValueError(f"--inherit {mode!r} is not one of {', '.join(INHERIT_MODES)}")
    ref = load_reference(path, student, student_preset)
    theirs, ours = ref.model.config, student.config
    same = theirs.attention == ours.attention
    if not same and theirs.attention != "softmax":
        raise ValueError(f"--init-from {ref.describe()} is a {theirs.attention}-attention model: a student starts "
                         f"from a model of its own attention ({ours.attention}: continue up the ladder) or from a "
                         f"softmax DiT/SiT (conversion)")
    check_compatible(ref, student, student_objective_config, "--init-from", trunk=True)
    if not same and mode == "attention-qkv" and theirs.num_heads != ours.num_heads:
        raise ValueError(f"--inherit attention-qkv: the source has {theirs.num_heads} heads, the student "
                         f"{ours.num_heads}; use all-but-attention or the same head count")
    _check_structure(ref, student, same)
    # The student's positions continue the source's: its base grid, recomputed table.
    student.rebase(theirs.get("base_size") or theirs.input_size)
    report = inherit(student, ref.model.state_dict(), "all" if same else mode)
    report.sizes = (theirs.input_size, ours.input_size, student.config.base_size, ours.positions, ours.patch_size)
    return report


def _check_structure(ref: Reference, student: DiT, same_attention: bool) -> None:
    """Refuse a source whose trained tensors the student has no place for, naming the flag
    that gives it one: Mix-FFN convs (``--mlp mix``), region weights (``--nala-regions R``),
    and, for a source of the student's own attention, another hybrid schedule
    (``--softmax-blocks``: a block's softmax and linear layers hold different tensors).
    The other way round (a student with more structure) is growth that keeps the source's
    function (``_grown``), and a softmax source's blocks fill a hybrid's softmax blocks."""
    theirs, ours = ref.model.config, student.config
    source = ref.model.state_dict()

    def numbers(part: str) -> int:
        return sum(v.numel() for k, v in source.items() if part in k)

    if theirs.get("mlp", "mlp") == "mix" and ours.get("mlp", "mlp") != "mix":
        raise ValueError(f"--init-from {ref.path} is a Mix-FFN model (--mlp mix): a student without it would drop "
                         f"its trained depthwise convs (blocks.*.mlp.dwconv, {numbers('.mlp.dwconv.'):,} numbers); "
                         f"pass --mlp mix")
    regions = theirs.get("nala_regions") or 1
    if regions > 1 and (ours.get("nala_regions") or 1) == 1:
        raise ValueError(f"--init-from {ref.path} has {regions}x{regions} region states (--nala-regions {regions}): "
                         f"a student without them would drop their trained mixing weights (blocks.*.attn.region_logits, "
                         f"{numbers('.attn.region_logits'):,} numbers); pass --nala-regions {regions}")
    blocks = [list(c.get("softmax_blocks") or ()) for c in (theirs, ours)]
    if same_attention and blocks[0] != blocks[1]:
        shown = [",".join(map(str, b)) or "none" for b in blocks]
        what = f"softmax blocks {shown[0]} (--softmax-blocks {shown[0]})" if blocks[0] else "no softmax blocks"
        raise ValueError(f"--init-from {ref.path} has {what}, the student {shown[1]}: a block's softmax and linear "
                         f"layers hold different tensors; pass --softmax-blocks {shown[0]}")
    ours_keys = student.state_dict()
    lost = [k for k in source if same_attention and k not in ours_keys and k not in _POSITIONAL]
    if lost:  # any other option whose trained tensors the student has no place for (--lepe, --norm-scale ...)
        groups = sorted({re.sub(r"\.\d+\.", ".*.", k) for k in lost})
        options = [k for k in MODEL_OPTIONS if k != "nala_regions"]   # the attention's options (regions: above)
        differ = " ".join(_as_flag(k.replace("_", "-"), theirs.get(k)) for k in options if theirs.get(k) != ours.get(k))
        differ = differ or "the source run's model flags (its config.yaml)"
        raise ValueError(f"--init-from {ref.path} has trained tensors the student lacks ({', '.join(groups[:3])}"
                         f"{', ...' if len(groups) > 3 else ''}: {sum(source[k].numel() for k in lost):,} numbers) "
                         f"that would be dropped; pass {differ}")


# ------------------------------------------------------------------ resume with other settings
def _as_flag(key: str, value) -> str:
    """``--key value`` as train.py reads it back (lists as ``1,3``, None as ``none``)."""
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value)) or "none"
    elif value is None:
        value = "none"
    elif isinstance(value, bool):
        value = str(value).lower()
    return f"--{key} {value}"


def resume_refusal(ckpt, changes: dict, refused: dict, model: DiT, student_preset: str, train_config: dict,
                   run_name: str) -> str | None:
    """The error for resuming ``ckpt`` into ``model`` (built from the new settings), or None
    when the resume may go on: every change named in ``--allow-changes`` and the weights fit.

    The advice is only what works: ``--allow-changes`` when the checkpoint's tensors fit the
    new model; when they do not (``--mlp``, ``--nala-regions``, ``--softmax-blocks``, ``--lepe``
    ...), a new run started from the checkpoint's weights (``--init-from``, tried here on
    ``model``, which the caller discards) or, when that is refused too, its reason; and
    always the checkpoint's own settings, with which the resume works."""
    from ..guards import state_dict_mismatch
    from ..models.files import weight_shapes
    from .config import TrainConfig

    shapes = weight_shapes(ckpt.path / "model.safetensors")
    misfit = state_dict_mismatch({k: v.to("meta") for k, v in model.state_dict().items()},
                                 {k: torch.empty(s, device="meta") for k, s in shapes.items()})
    if not refused and not misfit:
        return None
    listed = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in (refused or changes).items())
    flags = {f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)}
    own = " ".join(_as_flag(k, a) for k, (a, _) in (refused or changes).items() if k in flags)
    own = f"resume with the checkpoint's settings ({own or 'in its state.json'})"
    head = f"checkpoint {ckpt.path} was trained with other settings ({listed})"
    if not misfit:
        return (f"{head}. {own[0].upper() + own[1:]}, or pass --allow-changes {','.join(refused)} to change them "
                f"deliberately")
    try:
        init_from(ckpt.path, model, student_preset, train_config.get("inherit") or INHERIT_MODES[0], train_config)
    except (ValueError, FileNotFoundError) as err:
        new_run = f"a new run cannot start from its weights either ({str(err).splitlines()[0]})"
    else:
        new_run = (f"to train with the new settings, start a new run from its weights: drop --resume (and "
                   f"--allow-changes) and pass --init-from {ckpt.path} --exp-name {run_name}-{'-'.join(changes)}")
    return (f"{head}. Its weights do not fit the model these settings build ({misfit}), so this run cannot continue "
            f"with them (--allow-changes cannot help): {own}; or {new_run}")


# ------------------------------------------------------------------ distillation
def _sq_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean squared error per sample, then over the batch (as L_simple's ``mean_flat``)."""
    return (a.float() - b.float()).pow(2).flatten(1).mean(1).mean()


class Distiller:
    """A frozen teacher and LiT's output-matching terms, fed by the student's own call.

    ``watch(model_fn)`` wraps the student for one loss computation: it draws the label
    dropout itself (the same ``torch.rand`` ``LabelEmbedder.token_drop`` would, so the
    RNG stream and the student's inputs are unchanged) and records the student's inputs
    and output; ``terms()`` then runs the teacher on exactly those inputs. The teacher
    is never wrapped for DDP: every process holds its own copy.
    """

    def __init__(self, teacher: DiT, student: DiT, weight: float, sigma_weight: float | None):
        both_sigma = teacher.config.learn_sigma and student.config.learn_sigma
        if sigma_weight is None:
            sigma_weight = LIT_SIGMA_WEIGHT if both_sigma else 0.0
        if sigma_weight and not both_sigma:
            raise ValueError(f"--distill-sigma-weight {sigma_weight}: matching the learned variance needs "
                             f"learn_sigma on both (teacher {teacher.config.learn_sigma}, student "
                             f"{student.config.learn_sigma}); set it to 0")
        if student.config.class_dropout_prob > 0 and teacher.null_label is None:
            raise ValueError("the student drops labels for guidance but the teacher has no null class "
                             "(trained with class-dropout-prob 0); use --class-dropout-prob 0 or another teacher")
        if weight < 0 or sigma_weight < 0:
            raise ValueError(f"distillation weights must be >= 0, got {weight} and {sigma_weight}")
        self.teacher = teacher.eval().requires_grad_(False)
        self.weight, self.sigma_weight = weight, sigma_weight
        self.dropout_prob = student.config.class_dropout_prob
        self._last = None

    @classmethod
    def load(cls, path, student: DiT, student_preset: str, student_objective_config: dict, weight: float,
             sigma_weight: float | None, device) -> "Distiller":
        ref = load_reference(path, student, student_preset)
        check_compatible(ref, student, student_objective_config, "--teacher")
        return cls(ref.model.to(device), student, weight, sigma_weight)

    def watch(self, model_fn):
        def student_fn(x, t, y):
            drop = None
            if self.dropout_prob > 0:
                drop = (torch.rand(y.shape[0], device=y.device) < self.dropout_prob).long()
            out = model_fn(x, t, y, force_drop_ids=drop)
            self._last = (x, t, y, drop, out)
            return out
        return student_fn

    def terms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted sum, [prediction term, variance term]) for the last watched call."""
        x, t, y, drop, out = self._last
        self._last = None
        with torch.no_grad():
            target = self.teacher(x.detach(), t, y, force_drop_ids=drop)
        c = x.shape[1]
        pred = _sq_err(target[:, :c], out[:, :c])
        sigma = _sq_err(target[:, c:2 * c], out[:, c:2 * c]) if self.sigma_weight else pred.new_zeros(())
        return self.weight * pred + self.sigma_weight * sigma, torch.stack([pred.detach(), sigma.detach()])
