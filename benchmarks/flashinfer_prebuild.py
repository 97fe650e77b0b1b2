"""Build (or load) the FlashInfer modules phloem uses, in parallel: the fa2 paged prefill module
for bf16 with head dims 64 and 128 (it serves prefill, chunked appends and decode). Run on the GPU
machine after `source benchmarks/device_setup.sh`."""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from flashinfer.prefill import get_batch_prefill_module


def build(head_dim: int) -> str:
    start = time.perf_counter()
    bf16 = torch.bfloat16
    get_batch_prefill_module(
        "fa2", bf16, bf16, bf16, torch.int32, head_dim, head_dim, 0, False, False, False
    )
    return f"head_dim {head_dim}: {time.perf_counter() - start:.0f} s"


if __name__ == "__main__":
    dims = [int(x) for x in sys.argv[1:]] or [128, 64]
    with ThreadPoolExecutor(len(dims)) as pool:
        for line in pool.map(build, dims):
            print("flashinfer module ready,", line, flush=True)
