#!/usr/bin/env bash
# The whole GPU check-and-bench in one run (<= 10 minutes), from the repository root:
#   STAGES="build tests latency prefill decode" benchmarks/device_check.sh OUT_DIR
# Stages: build (FlashInfer modules), tests (tests/gpu), and one bench per workload
# (latency, prefill, decode, shared, batchllm); bench JSON and profiles land in OUT_DIR/results.tgz.
# Needs the carried .whl/ (and .fiaot/ when modules were built before): see device_setup.sh.
set -uo pipefail
OUT=${1:-/tmp/phloem_out}
STAGES=${STAGES:-"build tests latency prefill decode"}
MODEL=${MODEL:-llama-3.1-8b}
COMPARE=${COMPARE:-"--compare transformers"}
ENGINE_ARGS=${ENGINE_ARGS:-}  # e.g. "--max-num-batched-tokens 8192"
RES=/tmp/phloem_results
mkdir -p "$RES/results"
source benchmarks/device_setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, flashinfer, transformers; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
bench() {  # bench NAME TIMEOUT ARGS...
    local name=$1 limit=$2; shift 2
    echo "=== bench $name ($(date +%T))"
    timeout "$limit" python3 -m phloem.entrypoints.bench throughput --model "$MODEL" \
        --json "$RES/results/$name.json" --profile "$RES/results/$name-profile.txt" $ENGINE_ARGS "$@"
    echo "=== bench $name rc=$? ($(date +%T))"
    tar -czf "$OUT/results.tgz" -C "$RES" results  # after each bench: a timeout keeps the rest
}
for stage in $STAGES; do
    case $stage in
    build) echo "=== build ($(date +%T))"; timeout 400 python3 benchmarks/flashinfer_prebuild.py 128 64
           fi_pack_modules "$OUT" ;;
    tests) echo "=== tests ($(date +%T))"
           timeout 300 python3 -m pytest -q -x -s -p no:cacheprovider tests/gpu 2>&1 | tail -40 ;;
    latency) bench latency 150 --workload latency $COMPARE ;;
    latency-eager) bench latency-eager 150 --workload latency --enforce-eager ;;
    prefill) bench prefill-heavy 240 --workload prefill-heavy --num-requests ${PREFILL_N:-200} ${PREFILL_COMPARE:-} ;;
    prefill-peer) bench prefill-heavy-peer 240 --workload prefill-heavy --num-requests ${PREFILL_PEER_N:-32} $COMPARE ;;
    decode) bench decode-heavy 300 --workload decode-heavy --num-requests ${DECODE_N:-200} ${DECODE_COMPARE:-} ;;
    shared) bench shared-prefix 240 --workload shared-prefix --num-groups ${SHARED_G:-8} ;;
    batchllm) bench batchllm 240 --workload batchllm --num-groups ${BATCHLLM_G:-16} ;;
    esac
done
echo "=== done ($(date +%T))"
for f in "$OUT"/*.tgz; do ls -la "$f"; done
