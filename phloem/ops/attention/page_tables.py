"""A step's page table as FlashInfer's kernels read it, built on the host from the block tables:
FlashInfer's CSR layout (`paged_kv_layout`: its prefill and decode wrappers) and the dense
[B, pages] table of its XQA decode kernel (`dense_page_table`). For sequence b the pages are its
first ceil(L_b / block_size) block ids and the last page holds L_b - (n_pages - 1) * block_size
tokens:

    |-- page 0 --|-- page 1 --| ... |-- last page (last_page_len tokens) --|
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.staging import pinned


def paged_kv_layout(
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table of a step, on the host.

    Returns:
        (kv_indptr int32 [B + 1], kv_indices int32 [kv_indptr[-1]], last_page_len int32 [B]).
    Raises:
        ValueError: if the metadata lacks `block_tables_cpu` or a table is too short.
    """
    bs = meta.block_size
    tables = meta.block_tables_cpu
    if tables is None:
        tables = meta.block_tables.tolist()  # one device sync; builders should pass host tables
    seq_lens = np.array(meta.seq_lens_cpu, dtype=np.int64)
    num_pages = (seq_lens + bs - 1) // bs
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    short = np.flatnonzero(lengths < num_pages)
    if short.size:
        b = int(short[0])
        raise ValueError(f"sequence {b}: block table has {lengths[b]} blocks, needs {num_pages[b]}")
    pages = num_pages.tolist()
    total = int(num_pages.sum())
    indices = np.fromiter(
        itertools.chain.from_iterable(itertools.starmap(_head, zip(tables, pages))),
        dtype=np.int32,
        count=total,
    )
    indptr = np.zeros(len(pages) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    last = (seq_lens - (num_pages - 1) * bs).astype(np.int32)
    return pinned(indptr), pinned(indices), pinned(last)


def _head(table: list[int], n: int) -> list[int]:
    return table if len(table) == n else table[:n]


def dense_page_table(meta: AttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
    """A step's page table as XQA reads it, on the host: row b holds sequence b's first
    ceil(L_b / block_size) block ids, then zeros (never read) up to the step's longest.

    Returns:
        (table int32 [B, max(1, longest page count)], seq_lens int32 [B]).
    Raises:
        ValueError: as `paged_kv_layout`, for a block table too short for its length.
    """
    indptr, indices, _ = (t.numpy() for t in paged_kv_layout(meta))
    pages = np.diff(indptr)
    table = np.zeros((len(pages), max(1, int(pages.max(initial=0)))), dtype=np.int32)
    rows = np.repeat(np.arange(len(pages)), pages)
    table[rows, np.arange(len(indices)) - indptr[:-1][rows]] = indices
    return table, np.asarray(meta.seq_lens_cpu, dtype=np.int32)
