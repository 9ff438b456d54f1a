"""Representation alignment (nala_dit/training/repa.py): the loss, the encoders, the resizing rule,
and training with it (checkpoint, EMA, export, bitwise resume)."""

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

import nala_dit  # noqa: F401  (teaches diffusers our pipeline names)
from nala_dit.training import repa
from nala_dit.training.tracking import progress_values
from tests.data.test_datasets import write_latent_folder
from tests.utils import DEEP, assert_names, one_line


def test_alignment_loss_against_a_hand_computation():
    # A fixed projector: identity-like weights on 2-d tokens, biases 0, so SiLU(x) is known.
    proj = repa.build_projector(2, 2, 2)
    with torch.no_grad():
        for layer in (proj[0], proj[2], proj[4]):
            layer.weight.copy_(torch.eye(2))
            layer.bias.zero_()
    tokens = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])           # (B=1, T=2, D=2)
    features = torch.tensor([[[1.0, 1.0], [3.0, 0.0]]])
    # silu(silu(1)) = silu(0.7310586) = 0.7310586 / (1 + e^-0.7310586) = 0.4918, silu(0) = 0: token 0 → (0.4918, 0),
    # cos with (1, 1) = 1/√2; token 1 → (0, silu(silu(2))) ⟂ (3, 0): cos 0.
    projected = proj(tokens)
    s1 = torch.nn.functional.silu(torch.nn.functional.silu(torch.tensor(1.0)))
    assert projected[0, 0].tolist() == pytest.approx([s1.item(), 0.0])
    loss, cos = repa.alignment_loss(projected, features)
    assert cos.item() == pytest.approx((1 / 2 ** 0.5 + 0.0) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(-cos.item())
    loss.backward()  # the loss trains the projector
    assert proj[0].weight.grad is not None
    with pytest.raises(ValueError) as err:
        repa.alignment_loss(projected, torch.zeros(1, 3, 2))
    assert_names(err, "projected tokens (1, 2, 2)", "encoder features (1, 3, 2)", "differ")


def test_images_are_resized_so_the_encoder_patch_grid_is_a_non_square_token_grid():
    # A 2x3 token grid, encoder patch 2: the image goes to 4x6 px. A horizontal ramp 0..11 over
    # 12 px halved by bicubic (a = -0.75, align_corners False) samples at x = 2i + 0.5 with
    # weights (-0.09375, 0.59375, 0.59375, -0.09375) on pixels 2i-1..2i+2 (edges clamped).
    ramp = torch.arange(12.0).repeat(8, 1)[None, None]            # (1, 1, 8, 12), values 0..11
    images = ramp / 11 * 2 - 1                                    # in [-1, 1]: back to 0..11/11 in [0, 1]
    x = repa.encoder_input(images, (2, 3), 2, mean=(0.0,), std=(1 / 11,), channels=1)
    assert x.shape == (1, 1, 4, 6)
    first = -0.09375 * 0 + 0.59375 * 0 + 0.59375 * 1 - 0.09375 * 2   # pixel -1 clamped to 0
    last = -0.09375 * 9 + 0.59375 * 10 + 0.59375 * 11 - 0.09375 * 11  # pixel 12 clamped to 11
    expected = [first, 2.5, 4.5, 6.5, 8.5, last]
    for row in x[0, 0]:
        assert row.tolist() == pytest.approx(expected, abs=1e-4)
    # one channel repeated to an RGB encoder's three
    assert repa.encoder_input(images, (4, 6), 2, repa.IMAGENET_MEAN, repa.IMAGENET_STD, 3).shape == (1, 3, 8, 12)


def test_a_saved_dinov2_loads_offline_and_gives_the_token_grid(tiny_dinov2, monkeypatch):
    from transformers import Dinov2Model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    encoder = repa.load_encoder(tiny_dinov2)
    assert (encoder.patch_size, encoder.dim, encoder.channels) == (4, 32, 3)
    assert not encoder.module.training and not any(p.requires_grad for p in encoder.module.parameters())
    images = torch.rand(2, 1, 8, 8) * 2 - 1
    feats = encoder.features(images, (2, 3))                      # a non-square 2x3 grid: 8x12 px in
    assert feats.shape == (2, 6, 32)
    # the same numbers as the transformers model run by hand: final-norm tokens without CLS
    reference = Dinov2Model.from_pretrained(tiny_dinov2, local_files_only=True).eval()
    x = repa.encoder_input(images, (2, 3), 4, repa.IMAGENET_MEAN, repa.IMAGENET_STD, 3)
    with torch.no_grad():
        expected = reference(pixel_values=x).last_hidden_state[:, 1:]
    torch.testing.assert_close(feats, expected, rtol=0, atol=0)


def test_missing_encoder_files_are_one_line(tiny_dinov2, tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        repa.load_encoder(tmp_path / "nowhere")
    assert_names(err, f"--repa-encoder {tmp_path / 'nowhere'}", "no such folder",
                 "Dinov2Model.from_pretrained('facebook/dinov2-base')")
    assert "\n" not in str(err.value)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_dinov2 / "config.json").read_text())
    with pytest.raises(FileNotFoundError) as err:
        repa.load_encoder(broken)
    assert_names(err, f"--repa-encoder {broken}", f"{broken / 'model.safetensors'} is missing", "safetensors only")
    assert "\n" not in str(err.value)
    (broken / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"{broken / 'config.json'} is missing"):
        repa.load_encoder(broken)
    (broken / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="holds a 'bert' model"):
        repa.load_encoder(broken)


