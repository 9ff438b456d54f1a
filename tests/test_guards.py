"""Tests of `nala_dit/guards.py`."""
import time

import pytest

from nala_dit.models.dit import create_model
from tests.scripts.test_sample import FAST
from tests.utils import DEEP, cli, one_line, one_line_error


# 6. huge image sizes: an estimate against the memory there is, before allocating
@pytest.mark.parametrize("size", ["99998", "4000x99998"])
def test_huge_image_size_is_refused_with_a_memory_estimate(run_dir, tmp_path, capsys, size):
    start = time.perf_counter()
    assert cli("--ckpt", run_dir, "--labels", "1", *FAST, "--image-size", size, "--grid", tmp_path / "g.png") == 1
    err = one_line_error(capsys)
    assert f"--image-size {size}: sampling 1 image(s) of" in err and "needs at least" in err
    assert "this machine has" in err and "use a smaller --image-size or --batch-size" in err
    assert time.perf_counter() - start < 20


def test_memory_estimate_is_a_lower_bound_with_known_terms():
    from nala_dit.guards import sample_memory

    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10)
    c = model.config
    # 4 bytes × (runs × (noise + output per pixel + tokens × hidden × (2 + 2 · mlp ratio)) + batch × RGB pixels)
    per_run = 16 * 16 * (1 + 2) + 64 * c.hidden_size * (2 + 2 * c.mlp_ratio)
    assert sample_memory(model, (16, 16), 3) == 4 * (3 * per_run + 3 * 3 * 16 * 16)
    assert sample_memory(model, (16, 16), 3, guided=True) == 4 * (6 * per_run + 3 * 3 * 16 * 16)
    assert sample_memory(model, (16, 16), 3, vae_factor=8) == 4 * (3 * per_run + 3 * 3 * 128 * 128)


# --- JSON files that did not name themselves ----------------------------------------------
def test_bad_json_names_its_file(tmp_path):
    from nala_dit.pipelines.sources import read_labels_file

    labels = tmp_path / "labels.json"
    for content in ("{not json", DEEP, "3"):
        labels.write_text(content)
        with pytest.raises(ValueError) as err:
            read_labels_file(labels)
        assert str(labels) in one_line(err)
