"""Copies between host and device that never make the host wait for the device.

A copy from pageable host memory may synchronize with the stream (the driver stages it through
pinned memory it owns), which would stall the host behind every kernel already queued: fatal for
async scheduling, where step N+1 is prepared while step N runs. Staging through pinned memory
(PyTorch's caching host allocator, which keeps a block alive until its copy has run) makes the
copy fully asynchronous.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`data` (a numpy array or a CPU tensor) as a tensor on `device`, copied without waiting
    for the device when it is a GPU. The caller may reuse `data` right away."""
    tensor = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pinned(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A pinned CPU copy (for libraries that copy host tensors to the device themselves, such
    as FlashInfer's `plan`), or the CPU tensor itself when no GPU is present."""
    tensor = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy of a device tensor into pinned host memory, enqueued on the current
    stream: read it only after an event recorded later on that stream has completed (a CPU
    tensor is returned as is)."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
