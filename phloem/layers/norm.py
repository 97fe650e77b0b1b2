"""RMSNorm, optionally fused with the residual add that precedes it (as in HF Llama)."""

from __future__ import annotations

import torch
from torch import nn

from phloem.layers.compilable import Compilable


class RMSNorm(Compilable):
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in float32 (HF `LlamaRMSNorm`).

    Args:
        hidden_size: size of the normalized (last) dimension; eps: added to the mean square.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def compute(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize over the last dimension.

        Args:
            x: [..., hidden_size].
            residual: if given, [..., hidden_size]; x + residual (in x's dtype) is normalized.
        Returns:
            norm(x) without `residual`; otherwise (norm(x + residual), x + residual), the second
            being the next residual stream.
        """
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
