"""An autoencoder folder's ``config.json`` is checked against its weights before anything is
built (``files.check_autoencoder_folder``, run by ``load_vae`` and the pipelines' loader): an
edited size is one line naming the file, and no model is built except on the ``meta`` device."""
import functools
import json
import shutil

import pytest
import torch
from diffusers import AutoencoderKL

from nala_dit.models.vae import load_vae
from tests.models.test_vae import tiny_vae
from tests.utils import one_line


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("autoencoder") / "vae"
    tiny_vae().save_pretrained(folder)
    return folder


@pytest.fixture
def builds(monkeypatch):
    """The default device of every AutoencoderKL built ("meta" for the check's own build)."""
    devices, init = [], AutoencoderKL.__init__

    @functools.wraps(init)   # diffusers reads the signature
    def recording(self, *args, **kwargs):
        devices.append(torch.empty(0).device.type)
        init(self, *args, **kwargs)

    monkeypatch.setattr(AutoencoderKL, "__init__", recording)
    return devices


def test_the_saved_folder_loads(vae_folder, builds):
    vae, _ = load_vae(str(vae_folder))
    assert sum(p.numel() for p in vae.parameters()) == sum(p.numel() for p in tiny_vae().parameters())
    assert builds[0] == "meta" and "cpu" in builds


@pytest.mark.parametrize("edit,names", [
    ({"block_out_channels": [60000]}, ["block_out_channels", "1 levels", "holds 4"]),
    ({"block_out_channels": [8, 8, 16, 60000]}, ["parameters", "by the config"]),
    ({"block_out_channels": [8, 8, 16, 70000]}, ["block_out_channels", "70,000", "beyond any autoencoder"]),
    ({"block_out_channels": "x"}, ["'block_out_channels' must be tuple[int]", "'x' (str)"]),
    ({"layers_per_block": 60000}, ["layers_per_block", "60,000 layers per level", "holds 1"]),
    ({"latent_channels": 8}, ["parameters", "by the config"]),
    ({"norm_num_groups": 3}, ["does not build a AutoencoderKL"]),
])
def test_an_edited_config_is_one_line_before_anything_is_built(vae_folder, tmp_path, builds, edit, names):
    bad = tmp_path / "vae"
    shutil.copytree(vae_folder, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError) as err:
        load_vae(str(bad))
    text = one_line(err)
    assert text.startswith(f"{bad / 'config.json'}") and all(name in text for name in names), text
    assert set(builds) <= {"meta"}, builds


def test_a_pipeline_folder_s_autoencoder_is_checked_on_the_pipelines_route(pipe_folder, vae_folder, tmp_path, builds):
    from nala_dit.pipelines.pipeline import NaLaDiTPipeline

    bad = tmp_path / "pipe"
    shutil.copytree(pipe_folder, bad)
    shutil.copytree(vae_folder, bad / "vae")
    index = json.loads((bad / "model_index.json").read_text())
    (bad / "model_index.json").write_text(json.dumps({**index, "vae": ["diffusers", "AutoencoderKL"]}))
    config = json.loads((bad / "vae" / "config.json").read_text())
    (bad / "vae" / "config.json").write_text(json.dumps({**config, "block_out_channels": [8, 8, 16, 60000]}))
    with pytest.raises(ValueError) as err:
        NaLaDiTPipeline.from_pretrained(str(bad))
    assert one_line(err).startswith(f"{bad / 'vae' / 'config.json'} implies a AutoencoderKL of")
    assert set(builds) <= {"meta"}, builds
