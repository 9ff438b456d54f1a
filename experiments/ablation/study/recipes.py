"""The study's tasks (data and recipe), variants (the flags that make each model) and names."""

from __future__ import annotations

# Variants: the flags that make them, on top of the task's recipe. Every model is the
# DiT-T/2 backbone (diffusion objective, learned sigma); only the attention differs.
VARIANTS = {
    "softmax": ["--model", "DiT-T/2", "--attention", "softmax"],
    "softmax_gated": ["--model", "DiT-T/2", "--attention", "softmax_gated"],
    "relu_gated": ["--model", "DiT-T/2", "--attention", "relu"],
    "elu_gated": ["--model", "DiT-T/2", "--attention", "elu"],
    "nala": ["--model", "DiT-T/2", "--attention", "nala"],
    "nala_sqrt_d": ["--model", "DiT-T/2", "--attention", "nala", "--norm-scale", "sqrt_d"],
    "nala_learned": ["--model", "DiT-T/2", "--attention", "nala", "--norm-scale", "learned"],
    "nala_relu_split": ["--model", "DiT-T/2", "--attention", "nala", "--direction", "relu_split"],
    "nala_no_lepe": ["--model", "DiT-T/2", "--attention", "nala", "--lepe", "false"],
    "nala_no_gate": ["--model", "DiT-T/2", "--attention", "nala", "--gate", "false"],
    "nala_rope": ["--model", "DiT-T/2", "--attention", "nala", "--rope", "true"],
    "hybrid": ["--model", "DiT-T/2", "--attention", "nala", "--softmax-blocks", "every:4"],
    # The 4,096-token remedies (experiments/ablation/README.md "Where it pays"): region states, Mix-FFN,
    # both, and the hybrid's softmax block elsewhere.
    "nala_r2": ["--model", "DiT-T/2", "--attention", "nala", "--nala-regions", "2"],
    "nala_r4": ["--model", "DiT-T/2", "--attention", "nala", "--nala-regions", "4"],
    "nala_mix": ["--model", "DiT-T/2", "--attention", "nala", "--mlp", "mix"],
    "nala_r4_mix": ["--model", "DiT-T/2", "--attention", "nala", "--nala-regions", "4", "--mlp", "mix"],
    "hybrid_b0": ["--model", "DiT-T/2", "--attention", "nala", "--softmax-blocks", "0"],
    "hybrid_b13": ["--model", "DiT-T/2", "--attention", "nala", "--softmax-blocks", "1,3"],
    # The 2 x 2 {softmax, NaLa} x {MLP, Mix-FFN} (with softmax, nala and nala_mix above), and
    # gated softmax with Mix-FFN (with softmax_gated: NaLa's layer, the softmax kernel).
    "softmax_mix": ["--model", "DiT-T/2", "--attention", "softmax", "--mlp", "mix"],
    "softmax_gated_mix": ["--model", "DiT-T/2", "--attention", "softmax_gated", "--mlp", "mix"],
}
DESCRIPTIONS = {
    "softmax": "DiT's softmax attention (qkv, proj; no extras)",
    "softmax_gated": "softmax in the gated layer (qkvg, LePE, LayerNorm, SiLU gate)",
    "relu_gated": "ReLU linear attention in the gated layer",
    "elu_gated": "1+ELU linear attention in the gated layer",
    "nala": "NaLa cosine, s = 1 (the paper), gated layer",
    "nala_sqrt_d": "NaLa cosine, s = √D",
    "nala_learned": "NaLa cosine, learned s per head",
    "nala_relu_split": "NaLa relu_split direction, s = 1",
    "nala_no_lepe": "NaLa s = 1 without LePE",
    "nala_no_gate": "NaLa s = 1 without the SiLU gate",
    "nala_rope": "NaLa s = 1 with numerator-only 2-D RoPE",
    "hybrid": "NaLa s = 1 in blocks 0-2, DiT's softmax layer in block 3 (one of four)",
    "nala_r2": "NaLa s = 1 with 2 x 2 region states",
    "nala_r4": "NaLa s = 1 with 4 x 4 region states",
    "nala_mix": "NaLa s = 1 with Mix-FFN (3 x 3 depthwise conv in the MLP)",
    "nala_r4_mix": "NaLa s = 1 with 4 x 4 region states and Mix-FFN",
    "hybrid_b0": "DiT's softmax layer in block 0, NaLa s = 1 in blocks 1-3",
    "hybrid_b13": "DiT's softmax layer in blocks 1 and 3, NaLa s = 1 in blocks 0 and 2",
    "softmax_mix": "DiT's softmax layer with Mix-FFN",
    "softmax_gated_mix": "softmax in the gated layer with Mix-FFN",
}
# The ladder grid's variants (``--variants ladder``): the five and the hybrid.
LADDER_VARIANTS = ("softmax", "softmax_gated", "nala", "nala_sqrt_d", "relu_gated", "hybrid")
# The 4,096-token remedies (``--variants remedies``).
REMEDY_VARIANTS = ("nala_r2", "nala_r4", "nala_mix", "nala_r4_mix", "hybrid_b0", "hybrid_b13")
# Is it the attention? The 2 x 2 (``--variants 2x2``), then gated softmax +- Mix-FFN (``--variants gated``).
TWO_BY_TWO = ("softmax", "softmax_mix", "nala", "nala_mix")
GATED_SOFTMAX = ("softmax_gated", "softmax_gated_mix")
VARIANT_GROUPS = {"ladder": LADDER_VARIANTS, "remedies": REMEDY_VARIANTS, "2x2": TWO_BY_TWO, "gated": GATED_SOFTMAX}

