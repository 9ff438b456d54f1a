#!/usr/bin/env bash
# Build .gpu_wheels/ on a machine that reaches PyPI, for a GPU machine that reaches nothing:
# the packages nala_dit imports that the GPU machines' image lacks, as wheels for its Python.
# benchmarks/gpu_check.sh (and experiments/cifar10_speedrun/gpu_run.sh) install them into a
# temporary folder before their first stage; the folder travels with the working tree (git
# ignores it), so it must stay small: the device tool carries at most 64 MiB in all.
#
#   bash benchmarks/gpu_wheels.sh            # download into .gpu_wheels/ (kept files are reused)
#   bash benchmarks/gpu_wheels.sh --list     # print what it would fetch, fetch nothing
#
# The image (torch 2.11, Triton 3.6, Python 3.12; accelerate, safetensors, torchvision, scipy,
# transformers, huggingface-hub, numpy, pillow, regex, requests, filelock, zipp, tqdm, pyyaml
# among what it holds) lacks diffusers, torch-fidelity and diffusers' importlib_metadata (with
# its lazy-importer). The versions are this repository's pins (pyproject.toml) and what the
# pinned diffusers installs here. Nothing is deleted: a wheel already in the folder is kept.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${GPU_WHEELS:-$ROOT/.gpu_wheels}"
PY="${PYTHON:-python3}"
TARGET_PYTHON=3.12
LIMIT_MIB=32            # leaves half of the 64 MiB a call carries for the tree itself
WHEELS=(
  diffusers==0.42.1
  torch-fidelity==0.4.0
  importlib_metadata==10.2.0
  lazy-importer==0.1.0
)

if [[ "${1:-}" == "--list" ]]; then
  printf '%s\n' "${WHEELS[@]}"
  exit 0
elif [[ $# -gt 0 ]]; then
  echo "gpu_wheels.sh: unknown argument '$1' (use --list, or no argument to download)" >&2
  exit 2
fi

mkdir -p "$DEST"
# --no-deps: the image has every other dependency; pure-Python wheels (py3-none-any) fit any platform
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$TARGET_PYTHON" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${WHEELS[@]}"
size_kib=$(du -sk "$DEST" | cut -f1)
echo "wheels for Python $TARGET_PYTHON in $DEST: $((size_kib / 1024)) MiB"
ls -1 "$DEST"
if ((size_kib > LIMIT_MIB * 1024)); then
  echo "gpu_wheels.sh: $DEST holds $((size_kib / 1024)) MiB, over the $LIMIT_MIB MiB this plan leaves for wheels: " \
       "move the extra wheels out of it (the device tool carries at most 64 MiB a call)" >&2
  exit 1
fi