# --- training with alignment ------------------------------------------------------------

def aligned_run(tmp_path, encoder, *extra, name="run"):
    from tests.training.test_loop import run_train

    return run_train(tmp_path, "--repa-encoder", str(encoder), "--repa-projector-dim", "16", "--flip", "true",
                     *extra, name=name)


def test_aligned_run_resumes_bitwise_and_the_projector_stays_out_of_ema_and_export(tmp_path, tiny_dinov2, capsys):
    from safetensors.torch import load_file

    import export
    from nala_dit.training import checkpoint as ckpt_lib
    from tests.training.test_loop import read_log

    straight = aligned_run(tmp_path, tiny_dinov2, "--max-steps", "4", "--ckpt-every", "4", name="straight")
    resumed = aligned_run(tmp_path, tiny_dinov2, "--max-steps", "2", "--ckpt-every", "2", name="resumed")
    aligned_run(tmp_path, tiny_dinov2, "--max-steps", "4", "--ckpt-every", "4", "--resume", "auto", name="resumed")
    a, b = ckpt_lib.open_checkpoint(straight), ckpt_lib.open_checkpoint(resumed)
    for which in ("model", "ema", "projector"):
        wa, wb = a.weights(which), b.weights(which)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), which
    assert a.optimizer_state()["state"].keys() == b.optimizer_state()["state"].keys()
    log = read_log(straight)
    keys = ("loss", "loss_simple", "loss_align", "align_cos")
    assert [[r[k] for k in keys] for r in log] == [[r[k] for k in keys] for r in read_log(resumed)]
    for r in log:  # loss = diffusion + λ·(−cos), λ = 0.5; −cos is the logged alignment loss
        assert r["loss"] == pytest.approx(r["loss_simple"] + 0.5 * r["loss_align"], rel=1e-5)
        assert r["align_cos"] == pytest.approx(-r["loss_align"], rel=1e-6) and -1 < r["align_cos"] < 1
    # The projector (3 linears, T/2's hidden 128 → 16 → 16 → the encoder's 32) is its own file and
    # optimizer entries; the model and EMA hold exactly a plain model's tensors.
    projector = a.weights("projector")
    assert {k: tuple(v.shape) for k, v in projector.items()} == {
        "0.weight": (16, 128), "0.bias": (16,), "2.weight": (16, 16), "2.bias": (16,), "4.weight": (32, 16),
        "4.bias": (32,)}
    plain = ckpt_lib.build_model_from_config(a.model_config).state_dict()
    assert a.weights("model").keys() == a.weights("ema").keys() == plain.keys()
    model_params = sum(1 for _ in ckpt_lib.build_model_from_config(a.model_config).parameters())
    assert sum(len(g["params"]) for g in a.optimizer_state()["param_groups"]) == model_params + 6
    out = tmp_path / "pipe"
    assert export.main(["checkpoint", str(straight), str(out)]) == 0
    exported = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert exported.keys() == plain.keys() and all(torch.equal(exported[k], a.weights("ema")[k]) for k in exported)
    assert not [p for p in out.rglob("*") if "projector" in p.name]
    # Resuming without the encoder (or a plain checkpoint with it) is one line.
    import train as train_cli
    from tests.utils import TINY_RUN

    capsys.readouterr()
    assert train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "resumed", "--max-steps", "5",
                                      "--flip", "true", "--resume", "auto"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert_names(err[0], f"error: checkpoint {b.path}", "other settings", "2048 now",
                 f"--repa-encoder {tiny_dinov2} --repa-projector-dim 16",
                 "--allow-changes repa-encoder,repa-projector-dim")


