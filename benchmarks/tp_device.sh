#!/usr/bin/env bash
# Tensor parallelism on a machine with >= 2 GPUs in one call (<= 10 minutes), from the repo root:
#   bash benchmarks/tp_device.sh "$OUT/tp"                    # issue 17's TP runs, TP=2
#   TP=4 STAGES="agree latency" bash benchmarks/tp_device.sh "$OUT/tp4"
# On Llama-3.1-8B shapes with random weights (load_format dummy draws the same model at every TP
# size), bf16, one process per run, the stages of STAGES in this order:
#   tests    tests/distributed/test_tp_gpu.py (TESTS_LIMIT s, default 420; TESTS_CASE_LIMIT s a
#            case, default 200: the symmetric-memory cases start their TP=2 engines in new
#            processes; TESTS_K picks cases by pytest -k): TP=2 vs TP=1 greedy on tiny models,
#            NCCL, decode CUDA graphs on and off (output in OUT_DIR/tp-gpu-tests.txt)
#   agree    benchmarks/tp_agreement.py: greedy reference at TP=1, then TP=$TP teacher-forced top-1
#            agreement with it (goal >= 0.99) and free-running greedy match; says whether TP=$TP
#            replayed CUDA graphs (which capture the all-reduces); then TP=1 checked the same way,
#            the noise floor of bf16 rounding (random weights give near-tied logits)
#   allreduce benchmarks/allreduce_norm_bench.py on $TP ranks (torchrun): us per call of NCCL
#            all-reduce + add-RMSNorm, symm_mem + norm and the symm_norm kernel at 1, 4, 16 rows
#            inside CUDA graphs, results checked (OUT_DIR/allreduce-norm.json)
#   latency  `phloem bench throughput --workload latency` (batch 1, 128 in / 256 out), the runs of
#            LATENCY_RUNS in order (default "tp1 tp symm symmnorm glogits both trace"):
#            tp1, tp: TP=1 and TP=$TP; symm: TP=$TP with PHLOEM_TP_ALLREDUCE=symm_mem (the
#            one-shot symmetric-memory all-reduce for small messages); symmnorm: with
#            PHLOEM_TP_ALLREDUCE=symm_norm (all-reduce, residual add and RMSNorm in one phloem
#            Triton kernel); fused (not in the default: FlashInfer's module outlives a start-up):
#            with PHLOEM_TP_ALLREDUCE=fused_norm (the same fusion, FlashInfer's kernel); glogits:
#            TP=1 and TP=$TP with the LM head inside the decode graphs
#            (PHLOEM_GRAPH_LOGITS_MAX_BATCH=16); both: TP=$TP with symm_norm and graph logits;
#            trace: TP=$TP and TP=1 again with --trace-steps (the JSONs' "steps": host phases,
#            GPU time, gaps). Output tokens/s and their ratios to TP=1 (goal >= 1.6x at TP=2)
#   batchllm `phloem bench throughput --workload batchllm --num-groups 100` (1,600 requests) at
#            TP=$TP, to set beside two data-parallel replicas (benchmarks/multi_gpu.sh)
#   big      Llama-3.1-70B shapes (a model that needs TP; 141 GB of bf16 weights: TP=2 on H200s,
#            TP=4 on H100s) at TP=$TP: batchllm 100 x 16 and decode-heavy (1,000 x 1000/1000), each
#            with its roofline ratios (per GPU: the roofline counts the group's bytes and FLOPs
#            against TP x one GPU's ceilings); BIG_LIMIT seconds a run (default 420),
#            BIG_DECODE_REQUESTS decode-heavy requests (default 1,000; 500 as issue 19's table). Not in the
#            default STAGES: run it alone, `STAGES=big bash benchmarks/tp_device.sh "$OUT/tp70b"`
# Writes every run's JSON, its whole log (NAME.log) and summary.json under OUT_DIR; a rank's failure shows as
# "tensor-parallel rank R ..." in the run's tail. Needs the carried .whl/ (device_setup.sh).
set -uo pipefail
OUT=${1:-/tmp/phloem_tp}
TP=${TP:-2}
STAGES=${STAGES:-"tests agree latency batchllm"}
LIMIT=${LIMIT:-200}
TESTS_LIMIT=${TESTS_LIMIT:-420}
BIG_LIMIT=${BIG_LIMIT:-420}
ENGINE_ARGS=${ENGINE_ARGS:-"--max-num-seqs 2048 --max-num-batched-tokens 8192"}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source benchmarks/device_setup.sh || exit 1
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
bench() {  # NAME TP WORKLOAD_ARGS...  (MODEL, LIMIT from the environment)
    local name=$1 tp=$2
    shift 2
    echo "=== $name (TP=$tp) $(date +%T)"
    # shellcheck disable=SC2086
    timeout "$LIMIT" python3 -m phloem.entrypoints.bench throughput --model "${MODEL:-llama-3.1-8b}" "$@" \
        $ENGINE_ARGS --tensor-parallel-size "$tp" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" \
        | grep -v -i warn | grep -i -E "tok/s|req/s|roofline|graph|rank|error" | tail -8
}
for stage in $STAGES; do
    case $stage in
    tests)
        echo "=== tests $(date +%T)"
        # 5 cases x 3 engine starts (TP=1, TP=2 with graphs, TP=2 eager): ~60 s a case; a case
        # that hangs is named by pytest-timeout; TESTS_K picks cases (pytest -k, e.g. symm_norm).
        # The thread method dumps every thread's stack at the timeout even when the main thread is
        # blocked in CUDA or NCCL (the signal method never fired on symm_norm's hang, 2026-11-27c)
        timeout "$TESTS_LIMIT" python3 -m pytest -v -x --tb=short -p no:cacheprovider \
            --timeout "${TESTS_CASE_LIMIT:-200}" \
            --timeout-method=thread \
            --durations=0 -k "${TESTS_K:-}" tests/distributed/test_tp_gpu.py 2>&1 | tee "$OUT/tp-gpu-tests.txt" \
            | grep -E "PASS|FAIL|ERROR|Timeout|passed|failed|s call"
        ;;
    agree)
        echo "=== agreement TP=1 -> TP=$TP $(date +%T)"
        # (a reference already in OUT_DIR, e.g. made on one GPU beside another job, is kept)
        [ -f "$OUT/agree-ref.json" ] || timeout "$LIMIT" python3 benchmarks/tp_agreement.py \
            reference --out "$OUT/agree-ref.json" 2>&1 | tail -2
        timeout "$LIMIT" python3 benchmarks/tp_agreement.py check --ref "$OUT/agree-ref.json" \
            --tensor-parallel-size "$TP" --out "$OUT/agree-tp$TP.json" 2>&1 | tail -4
        # the noise floor: TP=1 checked against its own reference (teacher-forced prefills vs
        # the reference's decode steps, other batch shapes: bf16 rounding alone)
        timeout "$LIMIT" python3 benchmarks/tp_agreement.py check --ref "$OUT/agree-ref.json" \
            --tensor-parallel-size 1 --out "$OUT/agree-tp1.json" 2>&1 | tail -1
        ;;
    allreduce)
        echo "=== allreduce + norm microbenchmark ($TP ranks) $(date +%T)"
        timeout "$LIMIT" python3 -m torch.distributed.run --nproc-per-node "$TP" \
            benchmarks/allreduce_norm_bench.py --json "$OUT/allreduce-norm.json" 2>&1 \
            | tee "$OUT/allreduce-norm.log" | grep -E "us/call|Error|error" | tail -16
        ;;
    latency)
        for run in ${LATENCY_RUNS:-tp1 tp symm symmnorm glogits both trace}; do
            case $run in
            tp1) bench latency-tp1 1 --workload latency ;;
            tp) bench "latency-tp$TP" "$TP" --workload latency ;;
            symm) PHLOEM_TP_ALLREDUCE=symm_mem bench "latency-tp$TP-symm" "$TP" --workload latency ;;
            symmnorm) PHLOEM_TP_ALLREDUCE=symm_norm bench "latency-tp$TP-symmnorm" "$TP" \
                --workload latency ;;
            fused) PHLOEM_TP_ALLREDUCE=fused_norm bench "latency-tp$TP-fused" "$TP" --workload latency ;;
            glogits)
                PHLOEM_GRAPH_LOGITS_MAX_BATCH=16 bench latency-tp1-glogits 1 --workload latency
                PHLOEM_GRAPH_LOGITS_MAX_BATCH=16 bench "latency-tp$TP-glogits" "$TP" --workload latency
                ;;
            both) PHLOEM_TP_ALLREDUCE=symm_norm PHLOEM_GRAPH_LOGITS_MAX_BATCH=16 \
                bench "latency-tp$TP-both" "$TP" --workload latency ;;
            trace)  # where TP's extra GPU idle sits: host phases and GPU time per step (CUDA events)
                bench "latency-tp$TP-trace" "$TP" --workload latency --trace-steps
                bench latency-tp1-trace 1 --workload latency --trace-steps
                ;;
            *) echo "unknown LATENCY_RUNS entry: $run" ;;
            esac
        done
        ;;
    batchllm)
        bench "batchllm100-tp$TP" "$TP" --workload batchllm --num-groups 100
        ;;
    big)
        MODEL=llama-3.1-70b LIMIT=$BIG_LIMIT bench "70b-batchllm100-tp$TP" "$TP" \
            --workload batchllm --num-groups 100
        MODEL=llama-3.1-70b LIMIT=$BIG_LIMIT bench "70b-decode-heavy-tp$TP" "$TP" \
            --workload decode-heavy --num-requests "${BIG_DECODE_REQUESTS:-1000}"
        ;;
    esac
