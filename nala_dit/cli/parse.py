"""What every CLI shares: one argument parser with forgiving errors (torch-free).

* The same rule everywhere: flags are spelled in full (no prefix abbreviations), so a
  flag means the same on the command line and as a YAML key, and a later flag never
  silently changes what an old abbreviation meant.
* A mistyped flag names the nearest real one (``--max-step`` → ``--max-steps``,
  ``--cfg_scale`` → ``--cfg-scale``), with a one-line usage instead of argparse's listing
  of every flag.
* ``closest`` (``nala_dit/checks.py``) is the one suggestion rule, also used for YAML keys, class
  names and mistyped paths (``did_you_mean``).
* ``passive_wait_policy``: called first by every entry point (CLIs, ``demo.py``, the
  benchmarks, the test suite), before torch loads.
* ``set_threads``: the ``--threads`` option of every CLI that computes.
* ``Interrupted`` / ``run_main``: Ctrl-C ends a CLI with one line saying what was kept and how
  to go on.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
import time

from ..checks import SYNONYMS, closest, did_you_mean, nearest_path  # noqa: F401  (the suggestion rule: checks.py)
from ..training.config import THREADS_HELP  # noqa: F401

NEGATIVE_NUMBER = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^-(?:inf|infinity|nan)$", re.IGNORECASE)


# Flags that other tools' scripts have and a parser here may not (only a parser without the flag
# answers with these): instead of the nearest spelling, what takes its place.
ABSENT_FLAGS = {
    "--device": "the first CUDA GPU is used when one is visible, else the CPU; CUDA_VISIBLE_DEVICES picks "
                "the GPU(s), ACCELERATE_USE_CPU=1 forces the CPU, `accelerate launch` spreads processes over "
                "GPUs",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse without abbreviations, whose errors are short and suggest the nearest flag."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        # A value that starts with '-' is a negative number, not a flag, in every spelling
        # (argparse's own rule knows only -1 and -.5: "--lr -1e-4" was "expected one argument"),
        # so the option's own check can say what is wrong with it.
        self._negative_number_matcher = NEGATIVE_NUMBER

    def flags(self) -> list[str]:
        """Every visible long flag of this parser (not of its subcommands)."""
        return [s for a in self._actions if a.help != argparse.SUPPRESS
                for s in a.option_strings if s.startswith("--")]

    def all_flags(self) -> set[str]:
        """Every visible long flag of this parser and of its subcommands."""
        subs = [a.choices.values() for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        return set(self.flags()).union(*(p.all_flags() for group in subs for p in group))

    def _chosen_subparser(self, namespace):
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(namespace, action.dest, None) or "")
        return None

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = self._chosen_subparser(namespace)
            parser = sub if sub is not None else self
            candidates = parser.flags() + (self.flags() if sub is not None else [])
            parts = []
            for token in extras:
                if token.startswith("-"):
                    flag = token.split("=", 1)[0]
                    near = closest(flag, candidates)
                    if flag in ABSENT_FLAGS and flag not in self.all_flags():   # what this script does instead
                        parts.append(f"{flag} ({parser.prog} has no {flag}: {ABSENT_FLAGS[flag]})")
                    else:
                        parts.append(f"{flag} (did you mean {near[0]}?)" if near else flag)
            if not parts:
                parts = [repr(t) for t in extras]
            parser.error(f"unrecognized arguments: {', '.join(parts)}")  # argparse's wording, plus the hints
        return namespace

    def short_usage(self) -> str:
        """``usage: prog REQUIRED... [options]``: what must be given, not every flag."""
        parts = []
        for a in self._actions:
            if a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            if not a.option_strings:
                parts.append("{" + ",".join(a.choices) + "}" if isinstance(a, argparse._SubParsersAction)
                             else (a.metavar or a.dest))
            elif a.required:
                parts.append(f"{a.option_strings[-1]} {a.metavar or a.dest.upper()}")
        return f"usage: {' '.join([self.prog] + parts)} [options]"

    def error(self, message: str):
        # argparse would print the full usage (for train.py, every flag and preset);
        # one line and a pointer to --help is easier to read.
        helps = (f"`{self.prog} --help` lists the common options, `{self.prog} --help-all` every one"
                 if self.common_actions is not None else f"`{self.prog} --help` lists every option")
        self.exit(2, f"{self.short_usage()}\n{self.prog}: error: {message}\n({helps})\n")

    # A parser with many flags (train.py's) answers --help with the common ones and --help-all with
    # all of them in sections, as PyTorch's and diffusers' training scripts do: ``common_actions``
    # (None: --help lists every flag, argparse's own way) and ``add_help_flags``.
    common_actions: list | None = None

    def add_help_flags(self) -> None:
        """``-h/--help`` (the common options) and ``--help-all`` (every one); the parser is made
        with ``add_help=False``. Flags go into ``common_actions`` as the caller adds them."""
        quiet = dict(action=_HelpAction, nargs=0, default=argparse.SUPPRESS)
        self.common_actions = [self.add_argument("-h", "--help", help="show the common options and exit", **quiet),
                               self.add_argument("--help-all", help="show every option, in sections, and exit",
                                                 **quiet)]

    def format_common_help(self) -> str:
        """The usage, the description, the common options and where the others are."""
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self.common_actions, [])
        formatter.add_text(self.description)
        formatter.start_section("common options")
        formatter.add_arguments(self.common_actions)
        formatter.end_section()
        sections = [g.title for g in self._action_groups[2:] if g._group_actions]
        total = len([a for a in self._actions if a.option_strings])
        yaml = (" Every option is also a YAML key of --config (the flag without --)."
                if "--config" in self.flags() else "")
        formatter.add_text(textwrap.fill(f"`{self.prog} --help-all` lists every option ({total} in all), in "
                                         f"sections: {'; '.join(sections)}.{yaml}", 79))
        return formatter.format_help()


class _HelpAction(argparse.Action):
    """``--help``: the common options; ``--help-all``: every option."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(parser.format_help() if option_string == "--help-all" else parser.format_common_help(),
                              sys.stdout)
        parser.exit()


