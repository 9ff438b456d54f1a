"""``NaLaConfig`` (nala_dit/attention/config.py): every setting of the gated attention layer in
one frozen dataclass, checked once, carried unchanged from the training CLI to the layer and
the kernels; and the model config key ``positions`` (``pos_embed`` in configs of older
versions): an old checkpoint and an old exported pipeline folder still load and give the
same outputs."""

import dataclasses
import json
import math

import pytest
import torch

from nala_dit.attention.config import MODEL_OPTIONS, NaLaConfig
from nala_dit.cli.config import resolve, to_dict
from nala_dit.cli.options import ATTENTION_OPTIONS, MODEL_OVERRIDES, TrainConfig
from tests.utils import assert_names


# ------------------------------------------------------------------ each rule, once
@pytest.mark.parametrize("options,words", [
    (dict(kernel="flash"), "kernel must be one of"),
    (dict(direction="sine"), "direction must be one of"),
    (dict(norm_scale="sqrt-d"), "norm_scale must be a positive number"),
    (dict(norm_scale=0), "norm_scale must be a positive number"),
    (dict(norm_scale=True), "norm_scale must be a positive number"),      # True == 1.0, still refused
    (dict(regions=0), "nala-regions must be an integer >= 1"),
    (dict(regions=17), "more than 16 regions per side"),
    (dict(kernel="softmax", rope=True), "rope applies to the linear kernels"),
    (dict(kernel="relu", regions=2), "applies to NaLa attention"),
    (dict(regions=2, rope=True), "region states and rope do not combine"),
])
def test_every_rule_is_checked_on_construction(options, words):
    with pytest.raises(ValueError, match=words) as err:
        NaLaConfig(**options)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=words):        # and on every change (the functional API's overrides)
        NaLaConfig.of(NaLaConfig(), **options)


def test_the_config_is_frozen_normalised_and_kept_when_nothing_changes():
    config = NaLaConfig(norm_scale="2")
    assert config.norm_scale == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.power = 2.0
    assert NaLaConfig.of(config) is config and NaLaConfig.of(config, power=3.0) is config
    assert NaLaConfig.of(config, power=2.5).power == 2.5 and config.power == 3.0
    assert NaLaConfig.of(None) == NaLaConfig()


def test_norm_scale_resolves_per_head_dim():
    assert NaLaConfig(norm_scale="sqrt_d").norm_scale_for(64) == 8.0
    assert NaLaConfig(norm_scale="learned").norm_scale_for(64) == 1.0      # the layer scales q itself
    assert NaLaConfig(norm_scale=3).norm_scale_for(64) == 3.0


def test_model_keys_map_to_the_fields():
    config = NaLaConfig.from_model("nala", nala_regions=2, lepe=False, power=2.0)
    assert (config.kernel, config.regions, config.lepe, config.power) == ("nala", 2, False, 2.0)
    assert NaLaConfig.from_model("softmax_gated").kernel == NaLaConfig.from_model("softmax").kernel == "softmax"
    with pytest.raises(ValueError, match="attention must be one of"):
        NaLaConfig.from_model("flash")
    with pytest.raises(TypeError, match="powr"):
        NaLaConfig.from_model("nala", powr=2.0)
    # The CLI's tables are made from the same fields.
    assert set(MODEL_OPTIONS) == {"direction", "lepe", "gate", "out_norm", "power", "offset", "norm_scale", "alpha",
                                  "rope", "rope_layout", "nala_regions"}
    assert set(MODEL_OPTIONS) < set(ATTENTION_OPTIONS) and set(MODEL_OPTIONS) < set(MODEL_OVERRIDES)
    assert {f.name for f in dataclasses.fields(TrainConfig)} >= set(MODEL_OPTIONS)


def test_the_cli_settings_reach_the_layer_and_kernel_unchanged():
    from nala_dit.models.dit import create_model

    cfg, _ = resolve(TrainConfig, ["--model", "NaLaDiT-T/2", "--norm-scale", "sqrt_d", "--power", "2.5",
                                   "--direction", "relu_split", "--lepe", "false"])
    overrides = {key: getattr(cfg, name) for name, key in MODEL_OVERRIDES.items() if getattr(cfg, name) is not None}
    model = create_model(cfg.model, input_size=8, **overrides)
    layers = [block.attn for block in model.blocks]
    assert layers[0].config == cfg.nala_config() and all(layer.config is layers[0].config for layer in layers)
    assert layers[0].lepe is None and layers[0].norm_scale() == math.sqrt(32)


def test_the_cli_gives_nalaconfigs_errors():
    with pytest.raises(ValueError) as err:
        TrainConfig(model="NaLaDiT-T/2", nala_regions=0).validate()
    assert_names(err, "nala-regions", "integer >= 1", "got 0")
    with pytest.raises(ValueError) as err:
        TrainConfig(model="NaLaDiT-T/2", nala_regions=2, rope=True).validate()
    assert_names(err, "region states", "rope", "use one of them")


