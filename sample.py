"""Sample class-conditional images from a training checkpoint or a saved pipeline folder.

A grid, one row per label (4 samples each), from the latest checkpoint of a run:
    python sample.py --ckpt runs/NaLaDiT-S-2 --labels 1,2,3 --per-label 4 --grid grid.png
Class names (matched against the model's id2label; "_" stands for a space), guided:
    python sample.py --ckpt exported/nala-dit-xl2 --labels golden_retriever,tabby --cfg-scale 1.5 \\
        --guidance-interval 0,700 --out-dir samples/
At another size (pixels; HxW for non-square), directly or by progressive upscaling from
the trained size (SDEdit: sample at 256, upsample, re-noise to --strength, denoise at 512):
    python sample.py --ckpt runs/NaLaDiT-S-2 --labels 1,2 --image-size 512 --time-shift auto --grid big_grid.png
    python sample.py --ckpt runs/NaLaDiT-S-2 --labels 1,2 --image-size 512 --upscale-from 256 \\
        --strength 0.6 --grid big_grid.png
The grid of an 8-px digits model, enlarged 6 times for viewing (nearest neighbour):
    python sample.py --ckpt runs/demo/NaLaDiT --labels 0,1,2,3 --per-label 4 --grid digits_grid.png --grid-scale 6
Random, class-balanced labels, individual PNGs, DPM-Solver++ in bf16:
    python sample.py --ckpt runs/NaLaDiT-S-2 --num-samples 64 --sampler dpm-solver --steps 25 \\
        --precision bf16 --out-dir samples/
Compiled, each batch shape captured once as a CUDA graph and replayed at every step:
    python sample.py --ckpt runs/NaLaDiT-S-2 --num-samples 64 --cuda-graphs --out-dir samples/
One large image's rows over 2 processes per sample (context parallel; same .npz):
    accelerate launch --multi_gpu --num_processes 8 sample.py --ckpt runs/NaLaDiT-XL-2 --image-size 4096 \\
        --num-samples 64 --context-parallel 2 --out big.npz
FID-50K samples as ADM's .npz (+ samples.npz.json), resumable, on every GPU:
    accelerate launch --multi_gpu --num_processes 8 sample.py --ckpt runs/NaLaDiT-S-2 \\
        --num-samples 50000 --cfg-scale 1.5 --out samples.npz
On CPUs, several processes (`accelerate launch --cpu` would start only one; torchrun
with ACCELERATE_USE_CPU=1 works too):
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no sample.py --ckpt ... --num-samples 1000 --out s.npz

A killed mass-sampling run resumes where it stopped: rerun the same command; finished
shards in ``<out>.parts/`` are kept. Every sample's noise is seeded by (seed, index), so
the images do not depend on the number of processes. Stochastic samplers (ddpm, sde-*)
also depend on --batch-size; keep it fixed to reproduce a run.
"""

import argparse
import math
import sys
from pathlib import Path
from datetime import timedelta

from nala_dit.cli.requirements import require_installed

require_installed()  # a python without torch (not the .venv one): one line naming .venv, not a traceback

from nala_dit.cli.parse import (THREADS_HELP, ArgumentParser, Interrupted, default_device, main_process,
                                passive_wait_policy, report_error, run_main, seed_arg, set_threads)
from nala_dit.cli.sizes import add_size_arguments, check_size_args, sized
from nala_dit.cli.options import (CONTEXT_PARALLEL_HELP, ODE_ATOL, ODE_RTOL, PRECISIONS, SAMPLERS, VAE_TILE_PIXELS,
                              VAE_TILING_MODES, cfg_scale_arg, check_context_parallel)

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)


def _pair(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two numbers), got {text!r}") from None
    return lo, hi


GRID_SCALE_MAX = 64
GRID_PIXELS_MAX = 2 ** 28   # an enlarged grid beyond this (16k x 16k) is refused before sampling


def grid_scale_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= GRID_SCALE_MAX:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {GRID_SCALE_MAX} "
                                         f"(times the grid's size), got {text!r}")
    return value


