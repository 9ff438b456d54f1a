"""experiments/meanflow/run.py: the command a cell trains with, and the table it writes (no training here;
the study's own record holds the runs)."""

from pathlib import Path

from experiments.meanflow import run as study


def test_a_cell_trains_the_demo_config_with_meanflow_and_scores_one_step(tmp_path):
    argv = study.train_argv("SiT", 2, Path("ref.npz"), Path("clf"), tmp_path, 600, 300)
    assert Path(argv[1]).name == "train.py"
    assert argv[2:9] == ["--model", "SiT-T/2", "--mean-flow", "--mf-cfg-omega", "1.0", "--mf-cfg-kappa", "0.5"]
    flags = dict(zip(argv[9::], argv[10::]))
    assert Path(flags["--config"]).name == "digits_nala_sit.yaml"
    assert (flags["--sample-sampler"], flags["--sample-steps"], flags["--sample-cfg-scale"]) == ("meanflow", "1", "1.0")
    assert (flags["--seed"], flags["--max-steps"], flags["--fid-samples"]) == ("2", "600", "300")
    assert (flags["--results-dir"], flags["--exp-name"]) == (str(tmp_path / "SiT"), "seed2")
    nala = study.train_argv("NaLaSiT", 0, Path("ref.npz"), Path("clf"), tmp_path, 600, 300)
    assert "--model" not in nala and nala[2:7] == study.MEANFLOW   # the config's own NaLaSiT-T/2


def test_the_table_is_mean_and_sample_std_over_seeds():
    cells = [dict(model="NaLaSiT", scores={name: dict(class_consistency=cc, fd_digits=fd) for name in study.SAMPLERS})
             for cc, fd in ((1.0, 10.0), (0.99, 12.0), (0.98, 14.0))]
    base = [dict(model="SiT", recipe="uniform", scores={"fid/class_consistency": 0.9, "fid/fd_digits": 15.0})]
    lines = study.table(cells, base).splitlines()
    assert "| NaLaSiT-T/2 | MeanFlow | meanflow 1 | 1 | 3 | 0.990 ± 0.010 | 12.00 ± 2.00 |" in lines
    assert "| NaLaSiT-T/2 | MeanFlow | ode-heun 16 | 31 | 3 | 0.990 ± 0.010 | 12.00 ± 2.00 |" in lines
    assert "| SiT-T/2 | transport (demo) | ode-heun 16 | 62 | 1 | 0.900 | 15.00 |" in lines
    assert not any(line.startswith("| SiT-T/2 | MeanFlow") for line in lines)   # no cells, no rows