class Interrupted(KeyboardInterrupt):
    """Ctrl-C inside a CLI's ``main``, carrying one line on what was kept. It is still a
    KeyboardInterrupt, so in-process callers of ``main`` see the interrupt as before.
    ``exit_code``: the status ``run_main`` returns; ``together``: every process of the launch
    stopped at the same point, so they leave their group together (``training.preempt.Preempted``)."""

    exit_code = 130
    together = False


def leave_group() -> None:
    """Every launched process waits for the others, then the group is torn down. A process
    that exits while gloo's threads still run aborts ("terminate called without an active
    exception"): a helper rank that finished its forwards must not exit before the first
    rank has scored. ``run_main`` calls it after every successful script."""
    dist = sys.modules.get("torch.distributed")   # never imports torch itself
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_main(main) -> int:
    """A script's entry point: ``main()``, with Ctrl-C ending in one line that says what
    was kept and how to go on (instead of a traceback); exit status 130 (an ``Interrupted``:
    its ``exit_code``, training's ``Preempted`` 75). In a multi-process launch only rank 0
    speaks. After a successful ``main()``, or a stop every process agreed on (``together``),
    the launched processes leave their group together (``leave_group``)."""
    try:
        code = main()
        if code == 0:
            leave_group()
        return code
    except KeyboardInterrupt as err:
        code, stopped = getattr(err, "exit_code", 130), getattr(err, "together", False)
        kept = str(err) if isinstance(err, Interrupted) or stopped else "run the same command to start again"
        if stopped:
            leave_group()
    except Exception as err:
        if not peer_lost(err):
            raise
        # another rank stopped (its one-line error is out): one line here, not torch's traceback
        rank = os.environ.get("RANK", "?")
        if rank == "0":   # rank 0 prints every error itself: the one that stopped was another, maybe killed
            where = "it was killed or failed; the launcher's report names it and its exit code"
        else:
            where = "its error is the line above from rank 0, or the launcher's report"
        print(f"rank {rank}: stopped because another process of this launch stopped ({where})", file=sys.stderr)
        return 1
    tqdm = sys.modules.get("tqdm.std")
    if tqdm is not None:  # close live progress bars now, or they redraw after the line
        for bar in list(getattr(tqdm.tqdm, "_instances", ())):
            bar.close()
    if main_process():
        print(f"{'stopped' if stopped else 'interrupted'}: {kept}", file=sys.stderr)
    return code


