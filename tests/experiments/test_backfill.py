"""experiments/ablation/backfill.py: the raw-weight held-out loss written
into cells scored before it was recorded is what a fresh cell records, from the same
checkpoint; a checkpoint that is not the cell's is refused."""

import copy
import json
from pathlib import Path

import torch

from experiments.ablation import backfill
from experiments.ablation import study as ablation
from nala_dit.cli.config import to_dict
from nala_dit.models.dit import create_model
from nala_dit.training.checkpoint import build_objective, save_checkpoint
from nala_dit.training.loop import TrainConfig
from tests.utils import assert_names


def kept_checkpoint(run_dir: Path, step: int):
    """A cell's final checkpoint as train.py keeps it, with EMA weights that differ from the raw ones."""
    torch.manual_seed(0)
    model = create_model("DiT-T/2", input_size=8, in_channels=1, num_classes=10, attention="nala").eval()
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.02)
    cfg = TrainConfig(model="DiT-T/2", attention="nala", data="digits", exp_name=run_dir.name,
                      results_dir=str(run_dir.parent))
    state = dict(step=step, epoch=0, position=step, world_size=1, config=to_dict(cfg), model_config=dict(model.config))
    save_checkpoint(run_dir / "checkpoints", model=model, ema=ema, state=state,
                    optimizer=torch.optim.AdamW(model.parameters()), rng_states=[torch.get_rng_state()])
    return model, ema, state


def test_backfill_writes_what_a_fresh_cell_records(tmp_path, capsys):
    recipe = dict(ablation.task_recipe("digits", False), heldout_items=40, heldout_repeats=1, budgets=[3, 5])
    name = ablation.cell_name("digits", "nala", 0, 2e-3)
    model, ema, state = kept_checkpoint(tmp_path / "work" / "runs" / name, 5)
    # The independent reference: the held-out loss of the in-memory weights.
    objective = build_objective(state["model_config"], {})
    held = ablation.heldout_set("digits")
    raw_loss = ablation.heldout_loss(model, objective, held, items=40, repeats=1)
    ema_loss = ablation.heldout_loss(ema, objective, held, items=40, repeats=1)
    assert raw_loss != ema_loss
    cell = dict(task="digits", variant="nala", seed=0, lr=2e-3, quick=False, recipe=recipe,
                budgets=[dict(budget=3, heldout_loss=0.5), dict(budget=5, heldout_loss=ema_loss)])
    cell_file = ablation.cell_path(tmp_path, "digits", "nala", 0, 2e-3)
    ablation.write_json(cell_file, cell)

    assert backfill.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert "\n" not in out, out
    assert_names(out, f"{cell_file}: ", "heldout_loss_raw", "backfilled", "budget 5")
    got = json.loads(cell_file.read_text())
    assert got["budgets"][1][ablation.RAW] == raw_loss and ablation.RAW not in got["budgets"][0]  # step 3: no checkpoint
    assert_names(got["backfilled"], "heldout_loss_raw at budget 5", "kept final checkpoint",
                 f"python experiments/ablation/backfill.py --out OUT --cells {name}")
    assert backfill.main(["--out", str(tmp_path), "--cells", name]) == 0   # nothing left to fill
    assert capsys.readouterr().out == "" and json.loads(cell_file.read_text()) == got

    # A checkpoint that is not the one the cell scored (its EMA loss differs): refused, nothing written.
    cell["budgets"][1]["heldout_loss"] = ema_loss * 1.01
    ablation.write_json(cell_file, cell)
    before = cell_file.read_bytes()
    assert backfill.main(["--out", str(tmp_path), "--cells", name]) == 1
    assert "is not the checkpoint" in capsys.readouterr().err and cell_file.read_bytes() == before


def test_every_backfilled_committed_cell_says_how_to_reproduce_it():
    """The committed cells' notes name this script and the cell, for every budget that has the number."""
    cells = sorted(ablation.RESULTS.joinpath("cells").rglob("*.json"))
    noted = 0
    for path in cells:
        cell = json.loads(path.read_text())
        if "backfilled" in cell:
            noted += 1
            assert cell["backfilled"] == backfill.note(cell, [r["budget"] for r in cell["budgets"] if ablation.RAW in r])
    assert noted == 10
