"""Options that do not apply to the chosen model are errors that name the option and the
models it applies to: in ``create_model``, in YAML configs and on the command line."""

import pytest

from nala_dit.cli.config import resolve
from nala_dit.cli.options import ATTENTION_OPTIONS, TrainConfig


def test_create_model_rejects_inapplicable_attention_options():
    from nala_dit.models.dit import create_model

    with pytest.raises(ValueError, match=r"lepe applies to the gated layer \(nala/relu/elu/softmax_gated attention\), "
                                         r"not to DiT-T/2, which uses softmax attention.*NaLaDiT-T/2"):
        create_model("DiT-T/2", input_size=8, lepe=True)
    with pytest.raises(ValueError, match=r"power applies to NaLa \(nala attention\), not to NaLaDiT-T/2, which uses relu"):
        create_model("NaLaDiT-T/2", input_size=8, attention="relu", power=2.0)
    with pytest.raises(ValueError, match=r"rope applies to the linear kernels .*which uses softmax_gated"):
        create_model("DiT-T/2", input_size=8, attention="softmax_gated", rope=True)
    # The same options are fine where they apply: an override of the attention kind counts.
    assert create_model("DiT-T/2", input_size=8, attention="nala", lepe=False).config.lepe is False
    assert create_model("NaLaSiT-T/2", input_size=8, alpha=5.0).config.alpha == 5.0


@pytest.mark.parametrize("option", sorted(ATTENTION_OPTIONS))
def test_every_table_row_is_enforced_for_softmax_in_configs(option, tmp_path):
    value = {"direction": "cosine"}.get(option, "true" if option in ("lepe", "gate", "out_norm", "rope") else "2.0")
    flag = option.replace("_", "-")
    yaml = tmp_path / "c.yaml"
    yaml.write_text(f"model: SiT-T/2\n{flag}: {value}\n")
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--config", str(yaml)])
    with pytest.raises(ValueError, match=f"--{flag} applies to .*, not to SiT-T/2"):
        TrainConfig(model="SiT-T/2", **{option: {"direction": "cosine", "rope": True}.get(option, 2.0)}).validate()


def test_objective_options_and_grid_sampler_must_fit_the_objective(capsys):
    with pytest.raises(ValueError, match="--path-type does not apply to DiT-T/2, a diffusion model"):
        TrainConfig(model="DiT-T/2", path_type="gvp").validate()
    with pytest.raises(ValueError, match="--noise-schedule does not apply to NaLaSiT-T/2"):
        TrainConfig(model="NaLaSiT-T/2", noise_schedule="cosine").validate()
    with pytest.raises(ValueError, match="--sample-sampler ddim is not a sampler for SiT-T/2"):
        TrainConfig(model="SiT-T/2", sample_sampler="ddim").validate()
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--model", "DiT-T/2", "--prediction", "noise"])
    assert "--prediction does not apply to DiT-T/2" in capsys.readouterr().err
    TrainConfig(model="SiT-T/2", path_type="gvp", sample_sampler="sde-euler").validate()  # fits: no error


def test_default_num_workers_shares_the_cpus_of_this_process(monkeypatch):
    from nala_dit.cli.options import default_num_workers

    # (processes on this machine, CPUs this process may use) -> workers per process
    for processes, cpus, workers in ((1, 2, 2), (2, 2, 1), (3, 2, 0), (1, 1, 1), (1, 16, 4), (8, 64, 4), (4, 8, 2)):
        assert default_num_workers(processes, cpus) == workers, (processes, cpus)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)  # taskset / Slurm: 2 CPUs
    assert default_num_workers(1) == 2 and default_num_workers(2) == 1
    cfg, _ = resolve(TrainConfig, [])
    assert cfg.num_workers is None  # resolved per run; the flag still sets it
    assert resolve(TrainConfig, ["--num-workers", "3"])[0].num_workers == 3
    with pytest.raises(SystemExit):
        resolve(TrainConfig, ["--num-workers", "-1"])
