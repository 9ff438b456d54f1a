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

from ..attention.context_parallel import shard_of

# Default --repa-depth per preset size: REPA aligns block 8 of SiT-XL/2's 28 (its README's
# recipe); the same first-third rule gives 8 for L (24 blocks), 4 for S and B (12 blocks)
# and 1 for the tiny T (4 blocks).
DEFAULT_DEPTH = {"S": 4, "B": 4, "L": 8, "XL": 8, "T": 1}
IMAGENET_MEAN = (0.485, 0.456, 0.406)   # DINOv2's normalisation (timm IMAGENET_DEFAULT_*)
IMAGENET_STD = (0.229, 0.224, 0.225)
DIGITS_ENCODER_JSON = "encoder.json"
DIGITS_ENCODER_WEIGHTS = "encoder.safetensors"
ENCODER_HELP = ("save one with transformers: Dinov2Model.from_pretrained('facebook/dinov2-base')"
                ".save_pretrained(FOLDER) on a machine with internet (docs/alignment.md), or make the digits "
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
    encoder). Nothing is downloaded; a missing file is one line naming it. Before
    transformers sees a DINOv2 folder, its config is read with the guarded reader, every
    weights file it would read must be a safetensors file inside the folder (a
    ``model.safetensors.index.json`` naming a pickle ``.bin`` is refused: nothing is
    unpickled), and the config's sizes must fit the weights' headers (no model of another
    size is built)."""

    root = Path(source)
    if not root.is_dir():
        raise FileNotFoundError(f"--repa-encoder {source}: no such folder; {ENCODER_HELP}")
    if (root / DIGITS_ENCODER_JSON).is_file():
        return FrozenEncoder(load_digits_encoder(root), str(source))
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"--repa-encoder {source}: {config_file} is missing (not a saved transformers "
                                f"model); {ENCODER_HELP}")
    fix = f"save the encoder again ({ENCODER_HELP})"
    config = _json_object(config_file, source, fix)
    kind = config.get("model_type")
    if kind not in ("dinov2", "dinov2_with_registers"):
        raise ValueError(f"--repa-encoder {source}: {config_file} holds a {kind!r} model; the encoders taken are "
                         f"DINOv2 ('dinov2', 'dinov2_with_registers') and the digits encoder")
    files = dino_weight_files(source, root, fix)
    check_dino_sizes(source, config_file, config, files, fix)
    from transformers import Dinov2Model, Dinov2WithRegistersModel

    cls = Dinov2Model if kind == "dinov2" else Dinov2WithRegistersModel
    try:
        model = cls.from_pretrained(str(root), local_files_only=True, use_safetensors=True)
    except (OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"--repa-encoder {source}: cannot load it ({str(err).splitlines()[0]})") from None
    return FrozenEncoder(DinoEncoder(model.float()), str(source))


def dino_weight_files(source, root: Path, fix: str) -> list[Path]:
    """The safetensors files transformers would read from ``root``: ``model.safetensors``
    and every file ``model.safetensors.index.json`` names, each a ``.safetensors`` file
    inside the folder; anything else (``pytorch_model.bin``, ``.pt``, ``.pth``, ``.ckpt``, a
    path out of the folder) is refused in one line, before transformers sees the folder."""
    from ..guards import read_json

    single, index = root / "model.safetensors", root / "model.safetensors.index.json"
    if not single.is_file() and not index.is_file():
        raise FileNotFoundError(f"--repa-encoder {source}: {single} is missing (weights are read "
                                f"from safetensors only); {ENCODER_HELP}")
    files = [single] if single.is_file() else []
    if index.is_file():
        try:
            data = read_json(index, fix)
        except ValueError as err:
            raise ValueError(f"--repa-encoder {source}: {err}") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map \
                or not all(isinstance(v, str) and v for v in weight_map.values()):
            raise ValueError(f"--repa-encoder {source}: {index} must hold a 'weight_map' object of tensor names to "
                             f"file names; {fix}")
        inside = root.resolve()
        for name in sorted(set(weight_map.values())):
            if not name.endswith(".safetensors") or Path(name).is_absolute() \
                    or (root / name).resolve().parent != inside:
                raise ValueError(f"--repa-encoder {source}: {index} names {name!r}, which is not a .safetensors file "
                                 f"of this folder: encoder weights are read from safetensors only (a pickle such as "
                                 f"pytorch_model.bin could run code when loaded); nothing was loaded. Save the "
                                 f"encoder with save_pretrained(FOLDER) (safetensors by default)")
            if not (root / name).is_file():
                raise FileNotFoundError(f"--repa-encoder {source}: {root / name} is missing ({index.name} names it); "
                                        f"{fix}")
            files.append(root / name)
    return files


def _header_shapes(source, files: list[Path], fix: str) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from safetensors headers (nothing loaded); a file that is not
    one (truncated, a renamed pickle) is one line naming it."""
    from ..models.files import header_shapes

    return header_shapes(files, lambda file, cause: f"--repa-encoder {source}: {file} is not a readable safetensors "
                                                    f"file (truncated, damaged or another format renamed; {cause}); {fix}")


