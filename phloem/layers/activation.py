"""Gated activations for fused gate/up projections."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from phloem.layers.compilable import Compilable


class SiluAndMul(Compilable):
    """x = [gate | up] along the last dim (each half d) -> silu(gate) * up, shape [..., d].

    On CUDA with Triton, one fused kernel (`phloem.ops.activation.silu_and_mul`, float32 math,
    one rounding); elsewhere two torch ops (as transformers computes it).
    """

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and _fused() is not None:
            return _fused()(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


@functools.cache
def _fused():
    """The Triton SiLU-and-mul, or None where Triton does not import."""
    try:
        from phloem.ops.activation import silu_and_mul
    except ImportError:
        return None
    return silu_and_mul
