"""``experiments/ablation/run.py``'s subcommands: run, table, timing, flops and cell."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import ROOT
from .recipes import (GATED_SOFTMAX, LADDER_VARIANTS, QUICK, QUICK_SEEDS, QUICK_TASKS, QUICK_VARIANTS, REMEDY_VARIANTS,
                      TASKS, TWO_BY_TWO, VARIANT_GROUPS, VARIANTS)
from .flops import FLOPS_FILE, FLOPS_SIZES, FLOPS_TOKENS, flops_main
from .runner import _csv, cell_main, cell_parser, run_main
from .tables import write_table
from .timing import QUICK_TIMING, TIMING_FILE, timing_main

def _check_names(parser, args, names) -> None:
    for name in names:
        allowed = TASKS if name == "tasks" else VARIANTS
        bad = [x for x in getattr(args, name) if x not in allowed]
        if bad:
            parser.error(f"--{name.replace('_', '-')}: unknown {bad}; choose from {list(allowed)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=sys.modules[__package__].__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the grid (skips finished cells), then write the table")
    run.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation")
    run.add_argument("--tasks", type=_csv(str), default=None,
                     help=f"comma list of {list(TASKS)} (default digits; --quick: {','.join(QUICK_TASKS)})")
    run.add_argument("--variants", type=_csv(str), default=None,
                     help=f"comma list, or 'ladder' = {','.join(LADDER_VARIANTS)}, 'remedies' = "
                          f"{','.join(REMEDY_VARIANTS)}, '2x2' = {','.join(TWO_BY_TWO)}, 'gated' = "
                          f"{','.join(GATED_SOFTMAX)} (default: all)")
    run.add_argument("--seeds", type=_csv(int), default=[0, 1, 2])
    run.add_argument("--sweep-lrs", type=_csv(float), default=[1e-3, 4e-3],
                     help="extra learning rates run at seed 0 for --sweep-variants")
    run.add_argument("--sweep-variants", type=_csv(str), default=["softmax", "nala"])
    run.add_argument("--core", type=int, default=0,
                     help="run every seed of the first N --variants before the other variants start")
    run.add_argument("--jobs", type=int, default=1, help="cells at once, one thread each (1 = in this process)")
    run.add_argument("--budgets", type=_csv(int), default=None,
                     help="steps at which to score (train to the largest); default the task's")
    run.add_argument("--no-wait", action="store_true",
                     help="return once the last cell has started (a following runner shares the slots)")
    run.add_argument("--md", type=Path, default=None, help="also write the table here (default <out>/table.md)")
    run.add_argument("--classifier-dir", type=Path, default=None,
                     help="digits classifier folder (default <out>/work/digits_classifier, trained if absent)")
    run.add_argument("--quick", action="store_true",
                     help=f"smoke run: variants {QUICK_VARIANTS}, seeds {QUICK_SEEDS}, {QUICK['budgets']} steps, no sweep")
    table = sub.add_parser("table", help="rebuild the table from the cell JSONs")
    table.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation")
    table.add_argument("--md", type=Path, default=None)
    table.add_argument("--page", "--readme", dest="page", type=Path, default=None,  # --readme: its old name
                       help="also replace the tables between the ablation markers of this file (experiments/ablation/README.md)")
    timing = sub.add_parser("timing", help="isolated step times per variant and task (one thread, round robin)")
    timing.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation", help=f"writes <out>/{TIMING_FILE}")
    timing.add_argument("--tasks", type=_csv(str), default=["canvas64", "canvas128"])
    timing.add_argument("--variants", type=_csv(str), default=["ladder"],
                        help="comma list, 'ladder' (default), 'remedies', '2x2' or 'gated'")
    timing.add_argument("--rounds", type=int, default=5, help="round-robin passes over the variants")
    timing.add_argument("--steps", type=int, default=2, help="timed steps per variant per pass")
    timing.add_argument("--quick", action="store_true",
                        help=f"smoke run: the quick recipes' batches, {QUICK_TIMING}")
    flops = sub.add_parser("flops", help="training FLOPs per image of the 2 x 2 variants at T/2, S/2, XL/2 and "
                                         f"{', '.join(map(str, FLOPS_TOKENS))} tokens")
    flops.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation", help=f"writes <out>/{FLOPS_FILE}")
    flops.add_argument("--sizes", type=_csv(str), default=None, help=f"comma list of {','.join(FLOPS_SIZES)} (default all)")
    flops.add_argument("--page", type=Path, default=None,
                       help="also replace the FLOPs block between the flops markers of this file (experiments/ablation/README.md)")
    sub.add_parser("cell", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "cell":
        return cell_main(cell_parser().parse_args(rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in ("run", "timing") and args.variants:
        args.variants = [x for v in args.variants for x in VARIANT_GROUPS.get(v, [v])]
    if args.command == "timing":
        _check_names(parser, args, ("tasks", "variants"))
        if args.rounds < 1 or args.steps < 1:
            parser.error(f"--rounds {args.rounds} and --steps {args.steps} must be >= 1")
        return timing_main(args)
    if args.command == "flops":
        bad = [s for s in args.sizes or () if s not in FLOPS_SIZES]
        if bad:
            parser.error(f"--sizes: unknown {bad}; choose from {list(FLOPS_SIZES)}")
        return flops_main(args)
    if args.command == "table":
        print(write_table(args.out.resolve(), args.md, args.page).read_text())
        return 0
    if args.quick:
        args.variants = args.variants or list(QUICK_VARIANTS)
        args.tasks = args.tasks or list(QUICK_TASKS)
        args.seeds, args.sweep_lrs = list(QUICK_SEEDS), []
    args.variants = args.variants or list(VARIANTS)
    args.tasks = args.tasks or ["digits"]
    _check_names(parser, args, ("tasks", "variants", "sweep_variants"))
    code = run_main(args)
    print((args.md or args.out.resolve() / "table.md").read_text())
    return code