# ``--help`` lists these (``--help-all`` every option, in sections), as train.py's does
HELP_COMMON = ("ckpt", "labels", "per_label", "num_samples", "seed", "image_size", "sampler", "steps", "cfg_scale",
               "batch_size", "threads", "grid", "grid_scale", "out_dir", "out")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, add_help=False, usage="%(prog)s --ckpt CKPT [options]")
    p.add_help_flags()
    p.add_argument("--ckpt", required=True, help="checkpoint folder, run folder (latest checkpoint) or pipeline folder")
    p.add_argument("--weights", choices=["ema", "model"], default="ema",
                   help="checkpoint weights (a pipeline folder holds one set)")
    p.add_argument("--vae", help="VAE folder or hub id (default: the one the checkpoint/pipeline names)")
    what = p.add_argument_group("what to sample")
    what.add_argument("--labels", help="comma-separated class ids or names, e.g. 1,2,3 or golden_retriever,tabby")
    what.add_argument("--per-label", type=int, default=1, help="samples per label in --labels (grid: one row each)")
    what.add_argument("--num-samples", type=int, help="N samples with balanced, seeded-shuffled labels")
    what.add_argument("--seed", type=seed_arg, default=0, help="seeds every sample's noise together with its index")
    add_size_arguments(p)
    how = p.add_argument_group("sampler")
    how.add_argument("--sampler", choices=list(SAMPLERS), help="default: ddpm (DiT) / ode-heun (SiT)")
    how.add_argument("--steps", type=int, help="sampler steps (default per sampler, see nala_dit.diffusion.generate)")
    how.add_argument("--max-nfe", type=int, help="dopri5: stop with an error after this many model "
                     "evaluations per batch (default: unbounded)")
    how.add_argument("--atol", type=float, default=ODE_ATOL, help="dopri5: absolute tolerance")
    how.add_argument("--rtol", type=float, default=ODE_RTOL, help="dopri5: relative tolerance")
    how.add_argument("--cfg-scale", type=cfg_scale_arg, default=1.0,
                     help="classifier-free guidance scale, 0..100; 1 = none")
    how.add_argument("--guidance-interval", type=_pair, metavar="LO,HI",
                     help="guide only for model times in [LO, HI] (DiT timesteps 0..999, SiT t in [0, 1])")
    how.add_argument("--guide-channels", type=int, help="guide only the first k channels (3 = original DiT code)")
    how.add_argument("--precision", choices=list(PRECISIONS), default="fp32", help="transformer precision")
    how.add_argument("--batch-size", type=int, default=32, help="samples per forward pass (per process)")
    how.add_argument("--threads", type=int, help=THREADS_HELP)
    how.add_argument("--compile", action="store_true",
                     help="torch.compile the model (in place; NaLa traces whole, as a custom op); the first "
                          "batch pays the compilation (tens of seconds on a CPU)")
    how.add_argument("--cuda-graphs", action="store_true",
                     help="--compile with CUDA graphs (mode reduce-overhead): each batch shape captured once, "
                          "replayed at every sampler step; without CUDA one note, then compiled without them")
    how.add_argument("--context-parallel", type=int, default=1, metavar="P",
                     help="mass sampling (--out) under accelerate launch: " + CONTEXT_PARALLEL_HELP)
    how.add_argument("--vae-tiling", choices=list(VAE_TILING_MODES), default="auto",
                     help="tiled VAE decode: auto = above 1024x1024 px (also decodes big batches one image at "
                     "a time), on, off (tiled images differ from untiled ones, most near tile edges)")
    how.add_argument("--vae-tile-size", type=int, metavar="PIXELS",
                     help=f"tile side in image px when tiling (default {VAE_TILE_PIXELS}; a multiple of 32 for f8 VAEs)")
    out = p.add_argument_group("outputs")
    out.add_argument("--grid", help="write a PNG grid here")
    out.add_argument("--grid-scale", type=grid_scale_arg, default=1, metavar="N",
                     help="enlarge the saved grid N times (nearest neighbour, for viewing; 8-px digits: 4-8), "
                     "1 to 64; the --out-dir PNGs keep the model's size")
    out.add_argument("--out-dir", help="write one PNG per sample here")
    out.add_argument("--out", help="mass sampling: ADM .npz path (needs --num-samples; shards in <out>.parts/)")
    out.add_argument("--shard-size", type=int, help="mass sampling: samples per resumable shard (default: about "
                     "1/20 of --num-samples, at most 1000; a resumed run keeps its own)")
    out.add_argument("--keep-parts", action="store_true", help="mass sampling: keep the shards after assembling")
    out.add_argument("--stop-after", type=int, help=argparse.SUPPRESS)  # tests: simulate an interruption
    p.common_actions += [a for name in HELP_COMMON for a in p._actions if a.dest == name]
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, OSError, KeyError) as err:
        return report_error(err)  # one line, printed by rank 0 only
    except KeyboardInterrupt:
        if not args.out:
            raise Interrupted("nothing was written (images are saved at the end); run the same command again")
        from nala_dit.pipelines.sample_files import shards_done

        samples, shards = shards_done(args.out)
        raise Interrupted(f"{samples} of {args.num_samples} samples kept ({shards} finished shards in "
                           f"{args.out}.parts/); run the same command to resume")