def test_repa_options_are_checked(tmp_path, tiny_dinov2):
    from nala_dit.cli.options import TrainConfig

    with pytest.raises(ValueError) as err:
        TrainConfig(repa_encoder=str(tiny_dinov2), repa_depth=13).validate()
    assert_names(err, "--repa-depth 13", "NaLaDiT-S/2", "blocks 1..12")
    with pytest.raises(ValueError) as err:
        TrainConfig(repa_depth=3).validate()
    assert_names(err, "--repa-depth", "--repa-encoder FOLDER")
    assert [repa.default_depth(m) for m in ("NaLaSiT-XL/2", "DiT-L/2", "NaLaDiT-B/2", "SiT-S/2", "NaLaDiT-T/2")] \
        == [8, 8, 4, 4, 1]


def test_the_digits_encoder_is_label_free_deterministic_and_trains_a_model(tmp_path):
    from nala_dit.training import checkpoint as ckpt_lib
    from tests.training.test_loop import read_log

    a = repa.train_digits_encoder(tmp_path / "a", steps=20, print=lambda *_: None)
    b = repa.train_digits_encoder(tmp_path / "b", steps=20, print=lambda *_: None)
    ea, eb = repa.load_encoder(a), repa.load_encoder(b)
    assert all(torch.equal(x, y) for x, y in zip(ea.module.state_dict().values(), eb.module.state_dict().values()))
    assert (ea.patch_size, ea.dim, ea.channels) == (2, 64, 1)
    images = torch.rand(3, 1, 8, 8) * 2 - 1
    assert ea.features(images, (4, 4)).shape == (3, 16, 64)      # 8-px digits at patch 2
    assert ea.features(images, (8, 8)).shape == (3, 64, 64)      # 16-px digits: the image resized to 16 px
    run = aligned_run(tmp_path, a, "--max-steps", "2", "--ckpt-every", "2")
    assert [r["step"] for r in read_log(run) if "align_cos" in r] == [1, 2]
    assert ckpt_lib.open_checkpoint(run).weights("projector")["4.weight"].shape == (64, 16)
    # The command line never overwrites an encoder, and --help is help, not a folder to train into.
    before = (a / repa.DIGITS_ENCODER_WEIGHTS).read_bytes()
    assert repa.main([str(a)]) == 1 and (a / repa.DIGITS_ENCODER_WEIGHTS).read_bytes() == before
    with pytest.raises(SystemExit) as stop:
        repa.main(["--help"])
    assert stop.value.code == 0 and not (tmp_path / "--help").exists()
    (a / repa.DIGITS_ENCODER_WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError) as err:
        repa.load_encoder(a)
    assert_names(err, f"--repa-encoder {a}", f"{a / repa.DIGITS_ENCODER_WEIGHTS} is missing")


@pytest.mark.parametrize("name, overrides, checkpointing", [
    ("NaLaSiT-T/2", dict(softmax_blocks="every:2", mlp="mix"), False),   # hybrid, Mix-FFN
    ("DiT-T/2", {}, True),                                                # softmax, gradient checkpointing
    ("NaLaDiT-T/2", dict(nala_regions=2), False),                         # region states
])
def test_block_k_tokens_are_aligned_and_the_forward_is_unchanged(name, overrides, checkpointing):
    from nala_dit.models.dit import create_model

    torch.manual_seed(0)
    model = create_model(name, input_size=8, in_channels=1, num_classes=10, **overrides).eval()  # no label dropout
    model.gradient_checkpointing = checkpointing
    x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])
    plain = model(x, t, y)
    projector = repa.build_projector(model.config.hidden_size, 16, 8)
    aligned = repa.Aligned(model, model, projector, depth=2)
    assert torch.equal(aligned(x, t, y), plain)
    assert aligned.projected.shape == (2, 16, 8)                  # 4x4 tokens
    loss, _ = repa.alignment_loss(aligned.projected, torch.randn(2, 16, 8))
    loss.backward()
    # Block 2's output: blocks 1-2 (and the embedders) get gradients, blocks 3-4 and the final layer none.
    grads = [any(p.grad is not None and p.grad.abs().sum() > 0 for p in b.parameters()) for b in model.blocks]
    assert grads == [True, True, False, False]
    assert all(p.grad is None for p in model.final_layer.parameters())
    assert torch.equal(model(x, t, y), plain) and aligned.tokens is None   # outside the wrapper: nothing kept


