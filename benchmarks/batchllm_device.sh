#!/usr/bin/env bash
# BatchLLM-scale benches on the GPU machine in one call (<= 10 minutes), from the repo root:
#   RUNS="400:auto 400:auto:--block-size,32 shared-prefix:auto" TESTS=1 bash benchmarks/batchllm_device.sh OUT_DIR
# Each run is WORKLOAD:BACKEND[:EXTRA_ARGS]: WORKLOAD is a number of groups of the `batchllm`
# workload (degree 16, 2000/200/100) or another workload's name (`shared-prefix`, ...); EXTRA_ARGS
# are more `bench throughput` flags with commas for spaces. All on Llama-3.1-8B shapes with random
# weights and per-step host/device timing (--trace-steps). PROFILE_WINDOW=START:COUNT profiles
# those steps of each run (torch.profiler tables next to the JSON). TESTS=1 first runs the GPU
# tests (TEST_PATHS, default: the GPU, kernel and layer tests) into OUT_DIR/gpu-tests.txt.
# PACK=1 ends by packing OUT_DIR into OUT_DIR.tgz (and removing it): the device tool returns at
# most 8 files per call, so more runs than that lose their JSON files otherwise.
# Needs the carried .whl/ and .fiaot/ (see device_setup.sh).
set -uo pipefail
OUT=${1:-/tmp/phloem_out}
RUNS=${RUNS:-"400:auto"}
ENGINE_ARGS=${ENGINE_ARGS:-"--max-num-seqs 2048 --max-num-batched-tokens 8192"}
LIMIT=${LIMIT:-280}
TEST_PATHS=${TEST_PATHS:-"tests/gpu tests/ops tests/layers"}
source benchmarks/device_setup.sh || exit 1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${TESTS:-0}" = 1 ]; then
    echo "=== tests $(date +%T)"
    # shellcheck disable=SC2086
    timeout 260 python3 -m pytest -q -p no:cacheprovider $TEST_PATHS 2>&1 \
        | tee "$OUT/gpu-tests.txt" | tail -5
fi
for run in $RUNS; do
    IFS=: read -r workload backend extra <<<"$run"
    extra=${extra//,/ }
    if [[ $workload =~ ^[0-9]+$ ]]; then
        name="batchllm-g$workload-$backend" wargs="--workload batchllm --num-groups $workload"
    else
        name="$workload-$backend" wargs="--workload $workload"
    fi
    name="$name${extra:+-$(echo "$extra" | tr -c 'a-z0-9\n' '-' | tr -s '-' | sed 's/^-//')}"
    echo "=== $name $(date +%T)"
    window=${PROFILE_WINDOW:+--profile-window $PROFILE_WINDOW --profile $OUT/$name-window.txt}
    # shellcheck disable=SC2086
    timeout "$LIMIT" python3 -m phloem.entrypoints.bench throughput --model llama-3.1-8b \
        $wargs --attention-backend "$backend" --trace-steps \
        $ENGINE_ARGS $extra $window --json "$OUT/$name.json" 2>&1 | grep -v -i warn | tail -10
done
echo "=== done $(date +%T)"
if [ "${PACK:-0}" = 1 ]; then
    tar -czf "$OUT.tgz" -C "$OUT" . && rm -r "$OUT" && echo "packed $OUT.tgz"
fi