def run(args) -> int:
    if args.out:  # mass sampling may be launched: the launcher's mistakes at once, before torch loads
        from nala_dit.runlock import check_launch

        check_launch("sample.py", args.context_parallel)
    import torch

    from nala_dit.data.images import balance_notice
    from nala_dit.pipelines.sample_files import mass_sample
    from nala_dit.pipelines.sources import load_source
    from nala_dit.models.vae import check_tiling, decode_settings

    set_threads(args.threads)
    settings = checked_settings(args)
    if args.out:
        from accelerate import PartialState
        from accelerate.utils import parse_flag_from_env

        from nala_dit.runlock import check_process_count

        # Without GPUs the processes must form a gloo group (cpu=True), or each would
        # sample everything alone. Ranks that resume with nothing left to do wait at the
        # final barrier for the others: give the group a long timeout.
        cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
        state = PartialState(cpu=cpu, timeout=timedelta(hours=12))
        check_process_count(state.num_processes, "sample.py")
        from nala_dit.attention.context_parallel import ContextParallel, enable

        context = ContextParallel.from_world(args.context_parallel)
        source = compiled(load_source(args.ckpt, args.weights, args.vae, state.device), args)
        enable(source.model, context)
        settings = sized(settings, source, args, min(args.batch_size, args.num_samples), state.is_main_process)
        settings.resolved(source.objective)  # clear errors before any work
        check_tiling(args.vae_tiling, args.vae_tile_size, source.vae)
        if state.is_main_process and (note := balance_notice(args.num_samples, source.num_classes)):
            print(note, file=sys.stderr)
        with decode_settings(args.vae_tiling, args.vae_tile_size):
            # it says what it wrote (or that the file was already complete)
            mass_sample(source, args.out, args.num_samples, args.seed, settings, args.batch_size,
                        args.shard_size, args.stop_after, args.keep_parts, state=state, context=context)
        return 0

    device = default_device()   # as train.py's Accelerator (ACCELERATE_USE_CPU=1: the CPU)
    write_samples(args, compiled(load_source(args.ckpt, args.weights, args.vae, device), args), settings)
    return 0


def compiled(source, args):
    """``source`` with its model compiled in place as ``--compile`` / ``--cuda-graphs`` ask
    (``nala_dit.models.compile``: the module keeps its class and attributes)."""
    if args.compile or args.cuda_graphs:
        from nala_dit.models.compile import compile_model, compile_note

        compile_model(source.model, "reduce-overhead" if args.cuda_graphs else "default")
        if main_process():
            print(compile_note("batch"), file=sys.stderr, flush=True)
    return source


