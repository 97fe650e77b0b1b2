#!/usr/bin/env bash
# The serving benchmark of issue 24 on a GPU machine, from the repository root: phloem's server
# and (when importable) vLLM's, each started at its defaults on random-weight Llama-3.1-8B
# (`--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9`, the shipped config
# and phloem's synthetic tokenizer written to one directory both load), the same client
# (`phloem bench serve`, streaming /v1/completions, token-id prompts, EOS ignored) against each:
#   - Poisson arrivals, 512-token prompts, 128 output tokens, at each rate of RATES for DURATION s;
#   - all at once, BURST_N x 512/128;
#   - the shared-prefix burst, SHARED_N x (1,024 shared + 256 own tokens), 128 out, all at once;
# then `phloem bench serve-summary OUT`: summary.json / summary.md (per run, ratios phloem/vLLM,
# goodput under TTFT p99 <= 300 ms and TPOT p99 <= 25 ms, and each phloem run's engine steps by
# kind from its step trace) and latency_throughput.png.
#
#   bash benchmarks/serving.sh OUT_DIR                          # everything (~25 min: 2 calls+)
#   ENGINES=phloem RATES="20 30" BURST=1 SHARED=1 bash benchmarks/serving.sh OUT_DIR
#   ENGINES=vllm   RATES="20 30" BURST=1 SHARED=1 bash benchmarks/serving.sh OUT_DIR
#   ENGINES="phloem vllm" RATES=" " bash benchmarks/serving.sh OUT_DIR   # the two bursts only
#
# Several phloem configurations back to back (one server start each), labelled phloem@NAME:
#   PHLOEM_CONFIGS="default:|seqs256:--max-num-seqs 256 --max-num-batched-tokens 4096|\
#   nopieces:--cuda-graph-mode decode|prefill512:--max-prefill-tokens-per-step 512" \
#   ENGINES=phloem RATES="30" DURATION=20 BURST=0 SHARED=1 bash benchmarks/serving.sh OUT_DIR
# PHLOEM_CONFIGS is "NAME:FLAGS" entries separated by "|" (FLAGS may be empty: the defaults); each
# server gets SERVER_ARGS PHLOEM_ARGS FLAGS, writes OUT/phloem@NAME-WORKLOAD.json, its log
# OUT/phloem@NAME-server.log and its step trace OUT/phloem@NAME-steps.jsonl, and serve-summary
# compares each configuration with vLLM on its own. Unset, phloem runs once, labelled "phloem".
# Time per phloem configuration, from the H200 runs of benchmarks/results/2026-11-26b-h200x2-
# serving: "ready and warm" 43 s when nothing compiles (FlashInfer modules from .fiaot, Triton
# cache warm: every configuration after the first on one machine), 245 s for the first start on
# a fresh machine (~110 s of it Triton compiling); --max-num-seqs 1024 captures 4x the CUDA
# graphs of 256 (5 s at 256: ~15 s more); each Poisson rate DURATION + ~3 s drain + ~4 s client
# start; burst-1000 ~25 s; shared-prefix-800 ~15 s; stop ~5 s. One 600 s call on a fresh
# machine thus holds three configurations with RATES="30" DURATION=20 BURST=0 SHARED=1 (~300 +
# 2 x ~90 s), but no vLLM beside them (its first start alone is 130 s): copy an earlier call's
# vllm-*.json into OUT_DIR first for the ratios. Each configuration prints "=== LABEL: done
# after N s".
#
# Settings (environment): ENGINES ("phloem vllm"), RATES ("10 20 30 40"), DURATION (30 s per
# rate), BURST (1: run the all-at-once burst), BURST_N (1000), SHARED (1), SHARED_N (800),
# WARMUP (32 requests after /health answers, not measured: a first start compiles and captures
# graphs), READY_S (900: how long a server may take to start; one that exits is not waited
# on), MODEL (llama-3.1-8b: a shipped config name, or a model directory with its tokenizer),
# SERVER_ARGS (the flags both servers
# get; default: dummy weights, 4,096 context, 0.9 of GPU memory), PORT (8000), VLLM_SITE
# (/tmp/vsite: vLLM's unpacked bundle, shared/tools/vllm_bundle.sh), PHLOEM_ARGS / VLLM_ARGS
# (more flags for one server), PHLOEM_CONFIGS (above), STEP_TRACE (1: phloem servers write a
# step trace, `phloem serve --step-trace`; 0: none). Each run's seed
# differs (its prompts never hit a cache left by another run) and is the same for both engines.
# Time per engine: start (1-3 min) + len(RATES) x (DURATION + ~10 s) + bursts (~1 min each): one
# engine with RATES="20 30", DURATION=30 and both bursts fits one 600 s device call.
# Runs that already have a JSON in OUT_DIR are skipped (a server whose runs all have one is not
# started), so a second call can add the other engine; its step trace then goes to a new file
# (ENGINE-steps-N.jsonl: serve-summary cuts each run from the latest trace started before it).
set -uo pipefail
OUT=${1:-/tmp/phloem_serving}
ENGINES=${ENGINES:-"phloem vllm"}
RATES=${RATES:-"10 20 30 40"}
DURATION=${DURATION:-30}
BURST=${BURST:-1}
BURST_N=${BURST_N:-1000}
SHARED=${SHARED:-1}
SHARED_N=${SHARED_N:-800}
WARMUP=${WARMUP:-32}
READY_S=${READY_S:-900}
MODEL=${MODEL:-llama-3.1-8b}
PORT=${PORT:-8000}
VLLM_SITE=${VLLM_SITE:-/tmp/vsite}
SERVER_ARGS=${SERVER_ARGS:-"--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9"}
PHLOEM_CONFIGS=${PHLOEM_CONFIGS:-}
STEP_TRACE=${STEP_TRACE:-1}
mkdir -p "$OUT"
if command -v nvidia-smi >/dev/null && ls .whl/*.whl >/dev/null 2>&1; then  # the GPU machine
    source benchmarks/device_setup.sh || exit 1
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
fi
PY=${PYTHON:-python3}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader \
    | tee "$OUT/device.txt"
if [ -f "$MODEL/config.json" ]; then  # a model directory (with a tokenizer) as it is
    MODEL_DIR=$MODEL MODEL=$(basename "$MODEL")
else
    MODEL_DIR=$OUT/model-$MODEL
    [ -f "$MODEL_DIR/config.json" ] || $PY -c "import sys; import phloem.model_configs as m; \
m.materialize(sys.argv[1], sys.argv[2])" "$MODEL" "$MODEL_DIR" || exit 1
fi
URL=http://127.0.0.1:$PORT
SERVER_PID=

bench() {  # bench LABEL WORKLOAD FLAGS...: one measured run into OUT/LABEL-WORKLOAD.json
    local label=$1 workload=$2; shift 2
    local json=$OUT/$label-$workload.json
    if [ -f "$json" ]; then echo "=== $label $workload: done already"; return; fi
    echo "=== $label $workload $(date +%T)"
    $PY -m phloem.entrypoints.cli bench serve --base-url "$URL" --model "$MODEL" \
        --engine "$label" --workload "$workload" --no-save-requests --json "$json" "$@" \
        | grep -E "Successful|Failed|Request throughput|Median TTFT|P99 TTFT|Median TPOT|P99 TPOT"
}

workloads() {  # the workload labels of one server's runs
    for rate in $RATES; do echo "poisson-$rate"; done
    [ "$BURST" = 1 ] && echo "burst-$BURST_N"
    [ "$SHARED" = 1 ] && echo "shared-prefix-$SHARED_N"
    return 0
}

pending() {  # pending LABEL: true when a run of LABEL has no JSON yet
    local w
    for w in $(workloads); do [ -f "$OUT/$1-$w.json" ] || return 0; done
    return 1
}

trace_path() {  # trace_path LABEL: OUT/LABEL-steps.jsonl, or -N.jsonl beside earlier traces
    local path=$OUT/$1-steps.jsonl n=2
    while [ -f "$path" ]; do path=$OUT/$1-steps-$n.jsonl; n=$((n + 1)); done
    echo "$path"
}

start_server() {  # start_server ENGINE LABEL [FLAGS]: in the background, log OUT/LABEL-server.log
    local engine=$1 label=$2 flags=${3:-} trace=
    local log=$OUT/$label-server.log
    # shellcheck disable=SC2086
    if [ "$engine" = phloem ]; then
        [ "$STEP_TRACE" = 1 ] && trace="--step-trace $(trace_path "$label")"
        $PY -m phloem.entrypoints.cli serve --model "$MODEL_DIR" --served-model-name "$MODEL" \
            --port "$PORT" $SERVER_ARGS ${PHLOEM_ARGS:-} $flags $trace >"$log" 2>&1 &
    else
        PYTHONPATH=$VLLM_SITE VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
            $PY -m vllm.entrypoints.cli.main serve "$MODEL_DIR" --served-model-name "$MODEL" \
            --port "$PORT" $SERVER_ARGS ${VLLM_ARGS:-} >"$log" 2>&1 &
    fi
    SERVER_PID=$!
}

stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 300); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
    SERVER_PID=
}
trap stop_server EXIT

warm_up() {  # wait for /health, then warm up (first requests compile kernels, capture graphs;
    # unmeasured); false as soon as the server has exited (a server that died at start-up, say
    # on a port already taken, is not waited on for READY_S)
    $PY -m phloem.entrypoints.cli bench serve --base-url "$URL" --model "$MODEL" \
        --wait-ready "$READY_S" --warmup "$WARMUP" --num-prompts 1 --input-len 512 \
        --output-len 8 --seed 99 >/dev/null &
    local client=$!
    while kill -0 "$client" 2>/dev/null; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "=== the server exited while starting"
            kill "$client" 2>/dev/null
            wait "$client" 2>/dev/null
            return 1
        fi
        sleep 0.2
    done
    wait "$client"
}

serve_and_bench() {  # serve_and_bench ENGINE LABEL [FLAGS]: start, warm up, every run, stop
    local engine=$1 label=$2 flags=${3:-} start
    if ! pending "$label"; then echo "=== $label: every run done already"; return; fi
    echo "=== $label: starting $(date +%T) ${flags:+(flags: $flags)}"
    start=$(date +%s)
    start_server "$engine" "$label" "$flags"
    if ! warm_up; then
        echo "=== $label: not ready or warm-up failed; server log tail:"
        tail -20 "$OUT/$label-server.log"
        stop_server
        return
    fi
    echo "=== $label: ready and warm after $(($(date +%s) - start)) s"
    for rate in $RATES; do
        bench "$label" "poisson-$rate" --request-rate "$rate" --duration "$DURATION" \
            --input-len 512 --output-len 128 --seed "$((1000 + rate))"
    done
    if [ "$BURST" = 1 ]; then
        bench "$label" "burst-$BURST_N" --request-rate inf --num-prompts "$BURST_N" \
            --input-len 512 --output-len 128 --seed 7
    fi
    if [ "$SHARED" = 1 ]; then
        bench "$label" "shared-prefix-$SHARED_N" --request-rate inf --num-prompts "$SHARED_N" \
            --input-len 1280 --prefix-len 1024 --output-len 128 --seed 11
    fi
    stop_server
    echo "=== $label: done after $(($(date +%s) - start)) s"
}

for engine in $ENGINES; do
    if [ "$engine" = vllm ] && ! PYTHONPATH=$VLLM_SITE $PY -c "import vllm" 2>/dev/null; then
        echo "=== vllm: not importable from $VLLM_SITE (shared/tools/vllm_bundle.sh); skipped"
        continue
    fi
    if [ "$engine" != phloem ] || [ -z "$PHLOEM_CONFIGS" ]; then
        serve_and_bench "$engine" "$engine"
        continue
    fi
    IFS='|' read -r -a configs <<<"$PHLOEM_CONFIGS"
    for config in "${configs[@]}"; do
        name=${config%%:*}
        name=${name//[[:space:]]/}
        if [ -z "$name" ] || [ "$name" = "$config" ]; then
            echo "=== PHLOEM_CONFIGS entry '$config' is not NAME:FLAGS; skipped"
            continue
        fi
        serve_and_bench phloem "phloem@$name" "${config#*:}"
    done
done
$PY -m phloem.entrypoints.cli bench serve-summary "$OUT"
