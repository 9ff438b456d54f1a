"""Training-step time against torch's thread settings, on a quiet machine and beside a busy one.

NaLaDiT-T/2 and DiT-T/2 (batch 64, 8×8 one-channel images = 16 tokens, as the demo trains
them; forward, MSE, backward, AdamW) under three settings:

* ``1 thread``: ``OMP_NUM_THREADS=1``;
* ``default``: torch's default threads (one per core) and OpenMP's default wait policy
  (idle threads spin before they sleep): what a plain ``python`` got before the entry points
  set ``OMP_WAIT_POLICY``;
* ``default + PASSIVE``: torch's default threads with ``OMP_WAIT_POLICY=PASSIVE`` (idle
  threads sleep): what every entry point of this repository now sets unless the user did.

each *quiet* and *busy* (beside one busy one-thread torch process, a matmul loop this script
starts and kills afterwards). OpenMP reads its environment once, when torch loads, so every
(model, setting, condition) runs in a fresh process. A step is timed ``--steps`` times after
one warm-up step (fewer when ``--cap-s`` seconds are spent: the default threads beside a
busy process can be very slow); the table reports medians and the ratio to the one-thread
time of the same model and condition. The JSON keeps every step's time and the load average
before and after.

    python benchmarks/threads.py --steps 8 --out benchmarks/results/threads_cpu.json
    python benchmarks/threads.py --tiny --out runs/threads.json      # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name: environment changes (None: removed)
    "1 thread": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": None},
    "default": {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None},
    "default + PASSIVE": {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": "PASSIVE"},
}
MODELS = ("NaLaDiT-T/2", "DiT-T/2")
# The busy neighbour: one torch thread multiplying matrices until it is killed.
BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(384, 384)\nwhile True:\n    a = (a @ a).tanh()\n"
CHILD = "import sys, json; sys.path.insert(0, {root!r}); from benchmarks.threads import step_times; " \
        "print(json.dumps(step_times({model!r}, {batch}, {steps}, {cap})))"


def step_times(model_name: str, batch: int, steps: int, cap_s: float) -> dict:
    """Runs in the child: seconds per training step (after one warm-up step)."""
    env = {key: os.environ.get(key) for key in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}  # as torch loads
    import torch

    from benchmarks.model import make_batch, train_step
    from nala_dit.models.dit import create_model

    torch.manual_seed(0)
    model = create_model(model_name, input_size=8, in_channels=1, num_classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = make_batch(model, batch, 8, torch.device("cpu"), torch.float32)
    train_step(model, opt, data)  # warm-up: allocator, AdamW state, thread pool
    times, start = [], time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        train_step(model, opt, data)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > cap_s:
            break
    return dict(times_s=times, torch_threads=torch.get_num_threads(), omp_wait_policy=env["OMP_WAIT_POLICY"],
                omp_num_threads=env["OMP_NUM_THREADS"])


def run_child(model: str, setting: str, batch: int, steps: int, cap_s: float) -> dict:
    from nala_dit.cli.parse import child_env

    code = CHILD.format(root=str(ROOT), model=model, batch=batch, steps=steps, cap=cap_s)
    out = subprocess.run([sys.executable, "-c", code], env=child_env(ROOT, **SETTINGS[setting]), capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def start_busy() -> subprocess.Popen:
    from nala_dit.cli.parse import child_env

    proc = subprocess.Popen([sys.executable, "-c", BUSY], env=child_env(ROOT, OMP_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2.0)  # let it import torch and start multiplying
    if proc.poll() is not None:
        raise RuntimeError(f"the busy process ended at once (exit code {proc.returncode})")
    return proc


def main(argv=None) -> int:
    from benchmarks.outputs import new_output  # an existing results file is refused

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="timed steps per setting (after one warm-up step)")
    p.add_argument("--cap-s", type=float, default=20.0, help="stop timing a setting after this many seconds")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tiny", action="store_true", help="NaLaDiT-T/2 only, quiet only (the default policy beside a busy process can take "
                   "a minute a step), batch 8, 2 steps: a smoke test")
    p.add_argument("--threads", type=int, help=argparse.SUPPRESS)  # every benchmark takes it; the settings decide
    p.add_argument("--out", type=new_output)
    args = p.parse_args(argv)
    models = ["NaLaDiT-T/2"] if args.tiny else args.models.split(",")
    steps, batch = (2, 8) if args.tiny else (args.steps, args.batch)
    conditions = ("quiet",) if args.tiny else ("quiet", "busy")
    if steps < 1 or batch < 1:
        p.error("--steps and --batch must be >= 1")
    load_start = os.getloadavg()
    rows = []
    busy = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` still kills the busy process (finally)
    meta = dict(batch=batch, tokens=16, steps=steps, cap_s=args.cap_s, cpus=os.cpu_count(), tiny=args.tiny,
                conditions=conditions, loadavg_start=load_start,
                command=" ".join(["python benchmarks/threads.py"] + (argv if argv is not None else sys.argv[1:])))

    def write(complete: bool) -> None:  # after every row: a run cut short keeps what it measured
        if args.out:
            meta.update(loadavg_end=os.getloadavg(), complete=complete)
            args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")

    try:
        for condition in conditions:
            if condition == "busy":
                busy = start_busy()
            for model in models:
                for setting in SETTINGS:
                    r = run_child(model, setting, batch, steps, args.cap_s)
                    r.update(model=model, setting=setting, condition=condition,
                             median_s=statistics.median(r["times_s"]))
                    rows.append(r)
                    write(False)
                    print(f"{model:12s} {condition:5s} {setting:18s} {r['torch_threads']} threads "
                          f"{r['median_s']:.3f} s/step ({len(r['times_s'])} steps)", flush=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    load_end = os.getloadavg()
    one = {(r["model"], r["condition"]): r["median_s"] for r in rows if r["setting"] == "1 thread"}
    for r in rows:
        r["vs_1_thread"] = round(r["median_s"] / one[r["model"], r["condition"]], 3)
    print(f"\nload average {load_start[0]:.2f} → {load_end[0]:.2f}; median s/step (× the 1-thread time)")
    print(f"| model | condition | {' | '.join(SETTINGS)} |")
    print("|---|---|" + "---:|" * len(SETTINGS))
    for model in models:
        for condition in conditions:
            cells = [next(r for r in rows if (r["model"], r["condition"], r["setting"]) == (model, condition, s))
                     for s in SETTINGS]
            print(f"| {model} | {condition} | " + " | ".join(f"{c['median_s']:.3f} ({c['vs_1_thread']:.2f}×)"
                                                               for c in cells) + " |")
    write(True)
    return 0


if __name__ == "__main__":  # not when a child imports step_times: its environment is the setting's
    sys.path.insert(0, str(ROOT))
    from nala_dit.cli.parse import passive_wait_policy

    passive_wait_policy()  # as every entry point; each child gets its setting's environment explicitly
    sys.exit(main())
