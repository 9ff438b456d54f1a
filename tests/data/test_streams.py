"""Sharded data (data/streams.py): webdataset tar shards, Hugging Face parquet files and
save_to_disk folders, built here; each process reads its own shards; a resumed run reads on
where it stopped (bitwise against an uninterrupted run); held-out splits by name or count."""

import io
import json
import sys
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import train as train_cli
from nala_dit.data.sources import DATA_SOURCES, data_source
from nala_dit.data.streams import ShardSampler, TableShards, TarShards
from nala_dit.training import checkpoint as ckpt_lib
from tests.utils import TINY_RUN, assert_names



def _png(value: int) -> bytes:
    """An 8x8 RGB PNG whose pixels say its item number (red) and class (green)."""
    arr = np.zeros((8, 8, 3), np.uint8)
    arr[..., 0], arr[..., 1], arr[:4, :4, 2] = value % 256, value // 256, 255
    out = io.BytesIO()
    Image.fromarray(arr).save(out, format="PNG")
    return out.getvalue()


def _items(first: int, n: int, classes: int = 3):
    return [(_png(first + i), (first + i) % classes) for i in range(n)]


def _tar(path, items, first: int) -> None:
    with tarfile.open(path, "w") as tar:
        for i, (png, label) in enumerate(items):
            for ext, data in (("png", png), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{first + i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def tar_folder(root, shards=(7, 5, 6, 4), val=3):
    root.mkdir()
    first = 0
    for s, n in enumerate(shards):
        _tar(root / f"data-train-{s:06d}.tar", _items(first, n), first)
        first += n
    _tar(root / "data-val-000000.tar", _items(first, val), first)
    (root / "classes.txt").write_text("cat\ndog\nfox\n")
    return root


def _table(items):
    return pa.table({"image": [{"bytes": png, "path": None} for png, _ in items],
                     "label": pa.array([label for _, label in items], pa.int64())})


HF_FEATURES = {"image": {"_type": "Image"}, "label": {"names": ["cat", "dog", "fox"], "_type": "ClassLabel"}}


def parquet_folder(root, files=(9, 7, 8), val=4, row_group=4):
    (root / "data").mkdir(parents=True)
    first, meta = 0, {b"huggingface": json.dumps({"info": {"features": HF_FEATURES}}).encode()}
    for s, n in enumerate(files):
        table = _table(_items(first, n)).replace_schema_metadata(meta)
        pq.write_table(table, root / "data" / f"train-{s:05d}-of-{len(files):05d}.parquet", row_group_size=row_group)
        first += n
    pq.write_table(_table(_items(first, val)).replace_schema_metadata(meta),
                   root / "data" / "validation-00000-of-00001.parquet")
    return root


def saved_dataset(root, splits=(("train", (10, 6)), ("validation", (4,)))):
    """A DatasetDict as ``save_to_disk`` lays it out: one folder a split, Arrow stream files."""
    root.mkdir()
    first = 0
    for split, files in splits:
        (root / split).mkdir()
        names = []
        for s, n in enumerate(files):
            name = f"data-{s:05d}-of-{len(files):05d}.arrow"
            table = _table(_items(first, n))
            with pa.ipc.new_stream(str(root / split / name), table.schema) as writer:
                for batch in table.to_batches(max_chunksize=3):
                    writer.write_batch(batch)
            names.append({"filename": name})
            first += n
        (root / split / "state.json").write_text(json.dumps({"_data_files": names, "_split": split}))
        (root / split / "dataset_info.json").write_text(json.dumps({"features": HF_FEATURES}))
    (root / "dataset_dict.json").write_text(json.dumps({"splits": [s for s, _ in splits]}))
    return root


def _item_number(x: torch.Tensor) -> int:
    """The item number ``_png`` wrote into an image (red + 256 green)."""
    pixels = ((x[:, 0, 0] + 1) * 127.5).round().long()
    return int(pixels[0] + 256 * pixels[1])


def test_each_process_reads_its_own_shards_and_the_same_count(tmp_path):
    data = TarShards(tar_folder(tmp_path / "wds"), 8)
    assert len(data) == 22 and data.classes == ["cat", "dog", "fox"] and [s[2] for s in data.spans] == [7, 5, 6, 4]
    shard_of = {i: s for s in range(4) for i in range(data.offsets[s], data.offsets[s + 1])}
    for epoch in (0, 1):
        a, b = (ShardSampler(data, rank, 2, seed=0, epoch=epoch) for rank in (0, 1))
        assert {shard_of[i] for i in a.order}.isdisjoint({shard_of[i] for i in b.order})   # its own shards
        assert len(a.order) == len(b.order) == a.per_rank and len(set(a.order)) == len(a.order)
        # the process with fewer items reads every item of its shards, the other as many
        assert any(set(s.order) == {i for i in shard_of if shard_of[i] in {shard_of[j] for j in s.order}}
                   for s in (a, b))
    sizes = [ShardSampler(data, 0, 2, 0, epoch).per_rank for epoch in range(8)]
    assert set(sizes) <= {9, 10, 11} and len(set(sizes)) > 1   # the smallest pair of shards of each deal
    x, y = data[data.offsets[2] + 1]   # shard 2's second sample: item 7 + 5 + 1 = 13, class 13 % 3
    assert _item_number(x) == 13 and y == 1
    assert list(ShardSampler(data, 0, 2, 0, 0, start=3)) == ShardSampler(data, 0, 2, 0, 0).order[3:]
    with pytest.raises(ValueError) as err:
        ShardSampler(data, 0, 5, 0)
    assert_names(str(err.value), "4 shard(s) for 5 processes", "at least 5 shards")


def test_held_out_by_name_and_by_count(tmp_path):
    wds, saved = tar_folder(tmp_path / "wds"), saved_dataset(tmp_path / "saved")
    assert [_item_number(TarShards(wds, 8, "heldout", "val")[i][0]) for i in range(3)] == [22, 23, 24]
    train, held = TarShards(wds, 8, "train", "5"), TarShards(wds, 8, "heldout", "5")
    assert (len(train), len(held)) == (17, 5)   # the last 5 of the training split: 4 of shard 3, 1 of shard 2
    numbers = sorted(_item_number(d[i][0]) for d in (train, held) for i in range(len(d)))
    assert numbers == list(range(22)) and [_item_number(held[i][0]) for i in range(5)] == [17, 18, 19, 20, 21]
    data = TableShards(saved, 8, "arrow")
    assert len(data) == 16 and data.classes == ["cat", "dog", "fox"] and data.blocks(0)[:2] == [(0, 3), (3, 6)]
    assert [_item_number(TableShards(saved, 8, "arrow", "heldout", "validation")[i][0]) for i in range(4)] == \
        [16, 17, 18, 19]
    with pytest.raises(ValueError) as err:
        TableShards(saved, 8, "arrow", "heldout", "test")
    assert_names(str(err.value), "no 'test' split", "train, validation")
    with pytest.raises(ValueError) as err:
        TarShards(wds, 8, "heldout", "22")
    assert_names(str(err.value), "--val-data 22", "between 1 and 21")


def test_sources_are_detected_and_bad_columns_named(tmp_path, monkeypatch):
    wds, parquet, saved = tar_folder(tmp_path / "wds"), parquet_folder(tmp_path / "pq"), saved_dataset(tmp_path / "s")
    assert [data_source(str(p)) for p in (wds, parquet, saved)] == [DATA_SOURCES[k] for k in ("tar-shards", "parquet",
                                                                                              "saved-dataset")]
    assert data_source(str(parquet)).class_names(str(parquet)) == ["cat", "dog", "fox"]
    pq.write_table(pa.table({"img": [b"x"], "label": [0]}), parquet / "data" / "train-00003-of-00004.parquet")
    with pytest.raises(ValueError) as err:
        TableShards(parquet, 8, "parquet")
    assert_names(str(err.value), "train-00003-of-00004.parquet", "has the columns img, label", "needs 'image'")
    monkeypatch.setitem(sys.modules, "pyarrow", None)   # not installed: one line naming the extra
    with pytest.raises(ValueError) as err:
        TableShards(saved, 8, "arrow")
    assert str(err.value) == "reading parquet or save_to_disk data needs pyarrow: pip install -e '.[stream]' " \
                             "(pyarrow reads parquet and save_to_disk folders)"


RUN = [*TINY_RUN, "--image-size", "8", "--lr", "1e-3"]


@pytest.mark.parametrize("kind", ["tar", "parquet"])
def test_training_resumes_bitwise(tmp_path, kind):
    """Eight steps straight against five then resumed to eight, across the first epoch's end
    (22 or 24 training items: 5 or 6 micro-batches of 4), with the held-out loss of a named split."""
    data = tar_folder(tmp_path / "d") if kind == "tar" else parquet_folder(tmp_path / "d")
    val = ["--val-every", "2", "--val-data", "val" if kind == "tar" else "validation", "--val-samples", "3"]
    run = [*RUN, "--data", str(data), "--results-dir", str(tmp_path), "--global-batch-size", "4", *val]
    assert train_cli.main([*run, "--max-steps", "8", "--ckpt-every", "8", "--exp-name", "straight"]) == 0
    assert train_cli.main([*run, "--max-steps", "5", "--ckpt-every", "5", "--exp-name", "resumed"]) == 0
    assert train_cli.main([*run, "--max-steps", "8", "--ckpt-every", "8", "--exp-name", "resumed",
                           "--resume", "auto"]) == 0
    a, b = (ckpt_lib.open_checkpoint(tmp_path / name) for name in ("straight", "resumed"))
    assert a.step == b.step == 8 and a.state["epoch"] >= 1 and (a.state["epoch"], a.state["position"]) == \
        (b.state["epoch"], b.state["position"])
    for which in ("model", "ema"):
        wa, wb = a.weights(which), b.weights(which)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), which
    logs = [[json.loads(line) for line in (tmp_path / n / "log.jsonl").read_text().splitlines()]
            for n in ("straight", "resumed")]
    assert [r.get("val/loss") for r in logs[0]] == [r.get("val/loss") for r in logs[1]]


def latent_cache(root, vae=None, n=10, shard=4, channels=4, side=2):
    """A latent folder as extract_latents.py writes one (float32 moments of image and mirror)."""
    from safetensors.torch import save_file

    root.mkdir()
    g = torch.Generator().manual_seed(0)
    moments, labels = torch.randn(n, 2, 2, channels, side, side, generator=g), torch.arange(n) % 3
    names = []
    for k, first in enumerate(range(0, n, shard)):
        names.append(f"latents-{k:05d}.safetensors")
        save_file({"moments": moments[first:first + shard].contiguous(), "labels": labels[first:first + shard]},
                  str(root / names[-1]))
    (root / "meta.json").write_text(json.dumps(dict(shards=names, classes=["cat", "dog", "fox"], scaling_factor=0.5,
                                                    latent_channels=channels, image_size=8 * side, dtype="float32",
                                                    vae=str(vae))))
    return root


def test_latents_as_tar_shards_round_trip_and_train(tmp_path):
    from nala_dit.data.datasets import LatentDataset
    from nala_dit.data.streams import TarLatents, pack_latents
    from tests.training.test_loop import tiny_vae

    vae = tiny_vae(tmp_path / "vae")
    cache = latent_cache(tmp_path / "lat", vae)
    shards = pack_latents(cache, tmp_path / "lat-tar", per_shard=3)
    assert [p.name for p in shards] == [f"latents-{k:06d}.tar" for k in range(4)]   # 10 latents, 3 a shard
    packed, source = TarLatents(tmp_path / "lat-tar"), LatentDataset(cache)
    assert data_source(str(tmp_path / "lat-tar")) is DATA_SOURCES["latents"] and packed.is_latent
    assert (len(packed), packed.classes, packed.channels, packed.scaling_factor) == (10, ["cat", "dog", "fox"], 4, 0.5)
    assert all(torch.equal(packed[i][0], source[i][0]) and packed[i][1] == source[i][1] for i in range(10))
    with pytest.raises(FileExistsError):
        pack_latents(cache, tmp_path / "lat-tar")   # never over what is there
    run = [*RUN, "--data", str(tmp_path / "lat-tar"), "--vae", str(vae), "--global-batch-size", "2",
           "--results-dir", str(tmp_path), "--max-steps", "2", "--ckpt-every", "2"]
    assert train_cli.main(run) == 0
    assert ckpt_lib.open_checkpoint(tmp_path / "NaLaDiT-T-2").model_config["in_channels"] == 4