@pytest.mark.slow
def test_the_hook_keeps_block_k_under_torch_compile():
    """``--compile`` wraps the model in ``torch.compile`` after the hook is registered: dynamo
    traces the hook into the graph and replays its side effect (the kept tokens), so the
    projected tokens and their gradients are the eager ones. The ``eager`` backend checks
    the tracing (what could drop the hook) in seconds; inductor only generates the kernels."""
    from nala_dit.models.dit import create_model

    torch.manual_seed(0)
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10).eval()
    x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])
    features = torch.randn(2, 16, 8)
    projector = repa.build_projector(model.config.hidden_size, 16, 8)
    results = []
    for train_model in (model, torch.compile(model, backend="eager")):
        aligned = repa.Aligned(model, train_model, projector, depth=2)
        out = aligned(x, t, y)
        loss, _ = repa.alignment_loss(aligned.projected, features)
        model.zero_grad(set_to_none=True)
        loss.backward()
        results.append((out.detach(), aligned.projected.detach(), model.blocks[0].attn.qkvg.weight.grad.clone()))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_keep_images_cache_resumes_and_trains_aligned_with_the_image_flipped_as_the_latent(tmp_path, tiny_dinov2,
                                                                                          capsys):
    from safetensors.torch import load_file

    import train as train_cli
    from extract_latents import main as extract_main
    from nala_dit.data import datasets as data_lib
    from nala_dit.training.step import to_model_space
    from tests.training.test_loop import make_image_folder, read_log, tiny_vae
    from tests.utils import TINY_RUN

    images, vae = make_image_folder(tmp_path / "images"), tiny_vae(tmp_path / "vae")
    argv = ["--data", str(images), "--vae", str(vae), "--image-size", "64", "--shard-size", "4", "--num-workers", "0",
            "--dtype", "float32"]
    assert extract_main(argv + ["--out", str(tmp_path / "plain")]) == 0
    # A cache without images is refused with the fix, in one line.
    capsys.readouterr()
    assert train_cli.main(TINY_RUN + ["--data", str(tmp_path / "plain"), "--vae", str(vae), "--results-dir",
                                      str(tmp_path), "--repa-encoder", str(tiny_dinov2), "--max-steps", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tmp_path / 'plain'}: ") and "\n" not in err, err
    assert_names(err, "without images", "extract_latents.py", "--keep-images", "another --out")
    out = tmp_path / "lat"
    assert extract_main(argv + ["--out", str(out), "--keep-images"]) == 0
    shards = sorted(out.glob("latents-*.safetensors"))
    first = shards[0].stat().st_mtime_ns
    shards[1].unlink()                                            # interrupted before the second shard
    assert extract_main(argv + ["--out", str(out), "--keep-images"]) == 0
    assert shards[0].stat().st_mtime_ns == first and shards[1].is_file()
    # The stored image is the resized image the latents encode, as uint8.
    x, _ = data_lib.ImageFolderDataset(images, 64)[5]
    stored = load_file(str(shards[1]))["images"][1]
    assert stored.dtype == torch.uint8 and torch.equal(stored.float() / 127.5 - 1, x)
    assert extract_main(argv + ["--out", str(tmp_path / "plain"), "--keep-images"]) == 1   # no silent mix
    # The image is mirrored exactly where the latent is: near-zero variance makes the latent its mean.
    lat = data_lib.LatentDataset(out, images=True)
    moments = torch.randn(8, 2, 2, 4, 8, 8)
    moments[:, :, 1] = -30.0
    pixels = torch.randint(0, 256, (8, 3, 64, 64), dtype=torch.uint8)
    torch.manual_seed(3)
    z, seen = to_model_space([moments, pixels], dataset=lat, vae=None, norm=1.0, flip=True, images=True)
    mirrored = [bool(torch.allclose(z[i], moments[i, 1, 0], atol=1e-5)) for i in range(8)]
    assert 0 < sum(mirrored) < 8
    for i, m in enumerate(mirrored):
        plain = pixels[i].float() / 127.5 - 1
        assert torch.equal(seen[i], plain.flip(-1) if m else plain)
    run = aligned_run(tmp_path, tiny_dinov2, "--data", str(out), "--vae", str(vae), "--global-batch-size", "2",
                      "--max-steps", "2", "--ckpt-every", "2", name="latent")
    assert [r["step"] for r in read_log(run) if "align_cos" in r] == [1, 2]


@pytest.mark.slow
def test_aligned_run_with_context_parallel_2_gives_the_one_process_weights(tmp_path, tiny_dinov2):
    """Each rank aligns its own rows of block K's tokens against the same rows of the encoder's
    features; the cosine sums are all-reduced. Two processes splitting each image therefore
    train what one process trains (weights, projector, logged alignment), up to the order of
    fp32 sums."""
    from safetensors.torch import load_file

    import train as train_cli
    from nala_dit.training import checkpoint as ckpt_lib
    from tests.attention.test_context_parallel import CP_RUN, TOL
    from tests.training.test_loop import read_log
    from tests.ranks import run_ranks

    run = CP_RUN + ["--repa-encoder", str(tiny_dinov2), "--repa-projector-dim", "16", "--results-dir", str(tmp_path)]
    proc = run_ranks(tmp_path, "train.py", *run, "--context-parallel", "2", "--exp-name", "cp2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_cli.main(run + ["--exp-name", "one"]) == 0
    split, one = (ckpt_lib.open_checkpoint(tmp_path / name) for name in ("cp2", "one"))
    for which in ("model", "projector"):
        a, b = (load_file(str(c.path / f"{which}.safetensors")) for c in (split, one))
        assert a.keys() == b.keys()
        worst = max((a[k] - b[k]).abs().max().item() for k in b)
        assert worst <= TOL, (which, worst)
    logs = [read_log(tmp_path / name) for name in ("cp2", "one")]
    assert len(logs[0]) == len(logs[1]) == 3
    for a, b in zip(*logs):
        assert a["align_cos"] == pytest.approx(b["align_cos"], abs=1e-6)
        assert a["loss_align"] == pytest.approx(b["loss_align"], abs=1e-6)
    assert logs[1][0]["align_cos"] != logs[1][-1]["align_cos"]   # the alignment trained


# --- item 2: REPA encoder weights are safetensors or nothing ------------------------------
class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.pt", "model.pth", "model.ckpt",
                                     "../model.safetensors"])
