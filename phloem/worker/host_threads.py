"""torch's intra-op CPU threads in an engine process whose model runs on a CUDA GPU.

There the process's own torch CPU work is the host side of a step: staging small arrays (input
ids, positions, KV page indices, sampling parameters) into pinned memory. None needs threads, but a
CPU op over more than 32,768 elements (`at::internal::GRAIN_SIZE`: a step's KV page indices once
a batch holds that many pages) opens an OpenMP parallel region, after which each of torch's
worker threads spin-waits before it sleeps (libgomp's default policy: 8-13 ms of CPU per worker
on the machine measured) on the cores the grammar library's threads fill the step's bitmask on:
a fill beside such ops took 2-4x as long. With the pool at one thread no region opens
(benchmarks/results/2026-11-26g-cpu-structured-contention/). vLLM runs torch on one thread in its
GPU worker processes for the same reason.

The cap is applied once the engine has started (`cap_torch_threads`), so start-up's CPU work
(converting or loading weights) keeps every thread. It is never applied on the CPU device (the
model itself runs on those threads), nor when the user set OMP_NUM_THREADS.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)

GPU_ENGINE_TORCH_THREADS = 1  # torch's intra-op threads in a CUDA engine process after start-up


def engine_torch_threads(device_type: str, env: Mapping[str, str]) -> int | None:
    """torch's intra-op threads for an engine process whose model is on `device_type` ("cuda",
    "cpu"), with environment `env`: `GPU_ENGINE_TORCH_THREADS` on CUDA, None (leave torch as it
    is) on any other device or when `env` sets OMP_NUM_THREADS (the user's choice)."""
    if device_type != "cuda" or env.get("OMP_NUM_THREADS", "").strip():
        return None
    return GPU_ENGINE_TORCH_THREADS


def cap_torch_threads(device_type: str) -> None:
    """Lower this process's torch intra-op threads to `engine_torch_threads(device_type,
    os.environ)` where that is set and lower than now. Mutates torch's global thread count (an
    offline `LLM` shares it with the caller's own torch work)."""
    threads = engine_torch_threads(device_type, os.environ)
    if threads is None or torch.get_num_threads() <= threads:
        return
    logger.info(
        "torch CPU threads %d -> %d in this GPU engine process (set OMP_NUM_THREADS to keep "
        "your own)", torch.get_num_threads(), threads,
    )  # fmt: skip
    torch.set_num_threads(threads)
