"""A minimal stand-in for the model runner: runs a phloem model step by step over a paged KV cache.

Each step appends some tokens to some sequences (a prefill chunk, a whole prompt or one decode
token); blocks come from a shuffled free list so block tables are random and non-contiguous.
"""

from __future__ import annotations

import random
from collections.abc import Hashable

import torch

from phloem.forward_context import ForwardContext, forward_context
from phloem.ops.attention import AttentionMetadata
from phloem.ops.attention.reference import ReferenceAttention


def build_metadata(
    block_ids: list[list[int]],
    q_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_pad: int = 0,
) -> AttentionMetadata:
    """Metadata for sequences whose last q_len tokens (of seq_len) are computed this step."""
    slots: list[int] = []
    qsl = [0]
    for ids, q_len, seq_len in zip(block_ids, q_lens, seq_lens):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + q_len)
    slots += [-1] * num_pad
    width = max(len(ids) for ids in block_ids) + 1  # + 1: padding columns must be ignored
    tables = torch.zeros(len(block_ids), width, dtype=torch.int32)
    for b, ids in enumerate(block_ids):
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        block_size=block_size,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
    )


class PagedHarness:
    """Holds per-layer KV caches, block tables and positions for a set of sequences."""

    def __init__(
        self, model: torch.nn.Module, num_blocks: int = 64, block_size: int = 4, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, 2, block_size, model.num_kv_heads, model.head_dim)
        # NaN-filled so that reading an unwritten slot would poison the output.
        self.kv_caches = [
            torch.full(shape, float("nan"), dtype=dtype) for _ in range(model.num_layers)
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_ids: dict[Hashable, list[int]] = {}
        self.num_computed: dict[Hashable, int] = {}
        self.backend = ReferenceAttention()

    @torch.no_grad()
    def step(
        self, chunks: list[tuple[Hashable, list[int]]], num_pad: int = 0
    ) -> list[torch.Tensor]:
        """Compute `token_ids` of each (seq_id, token_ids) in one packed forward.

        Returns:
            per chunk, float32 logits [len(token_ids), vocab] (one row per computed token).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        tables, q_lens, seq_lens = [], [], []
        for seq_id, tokens in chunks:
            start = self.num_computed.get(seq_id, 0)
            ids = self.block_ids.setdefault(seq_id, [])
            end = start + len(tokens)
            while len(ids) * self.block_size < end:
                ids.append(self.free.pop())
            input_ids += tokens
            positions += range(start, end)
            tables.append(ids)
            q_lens.append(len(tokens))
            seq_lens.append(end)
            self.num_computed[seq_id] = end
        input_ids += [0] * num_pad
        positions += [0] * num_pad
        meta = build_metadata(tables, q_lens, seq_lens, self.block_size, num_pad)
        ctx = ForwardContext(attn_metadata=meta, kv_caches=self.kv_caches, backend=self.backend)
        with forward_context(ctx):
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions))
        logits = self.model.compute_logits(hidden)
        return list(logits[: meta.query_start_loc_cpu[-1]].split(q_lens))