def checked_settings(args):
    """The sampler settings of the flags, after every check that needs no model (outputs
    writable, counts, sizes, what to write): one-line errors before loading it. ``app.py``
    runs its requests through this too, so the page refuses what the command refuses."""
    from nala_dit.diffusion.generate import SampleSettings
    from nala_dit.guards import check_writable
    from nala_dit.cli.options import check_steps

    # outputs that cannot be written fail now, not after all the sampling
    for flag, path, kind in (("--grid", args.grid, dict(image=True)), ("--out-dir", args.out_dir, dict(folder=True)),
                             ("--out", args.out, {})):
        if path:
            check_writable(path, flag, **kind)
    refuse_overwrite(args)
    if args.num_samples is not None and args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    check_counts(args)
    if args.sampler and args.steps is not None:   # the sampler's bound (check_steps) before loading; the exact
        check_steps(args.sampler, args.steps)      # chain of a DiT model is checked once it is loaded
    settings = SampleSettings(args.sampler, args.steps, args.cfg_scale, args.guidance_interval,
                              args.guide_channels, args.precision, args.atol, args.rtol, args.max_nfe)
    check_size_args(args)
    check_context_parallel(args.context_parallel)
    if args.context_parallel > 1 and not args.out:
        raise ValueError(f"--context-parallel {args.context_parallel} applies to mass sampling (--out "
                         f"samples.npz --num-samples N) under accelerate launch; drop it for --grid / --out-dir")
    if args.out:
        if args.num_samples is None or args.labels:
            raise ValueError("--out (mass sampling) takes --num-samples N and no --labels (labels are balanced)")
        return settings
    if not (args.grid or args.out_dir):
        raise ValueError("nothing to write: pass --grid PATH and/or --out-dir DIR (or --out for an .npz)")
    if (args.labels is None) == (args.num_samples is None):
        raise ValueError("pass exactly one of --labels and --num-samples")
    return settings


def requested_count(args) -> int:
    """How many images the flags ask for: --num-samples, else --labels × --per-label (1 at least)."""
    if args.num_samples is not None:
        return max(args.num_samples, 1)
    return max(1, len([s for s in (args.labels or "").split(",") if s.strip()]) * max(args.per_label, 1))


def check_counts(args) -> None:
    """How many images the flags ask for, within ``MAX_SAMPLES``, before the model is loaded
    (``--per-label 1000000000`` would build a list of 10⁹ labels)."""
    from nala_dit.data.images import check_sample_count

    what = "--num-samples" if args.num_samples is not None else f"--labels × --per-label {args.per_label:,}"
    check_sample_count(requested_count(args), what)


def check_held_images(count: int, h: int, w: int) -> None:
    """--grid / --out-dir keep every image in memory until written: refuse, before sampling, more
    than this machine has available (``--out`` writes shards and holds one)."""
    from nala_dit.guards import TooLargeError, available_memory

    need, (have, kind) = count * h * w * 3, available_memory("cpu")
    if need > have:
        raise TooLargeError(f"--grid / --out-dir hold all {count:,} images of {w}x{h} px in memory ({need / 1e9:,.1f} "
                            f"GB), this machine has {have / 1e9:,.1f} GB {kind}; sample fewer, or write them with "
                            f"--out samples.npz --num-samples {count} (in shards)")


def refuse_overwrite(args) -> None:
    """A user's files are never replaced: an existing --grid, or an --out-dir already holding
    sample PNGs (``<index>_class<label>.png``, the names this command writes), is refused in one
    line (``--out``'s .npz has its own rule: only its own unfinished run is resumed)."""
    from nala_dit.guards import refuse_existing

    if args.grid:
        refuse_existing(args.grid, "--grid")
    if args.out_dir and Path(args.out_dir).is_dir():
        if held := sorted(Path(args.out_dir).glob(SAMPLE_PNG_GLOB)):
            raise FileExistsError(f"--out-dir {args.out_dir} already holds {len(held)} sample PNG(s) (e.g. "
                                  f"{held[0].name}); not overwriting them: choose another --out-dir, or move them away")


GRID_VIEW_PIXELS = 32   # an image side below this gets a --grid-scale hint (8-px digits: 4x)


def grid_size(count: int, nrow: int, h: int, w: int, scale: int = 1) -> tuple[int, int]:
    """(height, width) in px of ``save_grid``'s grid of ``count`` h x w images, ``nrow`` a row
    (2 px padding around each), enlarged ``scale`` times."""
    rows, cols = math.ceil(count / nrow), min(nrow, count)
    return (rows * (h + 2) + 2) * scale, (cols * (w + 2) + 2) * scale


