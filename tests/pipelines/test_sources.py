"""Tests of `nala_dit/pipelines/sources.py`."""
import pytest

from tests.scripts.test_sample import FAST
from tests.utils import assert_names, cli, copy_tree, one_line_error, poison


# 1. non-finite weights, guidance scales and samples
def test_pipeline_folder_with_nan_weights_is_refused(pipe_dir, tmp_path, capsys):
    from nala_dit.pipelines.pipeline import NaLaDiTPipeline

    bad = copy_tree(pipe_dir, tmp_path / "bad")
    key = poison(bad / "transformer" / "diffusion_pytorch_model.safetensors")
    assert cli("--ckpt", bad, "--labels", "1", *FAST, "--grid", tmp_path / "g.png") == 1
    err = one_line_error(capsys)
    assert_names(err, f"tensor {key}", "1 non-finite value(s)", str(bad / "transformer"))
    assert not (tmp_path / "g.png").exists()
    with pytest.raises(ValueError, match="non-finite"):
        NaLaDiTPipeline.from_pretrained(str(bad))
