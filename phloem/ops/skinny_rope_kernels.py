"""The two tile products of the skinny GEMM (`phloem.ops.skinny_gemm`'s `_skinny_fma_kernel` and
`_skinny_dot_kernel`: the same K loops, with their `NORM` variant) for the QKV projection with
RoPE and the KV-cache write as the epilogue (`phloem.ops.skinny_rope`). Each program computes
`block_n` output columns in rotate-half pairs of one head (`skinny_rope_tiles.paired_cols`), so
a finished tile holds both halves of what it rotates; nothing is written but the rotated q and
the cache. Separate kernels (not a constexpr of the plain ones) so that the plain kernels'
signatures and compiled code stay as measured.

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

from phloem.ops.skinny_rope_tiles import pair_index, paired_cols, rope_kv_store
from phloem.ops.skinny_tiles import norm_step, norm_tile, rms_scale, row_times_w, w_tile


@triton.jit
def _finish_rope_row(
    a, q, m, M, K, eps, bias, x_ptr, pos_ptr, slot_ptr, q_ptr, cache_ptr, cos_ptr, sin_ptr,
    s_cos, s_cb, s_ckv, s_cs, s_ch, k_scale, v_scale, pair, N, NORM: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """Row m of a CUDA-core tile: its sum over K (times 1 / rms under NORM, plus the bias)
    rounded to the model dtype as the plain GEMM stores it, split into its pairs, rotated and
    stored (`rope_kv_store`); pair: the tile's pairs, [BLOCK_N / 2] (`pair_index`)."""
    y = tl.sum(a, axis=1) * rms_scale(q, K, eps, NORM) + bias
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(y, (a.shape[0] // 2, 2)))  # a.shape[0]: BLOCK_N
    rows = pair * 0 + m  # the row as a vector (its loads repeat one address: L1 hits)
    m_ok = rows < M
    pos = tl.load(pos_ptr + rows, mask=m_ok, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + rows, mask=m_ok, other=-1).to(tl.int64)
    rope_kv_store(x1, x2, pair, (pair < N // 2) & m_ok, rows, pos, slot, q_ptr, cache_ptr, cos_ptr,
                  sin_ptr, s_cos, s_cb, s_ckv, s_cs, s_ch, k_scale, v_scale, NUM_HEADS,
                  NUM_KV_HEADS, HEAD_DIM, PAGE, CLAMP, LIMIT)  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rope_fma_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, nw_ptr, ro_ptr, pos_ptr, slot_ptr, q_ptr, cache_ptr, cos_ptr,
    sin_ptr, M, N, K, s_xm, s_wn, eps, s_cos, s_cb, s_ckv, s_cs, s_ch, k_scale, v_scale,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """`_skinny_fma_kernel` (one split of K) over program n's paired columns, then each row's
    RoPE + KV-write epilogue (`_finish_rope_row`). N = (NUM_HEADS + 2 NUM_KV_HEADS) HEAD_DIM."""
    pid_n = tl.program_id(0)
    rn = paired_cols(pid_n, BLOCK_N, HEAD_DIM)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * s_wn + rk[None, :]
    a0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    a1, a2, a3 = a0, a0, a0
    q0 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    q1, q2, q3 = q0, q0, q0
    w_next = w_tile(w_ptrs, n_ok, rk < K, EVEN_K)
    for k in range(0, K, BLOCK_K):
        w = w_next.to(tl.float32)
        step = BLOCK_K * (k + BLOCK_K < K).to(tl.int32)
        w_ptrs += step
        w_next = w_tile(w_ptrs, n_ok, (k + step + rk) < K, EVEN_K)
        offs_k = k + rk
        k_ok = offs_k < K
        if NORM:
            rest = (x_ptr, r_ptr, ro_ptr, nw_ptr, M, K, offs_k, k_ok, w, pid_n, HAS_RES)
            a0, q0 = norm_step(a0, q0, 0, *rest)
            if ROWS > 1:
                a1, q1 = norm_step(a1, q1, 1, *rest)
            if ROWS > 2:
                a2, q2 = norm_step(a2, q2, 2, *rest)
                a3, q3 = norm_step(a3, q3, 3, *rest)
        else:
            a0 += row_times_w(x_ptr, 0, M, K, offs_k, k_ok, w, rn, s_xm, False)
            if ROWS > 1:
                a1 += row_times_w(x_ptr, 1, M, K, offs_k, k_ok, w, rn, s_xm, False)
            if ROWS > 2:
                a2 += row_times_w(x_ptr, 2, M, K, offs_k, k_ok, w, rn, s_xm, False)
                a3 += row_times_w(x_ptr, 3, M, K, offs_k, k_ok, w, rn, s_xm, False)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    rest = (K, eps, bias, x_ptr, pos_ptr, slot_ptr, q_ptr, cache_ptr, cos_ptr, sin_ptr, s_cos,
            s_cb, s_ckv, s_cs, s_ch, k_scale, v_scale, pair_index(pid_n, BLOCK_N), N, NORM, NUM_HEADS,
            NUM_KV_HEADS, HEAD_DIM, PAGE, CLAMP, LIMIT)  # fmt: skip
    _finish_rope_row(a0, q0, 0, M, *rest)
    if ROWS > 1:
        _finish_rope_row(a1, q1, 1, M, *rest)
    if ROWS > 2:
        _finish_rope_row(a2, q2, 2, M, *rest)
        _finish_rope_row(a3, q3, 3, M, *rest)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rope_dot_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, nw_ptr, ro_ptr, pos_ptr, slot_ptr, q_ptr, cache_ptr, cos_ptr,
    sin_ptr, M, N, K, s_xm, s_wn, eps, s_cos, s_cb, s_ckv, s_cs, s_ch, k_scale, v_scale,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    CLAMP: tl.constexpr, LIMIT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """`_skinny_dot_kernel` (one split of K; x padded to 16 rows) over program n's paired
    columns, then the RoPE + KV-write epilogue of its [BLOCK_N, 16] tile (out^T)."""
    pid_n = tl.program_id(0)
    rm = tl.arange(0, 16)
    rn = paired_cols(pid_n, BLOCK_N, HEAD_DIM)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * s_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * s_xm + rk[None, :]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    ss = tl.zeros((16,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + rk) < K
        w = w_tile(w_ptrs, n_ok, k_ok, EVEN_K)
        x_ok = m_ok[:, None] if EVEN_K else m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        if NORM:
            x, sq = norm_tile(x, r_ptr, ro_ptr, nw_ptr, rm, k + rk, K, k_ok, x_ok, pid_n, HAS_RES)
            ss += sq
        if INTERPRET:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(w, tl.trans(x), out_dtype=tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if NORM:
        acc = acc * tl.rsqrt(ss / K + eps)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # as the plain kernel stores it
    pairs = tl.permute(tl.reshape(acc, (BLOCK_N // 2, 2, 16)), (0, 2, 1))
    x1, x2 = tl.split(pairs)  # [BLOCK_N / 2, 16] each
    pair = pair_index(pid_n, BLOCK_N)[:, None]
    pos = tl.load(pos_ptr + rm, mask=m_ok, other=0).to(tl.int64)[None, :]
    slot = tl.load(slot_ptr + rm, mask=m_ok, other=-1).to(tl.int64)[None, :]
    rope_kv_store(x1, x2, pair, (pair < N // 2) & m_ok[None, :], rm[None, :], pos, slot, q_ptr,
                  cache_ptr, cos_ptr, sin_ptr, s_cos, s_cb, s_ckv, s_cs, s_ch, k_scale, v_scale,
                  NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE, CLAMP, LIMIT)  # fmt: skip
