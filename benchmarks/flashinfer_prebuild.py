"""Build (or load) the FlashInfer modules phloem uses, in parallel: the fa2 paged prefill module
for bf16 with head dims 64 and 128 (it serves prefill, chunked appends and decode) and, on Hopper,
the fa3 one (long prefill chunks of shared-prefix steps). Run on the GPU machine after
`source benchmarks/device_setup.sh`."""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from flashinfer.prefill import get_batch_prefill_module


def build(job: tuple[str, int]) -> str:
    backend, head_dim = job
    start = time.perf_counter()
    bf16 = torch.bfloat16
    get_batch_prefill_module(
        backend, bf16, bf16, bf16, torch.int32, head_dim, head_dim, 0, False, False, False
    )
    return f"{backend} head_dim {head_dim}: {time.perf_counter() - start:.0f} s"


if __name__ == "__main__":
    dims = [int(x) for x in sys.argv[1:]] or [128, 64]
    jobs = [("fa2", d) for d in dims]
    if torch.cuda.get_device_capability()[0] == 9:
        jobs += [("fa3", d) for d in dims]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for line in pool.map(build, jobs):
            print("flashinfer module ready,", line, flush=True)
