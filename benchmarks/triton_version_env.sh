#!/usr/bin/env bash
# A throwaway Triton of another version beside the venv's, for the compile report: the GPU
# machines (and gpu_check.sh) run Triton 3.6, the venv has a newer one, and what Triton
# generates differs between them (registers, spills; benchmarks/README.md). It downloads
# that version's wheel for the Python that will run it (no dependencies: torch stays the
# venv's) and installs it into FOLDER/site, which PYTHONPATH then puts before the venv:
#
#   bash benchmarks/triton_version_env.sh                       # Triton 3.6.0 in runs/triton-3.6.0/
#   bash benchmarks/triton_version_env.sh 3.6.0 /tmp/triton36   # a version, a folder
#   PYTHONPATH=runs/triton-3.6.0/site .venv/bin/python benchmarks/triton_compile_check.py \
#       --launches 384/6,1152/16 --dtypes bf16,fp16 --out runs/launches_triton36.json
#
# FOLDER (default runs/triton-VERSION, git-ignored) must be new, empty, or one this script
# made for the same version (then its wheel and install are reused). Nothing is deleted:
# a failed run leaves what it wrote (the wheel in FOLDER/wheel, pip's log) for the next.
# Offline (no PyPI, no cached wheel), it stops with one line naming the wheel it needs.
# PYTHON picks the interpreter (default: the repository's .venv, else python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:-3.6.0}"
DIR="${2:-$ROOT/runs/triton-$VERSION}"
if [[ $# -gt 2 || ! "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "triton_version_env.sh: usage: triton_version_env.sh [VERSION such as 3.6.0] [FOLDER]" >&2
  exit 2
fi
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
TAG="$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
WHEEL="triton-$VERSION-$TAG-$TAG-manylinux*_$(uname -m).whl"
MARK="$DIR/.triton_version_env"           # what this script made the folder for

if [[ -e "$DIR" && ! -d "$DIR" ]]; then
  echo "triton_version_env.sh: $DIR is a file, not a folder" >&2
  exit 1
fi
if [[ -d "$DIR" && -n "$(ls -A "$DIR")" && "$(cat "$MARK" 2>/dev/null)" != "triton==$VERSION $TAG" ]]; then
  echo "triton_version_env.sh: $DIR holds files this script did not put there for triton==$VERSION ($TAG): name a new or empty folder" >&2
  exit 1
fi
mkdir -p "$DIR/wheel"
echo "triton==$VERSION $TAG" > "$MARK"

# shellcheck disable=SC2086  # $WHEEL is a glob on purpose
if ! compgen -G "$DIR/wheel/$WHEEL" > /dev/null; then
  if ! "$PYTHON" -m pip download --no-deps --only-binary=:all: -d "$DIR/wheel" "triton==$VERSION" \
       > "$DIR/pip.log" 2>&1 || ! compgen -G "$DIR/wheel/$WHEEL" > /dev/null; then
    echo "triton_version_env.sh: could not download the wheel $WHEEL (triton==$VERSION) from PyPI: offline, or no such wheel for this Python (pip's output: $DIR/pip.log)" >&2
    exit 1
  fi
fi
if [[ ! -d "$DIR/site/triton" ]]; then
  "$PYTHON" -m pip install --quiet --no-deps --target "$DIR/site" "$(compgen -G "$DIR/wheel/$WHEEL" | head -n 1)" \
    >> "$DIR/pip.log" 2>&1 || { echo "triton_version_env.sh: pip could not install the wheel into $DIR/site (see $DIR/pip.log)" >&2; exit 1; }
fi
found="$(PYTHONPATH="$DIR/site" "$PYTHON" -c 'import triton; print(triton.__version__)')"
if [[ "$found" != "$VERSION" ]]; then
  echo "triton_version_env.sh: PYTHONPATH=$DIR/site imports Triton $found, not $VERSION" >&2
  exit 1
fi
echo "Triton $VERSION for $TAG in $DIR/site; run with: PYTHONPATH=$DIR/site $PYTHON ..."
