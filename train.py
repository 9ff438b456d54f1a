"""Train a DiT / SiT / NaLaDiT / NaLaSiT model with Hugging Face Accelerate.

One process (CPU or one GPU):
    python train.py --config configs/digits_nala_dit.yaml
Many GPUs / nodes (same command, accelerate decides the topology):
    accelerate launch --multi_gpu --num_processes 8 train.py --config configs/nala_dit_s2_imagenet256.yaml
Resume after an interruption (same flags):
    accelerate launch ... train.py --config ... --resume auto
SIGTERM / SIGUSR1 (preemption, time limit): checkpoint, exit 75 (scripts/slurm/train.sbatch)
Print the resolved config (defaults < YAML < flags) and exit:
    python train.py --config configs/nala_dit_s2_imagenet256.yaml --lr 2e-4 --dry-run
"""

import sys

from nala_dit.cli.requirements import require_installed

require_installed()  # a python without torch (not the .venv one): one line naming .venv, not a traceback

from nala_dit.cli.parse import Interrupted, main_process, passive_wait_policy, report_error, run_main
from nala_dit.cli.config import dump_yaml, resolve
from nala_dit.cli.options import TrainConfig

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)


def main(argv=None) -> int:
    cfg, args = resolve(TrainConfig, argv, description=__doc__)
    if args.dry_run:
        print(dump_yaml(cfg), end="")
        return 0
    from nala_dit.runlock import check_launch

    try:
        check_launch("train.py", cfg.context_parallel)  # the launcher's mistakes at once, before torch loads
        from nala_dit.training.loop import train  # torch and accelerate: only once there is work to do

        run_dir = train(cfg)
    except (ValueError, FileNotFoundError, FileExistsError, OSError, FloatingPointError) as err:
        return report_error(err)  # one line, printed by rank 0 only
    except KeyboardInterrupt as err:
        if getattr(err, "together", False):   # SIGTERM / SIGUSR1 (training/preempt.py): every process stopped
            raise                             # at one step, its checkpoint written; its line, exit status 75
        from nala_dit.training.checkpoint import list_checkpoints

        found = list_checkpoints(cfg.run_dir() / "checkpoints")
        if not found:
            raise Interrupted(f"no checkpoint was written yet in {cfg.run_dir()}; run the same command to start again")
        again = "the same command" if cfg.resume == "auto" else "the same command with --resume auto"
        raise Interrupted(f"kept {len(found)} checkpoint(s) in {cfg.run_dir()}, the latest at step "
                           f"{int(found[-1].name)}; run {again} to continue from it")
    if main_process():  # every rank returns here; one line says the run is done
        print(f"done: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
