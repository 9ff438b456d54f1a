"""Issue 45 item 10: one line naming the file, the problem and the fix, where a traceback
came before: latent caches, REPA encoders (DINOv2 and the digits encoder), JSON files
that did not name themselves, an edited ``wandb-id``, and rank 0 after a peer is killed."""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nala_dit.training import repa
from tests.test_hostile_inputs import write_latent_folder
from tests.test_repa import tiny_dinov2  # noqa: F401  (fixture)

DEEP = "[" * 100_000 + "]" * 100_000


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# --- latent caches ------------------------------------------------------------------------
def test_a_deep_latent_meta_json_is_one_line(tmp_path):
    from nala_dit.data.datasets import LatentDataset

    write_latent_folder(tmp_path / "lat")
    (tmp_path / "lat" / "meta.json").write_text(DEEP)
    with pytest.raises(ValueError) as err:
        LatentDataset(tmp_path / "lat")
    assert f"{tmp_path / 'lat' / 'meta.json'}: nested too deeply" in one_line(err)
    assert "rerun extract_latents.py" in one_line(err)


@pytest.mark.parametrize("shape", [(2, 2, 4, 2, 2), (2, 2, 2, 3, 2, 2), (2, 2, 2, 4, 2, 3)])
def test_a_shard_whose_moments_have_the_wrong_shape_is_one_line(tmp_path, shape):
    from nala_dit.data.datasets import LatentDataset

    write_latent_folder(tmp_path / "lat")
    shard = tmp_path / "lat" / "latents-000000.safetensors"
    save_file({"moments": torch.zeros(shape), "labels": torch.tensor([0, 1])}, str(shard))
    with pytest.raises(ValueError) as err:
        LatentDataset(tmp_path / "lat")
    assert str(shard) in one_line(err) and "'moments'" in one_line(err) and str(shape) in one_line(err)
    assert "rerun extract_latents.py" in one_line(err)


def test_repa_on_a_cache_whose_shards_hold_no_images_is_one_line(tmp_path):
    from nala_dit.data.datasets import LatentDataset

    meta = write_latent_folder(tmp_path / "lat")
    (tmp_path / "lat" / "meta.json").write_text(json.dumps({**meta, "images": True}))   # says so, holds none
    with pytest.raises(ValueError) as err:
        LatentDataset(tmp_path / "lat", images=True)
    assert "latents-000000.safetensors" in one_line(err) and "no 'images'" in one_line(err)
    assert "--keep-images" in one_line(err)


# --- the REPA encoder's files -------------------------------------------------------------
def dino_copy(src: Path, dst: Path, **config) -> Path:
    import shutil

    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**data, **config}))
    return dst


def test_a_deep_dinov2_config_is_one_line(tiny_dinov2, tmp_path):  # noqa: F811
    folder = dino_copy(tiny_dinov2, tmp_path / "enc")
    (folder / "config.json").write_text(DEEP)
    with pytest.raises(ValueError) as err:
        repa.load_encoder(folder)
    assert f"--repa-encoder {folder}: {folder / 'config.json'}: nested too deeply" in one_line(err)


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


@pytest.fixture
def digits_encoder(tmp_path):
    return repa.save_digits_encoder(repa.DigitsEncoder(width=8, dim=4), tmp_path / "digits")


class ShellPayload:
    def __reduce__(self):
        return (os.system, ("echo ran",))


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


# --- JSON files that did not name themselves ----------------------------------------------
def test_bad_json_names_its_file(tmp_path):
    from nala_dit.pipelines.sources import read_labels_file

    labels = tmp_path / "labels.json"
    for content in ("{not json", DEEP, "3"):
        labels.write_text(content)
        with pytest.raises(ValueError) as err:
            read_labels_file(labels)
        assert str(labels) in one_line(err)


def test_bad_shard_settings_json_names_its_file(tmp_path, capsys):
    import sample
    from tests.test_sample_cli import FAST, write_checkpoint

    run = write_checkpoint(tmp_path / "run")
    out = tmp_path / "s.npz"
    argv = ["--ckpt", str(run), "--num-samples", "10", *FAST, "--batch-size", "5", "--shard-size", "5"]
    assert sample.main(argv + ["--out", str(out), "--stop-after", "1"]) == 0
    settings = Path(f"{out}.parts") / "settings.json"
    settings.write_text("{oops")
    capsys.readouterr()
    assert sample.main(argv[:-2] + ["--out", str(out)]) == 1         # no --shard-size: the stored one is read
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(settings) in err and f"delete {out}.parts" in err


def test_bad_digits_classifier_info_names_its_file(digits_classifier_dir, tmp_path):
    import shutil

    from nala_dit.data.digits import CLASSIFIER_INFO, load_digits_classifier

    folder = shutil.copytree(digits_classifier_dir, tmp_path / "clf")
    (folder / CLASSIFIER_INFO).write_text("{oops")
    with pytest.raises(ValueError) as err:
        load_digits_classifier(folder)
    assert str(folder / CLASSIFIER_INFO) in one_line(err)


# --- an edited wandb-id on resume -----------------------------------------------------------
@pytest.mark.parametrize("edited", ["", "a/b", "two\nlines", "x" * 200, " spaced "])
def test_an_edited_wandb_id_is_one_line(tmp_path, edited):
    pytest.importorskip("wandb")
    from nala_dit.training.tracking import make_trackers

    (tmp_path / "wandb-id").write_text(edited)
    with pytest.raises(ValueError) as err:
        make_trackers("wandb", tmp_path, 5)
    text = one_line(err)
    assert str(tmp_path / "wandb-id") in text and "not a wandb run id" in text and "delete the file" in text


# --- rank 0 after a peer is killed ----------------------------------------------------------
@pytest.mark.parametrize("rank", ["0", "1"])
def test_after_a_peer_is_killed_rank_0_does_not_point_at_itself(monkeypatch, capsys, rank):
    from nala_dit.cli.parse import run_main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)

    def main():
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")

    assert run_main(main) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"rank {rank}: stopped because another process")
    if rank == "0":
        assert "from rank 0" not in err and "launcher's report" in err
    else:
        assert "the line above from rank 0" in err
