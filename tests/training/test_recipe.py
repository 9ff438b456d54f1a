"""The 2025 training recipe: logit-normal times, warm-up, β2, clipping, NaN
skips, validation during training, trackers. Each knob against a known answer."""

import json
import math

import pytest
import torch

from nala_dit.diffusion.gaussian import GaussianDiffusion
from nala_dit.diffusion.transport import Transport
from tests.utils import assert_names

# Kolmogorov-Smirnov: at n draws, sup |F_n − F| exceeds 1.95/√n with probability 0.001.
KS_N = 20_000
KS_BOUND = 1.95 / math.sqrt(KS_N)


def logit_normal_cdf(u: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """P(sigmoid(mean + std·z) <= u), z ~ N(0, 1): Φ((logit u − mean) / std)."""
    u = u.double().clamp(1e-300, 1 - 1e-16)
    return 0.5 * (1 + torch.erf((torch.log(u) - torch.log1p(-u) - mean) / (std * math.sqrt(2))))


@pytest.mark.parametrize("mean,std", [(0.0, 1.0), (0.5, 0.8)])
def test_sit_logit_normal_times_follow_the_cdf(mean, std):
    """SiT's t = 1 is data: t = 1 − noise fraction, so P(t <= x) = 1 − F(1 − x)."""
    tr = Transport(t_sampling="logit-normal", t_mean=mean, t_std=std)
    t = tr.sample_t(KS_N, generator=torch.Generator().manual_seed(0)).double().sort().values
    model = 1 - logit_normal_cdf(1 - t, mean, std)
    n = torch.arange(1, KS_N + 1, dtype=torch.float64) / KS_N
    ks = torch.maximum((n - model).abs(), (n - 1 / KS_N - model).abs()).max().item()
    assert ks < KS_BOUND, ks
    # the orientation matters: the same draws read as noise fractions are far off (mean 0.5)
    flipped = logit_normal_cdf(t, mean, std)
    assert mean == 0 or torch.maximum((n - flipped).abs(), (n - 1 / KS_N - flipped).abs()).max() > 5 * KS_BOUND


def test_dit_logit_normal_index_follows_the_discretised_cdf():
    """DiT's index i = min(floor(T·u), T − 1): P(i <= k) = F((k + 1) / T) at every k."""
    T, mean, std = 1000, 0.5, 0.8
    diffusion = GaussianDiffusion.from_schedule("linear", T, t_sampling="logit-normal", t_mean=mean, t_std=std)
    torch.manual_seed(0)
    i = diffusion.sample_timesteps(KS_N)
    assert i.dtype == torch.long and 0 <= i.min() and i.max() <= T - 1
    empirical = torch.bincount(i, minlength=T).cumsum(0).double() / KS_N
    model = logit_normal_cdf(torch.arange(1, T + 1, dtype=torch.float64) / T, mean, std)
    model[-1] = 1.0
    assert (empirical - model).abs().max().item() < KS_BOUND


def test_uniform_times_are_the_official_draws():
    """The default draws exactly what DiT (randint) and SiT (rand) draw, stream for stream."""
    torch.manual_seed(3)
    a = GaussianDiffusion.from_schedule("linear", 1000).sample_timesteps(64)
    torch.manual_seed(3)
    assert torch.equal(a, torch.randint(0, 1000, (64,)))
    b = Transport().sample_t(64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(b, torch.rand(64, generator=torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError, match="t-std > 0"):
        Transport(t_sampling="logit-normal", t_std=0.0)
    with pytest.raises(ValueError, match="t_sampling 'lognormal'"):
        GaussianDiffusion.from_schedule("linear", 1000, t_sampling="lognormal")


# --- optimiser knobs: warm-up, β2, clipping (and their resume) -----------------------

def test_warmup_is_linear_from_zero():
    from nala_dit.training.step import lr_at

    assert [lr_at(s, 1e-3, 4) for s in (0, 1, 2, 4, 9)] == [0.0, 2.5e-4, 5e-4, 1e-3, 1e-3]
    assert lr_at(0, 1e-3, 0) == 1e-3


def test_clipping_against_a_hand_computed_norm():
    from accelerate import Accelerator

    from nala_dit.training.step import clip_gradients

    accelerator = Accelerator(cpu=True)
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1, 2))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([[0.0, -4.0]])  # ‖(3, 0, 0, −4)‖ = 5
    assert clip_gradients(accelerator, [a, b], 0.0).item() == 5.0  # off: the norm, the gradients as they were
    assert a.grad.tolist() == [3.0, 0.0] and b.grad.tolist() == [[0.0, -4.0]]
    assert clip_gradients(accelerator, [a, b], 10.0).item() == 5.0  # below the bound: untouched
    assert a.grad.tolist() == [3.0, 0.0]
    assert clip_gradients(accelerator, [a, b], 1.0).item() == 5.0  # the norm before clipping
    scale = 1.0 / (5.0 + 1e-6)  # torch's clip coefficient
    assert torch.allclose(a.grad, torch.tensor([3.0 * scale, 0.0]), rtol=0, atol=1e-7)
    assert torch.allclose(b.grad, torch.tensor([[0.0, -4.0 * scale]]), rtol=0, atol=1e-7)


RECIPE = ["--t-sampling", "logit-normal", "--t-mean", "0.3", "--warmup-steps", "4", "--adam-beta2", "0.95",
          "--max-grad-norm", "0.5"]


def test_recipe_logs_lr_and_grad_norm_and_resumes_bitwise(tmp_path, capsys):
    from nala_dit.training import checkpoint as ckpt_lib
    from tests.training.test_loop import read_log, run_train

    straight = run_train(tmp_path, *RECIPE, "--max-steps", "5", "--ckpt-every", "5", name="straight")
    log = read_log(straight)
    assert [r["lr"] for r in log] == pytest.approx([0.0, 2.5e-5, 5e-5, 7.5e-5, 1e-4], rel=1e-12)  # --lr 1e-4, warm-up 4
    assert all(r["grad_norm"] > 0 for r in log)
    assert ckpt_lib.open_checkpoint(straight).optimizer_state()["param_groups"][0]["betas"] == (0.9, 0.95)
    resumed = run_train(tmp_path, *RECIPE, "--max-steps", "3", "--ckpt-every", "3", name="resumed")
    run_train(tmp_path, *RECIPE, "--max-steps", "5", "--ckpt-every", "5", "--resume", "auto", name="resumed")
    a, b = ckpt_lib.open_checkpoint(straight), ckpt_lib.open_checkpoint(resumed)
    for which in ("model", "ema"):
        wa, wb = a.weights(which), b.weights(which)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), which
    assert read_log(resumed) == [{**r, "steps_per_sec": s["steps_per_sec"], "images_per_sec": s["images_per_sec"]}
                                 for r, s in zip(log, read_log(resumed))]
    # A changed knob on resume is applied and said.
    capsys.readouterr()
    run_train(tmp_path, *RECIPE[:-4], "--adam-beta2", "0.9", "--max-steps", "6", "--ckpt-every", "6",
              "--resume", "auto", name="resumed")
    out = capsys.readouterr().out
    for new, old in (("--adam-beta2 0.9", "0.95"), ("--max-grad-norm 0.0", "0.5")):
        lines = [line for line in out.splitlines() if line.startswith(f"resume: {new} ")]
        assert len(lines) == 1, out
        assert_names(lines[0], f"checkpoint's {old}")
    assert ckpt_lib.open_checkpoint(resumed).optimizer_state()["param_groups"][0]["betas"] == (0.9, 0.9)


