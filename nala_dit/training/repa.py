"""Representation alignment (REPA; Yu et al., ICLR 2025, github.com/sihyun-yu/REPA).

One extra training loss: the hidden tokens of block ``K`` (``--repa-depth``), through a
small MLP projector, are pulled towards the patch features of a frozen pretrained encoder
(``--repa-encoder``, DINOv2-B/14 in REPA) of the clean image, by negative cosine
similarity, weighted λ (``--repa-weight``, 0.5):

    loss = diffusion loss + λ · mean over images and tokens of −cos(projector(h_K), f)

The projector trains with the model (same optimizer), is saved in the checkpoint
(``projector.safetensors``) and is never part of the EMA, of exports or of pipelines: a
REPA-trained model samples exactly as one trained without it.

Resizing rule (REPA's ``preprocess_raw_image``): the image, in [0, 1] and normalised
with the encoder's mean/std, is resized (bicubic, no antialias) to ``(h·p, w·p)`` pixels,
where ``(h, w)`` is the DiT's token grid and ``p`` the encoder's patch size, so the
encoder's patch grid *is* the token grid, row for row and column for column, for any
``--image-size`` and non-square grids (REPA: 256-px images → 224 px = 16 × 14 for a
16×16 grid). DINOv2 interpolates its position embeddings to that grid (bicubic, as REPA
does with timm's ``resample_abs_pos_embed``). Resizing the image rather than the
features keeps every feature computed from the pixels under its token, at the encoder's
own patch scale, and needs no second resampling of features.

Encoders: a folder with a DINOv2 model saved by ``transformers`` (``save_pretrained``:
``config.json`` + ``model.safetensors``), loaded with ``local_files_only`` and safetensors
only (nothing downloaded, no pickle); or a folder written by ``save_digits_encoder`` (the
repo's own label-free digits autoencoder, ``encoder.json`` + ``encoder.safetensors``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models.context_parallel import shard_of

# Default --repa-depth per preset size: REPA aligns block 8 of SiT-XL/2's 28 (its README's
# recipe); the same first-third rule gives 8 for L (24 blocks), 4 for S and B (12 blocks)
# and 1 for the tiny T (4 blocks).
DEFAULT_DEPTH = {"S": 4, "B": 4, "L": 8, "XL": 8, "T": 1}
IMAGENET_MEAN = (0.485, 0.456, 0.406)   # DINOv2's normalisation (timm IMAGENET_DEFAULT_*)
IMAGENET_STD = (0.229, 0.224, 0.225)
DIGITS_ENCODER_JSON = "encoder.json"
DIGITS_ENCODER_WEIGHTS = "encoder.safetensors"
ENCODER_HELP = ("save one with transformers: Dinov2Model.from_pretrained('facebook/dinov2-base')"
                ".save_pretrained(FOLDER) on a machine with internet (docs/training.md), or make the digits "
                "encoder with nala_dit.training.repa.train_digits_encoder")


def default_depth(model_name: str) -> int:
    """REPA's aligned block for a preset (``NaLaSiT-XL/2`` → 8)."""
    return DEFAULT_DEPTH[model_name.split("-")[-1].split("/")[0]]


def build_projector(hidden_size: int, projector_dim: int, encoder_dim: int) -> nn.Sequential:
    """REPA's projector: Linear(hidden, proj) SiLU Linear(proj, proj) SiLU Linear(proj, enc)."""
    return nn.Sequential(nn.Linear(hidden_size, projector_dim), nn.SiLU(), nn.Linear(projector_dim, projector_dim),
                         nn.SiLU(), nn.Linear(projector_dim, encoder_dim))


