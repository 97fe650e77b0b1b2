"""The prefill split of an eager shared-prefix step: long ungrouped prefill chunks on another backend.

Prefill chunks are compute-bound, where a library kernel tuned per GPU beats our portable tiles
(FlashInfer's Hopper "fa3" kernels; `get_attention_backend` sets one up on Hopper GPUs). On an
eager step that takes the shared path, the sequences without a group and with at least
`min_query_len` queries (group leaders computing a prefix, members computing their own prompt)
are planned as a sub-step of their own on that backend; our kernel computes the rest of the step
and leaves their output rows to it:

    step tokens   |-- decode / short chunks (ours) --|-- long chunk (prefill backend) --|-- ... --|
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from phloem.ops.attention.interface import AttentionBackend
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata
from phloem.ops.staging import to_device


class SplitPlan(NamedTuple):
    """One step's split: `exclude` (bool [B]) marks the sequences the prefill backend computes;
    `index` their query tokens (a slice when contiguous, else an int64 index tensor); `sub` the
    sub-step's metadata, planned on the prefill backend."""

    exclude: np.ndarray
    index: Any
    sub: AttentionMetadata


class PrefillSplit:
    """Plans and runs the split part of a shared step (see the module docstring).

    Args:
        backend: the plain backend for the split-off chunks; its `forward` takes `out=`.
        min_query_len: the fewest queries of a chunk that goes to it [tokens].
    """

    def __init__(self, backend: AttentionBackend, min_query_len: int = 64) -> None:
        self.backend = backend
        self.min_query_len = min_query_len

    def plan(self, meta: AttentionMetadata, groups: SharedPrefixMetadata) -> SplitPlan | None:
        """The split of a shared step with these groups, planned on the backend (its
        `begin_step` on the sub-step); None when no chunk qualifies."""
        qsl, bs = meta.query_start_loc_cpu, meta.block_size
        seqs = [
            b for b in range(meta.num_seqs)
            if groups.seq_group[b] < 0 and qsl[b + 1] - qsl[b] >= self.min_query_len
        ]  # fmt: skip
        if not seqs:
            return None
        tables = meta.block_tables_cpu
        if tables is None:
            tables = meta.block_tables.tolist()
        seq_lens = [meta.seq_lens_cpu[b] for b in seqs]
        sub = AttentionMetadata.from_host(
            [qsl[b + 1] - qsl[b] for b in seqs], seq_lens,
            [tables[b][: -(-n // bs)] for b, n in zip(seqs, seq_lens)], bs, device="cpu",
            padded_tables=self.backend.needs_block_tables,
        )  # fmt: skip
        if all(qsl[a + 1] == qsl[b] for a, b in zip(seqs, seqs[1:])):
            index: Any = slice(qsl[seqs[0]], qsl[seqs[-1] + 1])
        else:  # the chunks' token indices, uploaded once for the step's layers
            tokens = np.concatenate([np.arange(qsl[b], qsl[b + 1]) for b in seqs])
            index = to_device(tokens, meta.query_start_loc.device)
        self.backend.begin_step(sub)
        exclude = np.zeros(meta.num_seqs, dtype=bool)
        exclude[seqs] = True
        return SplitPlan(exclude, index, sub)

    def run(
        self,
        split: SplitPlan,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> SplitPlan:
        """Write the split-off chunks' attention into `out` (in place when their tokens are
        contiguous, else gathered and scattered; `kv_scales`: an FP8 cache's (k_scale,
        v_scale)). Returns the plan to keep for the step's next layers (its index moved to the
        query's device when the metadata was built elsewhere)."""
        index, sub = split.index, split.sub
        if isinstance(index, slice):
            self.backend.forward(query[index], kv_cache, sub, scale, out[index], *kv_scales)
            return split
        if index.device != query.device:  # metadata built on another device (tests): once
            index = index.to(query.device)
            split = split._replace(index=index)
        attn = self.backend.forward(
            query.index_select(0, index), kv_cache, sub, scale, None, *kv_scales
        )
        out.index_copy_(0, index, attn)
        return split

    def end_step(self) -> None:
        """Forget the backend's sub-step plan."""
        self.backend.end_step()
