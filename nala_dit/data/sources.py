"""The data ``--data`` can name: each kind by its name (the embedded digits) or by what a folder
holds (a latent cache, an image folder), with the function that opens it. Plain data: importing
this module costs no torch (``train.py --help`` lists the kinds, ``--dry-run`` checks
``--image-size``); the datasets' modules are imported when a source opens.

``train.py`` (``training.loop.build_dataset``), the held-out split of ``--val-every``
(``training.validation.heldout_dataset``), the settings' check (``TrainConfig.validate``) and
the class names a model card or ``sample.py --labels`` reads (``pipelines.sources``) all look a
``--data`` value up here, so a new kind of data is its own dataset class (any module) plus one
line in ``DATA_SOURCES`` below, as DiT keeps its presets in ``DiT_models``::

    "my-data": DataSource(open_my_data, describe="'my-data' (what it is)"),

``open(data, cfg, split="train", size=None, state=None)`` returns the dataset: ``data`` the
``--data`` (or ``--val-data``) value, ``cfg`` the ``TrainConfig``, ``split`` "train" or
"heldout", ``size`` the image side to use (None: ``--image-size`` or the source's default; the
held-out split gets the training set's), ``state`` Accelerate's (to share one-time work over the
processes). A dataset returns ``(x, label)`` items with no randomness of its own (flips and VAE
samples are the training step's, drawn from its seeded RNG, so a resumed run sees the same data),
and has ``num_classes``, ``classes`` (the names), ``channels``, ``image_size`` and ``is_latent``:
False when x is an image in [-1, 1] (C, S, S), True for a latent cache (``LatentDataset``: x is
moments, sampled by ``datasets.sample_latents``, with ``scaling_factor``, ``stats``,
``vae_fingerprint``, ``meta`` and ``root``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .choices import (CANVAS_SIZES, DIGITS_SIZES, IMAGE_FOLDER_SIZE, LATENT_META, check_canvas_size,
                      check_digits_size, tar_names)


def _no_names(data: str) -> list[str] | None:
    return None


@dataclass(frozen=True)
class DataSource:
    """One kind of data. ``open``: as the module doc says. ``detect``: None when ``--data`` names
    the source by its key in ``DATA_SOURCES``, else whether a ``--data`` value is of this kind
    (tried in ``DATA_SOURCES``' order after the names, ``FALLBACK`` last). ``describe``: how
    ``--help`` names it.
    ``check_size``: ``--image-size``'s check (one ValueError line), before anything loads.
    ``class_names``: the class names of a ``--data`` value without opening it (None: not known).
    ``heldout``: ``open(..., split="heldout")`` gives the source's own held-out split (the
    embedded data), so ``--val-every`` needs no ``--val-data``.
    ``splits``: ``--val-data`` may also name one of the data's splits, or a count of training
    items to hold out (sharded data, ``streams.py``), read by ``open(..., split="heldout")``."""

    open: Callable
    describe: str
    detect: Callable[[str], bool] | None = None
    check_size: Callable[[int], int] | None = None
    class_names: Callable[[str], list[str] | None] = _no_names
    heldout: bool = False
    splits: bool = False


# ------------------------------------------------------------------ the built-in sources
def open_digits(data, cfg, split="train", size=None, state=None):
    from .datasets import DigitsDataset

    return DigitsDataset(split, size or cfg.image_size or DIGITS_SIZES[0])


def open_canvas(data, cfg, split="train", size=None, state=None):
    from .datasets import DigitsCanvasDataset

    return DigitsCanvasDataset(split, size or cfg.image_size or CANVAS_SIZES[0])


def digit_names(data: str) -> list[str]:
    from .digits import DIGIT_LABELS

    return list(DIGIT_LABELS)


def open_latents(data, cfg, split="train", size=None, state=None):
    """A latent cache of ``extract_latents.py``; training reads its kept images for
    ``--repa-encoder`` and needs ``--vae`` (the sample grids decode with it)."""
    from .datasets import LatentDataset, read_latent_meta

    if all(name.endswith(".tar") for name in read_latent_meta(data)["shards"]):   # streams.pack_latents
        from .streams import TarLatents

        if cfg.repa_encoder:
            raise ValueError(f"{data} holds latents as tar shards, without images: --repa-encoder needs a latent "
                             f"folder of extract_latents.py --keep-images")
        dataset = TarLatents(data)
    elif split != "train":
        return LatentDataset(data)
    else:
        dataset = LatentDataset(data, images=bool(cfg.repa_encoder))
    if cfg.vae is None:
        raise ValueError(f"{data} holds latents: pass --vae (the VAE they came from) to decode sample grids")
    return dataset


def is_latent_folder(data: str) -> bool:
    return (Path(data) / LATENT_META).is_file()


def latent_names(data: str) -> list[str]:
    from .datasets import read_latent_meta

    return read_latent_meta(data)["classes"]


def open_images(data, cfg, split="train", size=None, state=None):
    """``<root>/<class name>/<images>``; training opens every image first with ``--check-data``."""
    from .datasets import ImageFolderDataset, check_images

    dataset = ImageFolderDataset(data, size or cfg.image_size or IMAGE_FOLDER_SIZE, cfg.skip_corrupt)
    if split == "train" and cfg.check_data:
        check_images(dataset, state)
    return dataset


def folder_names(data: str) -> list[str] | None:
    """The sub-folders an image folder's classes are (hidden ones skipped, as the dataset does)."""
    root = Path(data)
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")) \
        if root.is_dir() else None


