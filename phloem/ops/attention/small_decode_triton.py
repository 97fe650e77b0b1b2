"""Our Triton kernel for small-batch decode attention, split-KV merged in the same launch;
imported lazily by `small_decode.py` (which holds the workspace, the torch path and the backend).

Flash-Decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"):
at q_len 1 and a small batch, one program per (sequence, KV head) leaves most SMs idle, so the KV
of each sequence is cut into ranges, each program computes a partial softmax (O, LSE) of its
range, and the partials are merged LSE-weighted. Here the merge runs inside the same launch:
each program writes its partial to a float32 workspace, bumps the (sequence, KV head)'s int32
counter, and the program that finds itself last (counter == used - 1) merges the used splits,
writes the output and sets the counter back to 0 (so the next launch, a CUDA-graph replay too,
starts from 0). No host work depends on the step: the grid is (B, H_kv, S_max), fixed per batch
bucket, and each sequence's number of splits and their token ranges are computed on the device
from its length L (so a long sequence gets more splits than a short one in the same step):

    tiles T = ceil(L / BLOCK_N), used u = clamp(ceil(L / split_tokens), 1, min(S_max, T)),
    split s < u takes tiles [s * T // u, (s + 1) * T // u) (balanced, none empty):
    |-- split 0 --|-- split 1 --| ... |-- split u-1 (ragged end) --|  programs s >= u: exit

A program handles the GQA query heads of one KV head together (rows of a BLOCK_M >= 16 tile for
`tl.dot`), so every KV byte is read once; the inner step is the shared-prefix kernel's `kv_step`
(online softmax in log2 units, float32 state).

An FP8 (e4m3) cache's maths (`fp8_math`: F16_MATH, FP8_MMA) are described in `small_decode_fp8.py`.

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported (the
decorator reads it); tensors may then live on the CPU (programs run one after another there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from phloem.ops.attention.shared_prefix_triton import kv_step
from phloem.ops.attention.small_decode_fp8 import fp8_mode

_LOG2E = 1.4426950408889634
FP8_P_SCALE = tl.constexpr(448.0)  # P (in [0, 1]) times e4m3's largest value before rounding
_INDEX_PTRS = ["count_ptr", "seq_lens_ptr", "indptr_ptr", "pages_ptr"]


@triton.jit
def _merge_chunk(opart_ptr, lpart_ptr, base, s0, num_splits, m, den, acc, r, r_ok, d, d_ok,
                 GQA: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT_CHUNK: tl.constexpr):  # fmt: skip
    """Splits [s0, s0 + SPLIT_CHUNK) (those < num_splits) into the merge's online softmax."""
    s = s0 + tl.arange(0, SPLIT_CHUNK)
    ok = (s < num_splits)[:, None] & r_ok[None, :]
    prow = base + s[:, None] * GQA + r[None, :]  # [chunk, G]
    lse = tl.load(lpart_ptr + prow, mask=ok, other=float("-inf"), cache_modifier=".cg")
    o = tl.load(opart_ptr + prow[:, :, None] * HEAD_DIM + d[None, None, :],
                mask=ok[:, :, None] & d_ok[None, None, :], other=0.0,
                cache_modifier=".cg")  # fmt: skip
    m_new = tl.maximum(m, tl.max(lse, axis=0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet
    alpha = tl.exp2(m - m_use)
    w = tl.exp2(lse - m_use[None, :])  # [chunk, G]; 0 past num_splits (LSE -inf)
    den = den * alpha + tl.sum(w, axis=0)
    acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], axis=0)
    return m_new, den, acc


