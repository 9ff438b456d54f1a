"""The ablation's data and runner: the digits canvas task and the quick grid."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nala_dit.data.digits import (
    CANVAS_DIGIT,
    CANVAS_SIZE,
    load_canvas_split,
    load_digits_split,
)
from tests.utils import assert_names

pytestmark = pytest.mark.slow   # runs scripts end to end: the full tier (make test)


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
    from experiments.ablation import study as ablation

    # The isolated step times first (one thread, round robin), so the table ranks time to loss.
    assert ablation.main(["timing", "--quick", "--out", str(tmp_path), "--tasks", ",".join(ablation.QUICK_TASKS),
                          "--variants", ",".join(ablation.QUICK_VARIANTS)]) == 0
    timing = json.loads((tmp_path / "timing.json").read_text())
    assert timing["meta"]["threads"] == 1 and set(timing["tasks"]) == set(ablation.QUICK_TASKS)
    assert set(timing["task_meta"]) == set(ablation.QUICK_TASKS)              # each task's own conditions
    assert all(m["variants"] == list(ablation.QUICK_VARIANTS) and len(m["loadavg_end"]) == 3
               for m in timing["task_meta"].values())
    for task in ablation.QUICK_TASKS:
        for v in ablation.QUICK_VARIANTS:
            row = timing["tasks"][task][v]
            # 2 rounds x 1 step: the median of two times is their mean (times are stored to 0.1 ms).
            assert len(row["steps_s"]) == 2 and abs(row["median_step_s"] - sum(row["steps_s"]) / 2) <= 1e-4
            assert row["batch"] == ablation.task_recipe(task, True)["batch"]
    assert ablation.main(["run", "--quick", "--out", str(tmp_path), "--classifier-dir", str(digits_classifier_dir)]) == 0
    rows = json.loads((tmp_path / "table.json").read_text())["rows"]
    budgets = ablation.QUICK["budgets"]
    # the ladder cells' sources (the 256-token canvas cells) ran first and are recorded too
    tasks = (*ablation.QUICK_TASKS, "canvas")
    assert {(r["task"], r["variant"], r["budget"]) for r in rows} == \
           {(t, v, b) for t in tasks for v in ablation.QUICK_VARIANTS for b in budgets}
    for v in ablation.QUICK_VARIANTS:       # every ladder cell started from its own source, resized
        run = tmp_path / "work" / "runs" / ablation.cell_name("ladder64_interp", v, 0, 2e-3)
        record = json.loads((run / "init_from.json").read_text())
        assert (record["source_input_size"], record["input_size"], record["pos_embed"]) == (32, 64, "interpolate")
    assert ablation.QUICK_TASKS[1] == "study64" and ablation.task_recipe("study64", True)["image_size"] == 64
    for r in rows:
        assert r["n"] == len(ablation.QUICK_SEEDS)
        sampled = r["budget"] in ablation.task_recipe(r["task"], True).get("sample_budgets", budgets)
        for m in ablation.METRICS:
            if m in ("class_consistency", "frechet_distance") and not sampled:  # the ladder samples at its last budget
                assert math.isnan(r[m]), (r["task"], r["variant"], m)
                continue
            assert math.isfinite(r[m]) and math.isfinite(r[m + "_std"]), (r["task"], r["variant"], m)
        if sampled:
            assert 0 <= r["class_consistency"] <= 1 and r["frechet_distance"] >= 0
        # the raw weights are scored beside the EMA at every budget (an EMA of 0.99 lags ~100 steps)
        assert r["heldout_loss_raw_n"] == r["n"] and math.isfinite(r["heldout_loss_raw"]), (r["task"], r["variant"])
        # the study's noise bands fill every row of the study task, and no other task has them
        for band in ablation.BANDS:
            if r["task"] == "study64":
                assert r[band + "_n"] == r["n"] and math.isfinite(r[band]) and math.isfinite(r[band + "_std"])
            else:
                assert r[band + "_n"] == 0
    # the study cells trained with its rules: the EMA warm-up, and Mix-FFN's conv at identity
    for v, mix in (("softmax", None), ("nala_mix", "identity")):
        config = (tmp_path / "work" / "runs" / ablation.cell_name("study64", v, 0, 2e-3) / "config.yaml").read_text()
        assert "ema-warmup: true" in config and f"mix-init: {mix or 'null'}" in config, v
    table = (tmp_path / "table.md").read_text()
    assert "## study64, 2 steps" in table and "| softmax | 2e-3 | 2 | — | — |" in table
    assert table.count("held-out loss by noise band: low · mid · high") == len(budgets)       # the study's tables only
    for task in ablation.QUICK_TASKS:
        title = ablation.TASK_TITLES[task]
        assert f"## {title}: time to held-out loss" in table and f"## {title}: held-out loss at equal compute" in table
    for task in ("study64", "ladder64_interp"):                   # one curve plot per ladder size
        assert (tmp_path / f"curves_{task}.png").stat().st_size > 10_000
    assert "| softmax | 2e-3 | 2 |" in table and "| nala_mix | 2e-3 | 2 |" in table
    # A rerun finds every cell done and trains nothing.
    cells = sorted((tmp_path / "cells").rglob("*.json"))
    stamps = [p.stat().st_mtime_ns for p in cells]
    assert ablation.main(["run", "--quick", "--out", str(tmp_path), "--classifier-dir", str(digits_classifier_dir)]) == 0
    assert [p.stat().st_mtime_ns for p in cells] == stamps
    # The page's block (experiments/ablation/README.md) is regenerated in place: text outside the markers is
    # kept, a second fill (by the old flag name --readme) gives the same file, and a file
    # without markers is refused with the fix.
    readme = tmp_path / "ablation.md"
    readme.write_text("intro\n<!-- ablation:start old -->\nstale table\n<!-- ablation:end -->\nclaims\n")
    assert ablation.main(["table", "--out", str(tmp_path), "--page", str(readme)]) == 0
    filled = readme.read_text()
    assert filled.startswith("intro\n<!-- ablation:start") and filled.endswith("<!-- ablation:end -->\nclaims\n")
    assert "stale table" not in filled and "| nala_mix | 2e-3 | 2 |" not in filled   # results: RESULTS.md only
    assert f"| Digits (16 tokens) | 4 | " in filled and f" | {', '.join(map(str, budgets))} |" in filled
    assert ablation.main(["table", "--out", str(tmp_path), "--readme", str(readme)]) == 0
    assert readme.read_text() == filled
    with pytest.raises(SystemExit, match="no such file"):
        ablation.main(["table", "--out", str(tmp_path), "--page", str(tmp_path / "missing.md")])
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="add the two marker lines"):
        ablation.main(["table", "--out", str(tmp_path), "--page", str(readme)])


def test_time_to_loss_ranks_variants_by_compute_time_to_the_common_target(tmp_path):
    """Known answer: softmax reaches 0.30 (the loss every variant reaches) at 200 steps x 2.0 s =
    400 s, NaLa at 400 steps x 0.5 s = 200 s: NaLa first, softmax 2.00x slower."""
    from experiments.ablation import study as ablation

    losses = {"softmax": {100: 0.40, 200: 0.30, 400: 0.25}, "nala": {100: 0.50, 200: 0.35, 400: 0.30}}
    for variant, by_budget in losses.items():
        for seed in (0, 1, 2):
            budgets = [dict(budget=b, heldout_loss=v, train_loss=v, train_time_s=1.0, class_consistency=math.nan,
                            frechet_distance=math.nan) for b, v in by_budget.items()]
            ablation.write_json(ablation.cell_path(tmp_path, "canvas128", variant, seed, 2e-3),
                                dict(task="canvas128", variant=variant, seed=seed, lr=2e-3, budgets=budgets))
    ablation.write_json(tmp_path / "timing.json", dict(tasks={"canvas128": {
        "softmax": dict(median_step_s=2.0), "nala": dict(median_step_s=0.5)}}))
    found = ablation.time_to_loss(ablation.summarize(ablation.load_cells(tmp_path)), ablation.load_timing(tmp_path))
    assert [(f["variant"], f["budget"], f["n"]) for f in found] == [("nala", 400, 3), ("softmax", 200, 3)]
    assert [f["time_s"] for f in found] == [200.0, 400.0] and [f["factor"] for f in found] == [1.0, 2.0]
    assert all(f["target"] == 0.30 for f in found)
    table = ablation.write_table(tmp_path).read_text()
    assert "## Canvas 128 px (4,096 tokens): time to held-out loss 0.3000" in table
    assert "| nala | 3 | 400 | 0.500 | 200.0 | 1.00 |" in table and "| softmax | 3 | 200 | 2.000 | 400.0 | 2.00 |" in table
    assert "| softmax | 2e-3 | 3 | — | — | 0.3000 ± 0.0000 |" in table    # not sampled: shown as —
    # Equal compute: NaLa's whole run is 400 x 0.5 = 200 s; in 200 s softmax (2.0 s a step)
    # affords exactly its 100-step budget (loss 0.40 against NaLa's 0.30).
    equal = ablation.equal_compute(ablation.summarize(ablation.load_cells(tmp_path)), ablation.load_timing(tmp_path))
    assert [(f["variant"], f["steps"], f["compute_s"], f["below"]["budget"], f["above"]) for f in equal] == [
        ("nala", 400, 200.0, 400, None), ("softmax", 100, 200.0, 100, None)]
    assert [f["below"]["heldout_loss"] for f in equal] == pytest.approx([0.30, 0.40], abs=1e-12)
    assert "## Canvas 128 px (4,096 tokens): held-out loss at equal compute (200 s)" in table
    assert "| softmax | 2.000 | 100 | 100 steps: 0.4000 ± 0.0000 (n = 3) |" in table
    # Between budgets: at 1.6 s a step softmax affords 125 steps, bracketed by 100 and 200;
    # at 2.5 s it affords 80, under its first budget, which is then the only one shown.
    for step, steps, around in ((1.6, 125, "100 steps: 0.4000 ± 0.0000 (n = 3) · 200 steps: 0.3000 ± 0.0000 (n = 3)"),
                                (2.5, 80, "none measured below · 100 steps: 0.4000 ± 0.0000 (n = 3)")):
        ablation.write_json(tmp_path / "timing.json", dict(tasks={"canvas128": {
            "softmax": dict(median_step_s=step), "nala": dict(median_step_s=0.5)}}))
        equal = ablation.equal_compute(ablation.summarize(ablation.load_cells(tmp_path)), ablation.load_timing(tmp_path))
        assert [(f["variant"], f["steps"]) for f in equal] == [("nala", 400), ("softmax", steps)]
        assert f"| softmax | {step:.3f} | {steps} | {around} |" in ablation.write_table(tmp_path).read_text()
    # The full table (results/RESULTS.md) has the compute tables; the record's block links to it.
    page = ablation.render_table(ablation.summarize(ablation.load_cells(tmp_path)), [], ablation.load_timing(tmp_path))
    assert "## Canvas 128 px (4,096 tokens): held-out loss at equal compute (200 s)" in page
    # At plain softmax's compute (its 400 steps x 2.5 s = 1,000 s) NaLa affords 2,000 steps;
    # its runs stop at 400, the last budget shown.
    at_softmax = ablation.equal_compute(ablation.summarize(ablation.load_cells(tmp_path)),
                                        ablation.load_timing(tmp_path), reference="softmax")
    assert [(f["variant"], f["steps"], f["compute_s"], f["below"]["budget"]) for f in at_softmax] == [
        ("nala", 2000, 1000.0, 400), ("softmax", 400, 1000.0, 400)]
    assert "## Canvas 128 px (4,096 tokens): held-out loss at plain softmax's compute (1000 s)" in page
    assert "| nala | 0.500 | 2000 | 400 steps: 0.3000 ± 0.0000 (n = 3) |" in page


def test_quick_timing_builds_and_steps_every_remedy_variant(tmp_path):
    """The 4,096-token study's variants (``--variants remedies``): each one's flags build its
    model (the parameter count says which blocks changed) and take timed training steps."""
    from experiments.ablation import study as ablation
    from nala_dit.cli.config import resolve
    from nala_dit.cli.options import TrainConfig
    from nala_dit.models.dit import count_params
    from nala_dit.training.loop import build_model

    assert ablation.main(["timing", "--quick", "--out", str(tmp_path), "--tasks", "canvas64",
                          "--variants", "nala,remedies"]) == 0
    rows = json.loads((tmp_path / "timing.json").read_text())["tasks"]["canvas64"]
    assert list(rows) == ["nala", *ablation.REMEDY_VARIANTS]
    assert all(len(r["steps_s"]) == 2 and r["median_step_s"] > 0 for r in rows.values())

    def params(variant):
        cfg, _ = resolve(TrainConfig, [*ablation.VARIANTS[variant], "--data", "digits-canvas", "--image-size", "64"])
        return count_params(build_model(cfg, input_size=64, in_channels=1, num_classes=10))

    nala, c, heads, depth = params("nala"), 128, 4, 4
    assert params("nala_r2") - nala == depth * heads * 4 ** 2
    assert params("nala_r4") - nala == depth * heads * 16 ** 2
    assert params("nala_mix") - nala == depth * 10 * 4 * c
    assert params("nala_r4_mix") - nala == depth * (heads * 16 ** 2 + 10 * 4 * c)
    # a gated NaLa layer: qkvg 4C² + 4C, LePE 25C + C, LayerNorm 2C, proj C² + C; DiT's: 4C² + 4C
    swap = (5 * c * c + 33 * c) - (4 * c * c + 4 * c)
    assert params("hybrid_b0") == nala - swap
    assert params("hybrid_b13") == nala - 2 * swap


def test_summary_counts_the_raw_weight_loss_only_where_cells_have_it():
    from experiments.ablation import study as ablation
    from experiments.ablation.study.summary import _raw_cell

    def cell(seed, raw):
        row = dict(budget=300, class_consistency=0.1, frechet_distance=5.0, train_loss=0.03, heldout_loss=0.04,
                   train_time_s=10.0, **({"heldout_loss_raw": raw} if raw is not None else {}))
        return dict(task="canvas128", variant="nala_r2", lr=2e-3, seed=seed, budgets=[row])

    rows = ablation.summarize([cell(0, 0.02), cell(1, None), cell(2, 0.04)])
    assert len(rows) == 1 and rows[0]["n"] == 3 and rows[0]["heldout_loss_raw_n"] == 2
    assert rows[0]["heldout_loss_raw"] == pytest.approx(0.03) and rows[0]["heldout_loss_raw_std"] == pytest.approx(2 ** 0.5 / 100)
    assert _raw_cell(rows[0]) == "0.0300 ± 0.0141 (n = 2)"
    assert _raw_cell(ablation.summarize([cell(0, None)])[0]) == "—"


def test_the_record_shows_each_task_at_the_last_budget_every_variant_reached():
    """Known answer: softmax and NaLa reach 200 and 400 steps, only NaLa is continued to 800, so
    the record's block says the variants compare at 400 steps and links that table; the rows
    themselves are in the full table only, at all three budgets."""
    from experiments.ablation import study as ablation
    from experiments.ablation.study.tables import comparison_budget

    def cell(variant, budgets, seed=0):
        rows = [dict(budget=b, class_consistency=0.1, frechet_distance=5.0, train_loss=0.03, heldout_loss=1 / b,
                     train_time_s=10.0) for b in budgets]
        return dict(task="canvas", variant=variant, lr=2e-3, seed=seed, budgets=rows, wall_total_s=60.0)

    cells = [cell("softmax", (200, 400)), cell("nala", (200, 400, 800))]
    rows = ablation.summarize(cells)
    assert comparison_budget(rows, "canvas") == 400
    block = ablation.readme_block(rows, cells)
    # 2 cells, 120 s = 2 core-minutes; compared at 400 steps, linked to that table's heading
    assert "| Canvas (256 tokens) | 2 | 2 | 200, 400, 800 | [400 steps](results/RESULTS.md#canvas-400-steps) |" in block
    assert "| softmax |" not in block and "| nala |" not in block
    table = ablation.render_table(rows, cells)
    assert all(f"## canvas, {b} steps" in table for b in (200, 400, 800))


def test_heldout_loss_by_noise_band_is_the_hand_computed_mean():
    """An objective whose loss is 1, 2 or 4 by the noise band of t (1,000 timesteps: t < 333,
    < 667, the rest): with 3 bands every band's mean is exactly its value, draw i falls in
    band i mod 3 (300 canvases: 100 draws each, across the 256-image batches), the overall loss
    is (100·1 + 100·2 + 100·4)/300 = 7/3, and a second model sees the very same draws."""
    from types import SimpleNamespace

    from experiments.ablation import study as ablation
    from experiments.ablation.study.scoring import band_edges, heldout_losses

    class BandObjective:
        num_timesteps = 1000

        def __init__(self):
            self.draws = []

        def training_losses(self, model, x, t, y, noise=None):
            self.draws.append(t.clone())
            return {"loss": torch.tensor([1.0, 2.0, 4.0])[torch.bucketize(t, torch.tensor([333, 667]), right=True)]}

    assert band_edges(1000, 3) == [0, 333, 667, 1000]
    data = SimpleNamespace(images=torch.zeros(300, 1, 2, 2), labels=torch.zeros(300, dtype=torch.long))
    model = SimpleNamespace(config=SimpleNamespace(objective="diffusion"))
    first, second = BandObjective(), BandObjective()
    out = heldout_losses(model, first, data, items=None, repeats=1, bands=3)
    assert out == {"heldout_loss": pytest.approx(7 / 3, abs=1e-12), "heldout_loss_low": 1.0,
                   "heldout_loss_mid": 2.0, "heldout_loss_high": 4.0}
    t = torch.cat(first.draws)
    assert len(t) == 300 and torch.equal(torch.bucketize(t, torch.tensor([333, 667]), right=True), torch.arange(300) % 3)
    assert t.min() >= 0 and t.max() < 1000 and len(set(t.tolist())) > 250           # spread within the bands
    heldout_losses(model, second, data, items=None, repeats=1, bands=3)
    assert torch.equal(torch.cat(second.draws), t)                                 # the same draws for every model
    # Without bands: the plain uniform draws, as every cell before the study was scored.
    assert set(heldout_losses(model, BandObjective(), data, repeats=1)) == {"heldout_loss"}
    assert ablation.heldout_loss(model, BandObjective(), data, repeats=1) == heldout_losses(
        model, BandObjective(), data, repeats=1)["heldout_loss"]
    with pytest.raises(ValueError) as err:
        heldout_losses(SimpleNamespace(config=SimpleNamespace(objective="transport")), first, data, bands=3)
    assert_names(err, "noise bands", "diffusion objective", "'transport'", "bands=0")


def test_study_variants_and_recipe_flags():
    """The 2 x 2 and gated softmax +- Mix-FFN: Mix-FFN adds 40C parameters per block to any
    attention; a study task trains with the EMA warm-up and every Mix-FFN conv at identity."""
    from experiments.ablation import study as ablation
    from experiments.ablation.study.recipes import STUDY_TASKS, TWO_BY_TWO, recipe_flags
    from nala_dit.cli.config import resolve
    from nala_dit.cli.options import TrainConfig
    from nala_dit.models.dit import count_params
    from nala_dit.training.loop import build_model

    def params(variant):
        cfg, _ = resolve(TrainConfig, [*ablation.VARIANTS[variant], "--data", "digits-canvas", "--image-size", "64"])
        return count_params(build_model(cfg, input_size=64, in_channels=1, num_classes=10))

    c, depth = 128, 4
    assert TWO_BY_TWO == ("softmax", "softmax_mix", "nala", "nala_mix")
    counts = {v: params(v) for v in ("softmax", "softmax_mix", "softmax_gated", "softmax_gated_mix")}
    for plain in ("softmax", "softmax_gated"):        # (NaLa's: test_quick_timing_builds_and_steps_every_remedy_variant)
        assert counts[f"{plain}_mix"] - counts[plain] == depth * 10 * 4 * c
    assert counts["softmax_mix"] == 1_424_392                  # tests/models/test_dit.py's hand count
    for task in STUDY_TASKS:
        recipe = ablation.task_recipe(task, False)
        assert recipe_flags(recipe, "softmax_mix") == ["--ema-warmup", "true", "--mix-init", "identity"]
        assert recipe_flags(recipe, "nala") == ["--ema-warmup", "true"]
        assert recipe["heldout_bands"] == 3 and recipe["ema"] == 0.99
    assert recipe_flags(ablation.task_recipe("canvas128", False), "nala_mix") == []   # the ladder's cells, as they ran


def test_quick_recipes_are_the_least_that_fill_every_column():
    """--quick: the digits task at batch 16, sampled with guidance 2 at every budget; every canvas
    task (the ladder's 256-token source too) and every larger rung at batch 1, sampled at the
    last budget only, 2 sampler steps (a respaced sampler keeps both ends) without guidance.
    The full recipes are untouched."""
    from experiments.ablation import study as ablation
    from experiments.ablation.study.recipes import TASKS, is_canvas

    digits = ablation.task_recipe("digits", True)
    assert (digits["batch"], digits["cfg"], digits["sample_steps"], digits["budgets"]) == (16, 2.0, 2, (2, 4))
    assert "sample_budgets" not in digits
    small = [t for t in TASKS if is_canvas(t) or "image_size" in TASKS[t]]
    assert {"canvas", "canvas64", "study64", "ladder64_interp", "samples16"} <= set(small)
    for task in small:
        r = ablation.task_recipe(task, True)
        assert (r["batch"], r["cfg"], r["sample_steps"], r["sample_budgets"], r["per_class"], r["budgets"]) == \
               (1, 1.0, 2, (4,), 1, (2, 4)), task
    for task, batch in (("canvas", 32), ("canvas64", 8), ("samples16", 32)):
        full = ablation.task_recipe(task, False)
        assert (full["batch"], full["cfg"]) == (batch, 2.0) and full == TASKS[task], task


def test_training_flops_per_image_match_the_hand_count(tmp_path):
    """DiT-T/2 (C = 128, 4 blocks, 4 latent channels, patch 2) with Mix-FFN, forward FLOPs at N
    tokens = c0 + c1·N + c2·N² (2 per multiply-add), counted by hand:
    c0 = t-embedder 2·256·C + 2·C² + adaLN 4·2·C·6C + final adaLN 2·C·2C = 950,272;
    c1 = patch 2·16·C + per block (qkv 6C² + proj 2C² + fc1, fc2 16C² + 3×3 depthwise conv 2·4C·9)
         + final linear 2·C·(2·2·8) = 1,622,016;  c2 = per block 2·C (scores) + 2·C (weighted sum) = 2,048.
    Training = 3 × forward; the fit from N = 4, 16, 64 equals a direct count at 1,024 tokens."""
    from experiments.ablation import study as ablation
    from experiments.ablation.study.flops import (
        flops_block,
        flops_polynomial,
        forward_flops,
        training_flops,
    )

    c = 128
    c0 = 2 * 256 * c + 2 * c * c + 4 * (2 * c * 6 * c) + 2 * c * 2 * c
    c1 = 2 * 16 * c + 4 * (6 * c * c + 2 * c * c + 16 * c * c + 2 * 4 * c * 9) + 2 * c * 32
    c2 = 4 * (2 * c + 2 * c)
    assert (c0, c1, c2) == (950_272, 1_622_016, 2_048)
    assert flops_polynomial("T/2", "softmax_mix") == (c0, c1, c2)
    assert forward_flops("T/2", "softmax_mix", 64) == c0 + c1 * 1024 + c2 * 1024 ** 2
    assert training_flops((c0, c1, c2), 4096) == 3 * (c0 + c1 * 4096 + c2 * 4096 ** 2) == 123_013_398_528
    # The subcommand writes flops.json and the page's block (text outside the markers kept).
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- flops:start old -->\nstale\n<!-- flops:end -->\nend\n")
    assert ablation.main(["flops", "--out", str(tmp_path), "--sizes", "T/2", "--page", str(page)]) == 0
    flops = json.loads((tmp_path / "flops.json").read_text())
    # NaLa: no N² term; Mix-FFN adds the conv's 2·4C·9 per token per block to any attention.
    nala, nala_mix = (flops["models"]["T/2"][v]["forward_coefficients"] for v in ("nala", "nala_mix"))
    assert nala[2] == nala_mix[2] == 0 and nala_mix[1] - nala[1] == 4 * 2 * 4 * c * 9
    assert flops["models"]["T/2"]["softmax_mix"]["training_flops"]["4096"] == 123_013_398_528
    text = page.read_text()
    assert text == "intro\n" + flops_block(flops) + "\nend\n" and "stale" not in text
    assert "| T/2 | 4,096 | " in text and " 123.0 (" in text


def test_steps_to_softmax_mix_loss_and_their_training_flops(tmp_path):
    """Known answer: softmax + Mix-FFN ends at 0.025 (300 steps, 4,096 tokens, batch 4); NaLa +
    Mix-FFN is at or below it from 300 steps, plain softmax never: FLOPs = 300 × 4 × T/2's
    training FLOPs per image, 3 × (c0 + c1·4096) for NaLa + Mix-FFN (no N² term)."""
    from experiments.ablation import study as ablation
    from experiments.ablation.study.compute import steps_to_reference

    losses = {"softmax": (0.50, 0.20, 0.030), "softmax_mix": (0.50, 0.15, 0.025), "nala_mix": (0.50, 0.10, 0.020)}
    for variant, values in losses.items():
        for seed in (0, 1):
            budgets = [dict(budget=b, heldout_loss=v, train_loss=v, train_time_s=1.0, class_consistency=math.nan,
                            frechet_distance=math.nan) for b, v in zip((75, 150, 300), values)]
            ablation.write_json(ablation.cell_path(tmp_path, "study128", variant, seed, 2e-3),
                                dict(task="study128", variant=variant, seed=seed, lr=2e-3, budgets=budgets))
    found = steps_to_reference(ablation.summarize(ablation.load_cells(tmp_path)))
    assert [(f["variant"], f["budget"], f["n"]) for f in found] == [               # in VARIANTS order
        ("softmax", None, 2), ("nala_mix", 300, 2), ("softmax_mix", 300, 2)]
    nala_mix = 300 * 4 * 3 * (950_272 + 1_846_272 * 4096)   # flops.json: T/2 nala_mix forward_coefficients
    softmax_mix = 300 * 4 * 123_013_398_528
    assert [f["training_flops"] for f in found] == [None, nala_mix, softmax_mix] and found[0]["target"] == 0.025
    table = ablation.write_table(tmp_path).read_text()
    assert "## Canvas 128 px (4,096 tokens), the 2 × 2 study (EMA warm-up, Mix-FFN conv at identity): steps to " \
           "softmax + Mix-FFN's 300-step held-out loss 0.0250" in table
    assert f"| nala_mix | 2 | 300 | {nala_mix:.3g} | {nala_mix / softmax_mix:.2f} |" in table
    assert "| softmax | 2 | not reached | — | — |" in table


def test_the_2x2_contrasts_are_per_seed_differences_with_the_two_spread_rule(tmp_path):
    """Known answer, three seeds at 400 steps (held-out loss):
    softmax 0.050 0.040 0.045 · softmax_mix 0.030 0.030 0.035 · nala 0.040 0.042 0.041 ·
    nala_mix 0.030 0.020 0.031. Mix-FFN's change for softmax: −0.020, −0.010, −0.010 → mean
    −0.0133, std 0.0058 (claimed: 0.0133 > 0.0115); NaLa + Mix-FFN − softmax + Mix-FFN: 0, −0.010,
    −0.004 → −0.0047 ± 0.0050 (not claimed); the interaction (nala_mix − nala − softmax_mix +
    softmax): 0.010, −0.012, 0.000 → −0.0007 ± 0.0110. A fourth, incomplete seed is left out of
    every contrast that needs its missing variant."""
    from experiments.ablation import study as ablation
    from experiments.ablation.study.contrasts import contrast_rows

    losses = {"softmax": (0.050, 0.040, 0.045), "softmax_mix": (0.030, 0.030, 0.035),
              "nala": (0.040, 0.042, 0.041), "nala_mix": (0.030, 0.020, 0.031)}
    for variant, values in losses.items():
        for seed, v in enumerate(values + ((0.5,) if variant == "softmax" else ())):
            row = dict(budget=400, heldout_loss=v, train_loss=v, train_time_s=1.0, class_consistency=math.nan,
                       frechet_distance=math.nan)
            ablation.write_json(ablation.cell_path(tmp_path, "study64", variant, seed, 2e-3),
                                dict(task="study64", variant=variant, seed=seed, lr=2e-3, budgets=[row]))
    rows = {r["label"]: r["heldout_loss"] for r in contrast_rows(ablation.load_cells(tmp_path), "study64", 400)}
    mix_softmax = rows["Mix-FFN's change, softmax"]
    assert mix_softmax["seeds"] == [0, 1, 2] and mix_softmax["mean"] == pytest.approx(-0.04 / 3)
    assert mix_softmax["std"] == pytest.approx(math.sqrt(((-0.02 + 0.04 / 3) ** 2 + 2 * (-0.01 + 0.04 / 3) ** 2) / 2))
    assert mix_softmax["claimed"]
    level = rows["NaLa + Mix-FFN − softmax + Mix-FFN"]
    assert level["mean"] == pytest.approx(-0.014 / 3) and not level["claimed"]
    inter = rows["interaction: NaLa's change − softmax's"]
    assert inter["mean"] == pytest.approx(-0.002 / 3) and not inter["claimed"]
    m = -0.002 / 3
    assert inter["std"] == pytest.approx(math.sqrt(((0.010 - m) ** 2 + (-0.012 - m) ** 2 + m ** 2) / 2))
    assert "Mix-FFN's change, gated softmax" not in rows          # no gated cells: no row
    table = ablation.write_table(tmp_path).read_text()
    assert "## study64, 400 steps: the 2 × 2's contrasts, seed by seed" in table
    assert "| Mix-FFN's change, softmax | -0.0133 ± 0.0058 (n 3) ✔ |" in table


def test_samples_protocol_climbs_the_ladder_one_rung_at_a_time(tmp_path, digits_classifier_dir):
    """The samples protocol's rungs: each starts from the same variant and seed's previous rung
    (8 -> 16 px here, quick), trains with the time shift "auto" (s = sqrt(64 / 16) = 2 at 16 px),
    and is scored on samples with KID beside class-consistency and Fréchet distance."""
    from experiments.ablation import study as ablation
    from experiments.ablation.study.recipes import SAMPLES_TASKS, recipe_flags

    assert SAMPLES_TASKS == ("samples8", "samples16", "samples32", "samples64")
    assert [ablation.task_recipe(t, False).get("init_task") for t in SAMPLES_TASKS] == \
           [None, "samples8", "samples16", "samples32"]
    assert [ablation.task_recipe(t, False).get("image_size", 8) for t in SAMPLES_TASKS] == [8, 16, 32, 64]
    assert recipe_flags(ablation.task_recipe("samples64", False), "nala_mix") == \
           ["--ema-warmup", "true", "--time-shift", "auto", "--mix-init", "identity"]
    assert ablation.main(["run", "--quick", "--out", str(tmp_path), "--tasks", "samples16", "--variants", "nala_mix",
                          "--classifier-dir", str(digits_classifier_dir)]) == 0
    run = tmp_path / "work" / "runs" / ablation.cell_name("samples16", "nala_mix", 0, 1e-3)
    record = json.loads((run / "init_from.json").read_text())
    assert (record["source_input_size"], record["input_size"], record["pos_embed"]) == (8, 16, "interpolate")
    source = tmp_path / "work" / "runs" / ablation.cell_name("samples8", "nala_mix", 0, 2e-3) / "checkpoints"
    assert f"init-from: {sorted(source.iterdir())[-1]}\n" in (run / "config.yaml").read_text()   # its final checkpoint
    from nala_dit.training.checkpoint import (
        build_objective,
        list_checkpoints,
        open_checkpoint,
    )

    ckpt = open_checkpoint(list_checkpoints(run / "checkpoints")[-1])
    assert build_objective(ckpt.model_config, ckpt.config).time_shift == 2.0
    rows = json.loads((tmp_path / "table.json").read_text())["rows"]
    assert {(r["task"], r["budget"]) for r in rows} == {(t, b) for t in ("samples8", "samples16")
                                                       for b in ablation.QUICK["budgets"]}
    for r in rows:   # KID beside the other sample scores wherever a rung samples (quick: a ladder's last budget)
        sampled = r["budget"] in ablation.task_recipe(r["task"], True).get("sample_budgets", ablation.QUICK["budgets"])
        assert r["n"] == len(ablation.QUICK_SEEDS) and r["kid_n"] == (r["n"] if sampled else 0)
        if sampled:
            assert 0 <= r["class_consistency"] <= 1 and math.isfinite(r["kid"]) and r["frechet_distance"] >= 0
    assert {r["task"] for r in rows if r["kid_n"]} == {"samples8", "samples16"}
    table = (tmp_path / "table.md").read_text()
    assert "| variant | lr | n | class-consistency ↑ | Fréchet distance ↓ | KID ↓ | train loss |" in table


def test_a_rung_whose_source_checkpoint_is_lost_retrains_it_and_records_whether_it_reproduced(
        tmp_path, digits_classifier_dir):
    """A fresh clone holds the cell JSONs, not the runs: a rung retrains the rung below (without
    rescoring it) and records whether the retrained log matches the committed cell bit for bit."""
    import shutil

    import torch

    from experiments.ablation import study as ablation

    flags = ["run", "--quick", "--out", str(tmp_path), "--variants", "nala",
             "--classifier-dir", str(digits_classifier_dir)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert ablation.main([*flags, "--tasks", "samples8"]) == 0
        assert torch.get_num_threads() == 2      # the in-process cell ran on one thread, the caller's restored
    finally:
        torch.set_num_threads(threads)
    below = ablation.cell_path(tmp_path, "samples8", "nala", 0, 2e-3)
    assert json.loads(below.read_text())["torch_threads"] == 1
    recorded = below.read_text()
    shutil.rmtree(tmp_path / "work" / "runs" / "samples8")            # the checkpoints are lost
    assert ablation.main([*flags, "--tasks", "samples16"]) == 0
    assert below.read_text() == recorded                              # kept, not rescored
    rung = json.loads(ablation.cell_path(tmp_path, "samples16", "nala", 0, 1e-3).read_text())
    assert rung["init_from"] == dict(cell=ablation.cell_name("samples8", "nala", 0, 2e-3), retrained=True,
                                     reproduced=True)
    # A recorded cell that this machine does not reproduce (here: its loss edited) is said so.
    data = json.loads(recorded)
    data["budgets"][-1]["train_loss"] += 1e-3
    below.write_text(json.dumps(data))
    shutil.rmtree(tmp_path / "work" / "runs")
    ablation.cell_path(tmp_path, "samples16", "nala", 0, 1e-3).unlink()
    assert ablation.main([*flags, "--tasks", "samples16"]) == 0
    rung = json.loads(ablation.cell_path(tmp_path, "samples16", "nala", 0, 1e-3).read_text())
    assert rung["init_from"]["reproduced"] is False


def test_a_rung_trains_its_source_under_the_source_lock_and_waits_for_another_holder(
        tmp_path, digits_classifier_dir, monkeypatch):
    """Two runners whose rungs share a source (``--jobs 1`` included) must not both train it in
    one run folder: ``ladder_source`` trains the source under the source cell's own lock, and
    waits while another live process holds that lock."""
    import os
    import subprocess
    import sys
    import threading

    from experiments.ablation.study import runner

    lock = runner._lock_path(tmp_path, ("samples8", "nala", 0, 2e-3))
    assert lock == tmp_path / "locks" / "samples8__nala__seed0_lr2e-3.pid"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    threading.Thread(target=other.wait, daemon=True).start()   # reaped on exit (a zombie still answers kill 0)
    lock.parent.mkdir()
    lock.write_text(str(other.pid))
    with runner._holding(lock, poll_s=0.05):
        assert other.poll() is not None                          # entered only once the other holder ended
        assert lock.read_text() == str(os.getpid())
    assert not lock.exists()

    held, real = [], runner.run_cell
    monkeypatch.setattr(runner, "run_cell", lambda *a, **k: held.append(runner._holder(lock)) or real(*a, **k))
    path, info = runner.ladder_source("samples8", "nala", 0, tmp_path, True, digits_classifier_dir)
    assert held == [os.getpid()] and not lock.exists()           # trained under the lock, released after
    assert path.name == f"{max(runner.task_recipe('samples8', True)['budgets']):07d}"
    assert info == dict(cell=runner.cell_name("samples8", "nala", 0, 2e-3), retrained=False)
