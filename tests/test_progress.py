"""Progress off a terminal: whole lines at a bounded rate, never a bar."""

import io

import torch

from nala_dit.progress import PlainProgress, progress_bar
from nala_dit.diffusion.gaussian import GaussianDiffusion
from nala_dit.diffusion.samplers import ddpm_sample
from tests.diffusion.oracle import DiffusionOracle
from tests.training.test_loop import run_train


class FakeClock:
    """A clock that moves ``tick`` seconds per reading after the first."""

    def __init__(self, tick):
        self.t, self.tick = -tick, tick

    def __call__(self):
        self.t += self.tick
        return self.t


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_at_each_tenth_and_every_interval():
    out = io.StringIO()
    # 1 s per step, a line at least every 7 s and at each 20 steps: 7, 14, 20 in each block of 20.
    bar = PlainProgress(total=200, desc="train X", unit="step", file=out, interval=7, clock=FakeClock(1.0))
    for i in range(200):
        bar.update(1)
        if i == 9:
            bar.set_postfix(loss="0.5000")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 30 and "\r" not in out.getvalue()
    assert lines[0] == "train X: 7/200 step (3%), 0:00:07 elapsed, 1 step/s, eta 0:03:13"
    assert lines[1] == "train X: 14/200 step (7%), 0:00:14 elapsed, 1 step/s, eta 0:03:06, loss=0.5000"
    assert lines[-1] == "train X: 200/200 step (100%), 0:03:20 elapsed, 1 step/s, loss=0.5000"
    assert len(out.getvalue()) < 30 * 90  # bounded: about 80 bytes a line


def test_a_redirected_bar_prints_a_line_every_10_seconds_by_default():
    """Progress to a file at least every 10 s (a log that stays quiet for a minute looks hung):
    updates every 3 s with no total print at 12 s and 24 s of 30."""
    out = io.StringIO()
    bar = PlainProgress(desc="features", unit="img", file=out, clock=FakeClock(3.0))
    for _ in range(10):
        bar.update(1)
    assert [line.split(",")[0] for line in out.getvalue().splitlines()] == ["features: 4 img", "features: 8 img"]


def test_resumed_bar_counts_from_initial_and_close_reports_where_it_stopped():
    out = io.StringIO()
    bar = PlainProgress(total=100, desc="d", initial=50, file=out, interval=1e9, clock=FakeClock(2.0))
    for _ in range(15):
        bar.update(1)
    bar.close()
    bar.close()  # once only
    # Lines at 60% only, then close at 65 (interrupted); the rate counts this run's steps only.
    assert out.getvalue().splitlines() == ["d: 60/100 it (60%), 0:00:20 elapsed, 0.5 it/s, eta 0:01:20",
                                           "d: 65/100 it (65%), 0:00:32 elapsed, 0.469 it/s, eta 0:01:14"]


def test_terminal_gets_tqdm_and_redirected_streams_get_plain_lines():
    from tqdm.auto import tqdm

    with progress_bar(total=3, file=Terminal()) as bar:
        assert isinstance(bar, tqdm)
    out = io.StringIO()
    with progress_bar(range(200), desc="steps", file=out) as bar:
        assert isinstance(bar, PlainProgress)
        assert sum(1 for _ in bar) == 200
    # The loop takes far less than PLAIN_INTERVAL: one line per tenth, exactly.
    assert [line.split(",")[0] for line in out.getvalue().splitlines()] == \
        [f"steps: {20 * k}/200 it ({10 * k}%)" for k in range(1, 11)]
    transient = io.StringIO()
    assert sum(1 for _ in progress_bar(range(5), leave=False, file=transient)) == 5
    assert transient.getvalue() == ""


def test_sampler_steps_write_nothing_to_a_redirected_stderr(capsys):
    base = GaussianDiffusion.from_schedule("linear", 200)
    noise = torch.randn(2, 4, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ddpm_sample(base, DiffusionOracle(base), noise, torch.zeros(2, dtype=torch.long), num_steps=200,
                progress=True)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""  # tqdm wrote ~10 KB of redraws here


def test_training_progress_is_one_line_per_tenth_off_a_terminal(tmp_path, capsys):
    run_train(tmp_path, "--max-steps", "2", "--ckpt-every", "2")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train NaLaDiT-T/2:")]
    assert [line.split(",")[0] for line in lines] == ["train NaLaDiT-T/2: 1/2 step (50%)",
                                                      "train NaLaDiT-T/2: 2/2 step (100%)"]
    assert "\r" not in err


def test_training_progress_line_shows_the_loss_of_its_own_step(tmp_path, capsys):
    """4/4 shows step 4's loss (it showed step 2's: the line was printed before the log step set it)."""
    import json

    run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "4", "--log-every", "2", name="lossline")
    err = capsys.readouterr().err
    lines = {line.split(",")[0]: line for line in err.splitlines() if line.startswith("train NaLaDiT-T/2:")}
    logged = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "lossline" / "log.jsonl").read_text().splitlines())}
    assert sorted(logged) == [2, 4] and logged[2] != logged[4]
    assert f"loss={logged[4]:.4f}" in lines["train NaLaDiT-T/2: 4/4 step (100%)"]
    assert f"loss={logged[2]:.4f}" in lines["train NaLaDiT-T/2: 2/4 step (50%)"]


def test_restart_rate_leaves_a_compiling_first_step_out_of_the_eta():
    """train.py --compile: step 1 took 100 s (the compilation), the others 1 s each; after
    restart_rate the rate and ETA are the steps' own, the elapsed time still the whole."""
    from nala_dit.progress import restart_rate

    times = iter([0.0, 100.0, 100.0, *[100.0 + i for i in range(1, 200)]])
    out = io.StringIO()
    bar = PlainProgress(total=20, desc="train", unit="step", file=out, interval=1e9, clock=lambda: next(times))
    bar.update(1)          # 100 s: compiled, then stepped (a line at 1/20? no: the tenths are 2, 4, ...)
    restart_rate(bar)
    bar.update(1)          # 101 s: the 2nd step, a tenth: a line
    assert out.getvalue().splitlines() == ["train: 2/20 step (10%), 0:01:41 elapsed, 1 step/s, eta 0:00:18"]
    tqdm_bar = progress_bar(total=3, file=Terminal())
    tqdm_bar.update(1)
    restart_rate(tqdm_bar)
    assert tqdm_bar.format_dict["rate"] is None and tqdm_bar.last_print_n == 1   # the smoothed rate starts again
    tqdm_bar.close()
