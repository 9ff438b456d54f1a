"""The benchmark scripts run end to end in --tiny mode and write valid JSON."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import assert_names

pytestmark = pytest.mark.slow   # runs scripts end to end: the full tier (make test)

ROOT = Path(__file__).resolve().parents[2]


def run_script(script, out, *extra):
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--tiny", "--threads", "1", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


def run_main(script, out, capsys, *extra):
    """The script's ``main(argv)`` with the arguments of ``run_script``, in this process (which
    has torch and the package loaded already: one interpreter start less, as demo.py runs the
    CLIs), for the scripts whose own process either counts memory with the allocator (not its
    resident memory) or only starts the processes that measure; torch's thread count and the
    environment (fsdp.py sets OMP_NUM_THREADS for its processes) are restored after."""
    import importlib

    import torch

    module = importlib.import_module(f"benchmarks.{Path(script).stem}")
    threads, env = torch.get_num_threads(), dict(os.environ)
    try:
        module.main(["--tiny", "--threads", "1", "--out", str(out), *extra])
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(env)
    return json.loads(out.read_text()), capsys.readouterr().out


@pytest.fixture
def forkserver():
    """This process's forkserver, started with tests/ranks.py's preload (which holds what
    benchmarks/processes.py preloads): the --tiny benchmarks fork their measuring processes
    from it, as the run_ranks tests of this process do."""
    import multiprocessing.forkserver

    from tests.ranks import context

    context()
    multiprocessing.forkserver.ensure_running()


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_attention_benchmark_tiny(tmp_path, capsys):
    data, stdout = run_main("attention.py", tmp_path / "attention.json", capsys)
    meta = data["meta"]
    for key in ("device", "dtype", "threads", "torch", "sdpa_backend", "memory_method", "command"):
        assert key in meta, key
    assert meta["threads"] == 1 and meta["dtype"] == "fp32"
    methods = {r["method"] for r in data["results"]}
    assert {"nala", "nala_naive", "relu", "sdpa", "math"} <= methods
    for r in data["results"]:
        assert r["mode"] in ("fwd", "fwd+bwd") and r["n"] in (64, 256)
        assert r["skipped"] is None, r
        assert finite(r["time_ms"]) and r["time_ms"] > 0
        assert finite(r["peak_mib"]) and r["peak_mib"] > 0
        assert r["gpu_ms"] is None                       # CUDA events only on CUDA (benchmarks/timing.py)
    assert set(data["slopes"]) == {"fwd", "fwd+bwd"}
    row = next(r for r in data["ratios"] if r["mode"] == "fwd" and r["n"] == 256)
    assert finite(row["time_nala/relu"]) and finite(row["time_nala/sdpa"]) and finite(row["mem_nala/sdpa"])
    assert (tmp_path / "attention.png").stat().st_size > 0
    assert "nala/relu" in stdout


def test_model_benchmark_tiny(tmp_path, capsys):
    data, stdout = run_main("model.py", tmp_path / "model.json", capsys)
    rows = data["results"]
    assert {r["model"] for r in rows} == {"DiT-S/2", "NaLaDiT-S/2"}
    assert {r["task"] for r in rows} == {"train", "sample"}
    for r in rows:
        assert r["skipped"] is None, r
        for key in ("images_per_s", "peak_mib", "gflops_fwd_per_image", "time_ms"):
            assert finite(r[key]) and r[key] >= 0, (key, r)
        assert r["params"] > 0 and r["latent"] == r["resolution"] // 8
        assert r["gpu_ms"] is None and r["images_per_s"] == pytest.approx(r["batch"] / r["time_ms"] * 1e3)
    assert data["meta"]["tiny"] is True
    assert "img/s" in stdout


def test_highres_benchmark_tiny(tmp_path, capsys):
    data, stdout = run_main("highres.py", tmp_path / "highres.json", capsys)
    rows = data["results"]
    assert {r["section"] for r in rows} == {"sample", "train", "vae"}
    assert {(r["attention"], r["model"]) for r in rows if r["section"] == "sample"} == {
        ("nala", "NaLaDiT-S/2"), ("sdpa", "DiT-S/2"), ("math", "DiT-S/2")}
    assert {r["grad_checkpointing"] for r in rows if r["section"] == "train"} == {False, True}
    assert {r["tiling"] for r in rows if r["section"] == "vae" and r["px"] == 128} == {"off", "on"}
    for r in rows:
        assert r["skipped"] is None, r
        assert finite(r["time_s"]) and r["time_s"] > 0 and r["calls"] >= 1
        # The shape-only count reproduces the measured peak (same operators, same shapes).
        assert abs(r["peak_mib_counted"] - r["peak_mib"]) <= 0.02 * r["peak_mib"] + 0.02, r
        if r["section"] != "vae":
            assert r["tokens"] == (r["px"] // 16) ** 2 and r["latent"] == r["px"] // 8
    ratios = {(r["section"], r["px"], r.get("attention"), r["vs"], r.get("grad_checkpointing")): r
              for r in data["ratios"]}
    assert finite(ratios[("sample", 128, None, "math", False)]["mem_ratio"])
    assert ratios[("vae", 128, None, "untiled", None)]["mem_ratio"] < 0.5       # 64-px tiles of a 128-px image
    for key in ("date", "load_average", "threads", "memory_method", "command"):
        assert key in data["meta"], key
    assert (tmp_path / "highres.png").stat().st_size > 0
    assert "ratios" in stdout and "| NaLa / math memory |" in stdout
    # The docs tables are rebuilt from the JSON alone (and the plot redrawn).
    (tmp_path / "highres.png").unlink()
    from benchmarks import highres

    highres.main(["--from-json", str(tmp_path / "highres.json")])
    tables = capsys.readouterr().out
    assert "**VAE decode**" in tables and "| 128 | 2.5 MiB |" in tables
    assert (tmp_path / "highres.png").stat().st_size > 0


def test_train_rss_benchmark_tiny(tmp_path):
    data, stdout = run_script("train_rss.py", tmp_path / "rss.json")
    rows = data["rows"]
    assert set(rows) == {"DiT", "NaLaDiT", "NaLaDiT (recompute=False)"} and data["meta"]["tokens"] == 64
    assert rows["DiT"]["peak_ratio"] == rows["DiT"]["step_ratio"] == 1.0
    for r in rows.values():
        (run,) = r["runs"]                                         # one fresh process each
        assert run["peak_mib"] > run["built_mib"] > 0
        assert r["median_step_mib"] == run["peak_mib"] - run["built_mib"]
    assert "step adds MiB" in stdout


def test_highres_quality_runs_every_setting(tmp_path, digits_checkpoint, digits_classifier_dir):
    """Every (model, setting, seed) is scored once; the classifier and reference are built once.
    10 sampling steps instead of the demo's 40: the count of every setting's calls is the check."""
    import shutil

    import torch

    import experiments.highres_quality.run as hq

    work = tmp_path / "work"
    shutil.copytree(digits_classifier_dir, work / "digits_classifier")
    threads = torch.get_num_threads()
    try:   # in this process, as run_main
        assert hq.main(["--runs", str(digits_checkpoint.parent), "--models", digits_checkpoint.name, "--per-class", "1",
                        "--seeds", "0,1", "--steps", "10", "--work", str(work), "--out", str(tmp_path / "q.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((tmp_path / "q.json").read_text())["rows"]
    assert [(r["setting"], r["seed"]) for r in rows] == [(s[0], seed) for s in hq.SETTINGS for seed in (0, 1)]
    for r in rows:
        assert 0 <= r["class_consistency"] <= 1 and finite(r["frechet_distance"])
        # NFE: the sampler's 10 steps, plus the upscaled second stage's round(strength · 10)
        assert r["nfe"] == 10 + (round(r["strength"] * 10) if r["strength"] else 0)


def test_highres_quality_refuses_steps_below_one(capsys):
    import experiments.highres_quality.run as hq

    with pytest.raises(SystemExit):
        hq.main(["--steps", "0"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("error: --steps must be >= 1, got 0")


def test_threads_benchmark_tiny(tmp_path):
    """Each setting ran in its own process with its own environment (--tiny: quiet only;
    the busy neighbour is started and killed below)."""
    data, stdout = run_script("threads.py", tmp_path / "threads.json")
    rows = {r["setting"]: r for r in data["rows"]}
    assert set(rows) == {"1 thread", "default", "default + PASSIVE"}
    assert {r["condition"] for r in data["rows"]} == {"quiet"} and data["meta"]["tiny"] is True
    assert data["meta"]["complete"] is True
    assert rows["1 thread"]["torch_threads"] == 1 and rows["1 thread"]["omp_num_threads"] == "1"
    assert rows["default"]["omp_wait_policy"] is None and rows["default"]["omp_num_threads"] is None
    assert rows["default + PASSIVE"]["omp_wait_policy"] == "PASSIVE"
    assert rows["default"]["torch_threads"] == rows["default + PASSIVE"]["torch_threads"] == len(os.sched_getaffinity(0))
    assert rows["1 thread"]["vs_1_thread"] == 1.0
    for r in rows.values():
        assert len(r["times_s"]) == 2 and all(finite(t) and t > 0 for t in r["times_s"])
    assert "| NaLaDiT-T/2 | quiet |" in stdout
    assert len(data["meta"]["loadavg_start"]) == 3


def test_threads_benchmark_busy_neighbour_runs_until_killed():
    sys.path.insert(0, str(ROOT))
    from benchmarks.threads import start_busy

    busy = start_busy()  # returns once the process is up (or raises if it ended)
    try:
        assert busy.poll() is None
    finally:
        busy.kill()
        assert busy.wait(timeout=30) == -9


@pytest.mark.slow
def test_context_parallel_benchmark_tiny(tmp_path, capsys, forkserver):
    """The exchanges counted at the torch.distributed calls equal the closed forms."""
    data, stdout = run_main("context_parallel.py", tmp_path / "cp.json", capsys, "--sections", "forward")
    rows = {r["model"]: r for r in data["results"]}
    assert set(rows) == {"NaLaDiT-T/2", "DiT-T/2"}
    for r in rows.values():
        assert r["tokens"] == 256 and r["procs"] == 2 and finite(r["speedup"]) and r["one_peak_mib"] > 0
        assert r["exchanged_per_layer_counted"] == r["exchanged_per_layer_formula"]
    # T/2: 4 heads of D = 32 → state 4·64·33 = 8,448, halo to the one neighbour: 2 rows of
    # 16 tokens · 128 channels = 4,096 numbers
    assert rows["NaLaDiT-T/2"]["exchanged_per_layer_formula"] == 8448 + 4096
    assert rows["DiT-T/2"]["exchanged_per_layer_formula"] == 2 * 128 * 128      # K and V of 128 tokens
    xl = {r["tokens"]: r for r in data["bytes_xl2"]}
    assert xl[16384]["nala_state_numbers"] == 16 * 144 * 73
    assert "softmax gather" in stdout


def test_fsdp_benchmark_tiny_counts_match_their_closed_forms(tmp_path, capsys, forkserver):
    """What each process holds and what a step exchanges, counted at the tensors and the
    torch.distributed calls, equal the formulas from the parameter shapes; at P = 2 FSDP holds
    half of DDP's parameters, gradients, AdamW state and EMA (plus the shards' padding rows)."""
    data, stdout = run_main("fsdp.py", tmp_path / "fsdp.json", capsys)
    rows = {(r["mode"], r["procs"]): r for r in data["results"]}
    assert set(rows) == {("ddp", 1), ("fsdp", 1), ("ddp", 2), ("fsdp", 2)}
    for r in rows.values():
        assert r["held_match_formula"] and r["collectives_match_formula"] and finite(r["step_s"]), r["mode"]
    assert rows["ddp", 1]["held_total"] == rows["fsdp", 1]["held_total"] == rows["ddp", 2]["held_total"]
    whole, half = rows["ddp", 2]["held_total"], rows["fsdp", 2]["held_total"]
    assert whole / 2 <= half < whole / 2 * 1.01   # the padding: each parameter rounded up to an even row count
    # FSDP sends each all-gathered and reduce-scattered buffer's other half; DDP all-reduces: 2 · 1/2 of it
    assert rows["fsdp", 2]["exchanged_per_process"] > rows["ddp", 2]["exchanged_per_process"] > 0
    assert "FSDP" in stdout and "| 2 | FSDP |" in data["table"]


def test_context_parallel_benchmark_on_cuda_without_a_gpu_is_a_one_line_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"), "--device", "cuda"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert_names(proc.stderr.strip().splitlines()[-1], "--device cuda", "no CUDA device", "run without --device")


def test_scorer_view_draws_each_sample_above_its_8x8_area_average(tmp_path):
    """A hand-made 16-px sample: its view is the 2 x 2 block means, enlarged back with square
    pixels; the tiles sit where the layout puts them (classes as columns, 2 px padding)."""
    import numpy as np
    from PIL import Image

    from experiments.ablation import scorer_view

    rng = np.random.default_rng(0)
    samples = tmp_path / "samples"
    samples.mkdir()
    images = {c: rng.integers(0, 256, (16, 16), dtype=np.uint8) for c in (0, 1)}
    images[1][:2, :2] = [[0, 255], [255, 255]]  # block mean 191.25 -> 191
    for i, c in enumerate((0, 1)):
        Image.fromarray(images[c]).save(samples / f"{i:06d}_class{c}.png")
    Image.fromarray(images[0]).save(samples / "notes.png")  # not sample.py's: ignored
    out = tmp_path / "view.png"
    assert scorer_view.main([str(samples), "--out", str(out)]) == 0
    fig = np.asarray(Image.open(out))
    assert fig.shape == (2 + 2 * 18, 2 + 2 * 18)
    for col, c in enumerate((0, 1)):
        x = 2 + col * 18
        np.testing.assert_array_equal(fig[2:18, x:x + 16], images[c])
        blocks = images[c].astype(np.float64).reshape(8, 2, 8, 2).mean(axis=(1, 3))
        expected = np.round(blocks).astype(np.uint8).repeat(2, 0).repeat(2, 1)
        np.testing.assert_array_equal(fig[20:36, x:x + 16], expected)
    assert fig[20, 20] == fig[21, 21] == 191
    assert not fig[:2].any() and not fig[18:20].any()  # padding rows stay black
    assert scorer_view.main([str(tmp_path / "empty"), "--out", str(out)]) == 2
    # Two folders stack top to bottom, 4 black rows between the two figures.
    both = tmp_path / "both.png"
    assert scorer_view.main([str(samples), str(samples), "--out", str(both)]) == 0
    stacked = np.asarray(Image.open(both))
    assert stacked.shape == (2 * fig.shape[0] + 4, fig.shape[1])
    np.testing.assert_array_equal(stacked[:fig.shape[0]], fig)
    np.testing.assert_array_equal(stacked[fig.shape[0] + 4:], fig)
    assert not stacked[fig.shape[0]:fig.shape[0] + 4].any()
    wide = tmp_path / "wide"
    wide.mkdir()
    for i, c in enumerate((0, 1, 2)):
        Image.fromarray(images[c % 2]).save(wide / f"{i:06d}_class{c}.png")
    assert scorer_view.main([str(samples), str(wide), "--out", str(both)]) == 2  # 2 vs 3 columns


def test_highres_builds_bf16_models_in_their_dtype_also_shape_only():
    """A bf16 cell builds its parameters in bf16 (not cast after: ``model.to`` under a fake
    mode cannot swap parameters, which stopped the GPU run), counted (fake) or real, with the
    fp32 build's parameter count; torch's default dtype is restored."""
    import torch

    from benchmarks.highres import build_model, fake_mode
    from nala_dit.models.dit import count_params

    cpu = torch.device("cpu")
    fp32 = count_params(build_model("NaLaDiT-S/2", 8, cpu, torch.float32, True, False))
    with fake_mode():
        shape_only = build_model("NaLaDiT-S/2", 8, cpu, torch.bfloat16, True, True)
        assert {p.dtype for p in shape_only.parameters()} == {torch.bfloat16}
        assert count_params(shape_only) == fp32
    real = build_model("NaLaDiT-S/2", 8, cpu, torch.bfloat16, True, False)
    assert {p.dtype for p in real.parameters()} == {torch.bfloat16} and count_params(real) == fp32
    assert torch.get_default_dtype() == torch.float32


def test_cpu_path_benchmark_tiny(tmp_path):
    """The three CPU-path sections at toy sizes: the three lifts compute the same features,
    each policy's chunk count is its closed form, the policy in use is restored, and the
    profile's shares partition the time; a count below 1 is refused."""
    import torch

    import nala_dit.attention.nala.fused as nala
    from benchmarks import cpu_path

    threads, policy = torch.get_num_threads(), nala._token_chunks
    try:
        assert cpu_path.main(["--tiny", "--out", str(tmp_path / "c.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    assert nala._token_chunks is policy
    data = json.loads((tmp_path / "c.json").read_text())
    lift = data["lift"]
    assert lift["chunk_tokens"] == 16 and lift["max_abs_diff"] < 1e-6
    assert min(lift["fused_us"], lift["eager_us"], lift["compiled_us"]) > 0
    # 6 × 64 heads: at most 2^16 // 384 = 170 tokens a chunk under both policies.
    counts = {(r["tokens"], r["mode"]): r["chunks"] for r in data["chunks"]}
    assert counts == {(n, m): {"near_equal": c, "ragged": c} for n, c in ((40, 1), (171, 2)) for m in ("fwd", "fwd+bwd")}
    assert all(r["ratio_q1"] <= r["ratio_median"] <= r["ratio_q3"] for r in data["chunks"])
    shares = data["profile"]["shares"]
    assert shares["gemm"] > 0 and shares["transcendental"] > 0 and sum(shares.values()) == pytest.approx(1.0)
    with pytest.raises(SystemExit):
        cpu_path.main(["--repeats", "0"])


def test_meanflow_step_benchmark_tiny(tmp_path, capsys):
    """One step of each objective on SiT-T/2: both timed, the ratio is their quotient."""
    data, _ = run_main("meanflow_step.py", tmp_path / "m.json", capsys, "--models", "SiT-T/2")
    (row,) = data["results"]
    assert row["model"] == "SiT-T/2" and row["transport_ms"] > 0 and row["meanflow_ms"] > 0
    assert row["ratio"] == pytest.approx(row["meanflow_ms"] / row["transport_ms"])


def test_attention_benchmark_jvp_tiny(tmp_path, capsys):
    """``--jvp``: NaLa's JVP timed with its forward beside it, the ratio their quotient; SDPA,
    which has no forward-mode rule, recorded as skipped with the error."""
    data, _ = run_main("attention.py", tmp_path / "jvp.json", capsys, "--jvp", "--methods", "nala,sdpa")
    jvp = {(r["method"], r["n"]): r for r in data["results"] if r["mode"] == "jvp"}
    assert set(jvp) == {(m, n) for m in ("nala", "sdpa") for n in (64, 256)}
    assert all("forward AD" in jvp[("sdpa", n)]["skipped"] for n in (64, 256))
    for n in (64, 256):
        row = next(r for r in data["ratios"] if r["mode"] == "jvp" and r["n"] == n)
        nala = jvp[("nala", n)]
        assert nala["skipped"] is None and row["time_jvp/fwd_nala"] == pytest.approx(nala["time_ms"] / nala["fwd_beside_ms"])