# --- NaN handling ---------------------------------------------------------------------

def poison_batches(monkeypatch, calls):
    """Batches that turn NaN at the data calls in ``calls`` (1-based: one per step here)."""
    from nala_dit.training import run as training   # run.Space.to_model: every batch into model space

    real, seen = training.to_model_space, []

    def poisoned(x, *args, **kwargs):
        seen.append(1)
        x = real(x, *args, **kwargs)
        return x * float("nan") if len(seen) in calls else x

    monkeypatch.setattr(training, "to_model_space", poisoned)


def equal_trees(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal_trees(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal_trees(x, y) for x, y in zip(a, b))
    return a == b


def test_a_non_finite_step_is_skipped_and_a_streak_stops_the_run(tmp_path, capsys, monkeypatch):
    from nala_dit.training import checkpoint as ckpt_lib
    from tests.training.test_loop import read_log, run_train
    from tests.utils import train_fails

    poison_batches(monkeypatch, {3})
    run = run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "1", "--max-grad-norm", "1")
    assert_names(capsys.readouterr().out, "step 3: non-finite loss", "lr 0.0001", "step skipped", "1 in a row",
                 "--max-nan-steps 20")
    before, after = (ckpt_lib.open_checkpoint(run / "checkpoints" / f"000000{i}") for i in (2, 3))
    for which in ("model", "ema"):
        assert equal_trees(before.weights(which), after.weights(which)), which
    assert equal_trees(before.optimizer_state(), after.optimizer_state())
    last = ckpt_lib.open_checkpoint(run)
    assert not equal_trees(after.weights("model"), last.weights("model"))  # step 4 updates again
    log = read_log(run)
    assert log[2]["skipped_steps"] == 1 and log[2]["loss"] is None and log[2]["grad_norm"] is None
    assert all("skipped_steps" not in r and r["loss"] > 0 for r in log[:2] + log[3:])
    # --max-nan-steps in a row: one line naming the step, the lr and the last good checkpoint.
    monkeypatch.undo()
    poison_batches(monkeypatch, {3, 4})
    err = train_fails(tmp_path, capsys, "--max-steps", "6", "--ckpt-every", "2", "--max-nan-steps", "2",
                      name="streak")
    good = tmp_path / "streak" / "checkpoints" / "0000002"
    assert_names(err, "non-finite loss at step 4", "--max-nan-steps 2", f"Last good checkpoint: {good}",
                 "lower --lr", "--max-grad-norm 1", "--mixed-precision no")
    assert [p.name for p in ckpt_lib.list_checkpoints(tmp_path / "streak" / "checkpoints")] == ["0000002"]


