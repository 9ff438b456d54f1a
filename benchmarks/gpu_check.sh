#!/usr/bin/env bash
# One-shot GPU check for issue 53: what the GPU spends on NaLa and on DiT at the batches people
# train at, old and new Triton kernels side by side. At most 8 minutes of stages on one H200:
# every stage has its own time limit (the limits sum to 480 s, held by
# tests/benchmarks/test_gpu_stages.py), a failing stage does not stop the others, and the
# summary at the end says which passed. Then `python benchmarks/tables.py --results DIR` writes
# the tables of docs/performance.md from the JSON files.
#
#   bash benchmarks/gpu_check.sh            # writes into $OUT if set, else runs/gpu_check/
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#   ONLY="kernels profile" bash benchmarks/gpu_check.sh   # only the stages whose names hold a word
#   ONLY=tests bash benchmarks/gpu_check.sh  # outside the 8 minutes: the CUDA correctness cases;
#                                            # likewise ONLY=highres, ONLY=context (the earlier
#                                            # plan's high-resolution and context-parallel stages)
#
# Needs python with torch (CUDA), triton and pytest, plus this repo's dependencies
# (diffusers: nala_dit imports it). On a machine that cannot install packages, put wheels
# into .gpu_wheels/ beforehand (git ignores it: copy it along) and they are installed into a
# temporary folder first. For the H200 image of 2026-12 (Python 3.12, torch 2.11, no diffusers)
# these two were enough:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .gpu_wheels diffusers==0.42.1 importlib_metadata
#
# Stages, in order (bf16; each writes its JSON as it goes, so a stage stopped at its limit
# keeps what it measured):
#   launch cost        launch.json: host µs per launched op (wall vs GPU), ops and GPU kernels
#                      of one gated layer / block / XL/2 model, forward and forward + backward
#   kernels fused      kernels_fused.json: one attention call at issue 53's six (B, H, N, D),
#                      NaLa Triton vs SDPA cuDNN / flash, fwd and fwd+bwd, GPU ms, FLOPs, bytes,
#                      fraction of the roofline (H200 or H100: kernels.py's ROOFLINES)
#   kernels baseline   kernels_baseline.json: NaLa alone with NALA_TRITON_VARIANT=baseline
#                      (the kernels before issue 53): the A/B in one run
#   profile            profile.json: top GPU kernels of one gated layer and one XL/2 block,
#                      NaLa vs softmax (torch.profiler)
#   model sweep        model_sweep.json: XL/2 at 256 px batch 8/32/128, 512 px batch 8/32,
#                      S/2 at 256 px batch 8/128; train + sample; DiT (cuDNN, flash) vs
#                      NaLaDiT, eager; torch.compile (DiT on cuDNN, NaLaDiT) at XL/2, 256 px,
#                      batch 32, right after its eager cells (a compile takes tens of seconds)
#   cuda graphs        graphs.json: sampling under torch.compile(mode="reduce-overhead"), XL/2
#                      at 256 px batch 32 (inductor's cache warm from the sweep) and 8, S/2 batch 8
#   block sweep d72    triton_configs_d72.json: block sizes of the kernels at head dim 72
# and gpu_check.log (everything printed, the summary at the end): 8 files, what a device run
# returns at most; anything more is packed into results.tar.

set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEST="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$DEST"
LOG="$DEST/gpu_check.log"
: >"$LOG"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset TRITON_INTERPRET
TOTAL_LIMIT=540          # seconds from the start: set-up, the 480 s of stages, margin (a 600 s device call)
declare -a SUMMARY=()

log() { echo "$@" | tee -a "$LOG"; }

# stage NAME LIMIT_S COMMAND...: run with a time limit, log everything, record the outcome.
stage() {
  local name="$1" limit="$2"; shift 2
  if [[ -n "${ONLY:-}" ]]; then
    local word wanted=0
    for word in $ONLY; do [[ "$name" == *"$word"* ]] && wanted=1; done
    ((wanted)) || { SUMMARY+=("$name: not run (ONLY=$ONLY)"); return; }
  fi
  local left=$((TOTAL_LIMIT - SECONDS))
  if ((left < 20)); then
    SUMMARY+=("$name: not run (total time limit reached)"); log "== $name: not run"; return
  fi
  ((limit > left)) && limit=$left
  log "== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  case $rc in
    0) SUMMARY+=("$name: ok (${took}s)") ;;
    124|130|137) SUMMARY+=("$name: TIME LIMIT after ${took}s (partial results kept)") ;;
    *) SUMMARY+=("$name: FAILED rc=$rc (${took}s)") ;;
  esac
}

# extra_stage: a stage outside the plan, run only when ONLY names it; else the same rules.
extra_stage() {
  [[ -n "${ONLY:-}" ]] || { SUMMARY+=("$1: not run (outside the plan: name it in ONLY)"); return; }
  stage "$@"
}

