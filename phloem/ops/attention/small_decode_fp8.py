"""An FP8 (e4m3) cache in phloem's small-decode kernel (`small_decode_triton.py`, issue 18):
which math its launches use (`fp8_mode`; PHLOEM_SMALL_DECODE_FP8: `fp8_launch_defaults`).

An FP8 (e4m3) cache with 16-bit queries computes in float16 by default (F16_MATH, `fp8_math="f16"`,
as the shared-prefix kernel does): the query is pre-scaled by softmax scale * log2(e) in float32
and rounded to float16 (far below 65,504), each K / V tile converts e4m3 -> float16, one exact
`cvt.rn.f16x2.e4m3x2` per 2 elements; k_scale multiplies the scores and v_scale the normalized
output, never the tiles. Converting to bfloat16 instead (`fp8_math="q"`) goes e4m3 -> f16 -> bf16,
a second instruction per element: for sm_90 the inner loop of a 32-token tile is 510 SASS
instructions a warp in bf16 math, 431 in float16, 265 over a bf16 cache (nvdisasm of the CPU
build, benchmarks/results/2026-11-27f-cpu-fp8-kv-decode). What remains above bf16 is V: the P.V
`tl.dot` takes V [BLOCK_N, D] with the reduced token axis strided, which `ldmatrix.trans` serves
for 16-bit elements but not 8-bit ones, so Triton stages the e4m3 tile in shared memory and reads
it back a byte at a time (LDS.U8), converting after the read wherever the source converts it.

`fp8_math="mma"` (FP8_MMA; PHLOEM_SMALL_DECODE_FP8=mma:128 for the engine) multiplies e4m3 by
e4m3 on the tensor cores instead, with the operands swapped as TensorRT-LLM's XQA does: S^T = K q^T
puts BLOCK_N KV tokens on the MMA's M side (>= 64: sm_90's wgmma) and the GQA group, padded to 16,
on N; O^T += V^T P^T with P scaled by 448 and rounded to e4m3 (V^T transposed through shared
memory by byte stores). The query is rounded to e4m3 (clamped, unscaled; the float32 scores carry
softmax scale * log2(e) * k_scale), so its error is that of XQA's math (~3-4% relative against
float64 on random data, vs ~0.3% for "f16"). sm_90 SASS: 785 instructions a warp per 128-token
tile at 4 warps, 785 per 32 tokens a program against 1,060 for a bf16 cache at the engine's
options and 1,724 for "f16".
"""

from __future__ import annotations

import functools
import os

import torch

from phloem.ops.kv_store import FP8_KV_DTYPE

FP8_MATHS = ("f16", "q", "mma")  # `small_decode_launch`'s fp8_math choices
FP8_ENV = "PHLOEM_SMALL_DECODE_FP8"  # "<fp8_math>[:<block_n>]", an FP8 cache's launch defaults


@functools.cache
def fp8_launch_defaults(value: str | None = None) -> tuple[str, int | None]:
    """(fp8_math, block_n or None) of an FP8 cache's launches that do not name fp8_math, from
    `value` (None: PHLOEM_SMALL_DECODE_FP8, read once; cache_clear() re-reads): "f16" (default),
    "q" or "mma", optionally ":<block_n>" (a power of 2 >= 16), e.g. "mma:128" for A/B runs of
    the engine, whose small-decode backend passes no fp8_math.

    Raises:
        ValueError: naming PHLOEM_SMALL_DECODE_FP8 for another value.
    """
    value = os.environ.get(FP8_ENV, "") if value is None else value
    math, sep, block = (value or "f16").partition(":")
    power = block.isdigit() and int(block) >= 16 and int(block) & (int(block) - 1) == 0
    ok = math in FP8_MATHS and (power or not sep)
    if not ok:
        raise ValueError(f"{FP8_ENV} must be <{'|'.join(FP8_MATHS)}>[:<block_n, a power of 2 "
                         f">= 16>], got {value!r}")  # fmt: skip
    return math, int(block) if block else None


def fp8_mode(q_dtype: torch.dtype, kv_dtype: torch.dtype, fp8_math: str | None, block_n: int,
              k_scale: float, v_scale: float) -> tuple[bool, bool, int, float, float]:  # fmt: skip
    """(F16_MATH, FP8_MMA, block_n, k_scale, v_scale) of a launch. An FP8 cache with bf16/fp16
    queries computes in `fp8_math`: "f16" (float16 over a pre-scaled query), "q" (the query's
    dtype) or "mma" (e4m3 x e4m3 on FP8 tensor cores, the query and P rounded to e4m3;
    block_n >= 64 for sm_90's wgmma); None: `fp8_launch_defaults()` (default "f16"; its
    block_n, if any, replaces block_n). Other caches: no FP8 math, scales 1.

    Raises:
        ValueError: for an unknown fp8_math."""
    fp8 = kv_dtype == FP8_KV_DTYPE
    if fp8_math is None:
        fp8_math, env_block_n = fp8_launch_defaults() if fp8 else ("f16", None)
        block_n = env_block_n or block_n
    if fp8_math not in FP8_MATHS:
        raise ValueError(f"fp8_math must be one of {FP8_MATHS}, got {fp8_math!r}")
    if not fp8:
        return False, False, block_n, 1.0, 1.0
    half = q_dtype in (torch.bfloat16, torch.float16)
    return half and fp8_math == "f16", half and fp8_math == "mma", block_n, k_scale, v_scale
