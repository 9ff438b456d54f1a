"""The model presets and the checks of the model's constructor options, as plain data:
importing this module costs no torch (the CLIs' ``--help`` reads it).

``SIZES`` × ``PATCHES`` × ``FAMILIES`` name every preset (``MODEL_NAMES``: ``NaLaDiT-S/2`` …);
``models/dit.py`` builds one constructor per name from them (``MODELS``, as DiT's ``DiT_models``).
The attention's own options are ``attention/config.py``'s (``NaLaConfig``).
"""

from __future__ import annotations

from ..attention.config import GATED_ATTENTIONS, LINEAR_KERNELS, MODEL_OPTIONS

# Sizes from the DiT paper (Table 1) plus a tiny one for tests and the demo.
SIZES = {
    "S": dict(depth=12, hidden_size=384, num_heads=6),
    "B": dict(depth=12, hidden_size=768, num_heads=12),
    "L": dict(depth=24, hidden_size=1024, num_heads=16),
    "XL": dict(depth=28, hidden_size=1152, num_heads=16),
    # Past XL, widths/depths/heads from the literature in DiT's own block (models/dit.py, docs/models.md):
    # G = Hunyuan-DiT's 1.5B DiT-g/2 size, also DiT-MoE's G (arXiv 2405.08748, 2407.11633), ~1.44B;
    # H = Sana's width and heads (2240, 20; arXiv 2410.10629) at SANA-1.5's 30 blocks (arXiv 2501.18427), ~2.73B.
    "G": dict(depth=40, hidden_size=1408, num_heads=16),
    "H": dict(depth=30, hidden_size=2240, num_heads=20),
    "T": dict(depth=4, hidden_size=128, num_heads=4),
}
# Patch 1 is for the f16/f32 tokenizers (DC-AE f32c32, RAE, the f16 KLs: nala_dit/models/tokenizer.py):
# 16×16 latents (256 px at f16, 512 px at f32) give 256 tokens at patch 1, the token count of
# patch 2 on the SD VAE's 32×32 at 256 px, so every size fits where its /2 fits at 256 px.
PATCHES = {"S": (1, 2, 4, 8), "B": (1, 2, 4, 8), "L": (1, 2, 4, 8), "XL": (1, 2, 4, 8), "G": (1, 2, 4, 8),
           "H": (1, 2, 4, 8), "T": (1, 2, 4)}
FAMILIES = {
    # name prefix: (objective, learn_sigma, attention)
    "DiT": ("diffusion", True, "softmax"),
    "NaLaDiT": ("diffusion", True, "nala"),
    "SiT": ("transport", False, "softmax"),
    "NaLaSiT": ("transport", False, "nala"),
}
MODEL_NAMES = tuple(f"{family}-{size}/{patch}" for family in FAMILIES for size in SIZES for patch in PATCHES[size])


def preset(name: str) -> tuple[str, bool, str]:
    """(objective, learn_sigma, attention) of the preset ``name``, e.g. ``NaLaDiT-S/2``."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    return FAMILIES[name.split("-")[0]]


# Which attention kinds each model option applies to (NaLaConfig's fields say it for theirs).
# An option given for a model whose attention ignores it is an error that names both
# (``--model DiT-S/2 --lepe true`` would otherwise train a plain DiT without a word).
ATTENTION_OPTIONS = {**{key: f.metadata["applies"] for key, f in MODEL_OPTIONS.items()},
                     "softmax_blocks": GATED_ATTENTIONS}
ATTENTION_GROUPS = {GATED_ATTENTIONS: "the gated layer", LINEAR_KERNELS: "the linear kernels", ("nala",): "NaLa"}


def check_attention_options(model: str, attention: str, given, flag=lambda name: name) -> None:
    """Raise if an option in ``given`` (names) does not apply to ``attention``; ``flag``
    spells a name as the caller's user wrote it (``--out-norm``, ``out-norm``, ``out_norm``)."""
    wrong = [name for name in given if name in ATTENTION_OPTIONS and attention not in ATTENTION_OPTIONS[name]]
    if not wrong:
        return
    needs = [f"{flag(n)} applies to {ATTENTION_GROUPS[ATTENTION_OPTIONS[n]]} ({'/'.join(ATTENTION_OPTIONS[n])} attention)"
             for n in wrong]
    kind = ATTENTION_OPTIONS[wrong[0]][0]
    objective = preset(model)[0]
    fits = [m for m in MODEL_NAMES if preset(m)[2] == kind and preset(m)[0] == objective
            and m.endswith(model[model.index("-"):])]
    raise ValueError(f"{', '.join(needs)}, not to {model}, which uses {attention} attention; choose a model "
                     f"with that attention, e.g. {' or '.join(fits + [flag('attention') + ' ' + kind])}")


