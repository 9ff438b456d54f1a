"""Issue 34 (newcomer polish 3): the messages and guards of the CLIs that are not one CLI's."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_data_folder_is_not_described_as_an_image_folder_layout(tmp_path):
    from nala_dit.data.datasets import ImageFolderDataset

    (tmp_path / "latents-256").mkdir()
    missing = tmp_path / "latents-265"
    with pytest.raises(FileNotFoundError) as err:
        ImageFolderDataset(missing, 8)
    assert str(err.value) == (f"data folder not found: {missing} (did you mean {tmp_path / 'latents-256'}?) (--data "
                              f"takes digits, digits-canvas, a latent folder written by extract_latents.py or an image "
                              f"folder <root>/<class name>/<images>)")


PEER_SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
from nala_dit.cli.parse import report_error, run_main
import torch.distributed as dist

def main():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=int(os.environ["RANK"]),
                            world_size=2)
    dist.barrier()                   # both set up (as a CLI is when its work starts)
    if os.environ["RANK"] == "0":   # rank 0 alone meets an error (a full disk, say): one line, then exits
        return report_error(OSError("cannot write shard-000000.npz: No space left on device"))
    dist.barrier()                   # ... while rank 1 waits for it
    return 0

sys.exit(run_main(main))
"""


def test_other_ranks_do_not_print_a_gloo_traceback_after_one_rank_stops(tmp_path):
    """Issue 34 item 12: two real gloo processes; rank 0 stops with its one-line error, rank 1,
    waiting in a barrier, loses its peer: one line, not torch's ~30-line traceback."""
    import os
    import subprocess
    import sys

    from tests.utils import free_port

    script = PEER_SCRIPT.format(root=str(ROOT), port=free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", OMP_NUM_THREADS="1"))
             for r in (0, 1)]
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [1, 1], (err0, err1)
    assert err0.strip().splitlines() == ["error: cannot write shard-000000.npz: No space left on device (the "
                                         "launcher's ChildFailedError report that follows only repeats that the "
                                         "processes stopped)"]
    assert err1.strip().splitlines() == ["rank 1: stopped because another process of this launch stopped (its "
                                         "error is the line above from rank 0, or the launcher's report)"], err1


@pytest.mark.parametrize("script, args", [("train.py", ["--config", "configs/digits_nala_dit.yaml"]),
                                          ("sample.py", ["--ckpt", "runs/demo/NaLaDiT", "--labels", "1"]),
                                          ("evaluate_fid.py", ["--help"]), ("export.py", ["--help"]),
                                          ("extract_latents.py", ["--help"]), ("demo.py", ["--quick"])])
def test_a_python_without_torch_gets_one_line_naming_the_venv(script, args):
    """Issue 34 item 11: ``python -S`` (no site-packages: truly no torch, numpy or PyYAML),
    as the system python is; one line naming ``source .venv/bin/activate``, exit status 1."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-S", script, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: {sys.executable} has no torch, numpy, yaml (the packages live in the project's .venv): run "
        f"`source .venv/bin/activate` first, or `.venv/bin/python {script} ...`; `make` creates .venv"]
