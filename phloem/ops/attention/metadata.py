"""What one model step hands to every attention kernel: the packed tokens and the paged KV layout.

KV cache layout (one tensor per layer, FlashInfer's "NHD" paged layout):
    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
A token's *slot* is `block_id * block_size + offset_in_block`. Kernels always see that shape; its
memory may be head-major instead (`CacheConfig.kv_layout="HND"`: a strided view, see
`ops/kv_store.py`), so they index through the strides.

The tokens of one step are packed: the step holds B sequences, sequence b contributes the query
tokens `query_start_loc[b] : query_start_loc[b+1]`, which are its *last* q_len_b tokens, so

    |------------- seq_lens[b] (KV length after this step) -------------|
    |-- already in the KV cache --|--- q_len_b tokens computed now ---|

and query token i of sequence b sits at position seq_lens[b] - q_len_b + i (causal: it attends to
KV positions 0 .. that position). Prefill chunks (q_len > 1) and decode tokens (q_len = 1) mix
freely in one step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from phloem.ops.staging import to_device


@dataclass
class AttentionMetadata:
    """Per-step attention inputs; T = tokens in the step, B = sequences in the step.

    Attributes:
        slot_mapping: int64 [T]; KV slot each new token's K/V is written to (-1 = skip: padding
            of hand-built steps; the runners' steps have none, `ForwardContext.valid_slots`).
        query_start_loc: int32 [B + 1]; cumulative query lengths (CSR offsets into the T tokens).
        seq_lens: int32 [B]; KV length of each sequence including this step's tokens [tokens].
        block_tables: int32 [B, max_blocks_per_seq]; block ids of each sequence, 0-padded.
        block_size: tokens per KV block.
        max_query_len: max q_len over the B sequences [tokens].
        max_seq_len: max seq_lens [tokens].
        query_start_loc_cpu / seq_lens_cpu: the same offsets as Python lists, for host-side loops.
        block_tables_cpu: the block ids of each sequence as Python lists (unpadded, at least
            ceil(seq_lens[b] / block_size) ids each), for backends that plan on the host
            (FlashInfer); None when the builder of the metadata did not provide them.
        prefix_lens_cpu: per sequence, the tokens at the start of its block table that are its
            prefix group's shared blocks (0 for none); read by the shared-prefix backend
            (`shared_prefix.py`) to batch a group's queries against the prefix KV once.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_tables_cpu: list[list[int]] | None = None
    prefix_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def from_host(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str | None = None,
        *,
        slot_mapping: torch.Tensor | None = None,
        padded_tables: bool = False,
        prefix_lens: list[int] | None = None,
        placeholder: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """A step's metadata from host lists (B = len(seq_lens)); the one way it is built.

        Args:
            query_lens: [B] tokens each sequence computes this step; seq_lens: [B] its KV
                length after the step; block_tables: [B] its block ids (unpadded, not copied:
                read only) [tokens, blocks].
            device: where `query_start_loc` and `seq_lens` are copied (staged through pinned
                memory, no host wait); None leaves every device field empty (host planning).
            slot_mapping: int64 [T] on the device, already built (empty when None).
            padded_tables: also copy the 0-padded int32 [B, max blocks] table (for backends
                that read it, `needs_block_tables`); else it is empty.
            prefix_lens: [B] shared-prefix tokens per sequence (`prefix_lens_cpu`).
            placeholder: a device tensor that stands for `query_start_loc`, `seq_lens` and
                `block_tables` (CUDA-graph replays: a planning backend reads only the host lists
                and the graph's own buffers, so nothing is copied).
        """
        qsl = [0, *itertools.accumulate(query_lens)]
        empty = torch.empty(0, dtype=torch.int32, device=device)
        if placeholder is not None:
            dev_qsl = dev_seq_lens = tables = placeholder
        elif device is None:
            dev_qsl = dev_seq_lens = tables = empty
        else:
            dev_qsl = to_device(np.array(qsl, dtype=np.int32), device)
            dev_seq_lens = to_device(np.array(seq_lens, dtype=np.int32), device)
            tables = _padded_tables(block_tables, device) if padded_tables else empty
        return cls(
            slot_mapping=empty if slot_mapping is None else slot_mapping,
            query_start_loc=dev_qsl,
            seq_lens=dev_seq_lens,
            block_tables=tables,
            block_size=block_size,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            block_tables_cpu=block_tables,
            prefix_lens_cpu=prefix_lens,
        )


def _padded_tables(block_tables: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """int32 [B, max len] of the tables, 0-padded, on `device` (one staged copy)."""
    width = max(map(len, block_tables), default=0)
    padded = np.zeros((len(block_tables), width), dtype=np.int32)
    for row, table in zip(padded, block_tables):
        row[: len(table)] = table
    return to_device(padded, device)