# --- validation during training -------------------------------------------------------

def test_noise_bands_split_by_hand():
    from nala_dit.training.validation import band_losses, band_means

    u = torch.tensor([0.0, 0.2, 1 / 3, 0.5, 2 / 3, 1.0], dtype=torch.float64)  # band edges belong above
    losses = torch.tensor([1.0, 3.0, 5.0, 7.0, 9.0, 11.0])
    sums = band_losses(u, losses)
    assert sums.tolist() == [[4.0, 2.0], [12.0, 2.0], [20.0, 2.0]]
    assert band_means(sums + band_losses(u[:1], losses[:1]), "val/loss") == {  # a second process's share
        "val/loss": 37 / 7, "val/loss_noise_low": 5 / 3, "val/loss_noise_mid": 6.0, "val/loss_noise_high": 10.0}


@pytest.fixture(scope="module")
def digits_reference(tmp_path_factory, digits_classifier_dir):
    from nala_dit.evaluation import metrics

    out = tmp_path_factory.mktemp("ref") / "digits.npz"
    metrics.make_reference(out, dataset="digits-heldout", features="digits", digits_classifier_dir=digits_classifier_dir)
    return out


def test_validation_draws_survive_resume_and_leave_training_alone(tmp_path, digits_reference, digits_classifier_dir):
    from tests.training.test_loop import read_log, run_train

    common = ["--model", "NaLaSiT-T/2", "--log-every", "2"]
    evaluate = ["--val-every", "2", "--val-samples", "24", "--fid-every", "4", "--fid-ref", str(digits_reference),
                "--fid-samples", "20", "--sample-steps", "4", "--digits-classifier", str(digits_classifier_dir)]
    plain = read_log(run_train(tmp_path, *common, "--max-steps", "4", "--ckpt-every", "4", name="plain"))
    straight_run = run_train(tmp_path, *common, *evaluate, "--max-steps", "4", "--ckpt-every", "4", name="straight")
    straight = read_log(straight_run)
    run_train(tmp_path, *common, *evaluate, "--max-steps", "2", "--ckpt-every", "2", name="resumed")
    resumed = read_log(run_train(tmp_path, *common, *evaluate, "--max-steps", "4", "--ckpt-every", "4",
                                 "--resume", "auto", name="resumed"))
    # Evaluation draws nothing from the training's streams: the same losses as without it.
    assert [r["loss"] for r in plain] == [r["loss"] for r in straight] == [r["loss"] for r in resumed]
    keys = ["val/loss", "val/loss_noise_low", "val/loss_noise_mid", "val/loss_noise_high", "val/ema_loss",
            "val/ema_loss_noise_low", "val/ema_loss_noise_mid", "val/ema_loss_noise_high"]
    for a, b in zip(straight, resumed):  # the resumed run rebuilt its draws: the same numbers
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert 0 < a["val/loss"] < 10
    fid = ["fid/fd_digits", "fid/precision_digits", "fid/recall_digits", "fid/class_consistency"]
    assert "fid/fd_digits" not in straight[0] and straight[1]["fid/fd_digits"] > 0
    assert {k: straight[1][k] for k in fid} == {k: resumed[1][k] for k in fid}  # samples seeded by index
    # ... and they are what evaluate_fid.py gen scores for the same checkpoint, samples and sampler.
    import evaluate_fid

    assert evaluate_fid.main(["gen", "--ckpt", str(straight_run), "--ref", str(digits_reference), "--num-samples", "20",
                              "--sampler", "ode-heun", "--steps", "4", "--device", "cpu", "--digits-classifier",
                              str(digits_classifier_dir), "--json", str(tmp_path / "gen.json")]) == 0
    scores = json.loads((tmp_path / "gen.json").read_text())["metrics"]
    assert {k: straight[1][k] for k in fid} == pytest.approx({f"fid/{k}": v for k, v in scores.items()}, rel=1e-5)


