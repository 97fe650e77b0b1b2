"""The maximum of each row of a `[B, V]` logits tensor, fast when B is small and V is large.

A greedy step's argmax is `logits.max(dim=-1)`. On CUDA that reduction gives each row one
thread block, so a step of few rows over a 128K vocabulary leaves the GPU almost idle while one
block per row walks 128K values: 41 us a step at any batch up to 16 on an H200 (kernel profile,
benchmarks/results/2026-11-26d-h200-serving), ~0.8% of a batch-1 decode step of Llama-3.1-8B.
`row_max` cuts such rows into `CHUNKS` contiguous chunks, reduces every chunk in one launch, then
reduces the chunks' maxima: the same values and the same ids. In a CUDA graph on an H200 (bf16,
128K vocabulary; benchmarks/results/2026-11-26d-h200-checks) one stage takes 28-29 us at 1-64
rows, two stages with 128 chunks 14.0 / 14.8 / 20.5 us at 1 / 16 / 64 rows.

Why the ids are the same: each chunk's reduction returns the first index of its maximum, and the
reduction over chunks returns the first chunk holding the row's maximum, so the id is the first
index of the row's maximum, as `max(dim=-1)` returns it. NaN propagates through both stages (a
chunk holding a NaN has the value NaN, and so has the row), so a row's value is non-finite
exactly when `max(dim=-1)`'s is: the sampler's non-finite flags read it.
"""

from __future__ import annotations

import torch

CHUNKS = 128  # chunks a row is cut into (benchmarks/row_max.py, H200: 128-256 best at B <= 16)
MIN_VOCAB = 32_768  # narrower rows reduce fast enough in one stage
MAX_ROWS = 64  # with more rows the one-stage reduction already has enough blocks


def row_max(
    logits: torch.Tensor, split: bool | None = None, chunks: int = CHUNKS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [B] in logits' dtype, ids int64 [B]) of each row's maximum: the first index among
    equal maxima and NaN propagating, exactly as `logits.max(dim=-1)`.

    Args:
        logits: [B, V], any floating dtype, on any device; rows contiguous in V.
        split: reduce in two stages (True), in one (False), or None: two on CUDA when
            B <= `MAX_ROWS` and V >= `MIN_VOCAB` (module docstring).
        chunks: how many chunks a row is cut into in two stages (>= 1).
    Raises:
        ValueError: logits not 2-D.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if split is None:
        split = logits.is_cuda and rows <= MAX_ROWS and vocab >= MIN_VOCAB
    width = vocab // chunks
    if not split or width == 0:  # (fewer logits than chunks: one stage)
        return logits.max(dim=-1)
    whole = width * chunks
    values, ids = logits[:, :whole].reshape(rows, chunks, width).max(dim=-1)  # [B, C]
    ids += torch.arange(0, whole, width, device=logits.device)
    if whole < vocab:  # the last vocab % CHUNKS logits: one more candidate per row, last
        tail_values, tail_ids = logits[:, whole:].max(dim=-1, keepdim=True)
        values = torch.cat([values, tail_values], dim=1)
        ids = torch.cat([ids, tail_ids + whole], dim=1)
    best_values, best = values.max(dim=-1)
    return best_values, ids.gather(1, best[:, None]).squeeze(1)