log "== gpu_check $(date -u +%FT%TZ) in $ROOT, output in $DEST"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
if ! "$PY" -c "import diffusers" 2>/dev/null && ls .gpu_wheels/*.whl >/dev/null 2>&1; then
  DEPS="$(mktemp -d)"
  "$PY" -m pip install --quiet --no-index --no-deps --target "$DEPS" .gpu_wheels/*.whl 2>&1 | tee -a "$LOG"
  export PYTHONPATH="$PYTHONPATH:$DEPS"
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib
for name in ("torch", "triton", "pytest", "diffusers", "matplotlib", "xdist"):
    try:
        print(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as err:
        print(f"{name} MISSING ({type(err).__name__}: {err})")
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF

# 1. The host's cost per launched op, and what a layer, a block and a model launch.
stage "launch cost" 40 \
  "$PY" benchmarks/launch.py --device cuda --dtype bf16 --size XL/2 --resolution 256 --batch 8 \
  --out "$DEST/launch.json"

# 2. Kernel GPU time at issue 53's shapes, new kernels then the old ones (A/B).
stage "kernels fused" 55 \
  "$PY" benchmarks/kernels.py --device cuda --dtype bf16 --budget-s 45 --out "$DEST/kernels_fused.json"
stage "kernels baseline" 40 \
  env NALA_TRITON_VARIANT=baseline "$PY" benchmarks/kernels.py --device cuda --dtype bf16 --methods nala \
  --budget-s 30 --out "$DEST/kernels_baseline.json"

# 3. Per-kernel profile of one gated layer and one block (XL/2, 256 px, batch 32).
stage "profile" 35 \
  "$PY" benchmarks/kernel_profile.py --device cuda --dtype bf16 --size XL/2 --resolution 256 --batch 32 \
  --out "$DEST/profile.json"

# 4. Whole models at the batches people train at: every eager cell, then compiled ones.
stage "model sweep" 185 \
  "$PY" benchmarks/sweep.py --device cuda --dtype bf16 --modes eager,default --repeats 5 \
  --compile-cells XL/2:256:32 --cell-cap-s 120 --budget-s 165 --out "$DEST/model_sweep.json"

# 5. Sampling through CUDA graphs (inductor's reduce-overhead), both models.
stage "cuda graphs" 85 \
  "$PY" benchmarks/sweep.py --device cuda --dtype bf16 --modes reduce-overhead --tasks sample \
  --cells XL/2:256:32,XL/2:256:8,S/2:256:8 --compile-cells all --repeats 10 --cell-cap-s 60 --budget-s 70 \
  --out "$DEST/graphs.json"

# 6. Block sizes at head dim 72, in the time left.
left=$((TOTAL_LIMIT - SECONDS - 10))
stage "block sweep d72" 40 \
  "$PY" benchmarks/triton_configs.py --head-dims 72 --budget-s $((left < 30 ? (left > 5 ? left : 5) : 30)) \
  --out "$DEST/triton_configs_d72.json"

# Outside the plan (not in the 8 minutes): stages that run only when ONLY names them.
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 6)
extra_stage "tests (CUDA, fp32 + bf16/fp16)" 120 \
  "$PY" -m pytest -q -p no:cacheprovider -rs "${XDIST[@]}" tests/attention/triton_cases.py
extra_stage "highres S/2 + XL/2" 100 \
  "$PY" benchmarks/highres.py --device cuda --dtype bf16 --sizes S/2,XL/2 --sections sample,vae,train \
  --math-cap-gib 50 --vae-real-max-px 4096 --repeats 3 --time-cap 10 --single-call-s 2 --budget-s 75 \
  --out "$DEST/highres_cuda.json"
extra_stage "context parallel P = 1 / 2" 45 \
  "$PY" benchmarks/context_parallel.py --device cuda --tokens 4096,16384 --repeats 3 \
  --out "$DEST/context_parallel_cuda.json"

# A device run returns at most 8 files: past that, everything but the log goes into one archive.
if (($(ls -1 "$DEST" | wc -l) > 8)); then
  (cd "$DEST" && tar -cf results.tar --exclude=gpu_check.log --exclude=results.tar . \
     && find . -maxdepth 1 -type f ! -name gpu_check.log ! -name results.tar -delete)
fi

log ""
log "== summary (${SECONDS}s in all)"
for line in "${SUMMARY[@]}"; do log "  $line"; done
# A kernel that failed its first-use check ran the eager composition instead: say so here, not
# only in the middle of the log (the JSONs hold it as meta.first_use_checks; tables.py warns).
fallbacks="$(grep -h "failed their first-use check" "$LOG" | sort -u)"
if [[ -n "$fallbacks" ]]; then
  log "  FALLBACK: the NaLa rows of these keys are not the Triton kernels' times:"
  while IFS= read -r line; do log "    ${line:0:300}"; done <<<"$fallbacks"
else
  log "  first-use checks: no fallback seen in the log"
fi
ls -la "$DEST" | tee -a "$LOG"