# dit.py MLPS: DiT's MLP, Mix-FFN.
MLP_KINDS = ("mlp", "mix")
MIX_INITS = ("default", "identity")   # Mix-FFN's conv: PyTorch's random init, or the identity (centre tap 1)


def check_mix_init(mlp: str | None, mix_init: str | None, flag=None) -> None:
    """The one rule of Mix-FFN's start: ``mix_init`` (``MIX_INITS``) applies to ``mlp='mix'``.
    ``DiT`` passes its keys (``'default'`` is also the plain MLP's value); the training CLI
    passes what was given (None: not given) with ``flag`` spelling a name, and there giving
    it at all without ``--mlp mix`` is refused."""
    if mix_init is None:
        return
    if mix_init not in MIX_INITS:
        raise ValueError(f"mix_init must be one of {MIX_INITS} ('identity': the conv starts as the identity, "
                         f"'default': PyTorch's random init), got {mix_init!r}")
    if mlp == "mix":
        return
    if flag is not None:
        raise ValueError(f"{flag('mix_init')} {mix_init} applies to Mix-FFN ({flag('mlp')} mix), not to DiT's MLP; "
                         f"add {flag('mlp')} mix or drop {flag('mix_init')}")
    if mix_init != "default":
        raise ValueError(f"mix_init={mix_init!r} applies to Mix-FFN (mlp='mix'), not to mlp={mlp!r}")


# The hybrid layer schedule: which blocks of a linear-attention model use DiT's own
# softmax layer instead (the NaLa authors' released classifier mixes NaLa and softmax
# stages). "every:K" = the last block of every K (blocks K-1, 2K-1, ...: later blocks
# refine what linear blocks have spread, as hybrid stacks usually end on softmax), or
# block indices "0,3"; "none" = no softmax block.
SOFTMAX_BLOCKS_HELP = ("hybrid schedule: blocks that use DiT's softmax layer (attn.qkv/attn.proj) in a "
                       "linear-attention model: 'every:K' (blocks K-1, 2K-1, ...), indices '0,3', or 'none'")


def parse_softmax_blocks(value, depth: int) -> list[int] | None:
    """The sorted block indices of a softmax-block schedule (None when there are none).

    ``value``: None, "none", "every:K", "i,j,..." (a flag or YAML string), an int, or a list
    of ints (a model config read back). Anything else, an index outside ``0..depth-1`` or
    a schedule that leaves no linear block is a ValueError naming the value and the fix.
    """
    forms = "'every:K' (K >= 2), block indices like '0,3', or 'none'"
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"softmax-blocks {value!r} is not a schedule; use {forms}")
    if isinstance(value, int):
        blocks = [value]
    elif isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        blocks = list(value)
    elif isinstance(value, str) and value.strip().lower().startswith("every:"):
        try:
            every = int(value.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"softmax-blocks {value!r}: K in 'every:K' must be an integer >= 2") from None
        if every < 2:
            raise ValueError(f"softmax-blocks {value!r}: K in 'every:K' must be >= 2 (every:1 is a plain softmax "
                             f"model: use attention softmax)")
        if every > depth:
            raise ValueError(f"softmax-blocks {value!r}: K is larger than the depth {depth}, so no block would "
                             f"be softmax; use K <= {depth} or block indices")
        blocks = list(range(every - 1, depth, every))
    elif isinstance(value, str):
        try:
            blocks = [int(part) for part in value.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"softmax-blocks {value!r} is not a schedule; use {forms}") from None
    else:
        raise ValueError(f"softmax-blocks {value!r} is not a schedule; use {forms}")
    bad = [i for i in blocks if not 0 <= i < depth]
    if bad:
        raise ValueError(f"softmax-blocks {value!r}: block {bad[0]} does not exist in a {depth}-block model; "
                         f"use indices 0..{depth - 1}")
    blocks = sorted(set(blocks))
    if len(blocks) == depth:
        raise ValueError(f"softmax-blocks {value!r} makes all {depth} blocks softmax; use attention softmax "
                         f"for a plain softmax model, or leave some blocks linear")
    return blocks or None


def check_class_dropout(value, where: str = "--class-dropout-prob", fix: str = "") -> float:
    """Label dropout for classifier-free guidance, in [0, 1): each training label is replaced by
    the null class with this probability (DiT 0.1; 0 = no null class). At 1 no label is ever
    seen, so the model is unconditional and its classes mean nothing; NaN and values past 1 are
    not probabilities. Else one ValueError line naming ``where`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{where} must be a probability in [0, 1) (DiT 0.1; 0 = no null class, no guidance; at 1 "
                         f"no label is ever seen, an unconditional model), got {value!r}{f'; {fix}' if fix else ''}")
    return value