def test_repa_index_naming_a_non_safetensors_file_is_refused_before_transformers(tiny_dinov2, tmp_path,  # noqa: F811
                                                                                monkeypatch, weights):
    from transformers import Dinov2Model

    from nala_dit.training import repa

    called = []
    monkeypatch.setattr(Dinov2Model, "from_pretrained", classmethod(lambda cls, *a, **k: called.append(a)))
    folder = tmp_path / "enc"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_dinov2 / "config.json").read_text())
    marker = tmp_path / "ran"
    torch.save({"x": Payload(marker)}, tmp_path / "payload")
    target = (folder / weights)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes((tmp_path / "payload").read_bytes())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"embeddings.cls_token": weights, "layernorm.weight": weights}}))
    with pytest.raises(ValueError) as err:
        repa.load_encoder(folder)
    text = one_line(err)
    assert f"--repa-encoder {folder}" in text and repr(weights) in text and "safetensors" in text
    assert not called and not marker.exists()


def test_repa_index_that_is_not_an_index_is_one_line(tiny_dinov2, tmp_path):  # noqa: F811
    from nala_dit.training import repa

    folder = tmp_path / "enc"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_dinov2 / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    for content, words in ((DEEP, "nested too deeply"), ("[1]", "weight_map"), ('{"weight_map": [1]}', "weight_map"),
                           ('{"weight_map": {"a": "gone.safetensors"}}', "missing")):
        index.write_text(content)
        with pytest.raises((ValueError, FileNotFoundError)) as err:
            repa.load_encoder(folder)
        assert str(index) in one_line(err) or "gone.safetensors" in one_line(err)
        assert words in one_line(err)


# --- the REPA encoder's files -------------------------------------------------------------
def dino_copy(src: Path, dst: Path, **config) -> Path:
    import shutil

    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**data, **config}))
    return dst


@pytest.fixture
def digits_encoder(tmp_path):
    return repa.save_digits_encoder(repa.DigitsEncoder(width=8, dim=4), tmp_path / "digits")