def grid_scale_hint(count: int, nrow: int, h: int, w: int) -> str:
    """``; 22 x 22 px: pass --grid-scale 4 to enlarge`` for a grid of images smaller than
    ``GRID_VIEW_PIXELS`` a side written without ``--grid-scale``, else ''."""
    if min(h, w) >= GRID_VIEW_PIXELS:
        return ""
    height, width = grid_size(count, nrow, h, w)
    scale = min(GRID_SCALE_MAX, math.ceil(GRID_VIEW_PIXELS / min(h, w)))
    return f"; {width} x {height} px: pass --grid-scale {scale} to enlarge"


SAMPLE_PNG_GLOB = "[0-9][0-9][0-9][0-9][0-9][0-9]_class*.png"   # data.images.save_pngs' names


def write_samples(args, source, settings) -> tuple[list[int], list]:
    """``--grid`` / ``--out-dir`` from a loaded ``source``: the size flags, the labels (ids or
    class names of ``source.id2label``, or balanced), the images and the files; returns the
    labels and the PNG paths. ``app.py`` calls exactly this, so its images are this command's."""
    from nala_dit.data.images import balance_notice, balanced_labels, save_grid, save_pngs
    from nala_dit.pipelines.sample_files import sample_images
    from nala_dit.pipelines.sources import resolve_labels
    from nala_dit.models.grid import vae_factor
    from nala_dit.models.vae import check_tiling, decode_settings

    settings = sized(settings, source, args, min(args.batch_size, requested_count(args)))
    settings.resolved(source.objective)
    check_tiling(args.vae_tiling, args.vae_tile_size, source.vae)
    h, w = (side * vae_factor(source.vae) for side in settings.resolved(source.objective).noise_size(source.model))
    if args.labels is not None:
        ids = resolve_labels([s for s in args.labels.split(",") if s.strip()], source.id2label, source.num_classes)
        if args.per_label < 1:
            raise ValueError(f"--per-label must be >= 1, got {args.per_label}")
        check_held_images(len(ids) * args.per_label, h, w)
        labels = [i for i in ids for _ in range(args.per_label)]
        nrow = args.per_label if args.per_label > 1 else len(labels)
    else:
        check_held_images(args.num_samples, h, w)
        labels = balanced_labels(args.num_samples, source.num_classes, args.seed).tolist()
        if note := balance_notice(args.num_samples, source.num_classes):
            print(note, file=sys.stderr)
        nrow = math.ceil(math.sqrt(len(labels)))
    scale = getattr(args, "grid_scale", 1) or 1
    if args.grid:   # the (enlarged) grid's size, refused before any sampling
        height, width = grid_size(len(labels), nrow, h, w, scale)
        pixels = height * width
        if pixels > GRID_PIXELS_MAX:
            flag, fix = (f"--grid-scale {scale}", "a smaller --grid-scale or ") if scale > 1 else ("--grid", "")
            raise ValueError(f"{flag}: the grid would be {pixels / 1e6:,.0f} megapixels (at most "
                             f"{GRID_PIXELS_MAX / 1e6:.0f}); use {fix}fewer images")
    with decode_settings(args.vae_tiling, args.vae_tile_size):
        images, nfe = sample_images(source, labels, args.seed, settings, args.batch_size, progress=True)
    pngs = []
    if args.grid:
        save_grid(images, args.grid, nrow, scale, new=True)   # refused at the start, and never replaced
        shown = f", shown {scale}x" if scale > 1 else grid_scale_hint(len(labels), nrow, *images.shape[1:3])
        print(f"wrote {args.grid} ({len(labels)} images, {nfe} NFE each{shown})")
    if args.out_dir:
        pngs = save_pngs(images, labels, args.out_dir, new=True)
        print(f"wrote {len(labels)} PNGs to {args.out_dir}")
    return labels, pngs


if __name__ == "__main__":
    sys.exit(run_main(main))