# The digits recipe is the demo's (configs/digits_*.yaml): batch 64, lr 2e-3, EMA 0.99;
# budgets 0.5x, 1x, 2x its 600 steps.
TASKS = {
    "digits": dict(data="digits", batch=64, lr=2e-3, ema=0.99, budgets=(300, 600, 1200), log_every=50,
                   per_class=30, sampler="ddpm", sample_steps=40, cfg=2.0, sample_batch=300),
    # 256 tokens: a step takes 1.0 s (softmax) to 1.5 s (NaLa) on one thread, and scoring at
    # the digits settings would take ~5 min per budget, so the canvas grid (5 variants x 3
    # seeds) is sized to fit 2 cores (measured: ~90 min): 100 samples (10 per class), 25 DDPM
    # steps, budgets 1/3x and 2/3x the demo's steps.
    "canvas": dict(data="digits-canvas", batch=32, lr=2e-3, ema=0.99, budgets=(200, 400), log_every=50,
                   per_class=10, sampler="ddpm", sample_steps=25, cfg=2.0, sample_batch=100),
    # The ladder (the same pictures at 64 / 128 px). Sized in experiments/ablation/ladder.md from the
    # isolated timing run: 36 cells (6 variants x 3 seeds x 2 sizes) in about 8 core-hours.
    # Held-out loss (the time-to-quality measure) at every budget on fixed draws of
    # ``heldout_items`` canvases; samples (class-consistency, Fréchet distance) only at
    # ``sample_budgets``, since one sampled image costs 2 x sample_steps forward passes.
    "canvas64": dict(data="digits-canvas", image_size=64, batch=8, lr=2e-3, ema=0.99, budgets=(100, 200, 400),
                     log_every=25, per_class=5, sampler="ddim", sample_steps=20, cfg=2.0, sample_batch=25,
                     sample_budgets=(200, 400), heldout_items=120, heldout_repeats=1),
    "canvas128": dict(data="digits-canvas", image_size=128, batch=4, lr=2e-3, ema=0.99, budgets=(75, 150, 300),
                      log_every=25, per_class=2, sampler="ddim", sample_steps=20, cfg=2.0, sample_batch=20,
                      sample_budgets=(300,), heldout_items=60, heldout_repeats=1),
}
# Up the ladder: the same 64 / 128-px recipes, each cell starting from the final checkpoint
# of the same variant and seed on the 256-token ``canvas`` (every weight copied, positions
# recomputed, train.py --init-from), under both position policies of docs/highres.md.
for _side in (64, 128):
    for _pos, _tag in (("interpolate", "interp"), ("extrapolate", "extrap")):
        TASKS[f"ladder{_side}_{_tag}"] = dict(TASKS[f"canvas{_side}"], init_task="canvas", pos_embed=_pos)
