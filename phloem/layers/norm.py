"""RMSNorm, optionally fused with the residual add that precedes it (as in HF Llama), and
optionally with the per-token FP8 quantization of its output (`emit_fp8`)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from phloem.distributed.communication import tp_all_reduce
from phloem.distributed.parallel_state import tp_fused_norm_all_reduce
from phloem.layers.compilable import Compilable
from phloem.layers.quantization.fp8_math import MIN_SCALE, Fp8Activation


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
        self.fp8_output = False  # see `emit_fp8`
        # True: x is a row-parallel layer's partial sum, all-reduced here first (see `forward`)
        self.reduces_input = False
        # which of the fused all-reduce's two buffer slots this norm uses (0 after o_proj, 1
        # after down_proj: consecutive calls alternate; `symm_norm_all_reduce.py`)
        self.reduce_slot = 0

    def emit_fp8(self) -> None:
        """From now on return the normalized tensor as an `Fp8Activation` (quantized per token,
        dynamically: the e4m3 values and scales `fp8_math.quantize_per_token` gives for the
        model-dtype output), for a norm whose output only an FP8 linear layer reads
        (`LinearMethod.accepts_fp8_input`). On CUDA one Triton kernel computes the residual
        add, the norm and the quantization (`phloem.ops.fp8_fused_quant.rms_norm_quant`);
        elsewhere the norm is followed by the quantization. Mutates the layer."""
        self.fp8_output = True

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | Fp8Activation | tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        """`compute`'s contract (through the compiled function where one was given), the
        normalized tensor being an `Fp8Activation` after `emit_fp8`. When `reduces_input`, x
        is first summed over the tensor-parallel ranks: in one kernel with the residual add and
        the norm where the group has one and the message fits it
        (`phloem.distributed.fused_norm_all_reduce`, `symm_norm_all_reduce`), else by the
        group's all-reduce."""
        if self.reduces_input:
            fused = tp_fused_norm_all_reduce()
            if (
                fused is not None
                and residual is not None
                and not self.fp8_output
                and fused.fits(x, residual)
            ):
                return fused(x, residual, self.weight, self.eps, self.reduce_slot)
            x = tp_all_reduce(x)
        if self.fp8_output:
            return self._forward_fp8(x, residual)
        return super().forward(x) if residual is None else super().forward(x, residual)

    def _forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None):
        kernel, max_columns = _fused_norm_quant()
        k = x.shape[-1]
        if kernel is not None and x.is_cuda and x.dtype == self.weight.dtype and k <= max_columns:
            res = None if residual is None else residual.reshape(-1, k).contiguous()
            q, scale, res = kernel(x.reshape(-1, k).contiguous(), self.weight, self.eps,
                                   MIN_SCALE, res)  # fmt: skip
            out = Fp8Activation(q.view(x.shape), scale.view(*x.shape[:-1], 1), x.dtype)
            return out if res is None else (out, res.view(x.shape))
        if residual is None:
            return Fp8Activation.per_token(super().forward(x))
        normed, residual = super().forward(x, residual)
        return Fp8Activation.per_token(normed), residual

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


@functools.cache
def _fused_norm_quant():
    """(the Triton RMSNorm + per-token FP8 quantization, the widest row it takes), or
    (None, 0) where Triton does not import."""
    try:
        from phloem.ops.fp8_fused_quant import MAX_FUSED_COLUMNS, rms_norm_quant
    except ImportError:
        return None, 0
    return rms_norm_quant, MAX_FUSED_COLUMNS
