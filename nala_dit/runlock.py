"""One writer per output: an exclusive lock file, and a check that the processes the
launcher started are the processes Accelerate sees.

Two ``train.py`` with the same run folder (or two ``sample.py`` with the same ``--out``)
would otherwise both "succeed" while overwriting each other's checkpoints, logs and
shards. ``RunLock`` creates ``<path>`` with ``O_EXCL`` and writes the holder's pid, host
and start time into it. A lock whose holder is gone (same host, pid not running, or
running but started later than the lock: a reused pid) is stale and taken over with a
message; a live holder, or one on another host that cannot be checked, is an error that
names it and says how to proceed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from .attention.config import check_parallel_world

LOCK_NAME = ".lock"


class LockedError(FileExistsError):
    """The output is held by another process (message names the holder)."""


def _process_start(pid: int) -> float | None:
    """Start time of ``pid`` in seconds since the epoch (Linux), None when unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of stat, after pid and (comm)
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def holder_is_gone(holder: dict) -> bool:
    """True when the lock's holder certainly no longer runs (same host only)."""
    if holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or not _alive(pid):
        return True
    started, since = _process_start(pid), holder.get("time")
    # A running pid that started after the lock was written is a reused pid.
    return started is not None and isinstance(since, (int, float)) and started > since + 1.0


class RunLock:
    """``with RunLock(path, what): ...`` holds ``path`` exclusively (see module doc)."""

    def __init__(self, path: str | os.PathLike, what: str, hint: str = ""):
        self.path = Path(path)
        self.what = what  # e.g. "run folder runs/x", for messages
        self.hint = hint  # how to avoid the clash, e.g. "choose another --exp-name"
        self.held = False

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = dict(pid=os.getpid(), host=socket.gethostname(), time=time.time())
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read_holder()
                if holder == {}:  # released meanwhile: try again
                    continue
                if holder is None or holder_is_gone(holder):
                    self._remove_stale(holder)
                    continue
                since = holder.get("time")
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
                raise LockedError(
                    f"{self.what} is in use by pid {holder.get('pid')} on host {holder.get('host')} "
                    f"(since {since}, lock file {self.path}); wait for it to finish"
                    f"{', or ' + self.hint if self.hint else ''}. "
                    f"If that process is gone (e.g. another machine crashed), delete {self.path}."
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise LockedError(f"could not take the lock {self.path}: it keeps reappearing (another process races for it)")

    def _remove_stale(self, holder: dict | None) -> None:
        """Delete the stale lock we read, unless another process replaced it meanwhile.
        A short-lived guard file makes check-and-delete atomic: two runs that find the
        same stale lock cannot both delete it (the second would delete the first's new lock)."""
        guard = self.path.with_name(self.path.name + ".takeover")
        try:
            fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - guard.stat().st_mtime > 10:  # left by a process killed mid-takeover
                    guard.unlink()
            time.sleep(0.05)
            return
        try:
            if self._read_holder() == holder:
                who = f"pid {holder.get('pid')}" if holder else "an unreadable lock"
                print(f"note: taking over the stale lock {self.path} ({who} is gone)")
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)
            guard.unlink(missing_ok=True)

    def _read_holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}  # released between our open and read: just retry
        except (OSError, ValueError):
            # Half-written by a process killed between create and write: give it a moment.
            time.sleep(0.2)
            try:
                holder = json.loads(self.path.read_text())
            except (OSError, ValueError):
                return None
        return holder if isinstance(holder, dict) else None

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def hold_lock(path: str | os.PathLike, what: str, hint: str = "", state=None):
    """Hold ``RunLock(path)`` for the ``with`` body. With an Accelerate ``state`` (an
    ``Accelerator`` or ``PartialState``) the main process takes it for the whole group and
    every process raises if it could not."""
    lock = RunLock(path, what, hint)
    failure = [None]
    if state is None or state.is_main_process:
        try:
            lock.acquire()
        except LockedError as err:
            failure[0] = str(err)
    if state is not None and state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(failure)
    if failure[0] is not None:
        raise LockedError(failure[0])
    try:
        yield lock
    finally:
        lock.release()


def launched_processes() -> int | None:
    """How many processes the launcher says it started (torchrun / accelerate / MPI / Slurm)."""
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


CPU_COMMAND = ("ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {n} --num_machines 1 "
               "--mixed_precision no --dynamo_backend no {script} ...")


def _parent_command() -> list[str]:
    """The command line of the process that started this one (Linux; [] when unknown)."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def single_process_launch(parent: list[str] | None = None) -> int | None:
    """The process count asked of an ``accelerate launch`` that started one process.

    Without ``--multi_gpu`` (``--cpu``, or no GPUs), accelerate's launcher runs the script
    once whatever ``--num_processes`` says, and sets no ``WORLD_SIZE``: only
    ``ACCELERATE_USE_CPU`` (always) and, when more than one process was asked for,
    ``MASTER_ADDR``. The count comes from the launcher's command line (our parent), 0 when
    it was more than one but not given there (an accelerate config file); None when this
    is not such a launch."""
    if "WORLD_SIZE" in os.environ or "ACCELERATE_USE_CPU" not in os.environ:
        return None
    parent = _parent_command() if parent is None else parent
    if not any("accelerate" in word for word in parent[:3]) or "launch" not in " ".join(parent[:3]):
        return None
    for i, word in enumerate(parent[1:], 1):
        if i >= 2 and word.endswith(".py"):  # the training script: its own flags follow
            break
        flag, _, value = word.partition("=")
        if flag in ("--num_processes", "--num-processes"):
            value = value or (parent[i + 1] if i + 1 < len(parent) else "")
            if value.isdigit():
                return int(value) if int(value) > 1 else None
    return 0 if "MASTER_ADDR" in os.environ else None


def refuse_single_process_launch(script: str) -> None:
    """Refuse an ``accelerate launch`` that started one process where more were asked for
    (``single_process_launch``): a 2-process command would quietly run one."""
    asked = single_process_launch()
    if asked is not None:
        n = asked or 2
        raise ValueError(
            f"accelerate launch was asked for {asked or 'more than one'} processes but started one: without "
            f"--multi_gpu (e.g. with --cpu) it runs a single process. On CPUs use: "
            f"{CPU_COMMAND.format(n=n, script=script)}; on GPUs: accelerate launch --multi_gpu "
            f"--num_processes {n} {script} ..."
        )


def check_launch(script: str, context_parallel: int = 1) -> None:
    """What the launcher's environment alone can refuse, before torch loads (about 5 s in every
    process): one process started where more were asked for, and a ``--context-parallel``
    that does not divide the processes. Checked again once the process group is up
    (``check_process_count``, ``ContextParallel.from_world``)."""
    refuse_single_process_launch(script)
    check_parallel_world(context_parallel, int(os.environ.get("WORLD_SIZE", "1") or 1))


def check_process_count(num_processes: int, script: str) -> None:
    """Refuse to run when the launcher started more (or fewer) processes than joined
    Accelerate's group, or started one process where more were asked for: each would
    otherwise work alone on the same outputs, or a 2-process command would quietly run one."""
    launched = launched_processes()
    if launched is None and num_processes == 1:
        refuse_single_process_launch(script)
    if launched is None or launched == num_processes:
        return
    raise ValueError(
        f"the launcher started {launched} processes but Accelerate sees {num_processes}: each process would "
        f"run alone on the same outputs. On CPUs use: {CPU_COMMAND.format(n=launched, script=script)} "
        f"(or torchrun with ACCELERATE_USE_CPU=1); on GPUs check that CUDA is visible to every process."
    )
