#!/usr/bin/env bash
# GPU start-up, cold then warm, in one call (issue 19): seconds per phase for an 8B model.
# From the repository root on a fresh GPU machine:  bash benchmarks/startup_device.sh OUT [STAGES]
# STAGES: comma list of cold, warm, prebuild, serial, triton (default cold,warm; the others are a
# second call: `prebuild` runs `phloem prebuild-kernels` into empty caches, then a start; `serial`
# builds the FlashInfer modules one after another, then all at once, to show what building at once
# saves; `triton` (e.g. `cold,triton`) starts with phloem's Triton prebuild off, then on, each with
# an empty Triton cache, and checks that no phloem kernel compiled in the main process with it). Cold means cold: the FlashInfer AOT
# modules that device_setup.sh restores from .fiaot are removed, and every compile cache is new.
set -u
OUT=${1:?usage: bash benchmarks/startup_device.sh OUT [STAGES]}
STAGES=${2:-cold,warm}
mkdir -p "$OUT"
source benchmarks/device_setup.sh || exit 1
rm -rf /tmp/site/flashinfer/data/aot
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 benchmarks/startup_gpu.py --stages "$STAGES" --json "$OUT/startup.json" \
    2> "$OUT/startup.log" | tee "$OUT/summary.txt"
tail -n 5 "$OUT/startup.log"
