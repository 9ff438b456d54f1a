#!/usr/bin/env bash
# One-shot GPU check for NaLa: correctness of the Triton kernels on CUDA, then attention,
# whole-model and high-resolution benchmarks. About 9.5 minutes on one H200, bounded:
# every stage has its own time limit, a failing stage does not stop the others, and the
# summary at the end says which passed.
#
#   bash benchmarks/gpu_check.sh            # writes into $OUT if set, else runs/gpu_check/
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#   ONLY="model highres" bash benchmarks/gpu_check.sh   # only the stages whose names hold a word
#
# Needs python with torch (CUDA), triton and pytest, plus this repo's dependencies
# (diffusers: nala_dit imports it). On a machine that cannot install packages, put wheels
# into .gpu_wheels/ beforehand (git ignores it: copy it along) and they are installed into a
# temporary folder first. For the H200 image of 2026-12 (Python 3.12, torch 2.11, no diffusers)
# these two were enough:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .gpu_wheels diffusers==0.42.1 importlib_metadata
#
# Output (8 files; a device run returns at most 8):
#   gpu_check.log                     everything printed, with the stage summary at the end
#   attention_cuda_s.json             NaLa (Triton, unchunked, compile) vs ReLU-LA vs SDPA
#                                     (default, flash, cuDNN), DiT-S heads (6 x 64), bf16,
#                                     N = 1K..64K, fwd and fwd+bwd, time and peak memory
#   attention_cuda_xl.json            the same for DiT-XL heads (16 x 72), without compile
#   model_cuda.json                   DiT vs NaLaDiT S/2 and XL/2, training step and
#                                     sampling forward at 256/512/1024 px, bf16, batch 8
#   highres_cuda.json                 one image at 256..4096 px (256..65K tokens), S/2 and
#                                     XL/2: sampling forward (NaLa, SDPA, math backend),
#                                     training peak with/without gradient checkpointing at
#                                     1K/4K/16K tokens, SD-VAE decode tiled vs untiled, bf16
#   triton_configs.json               block-size sweep of the kernels (fwd+bwd)
#   context_parallel_cuda.json        NaLaDiT-S/2, one image over P = 2 GPUs (NCCL) against
#                                     one, 4K/16K tokens, fwd and training step, fp32; with one
#                                     GPU the P = 1 numbers only
#   plots.tar                         the PNG plot written beside each JSON above
# One H200 run's files are committed in benchmarks/results/ (tables: benchmarks/results/RESULTS.md).

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
TOTAL_LIMIT=560          # seconds for all stages together (a 600 s device call minus set-up and margin)
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

# (a) Correctness on CUDA: every interpreter case compiled for the GPU (fp32, ≤ 1e-5
# against the quadratic reference), bf16/fp16 inputs, N = 8192 with many token ranges,
# the gated layer under bf16 autocast. Workers in parallel when pytest-xdist is there
# (each kernel variant compiles once per process).
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 6)
stage "tests (CUDA, fp32 + bf16/fp16)" 120 \
  "$PY" -m pytest -q -p no:cacheprovider -rs "${XDIST[@]}" tests/attention/triton_cases.py

# (b) Attention: DiT-S heads with torch.compile, then DiT-XL heads.
stage "attention S heads" 100 \
  "$PY" benchmarks/attention.py --device cuda --dtype bf16 --compile --min-tokens 1024 --step 2 \
  --max-tokens 65536 --heads 6 --head-dim 64 --repeats 5 --time-cap 2 --math-cap-gib 4 \
  --budget-s 65 --out "$DEST/attention_cuda_s.json"
stage "attention XL heads" 70 \
  "$PY" benchmarks/attention.py --device cuda --dtype bf16 --min-tokens 1024 --step 2 \
  --max-tokens 65536 --heads 16 --head-dim 72 --repeats 5 --time-cap 2 --math-cap-gib 4 \
  --budget-s 40 --out "$DEST/attention_cuda_xl.json"

# (c) Whole models, bf16 weights and inputs.
stage "model S/2 + XL/2" 100 \
  "$PY" benchmarks/model.py --device cuda --dtype bf16 --sizes S/2,XL/2 --resolutions 256,512,1024 \
  --batch 8 --repeats 5 --time-cap 5 --budget-s 65 --out "$DEST/model_cuda.json"

# (d) Block sizes of the kernels (results for retuning launch_config).
stage "triton block-size sweep" 40 \
  "$PY" benchmarks/triton_configs.py --budget-s 25 --out "$DEST/triton_configs.json"

# (e) One high-resolution image, batch 1, bf16: the transformer and the VAE decode apart.
# The math backend runs while one N x N score tensor fits 50 GiB: S/2 (6 heads) up to 65K
# tokens (48 GiB each, scores and softmax: ~96 GiB), XL/2 (16 heads) up to 16K. A cell
# predicted over 10 s, or out of memory, is skipped with the reason; sections in order
# of interest, no new cell after 90 s.
stage "highres S/2 + XL/2" 100 \
  "$PY" benchmarks/highres.py --device cuda --dtype bf16 --sizes S/2,XL/2 --sections sample,vae,train \
  --math-cap-gib 50 --vae-real-max-px 4096 --repeats 3 --time-cap 10 --single-call-s 2 --budget-s 75 \
  --out "$DEST/highres_cuda.json"

# (f) Context parallel: one image's rows over P = 2 GPUs (NCCL) against one GPU; the NaLa
# state all-reduce and the LePE halo on a real interconnect (docs/highres.md).
stage "context parallel P = 1 / 2" 45 \
  "$PY" benchmarks/context_parallel.py --device cuda --tokens 4096,16384 --repeats 3 \
  --out "$DEST/context_parallel_cuda.json"

# A device run returns at most 8 files: the plots travel as one archive.
(cd "$DEST" && ls ./*.png >/dev/null 2>&1 && tar -cf plots.tar ./*.png && rm -f ./*.png)

log ""
log "== summary (${SECONDS}s in all)"
for line in "${SUMMARY[@]}"; do log "  $line"; done
ls -la "$DEST" | tee -a "$LOG"
