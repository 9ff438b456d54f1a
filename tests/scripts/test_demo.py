"""The demo: it never deletes a run it did not make (fast), and the quick demo end to end:
train, sample, evaluate, report, and the printed next steps run as printed (marked slow)."""

import importlib
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.utils import assert_names

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ("params", "train_time_s", "images_per_sec", "nfe", "class_consistency", "frechet_distance")
PY = sys.executable


@pytest.fixture
def demo(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import demo

    return demo


def plant_full_demo(out: Path) -> dict[str, bytes]:
    """A finished demo as today's and earlier demo.py leave it (no mark file): report,
    reference, a run folder with a checkpoint. Returns {relative path: bytes}."""
    files = {
        "report.json": b'{"quick": false}',
        "report.md": b"# Digits demo report\n",
        "ref_heldout.npz": b"reference",
        "NaLaDiT/checkpoints/0000600/ema.safetensors": b"\x00weights\x01" * 100,
        "NaLaDiT/log.jsonl": b'{"step": 600, "loss": 0.1}\n',
    }
    for rel, data in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    return files


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_quick_demo_leaves_a_planted_full_demo_untouched(demo, tmp_path, monkeypatch):
    """`make demo QUICK=1` used to rmtree runs/demo. Now --quick defaults to runs/demo-quick,
    and a second quick run moves the first aside instead of deleting it."""
    monkeypatch.setattr(demo, "ROOT", tmp_path)
    ran = []

    def fake_run_demo(out, quick, threads, classifier):  # the folder handling, without 20 s of training
        ran.append((out, quick, threads, classifier))
        (out / "report.json").write_text(json.dumps(dict(run=len(ran))))

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    full = tmp_path / "runs" / "demo"
    planted = plant_full_demo(full)
    monkeypatch.chdir(tmp_path)
    assert demo.main(["--quick", "--threads", "1"]) == 0
    assert demo.main(["--quick", "--digits-classifier", "mine"]) == 0
    assert snapshot(full) == planted
    quick = tmp_path / "runs" / "demo-quick"
    assert [r[0] for r in ran] == [quick, quick] and ran[0][1:] == (True, ["--threads", 1], None) and ran[1][2] == []
    assert ran[1][3] == tmp_path / "mine"   # a classifier folder given: passed on resolved (default: <out>'s own)
    assert json.loads((quick / "report.json").read_text()) == dict(run=2)
    (aside,) = sorted((tmp_path / "runs").glob("demo-quick.old-*"))
    assert json.loads((aside / "report.json").read_text()) == dict(run=1)
    # The lock is released after each run, so the next one could start.
    assert not (tmp_path / "runs" / "demo-quick.lock").exists()


def test_full_demo_moves_a_previous_full_demo_aside(demo, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "run_demo", lambda out, quick, threads, classifier: None)
    out = tmp_path / "demo"
    planted = plant_full_demo(out)
    assert demo.main(["--out", str(out)]) == 0
    (aside,) = tmp_path.glob("demo.old-*")
    assert snapshot(aside) == planted
    assert [p.name for p in out.iterdir()] == [demo.DEMO_MARK]  # the new demo starts empty


def test_prepare_out_rules(demo, tmp_path, capsys):
    # Missing or empty: used as is, nothing moved.
    assert demo.prepare_out(tmp_path / "new") is None and (tmp_path / "new" / demo.DEMO_MARK).is_file()
    (tmp_path / "empty").mkdir()
    assert demo.prepare_out(tmp_path / "empty") is None
    # A demo's folder (the mark alone is enough): moved aside, twice in one second too.
    first = demo.prepare_out(tmp_path / "new")
    second = demo.prepare_out(tmp_path / "new")
    assert first != second and first.is_dir() and second.is_dir()
    assert {p.name for p in tmp_path.iterdir()} == {"new", "empty", first.name, second.name}
    assert f"aside to {first}" in capsys.readouterr().out
    # Anything else is refused, nothing changed.
    user = tmp_path / "mine"
    (user / "thesis").mkdir(parents=True)
    (user / "thesis" / "draft.tex").write_text("precious")
    with pytest.raises(SystemExit) as err:
        demo.prepare_out(user)
    assert_names(err, f"--out {user}", "not a demo's output", "nothing was changed", "a new or empty folder")
    assert snapshot(user) == {"thesis/draft.tex": b"precious"}
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="is a file, not a folder"):
        demo.prepare_out(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"


def test_a_second_demo_into_the_same_folder_is_refused(demo, tmp_path, monkeypatch):
    from nala_dit.runlock import RunLock

    monkeypatch.setattr(demo, "run_demo", lambda out, quick, threads, classifier: pytest.fail("must not run"))
    out = tmp_path / "demo"
    planted = plant_full_demo(out)
    with RunLock(tmp_path / "demo.lock", "demo folder"):  # a demo running in this process
        with pytest.raises(SystemExit) as err:
            demo.main(["--out", str(out)])
    assert str(err.value).startswith("error: "), err.value
    assert_names(err, f"demo folder {out}", f"in use by pid {os.getpid()}", "another --out")
    assert snapshot(out) == planted and not list(tmp_path.glob("demo.old-*"))


def test_cli_refuses_a_foreign_out_folder_in_one_line(tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    proc = subprocess.run([PY, str(ROOT / "demo.py"), "--quick", "--out", str(user)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert_names(lines[0], f"--out {user}", "not a demo's output", "nothing was changed", "a new or empty folder")
    assert snapshot(user) == {"notes.txt": b"keep me"} and not list(tmp_path.glob("mine.old-*"))
    bad = subprocess.run([PY, str(ROOT / "demo.py"), "--threads", "0", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--threads must be >= 1, got 0" in bad.stderr
    assert not (tmp_path / "x").exists()


def test_report_throughput_is_images_over_train_time(demo):
    row = dict(model="DiT", preset="DiT-T/2", params=1, steps=600, train_time_s=100.0, images_per_sec=384.0,
               sampler="ddpm", cfg_scale=2.0, nfe=40, class_consistency=0.5, frechet_distance=10.0)
    nala = dict(row, model="NaLaDiT", train_time_s=200.0, images_per_sec=192.0)
    md = demo.render_report(dict(quick=False, samples_per_model=300, models=[nala, row],
                                 ceiling=dict(model="real", class_consistency=1.0, frechet_distance=3.0)))
    assert "training throughput 0.50×" in md  # = 100 s / 200 s, the ratio of the train times


def test_next_steps_run_in_the_demos_python_with_its_threads(demo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    plain = demo.next_steps(tmp_path / "runs" / "demo").splitlines()
    commands = [line.strip() for line in plain if line.startswith("  ")]
    assert len(commands) == 6 and all(c.startswith(".venv/bin/python ") for c in commands)
    assert "--threads" not in "\n".join(plain)
    assert "--ckpt runs/demo/NaLaDiT-16 " in commands[2] and "naladit16_grid.png" in commands[2]
    # every grid drawn with a digit 32 px wide: 8-px digits ×4, the 16-px ones ×2
    samples = [argv for argv in (c.split("#")[0].split() for c in commands) if Path(argv[1]).name == "sample.py"]
    assert [argv[argv.index("--grid-scale") + 1] for argv in samples] == ["4", "4", "2", "4"]
    threaded = [line.split("#")[0].split() for line in demo.next_steps(tmp_path / "runs" / "demo", ["--threads", 2]).splitlines()
                if line.startswith("  ")]
    assert [c[-2:] == ["--threads", "2"] for c in threaded] == [True, True, True, False, True, True]  # not export.py's
    command, comment = commands[5].split("#", 1)
    assert command.rstrip().endswith("app.py --ckpt runs/demo/NaLaDiT")   # the command to copy, whole
    assert_names(comment, "web page", "http://127.0.0.1:7860", "docs/app.md")
    monkeypatch.setattr(sys, "executable", "")
    assert demo.next_steps(tmp_path / "x").splitlines()[2].startswith("  python ")
    # the quick demo's lines: the same commands at its sampler steps (its models are at chance)
    quick = demo.next_steps(tmp_path / "runs" / "demo", quick=True).splitlines()
    steps = [line.split("--steps ")[1].split()[0] for line in quick if "--steps " in line]
    assert steps == [str(demo.QUICK["sample_steps"])] * 4 == ["5"] * 4
    full = demo.next_steps(tmp_path / "runs" / "demo").splitlines()
    assert [line.replace("--steps 5 ", "") for line in quick] == \
           [line.replace("--steps 40 ", "").replace("--steps 16 ", "") for line in full]


@pytest.mark.slow
def test_quick_demo_writes_a_complete_report(tmp_path, monkeypatch, capsys, demo, digits_classifier_dir):
    monkeypatch.chdir(tmp_path)  # where the user runs it: the printed lines are relative to here
    out = tmp_path / "demo"
    # scored by the session's digits classifier: the one the demo would train (its training is deterministic)
    from nala_dit.checkpoints import ema as ema_lib

    monkeypatch.setattr(ema_lib, "_SAID", set())   # this process has said no EMA warning yet
    assert demo.main(["--quick", "--threads", "1", "--out", "demo",
                      "--digits-classifier", str(digits_classifier_dir)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    # its models are at chance (the report says so): the EMA warning once, not at each of its 15 loads
    assert captured.err.count("warning: the EMA weights") == 1, captured.err
    report = json.loads((out / "report.json").read_text())
    assert not (out / "digits_classifier").exists()   # the given one scored: none trained into --out
    assert [r["model"] for r in report["models"]] == ["NaLaDiT", "NaLaSiT", "DiT"]
    for row in report["models"]:
        for key in COLUMNS:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (row["model"], key, row[key])
        assert 0.0 <= row["class_consistency"] <= 1.0
        assert (out / f"{row['model']}_grid.png").is_file()
        # --quick: 5 steps of batch 64 over the train time (rounded to 0.01 s; images/s to 0.1).
        assert row["steps"] == 5
        assert row["images_per_sec"] == pytest.approx(5 * 64 / row["train_time_s"], rel=0.05, abs=0.1)
    # Up the ladder: the 8-px NaLaDiT sampled at 16 px, then fine-tuned there (5 steps in --quick).
    ladder = report["ladder"]
    assert [r["steps"] for r in ladder["rows"]] == [0, 5] and ladder["side"] == 16 and ladder["time_s"] > 0
    for r in ladder["rows"]:
        assert 0.0 <= r["class_consistency"] <= 1.0 and math.isfinite(r["frechet_distance"])
    assert (out / "NaLaDiT_at16_grid.png").is_file() and (out / "NaLaDiT-16_grid.png").is_file()
    assert np.load(out / "NaLaDiT-16_samples.npz")["arr_0"].shape == (20, 16, 16, 1)   # --quick: 2 per digit
    assert json.loads((out / "NaLaDiT-16" / "init_from.json").read_text())["base_grid_side"] == 4
    # Real digits are the ceiling: near-perfect classification, small distance.
    assert report["ceiling"]["class_consistency"] > 0.9
    md = (out / "report.md").read_text()
    for header in ("model", "params", "train time", "images/s", "sampler", "NFE", "class-consistency", "Fréchet distance",
                   "## Up the ladder: NaLaDiT at 16 px", "| NaLaDiT 8 → 16 px, fine-tuned | 5 |"):
        assert header in md
    assert (out / "loss.png").stat().st_size > 1000
    # the samples beside the scores, 32 px per digit; the quick report says its models are at chance
    from PIL import Image

    assert Image.open(out / "NaLaDiT_grid_x4.png").size == (408, 408) and "](NaLaDiT_grid_x4.png) |" in md
    assert Image.open(out / "NaLaDiT-16_grid_x2.png").size == (2 * (2 * 18 + 2), 2 * (10 * 18 + 2))  # 2 per digit
    assert "these models are at chance" in md
    # The printed next steps run as printed, here where the demo ran: they start with the
    # demo's interpreter and carry its --threads. The first through a shell, the rest
    # through each CLI's main (the same argv, without four more interpreter starts).
    lines = [line for line in printed.splitlines() if line.startswith(f"  {sys.executable} ")]
    assert len(lines) == 6
    commands = [shlex.split(line.split("#")[0]) for line in lines]
    assert [Path(c[1]).name for c in commands] == ["sample.py", "sample.py", "sample.py", "export.py", "sample.py",
                                                   "app.py"]
    assert all(c[-2:] == ["--threads", "1"] for c in commands if Path(c[1]).name in ("sample.py", "app.py"))
    # the quick demo's models sample at its own 5 sampler steps (the full demo's: 40 DDPM, 16 Heun)
    assert [c[c.index("--steps") + 1] for c in commands if "--steps" in c] == ["5", "5", "5", "5"]
    assert "--ckpt demo/NaLaDiT " in printed and "--ckpt demo/NaLaSiT " in printed and "--ckpt demo/NaLaDiT-16 " in printed
    assert "--copy-vae" not in printed  # pixel-space models have no VAE to copy
    proc = subprocess.run(lines[0], shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for _, script, *argv in commands[1:-1]:
        assert importlib.import_module(Path(script).stem).main(argv) == 0
    # the web page's line: its model loads and the page builds (serving it is tests/scripts/test_app.py's)
    if importlib.util.find_spec("gradio") is not None:
        import app

        args = app.build_parser().parse_args(commands[-1][2:])
        assert app.Demo(args, app.load(args)).page() is not None
    assert {p.name for p in tmp_path.glob("*_grid.png")} == {"naladit_grid.png", "nalasit_grid.png",
                                                            "naladit16_grid.png", "exported_grid.png"}
    # readable at screen size: 8 per digit, a row per digit, each pixel drawn 4 × 4 (the 16-px model's 2 × 2)
    assert Image.open(tmp_path / "naladit_grid.png").size == (4 * (8 * 10 + 2), 4 * (10 * 10 + 2))
    assert Image.open(tmp_path / "naladit16_grid.png").size == (2 * (8 * 18 + 2), 2 * (10 * 18 + 2))
    assert (tmp_path / "exported" / "demo-naladit" / "model_index.json").is_file()


def test_quick_and_full_demo_next_lines_write_to_different_places(demo, tmp_path, monkeypatch):
    """Pasting the quick demo's block after the full one's (or the
    reverse) exports and samples each demo's own model: no output path in common."""
    monkeypatch.chdir(tmp_path)
    full, quick = (demo.next_steps(tmp_path / "runs" / name) for name in ("demo", "demo-quick"))
    exports = [[line.split()[4] for line in block.splitlines() if "export.py checkpoint " in line]
               for block in (full, quick)]
    assert exports == [["exported/demo-naladit"], ["exported/demo-quick-naladit"]]
    assert "--ckpt exported/demo-quick-naladit " in quick and "exported/demo-naladit" not in quick


def test_readme_next_lines_are_what_the_full_demo_prints(demo, monkeypatch):
    """The README's block is the full demo's printout, line for line
    (run from the repository with `make demo`: .venv/bin/python, runs/demo, no --threads)."""
    import re

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "executable", str(ROOT / ".venv" / "bin" / "python"))
    printed = [line[2:] for line in demo.next_steps(ROOT / "runs" / "demo").splitlines() if line.startswith("  ")]
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"\*\*Next: use the demo's models\*\*.*?```bash\n(.*?)```", readme, re.S).group(1)
    assert block.splitlines() == printed
    assert len(printed) == 6 and "these six lines" in readme


def test_report_shows_enlarged_samples_beside_the_scores_and_says_quick_models_are_at_chance(demo, tmp_path):
    """The grids (102 × 102 px for 10 × 10 digits of 8 px) are shown at
    32 px per digit, nearest neighbour (every sampled pixel a 4 × 4 block), in a table beside
    the scores; the quick report says its models are at chance."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (102, 102), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "NaLaDiT_grid.png")
    path, size = demo.enlarge_grid(tmp_path / "NaLaDiT_grid.png", 8)
    assert path == tmp_path / "NaLaDiT_grid_x4.png" and size == (408, 408)
    np.testing.assert_array_equal(np.asarray(Image.open(path)), pixels.repeat(4, 0).repeat(4, 1))
    assert demo.enlarge_grid(tmp_path / "NaLaDiT_grid.png", 16)[1] == (204, 204)  # 16-px digits: ×2

    row = dict(model="NaLaDiT", preset="NaLaDiT-T/2", params=1, steps=20, train_time_s=10.0, images_per_sec=128.0,
               sampler="ddpm", cfg_scale=2.0, nfe=10, class_consistency=0.103, frechet_distance=40.0)
    report = dict(quick=True, samples_per_model=100, models=[row],
                  ceiling=dict(model="real", class_consistency=1.0, frechet_distance=3.0),
                  grids={"NaLaDiT": dict(file=path.name, width=408, height=408)})
    md = demo.render_report(report)
    assert_names(md, "Quick smoke run", "at chance", "20 training steps")
    assert ("| NaLaDiT | 0.103 | 40.000 | ![NaLaDiT samples, 408×408 px](NaLaDiT_grid_x4.png) |"
            in md.split("## Samples")[1])
    assert "at chance" not in demo.render_report(dict(report, quick=False))
