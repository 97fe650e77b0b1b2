"""Per-token FP8 (e4m3) quantization of activations as one Triton kernel, imported lazily.

The eager form (`phloem.layers.quantization.fp8_math.quantize_per_token`) reads x for its
maxima, then divides into an fp32 temporary and casts that: about 13 bytes moved per bf16
element. This kernel reads each row twice (maxima, then quantize; the second read is mostly
served from L2) and writes the fp8 row once: 5 bytes per element. Its arithmetic is the eager
form's, with IEEE-rounded divisions (`div_rn`), so both produce the same bytes and scales.

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
# the kernel's copy: a jitted Triton function reads only constexpr globals
_FP8_MAX_TL = tl.constexpr(FP8_MAX)


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, k, s_x, s_q, min_scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, k, BLOCK):
        ok = start + cols < k
        x = tl.load(x_ptr + row * s_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), _FP8_MAX_TL), min_scale)
    tl.store(s_ptr + row, scale)
    for start in range(0, k, BLOCK):
        ok = start + cols < k
        x = tl.load(x_ptr + row * s_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.math.div_rn(x, scale)
        tl.store(q_ptr + row * s_q + start + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


@triton.jit
def store_row_quantized(y, ok, q_ptrs, s_ptr, min_scale):
    """Quantize one token's row per token and store it (for kernels that hold a whole row):
    y fp32 [BLOCK] (0 where not `ok`) -> scale = max(max |y| / 448, min_scale) at s_ptr and
    y / scale, cast to e4m3 (round to nearest even), at q_ptrs where `ok`. The arithmetic of
    `_per_token_quant_kernel` (IEEE-rounded divisions), so the same bytes and scales."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), _FP8_MAX_TL), min_scale)
    tl.store(s_ptr, scale)
    tl.store(q_ptrs, tl.math.div_rn(y, scale).to(q_ptrs.dtype.element_ty), mask=ok)


def per_token_quant(
    x: torch.Tensor, min_scale: float, block: int = 2048
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (float dtypes, last dim contiguous) -> (float8_e4m3fn [T, K], fp32 [T, 1]):
    scale = max(max |x_t| / 448, min_scale) per row, q = x / scale rounded to nearest even.

    Raises:
        ValueError: if x is not 2-D with a contiguous last dimension.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"per_token_quant needs a 2-D x with a contiguous last dim, {x.shape}")
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _per_token_quant_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0), min_scale,
                                         BLOCK=min(block, triton.next_power_of_2(k)),
                                         num_warps=8)  # fmt: skip
    return q, scale


def compile_variants(width: int, dtype: torch.dtype) -> None:
    """Call `per_token_quant` once on a CPU row of `width` columns, for
    `phloem.worker.triton_prebuild`'s compile-only driver: the launch records the variant the
    engine compiles and runs nothing (see `phloem.ops.rope_kv.compile_variants`)."""
    per_token_quant(torch.zeros(1, width, dtype=dtype), 1.0)
