"""Whether the captured CUDA graphs left the memory eager steps need, and how many KV blocks to
give back when they did not.

The KV pool is sized before the graphs are captured (they hold its addresses): `total *
gpu_memory_utilization - in use - the largest step's activation peak`. The graphs then take
their memory from what is left: the executables (device memory per kernel node, which grows
with layers x buckets: ~4.9 GiB for Llama-3.1-70B shapes at TP = 4 with 132 decode buckets of 80
layers and 1,296 pieces) and their pool. Small probes cannot predict it: the driver hands out
graph memory in chunks, so the second of two graphs measured ~0 bytes. So the worker measures
after the real capture instead; when the free memory no longer holds the activation peak plus a
margin (70B at TP = 4 with 2,048 sequences: the first eager step ran out of memory), the KV
pool gives back the difference and the graphs are captured once more. vLLM reserves graph
memory before sizing its KV cache from a profiling capture (on by default since v0.21); this
costs nothing when the graphs fit, which they do for the common cases.
"""

from __future__ import annotations

import torch

MARGIN_FRACTION = 0.01  # of the device's memory, beside the activation peak
MIN_MARGIN_BYTES = 512 * 2**20


def runtime_need(activation_peak: int, total: int) -> int:
    """Bytes that must stay free (or cached unused by torch) after the capture: the largest
    step's activation peak plus a margin (max(1% of `total`, 512 MiB)) for the sampler's
    buffers and allocator fragmentation."""
    return activation_peak + max(int(total * MARGIN_FRACTION), MIN_MARGIN_BYTES)


def kv_blocks_to_release(available: int, need: int, bytes_per_block: int) -> int:
    """KV blocks to give back so that `need` bytes fit beside `available` free bytes (0 when
    they fit already)."""
    deficit = need - available
    return 0 if deficit <= 0 else -(-deficit // bytes_per_block)


def available_bytes(device: torch.device) -> tuple[int, int]:
    """(bytes a new allocation can use: the driver's free memory plus torch's cached unused
    blocks, the device's total) once queued work is done."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached, total
