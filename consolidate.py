"""Write the single-file checkpoint of a sharded one (``train.py --fsdp``).

An FSDP run's checkpoints hold the weights, EMA and optimizer as shards, one file per process
(``<step>/shards/``, torch.distributed.checkpoint). ``sample.py``, ``export.py`` and the
pipelines read them as they are, on one process; this writes the usual single-file folder
(``model.safetensors``, ``ema.safetensors``, ``optimizer.pt``, ...) to share, or to resume
without ``--fsdp``:
    python consolidate.py runs/NaLaDiT-H-2                       # the latest checkpoint
    python consolidate.py runs/NaLaDiT-H-2/checkpoints/0100000 --out exported/ckpts
It writes ``<run>/consolidated/<step>/`` by default; an existing folder is never replaced.
"""

import argparse
import sys

from nala_dit.cli.requirements import require_installed

require_installed()  # a python without torch (not the .venv one): one line naming .venv, not a traceback

from nala_dit.cli.parse import ArgumentParser, Interrupted, run_main


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__)
    p.add_argument("ckpt", help="a sharded checkpoint folder, or a run folder (its latest checkpoint)")
    p.add_argument("--out", help="the folder the checkpoint's <step>/ folder goes in (default <run>/consolidated)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from nala_dit.training.sharding import consolidate

    try:
        path = consolidate(args.ckpt, args.out)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        raise Interrupted("nothing was written (a checkpoint is renamed into place when complete); run the same "
                          "command again") from None
    print(f"wrote {path} (single-file checkpoint: sample.py --ckpt {path}, export.py checkpoint {path} OUT)")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
