"""Wall time of each CLI's ``--help`` as a ratio to ``python -c pass`` (the interpreter's own start).

    python benchmarks/cli_startup.py            # median of 5 runs each
    python benchmarks/cli_startup.py --repeats 11 --json runs/bench/cli_startup.json

A ratio, not seconds, so the number means the same on a loaded machine: ``--help`` must
not import torch, diffusers or accelerate (see ``nala_dit/cli/options.py``).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nala_dit.cli.parse import passive_wait_policy  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)

COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "train.py --help": ["train.py", "--help"],
    "train.py --dry-run": ["train.py", "--config", "configs/digits_nala_dit.yaml", "--dry-run"],
    "sample.py --help": ["sample.py", "--help"],
    "evaluate_fid.py calc --help": ["evaluate_fid.py", "calc", "--help"],
    "export.py --help": ["export.py", "--help"],
    "extract_latents.py --help": ["extract_latents.py", "--help"],
}


def wall(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    times = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):  # interleaved, so load changes hit every command alike
        for name, cmd in COMMANDS.items():
            times[name].append(wall(cmd))
    base = statistics.median(times["python -c pass"])
    rows = {name: dict(median_s=statistics.median(t), ratio=statistics.median(t) / base) for name, t in times.items()}
    print(f"{'command':<30} {'median s':>9} {'× python -c pass':>17}")
    for name, row in rows.items():
        print(f"{name:<30} {row['median_s']:>9.3f} {row['ratio']:>17.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(repeats=args.repeats, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
