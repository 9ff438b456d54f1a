"""What a resumed run does with each setting: the resume rules, as plain data (torch-free,
so ``cli/options.py`` names them without loading torch).

The code that applies them is ``resume.py`` (``restore``, ``resume_announcements``) and
``checkpoint.py`` (``config_changes``: the refused keys, in ``RESUME_RULES`` order).
"""

from __future__ import annotations

from ..attention.config import MODEL_OPTIONS

# What a resumed run does with each setting that differs from its checkpoint's: one rule per
# TrainConfig field (tests/training/test_resume_rules.py checks every field is here, once).
RESUME_RULE_MEANING = {
    "refused": "compared with the checkpoint's training config (when it applies: the objective's keys, a "
               "teacher's, REPA's): a change is refused naming it, unless --allow-changes names it",
    "refused-model": "compared through the model config these settings build (sizes, attention and its options, "
                     "classes, input size): refused naming the model key, unless --allow-changes names it",
    "refused-norm": "compared as the latent normalisation it gives: refused unless --allow-changes latent-norm",
    "applied": "this run's value is used; a change is printed (resume: --KEY NEW replaces the checkpoint's OLD)",
    "own-line": "a change is said by its own line (--context-parallel, --fsdp: fp32-close, not bitwise; "
                "--init-from: ignored, the run continues its checkpoint)",
    "not-compared": "how this command starts or resumes, not what the run trains (--inherit is read by "
                    "--init-from only, which a resume ignores)",
}
RESUME_RULES = {
    # in this order in config_changes' list of refused changes
    "refused": ("noise_schedule", "diffusion_steps", "path_type", "prediction", "loss_weight", "train_eps",
                "sample_eps", "time_shift", "vae", "teacher", "distill_weight", "distill_sigma_weight",
                "repa_encoder", "repa_depth", "repa_projector_dim"),
    "refused-model": ("model", "attention", *MODEL_OPTIONS, "pos_embed", "softmax_blocks", "mlp", "mix_init",
                      "class_dropout_prob", "image_size", "num_classes", "mean_flow"),
    "refused-norm": ("latent_norm",),
    "applied": ("data", "flip", "skip_corrupt", "check_data", "num_workers", "t_sampling", "t_mean", "t_std",
                "global_batch_size", "grad_accum", "lr", "warmup_steps", "weight_decay", "adam_beta2",
                "max_grad_norm", "max_nan_steps", "ema_decay", "ema_warmup", "max_steps", "mixed_precision",
                "grad_checkpointing", "compile", "threads", "seed", "results_dir", "exp_name", "log_every",
                "ckpt_every", "keep_last", "sample_every", "sample_sampler", "sample_steps", "sample_cfg_scale",
                "report_to", "val_every", "val_data", "val_samples", "fid_every", "fid_ref", "fid_samples",
                "fid_features", "inception_weights", "allow_unknown_inception_weights", "digits_classifier",
                "repa_weight", "mf_ratio", "mf_t_mean", "mf_t_std", "mf_adaptive_p", "mf_adaptive_c", "mf_cfg_omega",
                "mf_cfg_kappa"),
    "own-line": ("context_parallel", "fsdp", "init_from"),
    "not-compared": ("resume", "allow_changes", "inherit"),
}
RESUME_RULE = {name: rule for rule, names in RESUME_RULES.items() for name in names}
# A "refused" key that belongs to a feature is compared only when the checkpoint or the run uses it.
RESUME_WHEN = {**dict.fromkeys(("teacher", "distill_weight", "distill_sigma_weight"), "teacher"),
               **dict.fromkeys(("repa_encoder", "repa_depth", "repa_projector_dim"), "repa_encoder")}
# What an "applied" change means beyond its new value, said with it.
RESUME_NOTES = {
    "seed": "the data order and every draw from here on differ from an uninterrupted run",
    "flip": "the data the model sees from here on differs",
    "ema_decay": "the EMA continues from its saved weights with this decay",
    "ema_warmup": "the EMA continues from its saved weights with this rule",
    "global_batch_size": "the learning rate is not rescaled",
    "mixed_precision": "the numbers from here on differ from an uninterrupted run",
}
