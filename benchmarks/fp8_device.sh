#!/usr/bin/env bash
# FP8 W8A8 and the FP8 KV cache (issue 18) on one Hopper GPU, from the repo root:
#   bash benchmarks/fp8_device.sh "$OUT/fp8"                                   # everything
#   STAGES="tests batchllm" bash benchmarks/fp8_device.sh "$OUT/fp8"           # one <=10 min call
#   STAGES="decode-heavy prefill-heavy" bash benchmarks/fp8_device.sh "$OUT/fp8"   # the other
#   STAGES="fp8kv-tests" bash benchmarks/fp8_device.sh "$OUT/fp8"   # FP8 KV: build + tests,
#   STAGES="fp8kv" bash benchmarks/fp8_device.sh "$OUT/fp8"         # then its benches (same machine)
#   STAGES="unfused" bash benchmarks/fp8_device.sh "$OUT/fp8"     # what the fused quantization gains
# Stages, in the order given by STAGES:
#   tests          tests/gpu/test_fp8_gpu.py: torch._scaled_mm (row-wise) vs the CPU-exact
#                  reference over Llama-8B GEMM shapes, block checkpoints requantized on CUDA,
#                  an FP8 engine's CUDA graphs vs eager, FP8 vs bf16 greedy agreement; and
#                  tests/gpu/test_fp8_fused_quant_gpu.py: the RMSNorm / SiLU-and-mul kernels
#                  fused with the per-token quantization vs the unfused kernels, an FP8 engine
#                  with and without them (output in OUT_DIR/fp8-gpu-tests.txt)
#   batchllm       `phloem bench throughput --model llama-3.1-8b --workload batchllm
#                  --num-groups 400` at bf16 and with --quantization fp8
#   unfused        batchllm 400 with --quantization fp8, then again with PHLOEM_FP8_FUSED_QUANT=0
#                  (activations quantized in a pass of their own, as before the fusion); the
#                  summary gives fused / unfused requests/s
#   decode-heavy   the decode-heavy workload (1000 x 1000/1000) at bf16 and fp8
#   prefill-heavy  the prefill-heavy workload (1000 x 2048/128) at bf16 and fp8
#   fp8kv-tests    build FlashInfer's FP8-KV modules (flashinfer_prebuild.py --fp8-kv), then
#                  tests/gpu/test_fp8_kv_gpu.py (FlashInfer FP8 decode/prefill, our Triton
#                  kernel and the fused RoPE write with KV scales; engine agreement)
#   fp8kv          decode-heavy at bf16, with --kv-cache-dtype fp8 (goal >= 1.3x bf16 output
#                  tokens/s) and with --kv-cache-dtype fp8 --quantization fp8 (goal >= 1.6x):
#                  three bench runs, a call of their own
# Each bench stage runs bf16 then fp8 back to back on the same GPU (random weights, the same
# model: load_format dummy), and prints fp8/bf16 of requests/s, output and total tokens/s, with
# each run's sustained roofline ratio (the fp8 run's ceiling is the FP8 _scaled_mm one).
# Writes every run's JSON and summary.json under OUT_DIR. Needs the carried .whl/ and .fiaot/
# (device_setup.sh). All stages together take more than one 10-minute call: split them.
set -uo pipefail
OUT=${1:-/tmp/phloem_fp8}
STAGES=${STAGES:-"tests batchllm decode-heavy prefill-heavy"}
LIMIT=${LIMIT:-280}
ENGINE_ARGS=${ENGINE_ARGS:-"--max-num-seqs 2048 --max-num-batched-tokens 8192"}
source benchmarks/device_setup.sh || exit 1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader
bench() {  # NAME WORKLOAD_ARGS...
    local name=$1
    shift
    echo "=== $name $(date +%T)"
    # shellcheck disable=SC2086
    timeout "$LIMIT" python3 -m phloem.entrypoints.bench throughput --model llama-3.1-8b "$@" \
        $ENGINE_ARGS --json "$OUT/$name.json" 2>&1 \
        | grep -v -i warn | grep -i -E "tok/s|req/s|roofline|error|Traceback" | tail -6
}
for stage in $STAGES; do
    case $stage in
    tests)
        echo "=== tests $(date +%T)"
        timeout $((LIMIT + 120)) python3 -m pytest -q -s -p no:cacheprovider \
            tests/gpu/test_fp8_gpu.py tests/gpu/test_fp8_fused_quant_gpu.py 2>&1 \
            | tee "$OUT/fp8-gpu-tests.txt" | grep -E "fp8 vs bf16|fused vs|passed|failed|Error" | tail -6
        ;;
    batchllm)
        bench batchllm400-bf16 --workload batchllm --num-groups 400
        bench batchllm400-fp8 --workload batchllm --num-groups 400 --quantization fp8
        ;;
    unfused)
        bench batchllm400-fp8-fused --workload batchllm --num-groups 400 --quantization fp8
        PHLOEM_FP8_FUSED_QUANT=0 bench batchllm400-fp8-unfused --workload batchllm \
            --num-groups 400 --quantization fp8
        ;;
    fp8kv-tests)
        echo "=== fp8kv build $(date +%T)"
        timeout 400 python3 benchmarks/flashinfer_prebuild.py --fp8-kv 128 2>&1 | tail -6
        echo "=== fp8kv tests $(date +%T)"
        timeout "$LIMIT" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_kv_gpu.py \
            2>&1 | tee "$OUT/fp8kv-gpu-tests.txt" | grep -E "fp8 kv|passed|failed|Error" | tail -5
        ;;
    fp8kv)
        bench decode-heavy-kv-bf16 --workload decode-heavy
        bench decode-heavy-kv-fp8kv --workload decode-heavy --kv-cache-dtype fp8
        bench decode-heavy-kv-both --workload decode-heavy --kv-cache-dtype fp8 --quantization fp8
        ;;
    decode-heavy | prefill-heavy)
        bench "$stage-bf16" --workload "$stage"
        bench "$stage-fp8" --workload "$stage" --quantization fp8
        ;;
    *) echo "unknown stage $stage" ;;
    esac
