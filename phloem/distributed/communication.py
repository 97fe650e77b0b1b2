"""The collectives of tensor parallelism over the group of `parallel_state`; each returns its
input untouched when the group's size is 1 (no op, no copy).

All-reduce (sum) follows the row-parallel layers and the vocab-parallel embedding; all-gather
assembles the vocab-parallel logits (Megatron-LM, Shoeybi et al. 2019, §3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phloem.distributed.parallel_state import tp_group, tp_size, tp_small_all_reduce


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks (any shape and dtype the backend reduces): a new tensor
    from the symmetric-memory all-reduce when the group has one and `x` fits it, else `x`
    itself, summed in place by the process group's backend. Callers use the returned tensor."""
    if tp_size() == 1:
        return x
    small = tp_small_all_reduce()
    if small is not None and small.fits(x):
        return small(x)
    dist.all_reduce(x, group=tp_group())
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` (same shape on every rank) along `dim`, in rank order:
    [..., n, ...] -> [..., size * n, ...] (a new tensor); `x` itself when the size is 1."""
    size = tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=tp_group())
    return torch.cat(parts, dim=dim)


def tp_min(value: int, device: torch.device) -> int:
    """The smallest of the ranks' `value`s (e.g. the KV blocks each rank's memory holds)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp_group())
    return int(t.item())
