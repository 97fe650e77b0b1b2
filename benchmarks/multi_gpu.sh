#!/usr/bin/env bash
# Data parallelism on several GPUs in one call (<= 10 minutes), run from the repository root:
#   NUM_GROUPS=400 bash benchmarks/multi_gpu.sh "$OUT/multi-gpu"   # issue 17: DP runs
#   NUM_GROUPS=25 bash benchmarks/multi_gpu.sh "$OUT/smoke"   # a smoke test, even on 1 GPU
# `phloem bench throughput` on Llama-3.1-8B shapes with random weights, batchllm workload
# (NUM_GROUPS groups x 16 requests, prefix 2000, suffix 200, output 100), one process per run:
#   dp1             --data-parallel-size 1 (one GPU)
#   dpN-prefix      --data-parallel-size N, the global plan's groups dealt to the replicas
#   dpN-contiguous  --data-parallel-size N --data-parallel-routing contiguous (vLLM's slicing)
# N = the visible GPUs / TP (override with N=...; TP=2 makes each replica a TP=2 group, so dp1 is
# one TP group); with N = 1 the three runs are all one engine, which
# still checks the script end to end. A run whose JSON is already in OUT_DIR is skipped (so dp1 can
# run beforehand, e.g. on one GPU beside another job). Prints each run's summary, then the speed-ups over dp1,
# prefix over contiguous, the cluster-wide prompt reuse of each run and whether the outputs agree
# (the runs' output digests), and writes every run's JSON plus summary.json under OUT_DIR.
# Time: one H100 runs batchllm 100 x 16 at ~76 req/s with the ENGINE_ARGS below, so NUM_GROUPS=400
# (6,400 requests) is ~85 s of generation at DP=1, plus ~60-90 s per run for start-up and the
# ceilings; LIMIT (default 260 s) bounds each run. Needs the carried .whl/ (device_setup.sh).
set -uo pipefail
OUT=${1:-/tmp/phloem_multi_gpu}
NUM_GROUPS=${NUM_GROUPS:-400}
ENGINE_ARGS=${ENGINE_ARGS:-"--max-num-seqs 2048 --max-num-batched-tokens 8192"}
LIMIT=${LIMIT:-260}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source benchmarks/device_setup.sh || exit 1
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
TP=${TP:-1}  # each replica a tensor-parallel group of TP GPUs (DP x TP = the visible GPUs)
N=${N:-$(($(nvidia-smi -L | wc -l) / TP))}
echo "=== N=$N replicas of TP=$TP GPUs, batchllm $NUM_GROUPS x 16 ($((NUM_GROUPS * 16)) requests; DP=1 at ~76 req/s: ~$((NUM_GROUPS * 16 / 76)) s of generation)"
run() {  # NAME DP ROUTING (a run whose JSON is in OUT_DIR already is skipped)
    if [ -f "$OUT/$1.json" ]; then echo "=== $1: done already"; return; fi
    echo "=== $1 $(date +%T)"
    # shellcheck disable=SC2086
    timeout "$LIMIT" python3 -m phloem.entrypoints.bench throughput --model llama-3.1-8b \
        --workload batchllm --num-groups "$NUM_GROUPS" $ENGINE_ARGS --data-parallel-size "$2" \
        --data-parallel-routing "$3" --tensor-parallel-size "$TP" --json "$OUT/$1.json" 2>&1 \
        | grep -v -i warn | tail -24
}
run dp1 1 prefix
run "dp$N-prefix" "$N" prefix
run "dp$N-contiguous" "$N" contiguous
python3 - "$OUT" "$N" "$NUM_GROUPS" <<'PY'
import json, os, sys
out, n, groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
runs = {}
for name in ("dp1", f"dp{n}-prefix", f"dp{n}-contiguous"):
    path = os.path.join(out, f"{name}.json")
    if os.path.exists(path):
        with open(path) as f:
            runs[name] = json.load(f)
keys = ("requests_per_s", "total_tokens_per_s", "prompt_reuse_ratio", "num_computed_prompt_tokens",
        "roofline_ratio", "roofline_ratio_sustained", "output_digest")
summary = {"num_gpus": n, "num_groups": groups, "runs": {}, "ratios": {}}
for name, r in runs.items():
    row = {k: r.get(k) for k in keys}
    row["device"] = r.get("device")
    dp = r.get("data_parallel") or {}
    row.update({k: dp.get(k) for k in ("makespan_s", "planned_imbalance", "achieved_imbalance",
                                       "num_split_groups")})
    summary["runs"][name] = row
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"
    print(f"{name}: {row['requests_per_s']:.2f} req/s, reuse {row['prompt_reuse_ratio']:.1%}, "
          f"roofline ratio per GPU {fmt(row['roofline_ratio'])} (sustained "
          f"{fmt(row['roofline_ratio_sustained'])}), makespan {fmt(row['makespan_s'])} s, "
          f"imbalance {fmt(row['achieved_imbalance'])}")
def ratio(a, b):
    if a in runs and b in runs:
        value = runs[a]["requests_per_s"] / runs[b]["requests_per_s"]
        summary["ratios"][f"{a}/{b}"] = value
        print(f"{a} / {b}: {value:.3f}x")
ratio(f"dp{n}-prefix", "dp1")
ratio(f"dp{n}-contiguous", "dp1")
ratio(f"dp{n}-prefix", f"dp{n}-contiguous")
digests = {r.get("output_digest") for r in runs.values()}
summary["outputs_agree"] = len(digests) == 1
print(f"output digests agree: {len(digests) == 1} (bf16 greedy may differ with batch shape)")
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
PY
echo "=== done $(date +%T)"
