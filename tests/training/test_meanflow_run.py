"""A MeanFlow NaLaSiT end to end: ``train.py --mean-flow`` two steps, then one-step samples
through ``sample.py`` (a grid and the mass-sampling ``.npz``), the exported pipeline
(``num_inference_steps=1``) giving the same pixels, and the one-line refusals."""

import numpy as np

import export
import sample
import train
from nala_dit.diffusion.generate import SampleSettings
from nala_dit.pipelines.pipeline import load_pipeline
from nala_dit.pipelines.sample_files import sample_images
from nala_dit.pipelines.sources import load_source
from tests.utils import TINY_RUN, dry_run_error


def test_meanflow_trains_samples_in_one_step_and_exports(tmp_path, capsys):
    argv = [*TINY_RUN, "--results-dir", str(tmp_path), "--max-steps", "2", "--ckpt-every", "2"]
    argv[argv.index("NaLaDiT-T/2")] = "NaLaSiT-T/2"
    assert train.main([*argv, "--exp-name", "mf", "--mean-flow"]) == 0
    run = tmp_path / "mf"
    source = load_source(run)
    assert source.model.config.mean_flow and source.objective.mean_flow

    assert sample.main(["--ckpt", str(run), "--sampler", "meanflow", "--steps", "1", "--num-samples", "2",
                        "--out", str(tmp_path / "s.npz")]) == 0
    arr = np.load(tmp_path / "s.npz")["arr_0"]
    assert arr.shape[0] == 2 and arr.dtype == np.uint8
    assert sample.main(["--ckpt", str(run), "--labels", "1,2", "--grid", str(tmp_path / "g.png")]) == 0
    assert "1 NFE each" in capsys.readouterr().out            # the default sampler of a MeanFlow model

    out = tmp_path / "pipe"
    assert export.main(["checkpoint", str(run), str(out)]) == 0
    pipe = load_pipeline(out)
    pipe.set_progress_bar_config(disable=True)
    got = pipe([3, 4], num_inference_steps=1, generator=11).images            # the default sampler: meanflow
    ref, nfe = sample_images(source, [3, 4], 11, SampleSettings("meanflow", 1))
    for a, b in zip(got, ref.numpy()):
        np.testing.assert_array_equal(np.asarray(a), b[..., 0])

    # refusals: --mf-* without --mean-flow, --mean-flow on a DiT, meanflow on a plain SiT
    capsys.readouterr()
    assert "--mf-ratio is a MeanFlow setting: pass --mean-flow with it" in dry_run_error(capsys, *argv, "--mf-ratio", "0.5")
    assert "--mean-flow trains a transport model (SiT or NaLaSiT), not NaLaDiT-T/2" in dry_run_error(
        capsys, *TINY_RUN, "--mean-flow")
    plain = tmp_path / "plain"
    assert train.main([*argv, "--exp-name", "plain", "--max-steps", "1", "--ckpt-every", "1"]) == 0
    capsys.readouterr()
    assert sample.main(["--ckpt", str(plain), "--sampler", "meanflow", "--labels", "1", "--grid",
                        str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert "the meanflow sampler takes the average velocity of a MeanFlow model" in err and "\n" not in err
