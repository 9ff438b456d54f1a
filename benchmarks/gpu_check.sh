#!/usr/bin/env bash
# One-shot GPU check: what an H100 or H200 spends on NaLa and on DiT at the batches people
# train at, decided in one device call (at most 600 s, the machine's start outside it). Every
# stage has its own time limit (the planned ones sum to at most 480 s, held by
# tests/benchmarks/test_gpu_stages.py), a failing stage does not stop the others, and the
# summary at the end gives NaLaDiT / DiT per cell, the model-level A/B and every first-use
# check. Then `python benchmarks/tables.py --results DIR` writes the tables of
# docs/performance.md from the JSON files.
#
#   bash benchmarks/gpu_wheels.sh           # once, on a machine with PyPI: .gpu_wheels/ (6 MiB)
#   bash benchmarks/gpu_check.sh            # writes into $OUT if set, else runs/gpu_check/<UTC time>/
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#   ONLY="kernels profile" bash benchmarks/gpu_check.sh   # only the stages whose names hold a word
#   ONLY=tests bash benchmarks/gpu_check.sh  # outside the plan: the CUDA correctness cases;
#                                            # likewise ONLY=highres, ONLY=context, ONLY=block
#
# Needs python with torch (CUDA) and triton, plus this repo's dependencies. The GPU machines'
# image (Python 3.12, torch 2.11, Triton 3.6) lacks diffusers and torch-fidelity: carry
# .gpu_wheels/ (git ignores it) and they are installed into a temporary folder first. The
# output folder must be empty or new: nothing in it is overwritten, moved or deleted.
#
# Stages, in order (bf16; each writes its JSON as it goes, so a stage stopped at its limit
# keeps what it measured):
#   imports            every module the later stages import; a missing one is named with the
#                      wheel script's line, and the model stages are then not run
#   warm-up            warmup.json: every Triton specialisation the timed stages launch,
#                      compiled once (Triton's disk cache) with its first-use check
#   launch cost        launch.json: host µs per launched op, ops and GPU kernels of one gated
#                      layer / block / XL/2 model, forward and forward + backward
#   kernels fused      kernels_fused.json: one attention call at six (B, H, N, D), NaLa Triton
#                      vs SDPA cuDNN / flash, fwd and fwd+bwd, fraction of the GPU's roofline
#   kernels baseline   kernels_baseline.json: NaLa alone with NALA_TRITON_VARIANT=baseline
#   profile            profile.json: top GPU kernels of one gated layer and one XL/2 block
#   model sweep        model_sweep.json: eager DiT (cuDNN, flash) vs NaLaDiT: XL/2 at the
#                      targets' cells (256 px b32, 512 px b16, 1024 px b4), then 256 px b8 /
#                      b128 and S/2 at 256 px b8 / b128; train + sample
#   model ab baseline  model_ab_baseline.json: NaLaDiT-XL/2, 256 px, b32, train, eager, on
#                      the old kernels (its new-kernel row is the sweep's)
#   model ab unfused   model_ab_unfused.json: the same cell with the gated layers unfused
#   model compiled     model_compiled.json: torch.compile (DiT on cuDNN, NaLaDiT) at XL/2,
#                      256 px, b32 (a cold compile takes 40-100 s: last but one)
#   cuda graphs        graphs.json: sampling under mode="reduce-overhead", XL/2 at 256 px b32
# and gpu_check.log (everything printed, the summary at the end). A device run returns at
# most 8 files: past that, the files this run wrote (not the log) are packed into results.tar.

set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEST="${OUT:-$ROOT/runs/gpu_check/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$DEST"
if [[ -n "$(ls -A "$DEST")" ]]; then   # a folder of the user's, or an earlier run: never overwritten
  echo "gpu_check.sh: output folder $DEST is not empty; point OUT at an empty or new folder (nothing in it was touched)" >&2
  exit 2
