#!/usr/bin/env bash
# The CIFAR-10 speedrun on one GPU (issue 54): 256 tokens, 2 x 2 x 3 seeds, FID-5K, within 8 minutes
# (--time-limit-s 480: no stage starts after it, a variant's training is capped at 75 s and never runs
# past it; run the same command again to resume). Then the 1,024-token run, its own 8 minutes.
# Usage: experiments/cifar10_speedrun/gpu_run.sh <cifar10 folder with train/ and test/> [out] [--compile]
set -euo pipefail
CIFAR=${1:?usage: gpu_run.sh <cifar10 folder with train/ and test/> [out] [--compile]}
OUT=${2:-runs/cifar10_speedrun}
EXTRA=("${@:3}")
python experiments/cifar10_speedrun/run.py --cifar "$CIFAR" --out "$OUT/t256" --tokens 256 --time-limit-s 480 "${EXTRA[@]}"
python experiments/cifar10_speedrun/run.py --cifar "$CIFAR" --out "$OUT/t1024" --tokens 1024 --time-limit-s 480 "${EXTRA[@]}"
