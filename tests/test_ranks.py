"""tests/ranks.py, the forked ranks most multi-process tests run on: each rank sees what a real
``accelerate launch`` gives its workers, and a failing or hanging rank ends the run as the
launcher ends it."""

import json

import pytest

from tests import ranks
from tests.ranks import run_ranks, run_script
from tests.utils import launch

SCRIPT = """import json, os, sys
import torch
env = dict(os.environ, THREADS=str(torch.get_num_threads()), ARGV=json.dumps(sys.argv[1:]))
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "env-" + os.environ.get("RANK", "plain") + ".json"), "w") as f:
    json.dump(env, f)   # a file per rank: the ranks of a launch share one stdout, lines can interleave
"""
# torchrun's own bookkeeping (its agent's store, error files, restarts): nothing here reads them
LAUNCHER_ONLY = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_USE_AGENT_STORE", "_"}


def _envs(folder) -> dict[str, dict]:
    """{RANK (or "plain"): the environment that process saw}, from the files SCRIPT wrote."""
    return {p.stem.removeprefix("env-"): json.loads(p.read_text()) for p in folder.glob("env-*.json")}


@pytest.mark.slow
def test_a_forked_rank_sees_what_accelerate_launch_gives_its_workers(tmp_path):
    for name in ("launched", "forked"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "env.py").write_text(SCRIPT)
    launched = launch(tmp_path, tmp_path / "launched" / "env.py", "--flag", 1, processes=3)
    forked = run_ranks(tmp_path, tmp_path / "forked" / "env.py", "--flag", 1, processes=3)
    assert launched.returncode == forked.returncode == 0, launched.stderr[-2000:] + forked.stderr[-2000:]
    real, ours = _envs(tmp_path / "launched"), _envs(tmp_path / "forked")
    assert sorted(real) == sorted(ours) == ["0", "1", "2"]
    for rank in real:
        a, b = real[rank], ours[rank]
        assert set(a) - set(b) <= LAUNCHER_ONLY and set(b) <= set(a), (set(a) ^ set(b))
        differ = {k for k in b if a[k] != b[k]}
        assert differ == {"MASTER_PORT"}, {k: (a[k], b[k]) for k in differ}   # each launch its own free port
        assert b["THREADS"] == "1" and json.loads(b["ARGV"]) == ["--flag", "1"]


@pytest.mark.slow
def test_a_failing_rank_fails_the_run_and_a_hanging_one_is_stopped(tmp_path, monkeypatch):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "print('rank', os.environ['RANK'], flush=True)\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit('rank 1 gives up')\n"
                      "time.sleep(float(sys.argv[1]))\n")
    proc = run_ranks(tmp_path, script, 0)
    assert proc.returncode == 1 and proc.stdout == "rank 0\nrank 1\n" and proc.stderr == "rank 1 gives up\n"
    monkeypatch.setattr(ranks, "GRACE_S", 0.5)   # rank 0 waits 60 s for a peer that is gone: killed
    proc = run_ranks(tmp_path, script, 60, timeout=30)
    assert proc.returncode == 1 and proc.stderr == "rank 1 gives up\n"
    assert run_ranks(tmp_path, script, 0, processes=1).returncode == 0


@pytest.mark.slow
def test_run_script_is_a_plain_python_process(tmp_path):
    """``run_script``: no launcher variables, the caller's environment plus ``env``, and the
    script's own exit status (a launcher would say 1)."""
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT + "sys.exit(int(sys.argv[1]))\n")
    proc = run_script(tmp_path, script, 3, EXTRA="x")
    assert proc.returncode == 3
    env = _envs(tmp_path)["plain"]
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT", "ACCELERATE_USE_CPU"} & set(env) and env["EXTRA"] == "x"
    assert json.loads(env["ARGV"]) == ["3"] and env["HF_HOME"] == str(tmp_path / "hf")