done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else None
keys = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
summary = {}
for base in ("batchllm400", "decode-heavy", "prefill-heavy"):
    bf16, fp8 = load(base + "-bf16"), load(base + "-fp8")
    if not (bf16 and fp8):
        continue
    ratios = {k: fp8[k] / bf16[k] for k in keys}
    sustained = {p: r.get("roofline_ratio_sustained") for p, r in (("bf16", bf16), ("fp8", fp8))}
    summary[base] = {"bf16": {k: bf16[k] for k in keys}, "fp8": {k: fp8[k] for k in keys},
                     "fp8_over_bf16": ratios, "roofline_ratio_sustained": sustained,
                     "fp8_weight_bytes": fp8.get("weight_bytes"),
                     "fp8_ceiling_precision": (fp8.get("ceilings") or {}).get("precision")}
    print(f"{base}: fp8/bf16 requests/s {ratios['requests_per_s']:.3f}, output tok/s "
          f"{ratios['output_tokens_per_s']:.3f}, total tok/s {ratios['total_tokens_per_s']:.3f}; "
          f"sustained roofline ratio bf16 {sustained['bf16']} fp8 {sustained['fp8']}")
fused, unfused = load("batchllm400-fp8-fused"), load("batchllm400-fp8-unfused")
if fused and unfused:
    gain = fused["requests_per_s"] / unfused["requests_per_s"]
    summary["batchllm400-fp8-fused-over-unfused"] = {"requests_per_s": gain}
    print(f"batchllm400 fp8: fused / unfused activation quantization requests/s {gain:.3f}")
base = load("decode-heavy-kv-bf16")
for name, goal in (("fp8kv", 1.3), ("both", 1.6)):
    run = load("decode-heavy-kv-" + name)
    if not (base and run):
        continue
    ratio = run["output_tokens_per_s"] / base["output_tokens_per_s"]
    summary["decode-heavy-kv-" + name] = {
        "output_tokens_per_s": run["output_tokens_per_s"],
        "bf16_output_tokens_per_s": base["output_tokens_per_s"], "over_bf16": ratio,
        "goal": goal, "roofline_ratio_sustained": run.get("roofline_ratio_sustained"),
        "kv_cache_dtype": (run.get("engine") or {}).get("kv_cache_dtype")}
    print(f"decode-heavy {name}: output tok/s {run['output_tokens_per_s']:.0f} = {ratio:.3f}x "
          f"bf16 (goal {goal}x); sustained roofline ratio {run.get('roofline_ratio_sustained')}")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
echo "=== done $(date +%T)"