class ShellPayload:
    def __reduce__(self):
        return (os.system, ("echo ran",))


def test_repa_on_a_cache_whose_shards_hold_no_images_is_one_line(tmp_path):
    from nala_dit.data.datasets import LatentDataset

    meta = write_latent_folder(tmp_path / "lat")
    (tmp_path / "lat" / "meta.json").write_text(json.dumps({**meta, "images": True}))   # says so, holds none
    with pytest.raises(ValueError) as err:
        LatentDataset(tmp_path / "lat", images=True)
    assert "latents-000000.safetensors" in one_line(err) and "no 'images'" in one_line(err)
    assert "--keep-images" in one_line(err)


def test_a_deep_dinov2_config_is_one_line(tiny_dinov2, tmp_path):  # noqa: F811
    folder = dino_copy(tiny_dinov2, tmp_path / "enc")
    (folder / "config.json").write_text(DEEP)
    with pytest.raises(ValueError) as err:
        repa.load_encoder(folder)
    assert_names(one_line(err), f"--repa-encoder {folder}", f"{folder / 'config.json'}", "nested too deeply")


@pytest.mark.parametrize("hidden", [64, 65536])
def test_a_dinov2_config_with_another_hidden_size_is_refused_before_building(tiny_dinov2, tmp_path,  # noqa: F811
                                                                           monkeypatch, hidden):
    from transformers import Dinov2Model

    called = []
    monkeypatch.setattr(Dinov2Model, "from_pretrained", classmethod(lambda cls, *a, **k: called.append(a)))
    folder = dino_copy(tiny_dinov2, tmp_path / "enc", hidden_size=hidden, num_attention_heads=2)
    with pytest.raises(ValueError) as err:
        repa.load_encoder(folder)
    assert f"hidden_size {hidden:,} where the weights have 32" in one_line(err) and str(folder) in one_line(err)
    assert not called


@pytest.mark.parametrize("case, words", [
    ("extra key", "unknown key(s) ['extra']"),
    ("list", "must hold a JSON object, got list"),
    ("deep", "nested too deeply"),
    ("width 1e7", "'width' must be a positive integer, got 10000000.0"),
    ("width 10000000", "does not describe"),
    ("truncated weights", "not a readable safetensors file"),
    ("renamed pickle", "not a readable safetensors file"),
])
def test_a_damaged_digits_encoder_is_one_line(digits_encoder, case, words):
    config_file = digits_encoder / repa.DIGITS_ENCODER_JSON
    weights = digits_encoder / repa.DIGITS_ENCODER_WEIGHTS
    config = json.loads(config_file.read_text())
    if case == "extra key":
        config_file.write_text(json.dumps({**config, "extra": 1}))
    elif case == "list":
        config_file.write_text("[1, 2]")
    elif case == "deep":
        config_file.write_text(DEEP)
    elif case == "width 1e7":
        config_file.write_text(json.dumps(config).replace('"width": 8', '"width": 1e7'))
    elif case == "width 10000000":
        config_file.write_text(json.dumps({**config, "width": 10_000_000}))
    elif case == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:200])
    else:
        weights.write_bytes(pickle.dumps({"net.0.weight": ShellPayload()}))
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        repa.load_encoder(digits_encoder)
    text = one_line(err)
    assert f"--repa-encoder {digits_encoder}" in text and words in text and "train_digits_encoder" in text


ROOT = Path(__file__).resolve().parents[2]


def test_progress_shows_the_diffusion_loss_and_the_alignment_apart():
    combined = dict(loss=-0.35, images_per_sec=100.0, loss_simple=0.1, loss_align=-0.9, align_cos=0.9)
    shown = progress_values(combined)
    assert shown["loss"] == "0.1000" and shown["cos"] == "0.900"     # not the combined (negative) 0.1 - 0.45
    plain = progress_values(dict(loss=0.25, images_per_sec=100.0))
    assert plain["loss"] == "0.2500" and "cos" not in plain


def test_alignment_md_gives_the_measured_repa_cost_and_the_progress_fields():
    text = (ROOT / "docs" / "alignment.md").read_text()
    section = text[text.index("## Representation alignment (REPA)"):]
    assert re.search(r"measured[^.]*\d(\.\d+)?× (the|a) step", section), "the measured ratio at T/2"
    assert "XL/2" in section and "encoder" in section
    assert "`cos`" in section and "diffusion loss" in section