# ------------------------------------------------------------------ configs of older versions
def _old_config(model) -> dict:
    """``dict(model.config)`` as the code before the ``positions`` key wrote it (into
    state.json's ``model_config``): the same keys, the position policy under ``pos_embed``."""
    c = model.config
    return {
        "input_size": c.input_size, "patch_size": c.patch_size, "in_channels": c.in_channels,
        "hidden_size": c.hidden_size, "depth": c.depth, "num_heads": c.num_heads, "mlp_ratio": c.mlp_ratio,
        "class_dropout_prob": c.class_dropout_prob, "num_classes": c.num_classes, "learn_sigma": c.learn_sigma,
        "objective": c.objective, "attention": c.attention, "direction": c.direction, "power": c.power,
        "offset": c.offset, "norm_scale": c.norm_scale, "alpha": c.alpha, "lepe": c.lepe, "gate": c.gate,
        "out_norm": c.out_norm, "rope": c.rope, "pos_embed": c.positions, "base_size": c.base_size,
        "softmax_blocks": c.softmax_blocks, "nala_regions": c.nala_regions, "mlp": c.mlp, "mix_init": c.mix_init,
        "_use_default_values": ["mlp_ratio", "direction", "power", "offset", "alpha", "lepe", "gate", "out_norm",
                                "rope", "softmax_blocks", "nala_regions", "mlp", "mix_init", "learn_sigma",
                                "objective", "patch_size", "depth", "hidden_size", "num_heads"],
    }


@pytest.fixture(scope="module")
def model():
    """A digits NaLaDiT fine-tuned up the ladder (``interpolate`` positions relative to a base
    grid of 4 latent px), perturbed: its outputs depend on the position policy being read."""
    from nala_dit.models.dit import create_model

    torch.manual_seed(0)
    m = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, positions="interpolate",
                     base_size=4, norm_scale="sqrt_d")
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return m.eval()


def _outputs(m):
    g = torch.Generator().manual_seed(1)
    t, y = torch.tensor([3.0, 500.0]), torch.tensor([1, 2])
    with torch.no_grad():
        return [m(torch.randn(2, 1, *hw, generator=g), t, y) for hw in ((8, 8), (12, 16))]


def _same_model(loaded, model):
    from nala_dit.models.dit import config_keys

    assert loaded.config.positions == "interpolate" and loaded.config.base_size == 4
    assert "pos_embed" not in loaded.config                           # the old key is read, not kept
    assert torch.equal(loaded.pos_embed, model.pos_embed)
    for a, b in zip(_outputs(loaded), _outputs(model)):
        assert torch.equal(a, b)
    other = type(model)(**{**config_keys(loaded.config), "positions": "extrapolate"}).eval()
    other.load_state_dict(loaded.state_dict())
    assert not torch.equal(_outputs(other)[1], _outputs(model)[1])  # the policy read matters at other sizes


def test_a_checkpoint_with_the_old_key_loads_and_resumes(model, tmp_path):
    from nala_dit.training import checkpoint as ckpt_lib

    old = _old_config(model)
    assert "positions" not in old and old["pos_embed"] == "interpolate"
    cfg = TrainConfig(model="NaLaDiT-T/2", data="digits", pos_embed="interpolate", norm_scale="sqrt_d")
    state = dict(step=5, epoch=0, position=5, world_size=1, config=to_dict(cfg), model_config=old)
    ckpt_lib.save_checkpoint(tmp_path / "run" / "checkpoints", model=model, ema=model, state=state,
                             optimizer=torch.optim.AdamW(model.parameters()), rng_states=[torch.get_rng_state()])
    written = json.loads(next((tmp_path / "run" / "checkpoints").glob("*/state.json")).read_text())
    assert written["model_config"]["pos_embed"] == "interpolate"                # the old file, as written

    loaded, ckpt = ckpt_lib.load_model(tmp_path / "run")
    _same_model(loaded, model)
    assert ckpt.model_config["positions"] == "interpolate" and "pos_embed" not in ckpt.model_config
    # Resuming it with the same settings changes nothing; another policy is named by its flag.
    assert ckpt_lib.config_changes(ckpt, to_dict(cfg), dict(loaded.config)) == {}
    other = dict(loaded.config, positions="extrapolate")
    assert ckpt_lib.config_changes(ckpt, to_dict(cfg), other) == {"pos-embed": ("interpolate", "extrapolate")}


def test_an_exported_folder_with_the_old_key_loads(model, tmp_path):
    from nala_dit.models.dit import DiT
    from nala_dit.models.dit import DiT
    from nala_dit.models.files import check_transformer_folder
    from nala_dit.pipelines.pipeline import (
        DiTPipelineTransformer,
        NaLaDiTPipeline,
        load_pipeline,
    )
    from nala_dit.pipelines.sources import load_source

    NaLaDiTPipeline.from_model(model).save_pretrained(str(tmp_path / "pipe"))
    config_file = tmp_path / "pipe" / "transformer" / "config.json"
    # transformer/config.json as the code before ``positions`` wrote it (diffusers' save_config:
    # no ``_use_default_values``, ``_class_name`` and ``_diffusers_version`` added).
    old = {k: v for k, v in _old_config(model).items() if k != "_use_default_values"}
    old.update(_class_name="DiT", _diffusers_version=json.loads(config_file.read_text())["_diffusers_version"])
    config_file.write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")

    check_transformer_folder(tmp_path / "pipe" / "transformer", DiT)
    _same_model(DiT.from_pretrained(str(tmp_path / "pipe" / "transformer")), model)
    _same_model(DiT.from_pretrained(str(tmp_path / "pipe" / "transformer")), model)
    _same_model(load_pipeline(tmp_path / "pipe").transformer, model)
    _same_model(load_source(tmp_path / "pipe").model, model)
    # diffusers' DiTPipeline adapter carries the whole DiT config (with diffusers' bookkeeping) in its own.
    with torch.device("meta"):
        adapter = DiTPipelineTransformer(_old_config(model), 8, 1, 2)
    assert adapter.dit.config.positions == "interpolate" and adapter.dit.config.base_size == 4
