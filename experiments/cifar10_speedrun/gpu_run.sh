#!/usr/bin/env bash
# The CIFAR-10 speedrun on one GPU (issue 54): 256 tokens, 2 x 2 x 3 seeds, FID-5K; then 1,024 tokens.
# Usage: experiments/cifar10_speedrun/gpu_run.sh <cifar10 folder with train/ and test/> [out]
set -euo pipefail
CIFAR=${1:?usage: gpu_run.sh <cifar10 folder with train/ and test/> [out]}
OUT=${2:-runs/cifar10_speedrun}
python experiments/cifar10_speedrun/run.py --cifar "$CIFAR" --out "$OUT/t256" --tokens 256 --time-limit-s 480
python experiments/cifar10_speedrun/run.py --cifar "$CIFAR" --out "$OUT/t1024" --tokens 1024 --steps 1000 --time-limit-s 480
