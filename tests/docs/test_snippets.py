"""Every Python snippet in the README and docs/ runs as printed.

Each ```python block is executed in a fresh namespace inside a scratch folder where the paths
the snippets name (``exported/demo-naladit``, ``runs/NaLaDiT-S-2``, ...) are tiny real models:
an export of a random-weights digits NaLaDiT (ten classes "0".."9") and of a 1,000-class one
(ImageNet's names). The tensors a snippet leaves to the reader (``x, t, y``, ``q, k, v``) are
given. The blocks that cannot run here are listed in ``NOT_RUN`` with the reason; a new block
either runs or is added there on purpose.
"""

import re
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# (page, first line of the block) -> why it does not run here.
NOT_RUN = {
    ("sampling.md", "from nala_dit.training.checkpoint import load_model"):
        "loads stabilityai/sd-vae-ft-ema from the hub (its imports are checked)",
    ("highres.md", 'pipe = NaLaDiTPipeline.from_pretrained("exported/nala-dit-xl2")'):
        "a 512 x 768 image: 98K tokens of a pixel model (its names are checked)",
}


def python_blocks():
    found = []
    for page in PAGES:
        for match in re.finditer(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M):
            line = page.read_text()[:match.start()].count("\n") + 1
            found.append(pytest.param(page, match.group(1), id=f"{page.name}:{line}"))
    return found


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, digits_checkpoint):
    """A folder holding every path the snippets name."""
    import export
    from nala_dit.cli.config import to_dict
    from nala_dit.cli.options import TrainConfig
    from nala_dit.models.dit import create_model
    from nala_dit.training.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("snippets")
    (root / "runs").mkdir()
    shutil.copytree(digits_checkpoint, root / "runs" / "NaLaDiT-S-2")
    assert export.main(["checkpoint", str(digits_checkpoint), str(root / "exported" / "demo-naladit")]) == 0
    # A 1,000-class model for the ImageNet examples (labels 207, 360).
    run = root / "runs" / "imagenet-tiny"
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=3, num_classes=1000)
    cfg = TrainConfig(model="NaLaDiT-T/2", data="digits", exp_name=run.name, results_dir=str(run.parent))
    state = dict(step=1, epoch=0, position=1, world_size=1, config=to_dict(cfg), model_config=dict(model.config))
    save_checkpoint(run / "checkpoints", model=model, ema=model, state=state,
                    optimizer=torch.optim.AdamW(model.parameters()), rng_states=[torch.get_rng_state()])
    assert export.main(["checkpoint", str(run), str(root / "exported" / "nala-dit-s2")]) == 0
    return root


def _namespace():
    gen = torch.Generator().manual_seed(0)
    return {
        # docs/models.md: the last model built is DiT-S/2 at 32 x 32 latents.
        "x": torch.randn(2, 4, 32, 32, generator=gen), "t": torch.tensor([10, 500]), "y": torch.tensor([1, 2]),
        # docs/training.md: (B, H, N, D) queries, keys and values.
        "q": torch.randn(1, 6, 16, 64, generator=gen), "k": torch.randn(1, 6, 16, 64, generator=gen),
        "v": torch.randn(1, 6, 16, 64, generator=gen),
    }


def _check_imports(code: str):
    """Every nala_dit import of the block resolves."""
    for line in code.splitlines():
        if re.match(r"\s*(from nala_dit[\w.]* import |import nala_dit)", line):
            exec(compile(line.strip(), "<import>", "exec"), {})


@pytest.mark.parametrize("page,code", python_blocks())
def test_snippet_runs_as_printed(page, code, scratch, monkeypatch):
    compile(code, str(page), "exec")
    _check_imports(code)
    key = (page.name if page.parent.name == "docs" else str(page.relative_to(ROOT)), code.splitlines()[0])
    if key in NOT_RUN:
        pytest.skip(NOT_RUN[key])
    code = code.replace('"USER/REPO"', '"exported/demo-naladit"')   # docs/app.md: a hub id stands for the folder
    monkeypatch.chdir(scratch)
    exec(compile(code, str(page), "exec"), _namespace())


def test_not_run_lists_only_blocks_that_exist():
    keys = set()
    for page in PAGES:
        for code in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M):
            keys.add((page.name if page.parent.name == "docs" else str(page.relative_to(ROOT)), code.splitlines()[0]))
    assert set(NOT_RUN) <= keys


def test_the_readmes_pipeline_calls_name_their_step_count():
    """A pipeline call copied from the README (and its twin in docs/usage.md, the publishing
    lines in docs/app.md) runs the demo's step count, not the sampler's default of 250 DDPM
    steps, which took tens of seconds on two cores (docs/performance.md, Threads)."""
    for page in (ROOT / "README.md", ROOT / "docs" / "usage.md", ROOT / "docs" / "app.md"):
        calls = [line for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)
                 for line in block.splitlines() if re.search(r"\bpipe\(", line)]
        assert calls and all("num_inference_steps=" in call for call in calls), (page.name, calls)