@triton.jit
def _merge_partials(
    opart_ptr, lpart_ptr, base, num_splits,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, G: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The LSE-weighted sum of the `num_splits` (the used splits') partials of one (sequence,
    KV head) (partial row base + s * GQA + r), float32 [G, BLOCK_D] (G = GQA rounded up to a
    power of 2).

    SPLIT_CHUNK splits at a time, as [chunk, G] LSE and [chunk, G, BLOCK_D] O tiles whose loads
    do not wait for each other: a few memory round trips, not one per split. The running max
    is rescaled per chunk (online softmax). Loads bypass L1 (".cg"): other programs wrote the
    partials in this launch.
    """
    r = tl.arange(0, G)
    r_ok = r < GQA
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = tl.full([G], float("-inf"), tl.float32)
    den = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, BLOCK_D], tl.float32)
    if INTERPRET:  # (the interpreter cannot take computed scalars as range() bounds)
        s0 = 0
        while s0 < num_splits:
            m, den, acc = _merge_chunk(opart_ptr, lpart_ptr, base, s0, num_splits, m, den, acc,
                                       r, r_ok, d, d_ok, GQA, HEAD_DIM, SPLIT_CHUNK)  # fmt: skip
            s0 += SPLIT_CHUNK
    else:
        for s0 in range(0, num_splits, SPLIT_CHUNK):
            m, den, acc = _merge_chunk(opart_ptr, lpart_ptr, base, s0, num_splits, m, den, acc,
                                       r, r_ok, d, d_ok, GQA, HEAD_DIM, SPLIT_CHUNK)  # fmt: skip
    return acc / tl.where(den > 0, den, 1.0)[:, None]


@triton.jit
def _split_softmax(
    q, kv_begin, kv_end, seq_len, kv_ptr, pages_ptr, blk_off, kvh, s_mul,
    s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The online-softmax state (running max m and sum l in log2 units, float32 [BLOCK_M];
    unnormalized O, float32 [BLOCK_M, BLOCK_D]) of KV indices [kv_begin, kv_end) for the query
    rows `q` (`s_mul`: softmax scale * log2(e), times an FP8 cache's k_scale)."""
    qpos = tl.full([BLOCK_M], 0, tl.int32) + seq_len - 1  # every KV index is visible
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # (the interpreter cannot take loaded scalars as range() bounds: a while loop there)
    if INTERPRET:
        start = kv_begin
        while start < kv_end:
            m_i, l_i, acc = kv_step(
                q, m_i, l_i, acc, start, kv_end, 0, qpos, kv_ptr, pages_ptr, blk_off, kvh,
                s_mul, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok, BLOCK_N, PAGE, PRECISION,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(kv_begin, kv_end, BLOCK_N):
            m_i, l_i, acc = kv_step(
                q, m_i, l_i, acc, start, kv_end, 0, qpos, kv_ptr, pages_ptr, blk_off, kvh,
                s_mul, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok, BLOCK_N, PAGE, PRECISION,
            )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _load_ids(start, kv_end, pages_ptr, blk_off, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """The block id of each KV index of tile [start, start + BLOCK_N) (0 past kv_end: masked)."""
    j = start + tl.arange(0, BLOCK_N)
    return tl.load(pages_ptr + blk_off + j // PAGE, mask=j < kv_end, other=0).to(tl.int64)


@triton.jit
def _load_tile(start, kv_end, bid, kv_ptr, kvh, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok,
               BLOCK_N: tl.constexpr, PAGE: tl.constexpr):  # fmt: skip
    """K and V [BLOCK_N, BLOCK_D] of tile [start, start + BLOCK_N) as stored (zeros past
    kv_end: a tile wholly past it reads no memory)."""
    j = start + tl.arange(0, BLOCK_N)
    kv_off = bid * s_kb + (j % PAGE) * s_ks + kvh * s_kh
    mask = (j < kv_end)[:, None] & d_ok[None, :]
    k = tl.load(kv_ptr + kv_off[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(kv_ptr + s_kkv + kv_off[:, None] + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _prefetch_iter(
    q, m_i, l_i, acc, k, v, ids_n, start, kv_end, kv_ptr, pages_ptr, blk_off, kvh, s_mul,
    s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One tile of `_split_softmax_prefetch`: issue the next tile's K / V loads (its block ids
    `ids_n` loaded an iteration ago) and the block ids of the tile after it, then fold this
    tile's K / V (loaded an iteration ago) into the online softmax (`kv_step`'s math, every
    index visible: a decode query is the last position)."""
    k_n, v_n = _load_tile(start + BLOCK_N, kv_end, ids_n, kv_ptr, kvh, s_kb, s_kkv, s_ks, s_kh,
                          offs_d, d_ok, BLOCK_N, PAGE)  # fmt: skip
    ids_nn = _load_ids(start + 2 * BLOCK_N, kv_end, pages_ptr, blk_off, BLOCK_N, PAGE)
    j = start + tl.arange(0, BLOCK_N)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * s_mul  # [M, N]
    s = tl.where((j < kv_end)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the tile holds >= 1 index
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l_i, acc, k_n, v_n, ids_nn


@triton.jit
def _split_softmax_prefetch(
    q, kv_begin, kv_end, kv_ptr, pages_ptr, blk_off, kvh, s_mul,
    s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """`_split_softmax` software-pipelined in registers (PREFETCH=1): tile i + 1's K / V and
    tile i + 2's block ids are in flight while tile i is computed, so a tile costs about one
    memory latency or its math, not a block-id load, then a K / V load, then the math."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    ids = _load_ids(kv_begin, kv_end, pages_ptr, blk_off, BLOCK_N, PAGE)
    k, v = _load_tile(kv_begin, kv_end, ids, kv_ptr, kvh, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok,
                      BLOCK_N, PAGE)  # fmt: skip
    ids = _load_ids(kv_begin + BLOCK_N, kv_end, pages_ptr, blk_off, BLOCK_N, PAGE)
    if INTERPRET:
        start = kv_begin
        while start < kv_end:
            m_i, l_i, acc, k, v, ids = _prefetch_iter(
                q, m_i, l_i, acc, k, v, ids, start, kv_end, kv_ptr, pages_ptr, blk_off, kvh,
                s_mul, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok, BLOCK_N, PAGE, PRECISION,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(kv_begin, kv_end, BLOCK_N):
            m_i, l_i, acc, k, v, ids = _prefetch_iter(
                q, m_i, l_i, acc, k, v, ids, start, kv_end, kv_ptr, pages_ptr, blk_off, kvh,
                s_mul, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok, BLOCK_N, PAGE, PRECISION,
            )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _fp8_mma_step(
    q8, m_i, l_i, acc, start, kv_end, kv_ptr, pages_ptr, blk_off, kvh, s_mul,
    s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """One tile of `_split_softmax_fp8_mma`, transposed (XQA's SWAP_AB): scores S^T = K q^T
    [BLOCK_N, BLOCK_M] (the KV tile as the MMA's M side), softmax state per column, and
    O^T += V^T (P^T * FP8_P_SCALE in e4m3) [BLOCK_D, BLOCK_M]; e4m3 x e4m3 products, float32
    accumulators."""
    ids = _load_ids(start, kv_end, pages_ptr, blk_off, BLOCK_N, PAGE)
    k, v = _load_tile(start, kv_end, ids, kv_ptr, kvh, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok,
                      BLOCK_N, PAGE)  # fmt: skip
    j = start + tl.arange(0, BLOCK_N)
    s = tl.dot(k, tl.trans(q8)) * s_mul  # [N, M], log2 units
    s = tl.where((j < kv_end)[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: the tile holds >= 1 index
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    p8 = (p * FP8_P_SCALE).to(tl.float8e4nv)
    acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p8)
    return m_new, l_i, acc


@triton.jit
def _split_softmax_fp8_mma(
    q, kv_begin, kv_end, kv_ptr, pages_ptr, blk_off, kvh, s_mul,
    s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """`_split_softmax` of an FP8 cache on FP8 tensor cores (FP8_MMA, `fp8_math="mma"`): the
    query rounded to e4m3 (clamped to +-448, unscaled: `s_mul` = softmax scale * log2(e) *
    k_scale scales the float32 scores), tiles as `_fp8_mma_step`; returns the state in
    `_split_softmax`'s row form, O divided by FP8_P_SCALE again."""
    q8 = tl.clamp(q.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)  # O^T
    if INTERPRET:
        start = kv_begin
        while start < kv_end:
            m_i, l_i, acc = _fp8_mma_step(q8, m_i, l_i, acc, start, kv_end, kv_ptr, pages_ptr,
                                          blk_off, kvh, s_mul, s_kb, s_kkv, s_ks, s_kh, offs_d,
                                          d_ok, BLOCK_N, PAGE)  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(kv_begin, kv_end, BLOCK_N):
            m_i, l_i, acc = _fp8_mma_step(q8, m_i, l_i, acc, start, kv_end, kv_ptr, pages_ptr,
                                          blk_off, kvh, s_mul, s_kb, s_kkv, s_ks, s_kh, offs_d,
                                          d_ok, BLOCK_N, PAGE)  # fmt: skip
    return m_i, l_i, tl.trans(acc) * (1.0 / FP8_P_SCALE)


@triton.jit
def _store_split(
    o, has, m_i, l_use, out_ptr, opart_ptr, lpart_ptr, count_ptr, b, kvh, split, used,
    s_ot, s_oh, rows, row_ok, offs_d, d_ok,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, G: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Split `split` of `used` of sequence b, KV head kvh: its output (one split), or its
    partial into the workspace (pair rows pair * S_max * GQA + split * GQA + r) and the
    counter's handshake; the last of the used splits to arrive merges them and resets it."""
    q_mask = row_ok[:, None] & d_ok[None, :]
    head = kvh * GQA + rows
    if used == 1:
        out_dst = out_ptr + b.to(tl.int64) * s_ot + head[:, None] * s_oh + offs_d[None, :]
        tl.store(out_dst, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        lse = tl.where(has, m_i + tl.log2(l_use), float("-inf"))  # log2 units
        pair = b * tl.num_programs(1) + kvh
        base = pair.to(tl.int64) * tl.num_programs(2) * GQA
        prow = base + split * GQA + rows
        tl.store(opart_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], o, mask=q_mask)
        tl.store(lpart_ptr + prow, lse, mask=row_ok)
        # every thread's partial stores precede the counter's release (CUTLASS's semaphore:
        # a CTA barrier, then one thread's gpu-scope atomic)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel")
        if done == used - 1:  # the last used split of this pair to finish merges
            merged = _merge_partials(opart_ptr, lpart_ptr, base, used, GQA, HEAD_DIM, G,
                                     BLOCK_D, SPLIT_CHUNK, INTERPRET)  # fmt: skip
            g = tl.arange(0, G)
            g_dst = out_ptr + b.to(tl.int64) * s_ot + (kvh * GQA + g)[:, None] * s_oh
            g_mask = (g < GQA)[:, None] & d_ok[None, :]
            tl.store(g_dst + offs_d[None, :], merged.to(out_ptr.dtype.element_ty), mask=g_mask)
            tl.atomic_xchg(count_ptr + pair, 0, sem="relaxed")  # ready for the next launch


@triton.jit
def _load_query(q_ptr, b, kvh, s_qt, s_qh, rows, row_ok, offs_d, d_ok, scale_log2, k_scale,
                GQA: tl.constexpr, F16_MATH: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    # the GQA query rows of KV head kvh [BLOCK_M, BLOCK_D] and s_mul, what multiplies q . k to
    # give log2-unit scores (an FP8 cache's k_scale folded in)
    q = tl.load(q_ptr + b.to(tl.int64) * s_qt + (kvh * GQA + rows)[:, None] * s_qh
                + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    if F16_MATH:  # FP8 cache: float16 math over a pre-scaled query (module docstring)
        q = (q.to(tl.float32) * scale_log2).to(tl.float16)
        s_mul = k_scale
    else:
        s_mul = scale_log2 * k_scale
    if INTERPRET:  # the interpreter's bf16 tl.dot returns garbage (Triton 3.9)
        q = q.to(tl.float32)
    return q, s_mul


# split_tokens is not specialized (not on 1, not on multiples of 16): one compiled kernel serves
# every batch bucket; the grid's third dimension is the bucket's S_max.
@triton.jit(do_not_specialize=["split_tokens"], do_not_specialize_on_alignment=_INDEX_PTRS)
def small_decode_kernel(
    q_ptr, kv_ptr, out_ptr, opart_ptr, lpart_ptr, count_ptr,
    seq_lens_ptr, indptr_ptr, pages_ptr,
    scale_log2, k_scale, v_scale, split_tokens,
    s_qt, s_qh, s_kb, s_kkv, s_ks, s_kh, s_ot, s_oh,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr, G: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, PREFETCH: tl.constexpr, F16_MATH: tl.constexpr,
    FP8_MMA: tl.constexpr,
):  # fmt: skip
    # grid (B, H_kv, S_max): program (b, kvh, split) reads split `split` of the `used` splits of
    # sequence b's KV for the GQA query heads of KV head kvh; splits >= used exit at once
    # (no partial, no counter: the merge waits for and reads only the used ones)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    used = tl.minimum(tl.cdiv(seq_len, split_tokens), tl.minimum(tl.num_programs(2), tiles))
    used = tl.maximum(used, 1)
    if split < used:
        kv_begin = (split * tiles // used) * BLOCK_N  # whole tiles, balanced: none empty
        kv_end = tl.minimum(((split + 1) * tiles // used) * BLOCK_N, seq_len)
        blk_off = tl.load(indptr_ptr + b)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < GQA
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q, s_mul = _load_query(q_ptr, b, kvh, s_qt, s_qh, rows, row_ok, offs_d, d_ok,
                               scale_log2, k_scale, GQA, F16_MATH, INTERPRET)  # fmt: skip
        if FP8_MMA:  # an FP8 cache on FP8 tensor cores (module docstring)
            m_i, l_i, acc = _split_softmax_fp8_mma(
                q, kv_begin, kv_end, kv_ptr, pages_ptr, blk_off, kvh, s_mul, s_kb, s_kkv, s_ks,
                s_kh, offs_d, d_ok, BLOCK_M, BLOCK_D, BLOCK_N, PAGE, INTERPRET,
            )  # fmt: skip
        elif PREFETCH:
            m_i, l_i, acc = _split_softmax_prefetch(
                q, kv_begin, kv_end, kv_ptr, pages_ptr, blk_off, kvh, s_mul,
                s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok, BLOCK_M, BLOCK_D, BLOCK_N, PAGE,
                PRECISION, INTERPRET,
            )  # fmt: skip
        else:
            m_i, l_i, acc = _split_softmax(
                q, kv_begin, kv_end, seq_len, kv_ptr, pages_ptr, blk_off, kvh,
                s_mul, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok, BLOCK_M, BLOCK_D,
                BLOCK_N, PAGE, PRECISION, INTERPRET,
            )  # fmt: skip
        has = l_i > 0
        l_use = tl.where(has, l_i, 1.0)
        o = acc * (v_scale / l_use)[:, None]  # an FP8 cache's V scale (1.0 otherwise)
        _store_split(o, has, m_i, l_use, out_ptr, opart_ptr, lpart_ptr, count_ptr, b, kvh,
                     split, used, s_ot, s_oh, rows, row_ok, offs_d, d_ok, GQA, HEAD_DIM, G,
                     BLOCK_D, SPLIT_CHUNK, INTERPRET)  # fmt: skip


def _interpreting() -> bool:
    return isinstance(small_decode_kernel, InterpretedFunction)


def _tile_sizes(head_dim: int, gqa: int) -> tuple[int, int, int, int]:
    """(BLOCK_D, G, BLOCK_M, SPLIT_CHUNK): head_dim and the GQA group padded to powers of two,
    the query tile's rows (>= 16, for tl.dot) and the merge's splits a chunk, whose O tile
    [chunk, G, BLOCK_D] stays at <= 4,096 floats (32 a thread at 4 warps)."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    g = 1 << (gqa - 1).bit_length()
    return block_d, g, max(16, g), max(1, min(32, 4096 // (g * block_d)))


def small_decode_launch(
    query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, seq_lens: torch.Tensor,
    page_indptr: torch.Tensor, page_indices: torch.Tensor, opart: torch.Tensor,
    lpart: torch.Tensor, counters: torch.Tensor, max_splits: int, split_tokens: int,
    scale: float, block_n: int = 32, num_warps: int = 4, num_stages: int = 2,
    k_scale: float = 1.0, v_scale: float = 1.0, prefetch: bool = False,
    fp8_math: str | None = None,
) -> None:  # fmt: skip
    """One launch of `small_decode_kernel` over grid (B, H_kv, max_splits); writes `out`.

    Args:
        query: [B, H, D] (one decode token per sequence; last dim contiguous), bf16/fp16/fp32.
        kv_cache: [num_blocks, 2, block_size, H_kv, D] (NHD or HND strides; last dim
            contiguous); query's dtype or float8_e4m3fn (read as stored * k_scale / v_scale).
        out: [B, H, D] in query's dtype (written; last dim contiguous).
        seq_lens: int32 [>= B] KV tokens of each sequence (>= 1); page_indptr: int32 [>= B]
            offset of sequence b's ceil(L_b / block_size) page ids in `page_indices` (int32).
        opart / lpart: float32 workspace of >= B * H * max_splits * D and B * H * max_splits
            elements (contiguous); counters: int32 [>= B * H_kv], all 0 (left all 0).
        max_splits: S_max, the grid's splits per (sequence, KV head); split_tokens: target KV
            tokens a split (>= 1; `small_decode.splits_used`: one split, no merge).
        scale: softmax scale; block_n: KV tokens per inner step (power of 2, >= 16).
        prefetch: the register-pipelined inner loop (`_split_softmax_prefetch`; A/B option).
        fp8_math: an FP8 cache's math with bf16/fp16 queries (`small_decode_fp8.fp8_mode`;
            None: `fp8_launch_defaults()`'s); ignored for other caches.
    Raises:
        ValueError: for a float64 query, a GQA group above 128 rows, split_tokens < 1 or an
            unknown fp8_math.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    gqa = num_heads // num_kv_heads
    if query.dtype == torch.float64 or gqa > 128 or split_tokens < 1:
        raise ValueError(f"small decode kernel: {query.dtype}, GQA {gqa}, split_tokens "
                         f"{split_tokens} (use the torch path)")  # fmt: skip
    f16_math, fp8_mma, block_n, k_scale, v_scale = fp8_mode(
        query.dtype, kv_cache.dtype, fp8_math, block_n, k_scale, v_scale
    )
    block_d, g, block_m, chunk = _tile_sizes(head_dim, gqa)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    small_decode_kernel[(batch, num_kv_heads, max_splits)](
        query, kv_cache, out, opart, lpart, counters, seq_lens, page_indptr, page_indices,
        scale * _LOG2E, k_scale, v_scale, split_tokens,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        out.stride(0), out.stride(1),
        GQA=gqa, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE=block_size, PRECISION=precision, INTERPRET=_interpreting(), G=g, SPLIT_CHUNK=chunk,
        PREFETCH=bool(prefetch), F16_MATH=f16_math, FP8_MMA=fp8_mma, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
