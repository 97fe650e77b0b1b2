"""FP8 (e4m3) quantization arithmetic and the two GEMMs that use it, as plain functions.

Symmetric scaling, as in vLLM's and llm-compressor's FP8 W8A8 (Micikevicius et al., "FP8
Formats for Deep Learning", arXiv 2209.05433, §3: e4m3 for weights and activations): a tensor x
with scale s is stored as q = clamp(x / s, -448, 448) cast to float8_e4m3fn (round to nearest
even), and read back as q * s. Weights get one fp32 scale per output channel (row), activations
one per token (row of the [T, K] input), computed in the step from the token's max |x|.

`fp8_linear_reference` is the CPU path and the oracle: it quantizes the activations exactly as
the GPU path does, dequantizes both operands to fp32, multiplies in fp32 and casts to the output
dtype. `fp8_linear_scaled_mm` is the CUDA path (`torch._scaled_mm`, row-wise scales: cuBLASLt /
CUTLASS FP8 tensor-core GEMM, fp32 accumulation). Both take the activations either in the model
dtype or as an `Fp8Activation`: already quantized per token by the layer that produced them (an
RMSNorm or SiLU-and-mul fused with the quantization, `phloem/worker/fusion.py`), which skips the
quantization pass.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# The smallest scale: keeps a row whose max |x| is 0 from dividing by 0 (its values quantize to
# 0 either way), and is far below any real row's max / 448, so no row loses precision to it.
MIN_SCALE = 1e-12
# torch._scaled_mm on CUDA needs K and N to be multiples of this (cuBLASLt alignment).
SCALED_MM_ALIGNMENT = 16


def quantize(x: torch.Tensor, scale: torch.Tensor, saturate: bool = True) -> torch.Tensor:
    """x (any float dtype) / scale (fp32, broadcast), computed in fp32 (x / scale promotes: one
    kernel, no fp32 copy of x first), as float8_e4m3fn, rounded to nearest even.

    Args:
        saturate: clamp to +-448 first. Needed for a scale not derived from x (a static one):
            CUDA's cast turns values of 464 and above into NaN. A scale of max |x| / 448 keeps
            every quotient within fp32 rounding of 448, which rounds to 448, so dynamic
            quantization skips the clamp (one pass over the tensor less).
    """
    y = x / scale.float()
    if saturate:
        y = y.clamp_(-FP8_MAX, FP8_MAX)
    return y.to(FP8_DTYPE)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """fp32 [R, 1] scales of the rows of a 2-D tensor: max |x| over the row / 448 (one
    reduction kernel: the inf-norm)."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True).float()
    return (amax / FP8_MAX).clamp_(min=MIN_SCALE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization of activations x [T, K] -> (fp8 [T, K], fp32 [T, 1]).
    On CUDA one Triton kernel (`phloem.ops.fp8_quant`, the same bytes and scales)."""
    if x.is_cuda and x.stride(-1) == 1 and _fused_quant() is not None:
        return _fused_quant()(x, MIN_SCALE)
    scale = row_scales(x)
    return quantize(x, scale, saturate=False), scale


@dataclass(frozen=True)
class Fp8Activation:
    """Activations quantized per token: what an FP8 linear layer multiplies, handed to it
    instead of x [..., K] in the model dtype (by a producer fused with the quantization, or by
    `quantize_input`). The values are data * scale.

    Attributes:
        data: float8_e4m3fn [..., K]; scale: fp32 [..., 1], one per token (row);
        dtype: the model dtype x had, which the layer's output takes.
    """

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """x's shape [..., K] (the callers that read a hidden state's shape keep working)."""
        return self.data.shape

    @staticmethod
    def per_token(x: torch.Tensor) -> Fp8Activation:
        """x [..., K] quantized per token, dynamically (`quantize_per_token`)."""
        q, scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
        return Fp8Activation(q.view(x.shape), scale.view(*x.shape[:-1], 1), x.dtype)


def quantize_input(
    x: torch.Tensor | Fp8Activation, input_scale: torch.Tensor | None = None
) -> Fp8Activation:
    """The GEMMs' activation operand: x as given when it is already an `Fp8Activation`, else
    x [..., K] quantized per token, dynamically (`input_scale` None), by one static fp32 scalar
    scale, or by caller-computed fp32 per-token scales [M, 1] (M = x's rows), saturating."""
    if isinstance(x, Fp8Activation):
        return x
    if input_scale is None:
        return Fp8Activation.per_token(x)
    x2 = x.reshape(-1, x.shape[-1])
    # one scale per row: the row-wise GEMM reads [M, 1] (a static scale is broadcast)
    scale = input_scale.float().reshape(-1, 1).expand(x2.shape[0], 1).contiguous()
    q = quantize(x2, scale)
    return Fp8Activation(q.view(x.shape), scale.view(*x.shape[:-1], 1), x.dtype)


@functools.cache
def _fused_quant():
    """The Triton per-token quantizer, or None where Triton does not import."""
    try:
        from phloem.ops.fp8_quant import per_token_quant
    except ImportError:
        return None
    return per_token_quant


def quantize_per_channel(
    w: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel quantization of a weight w [N, K] -> (fp8 [N, K], fp32 [N]).

    Args:
        amax: optional fp32 [N] row maxima to use instead of w's own (a row-parallel shard
            passes the max over every rank's columns, so its scales are the whole row's).
    """
    if amax is None:
        scale = row_scales(w)
    else:
        scale = (amax.float() / FP8_MAX).clamp(min=MIN_SCALE).unsqueeze(1)
    return quantize(w, scale), scale.squeeze(1)


def expand_block_scales(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size):
    """Block scales [ceil(N/bn), ceil(K/bk)] -> one scale per element, fp32 [N, K]."""
    rows = scale.float().repeat_interleave(block[0], dim=0)[: shape[0]]
    return rows.repeat_interleave(block[1], dim=1)[:, : shape[1]]


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, block_k: int | None):
    """fp8 weight [N, K] -> fp32 [N, K]. `scale` is fp32 [N] (per channel) or, with `block_k`,
    fp32 [N, ceil(K / block_k)] (one scale per row and block of block_k columns)."""
    if block_k is None:
        return weight.float() * scale.unsqueeze(1)
    per_column = scale.repeat_interleave(block_k, dim=1)[:, : weight.shape[1]]
    return weight.float() * per_column


def fp8_linear_reference(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """y = dequant(quant(x)) @ dequant(W)^T + b in fp32, cast to x.dtype (the CPU path).

    Args:
        x: [..., K] activations (model dtype), or an `Fp8Activation` (already quantized:
            `input_scale` is then not used); weight: fp8 [N, K];
        weight_scale: fp32 [N], or [N, ceil(K / block_k)] with `block_k`;
        input_scale: None (dynamic per-token scales, computed here), an fp32 scalar (a static
            scale) or fp32 [M, 1] (per-token scales computed by the caller; M = x's rows);
        bias: [N] or None.
    Returns:
        [..., N] in x.dtype.
    """
    a = quantize_input(x, input_scale)
    x_q, x_scale = a.data.reshape(-1, a.shape[-1]), a.scale.reshape(-1, 1)
    out = (x_q.float() * x_scale) @ dequantize_weight(weight, weight_scale, block_k).t()
    if bias is not None:
        out += bias.float()
    return out.to(a.dtype).reshape(*a.shape[:-1], weight.shape[0])


def scaled_mm_supported(weight: torch.Tensor) -> bool:
    """Whether `fp8_linear_scaled_mm` can run this [N, K] weight: on CUDA, N and K multiples of
    `SCALED_MM_ALIGNMENT`."""
    n, k = weight.shape
    return weight.is_cuda and n % SCALED_MM_ALIGNMENT == 0 and k % SCALED_MM_ALIGNMENT == 0


def fp8_linear_scaled_mm(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same product through `torch._scaled_mm` with row-wise scales (CUDA path; also runs on
    the CPU, which tests use to check the call's contract).

    A = quant(x) [M, K] fp8 row-major with scale_a fp32 [M, 1]; B = W^T: the transpose of the
    contiguous [N, K] weight, so column-major [K, N], with scale_b fp32 [1, N]; fp32
    accumulation; out in bfloat16 (the row-wise kernels' output type), cast to x.dtype.

    Args: as `fp8_linear_reference` (per-channel weight scales only).
    """
    a = quantize_input(x, input_scale)
    out = torch._scaled_mm(
        a.data.reshape(-1, a.shape[-1]),
        weight.t(),
        scale_a=a.scale.reshape(-1, 1),
        scale_b=weight_scale.reshape(1, -1),
        out_dtype=torch.bfloat16,
    )
    if bias is not None:
        out = out + bias
    return out.to(a.dtype).reshape(*a.shape[:-1], weight.shape[0])
