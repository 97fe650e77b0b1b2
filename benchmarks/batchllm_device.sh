#!/usr/bin/env bash
# BatchLLM-scale benches on the GPU machine in one call (<= 10 minutes), from the repo root:
#   RUNS="400:shared_prefix 400:flashinfer" TESTS=1 bash benchmarks/batchllm_device.sh OUT_DIR
# PROFILE_WINDOW=START:COUNT profiles those steps of each run (torch.profiler tables next to
# the JSON). Each run is GROUPS:BACKEND[:EXTRA_ARGS] of the `batchllm` workload (degree 16, 2000/200/100)
# on Llama-3.1-8B shapes with random weights, with per-step host/device timing (--trace-steps).
# Needs the carried .whl/ and .fiaot/ (see device_setup.sh).
set -uo pipefail
OUT=${1:-/tmp/phloem_out}
RUNS=${RUNS:-"400:shared_prefix"}
ENGINE_ARGS=${ENGINE_ARGS:-"--max-num-seqs 1024 --max-num-batched-tokens 8192"}
LIMIT=${LIMIT:-280}
source benchmarks/device_setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${TESTS:-0}" = 1 ]; then
    echo "=== tests $(date +%T)"
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/ops/test_shared_prefix.py 2>&1 \
        | tee "$OUT/gpu-tests.txt" | tail -5
fi
for run in $RUNS; do
    IFS=: read -r groups backend extra <<<"$run"
    name="batchllm-g$groups-$backend${extra:+-$(echo "$extra" | tr -c 'a-z0-9\n' '-' | tr -s '-')}"
    echo "=== $name $(date +%T)"
    window=${PROFILE_WINDOW:+--profile-window $PROFILE_WINDOW --profile $OUT/$name-window.txt}
    timeout "$LIMIT" python3 -m phloem.entrypoints.bench throughput --model llama-3.1-8b \
        --workload batchllm --num-groups "$groups" --attention-backend "$backend" --trace-steps \
        $ENGINE_ARGS $extra $window --json "$OUT/$name.json" 2>&1 | grep -v -i warn | tail -9
done
echo "=== done $(date +%T)"