def alignment_loss(projected: torch.Tensor, features: torch.Tensor, shard=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(−mean cos, mean cos) over images and tokens of (B, T, D) projected tokens and
    encoder features (REPA's ``proj_loss``: both L2-normalised per token).

    Under context parallel (``shard``, a ``context_parallel.ShardGrid``) ``projected``
    holds this rank's rows only: the features are cut to the same rows, each rank sums
    its cosines and the sums are all-reduced (autograd), so every rank holds the whole
    grid's mean and backward gives each rank its rows' gradient P times, the convention
    of the model's gathered output (``ShardGrid.gather``)."""
    if shard is not None:
        features = features[:, shard.start * shard.w:shard.stop * shard.w]
    if projected.shape != features.shape:
        raise ValueError(f"projected tokens {tuple(projected.shape)} and encoder features {tuple(features.shape)} "
                         f"differ: the encoder's patch grid must be the model's token grid")
    cos = (F.normalize(projected.float(), dim=-1) * F.normalize(features.float(), dim=-1)).sum(-1)
    if shard is None:
        cos = cos.mean()
    else:
        cos = shard.all_reduce(cos.sum()) / (cos.shape[0] * shard.tokens)
    return -cos, cos.detach()


def encoder_input(images: torch.Tensor, grid: tuple[int, int], patch: int, mean, std, channels: int) -> torch.Tensor:
    """(B, C, H, W) images in [−1, 1] → the encoder's input: [0, 1], normalised, resized
    (bicubic, as REPA) to ``(h·patch, w·patch)`` so its patch grid is the token grid
    ``(h, w)``. One-channel images are repeated to the encoder's channels."""
    if images.shape[1] != channels:
        if images.shape[1] != 1:
            raise ValueError(f"the encoder takes {channels}-channel images, the data has {images.shape[1]}")
        images = images.expand(-1, channels, -1, -1)
    x = (images.float() + 1) / 2
    x = (x - x.new_tensor(mean)[:, None, None]) / x.new_tensor(std)[:, None, None]
    size = (grid[0] * patch, grid[1] * patch)
    if tuple(x.shape[-2:]) != size:
        x = F.interpolate(x, size=size, mode="bicubic", align_corners=False)
    return x


class DinoEncoder(nn.Module):
    """A transformers DINOv2 (with or without registers): its final-norm patch tokens
    (REPA's ``x_norm_patchtokens``: CLS and register tokens dropped)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        config = model.config
        self.patch_size, self.dim, self.channels = config.patch_size, config.hidden_size, config.num_channels
        self.skip = 1 + getattr(config, "num_register_tokens", 0)
        self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).last_hidden_state[:, self.skip:]


class DigitsEncoder(nn.Module):
    """The repo's own encoder for the embedded digits: the encoder half of a small
    convolutional autoencoder trained on the training split without labels
    (``train_digits_encoder``); one feature per ``patch_size``² pixels."""

    def __init__(self, channels: int = 1, width: int = 32, dim: int = 64, patch_size: int = 2):
        super().__init__()
        self.config = dict(channels=channels, width=width, dim=dim, patch_size=patch_size)
        self.patch_size, self.dim, self.channels = patch_size, dim, channels
        self.mean, self.std = (0.5,) * channels, (0.5,) * channels   # back to [−1, 1]
        layers, c = [nn.Conv2d(channels, width, 3, padding=1), nn.SiLU()], width
        for _ in range(int(math.log2(patch_size))):
            layers += [nn.Conv2d(c, width, 4, stride=2, padding=1), nn.SiLU()]
        layers += [nn.Conv2d(width, width, 3, padding=1), nn.SiLU(), nn.Conv2d(width, dim, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).flatten(2).transpose(1, 2)   # (B, h·w, dim), row-major as the DiT's tokens


class FrozenEncoder:
    """An encoder in eval mode without gradients; ``features(images, grid)`` → (B, h·w, D)."""

    def __init__(self, module: nn.Module, source: str):
        self.module = module.eval().requires_grad_(False)
        self.source = source
        self.patch_size, self.dim, self.channels = module.patch_size, module.dim, module.channels

    def to(self, device) -> "FrozenEncoder":
        self.module.to(device)
        return self

    @torch.no_grad()
    def features(self, images: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        x = encoder_input(images, grid, self.patch_size, self.module.mean, self.module.std, self.channels)
        out = self.module(x)
        if out.shape[1] != grid[0] * grid[1]:
            raise ValueError(f"--repa-encoder {self.source} gave {out.shape[1]} patch features for a "
                             f"{grid[0]}x{grid[1]} token grid")
        return out.float()


def load_encoder(source: str | Path) -> FrozenEncoder:
    """The frozen encoder in folder ``source`` (DINOv2 through transformers, or the digits
    encoder). Nothing is downloaded; a missing file is one line naming it."""
    root = Path(source)
    if not root.is_dir():
        raise FileNotFoundError(f"--repa-encoder {source}: no such folder; {ENCODER_HELP}")
    if (root / DIGITS_ENCODER_JSON).is_file():
        return FrozenEncoder(load_digits_encoder(root), str(source))
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"--repa-encoder {source}: {config_file} is missing (not a saved transformers "
                                f"model); {ENCODER_HELP}")
    try:
        kind = json.loads(config_file.read_text()).get("model_type")
    except (ValueError, AttributeError) as err:
        raise ValueError(f"--repa-encoder {source}: {config_file} is not a JSON object ({err})") from None
    if kind not in ("dinov2", "dinov2_with_registers"):
        raise ValueError(f"--repa-encoder {source}: {config_file} holds a {kind!r} model; the encoders taken are "
                         f"DINOv2 ('dinov2', 'dinov2_with_registers') and the digits encoder")
    if not any((root / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise FileNotFoundError(f"--repa-encoder {source}: {root / 'model.safetensors'} is missing (weights are read "
                                f"from safetensors only); {ENCODER_HELP}")
    from transformers import Dinov2Model, Dinov2WithRegistersModel

    cls = Dinov2Model if kind == "dinov2" else Dinov2WithRegistersModel
    try:
        model = cls.from_pretrained(str(root), local_files_only=True, use_safetensors=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"--repa-encoder {source}: cannot load it ({str(err).splitlines()[0]})") from None
    return FrozenEncoder(DinoEncoder(model.float()), str(source))


def save_digits_encoder(encoder: DigitsEncoder, folder: str | Path) -> Path:
    from safetensors.torch import save_file

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in encoder.state_dict().items()}, str(root / DIGITS_ENCODER_WEIGHTS))
    (root / DIGITS_ENCODER_JSON).write_text(json.dumps(dict(kind="digits-autoencoder", **encoder.config), indent=2))
    return root


def load_digits_encoder(root: Path) -> DigitsEncoder:
    from safetensors.torch import load_file

    config = json.loads((root / DIGITS_ENCODER_JSON).read_text())
    weights = root / DIGITS_ENCODER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"--repa-encoder {root}: {weights} is missing; rerun train_digits_encoder")
    encoder = DigitsEncoder(**{k: v for k, v in config.items() if k != "kind"})
    encoder.load_state_dict(load_file(str(weights)), strict=True)
    return encoder


class Aligned(nn.Module):
    """The training wrapper: ``forward`` is the model's; while it runs, a forward hook on
    block ``depth`` (1-based) keeps that block's output tokens and the projector maps them
    (``self.projected``, (B, T, encoder dim)). The model itself, its EMA copy (made
    before) and what it exports are unchanged; outside this wrapper the hook records
    nothing."""

    def __init__(self, model: nn.Module, train_model: nn.Module, projector: nn.Module, depth: int):
        super().__init__()
        self.train_model, self.projector = train_model, projector
        self.__dict__["capturing"], self.__dict__["tokens"], self.__dict__["projected"] = False, None, None
        self.__dict__["shard"] = None
        model.blocks[depth - 1].register_forward_hook(self._keep)

    def _keep(self, module, args, output):
        if self.capturing:   # a block is called as block(x, c, grid); under context parallel grid is a shard
            self.__dict__["tokens"], self.__dict__["shard"] = output, shard_of(args[2]) if len(args) > 2 else None

    def forward(self, *args, **kwargs):
        self.__dict__["capturing"] = True
        try:
            out = self.train_model(*args, **kwargs)
        finally:
            self.__dict__["capturing"] = False
        tokens, self.__dict__["tokens"] = self.tokens, None
        self.__dict__["projected"] = self.projector(tokens)
        return out


class Alignment:
    """The alignment term of one micro-batch: the encoder's features of the clean images
    (flipped as the model's input) on the token grid of the model input ``x``, against
    the projected tokens the ``Aligned`` wrapper kept from the forward just run."""

    def __init__(self, aligned: Aligned, encoder: FrozenEncoder, weight: float, patch_size: int):
        self.aligned, self.encoder, self.weight, self.patch_size = aligned, encoder, weight, patch_size

    def loss(self, images: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(λ·(−cos), [−cos, cos] detached)."""
        grid = (x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size)
        features = self.encoder.features(images, grid)
        projected, self.aligned.__dict__["projected"] = self.aligned.projected, None
        negative, cos = alignment_loss(projected, features, self.aligned.shard)
        return self.weight * negative, torch.stack([negative.detach(), cos])


def digits_decoder(encoder: DigitsEncoder) -> nn.Sequential:
    """The autoencoder's decoder: features back to pixels (training only, not saved)."""
    c, width = encoder.channels, encoder.config["width"]
    layers, current = [nn.Conv2d(encoder.dim, width, 3, padding=1), nn.SiLU()], width
    for _ in range(int(math.log2(encoder.patch_size))):
        layers += [nn.ConvTranspose2d(current, width, 4, stride=2, padding=1), nn.SiLU()]
    layers += [nn.Conv2d(width, c, 3, padding=1)]
    return nn.Sequential(*layers)


def train_digits_encoder(folder: str | Path, steps: int = 600, batch: int = 64, mask: float = 0.5,
                         seed: int = 0, print=print) -> Path:
    """The repo's own REPA encoder for the embedded digits, trained on the training split
    WITHOUT labels: a masked convolutional autoencoder (each 2×2 pixel patch hidden with
    probability ``mask``; the whole image reconstructed, MSE), deterministic (seeded, one
    thread's arithmetic), a few seconds on a CPU. Saves the encoder half to ``folder``
    (``--repa-encoder folder``). Never the metric's classifier (``digits.py``)."""
    from ..data.datasets import DigitsDataset

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    images = DigitsDataset("train", 8).images                      # (N, 1, 8, 8) in [-1, 1]; labels unused
    encoder = DigitsEncoder()
    decoder = digits_decoder(encoder)
    params = [*encoder.parameters(), *decoder.parameters()]
    optimizer = torch.optim.Adam(params, lr=2e-3)
    p = encoder.patch_size
    for step in range(steps):
        x = images[torch.randint(len(images), (batch,), generator=generator)]
        keep = (torch.rand(batch, 1, 8 // p, 8 // p, generator=generator) >= mask).float()
        keep = keep.repeat_interleave(p, 2).repeat_interleave(p, 3)
        recon = decoder(encoder.net(x * keep))                   # hidden patches read as 0 (mid grey)
        loss = F.mse_loss(recon, x)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if (step + 1) % 200 == 0:
            print(f"digits encoder: step {step + 1}, masked reconstruction MSE {loss.item():.4f}")
    return save_digits_encoder(encoder.eval(), folder)


def linear_probe(encoder: FrozenEncoder, size: int = 8, patch: int = 2) -> float:
    """Held-out accuracy of a logistic regression on the encoder's flattened patch features
    (fit on the training split; labels used here only), at the token grid of ``size``-px
    digits and ``patch``."""
    from sklearn.linear_model import LogisticRegression

    from ..data.datasets import DigitsDataset

    grid = (size // patch, size // patch)
    splits = [DigitsDataset(split, size) for split in ("train", "heldout")]
    feats = [encoder.features(d.images, grid).flatten(1).numpy() for d in splits]
    probe = LogisticRegression(max_iter=2000).fit(feats[0], splits[0].labels.numpy())
    return float(probe.score(feats[1], splits[1].labels.numpy()))


def main(argv=None) -> int:
    """``python -m nala_dit.training.repa [FOLDER]``: train the digits encoder into FOLDER and print its
    linear probe. A folder that already holds an encoder is kept (one line), never overwritten."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m nala_dit.training.repa",
                                     description="train the label-free digits encoder for --repa-encoder")
    parser.add_argument("folder", nargs="?", default="runs/digits_encoder",
                        help="where to save it (default runs/digits_encoder)")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    if (folder / DIGITS_ENCODER_JSON).exists() or (folder / DIGITS_ENCODER_WEIGHTS).exists():
        print(f"error: {folder} already holds a digits encoder; use it as --repa-encoder {folder}, or pick another "
              f"folder", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    out = train_digits_encoder(folder)
    print(f"saved {out}; linear probe (held-out accuracy): {linear_probe(load_encoder(out)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
