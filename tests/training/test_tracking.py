"""Tests of `nala_dit/training/tracking.py`."""
import pytest

from nala_dit.training import run as training  # Run.save writes the checkpoints
from tests.training.test_loop import read_log, run_train
from tests.utils import one_line


def test_killed_run_log_holds_each_step_once(tmp_path, monkeypatch):
    straight = run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "2", name="straight")
    real_save = training.save_checkpoint

    def killed_at_4(*args, state, **kwargs):
        if state["step"] == 4:
            raise KeyboardInterrupt("killed before the step-4 checkpoint")
        return real_save(*args, state=state, **kwargs)

    monkeypatch.setattr(training, "save_checkpoint", killed_at_4)
    with pytest.raises(KeyboardInterrupt):
        run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "2")
    monkeypatch.undo()
    run = tmp_path / "run"
    assert [r["step"] for r in read_log(run)] == [1, 2, 3, 4]
    run_train(tmp_path, "--max-steps", "4", "--ckpt-every", "2", "--resume", "auto")  # redoes steps 3 and 4
    assert [r["step"] for r in read_log(run)] == [1, 2, 3, 4]
    assert [r["loss"] for r in read_log(run)] == [r["loss"] for r in read_log(straight)]


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
