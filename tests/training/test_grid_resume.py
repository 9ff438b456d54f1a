"""A kill between a checkpoint and its sample grid (or a stop at a grid step) loses no grid: the
run resumed from that checkpoint draws it first, from the same EMA, byte for byte the grid the
step would have written (``loop.missing_grid``)."""
import train as train_cli
from tests.utils import TINY_RUN


def test_a_resumed_run_redraws_the_grid_its_checkpoint_step_lacks(tmp_path):
    def run(*extra):
        assert train_cli.main(TINY_RUN + ["--results-dir", str(tmp_path), "--exp-name", "run", "--sample-every", "2",
                                          "--sample-steps", "2", "--ckpt-every", "2", *extra]) == 0

    run("--max-steps", "2")
    grid = tmp_path / "run" / "samples" / "0000002.png"
    written = grid.read_bytes()
    grid.unlink()   # as if killed after the checkpoint, before the grid
    run("--max-steps", "2", "--resume", "auto")   # the last step's grid too: no step left to train
    assert grid.read_bytes() == written
