"""The quick demo end to end: train, sample, evaluate, report (marked slow)."""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("params", "train_time_s", "images_per_sec", "nfe", "class_consistency", "frechet_distance")


@pytest.mark.slow
def test_quick_demo_writes_a_complete_report(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    import demo

    assert demo.main(["--quick", "--out", str(tmp_path / "demo")]) == 0
    out = tmp_path / "demo"
    report = json.loads((out / "report.json").read_text())
    assert [r["model"] for r in report["models"]] == ["NaLaDiT", "NaLaSiT", "DiT"]
    for row in report["models"]:
        for key in COLUMNS:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (row["model"], key, row[key])
        assert 0.0 <= row["class_consistency"] <= 1.0
        assert (out / f"{row['model']}_grid.png").is_file()
    # Real digits are the ceiling: near-perfect classification, small distance.
    assert report["ceiling"]["class_consistency"] > 0.9
    md = (out / "report.md").read_text()
    for header in ("model", "params", "train time", "images/s", "sampler", "NFE", "class-consistency", "Fréchet distance"):
        assert header in md
    assert (out / "loss.png").stat().st_size > 1000
