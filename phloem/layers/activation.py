"""Gated activations for fused gate/up projections, optionally fused with the per-token FP8
quantization of their output (`SiluAndMul.emit_fp8`)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from phloem.layers.compilable import Compilable
from phloem.layers.quantization.fp8_math import MIN_SCALE, Fp8Activation


class SiluAndMul(Compilable):
    """x = [gate | up] along the last dim (each half d) -> silu(gate) * up, shape [..., d].

    On CUDA with Triton, one fused kernel (`phloem.ops.activation.silu_and_mul`, float32 math,
    one rounding); elsewhere two torch ops (as transformers computes it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.fp8_output = False  # see `emit_fp8`

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and _fused() is not None:
            return _fused()(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def emit_fp8(self) -> None:
        """From now on return silu(gate) * up as an `Fp8Activation` (quantized per token,
        dynamically: the e4m3 values and scales `fp8_math.quantize_per_token` gives for the
        model-dtype output), for an activation whose output only an FP8 linear layer reads
        (`LinearMethod.accepts_fp8_input`). On CUDA one Triton kernel computes both
        (`phloem.ops.fp8_fused_quant.silu_and_mul_quant`); elsewhere the activation is followed
        by the quantization. Mutates the layer."""
        self.fp8_output = True

    def forward(self, x: torch.Tensor) -> torch.Tensor | Fp8Activation:
        """x [..., 2d] -> [..., d]: a tensor, or an `Fp8Activation` after `emit_fp8`."""
        if not self.fp8_output:
            return super().forward(x)
        kernel, max_columns = _fused_quant()
        d = x.shape[-1] // 2
        if kernel is not None and x.is_cuda and d <= max_columns:
            q, scale = kernel(x.reshape(-1, 2 * d).contiguous(), MIN_SCALE)
            lead = x.shape[:-1]
            return Fp8Activation(q.view(*lead, d), scale.view(*lead, 1), x.dtype)
        return Fp8Activation.per_token(super().forward(x))


@functools.cache
def _fused():
    """The Triton SiLU-and-mul, or None where Triton does not import."""
    try:
        from phloem.ops.activation import silu_and_mul
    except ImportError:
        return None
    return silu_and_mul


@functools.cache
def _fused_quant():
    """(the Triton SiLU-and-mul + per-token FP8 quantization, the widest output row it takes),
    or (None, 0) where Triton does not import."""
    try:
        from phloem.ops.fp8_fused_quant import MAX_FUSED_COLUMNS, silu_and_mul_quant
    except ImportError:
        return None, 0
    return silu_and_mul_quant, MAX_FUSED_COLUMNS
