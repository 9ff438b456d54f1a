"""--ema-warmup: the EMA's decay min(decay, (1 + t) / (10 + t)) against its closed form, in
training (every step's weights against the recursion) and across a resume (bitwise)."""

import math

import torch

import train as train_cli
from nala_dit.training import checkpoint as ckpt_lib
from nala_dit.training.step import ema_initial_share, update_ema
from tests.utils import assert_names

TINY_RUN = ["--model", "NaLaDiT-T/2", "--data", "digits", "--global-batch-size", "8", "--num-workers", "0",
            "--sample-every", "0", "--log-every", "1", "--flip", "false", "--ema-decay", "0.9", "--ema-warmup", "true"]


def test_warmup_decay_sequence_has_its_closed_form():
    """One float64 parameter. Held at 1 with the EMA from 0, below the cap 1 − ema_T =
    ∏_{t<T} (1 + t)/(10 + t) = 1 / C(T + 9, 9): 0.9 after one update, 1 − 1/55 after two. Moving
    (sin t) over 200 updates, past the cap (0.95 from t = 170 on): the recursion with the
    formula's decays, written out."""
    model = torch.nn.Linear(1, 1, bias=False, dtype=torch.float64)
    ema = torch.nn.Linear(1, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.fill_(1.0)
        ema.weight.zero_()
    for t in range(20):
        update_ema(ema, model, 0.95, step=t)
        assert math.isclose(1.0 - ema.weight.item(), 1 / math.comb(t + 10, 9), rel_tol=1e-9), t
    assert abs(ema.weight.item() - (1 - 1 / math.comb(29, 9))) < 1e-15
    cap = 170
    assert (1 + cap) / (10 + cap) >= 0.95 > cap / (9 + cap)
    with torch.no_grad():
        ema.weight.fill_(0.25)
    expected = 0.25
    for t in range(200):
        with torch.no_grad():
            model.weight.fill_(math.sin(t))
        update_ema(ema, model, 0.95, step=t)
        d = 0.95 if t >= cap else (1 + t) / (10 + t)
        expected = d * expected + (1 - d) * math.sin(t)
        assert abs(ema.weight.item() - expected) < 1e-12, t
    # Without a step: the plain decay, as before.
    with torch.no_grad():
        ema.weight.zero_()
        model.weight.fill_(1.0)
    update_ema(ema, model, 0.95)
    assert abs(ema.weight.item() - 0.05) < 1e-15


def test_training_applies_the_warmup_and_resumes_bitwise(tmp_path):
    def run(name, *extra):
        assert train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", name, *extra]) == 0
        return tmp_path / name

    straight = run("straight", "--max-steps", "4", "--ckpt-every", "1")
    # Interrupted after step 2 (its checkpoint), resumed to 4 in another folder.
    resumed = run("resumed", "--max-steps", "4", "--ckpt-every", "4", "--resume",
                  str(straight / "checkpoints" / "0000002"))
    a, b = ckpt_lib.open_checkpoint(straight), ckpt_lib.open_checkpoint(resumed)
    assert a.step == b.step == 4
    for which in ("model", "ema"):
        wa, wb = a.weights(which), b.weights(which)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), which
    # Every step's EMA is the recursion over the saved raw weights with d_t = min(0.9, (1 + t)/(10 + t)):
    # 2/11, 3/12, 4/13 for the updates after steps 1..3 (all under the cap 0.9).
    steps = {ckpt_lib.open_checkpoint(p).step: ckpt_lib.open_checkpoint(p) for p in ckpt_lib.list_checkpoints(
        straight / "checkpoints")}
    assert sorted(steps) == [1, 2, 3, 4]
    ema = steps[1].weights("ema")
    for t in range(1, 4):
        d = min(0.9, (1 + t) / (10 + t))
        raw = steps[t + 1].weights("model")
        ema = {k: d * v + (1 - d) * raw[k] for k, v in ema.items()}
        saved = steps[t + 1].weights("ema")
        assert all(torch.allclose(saved[k], ema[k], rtol=1e-5, atol=1e-7) for k in ema), t
        moved = max((saved[k] - steps[t].weights("ema")[k]).abs().max().item() for k in ema)
        assert moved > 0   # the EMA follows the raw weights


def test_the_warmup_counts_the_emas_updates_not_skipped_steps(tmp_path, monkeypatch):
    """Step 3's loss is NaN (skipped: no update of the weights or the EMA). The EMA's t counts
    its updates, so step 4's decay is (1 + 2) / (10 + 2), the third update's, not step 4's
    (1 + 3) / (10 + 3); the count is stored with the checkpoint, so a run resumed after the skip
    is bitwise the same."""
    from tests.training.test_recipe import poison_batches

    poison_batches(monkeypatch, {3})
    straight = tmp_path / "straight"
    assert train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "straight", "--max-steps", "4",
                                      "--ckpt-every", "1"]) == 0
    monkeypatch.undo()
    steps = {t: ckpt_lib.open_checkpoint(straight / "checkpoints" / f"{t:07d}") for t in (1, 2, 3, 4)}
    assert [steps[t].state["ema_updates"] for t in (1, 2, 3, 4)] == [1, 2, 2, 3]
    ema3, raw4, ema4 = steps[3].weights("ema"), steps[4].weights("model"), steps[4].weights("ema")
    d = (1 + 2) / (10 + 2)
    assert all(torch.allclose(ema4[k], d * ema3[k] + (1 - d) * raw4[k], rtol=1e-5, atol=1e-7) for k in ema4)
    wrong = (1 + 3) / (10 + 3)     # the step count: what the warm-up used before
    assert not all(torch.allclose(ema4[k], wrong * ema3[k] + (1 - wrong) * raw4[k], rtol=1e-5, atol=1e-7)
                   for k in ema4)
    assert train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "resumed", "--max-steps", "4",
                                      "--resume", str(straight / "checkpoints" / "0000003")]) == 0
    resumed = ckpt_lib.open_checkpoint(tmp_path / "resumed").weights("ema")
    assert all(torch.equal(resumed[k], ema4[k]) for k in ema4)


