"""Fusing the elementwise layers between the GEMMs with torch.compile (inductor), on CUDA.

Eagerly, one decoder layer of batch-1 decode launches dozens of small kernels (RMSNorm with the
residual add, RoPE's slicing and float casts, SiLU * up) next to its 4 GEMMs (RoPE and SiLU * up
have Triton kernels of their own on CUDA, so only RMSNorm is compiled there); each costs a launch
slot of microseconds even inside a CUDA graph, which over all layers is a large share of a decode
step whose GEMMs only read the weights once. Compiling just these layers fuses each into one or
two Triton kernels without tracing attention, KV writes or the model's loops (the step time
before and after: benchmarks/results/2026-11-22-h100/README.md).

One compiled function per layer class is shared by every instance (the instance is an argument,
its tensors graph inputs and its equal integer attributes constants), with dynamic shapes, so the
whole model costs a few compiles, whatever the number of layers and batch sizes.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)


def compile_elementwise_layers(model: nn.Module) -> int:
    """Hand each RMSNorm instance of `model` (and RotaryEmbedding and SiluAndMul where their
    Triton kernels are unavailable) a compiled version of its `compute`
    (`Compilable.use_compiled`: mutates the instances; compiles lazily on first call). Returns
    how many instances got one; 0 when PHLOEM_TORCH_COMPILE=0."""
    if os.environ.get("PHLOEM_TORCH_COMPILE", "1") == "0":
        return 0
    from phloem.layers.activation import SiluAndMul, _fused
    from phloem.layers.attention import _fused_rope_kv
    from phloem.layers.norm import RMSNorm
    from phloem.layers.rotary import RotaryEmbedding

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    # SiLU-and-mul and RoPE (fused with the KV write) have hand-written Triton kernels on CUDA
    # (phloem/ops/activation.py, phloem/ops/rope_kv.py: they run at HBM bandwidth, where
    # inductor's do not); compile those layers only where the kernels are missing.
    classes = (RMSNorm,)
    classes += (RotaryEmbedding,) if _fused_rope_kv() is None else ()
    classes += (SiluAndMul,) if _fused() is None else ()
    compiled = {cls: torch.compile(cls.compute, dynamic=True) for cls in classes}
    count = 0
    for module in model.modules():
        fn = compiled.get(type(module))
        if fn is not None:
            module.use_compiled(fn)  # the layers' declared seam (`layers/compilable.py`)
            count += 1
    logger.info(
        "torch.compile: %d elementwise layers share %d compiled functions", count, len(compiled)
    )
    return count
