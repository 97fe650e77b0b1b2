"""The epilogue of the RoPE + KV-write-fused QKV GEMM (`phloem.ops.skinny_rope`): which output
columns a program computes (rotate-half pairs side by side) and the rotation of a finished tile
with its stores into q and the paged KV cache. Triton jit functions, inlined into the kernels.

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

from phloem.ops.rope_kv import rotate_pair, store_cache


@triton.jit
def paired_cols(pid_n, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The W rows (output columns) of program pid_n, [BLOCK_N] int32, and its first pair: tile
    element t holds pair P = pid_n * BLOCK_N / 2 + t // 2, half t % 2, i.e. column
    head * HEAD_DIM + (t % 2) * HEAD_DIM / 2 + i for P = head * HEAD_DIM / 2 + i. A pair is a
    rotate-half pair (x_i, x_{i + D/2}) of one head, so the tile holds both halves it rotates."""
    t = tl.arange(0, BLOCK_N)
    pair = pid_n * (BLOCK_N // 2) + t // 2
    half_d = HEAD_DIM // 2
    return (pair // half_d) * HEAD_DIM + (t % 2) * half_d + pair % half_d


@triton.jit
def pair_index(pid_n, BLOCK_N: tl.constexpr):
    """The pairs of program pid_n in tile order, [BLOCK_N / 2] int32 (see `paired_cols`)."""
    return pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)


@triton.jit
def rope_kv_store(
    x1, x2, pair, ok, m, pos, slot, q_ptr, cache_ptr, cos_ptr, sin_ptr, s_cos, s_cb, s_ckv,
    s_cs, s_ch, k_scale, v_scale, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """Rotate and store finished QKV outputs: x1 / x2 the first / second half of the pairs
    `pair` (fp32, already rounded to the model dtype as the GEMM writes it), of token rows m
    (position pos, cache slot slot); all of one broadcast shape ([BLOCK_N / 2] with a scalar
    row, or [BLOCK_N / 2, 16] on the tensor cores), stored where `ok`.

    q heads (head < NUM_HEADS) rotate into q_ptr ([M, NUM_HEADS, HEAD_DIM] contiguous), k heads
    rotate and v heads pass through into the cache ([blocks, 2, PAGE, kv heads, HEAD_DIM] by the
    strides s_cb, s_ckv, s_cs, s_ch) at slot (none for slot < 0). The arithmetic is
    `rope_kv._rope_kv_kernel`'s (`rope_kv.rotate_pair`, fp32, from the fp32 table)."""
    half_d = HEAD_DIM // 2
    head = pair // half_d
    i = pair % half_d
    rotated = head < NUM_HEADS + NUM_KV_HEADS
    cos = tl.load(cos_ptr + pos * s_cos + i, mask=ok & rotated, other=1.0)
    sin = tl.load(sin_ptr + pos * s_cos + i, mask=ok & rotated, other=0.0)
    r1, r2 = rotate_pair(x1, x2, cos, sin)
    y1 = tl.where(rotated, r1, x1)
    y2 = tl.where(rotated, r2, x2)
    is_q = head < NUM_HEADS
    q_dst = q_ptr + m * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + i
    q_ty = q_ptr.dtype.element_ty
    tl.store(q_dst, y1.to(q_ty), mask=ok & is_q)
    tl.store(q_dst + half_d, y2.to(q_ty), mask=ok & is_q)
    is_k = rotated & (head >= NUM_HEADS)
    kv_head = tl.where(is_k, head - NUM_HEADS, head - NUM_HEADS - NUM_KV_HEADS)
    kv_dst = (cache_ptr + (slot // PAGE) * s_cb + (slot % PAGE) * s_cs + kv_head * s_ch + i
              + tl.where(is_k, 0, s_ckv))  # fmt: skip
    kv_ok = ok & (head >= NUM_HEADS) & (slot >= 0)
    scale = tl.where(is_k, k_scale, v_scale)
    store_cache(kv_dst, y1, kv_ok, scale, CLAMP, LIMIT)
    store_cache(kv_dst + half_d, y2, kv_ok, scale, CLAMP, LIMIT)
