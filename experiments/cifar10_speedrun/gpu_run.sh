#!/usr/bin/env bash
# The CIFAR-10 speedrun as one call on a GPU machine that fetches nothing: unpack the CIFAR-10
# archive it is handed, install the wheels it needs from .gpu_wheels/ (as benchmarks/gpu_check.sh),
# run the 256-token 2 x 2 x 3 seeds (run.py --time-limit-s 420: no stage starts after it; 480 at 1,024), and
# leave five files in $OUT: summary.json, data_fid.json, table.md, cells.tar.gz (the cell JSONs
# and settings.json) and speedrun.log. The 1,024-token run is its own call: TOKENS=1024.
#
#   OUT=/path/to/results bash experiments/cifar10_speedrun/gpu_run.sh
#
# What it reads (README.md, "One GPU call", says how to put them there: an ignored folder that
# the call carries):
#   CIFAR_ARCHIVE  cifar10_jpg.tar.gz   (default experiments/cifar10_speedrun/carry/cifar10_jpg.tar.gz)
#   INCEPTION      the FID network      (default experiments/cifar10_speedrun/carry/inception_int8.safetensors)
#   TOKENS         256 (default) or 1024
#   TIME_LIMIT     run.py's --time-limit-s (default 420; 480 at 1,024 tokens)
#   WORK           the run folder, resumable (default runs/cifar10_speedrun/t$TOKENS)
#   PYTHON         the interpreter (default python3)
#   SMOKE=1        run.py --smoke (the CPU test of this script); RUN_ARGS: more run.py flags
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
HERE=experiments/cifar10_speedrun
: "${OUT:?set OUT to the folder the results go to}"
TOKENS=${TOKENS:-256}
CIFAR_ARCHIVE=${CIFAR_ARCHIVE:-$HERE/carry/cifar10_jpg.tar.gz}
INCEPTION=${INCEPTION:-$HERE/carry/inception_int8.safetensors}
WORK=${WORK:-$ROOT/runs/cifar10_speedrun/t$TOKENS}
PY=${PYTHON:-python3}
TIME_LIMIT=${TIME_LIMIT:-$([[ "$TOKENS" == 1024 ]] && echo 480 || echo 420)}   # run.py: no stage starts after it
CALL_LIMIT=${CALL_LIMIT:-560}   # seconds for run.py: the stages and the last one's overrun, under a 600 s call
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
fail() { echo "error: $*" >&2; exit 2; }

mkdir -p "$OUT" || fail "cannot create OUT=$OUT"
for name in speedrun.log summary.json data_fid.json table.md cells.tar.gz; do
  [[ -e "$OUT/$name" ]] && fail "$OUT/$name exists; not overwriting it: set OUT to a new or empty folder"
done
LOG="$OUT/speedrun.log"
log() { echo "$@" | tee -a "$LOG"; }
log "== cifar10 speedrun $(date -u +%FT%TZ): $TOKENS tokens, results in $OUT, run folder $WORK"
[[ -f "$CIFAR_ARCHIVE" ]] || fail "no CIFAR-10 archive at $CIFAR_ARCHIVE: copy cifar10_jpg.tar.gz there (README.md, One GPU call) or set CIFAR_ARCHIVE"
[[ -f "$INCEPTION" ]] || fail "no FID network at $INCEPTION: python3 $HERE/carried_inception.py make --out $INCEPTION (README.md, One GPU call) or set INCEPTION"

# Wheels: only what the image lacks (diffusers, torch-fidelity), from .gpu_wheels/, into a temporary folder.
if "$PY" -c "import diffusers, torch_fidelity" 2>/dev/null; then
  log "wheels: not needed (diffusers and torch_fidelity import)"
elif ls .gpu_wheels/*.whl >/dev/null 2>&1; then
  DEPS="$(mktemp -d)"
  "$PY" -m pip install --quiet --no-index --no-deps --target "$DEPS" .gpu_wheels/*.whl 2>&1 | tee -a "$LOG"
  export PYTHONPATH="$PYTHONPATH:$DEPS"
  "$PY" -c "import diffusers, torch_fidelity" 2>&1 | tee -a "$LOG"
  log "wheels: installed $(ls .gpu_wheels/*.whl | wc -l) from .gpu_wheels/ into $DEPS"
else
  fail "diffusers or torch_fidelity missing and no wheels in .gpu_wheels/ (README.md, One GPU call)"
fi

# The data: unpacked once beside the run folder (into a temporary folder, renamed when complete).
DATA="$(dirname "$WORK")/data"
if [[ ! -d "$DATA/cifar10/train" || ! -d "$DATA/cifar10/test" ]]; then
  [[ -e "$DATA/cifar10" ]] && fail "$DATA/cifar10 exists without train/ and test/: move it away"
  mkdir -p "$DATA" && TMP="$(mktemp -d "$DATA/.unpack-XXXXXX")" || fail "cannot create $DATA"
  start=$SECONDS
  tar -xzf "$CIFAR_ARCHIVE" -C "$TMP" 2>&1 | tee -a "$LOG"
  [[ -d "$TMP/cifar10/train" && -d "$TMP/cifar10/test" ]] || fail "$CIFAR_ARCHIVE holds no cifar10/train and cifar10/test"
  mv "$TMP/cifar10" "$DATA/cifar10" && rmdir "$TMP"
  log "data: unpacked $CIFAR_ARCHIVE into $DATA/cifar10 in $((SECONDS - start)) s"
fi

ARGS=(--cifar "$DATA/cifar10" --out "$WORK" --tokens "$TOKENS" --inception-weights "$INCEPTION" --time-limit-s "$TIME_LIMIT")
[[ "${SMOKE:-0}" == 1 ]] && ARGS+=(--smoke)
read -r -a MORE <<<"${RUN_ARGS:-}"
log "== $PY $HERE/run.py ${ARGS[*]} ${MORE[*]}"
timeout --signal=INT --kill-after=15 "$CALL_LIMIT" "$PY" "$HERE/run.py" "${ARGS[@]}" "${MORE[@]}" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
log "== run.py exit status $rc after ${SECONDS} s"

# Back: the run's files that exist, the cells packed into one archive (a device call returns at most 8 files).
for name in summary.json data_fid.json table.md; do
  [[ -f "$WORK/$name" ]] && cp "$WORK/$name" "$OUT/$name"
done
[[ -d "$WORK/cells" ]] && tar -czf "$OUT/cells.tar.gz" -C "$WORK" cells settings.json
log "== in $OUT:"
ls -la "$OUT" | tee -a "$LOG"
exit "$rc"