def test_an_edited_ema_update_count_is_refused_in_one_line(tmp_path):
    import json

    run = tmp_path / "run"
    assert train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "run", "--max-steps", "2"]) == 0
    state_file = ckpt_lib.find_checkpoint(run) / ckpt_lib.STATE
    for bad in (3, -1, "2", True):
        state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "ema_updates": bad}))
        try:
            ckpt_lib.open_checkpoint(run)
        except ckpt_lib.CheckpointError as err:
            assert_names(err, "'ema_updates'", "integer from 0 to the step 2", f"got {bad!r}")
        else:
            raise AssertionError(f"ema_updates {bad!r} was accepted")


# --- the warm-up by default where the EMA was not chosen, and a warning when
# the EMA is still mostly its random start ---------------------------------------------------

def test_initial_share_is_the_product_of_the_decays():
    for decay in (0.0, 0.05, 0.5, 0.9, 0.99, 0.9999, 1.0):
        for updates in (0, 1, 2, 9, 30, 171, 1000):
            for warmup in (False, True):
                product = 1.0
                for t in range(updates):
                    product *= min(decay, (1 + t) / (10 + t)) if warmup else decay
                assert math.isclose(ema_initial_share(decay, updates, warmup), product, rel_tol=1e-9,
                                    abs_tol=1e-300), (decay, updates, warmup)
    assert ema_initial_share(0.9999, 30, False) > 0.99   # a 30-step run: still the random start


def test_the_warmup_is_the_default_unless_the_ema_is_chosen(capsys):
    from nala_dit.cli.config import resolve
    from nala_dit.cli.options import TrainConfig

    def ema(*argv):
        cfg, _ = resolve(TrainConfig, list(argv))
        return cfg.ema_decay, cfg.ema_warmup

    assert ema() == (0.9999, True)                          # nothing chosen: warmed up
    assert ema("--data", "my-images") == (0.9999, True)     # a user's own image folder
    assert ema("--ema-decay", "0.9999") == (0.9999, False)  # DiT's EMA, chosen
    assert ema("--ema-decay", "0.999", "--ema-warmup", "true") == (0.999, True)
    assert ema("--ema-warmup", "false") == (0.9999, False)
    # The shipped configs that set the EMA keep it: ImageNet (DiT's) and the digits demo.
    for config in ("nala_dit_s2_imagenet256", "dit_xl2_imagenet256", "nala_sit_xl2_imagenet256_fast",
                   "digits_nala_dit"):
        decay, warmup = ema("--config", f"configs/{config}.yaml")
        assert warmup is False and decay in (0.9999, 0.99), config
    assert train_cli.main(["--dry-run"]) == 0
    assert "ema-warmup: true" in capsys.readouterr().out   # config.yaml records the resolved value


def test_a_run_whose_ema_is_still_its_random_start_says_so_at_the_end(tmp_path, capsys):
    from nala_dit.training.step import checkpoint_ema_warning

    plain = TINY_RUN[:TINY_RUN.index("--ema-decay")]
    assert train_cli.main(plain + ["--results-dir", str(tmp_path), "--exp-name", "dit-ema", "--max-steps", "3",
                                   "--ema-decay", "0.9999"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("warning: the EMA")]
    assert len(lines) == 1, out
    for words in ("99.97% their initial random weights", "after 3 updates", "--ema-decay 0.9999 without --ema-warmup",
                  "10,000 updates", "mostly noise", "--ema-warmup true", "sample.py --weights model"):
        assert words in lines[0], (words, lines[0])
    assert checkpoint_ema_warning(ckpt_lib.open_checkpoint(tmp_path / "dit-ema")) == lines[0][len("warning: "):]
    # the default (warmed up): nothing to say, here or when sampling
    assert train_cli.main(plain + ["--results-dir", str(tmp_path), "--exp-name", "default", "--max-steps", "3"]) == 0
    assert "warning: the EMA" not in capsys.readouterr().out
    assert checkpoint_ema_warning(ckpt_lib.open_checkpoint(tmp_path / "default")) is None


def test_sampling_checkpoints_trained_alike_warns_once_per_process(monkeypatch):
    """demo.py --quick loads its at-chance checkpoints 15 times in one process: the same EMA
    warning is said once; another recipe's, and a good EMA's silence, are unchanged."""
    from types import SimpleNamespace

    from nala_dit.checkpoints import ema as ema_lib

    monkeypatch.setattr(ema_lib, "_SAID", set())

    def ckpt(decay, warmup, updates):
        return SimpleNamespace(config={"ema-decay": decay, "ema-warmup": warmup}, state={"ema_updates": updates},
                               step=updates)

    first = ema_lib.ema_warning_once(ckpt(0.9999, False, 5))
    assert first == ema_lib.checkpoint_ema_warning(ckpt(0.9999, False, 5)) and "after 5 updates" in first
    assert [ema_lib.ema_warning_once(ckpt(0.9999, False, 5)) for _ in range(14)] == [None] * 14
    assert "after 7 updates" in ema_lib.ema_warning_once(ckpt(0.9999, False, 7))
    assert ema_lib.ema_warning_once(ckpt(0.9999, True, 5000)) is None