done
python3 - "$OUT" "$TP" <<'PY'
import json, os, sys
out, tp = sys.argv[1], sys.argv[2]
def load(name):
    path = os.path.join(out, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else None
summary = {"tensor_parallel_size": int(tp)}
agree = load(f"agree-tp{tp}")
if agree:
    summary["agreement"] = agree
    print(f"TP={tp} teacher-forced top-1 agreement {agree['teacher_forced_agreement']:.4f} "
          f"(goal >= 0.99); free-running exact {agree['free_running_exact']:.3f}; "
          f"CUDA graphs {agree['cuda_graphs']}")
for name, r in (("TP=" + tp, agree), ("TP=1 (noise floor)", load("agree-tp1"))):
    if r and "close_agreement" in r:
        margins = ", ".join(f">={m}: {v['agreement']} ({v['positions']})"
                            for m, v in r["agreement_by_margin"].items())
        print(f"{name}: top-5 close {r['close_agreement']:.4f}, mean |dlogprob| "
              f"{r['mean_abs_logprob_diff']}, agreement by reference margin (nats) {margins}")
floor = load("agree-tp1")
if floor:
    summary["agreement_noise_floor"] = floor
    print(f"noise floor, TP=1 checked against itself: {floor['teacher_forced_agreement']:.4f}")
keys = ("output_tokens_per_s", "requests_per_s", "total_tokens_per_s", "roofline_ratio",
        "roofline_ratio_sustained")
for name in ("latency-tp1", f"latency-tp{tp}", f"latency-tp{tp}-symm", f"latency-tp{tp}-symmnorm",
             f"latency-tp{tp}-fused", "latency-tp1-glogits", f"latency-tp{tp}-glogits",
             f"latency-tp{tp}-both",
             f"batchllm100-tp{tp}",
             f"70b-batchllm100-tp{tp}", f"70b-decode-heavy-tp{tp}"):
    r = load(name)
    if r:
        summary[name] = {k: r.get(k) for k in keys}
        print(name, {k: r.get(k) for k in keys})
one, many = load("latency-tp1"), load(f"latency-tp{tp}")
if one and many:
    ratio = many["output_tokens_per_s"] / one["output_tokens_per_s"]
    summary["latency_speedup"] = ratio
    print(f"latency output tok/s TP={tp} / TP=1: {ratio:.3f} (goal >= 1.6 at TP=2)")
for suffix, key, what in (("symm", "symm_mem", "symmetric-memory all-reduce"),
                          ("symmnorm", "symm_norm", "phloem's all-reduce + add + RMSNorm kernel"),
                          ("fused", "fused_norm", "FlashInfer's all-reduce + add + RMSNorm"),
                          ("glogits", "graph_logits", "LM head in the decode graphs"),
                          ("both", "symm_norm_graph_logits", "symm_norm + graph logits")):
    other = load(f"latency-tp{tp}-{suffix}")
    if one and other:
        ratio = other["output_tokens_per_s"] / one["output_tokens_per_s"]
        summary[f"latency_speedup_{key}"] = ratio
        print(f"latency output tok/s TP={tp} ({what}) / TP=1: {ratio:.3f}")
bench = load("allreduce-norm")
if bench:
    summary["allreduce_norm"] = bench["results"]
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
echo "=== done $(date +%T)"
