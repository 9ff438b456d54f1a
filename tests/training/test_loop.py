"""train.py: config resolution, resume equivalence, atomic saves, latents, bad input."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import train as train_cli
from nala_dit.cli.config import resolve
from nala_dit.cli.options import TrainConfig
from nala_dit.training import checkpoint as ckpt_lib
from tests.utils import TINY_RUN, _train_main, assert_names, launch

ROOT = Path(__file__).resolve().parents[2]

# Tiny pixel-space digits run: a few steps take seconds.


def run_train(tmp_path, *extra, name="run"):
    argv = TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", name, *extra]
    assert train_cli.main(argv) == 0
    return tmp_path / name


def read_log(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def test_config_precedence_and_unknown_keys(tmp_path, capsys):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model: DiT-S/2\nlr: 3.0e-4\nglobal-batch-size: 32\n")
    cfg, _ = resolve(TrainConfig, ["--config", str(cfg_file), "--lr", "5e-4"])
    assert cfg.model == "DiT-S/2" and cfg.lr == 5e-4 and cfg.global_batch_size == 32 and cfg.ema_decay == 0.9999
    cfg_file.write_text("global_batch_size: 32\n")
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--config", str(cfg_file)])
    assert_names(capsys.readouterr().err, "unknown key 'global_batch_size'", "did you mean 'global-batch-size'")
    with pytest.raises(SystemExit):  # no prefix abbreviations, no silent typos
        resolve(TrainConfig, ["--global-batch", "32"])
    assert "unrecognized arguments: --global-batch" in capsys.readouterr().err
    assert train_cli.main(["--config", str(ROOT / "configs/nala_dit_s2_imagenet256.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model: NaLaDiT-S/2" in out and "global-batch-size: 256" in out and "max-steps: 400000" in out


def test_help_states_each_default_once_and_synonyms_are_suggested(tmp_path, capsys):
    from nala_dit.cli.config import build_parser

    helps = {a.dest: a.help for a in build_parser(TrainConfig)._actions}
    assert helps["exp_name"] == "run folder name (default: the model name)"
    assert helps["lr"] == "AdamW learning rate (constant after --warmup-steps) (default: 0.0001)"
    assert helps["attention"] == "override the preset's attention"  # no "(default: None)"
    assert all(h.count("default") <= 1 and "(default: None)" not in h for h in helps.values())
    cfg_file = tmp_path / "c.yaml"
    for key in ("learning-rate", "learning_rate"):
        cfg_file.write_text(f"{key}: 3.0e-4\n")
        with pytest.raises(SystemExit):
            resolve(TrainConfig, ["--config", str(cfg_file)])
        assert_names(capsys.readouterr().err, str(cfg_file), f"unknown key '{key}'", "did you mean 'lr'")
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--learning-rate", "1e-3"])
    assert_names(capsys.readouterr().err, "unrecognized arguments: --learning-rate", "did you mean --lr")


def test_yaml_python_tags_and_syntax_errors_are_one_line(tmp_path, capsys):
    cfg_file = tmp_path / "evil.yaml"
    marker = tmp_path / "ran"
    for text, words in ((f'lr: 1.0e-4\nseed: !!python/object/apply:os.system ["touch {marker}"]\n',
                         ("line 2", "!!python/object/apply:os.system", "refused", "plain values")),
                        ("lr: [1, 2\n", ("line 2", "not valid YAML", "expected ',' or ']'"))):
        cfg_file.write_text(text)
        with pytest.raises(SystemExit):
            resolve(TrainConfig, ["--config", str(cfg_file)])
        err = capsys.readouterr().err
        assert_names(err, f"error: {cfg_file}: ", *words)
        assert "Traceback" not in err, err
    assert not marker.exists()


def test_pipeline_index_with_a_list_class_name_is_one_line(tmp_path, capsys):
    import sample

    (tmp_path / "pipe").mkdir()
    index = tmp_path / "pipe" / "model_index.json"
    for text, what in (('{"_class_name": ["nala_dit", "NaLaDiTPipeline"]}', "_class_name ['nala_dit', 'NaLaDiTPipeline']"),
                       ('["NaLaDiTPipeline"]', "_class_name None"), ('{"_class_name": "DiTPipeline"}', "a DiTPipeline")):
        index.write_text(text)
        assert sample.main(["--ckpt", str(index.parent), "--labels", "1", "--grid", str(tmp_path / "g.png")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), err   # one line
        assert_names(err, str(index), f"holds {what}", "['NaLaDiTPipeline', 'NaLaSiTPipeline']", "export.py")
    index.write_text('{"_class_name": ')
    assert sample.main(["--ckpt", str(index.parent), "--labels", "1", "--grid", str(tmp_path / "g.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: "), err
    assert_names(err, str(index), "not valid JSON", "Expecting value")


def test_mistyped_checkpoint_path_names_the_nearest_one(digits_checkpoint, capsys):
    import sample

    typo = digits_checkpoint.parent / "digts-dit" / "checkpoint"
    assert sample.main(["--ckpt", str(typo), "--labels", "1", "--grid", "g.png"]) == 1
    err = capsys.readouterr().err
    assert_names(err, str(typo), "no checkpoint or pipeline folder",
                 f"did you mean {digits_checkpoint / 'checkpoints'}")
    with pytest.raises(FileNotFoundError, match=f"did you mean {digits_checkpoint}\\?"):
        ckpt_lib.find_checkpoint(digits_checkpoint.parent / "digits_dit")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint found at \S+ \(expected"):
        ckpt_lib.find_checkpoint(digits_checkpoint.parent / "unrelated-name")


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_resolve(config):
    """Every shipped config parses, names its model in its file name, and fits the recipe."""
    cfg, _ = resolve(TrainConfig, ["--config", str(ROOT / "configs" / config)])
    family, size = cfg.model.split("-")
    assert config.startswith(("nala_" if family.startswith("NaLa") else "") + family.replace("NaLa", "").lower()) \
        or config.startswith(("digits_", "cifar10_"))
    if config.startswith("cifar10_"):   # CIFAR-10 in pixel space: the name says the model, FID against the test split
        assert config.removeprefix("cifar10_").startswith(("nala_" if family.startswith("NaLa") else "")
                                                           + family.replace("NaLa", "").lower() + "_")
        assert size.replace("/", "").lower() in config and cfg.image_size == 32 and cfg.vae is None
        assert cfg.flip and cfg.fid_every > 0 and cfg.fid_ref.endswith("cifar10_test.npz")
    elif config.startswith("digits_"):
        assert cfg.data == "digits" and size == "T/2" and cfg.val_every > 0  # the embedded data: validation on
    elif config.endswith("_fast.yaml"):  # the 2025 recipe (docs/training.md)
        assert (cfg.t_sampling, cfg.adam_beta2, cfg.mixed_precision) == ("logit-normal", 0.95, "bf16")
        assert cfg.warmup_steps > 0 and cfg.max_grad_norm > 0 and cfg.val_every > 0 and cfg.fid_every > 0
    else:
        assert size.replace("/", "").lower() in config and cfg.global_batch_size == 256 and cfg.lr == 1e-4


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    straight = run_train(tmp_path, "--max-steps", "6", "--ckpt-every", "6", name="straight")
    # Interrupted after 3 steps (its last checkpoint), then resumed to 6.
    interrupted = run_train(tmp_path, "--max-steps", "3", "--ckpt-every", "3", name="resumed")
    run_train(tmp_path, "--max-steps", "6", "--ckpt-every", "6", "--resume", "auto", name="resumed")
    a = ckpt_lib.open_checkpoint(straight)
    b = ckpt_lib.open_checkpoint(interrupted)
    assert a.step == b.step == 6
    for which in ("model", "ema"):
        wa, wb = a.weights(which), b.weights(which)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), which
    assert [r["loss"] for r in read_log(straight)] == [r["loss"] for r in read_log(interrupted)]
    assert a.state["epoch"] == b.state["epoch"] and a.state["position"] == b.state["position"]


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run = run_train(tmp_path, "--max-steps", "2", "--ckpt-every", "2")
    real_save = ckpt_lib.save_file

    def dying_save(tensors, path):
        if "ema" in path:
            raise KeyboardInterrupt("killed mid-save")
        real_save(tensors, path)

    monkeypatch.setattr(ckpt_lib, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "4", "--resume", "auto")
    monkeypatch.undo()
    done = ckpt_lib.list_checkpoints(run / "checkpoints")
    assert [p.name for p in done] == ["0000002"]
    assert ckpt_lib.open_checkpoint(run).step == 2
    ckpt_lib.load_model(run)  # still loads
    run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "4", "--resume", "auto")
    assert ckpt_lib.open_checkpoint(run).step == 4


def test_checkpoint_alone_rebuilds_the_model_and_keep_last(tmp_path):
    run = run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "1", "--keep-last", "2")
    assert [p.name for p in ckpt_lib.list_checkpoints(run / "checkpoints")] == ["0000003", "0000004"]
    model, ckpt = ckpt_lib.load_model(run)
    assert ckpt.config["model"] == "NaLaDiT-T/2" and model.config.num_classes == 10
    raw = load_file(str(ckpt.path / "model.safetensors"))
    assert set(raw) == set(model.state_dict())
    opt = ckpt.optimizer_state()  # weights_only load
    assert "state" in opt and "param_groups" in opt


@pytest.mark.slow
def test_digits_loss_falls(tmp_path):
    run = run_train(tmp_path, "--model", "SiT-T/2", "--max-steps", "60", "--global-batch-size", "32",
                    "--lr", "1e-3", "--ckpt-every", "60")
    losses = [r["loss"] for r in read_log(run)]
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:5]), losses


def test_nala_exponent_is_logged(tmp_path):
    run = run_train(tmp_path, "--max-steps", "1", "--ckpt-every", "1")
    record = read_log(run)[0]
    # p = λ(τ + tanh(‖q‖)) lies in [1.5, 4.5)
    assert 1.5 <= record["nala/exponent_mean"] < 4.5


def make_image_folder(root, classes=("cat", "dog"), per_class=3, size=64, seed=0):
    rng = np.random.default_rng(seed)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size + 8, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    return root


def tiny_vae(path):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8, 8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=8,
                        latent_channels=4, sample_size=64)
    vae.save_pretrained(path)
    return path


def test_latent_extraction_resume_and_training(tmp_path):
    from extract_latents import main as extract_main
    from nala_dit.data.datasets import ImageFolderDataset, LatentDataset
    from nala_dit.models.vae import load_vae
    from nala_dit.data.extract import encode_moments

    images = make_image_folder(tmp_path / "images")
    vae_dir = tiny_vae(tmp_path / "vae")
    argv = ["--data", str(images), "--out", str(tmp_path / "lat"), "--vae", str(vae_dir), "--image-size", "64",
            "--shard-size", "4", "--num-workers", "0", "--dtype", "float32"]
    assert extract_main(argv) == 0
    shards = sorted((tmp_path / "lat").glob("latents-*.safetensors"))
    assert len(shards) == 2  # 6 images in shards of 4
    first_mtime = shards[0].stat().st_mtime_ns
    shards[1].unlink()  # simulate an interruption before the second shard
    assert extract_main(argv) == 0
    assert shards[0].stat().st_mtime_ns == first_mtime and shards[1].is_file()

    lat = LatentDataset(tmp_path / "lat")
    assert len(lat) == 6 and lat.num_classes == 2 and lat.channels == 4
    vae, _ = load_vae(str(vae_dir))
    x, y = ImageFolderDataset(images, 64)[5]
    expected = encode_moments(vae, x[None])[0]
    got, label = lat[5]
    assert label == y == 1
    torch.testing.assert_close(got, expected)
    # The mirror half is the encoding of the mirrored image.
    torch.testing.assert_close(got[1], encode_moments(vae, x.flip(-1)[None])[0, 0])

    run = run_train(tmp_path, "--data", str(tmp_path / "lat"), "--vae", str(vae_dir), "--flip", "true",
                    "--global-batch-size", "2", "--max-steps", "2", "--ckpt-every", "2",
                    "--sample-every", "2", name="latent")
    model, _ = ckpt_lib.load_model(run)
    assert model.config.in_channels == 4 and model.config.input_size == 8 and model.config.num_classes == 2
    assert (run / "samples" / "0000002.png").is_file()


def test_on_the_fly_vae_training(tmp_path):
    images = make_image_folder(tmp_path / "images")
    vae_dir = tiny_vae(tmp_path / "vae")
    run = run_train(tmp_path, "--data", str(images), "--vae", str(vae_dir), "--image-size", "64",
                    "--global-batch-size", "2", "--max-steps", "1", "--ckpt-every", "1", "--model", "SiT-T/2")
    model, _ = ckpt_lib.load_model(run)
    assert model.config.input_size == 8 and model.config.in_channels == 4


def test_bad_inputs_give_clear_errors(tmp_path, capsys):
    def fails(*extra, match, name="bad"):
        code = train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", name,
                                          "--max-steps", "1", *extra])
        assert code == 1
        assert_names(capsys.readouterr().err, *((match,) if isinstance(match, str) else match))

    fails("--data", str(tmp_path / "nope"), match=("data folder not found", f"{tmp_path / 'nope'}"))
    (tmp_path / "empty").mkdir()
    fails("--data", str(tmp_path / "empty"), match="has no class sub-folders")
    (tmp_path / "noimg" / "a").mkdir(parents=True)
    fails("--data", str(tmp_path / "noimg"), match="holds no images")
    images = make_image_folder(tmp_path / "images", per_class=2)
    (images / "cat" / "broken.png").write_bytes(b"not a png")
    fails("--data", str(images), "--image-size", "16", "--global-batch-size", "5", match="cannot read image")
    fails("--num-classes", "7", match=("--num-classes 7", "does not match the data", "digits has 10 classes"))
    fails("--lr", "1e12", "--max-steps", "20", "--ckpt-every", "100", "--max-nan-steps", "3", match="non-finite loss")
    run_train(tmp_path, "--max-steps", "1", "--ckpt-every", "1", name="exists")
    fails("--ckpt-every", "1", match=("already holds checkpoints", "--resume auto"), name="exists")
    fails("--resume", "auto", "--model", "DiT-T/2", "--max-steps", "2", match="checkpoint", name="exists")


def test_skip_corrupt_warns_and_continues(tmp_path):
    images = make_image_folder(tmp_path / "images", per_class=2)
    (images / "cat" / "broken.png").write_bytes(b"not a png")
    with pytest.warns(UserWarning, match="skipping corrupt image"):
        run_train(tmp_path, "--data", str(images), "--image-size", "16", "--global-batch-size", "5",
                  "--max-steps", "1", "--ckpt-every", "1", "--skip-corrupt", "true")


@pytest.mark.slow
def test_two_process_cpu_run(tmp_path):
    """DDP over 2 gloo ranks (forked as accelerate's launcher starts its workers, tests/ranks.py;
    the real launcher's own start is pinned there and in test_fsdp's killed-rank resume)."""
    from tests.ranks import run_ranks

    proc = run_ranks(tmp_path, "train.py", *TINY_RUN, "--results-dir", tmp_path, "--exp-name", "ddp", "--max-steps",
                     "3", "--ckpt-every", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # One start line (rank 0) saying how the run is spread, one done line.
    assert [line for line in proc.stdout.splitlines() if line.startswith(("start:", "done:"))] == [
        "start: 2 processes (gloo) on 2× cpu, global batch 8 (4 per process, grad-accum 1), precision no, "
        "attention nala (fused)", f"done: {tmp_path / 'ddp'}"]
    logs = read_log(tmp_path / "ddp")
    assert len(logs) == 3  # only the main process writes the log
    for record in logs:
        assert len(record["loss_per_rank"]) == 2  # both ranks ran
        assert record["loss"] == pytest.approx(sum(record["loss_per_rank"]) / 2, rel=1e-6)
    assert any(r["loss_per_rank"][0] != r["loss_per_rank"][1] for r in logs)  # different data per rank
    ckpt = ckpt_lib.open_checkpoint(tmp_path / "ddp")
    assert ckpt.step == 3 and ckpt.state["world_size"] == 2
    assert len(load_file(str(ckpt.path / "rng.safetensors"))) == 2


@pytest.mark.slow
def test_cpu_launch_of_two_processes_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts ONE process: refused with the command that works."""
    proc = launch(tmp_path, "train.py", *TINY_RUN, "--results-dir", tmp_path, "--exp-name", "cpu2", "--max-steps", "1",
                  cpu_flag=True)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    # The problem, and the two commands to copy (given whole).
    assert_names(errors[0], "asked for 2 processes", "started one", "without --multi_gpu",
                 "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 "
                 "--mixed_precision no --dynamo_backend no train.py",
                 "accelerate launch --multi_gpu --num_processes 2 train.py")
    assert not (tmp_path / "cpu2").exists()


