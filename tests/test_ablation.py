"""The ablation's data and runner: the digits canvas task and the quick grid."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nala_dit.digits import CANVAS_DIGIT, CANVAS_SIZE, load_canvas_split, load_digits_split


def test_canvas_is_deterministic_and_holds_the_labelled_digit():
    a, labels, offsets = load_canvas_split("heldout")
    b, labels_b, offsets_b = load_canvas_split("heldout")
    assert np.array_equal(a, b) and np.array_equal(labels, labels_b) and np.array_equal(offsets, offsets_b)
    c, _, offsets_c = load_canvas_split("heldout", seed=5)
    assert not np.array_equal(offsets, offsets_c) and not np.array_equal(a, c)
    digits, digit_labels = load_digits_split("heldout")
    assert a.shape == (360, CANVAS_SIZE, CANVAS_SIZE) and a.dtype == np.uint8
    assert np.array_equal(labels, digit_labels)                # label = the pasted digit
    assert offsets.min() >= 0 and offsets.max() <= CANVAS_SIZE - CANVAS_DIGIT
    # Known answer: the digit, upscaled 2x, sits at its offset; everything else is 0.
    big = F.interpolate(torch.from_numpy(digits).float()[:, None], size=(16, 16), mode="bilinear",
                        align_corners=False)[:, 0].round().numpy().astype(np.uint8)
    for k in (0, 1, 359):
        r, col = offsets[k]
        assert np.array_equal(a[k, r:r + 16, col:col + 16], big[k])
        rest = a[k].copy()
        rest[r:r + 16, col:col + 16] = 0
        assert rest.max() == 0
    train, train_labels, _ = load_canvas_split("train")
    assert len(train) == 4 * 1437
    assert np.array_equal(np.bincount(train_labels), 4 * np.bincount(load_digits_split("train")[1]))


def test_quick_ablation_writes_a_complete_finite_table(tmp_path, digits_classifier_dir):
    import benchmarks.ablation as ablation

    assert ablation.main(["run", "--quick", "--out", str(tmp_path), "--classifier-dir", str(digits_classifier_dir)]) == 0
    rows = json.loads((tmp_path / "table.json").read_text())["rows"]
    budgets = ablation.QUICK["budgets"]
    assert {(r["variant"], r["budget"]) for r in rows} == {(v, b) for v in ablation.QUICK_VARIANTS for b in budgets}
    for r in rows:
        assert r["n"] == len(ablation.QUICK_SEEDS)
        for m in ablation.METRICS:
            assert math.isfinite(r[m]) and math.isfinite(r[m + "_std"]), (r["variant"], m)
        assert 0 <= r["class_consistency"] <= 1 and r["frechet_distance"] >= 0
    table = (tmp_path / "table.md").read_text()
    assert "| softmax | 2e-3 | 2 |" in table and "| nala | 2e-3 | 2 |" in table
    # A rerun finds every cell done and trains nothing.
    cells = sorted((tmp_path / "cells").rglob("*.json"))
    stamps = [p.stat().st_mtime_ns for p in cells]
    assert ablation.main(["run", "--quick", "--out", str(tmp_path), "--classifier-dir", str(digits_classifier_dir)]) == 0
    assert [p.stat().st_mtime_ns for p in cells] == stamps
    # The README block is regenerated in place: text outside the markers is kept, a second
    # fill gives the same file, and a file without markers is refused with the fix.
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- ablation:start old -->\nstale table\n<!-- ablation:end -->\nclaims\n")
    assert ablation.main(["table", "--out", str(tmp_path), "--readme", str(readme)]) == 0
    filled = readme.read_text()
    assert filled.startswith("intro\n<!-- ablation:start") and filled.endswith("<!-- ablation:end -->\nclaims\n")
    assert "stale table" not in filled and "| nala | 2e-3 | 2 |" in filled
    assert "Digits (16 tokens): 4 cells" in filled and f"budgets {', '.join(map(str, budgets))} steps" in filled
    assert ablation.main(["table", "--out", str(tmp_path), "--readme", str(readme)]) == 0
    assert readme.read_text() == filled
    with pytest.raises(SystemExit, match="no such file"):
        ablation.main(["table", "--out", str(tmp_path), "--readme", str(tmp_path / "missing.md")])
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="add the two marker lines"):
        ablation.main(["table", "--out", str(tmp_path), "--readme", str(readme)])