LADDER_TASKS = tuple(t for t in TASKS if t.startswith("ladder"))
# The 2 x 2 study (``study64``, ``study128``): the ladder's recipes with
# * the measure that reflects the weights: the EMA with a warm-up (``train.py --ema-warmup``,
#   decay min(0.99, (1 + t) / (10 + t))): below t = 890 it averages about the last tenth of the
#   steps, where EMA 0.99 lags 100 steps (a third of a 300-step run) and still holds 5 % of the
#   random initial weights at step 300 (0.99^300);
# * one Mix-FFN rule, the conv at identity (``--mix-init identity``): every Mix-FFN model starts as
#   its plain-MLP twin's function, seeded alike with the same weights, as the from-256 configs' models
#   start (``convert.inherit``), so the 2 x 2 measures what the conv learns, not its random start;
# * held-out loss on more canvases, in three equal noise bands of t (``heldout_bands``: the draws are
#   stratified, a third in each band, the same for every model).
for _side in (64, 128):
    TASKS[f"study{_side}"] = dict(TASKS[f"canvas{_side}"], ema_warmup=True, mix_init="identity", heldout_bands=3,
                                  heldout_items=360 if _side == 64 else 180, heldout_repeats=1)
STUDY_TASKS = ("study64", "study128")
# The samples protocol (samples well above chance at 1,024 tokens): whole-frame digits up the
# ladder 8 -> 16 -> 32 -> 64 px (``--data digits --image-size S``: the scans upscaled, every block
# averaging to its scan pixel), one rung at a time. Every rung is a cell that starts from the
# same variant and seed's previous rung (every weight copied, positions interpolated,
# ``train.py --init-from``) under the study's rules (EMA warm-up, Mix-FFN conv at identity) and
# the resolution-aware time shift ("auto": s = sqrt(tokens / 16), the 8-px model's tokens), and
# is scored on samples (class-consistency, Fréchet distance and KID of 100 samples against the
# held-out digits) and on held-out loss. The 64-px rung (1,024 tokens) is the protocol's answer;
# the lower rungs show where a variant loses its digits.
TASKS["samples8"] = dict(data="digits", batch=64, lr=2e-3, ema=0.99, budgets=(600,), log_every=50, ema_warmup=True,
                         mix_init="identity", per_class=10, sampler="ddim", sample_steps=20, cfg=2.0,
                         sample_batch=50, kid=True, heldout_items=360, heldout_repeats=4)
for _side, _batch, _budgets in ((16, 32, (150, 300)), (32, 32, (150, 300)), (64, 16, (150, 300))):
    TASKS[f"samples{_side}"] = dict(TASKS["samples8"], image_size=_side, init_task=f"samples{_side // 2}",
                                    pos_embed="interpolate", time_shift="auto", batch=_batch, lr=1e-3,
                                    budgets=_budgets, sample_batch=25, heldout_repeats=1)
SAMPLES_TASKS = ("samples8", "samples16", "samples32", "samples64")
# A smoke run (the tests' end-to-end study): every column filled at the least cost, one sample per
# class and 3 held-out items (one in each of the study's noise bands).
QUICK = dict(batch=16, budgets=(2, 4), log_every=1, per_class=1, sample_steps=2, sample_batch=10,
             heldout_items=3, heldout_repeats=1)