def test_start_line_names_processes_batch_precision_and_attention():
    from nala_dit.models.dit import create_model
    from nala_dit.training.build import attention_path, start_line

    nala = dict(create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10).config)
    assert attention_path(nala, "cpu", "no") == "nala (fused)"
    assert attention_path(nala, "cuda", "bf16") in ("nala (triton)", "nala (eager)")
    assert attention_path(dict(nala, attention="softmax"), "cuda", "no") == "softmax (SDPA)"
    assert attention_path(dict(nala, nala_regions=2), "cpu", "no") == "nala (2x2 region states, fused)"
    assert start_line(1, None, "1× cpu", 8, 8, 1, "no", "nala (fused)") == \
        "start: 1 process on 1× cpu, global batch 8 (8 per process, grad-accum 1), precision no, attention nala (fused)"
    assert start_line(4, "nccl", "4× NVIDIA H200", 256, 32, 2, "bf16", "nala (triton)") == \
        ("start: 4 processes (nccl) on 4× NVIDIA H200, global batch 256 (32 per process, grad-accum 2), "
         "precision bf16, attention nala (triton)")


@pytest.mark.slow
def test_bf16_mixed_precision_run(tmp_path):
    """bf16 autocast on CPU against the same first step in fp32 (same seed, weights, batch,
    noise and times): the loss is equal bit for bit (adaLN-Zero: the fresh model outputs exactly
    0 in any precision), the gradient norm is not (the backward did run in bf16) but within
    bf16 rounding of it, and the checkpoint keeps fp32 master weights and EMA."""
    from tests.ranks import run_script   # a process of its own: accelerate fixes the precision of its first Accelerator

    proc = run_script(tmp_path, "train.py", *TINY_RUN, "--results-dir", tmp_path, "--exp-name", "bf16",
                      "--max-steps", "2", "--ckpt-every", "2", "--mixed-precision", "bf16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _train_main(tmp_path, "--exp-name", "fp32", "--max-steps", "1") == 0
    bf16, fp32 = read_log(tmp_path / "bf16"), read_log(tmp_path / "fp32")
    assert bf16[0]["step"] == fp32[0]["step"] == 1 and all(np.isfinite(r["loss"]) for r in bf16)
    assert bf16[0]["loss"] == fp32[0]["loss"]
    # bf16 keeps 8 significant bits (2^-8 ≈ 0.4 % a rounding); the norm sums many of them.
    assert bf16[0]["grad_norm"] != fp32[0]["grad_norm"]
    assert bf16[0]["grad_norm"] == pytest.approx(fp32[0]["grad_norm"], rel=1e-2)
    ckpt = ckpt_lib.open_checkpoint(tmp_path / "bf16")
    assert ckpt.config["mixed-precision"] == "bf16"
    assert all(w.dtype == torch.float32 for w in ckpt.weights("ema").values())
    assert all(w.dtype == torch.float32 for w in ckpt.weights("model").values())


def test_start_line_names_the_softmax_blocks(tmp_path, capsys):
    from nala_dit.models.dit import create_model
    from nala_dit.training.build import attention_path

    hybrid = dict(create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10,
                               softmax_blocks="1,3").config)
    assert attention_path(hybrid, "cpu", "no") == "nala (fused) with softmax in blocks 1, 3 (--softmax-blocks 1,3)"
    assert attention_path(dict(hybrid, softmax_blocks=None), "cpu", "no") == "nala (fused)"
    assert _train_main(tmp_path, "--exp-name", "run", "--max-steps", "1", "--softmax-blocks", "every:2") == 0
    start = [line for line in capsys.readouterr().out.splitlines() if line.startswith("start:")]
    assert start == ["start: 1 process on 1× cpu, global batch 8 (8 per process, grad-accum 1), precision no, "
                     "attention nala (fused) with softmax in blocks 1, 3 (--softmax-blocks 1,3)"]


def test_non_finite_start_is_not_blamed_on_the_learning_rate(tmp_path, capsys, monkeypatch):
    import train as train_cli
    from nala_dit.training import loop as training

    real_build = training.build_model

    def poisoned_build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        with torch.no_grad():
            model.final_layer.linear.bias.fill_(float("nan"))
        return model

    monkeypatch.setattr(training, "build_model", poisoned_build)
    argv = ["--model", "NaLaDiT-T/2", "--data", "digits", "--global-batch-size", "8", "--num-workers", "0",
            "--sample-every", "0", "--log-every", "1", "--flip", "false", "--results-dir", str(tmp_path),
            "--exp-name", "run", "--max-steps", "2", "--ckpt-every", "2"]
    assert train_cli.main(argv) == 1
    err = capsys.readouterr().err
    assert_names(err, "non-finite loss at step 1", "before any update")
    assert "not the learning rate" in err and "Last good" not in err and "lower --lr" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()
