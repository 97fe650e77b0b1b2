"""Token embedding and the LM head, vocab-parallel under tensor parallelism (Megatron-LM,
Shoeybi et al. 2019, §3).

Rank r of tp holds vocabulary rows [r * V_r, (r + 1) * V_r) with V_r = ceil(V / tp); the last
rank's rows past V are zero padding. The embedding looks up the ids in its range (the others give
zeros) and sums over the ranks (one all-reduce); the LM head computes its slice of the logits
and all-gathers them, so every rank holds the whole [N, V] logits (every rank samples, see
`phloem.engine.tp_executor`). At tp_size 1 both are the plain lookup and matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phloem.distributed.communication import tp_all_gather, tp_all_reduce
from phloem.layers.linear import CheckpointParts, Loaded, WeightShardId, _check_no_shard, _tp_world


class _VocabShard(nn.Module):
    """The vocabulary rows of this rank: `weight` [V_r, embedding_dim] and its loader."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = _tp_world()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = min(self.tp_rank * self.rows_per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, embedding_dim, dtype=dtype), False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.weight.checkpoint_parts = self.checkpoint_parts  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Loaded, shard_id: WeightShardId = None
    ) -> None:
        """Copy this rank's rows of the [V, embedding_dim] checkpoint tensor (only those are read
        from a `CheckpointSlice`); padding rows are zeroed.

        Raises:
            ValueError: for a shard id or a checkpoint tensor of another shape.
        """
        _check_no_shard(self, shard_id)
        full = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != full:
            raise ValueError(
                f"{type(self).__name__}: checkpoint tensor has shape "
                f"{tuple(loaded_weight.shape)}, expected {full}"
            )
        rows = self.vocab_end - self.vocab_start
        part = loaded_weight.narrow(0, self.vocab_start, rows)
        param.data[:rows].copy_(part)
        param.data[rows:].zero_()

    def checkpoint_parts(self, param: nn.Parameter) -> CheckpointParts:
        return [(None, (self.num_embeddings, self.embedding_dim))]

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, rows=[{self.vocab_start}, {self.vocab_end})"


class VocabEmbedding(_VocabShard):
    """token id -> row of the embedding matrix.

    Args:
        num_embeddings: vocabulary size [tokens]; embedding_dim: hidden size.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [T] -> [T, embedding_dim] in the weight dtype."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class LMHead(_VocabShard):
    """hidden -> vocabulary logits. With tied embeddings, `tie(embedding)` shares the weight."""

    def tie(self, embedding: VocabEmbedding) -> None:
        """Share `embedding.weight` (HF `tie_word_embeddings`); loading either name fills both
        (the same rows: both split the vocabulary alike)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, embedding_dim] -> logits [N, vocab] in the weight dtype (under tensor
        parallelism, gathered from every rank's slice). Not upcast here: the sampler's greedy
        path takes argmax of these as they are (upcasting is exact and monotone) and its other
        paths upcast to float32 themselves (a float32 copy of the logits of a 2,048-row step
        over a 128K vocabulary is 1 GiB written, then read by the argmax)."""
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        logits = tp_all_gather(logits, dim=-1)
        if logits.shape[-1] != self.num_embeddings:  # the last rank's padding rows
            logits = logits[..., : self.num_embeddings]
        return logits
