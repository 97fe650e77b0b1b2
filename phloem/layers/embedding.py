"""Token embedding and the LM head (vocab-parallel later; tp_size is 1 now)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phloem.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    """token id -> row of the embedding matrix.

    Args:
        num_embeddings: vocabulary size [tokens]; embedding_dim: hidden size.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [T] -> [T, embedding_dim] in the weight dtype."""
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden -> vocabulary logits. With tied embeddings, `tie(embedding)` shares the weight."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def tie(self, embedding: VocabEmbedding) -> None:
        """Share `embedding.weight` (HF `tie_word_embeddings`); loading either name fills both."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, embedding_dim] -> logits [N, vocab] in the weight dtype. Not upcast here:
        the sampler's greedy path takes argmax of these as they are (upcasting is exact and
        monotone) and its other paths upcast to float32 themselves (a float32 copy of the logits of
        a 2,048-row step over a 128K vocabulary is 1 GiB written, then read by the argmax)."""
        return F.linear(hidden, self.weight)
