"""Build (or load) the FlashInfer modules phloem uses, in parallel: the fa2 paged prefill module
for bf16 with head dims 64 and 128 (it serves prefill, chunked appends and decode) and, on Hopper,
the fa3 one (long prefill chunks of shared-prefix steps); with `--fp8-kv`, also the modules of an
FP8 KV cache (bf16 queries, e4m3 KV): the fa2 prefill module (mixed steps) and the CUDA-core
batch decode module (decode-only steps); with `--comm`, TensorRT-LLM's all-reduce module that
PHLOEM_TP_ALLREDUCE=fused_norm runs (tensor parallelism). Run on the GPU machine after
`source benchmarks/device_setup.sh`:
`python3 benchmarks/flashinfer_prebuild.py [--fp8-kv] [--comm] [DIMS]`."""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from flashinfer.decode import get_batch_decode_module
from flashinfer.prefill import get_batch_prefill_module


def build(job: tuple[str, int, torch.dtype]) -> str:
    backend, head_dim, kv = job
    start = time.perf_counter()
    bf16 = torch.bfloat16
    if backend == "comm":
        from flashinfer.comm import gen_trtllm_comm_module

        gen_trtllm_comm_module().build(need_lock=True)
        return f"comm trtllm: {time.perf_counter() - start:.0f} s"
    if backend == "decode":  # q, kv, out, index dtypes, head dims, no RoPE/window/soft cap
        get_batch_decode_module(bf16, kv, bf16, torch.int32, head_dim, head_dim, 0, False, False)
    else:
        get_batch_prefill_module(
            backend, bf16, kv, bf16, torch.int32, head_dim, head_dim, 0, False, False, False
        )
    return f"{backend} head_dim {head_dim} kv {kv}: {time.perf_counter() - start:.0f} s"


if __name__ == "__main__":
    fp8_kv, comm = "--fp8-kv" in sys.argv, "--comm" in sys.argv
    dims = [int(x) for x in sys.argv[1:] if not x.startswith("--")] or [128, 64]
    jobs = [("fa2", d, torch.bfloat16) for d in dims]
    if torch.cuda.get_device_capability()[0] == 9:
        jobs += [("fa3", d, torch.bfloat16) for d in dims]
    if fp8_kv:
        e4m3 = torch.float8_e4m3fn
        jobs += [("fa2", d, e4m3) for d in dims] + [("decode", d, e4m3) for d in dims]
    if comm:
        jobs.append(("comm", 0, torch.bfloat16))
    with ThreadPoolExecutor(len(jobs)) as pool:
        for line in pool.map(build, jobs):
            print("flashinfer module ready,", line, flush=True)