def is_folder(data: str) -> bool:
    return Path(data).is_dir()


def open_tar(data, cfg, split="train", size=None, state=None):
    """Webdataset tar shards (``streams.py``): each process reads its own."""
    from .streams import TarShards

    return TarShards(data, size or cfg.image_size or IMAGE_FOLDER_SIZE, split, cfg.val_data)


def open_parquet(data, cfg, split="train", size=None, state=None):
    """Hugging Face parquet files with image and label columns (``streams.py``)."""
    from .streams import TableShards

    return TableShards(data, size or cfg.image_size or IMAGE_FOLDER_SIZE, "parquet", split, cfg.val_data)


def open_saved(data, cfg, split="train", size=None, state=None):
    """A Hugging Face ``save_to_disk`` folder with image and label columns (``streams.py``)."""
    from .streams import TableShards

    return TableShards(data, size or cfg.image_size or IMAGE_FOLDER_SIZE, "arrow", split, cfg.val_data)


def is_tar_folder(data: str) -> bool:
    return Path(data).is_dir() and any(Path(data).glob("*.tar"))


def is_parquet_folder(data: str) -> bool:
    root = Path(data)
    return root.is_dir() and (any(root.glob("*.parquet")) or any(root.glob("*/*.parquet")))


def is_saved_dataset(data: str) -> bool:
    return (Path(data) / "state.json").is_file() or (Path(data) / "dataset_dict.json").is_file()


def _table_names(kind: str):
    """The ``ClassLabel`` names a parquet / save_to_disk folder records (None: none, or unreadable)."""
    def names(data: str) -> list[str] | None:
        from . import streams

        try:
            return (streams.parquet_files if kind == "parquet" else streams.arrow_files)(Path(data), "train")[1]
        except (ValueError, OSError):
            return None
    return names


DATA_SOURCES: dict[str, DataSource] = {
    "digits": DataSource(open_digits, f"'digits' (embedded 8x8, or upscaled to "
                                      f"{'/'.join(map(str, DIGITS_SIZES[1:]))} px)",
                         check_size=check_digits_size, class_names=digit_names, heldout=True),
    "digits-canvas": DataSource(open_canvas, f"'digits-canvas' (embedded, one digit on a "
                                             f"{'/'.join(map(str, CANVAS_SIZES))}-px canvas)",
                                check_size=check_canvas_size, class_names=digit_names, heldout=True),
    "latents": DataSource(open_latents, "a latent folder from extract_latents.py",
                          detect=is_latent_folder, class_names=latent_names),
    "tar-shards": DataSource(open_tar, "webdataset tar shards (<key>.jpg + .cls)",
                             detect=is_tar_folder, class_names=tar_names, splits=True),
    "parquet": DataSource(open_parquet, "Hugging Face parquet files",
                          detect=is_parquet_folder, class_names=_table_names("parquet"), splits=True),
    "saved-dataset": DataSource(open_saved, "a save_to_disk folder",
                                detect=is_saved_dataset, class_names=_table_names("arrow"), splits=True),
    "images": DataSource(open_images, "an image folder <root>/<class>/*", detect=is_folder,
                         class_names=folder_names),
}
# The kind tried last (after every other detect, whatever the order), and what a --data value no
# source takes is opened as: its dataset's error says what is wrong (a folder not found, no classes).
FALLBACK = "images"


def data_source(data: str) -> DataSource:
    """The source a ``--data`` value names: by name, else the first whose ``detect`` takes it
    (``FALLBACK`` last), else ``FALLBACK``."""
    source = DATA_SOURCES.get(data)
    if source is not None and source.detect is None:
        return source
    for name, source in sorted(DATA_SOURCES.items(), key=lambda item: item[0] == FALLBACK):
        if source.detect is not None and source.detect(data):
            return source
    return DATA_SOURCES[FALLBACK]


def data_help() -> str:
    """The kinds ``--data`` takes, as ``--help`` lists them."""
    kinds = [source.describe for source in DATA_SOURCES.values()]
    return ", ".join(kinds[:-1]) + f", or {kinds[-1]}" if len(kinds) > 1 else kinds[0]


def class_names(data: str | None) -> list[str] | None:
    """The class names of a ``--data`` value (a run's ``config.yaml``), if its source knows them."""
    return data_source(data).class_names(data) if data else None
