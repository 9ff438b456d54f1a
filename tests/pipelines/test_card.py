"""Model cards: every export route writes README.md through huggingface_hub's ModelCard. The
card of a real short run is checked field by field against the run's own files (config.yaml,
log.jsonl, an evaluate_fid.py JSON, the sample grid), its sample.py line and Python lines run
as printed, and what a run did not measure is absent from its card."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from huggingface_hub import ModelCard
from PIL import Image

import export
import sample
import train
from tests.utils import assert_names

TAGS_NALA = ["class-conditional", "dit", "linear-attention", "nala", "nala_dit"]


def train_run(root: Path, name: str, *flags) -> Path:
    assert train.main(["--model", "NaLaDiT-T/2", "--data", "digits", "--global-batch-size", "16", "--num-workers", "0",
                       "--results-dir", str(root), "--exp-name", name, "--report-to", "none", "--lr", "1e-3",
                       "--ema-decay", "0.9", *map(str, flags)]) == 0
    return root / name


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory, digits_classifier_dir):
    """Four real training steps that measure everything a card can show: held-out losses,
    FID-type scores, an EMA sample grid, and an evaluate_fid.py JSON saved in the run folder."""
    import evaluate_fid
    from nala_dit.evaluation import metrics

    root = tmp_path_factory.mktemp("card-runs")
    ref = root / "digits_ref.npz"
    metrics.make_reference(ref, dataset="digits-heldout", features="digits", digits_classifier_dir=digits_classifier_dir)
    run = train_run(root, "measured", "--max-steps", 4, "--ckpt-every", 4, "--log-every", 2, "--val-every", 2,
                    "--val-samples", 16, "--fid-every", 4, "--fid-ref", ref, "--fid-samples", 20,
                    "--sample-every", 4, "--sample-steps", 4, "--digits-classifier", digits_classifier_dir)
    assert evaluate_fid.main(["gen", "--ckpt", str(run), "--ref", str(ref), "--num-samples", "20", "--sampler", "ddim",
                              "--steps", "4", "--device", "cpu", "--digits-classifier", str(digits_classifier_dir),
                              "--json", str(run / "metrics.json")]) == 0
    return run


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


@pytest.mark.slow
def test_the_card_of_a_real_run_says_what_the_run_recorded(measured_run, tmp_path, monkeypatch, capsys):
    from nala_dit.training.checkpoint import load_model

    monkeypatch.chdir(tmp_path)   # the card's commands name the folder as it was given
    assert export.main(["checkpoint", str(measured_run), "exported/measured"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("publish: ") and " upload USER/REPO exported/measured " in printed[-1]
    out = tmp_path / "exported" / "measured"
    card = ModelCard.load(out / "README.md")
    assert card.data.to_dict() == {"library_name": "diffusers", "tags": TAGS_NALA,
                                   "datasets": ["digits"]}   # no license (the user's), no base_model (from scratch)
    text = card.text

    # the model: preset and parameter count of the exported weights
    model, ckpt = load_model(measured_run)
    assert ckpt.step == 4 and text.startswith("\n# NaLaDiT-T/2\n")
    assert f"| parameters | {sum(p.numel() for p in model.parameters()):,} |" in text
    assert "| attention | nala (direction cosine, λ = 3.0, τ = 0.5, s = 1.0, α = 20.0, LePE, output gate, output norm) |" \
        in text
    # the recipe, from config.yaml
    cfg = yaml.safe_load((measured_run / "config.yaml").read_text())
    assert f"| steps | 4 (of --max-steps {cfg['max-steps']}) |" in text
    assert f"| global batch | {cfg['global-batch-size']} images per step (grad-accum {cfg['grad-accum']}) |" in text
    assert f"AdamW, lr {cfg['lr']}, β2 {cfg['adam-beta2']}," in text and f"| EMA | decay {cfg['ema-decay']}, " in text
    assert f"| t sampling | {cfg['t-sampling']} |" in text and "| data | digits, horizontal flips on" in text
    # the measurements, from log.jsonl (the last at or before the exported step)
    log = [json.loads(line) for line in (measured_run / "log.jsonl").read_text().splitlines()]
    last = log[-1]
    assert last["step"] == 4
    assert f"- training loss {last['loss']:.4f} at step 4" in text
    assert f"val/loss {last['val/loss']:.4f}, " in text and f"val/ema_loss {last['val/ema_loss']:.4f}" in text
    assert f"(16 items of the embedded data's held-out split" in text
    # FID samples as the grid does (DDIM for a DiT without --sample-sampler) and names the network that scored it
    assert (f"- FID-type scores at step 4 (20 EMA samples, ddim 4 steps, guidance 1.0, against `digits_ref.npz`, "
            f"scored by digits-classifier (model.safetensors), sha256 `{last['fid_network_sha256']}`): "
            f"fd_digits {last['fid/fd_digits']:.4g}, ") in text
    assert f"class_consistency {last['fid/class_consistency']:.4g}" in text
    # log.jsonl says what the scores compared: 20 samples against the 360 held-out digits, all of them
    assert (last["fid_samples"], last["fid_ref_images"], "fid_ref_subset" in last) == (20, 360, False)
    evaluation = json.loads((measured_run / "metrics.json").read_text())
    assert (f"- `metrics.json` (20 samples, from step 4, ddim 4 steps, guidance 1.0, against `digits_ref.npz`, "
            f"digits-classifier features): fd_digits {evaluation['metrics']['fd_digits']:.4g}, ") in text
    # the run's own grid, copied
    assert (out / "sample_grid.png").read_bytes() == (measured_run / "samples" / "0000004.png").read_bytes()
    assert "![EMA samples at step 4](sample_grid.png)" in text

    # the sampling lines run as printed (sample.py through its main, the Python as code)
    (line,) = code_blocks(text, "bash")
    argv = shlex.split(line)
    assert argv[:4] == ["python", "sample.py", "--ckpt", "exported/measured"]
    assert sample.main(argv[2:]) == 0
    assert np.asarray(Image.open(tmp_path / "grid.png")).shape == (4 * 10 + 2, 4 * 10 + 2)   # 4 classes × 4
    (python,) = code_blocks(text, "python")
    assert len(python.strip().splitlines()) == 3
    scope = {}
    exec(python, scope)
    assert [im.size for im in scope["images"]] == [(8, 8)] * 4


def test_a_figure_the_run_did_not_measure_is_absent(tmp_path, monkeypatch):
    """No --val-every, --fid-every, grid or evaluation JSON: none of them in the card, and a
    fine-tuned run names its (local) base in the body, not as base_model metadata."""
    run = train_run(tmp_path, "plain", "--max-steps", 2, "--ckpt-every", 2, "--log-every", 1, "--sample-every", 0)
    tuned = train_run(tmp_path, "tuned", "--max-steps", 2, "--ckpt-every", 2, "--log-every", 1, "--sample-every", 0,
                      "--init-from", run)
    for source, name in ((run, "plain"), (tuned, "tuned")):
        assert export.main(["checkpoint", str(source), str(tmp_path / "out" / name)]) == 0
        card = ModelCard.load(tmp_path / "out" / name / "README.md")
        assert card.data.to_dict() == {"library_name": "diffusers",
                                       "tags": TAGS_NALA, "datasets": ["digits"]}
        for absent in ("held-out", "FID", "## Samples", "## Evaluations", "sample_grid.png"):
            assert absent not in card.text, (name, absent)
        assert "- training loss " in card.text and not (tmp_path / "out" / name / "sample_grid.png").exists()
    assert_names(card.text, f"Started from `{run}`", "`--init-from`", "inherit all-but-attention", "a local path",
                 "set `base_model:`", "Hub id")


def test_base_model_metadata_names_a_hub_id():
    from nala_dit.models.dit import create_model
    from nala_dit.pipelines.card import card_data

    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10)
    record = dict(config={"init-from": "facebook/DiT-XL-2-256", "data": "/data/imagenet/train"})
    data = card_data(model, record, {})
    assert data.base_model == "facebook/DiT-XL-2-256" and data.datasets == ["imagenet/train"]


def test_official_exports_carry_cards(tmp_path, capsys):
    """export.py official: the pipeline folder and the transformer-only folder."""
    import torch

    from nala_dit.models.dit import create_model

    torch.save(create_model("DiT-T/4", input_size=8, num_classes=1000).state_dict(), tmp_path / "DiT.pt")
    common = ["--model", "DiT-T/4", "--image-size", "64"]
    assert export.main(["official", str(tmp_path / "DiT.pt"), str(tmp_path / "pipe"), *common]) == 0
    assert export.main(["official", str(tmp_path / "DiT.pt"), str(tmp_path / "model"), *common, "--model-only"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("    #")[0].split()[-1] for line in out if line.startswith("publish: ")] == [
        str(tmp_path / "pipe"), str(tmp_path / "model")]
    for folder, kind in ((tmp_path / "pipe", "NaLaDiTPipeline"), (tmp_path / "model", "model")):
        card = ModelCard.load(folder / "README.md")
        assert card.data.to_dict() == {"library_name": "diffusers",
                                       "tags": ["class-conditional", "dit", "nala_dit"]}   # softmax: not linear
        assert "from the published weights `DiT.pt`" in card.text and "## Training" not in card.text
        assert "| attention | softmax |" in card.text and "latents 8×8 of the VAE" in card.text
    pipe_card = ModelCard.load(tmp_path / "pipe" / "README.md").text
    assert f"python sample.py --ckpt {tmp_path / 'pipe'} --labels 0,1,2,3 --per-label 4 --sampler ddpm --steps 250 " \
           f"--grid grid.png" in pipe_card
    model_card = ModelCard.load(tmp_path / "model" / "README.md").text
    assert f"pipe = pipeline_for(DiT.from_pretrained({str(tmp_path / 'model')!r}), " \
           f"vae_path='stabilityai/sd-vae-ft-ema')" in model_card


def test_saving_into_a_folder_with_a_readme_keeps_it(tmp_path):
    from nala_dit.models.dit import create_model
    from nala_dit.pipelines.pipeline import pipeline_for

    pipe = pipeline_for(create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "README.md").write_text("my notes\n")
    pipe.save_pretrained(tmp_path / "mine")
    assert (tmp_path / "mine" / "README.md").read_text() == "my notes\n"
    pipe.save_pretrained(tmp_path / "fresh")
    card = ModelCard.load(tmp_path / "fresh" / "README.md")
    assert "from a model built in Python" in card.text and "## Training" not in card.text


def test_the_printed_publish_command_is_huggingface_hubs_cli():
    hf = Path(sys.executable).parent / "hf"
    assert hf.is_file(), f"{hf}: huggingface_hub's CLI (installed with it)"
    help_text = subprocess.run([str(hf), "upload", "--help"], capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and "REPO_ID [LOCAL_PATH]" in help_text.stdout


def test_a_score_against_part_of_a_dataset_says_how_much(tmp_path):
    """log.jsonl's fid_samples and fid_ref_subset (a reference made with --limit): the card
    says "1,000 EMA samples" and "1,000 of the 10,000 images it was made from"; no pipeline_tag."""
    import torch

    from nala_dit.cli.config import to_dict
    from nala_dit.cli.options import TrainConfig
    from nala_dit.models.dit import create_model
    from nala_dit.training.checkpoint import save_checkpoint

    run = tmp_path / "run"
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10)
    cfg = TrainConfig(model="NaLaDiT-T/2", data="digits", exp_name="run", results_dir=str(tmp_path),
                      fid_ref="runs/ref/cifar10_test1k.npz", fid_every=2, fid_samples=500)
    state = dict(step=2, epoch=0, position=2, world_size=1, config=to_dict(cfg), model_config=dict(model.config))
    save_checkpoint(run / "checkpoints", model=model, ema=model, state=state,
                    optimizer=torch.optim.AdamW(model.parameters()), rng_states=[torch.get_rng_state()])
    subset = "1000 of 10000 images, evenly spaced in reading order (--limit 1000)"
    (run / "log.jsonl").write_text(json.dumps({"step": 2, "loss": 0.5, "fid/fid": 40.0, "fid_samples": 1000,
                                               "fid_ref_images": 1000, "fid_ref_subset": subset}) + "\n")
    assert export.main(["checkpoint", str(run), str(tmp_path / "out")]) == 0
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert "pipeline_tag" not in card.data.to_dict()
    assert_names(card.text, "(1,000 EMA samples, ",
                 "against `cifar10_test1k.npz` (1,000 of the 10,000 images it was made from), ")


HOSTILE = "x`<script>alert(1)\n# heading | cell ```<b>&amp;"   # no "/": a file name too


def test_hostile_names_stay_text_in_the_card(tmp_path):
    """A run name, data path, reference, evaluation file and export folder holding backticks,
    HTML, a heading, a line break and ``|``: rendered (CommonMark + tables, markdown-it-py),
    each is shown as typed inside its code span or as text; no HTML element, heading,
    list item or table cell comes from them, and the card's bash line gives the folder back."""
    import html

    import torch
    markdown_it = pytest.importorskip("markdown_it", reason="markdown-it-py renders the card (installed with rich)")

    from nala_dit.cli.config import to_dict
    from nala_dit.cli.options import TrainConfig
    from nala_dit.models.dit import create_model
    from nala_dit.training.checkpoint import save_checkpoint

    run = tmp_path / f"run{HOSTILE}"
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10)
    cfg = TrainConfig(model="NaLaDiT-T/2", data=f"/data/{HOSTILE}", exp_name=run.name, results_dir=str(tmp_path),
                      fid_ref=f"/refs/{HOSTILE.replace(chr(10), '_')}.npz", fid_every=2, fid_samples=8)
    state = dict(step=2, epoch=0, position=2, world_size=1, config=to_dict(cfg), model_config=dict(model.config))
    ckpt = save_checkpoint(run / "checkpoints", model=model, ema=model, state=state,
                           optimizer=torch.optim.AdamW(model.parameters()), rng_states=[torch.get_rng_state()])
    (run / "log.jsonl").write_text(json.dumps({"step": 2, "loss": 0.5, "fid/fd_digits": 12.0}) + "\n")
    evaluation = f"ev{HOSTILE.replace(chr(10), '_')}.json"
    (run / evaluation).write_text(json.dumps({"metrics": {"<b>fd</b>": 1.5}, "extractor": "<img src=x>",
                                              "reference": f"/r/{HOSTILE}"}))
    out = tmp_path / f"out{HOSTILE}"
    assert export.main(["checkpoint", str(run), str(out)]) == 0
    card = ModelCard.load(out / "README.md")
    assert card.data.to_dict()["datasets"] == [HOSTILE]   # the YAML metadata: dumped, safe
    tokens = markdown_it.MarkdownIt("commonmark").enable("table").parse(card.text)
    rendered = markdown_it.MarkdownIt("commonmark").enable("table").render(card.text)

    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert headings == ["NaLaDiT-T/2", "Model", "Training", "Measured during training",
                        "Evaluations in the run folder", "Use it"]
    assert "<script" not in rendered and "<img" not in rendered and "<b>" not in rendered
    assert "&lt;script&gt;" in rendered and "&lt;img src=x&gt;" in rendered
    # every table row has its two cells: no '|' or line break of a name opened a new one
    rows = re.findall(r"<tr>(.*?)</tr>", rendered, re.S)
    assert rows and all(len(re.findall(r"<t[hd]>", row)) == 2 for row in rows), rows
    codes = [html.unescape(c) for c in re.findall(r"<code>(.*?)</code>", rendered, re.S)]
    one_line = str(ckpt).replace("\n", " ")
    assert one_line in codes and f"{run.name.replace(chr(10), ' ')}/log.jsonl" in codes   # as typed, one line
    assert evaluation in codes and f"{HOSTILE.replace(chr(10), '_')}.npz" in codes
    data_row = next(row for row in rows if "<td>data</td>" in row)
    assert html.unescape(re.findall(r"<td>(.*?)</td>", data_row)[1]).startswith(f"/data/{HOSTILE.replace(chr(10), ' ')},")
    # the bash block is one command naming the folder exactly (its line break inside the quotes)
    (bash,) = [t.content for t in tokens if t.type == "fence" and t.info == "bash"]
    argv = shlex.split(bash)
    assert argv[:4] == ["python", "sample.py", "--ckpt", str(out)] and argv[-2:] == ["--grid", "grid.png"]
    (python,) = [t.content for t in tokens if t.type == "fence" and t.info == "python"]
    assert f"from_pretrained({str(out)!r})" in python