def peer_lost(err: BaseException) -> bool:
    """A collective that failed because another process of the launch exited (gloo's
    "Connection closed by peer", NCCL's or torch's distributed errors), in a launch."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return False
    text = str(err)
    return (type(err).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError")
            or any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")))


# Seconds the other ranks of a launch wait before they exit on an error, so that rank 0's
# line is out before the launcher stops every process.
ERROR_GRACE_S = 2.0


def report_error(err: BaseException) -> int:
    """A CLI's ``error: ...`` line, once per run: every rank of a launch meets the same
    config, data and checkpoint errors, so only rank 0 prints it (one line, and in a
    launch a note on the launcher's report that follows); the others wait
    ``ERROR_GRACE_S`` first. Returns the exit status, 1."""
    if main_process():
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
        note = (" (the launcher's ChildFailedError report that follows only repeats that the processes stopped)"
                if launched else "")
        print(f"error: {err}{note}", file=sys.stderr, flush=True)
    else:
        time.sleep(ERROR_GRACE_S)
    return 1


def main_process() -> bool:
    """Rank 0 of a launch (or a single process), from the launcher's environment: what a
    CLI prints once per run, after Accelerate's state is gone, only this process prints."""
    return os.environ.get("RANK", "0") == "0"


def passive_wait_policy() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user set it: an entry point calls this before
    torch is imported (OpenMP reads it once, when torch loads; later it changes nothing).

    With OpenMP's default policy each idle torch thread spins at the end of every parallel
    region. On a machine whose cores are all busy, a spinning thread takes the core the
    thread it waits for needs, and every one of the thousands of small ops in a training step
    waits at a barrier: a NaLaDiT-T/2 step took 16-33x longer beside one other busy process than
    with one thread (``benchmarks/threads.py``). PASSIVE threads sleep instead; on a quiet
    machine that cost nothing measurable (``make demo QUICK=1`` 25.2 s with it,
    27.7 s without). In a user's own Python ``import nala_dit`` does the same when it comes
    before torch (docs/performance.md, "Threads"). Environments of child processes inherit it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def seed_arg(text: str) -> int:
    """argparse type of a sampling ``--seed``: a whole number >= 0 (numpy's SeedSequence,
    which mixes it with the sample index, takes no negative entropy)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {value}")
    return value



def set_threads(threads: int | None) -> None:
    """Apply ``--threads`` (None: leave torch's default)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def default_device() -> str:
    """The device of a one-process CLI with no ``--device`` (``sample.py``, ``app.py``), by
    accelerate's rule as training's: CUDA when visible (``CUDA_VISIBLE_DEVICES`` picks it), else
    the CPU; ``ACCELERATE_USE_CPU=1`` forces the CPU (``ABSENT_FLAGS``)."""
    import torch
    from accelerate.utils import parse_flag_from_env

    return "cpu" if parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available() else "cuda"


def child_env(root, **changes) -> dict:
    """This process's environment for a Python child that imports the repository at ``root``:
    ``root`` first on PYTHONPATH, then what was there (packages the caller put on it stay
    visible, e.g. wheels unpacked beside a GPU image's own); ``changes`` set variables, None
    removes one."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env