def _json_object(path: Path, source, fix: str) -> dict:
    """``path``'s JSON object; bad JSON, deep nesting or another type is one line naming it."""
    from ..guards import read_json

    try:
        config = read_json(path, fix)
    except ValueError as err:
        raise ValueError(f"--repa-encoder {source}: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--repa-encoder {source}: {path} must hold a JSON object, got {type(config).__name__}; {fix}")
    return config


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_dino_sizes(source, config_file: Path, config: dict, files: list[Path], fix: str) -> None:
    """The DINOv2 config's sizes (width, channels, patch, depth, position table) against
    the weights' headers: an edited ``hidden_size`` is one line, not a model of that size."""
    shapes = _header_shapes(source, files, fix)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "patch_size", "num_channels", "image_size")
    for key in keys:
        if key in config and not _positive_int(config[key]):
            raise ValueError(f"--repa-encoder {source}: {config_file} {key!r} must be a positive integer, got "
                             f"{config[key]!r}; {fix}")
    from transformers import Dinov2Config

    defaults = Dinov2Config()
    c = {key: config.get(key, getattr(defaults, key)) for key in keys}
    if c["hidden_size"] % c["num_attention_heads"]:
        raise ValueError(f"--repa-encoder {source}: {config_file} 'hidden_size' {c['hidden_size']} is not a multiple "
                         f"of 'num_attention_heads' {c['num_attention_heads']}; {fix}")
    proj = next((v for k, v in shapes.items() if k.endswith("embeddings.patch_embeddings.projection.weight")), None)
    pos = next((v for k, v in shapes.items() if k.endswith("embeddings.position_embeddings")), None)
    layers = {k.split("encoder.layer.", 1)[1].split(".", 1)[0] for k in shapes if "encoder.layer." in k}
    if proj is None or len(proj) != 4:
        raise ValueError(f"--repa-encoder {source}: {', '.join(map(str, files))} hold no DINOv2 patch embedding "
                         f"(embeddings.patch_embeddings.projection.weight); {fix}")
    expected = [("hidden_size", c["hidden_size"], proj[0]), ("num_channels", c["num_channels"], proj[1]),
                ("patch_size", c["patch_size"], proj[2]), ("num_hidden_layers", c["num_hidden_layers"], len(layers))]
    if pos is not None and len(pos) == 3:
        expected.append(("image_size", (c["image_size"] // c["patch_size"]) ** 2 + 1, pos[1]))
    wrong = [f"{key} {want:,} where the weights have {got:,}" for key, want, got in expected if want != got]
    if wrong:
        raise ValueError(f"--repa-encoder {source}: {config_file} does not describe its weights ("
                         f"{'; '.join(wrong)}): the config was edited or comes from another model; {fix}")


def save_digits_encoder(encoder: DigitsEncoder, folder: str | Path) -> Path:
    from safetensors.torch import save_file

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in encoder.state_dict().items()}, str(root / DIGITS_ENCODER_WEIGHTS))
    (root / DIGITS_ENCODER_JSON).write_text(json.dumps(dict(kind="digits-autoencoder", **encoder.config), indent=2))
    return root


DIGITS_ENCODER_KEYS = ("channels", "width", "dim", "patch_size")


def load_digits_encoder(root: Path) -> DigitsEncoder:
    """The digits encoder of ``root``, after checking ``encoder.json`` (an object of exactly
    the keys ``save_digits_encoder`` writes, positive integers, a power-of-two patch) and
    that its sizes are the weights file's (read from the header: a width of 1e7 is refused,
    not allocated); a truncated or renamed weights file is one line."""
    from safetensors.torch import load_file


    fix = "rerun train_digits_encoder (python -m nala_dit.training.repa FOLDER) into a new folder"
    config_file = root / DIGITS_ENCODER_JSON
    config = _json_object(config_file, root, fix)
    unknown = sorted(set(config) - {"kind", *DIGITS_ENCODER_KEYS})
    if unknown:
        raise ValueError(f"--repa-encoder {root}: {config_file} has unknown key(s) {unknown} (it holds kind, "
                         f"{', '.join(DIGITS_ENCODER_KEYS)}); {fix}")
    if config.get("kind") != "digits-autoencoder":
        raise ValueError(f"--repa-encoder {root}: {config_file} 'kind' must be 'digits-autoencoder', got "
                         f"{config.get('kind')!r}; {fix}")
    for key in DIGITS_ENCODER_KEYS:
        if key in config and not _positive_int(config[key]):
            raise ValueError(f"--repa-encoder {root}: {config_file} {key!r} must be a positive integer, got "
                             f"{config[key]!r}; {fix}")
    kwargs = {k: config[k] for k in DIGITS_ENCODER_KEYS if k in config}
    patch = kwargs.get("patch_size", 2)
    if patch & (patch - 1):
        raise ValueError(f"--repa-encoder {root}: {config_file} 'patch_size' must be a power of two, got {patch}; "
                         f"{fix}")
    weights = root / DIGITS_ENCODER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"--repa-encoder {root}: {weights} is missing; rerun train_digits_encoder")
    shapes = _header_shapes(root, [weights], fix)
    with torch.device("meta"):   # sizes only: no memory, whatever the config says
        expected = {k: tuple(v.shape) for k, v in DigitsEncoder(**kwargs).state_dict().items()}
    if shapes != expected:
        differ = [f"{k}: {shapes.get(k)} in the file, {v} for the config" for k, v in expected.items()
                  if shapes.get(k) != v] or [f"unexpected {sorted(set(shapes) - set(expected))[:3]}"]
        raise ValueError(f"--repa-encoder {root}: {config_file} does not describe {weights} ({'; '.join(differ[:2])}): "
                         f"one of them was edited or damaged; {fix}")
    try:
        state = load_file(str(weights))
    except Exception as err:  # safetensors raises its own error types
        raise ValueError(f"--repa-encoder {root}: {weights} is unreadable ({type(err).__name__}); {fix}") from None
    encoder = DigitsEncoder(**kwargs)
    encoder.load_state_dict(state, strict=True)
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