@pytest.mark.parametrize("text", ["plain", "`", "a``b", "``", "<b>&</b>", "a\nb", "| x |", "\\`"])
def test_inline_code_and_text_round_trip(text):
    """``_code`` shows any string as typed (line breaks as spaces) in one code span;
    ``_text`` renders as the string itself, no element made."""
    import html

    markdown_it = pytest.importorskip("markdown_it", reason="markdown-it-py renders the card (installed with rich)")
    from nala_dit.pipelines.card import _code, _text

    md = markdown_it.MarkdownIt("commonmark")
    (code,) = re.findall(r"<code>(.*?)</code>", md.render(f"a {_code(text)} b"), re.S)
    assert html.unescape(code) == text.replace("\n", " ")
    shown = md.render(f"a {_text(text)} b").strip()
    assert shown == f"<p>a {html.escape(text.replace(chr(10), ' '), quote=False)} b</p>"


def test_the_attention_row_names_the_rope_layout():
    """A RoPE model's card says which angle layout it was trained with: the two layouts give
    different models, and only 'released' is the NaLa authors' code."""
    from nala_dit.pipelines.card import _attention

    base = {"attention": "nala", "direction": "relu_split", "power": 3.0, "offset": 0.5, "norm_scale": 1.0,
            "alpha": 20.0, "rope": True}
    assert _attention({**base, "rope_layout": "released"}).endswith(", RoPE in the NaLa authors' released layout)")
    assert _attention({**base, "rope_layout": "halves"}).endswith(", RoPE in the halves layout)")
    assert _attention(base).endswith(", RoPE in the halves layout)")          # saved before rope_layout existed
    assert _attention({"attention": "relu", "rope": True}) == "relu linear attention (RoPE in the halves layout)"
