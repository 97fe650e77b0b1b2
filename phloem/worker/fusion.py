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

Under FP8 W8A8 (`quantization="fp8"`) the linear layers after the two RMSNorms and after
SiLU-and-mul quantize their input per token; `fuse_fp8_input_quant` has those producers emit
their output already quantized (one Triton kernel each on CUDA: `phloem/ops/fp8_fused_quant.py`),
so the quantizer's extra pass over every activation goes away.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

# (producer, consumer) module names relative to their common parent, where the producer's
# output is read by the consumer only: the Llama-family decoder layer (llama.py, and the
# qwen2/qwen3 models built from its blocks), in vLLM's / HF's module names.
FP8_INPUT_PAIRS = (
    ("input_layernorm", "self_attn.qkv_proj"),
    ("post_attention_layernorm", "mlp.gate_up_proj"),
    ("act_fn", "down_proj"),
)


def fuse_fp8_input_quant(model: nn.Module) -> int:
    """Have each producer of `FP8_INPUT_PAIRS` (an RMSNorm or SiluAndMul) whose consumer
    takes pre-quantized input (`LinearMethod.accepts_fp8_input`: FP8 with per-token dynamic
    scales over a whole row) return its output as an `Fp8Activation` (`emit_fp8`; mutates
    them). The consumer then skips its own quantization; the numbers are the same (the e4m3
    values and scales of the producer's model-dtype output). Returns how many producers emit
    FP8; 0 when PHLOEM_FP8_FUSED_QUANT=0.

    A pair is matched by name, so it holds only where the named producer's output feeds
    nothing but the named linear layer: true of every architecture phloem registers; an
    architecture where it is not must use other names or not be passed here."""
    if os.environ.get("PHLOEM_FP8_FUSED_QUANT", "1") == "0":
        return 0
    from phloem.layers.activation import SiluAndMul
    from phloem.layers.linear import LinearBase
    from phloem.layers.norm import RMSNorm

    consumers = dict(FP8_INPUT_PAIRS)
    modules = dict(model.named_modules())
    count = 0
    for name, producer in modules.items():
        parent, _, leaf = name.rpartition(".")
        if not isinstance(producer, (RMSNorm, SiluAndMul)) or leaf not in consumers:
            continue
        consumer = modules.get(f"{parent}.{consumers[leaf]}" if parent else consumers[leaf])
        if isinstance(consumer, LinearBase) and consumer.quant_method.accepts_fp8_input(consumer):
            producer.emit_fp8()
            count += 1
    return count


def compile_elementwise_layers(model: nn.Module) -> int:
    """Fuse FP8 input quantization into its producers (`fuse_fp8_input_quant`), then hand each
    RMSNorm instance of `model` (and RotaryEmbedding and SiluAndMul where their Triton kernels
    are unavailable) a compiled version of its `compute` (`Compilable.use_compiled`: mutates
    the instances; compiles lazily on first call). Returns how many instances got a compiled
    function; 0 when PHLOEM_TORCH_COMPILE=0."""
    fp8_producers = fuse_fp8_input_quant(model)
    if fp8_producers:
        logger.info("FP8: %d norms and activations quantize their own output", fp8_producers)
    if os.environ.get("PHLOEM_TORCH_COMPILE", "1") == "0":
        return 0
    from phloem.layers.activation import SiluAndMul, _fused
    from phloem.layers.attention import _fused_rope_kv
    from phloem.layers.compilable import Compilable
    from phloem.layers.norm import RMSNorm
    from phloem.layers.rotary import RotaryEmbedding

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    # SiLU-and-mul and RoPE (fused with the KV write) have hand-written Triton kernels on CUDA
    # (phloem/ops/activation.py, phloem/ops/rope_kv.py: they run at HBM bandwidth, where
    # inductor's do not); compile those layers only where the kernels are missing.
    classes: tuple[type[Compilable], ...] = (RMSNorm,)
    classes += (RotaryEmbedding,) if _fused_rope_kv() is None else ()
    classes += (SiluAndMul,) if _fused() is None else ()
    compiled: dict[type[nn.Module], Callable[..., Any]] = {
        cls: torch.compile(cls.compute, dynamic=True) for cls in classes
    }
    count = 0
    for module in model.modules():
        fn = compiled.get(type(module))
        if fn is not None and isinstance(module, Compilable):  # always, for a key of `compiled`
            module.use_compiled(fn)  # the layers' declared seam (`layers/compilable.py`)
            count += 1
    logger.info(
        "torch.compile: %d elementwise layers share %d compiled functions", count, len(compiled)
    )
    return count
