"""The device memory the CUDA graphs will take, measured before the KV cache is sized.

Graphs are captured after the KV pool is allocated (they hold its addresses), so without this
their memory comes out of the headroom `gpu_memory_utilization` leaves and the first eager step
after the capture can run out of memory: Llama-3.1-70B shapes at TP = 4 on 80 GB H100s, where 260
decode graphs of 80 layers (plus 1,296 piecewise ones) took the ~8 GiB that 0.9 left. vLLM
profiles graph memory before sizing its KV cache the same way (on by default since v0.21).

A graph costs its share of the memory pool its kind shares (the largest bucket's activations;
smaller buckets reuse those blocks) plus its own executable (device memory per kernel node,
nearly the same for every bucket of a kind). So the probe captures the largest bucket alone,
then the largest two in one pool, and extrapolates linearly from the second one's increment:

    estimate(n buckets) = first + (two - first) * (n - 1)

The increment of the second-largest bucket bounds the smaller ones' (their buffers are smaller),
so the estimate errs on the side of a smaller KV pool. The worker logs it beside what the real
capture took.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from phloem.worker.cuda_graph import CUDAGraphRunner
from phloem.worker.piecewise_graph import CUDAPieceGraphs, PiecewiseGraphRunner

logger = logging.getLogger(__name__)

Capture = Callable[[list[int]], Callable[[], None]]  # buckets -> the function releasing them


def extrapolate(first: int, two: int, count: int) -> int:
    """Bytes for `count` graphs of one kind: `first` bytes measured for the largest bucket
    alone, `two` for the largest two sharing one pool (a negative increment counts as 0)."""
    if count <= 1:
        return first
    return first + max(two - first, 0) * (count - 1)


def probe(capture: Capture, sizes: list[int], free_bytes: Callable[[], int]) -> int:
    """Estimated bytes for graphs of every bucket in `sizes` (ascending): captures the largest
    bucket, releases it, captures the largest two, releases them (`capture(buckets)` returns
    the release function), and `extrapolate`s; `free_bytes()` reads the device's free memory."""
    if not sizes:
        return 0
    first = _taken(capture, sizes[-1:], free_bytes)
    if len(sizes) == 1:
        return first
    return extrapolate(first, _taken(capture, sizes[-2:], free_bytes), len(sizes))


def _taken(capture: Capture, buckets: list[int], free_bytes: Callable[[], int]) -> int:
    before = free_bytes()
    release = capture(buckets)
    taken = before - free_bytes()
    release()
    return max(taken, 0)


def cuda_free_bytes(device: torch.device) -> int:
    """Free device memory [bytes] once queued work is done and torch's unused cached blocks
    are returned to the driver."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def estimate_graph_memory(
    runner, max_num_seqs: int, decode_sizes: list[int], piece_sizes: list[int]
) -> int:
    """Bytes the decode graphs of `decode_sizes` and the piecewise graphs of `piece_sizes`
    (empty: none) will take, probed on `runner`'s current (profiling) KV cache; the memory the
    probes leave behind (e.g. the attention backend's per-bucket buffers, kept for the real
    capture) is subtracted, since it is in use when the KV pool is sized. CUDA only."""

    def free() -> int:
        return cuda_free_bytes(runner.device)

    def decode(buckets: list[int]) -> Callable[[], None]:
        graphs = CUDAGraphRunner(
            runner.model, runner.kv_caches, runner.backend, runner.block_size,
            runner.num_blocks, max_num_seqs, runner.device, batch_sizes=buckets,
        )  # fmt: skip
        graphs.capture()
        return graphs.release

    def pieces(buckets: list[int]) -> Callable[[], None]:
        graphs = PiecewiseGraphRunner(
            runner.model, runner.kv_caches, runner.backend, runner.block_size,
            runner.num_blocks, buckets, runner.device, CUDAPieceGraphs(runner.device),
        )  # fmt: skip
        graphs.capture()
        return graphs.release

    start = free()
    decode_bytes = probe(decode, decode_sizes, free)
    piece_bytes = probe(pieces, piece_sizes, free)
    retained = max(start - free(), 0)
    total = max(decode_bytes + piece_bytes - retained, 0)
    logger.info(
        "CUDA graph memory estimate: %.2f GiB (decode %.2f GiB for %d buckets, piecewise %.2f "
        "GiB for %d buckets, less %.2f GiB the probes keep), reserved before the KV cache",
        total / 2**30, decode_bytes / 2**30, len(decode_sizes), piece_bytes / 2**30,
        len(piece_sizes), retained / 2**30,
    )  # fmt: skip
    return total