# --- trackers -------------------------------------------------------------------------

def test_offline_wandb_and_tensorboard_runs_write_their_files(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed: pip install -e '.[wandb]' (make test installs it)")
    from tests.training.test_loop import run_train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = run_train(tmp_path, "--report-to", "all", "--max-steps", "2", "--ckpt-every", "2", "--val-every", "2",
                    "--val-samples", "8", "--t-sampling", "logit-normal")
    wandb.teardown()  # the service writes the run's records after the run finishes: wait for it, as at exit
    records = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 1, list((run / "wandb").iterdir())
    data = records[0].read_bytes()
    run_id = (run / "wandb-id").read_text().strip()
    assert records[0].name == f"run-{run_id}.wandb"  # the id a resumed run continues
    for key in (b"loss", b"lr", b"grad_norm", b"steps_per_sec", b"images_per_sec", b"val/ema_loss",
                b"t-sampling", b"logit-normal"):  # logged values and the resolved config
        assert key in data, key
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_recipe_options_are_checked_in_one_line(tmp_path, capsys):
    from nala_dit.cli.options import TrainConfig
    from tests.utils import train_fails

    def refused(message, **kwargs):
        with pytest.raises(ValueError) as err:
            TrainConfig(**kwargs).validate()
        assert str(err.value) == message

    refused("--t-mean / --t-std shape logit-normal times; pass --t-sampling logit-normal with them (got --t-sampling "
            "uniform, --t-mean 0.5, --t-std 1.0)", t_mean=0.5)
    refused("adam-beta2 must be in [0, 1) (DiT 0.999, LightningDiT 0.95), got 1.0", adam_beta2=1.0)
    refused("--fid-every scores against a reference: pass --fid-ref REF.npz (evaluate_fid.py ref --dataset "
            "digits-heldout --features digits --out REF.npz for the embedded digits)", fid_every=100)
    refused("--val-data is the held-out data of --val-every: pass --val-every N with it", val_data="held-out")
    from tests.training.test_loop import make_image_folder

    images = make_image_folder(tmp_path / "images", per_class=2)
    err = train_fails(tmp_path, capsys, "--data", str(images), "--image-size", "16", "--global-batch-size", "2",
                      "--max-steps", "1", "--val-every", "1")
    assert_names(err, "--val-every", f"{images} is a folder", "--val-data", "held-out folder")