# A canvas or ladder task (256 tokens and more) in quick mode: the smallest batch and scoring that
# still fill every column: 2 sampler steps (the least: a respaced sampler keeps both ends), without
# guidance (cfg 1: no unconditional half, half the forward passes; the quick digits task keeps cfg 2).
QUICK_LADDER = dict(batch=1, per_class=1, sample_steps=2, cfg=1.0, sample_batch=10, sample_budgets=(4,),
                    heldout_items=3)
QUICK_VARIANTS = ("softmax", "nala_mix")
QUICK_SEEDS = (0, 1)
QUICK_TASKS = ("digits", "study64", "ladder64_interp")
HELDOUT_REPEATS = 4  # fixed (t, noise) draws per held-out image (all items unless a recipe says)
METRICS = ("class_consistency", "frechet_distance", "train_loss", "heldout_loss", "train_time_s")
RAW = "heldout_loss_raw"   # held-out loss of the raw (not EMA) weights; absent from cells scored before it
KID = "kid"                # KID of the samples (digits classifier's features; the samples protocol's cells)
# Held-out loss of the scored (EMA) weights in three noise bands of t (low, mid, high noise; study tasks).
BANDS = ("heldout_loss_low", "heldout_loss_mid", "heldout_loss_high")


def lr_tag(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def cell_name(task: str, variant: str, seed: int, lr: float) -> str:
    return f"{task}/{variant}/seed{seed}_lr{lr_tag(lr)}"


def task_recipe(task: str, quick: bool) -> dict:
    recipe = dict(TASKS[task])
    if quick:
        recipe.update(QUICK)
        if "image_size" in recipe or is_canvas(task):
            recipe.update(QUICK_LADDER)
    return recipe


def is_canvas(task: str) -> bool:
    return TASKS[task]["data"] == "digits-canvas"


def recipe_flags(recipe: dict, variant: str) -> list:
    """The train.py flags of the recipe's training rules: the EMA warm-up, the time shift, and
    the Mix-FFN conv's init for the variants with Mix-FFN."""
    flags = ["--ema-warmup", "true"] if recipe.get("ema_warmup") else []
    if recipe.get("time_shift"):
        flags += ["--time-shift", recipe["time_shift"]]
    mix = VARIANTS[variant][VARIANTS[variant].index("--mlp") + 1] == "mix" if "--mlp" in VARIANTS[variant] else False
    if mix and recipe.get("mix_init"):
        flags += ["--mix-init", recipe["mix_init"]]
    return flags


def data_flags(recipe: dict) -> list:
    """The train.py flags that pick the task's data (the ladder's canvas side)."""
    size = recipe.get("image_size")
    return ["--data", recipe["data"]] + (["--image-size", size] if size else [])


def _tasks(names) -> list[str]:
    """The tasks present, in ``TASKS`` order (digits before canvas)."""
    order = list(TASKS)
    return sorted(set(names), key=lambda t: (order.index(t) if t in order else len(order), t))


TASK_TITLES = {"digits": "Digits (16 tokens)", "canvas": "Canvas (256 tokens)", "canvas64": "Canvas 64 px (1,024 tokens)",
               "canvas128": "Canvas 128 px (4,096 tokens)",
               **{f"ladder{s}_{tag}": f"Canvas {s} px ({(s // 2) ** 2:,} tokens), up the ladder from the 256-token "
                                      f"canvas, {pos} positions"
                  for s in (64, 128) for pos, tag in (("interpolate", "interp"), ("extrapolate", "extrap"))},
               **{f"study{s}": f"Canvas {s} px ({(s // 2) ** 2:,} tokens), the 2 × 2 study (EMA warm-up, Mix-FFN conv "
                               f"at identity)" for s in (64, 128)},
               "samples8": "Digits 8 px (16 tokens), the samples protocol's first rung",
               **{f"samples{s}": f"Digits {s} px ({(s // 2) ** 2:,} tokens), the samples protocol: up the ladder "
                                 f"from {s // 2} px" for s in (16, 32, 64)}}
