"""Cache VAE latents of an image folder for fast training (resumable, multi-process).

One process:
    python extract_latents.py --data /data/imagenet/train --vae stabilityai/sd-vae-ft-ema \\
        --out /data/imagenet256-latents
Many GPUs (shards are split across processes; rerun the same command to resume):
    accelerate launch --multi_gpu --num_processes 8 extract_latents.py --data ... --vae ... --out ...
Then train on them:
    accelerate launch train.py --config configs/nala_dit_s2_imagenet256.yaml --data /data/imagenet256-latents
meta.json also holds the per-channel mean and std of the whole cache (latent_stats, exact
however the extraction was split or resumed), which --latent-norm channel trains with.
"""

import json
import sys

from nala_dit.cli.requirements import require_installed

require_installed()  # a python without torch (not the .venv one): one line naming .venv, not a traceback

from nala_dit.cli.parse import (THREADS_HELP, ArgumentParser, Interrupted, main_process, passive_wait_policy, report_error,
                          run_main, set_threads)

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True, help="image folder <root>/<class>/<images>")
    p.add_argument("--out", required=True, help="output folder for shards + meta.json")
    p.add_argument("--vae", required=True, help="diffusers autoencoder folder or hub id: any image "
                   "autoencoder class its config.json names (AutoencoderKL, AutoencoderDC, AutoencoderRAE, ...)")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--shard-size", type=int, default=4096, help="images per shard (the unit of resume)")
    p.add_argument("--num-workers", type=int, help="data loader workers per process (default: the CPUs this "
                   "process may use shared by the processes on this machine, at most 4)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="storage dtype of the moments")
    p.add_argument("--skip-corrupt", action="store_true", help="skip unreadable images with a warning")
    p.add_argument("--keep-images", action="store_true", help="also store each resized image (uint8) beside its "
                   "latents: what --repa-encoder needs (196 KB per 256-px image)")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    args = p.parse_args(argv)
    from nala_dit.data.extract import extract_latents  # torch, diffusers: only once there is work to do

    try:
        set_threads(args.threads)
        out = extract_latents(args.data, args.out, args.vae, args.image_size, args.batch_size,
                              args.shard_size, args.num_workers, args.dtype, args.skip_corrupt, args.keep_images)
    except (ValueError, FileNotFoundError, OSError) as err:
        return report_error(err)  # one line, printed by rank 0 only
    except KeyboardInterrupt:
        from nala_dit.data.extract import shards_done

        done, total = shards_done(args.out)
        raise Interrupted(f"{done} of {total if total is not None else '?'} shards kept in {args.out}; "
                           f"run the same command to resume")
    if not main_process():   # the first process reports for all
        return 0
    stats = json.loads((out / "meta.json").read_text()).get("latent_stats")
    print(f"latents in {out}")
    if stats:
        show = lambda v: ", ".join(f"{x:.4g}" for x in v)  # noqa: E731
        print(f"per-channel mean [{show(stats['mean'])}], std [{show(stats['std'])}] over {stats['latents']:,} "
              f"latents ({stats['values_per_channel']:,} values per channel)")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