fi
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
if ! "$PY" -c "import diffusers, torch_fidelity" 2>/dev/null && ls .gpu_wheels/*.whl >/dev/null 2>&1; then
  DEPS="$(mktemp -d)"
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$DEPS" .gpu_wheels/*.whl 2>&1 | tee -a "$LOG"
  export PYTHONPATH="$PYTHONPATH:$DEPS"
fi

# 0. Imports: each module a later stage needs, versions printed; a missing one named with its fix.
MODELS_OK=1
stage "imports" 15 "$PY" benchmarks/gpu_imports.py
[[ "${SUMMARY[-1]}" == "imports: FAILED"* || "${SUMMARY[-1]}" == "imports: TIME LIMIT"* ]] && MODELS_OK=0
# model_stage: a stage that imports the models (diffusers); not run where the imports failed.
model_stage() {
  ((MODELS_OK)) || { SUMMARY+=("$1: not run (the imports stage failed: see its lines)"); return; }
  stage "$@"
}

# 1. Compile every Triton specialisation once, outside the timed stages.
stage "warm-up" 50 "$PY" benchmarks/warmup.py --device cuda --dtype bf16 --out "$DEST/warmup.json"

# 2. The host's cost per launched op, and what a layer, a block and a model launch.
model_stage "launch cost" 30 \
  "$PY" benchmarks/launch.py --device cuda --dtype bf16 --size XL/2 --resolution 256 --batch 8 \
  --out "$DEST/launch.json"

# 3. Kernel GPU time, new kernels then the old ones (A/B per kernel).
stage "kernels fused" 45 \
  "$PY" benchmarks/kernels.py --device cuda --dtype bf16 --budget-s 38 --out "$DEST/kernels_fused.json"
stage "kernels baseline" 30 \
  env NALA_TRITON_VARIANT=baseline "$PY" benchmarks/kernels.py --device cuda --dtype bf16 --methods nala \
  --budget-s 24 --out "$DEST/kernels_baseline.json"

# 4. Per-kernel profile of one gated layer and one block (XL/2, 256 px, batch 32).
model_stage "profile" 30 \
  "$PY" benchmarks/kernel_profile.py --device cuda --dtype bf16 --size XL/2 --resolution 256 --batch 32 \
  --out "$DEST/profile.json"

# 5. Whole models, eager, the targets' cells first (train at 256 / 512 / 1024 px, batch 32 / 16 / 4).
model_stage "model sweep" 125 \
  "$PY" benchmarks/sweep.py --device cuda --dtype bf16 --modes eager --repeats 5 --cell-cap-s 40 --budget-s 110 \
  --cells XL/2:256:32,XL/2:512:16,XL/2:1024:4,XL/2:256:8,XL/2:256:128,S/2:256:8,S/2:256:128 \
  --out "$DEST/model_sweep.json"

# 6. The model-level A/B at XL/2, 256 px, batch 32: the old kernels, then the unfused gated layer.
AB=(--device cuda --dtype bf16 --modes eager --tasks train --families NaLaDiT --repeats 5 --cells XL/2:256:32)
model_stage "model ab baseline" 20 \
  env NALA_TRITON_VARIANT=baseline "$PY" benchmarks/sweep.py "${AB[@]}" --out "$DEST/model_ab_baseline.json"
model_stage "model ab unfused" 20 \
  "$PY" benchmarks/sweep.py "${AB[@]}" --gated-layer unfused --out "$DEST/model_ab_unfused.json"

# 7. Compiled models (a cold inductor compile of XL/2 takes tens of seconds), then CUDA graphs.
model_stage "model compiled" 75 \
  "$PY" benchmarks/sweep.py --device cuda --dtype bf16 --modes default --repeats 5 --cells XL/2:256:32 \
  --compile-cells XL/2:256:32 --cell-cap-s 70 --out "$DEST/model_compiled.json"
model_stage "cuda graphs" 40 \
  "$PY" benchmarks/sweep.py --device cuda --dtype bf16 --modes reduce-overhead --tasks sample \
  --cells XL/2:256:32 --compile-cells all --repeats 10 --cell-cap-s 35 --out "$DEST/graphs.json"

# Outside the plan (not in the 480 s): stages that run only when ONLY names them.
extra_stage "block sweep d72" 40 \
  "$PY" benchmarks/triton_configs.py --head-dims 72 --budget-s 30 --out "$DEST/triton_configs_d72.json"
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

log ""
log "== summary (${SECONDS}s in all)"
for line in "${SUMMARY[@]}"; do log "  $line"; done
"$PY" benchmarks/gpu_summary.py "$DEST" 2>&1 | tee -a "$LOG"
# A kernel that failed its first-use check ran the eager composition instead: say so here, not
# only in the middle of the log (the JSONs hold it as meta.first_use_checks; tables.py warns).
fallbacks="$(grep -h "failed their first-use check" "$LOG" | sort -u)"
if [[ -n "$fallbacks" ]]; then
  log "  FALLBACK: the NaLa rows of these keys are not the Triton kernels' times:"
  while IFS= read -r line; do log "    ${line:0:300}"; done <<<"$fallbacks"
else
  log "  first-use checks: no fallback seen in the log"
fi
# A device run returns at most 8 files: past that, the files this run wrote (the folder was empty
# at the start) go into one archive, the log and the archive left beside it.
if (($(ls -1 "$DEST" | wc -l) > 8)); then
  (cd "$DEST" && mapfile -t made < <(ls -1 | grep -v -x -e gpu_check.log -e results.tar) \
     && tar -cf results.tar "${made[@]}" && rm -f -- "${made[@]}")
fi
ls -la "$DEST" | tee -a "$LOG"
