"""Our Triton kernels for prefix-shared (cascade) attention; imported lazily by `shared_prefix.py`.

One launch covers every tile of a step (BatchLLM arXiv 2412.03594 §5, "horizontal fusion"):
per-group prefix tiles (a group's query tokens x GQA heads folded into M, against the paged prefix
KV, optionally split along the KV) and per-sequence suffix tiles (own paged KV, causal), laid out
by the tile planner (`tile_plan.py`, table layout there). Each tile runs a FlashAttention-style
online softmax (log2 domain, float32 state) and writes either its final output (a sequence
without a group) or a partial (O, LSE) of a grouped token. A second, small launch merges the
partials of the grouped tokens (LSE-weighted, as FlashInfer's merge_states).

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported (the
decorator reads it); tensors may then live on the CPU.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata
from phloem.ops.attention.tile_plan import DevicePlan, plan_tiles, upload
from phloem.ops.kv_store import FP8_KV_DTYPE

_LOG2E = 1.4426950408889634


@triton.jit
def kv_step(
    q, m_i, l_i, acc, start, kv_end, pos0, qpos, kv_ptr, blk_ptr, blk_off, kvh,
    scale_log2, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N slice of KV indices [start, start + BLOCK_N) into the online softmax
    (log2 units: scores are pre-multiplied by scale * log2(e), exp2 throughout)."""
    j = start + tl.arange(0, BLOCK_N)
    j_ok = j < kv_end
    bid = tl.load(blk_ptr + blk_off + j // PAGE, mask=j_ok, other=0).to(tl.int64)
    kv_off = bid * s_kb + (j % PAGE) * s_ks + kvh * s_kh
    kv_mask = j_ok[:, None] & d_ok[None, :]
    k = tl.load(kv_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(kv_ptr + s_kkv + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    # an FP8 cache is read at half the bytes and computed in q's dtype (float16 under F16_MATH)
    k, v = k.to(q.dtype), v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [M, N]
    keep = j_ok[None, :] & ((pos0 + j)[None, :] <= qpos[:, None])
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def run_tile(
    t, kvh, q_ptr, kv_ptr, out_ptr, opart_ptr, lpart_ptr,
    tiles_ptr, tok_ptr, qpos_ptr, blk_ptr,
    scale_log2, k_scale, v_scale,
    s_qt, s_qh, s_kb, s_kkv, s_ks, s_kh, s_ot, s_oh, s_ps, s_pt, s_ph, s_ls, s_lt,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr, F16_MATH: tl.constexpr,
):  # fmt: skip
    """Tile `t` of the table for KV head `kvh`: its online softmax over its KV range, then its
    output (a sequence without a group) or partial (O, LSE) (see the tile table above)."""
    desc = tiles_ptr + t * 8
    tok_off = tl.load(desc)
    row0 = tl.load(desc + 1)
    n_rows = tl.load(desc + 2)
    blk_off = tl.load(desc + 3)
    kv_begin = tl.load(desc + 4)
    kv_end = tl.load(desc + 5)
    pos0 = tl.load(desc + 6)
    slot = tl.load(desc + 7)

    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    t_local = rows // GQA
    head = kvh * GQA + rows % GQA
    tok = tl.load(tok_ptr + tok_off + t_local, mask=row_ok, other=0).to(tl.int64)
    qpos = tl.load(qpos_ptr + tok, mask=row_ok, other=-1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
                mask=q_mask, other=0.0)  # fmt: skip
    # An FP8 cache's k_scale multiplies the scores (q . (k_scale K) = k_scale (q . K)); it is
    # kept out of the float16 query, where a small scale would push q into subnormals.
    if F16_MATH:  # FP8 cache: e4m3 -> float16 is one exact conversion (bf16 is not)
        q = (q.to(tl.float32) * scale_log2).to(tl.float16)  # pre-scaled: |q| far below 65504
        s_mul = k_scale
    else:
        s_mul = scale_log2 * k_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The interpreter cannot take loaded scalars as range() bounds (NumPy 2 refuses to make an
    # int of a 1-element array), so it walks the KV with a while loop; compiled code keeps the
    # for loop, which Triton software-pipelines (num_stages).
    if INTERPRET:
        start = kv_begin
        while start < kv_end:
            m_i, l_i, acc = kv_step(
                q, m_i, l_i, acc, start, kv_end, pos0, qpos, kv_ptr, blk_ptr, blk_off, kvh,
                s_mul, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok, BLOCK_N, PAGE, PRECISION,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(kv_begin, kv_end, BLOCK_N):
            m_i, l_i, acc = kv_step(
                q, m_i, l_i, acc, start, kv_end, pos0, qpos, kv_ptr, blk_ptr, blk_off, kvh,
                s_mul, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok, BLOCK_N, PAGE, PRECISION,
            )  # fmt: skip
    has = l_i > 0
    l_use = tl.where(has, l_i, 1.0)
    o = acc * (v_scale / l_use)[:, None]  # an FP8 cache's V scale (1.0 otherwise)
    lse = tl.where(has, (m_i + tl.log2(l_use)) * 0.6931471805599453, float("-inf"))
    # Names differ per branch: compiled Triton needs one type per variable across branches.
    if slot < 0:
        out_dst = out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
        tl.store(out_dst, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        prow = (tok_off + t_local).to(tl.int64)
        part_dst = opart_ptr + slot * s_ps + prow[:, None] * s_pt + head[:, None] * s_ph
        tl.store(part_dst + offs_d[None, :], o, mask=q_mask)
        tl.store(lpart_ptr + slot * s_ls + prow * s_lt + head, lse, mask=row_ok)


# Specializations that would only multiply the compiled variants: the index tables (tiles, tile
# count, tokens, positions, block ids) are read a scalar or a gathered id at a time, so their
# 16-byte alignment buys nothing (a CUDA graph's tables are unaligned views of one buffer),
# and the partial LSE's slot stride (R * H) changes with each step's grouped tokens R.
_INDEX_PTRS = ["tiles_ptr", "ntiles_ptr", "tok_ptr", "qpos_ptr", "blk_ptr"]


@triton.jit(do_not_specialize=["s_ls"], do_not_specialize_on_alignment=_INDEX_PTRS)
def tile_kernel(
    q_ptr, kv_ptr, out_ptr, opart_ptr, lpart_ptr,
    tiles_ptr, ntiles_ptr, tok_ptr, qpos_ptr, blk_ptr,
    scale_log2, k_scale, v_scale,
    s_qt, s_qh, s_kb, s_kkv, s_ks, s_kh, s_ot, s_oh, s_ps, s_pt, s_ph, s_ls, s_lt,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr, F16_MATH: tl.constexpr,
    PERSISTENT: tl.constexpr,
):  # fmt: skip
    # One program per tile (grid axis 0 = the table's rows), or with PERSISTENT a fixed grid
    # whose programs stride over the first ntiles_ptr[0] rows: a CUDA graph's launch sized for
    # the machine instead of its largest possible table (no no-op programs to schedule).
    kvh = tl.program_id(1)
    if PERSISTENT:
        n_tiles = tl.load(ntiles_ptr)
        # (a for loop over a loaded bound runs under the interpreter too: the tests stride one
        # and three programs over several tiles)
        for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            run_tile(
                t, kvh, q_ptr, kv_ptr, out_ptr, opart_ptr, lpart_ptr, tiles_ptr, tok_ptr,
                qpos_ptr, blk_ptr, scale_log2, k_scale, v_scale, s_qt, s_qh, s_kb, s_kkv, s_ks, s_kh, s_ot,
                s_oh, s_ps, s_pt, s_ph, s_ls, s_lt, GQA, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                PAGE, PRECISION, INTERPRET, F16_MATH,
            )  # fmt: skip
    else:
        run_tile(
            tl.program_id(0), kvh, q_ptr, kv_ptr, out_ptr, opart_ptr, lpart_ptr, tiles_ptr,
            tok_ptr, qpos_ptr, blk_ptr, scale_log2, k_scale, v_scale, s_qt, s_qh, s_kb, s_kkv, s_ks, s_kh,
            s_ot, s_oh, s_ps, s_pt, s_ph, s_ls, s_lt, GQA, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
            PAGE, PRECISION, INTERPRET, F16_MATH,
        )  # fmt: skip


@triton.jit(
    do_not_specialize=["s_ls", "num_slots"],
    do_not_specialize_on_alignment=["tok_ptr", "count_ptr"],
)
def merge_kernel(
    out_ptr, opart_ptr, lpart_ptr, tok_ptr, count_ptr,
    s_ot, s_oh, s_ps, s_pt, s_ph, s_ls, s_lt,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    num_slots, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # Rows past the device-side count are no-ops: a CUDA graph launches one program per row of
    # its batch, and only the step's grouped tokens (count_ptr[0]) have partials to merge.
    r = tl.program_id(0).to(tl.int64)
    live = r < tl.load(count_ptr)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < tl.where(live, NUM_HEADS, 0)  # (a scalar & vector mask trips the interpreter)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    # num_slots is a runtime argument, not specialized (not even on 1): one compiled merge for
    # any split count
    for s in range(num_slots):
        lse = tl.load(lpart_ptr + s * s_ls + r * s_lt + h, mask=h_ok, other=float("-inf"))
        m = tl.maximum(m, lse)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(num_slots):
        lse = tl.load(lpart_ptr + s * s_ls + r * s_lt + h, mask=h_ok, other=float("-inf"))
        w = tl.exp(lse - m_use)  # 0 for an unwritten slot (lse -inf); never read its O
        src = opart_ptr + s * s_ps + r * s_pt + h[:, None] * s_ph + d[None, :]
        o = tl.load(src, mask=(h_ok & (w > 0))[:, None] & d_ok[None, :], other=0.0)
        acc += o * w[:, None]
        den += w
    o = acc / tl.where(den > 0, den, 1.0)[:, None]
    tok = tl.load(tok_ptr + tl.where(live, r, 0)).to(tl.int64)  # (stores masked when dead)
    dst = out_ptr + tok * s_ot + h[:, None] * s_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


def _interpreting() -> bool:
    return isinstance(tile_kernel, InterpretedFunction)


def launch_plan(
    plan: DevicePlan,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    block_size: int,
    num_warps: int,
    num_stages: int,
    narrow_num_warps: int | None,
    narrow_block_n: int | None = None,
    narrow_num_stages: int | None = None,
    fp8_math: str = "f16",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """The step's tile launches, then the merge (when it has rows to merge). The narrow launch
    (suffix tiles only: each starts at KV index 0) may use its own BLOCK_N and stage count.
    `fp8_math` (FP8 cache, 16-bit queries): "f16" converts K/V and the pre-scaled query to
    float16 (e4m3 -> f16 is exact and cheap), "q" to the query's dtype. An FP8 cache's
    `k_scale` multiplies the scores (q . (k_scale K) = k_scale (q . K)), its `v_scale` each
    tile's normalized output (the merge is linear in them); both are 1.0
    for any other cache."""
    if kv_cache.dtype != FP8_KV_DTYPE:
        k_scale = v_scale = 1.0
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    opart, lpart = plan.opart, plan.lpart
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    precision = "ieee" if query.dtype in (torch.float32, torch.float64) else "tf32"
    if fp8_math not in ("f16", "q"):
        raise ValueError(f"fp8_math must be 'f16' or 'q', got {fp8_math!r}")
    f16_math = (
        fp8_math == "f16"
        and kv_cache.dtype == FP8_KV_DTYPE
        and query.dtype in (torch.bfloat16, torch.float16)
    )
    for launch in plan.launches:
        warps, stages, block_n = num_warps, num_stages, plan.block_n
        if launch.narrow:
            warps = narrow_num_warps or num_warps
            stages = narrow_num_stages or num_stages
            block_n = narrow_block_n or plan.block_n
        persistent = launch.programs is not None
        programs = launch.programs if persistent else launch.tiles.shape[0]
        tile_kernel[(programs, num_kv_heads)](
            query, kv_cache, out, opart, lpart,
            launch.tiles, launch.count if persistent else plan.count, plan.tokens, plan.qpos,
            plan.blocks,
            scale * _LOG2E, k_scale, v_scale,
            query.stride(0), query.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            out.stride(0), out.stride(1),
            opart.stride(0), opart.stride(1), opart.stride(2), lpart.stride(0), lpart.stride(1),
            GQA=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=launch.block_m, BLOCK_N=block_n, PAGE=block_size, PRECISION=precision,
            INTERPRET=_interpreting(), F16_MATH=f16_math, PERSISTENT=persistent,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    if plan.merge_grid:
        merge_kernel[(plan.merge_grid,)](
            out, opart, lpart, plan.tokens, plan.count,
            out.stride(0), out.stride(1),
            opart.stride(0), opart.stride(1), opart.stride(2), lpart.stride(0), lpart.stride(1),
            num_heads, head_dim, 1 << (num_heads - 1).bit_length(), plan.num_slots,
            BLOCK_D=block_d, num_warps=num_warps,
        )  # fmt: skip


def shared_prefix_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_meta: AttentionMetadata,
    sp_meta: SharedPrefixMetadata,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    prefix_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    narrow_block_m: int | None = 16,
    narrow_num_warps: int | None = None,
    narrow_block_n: int | None = None,
    narrow_num_stages: int | None = None,
    fp8_math: str = "f16",
    exclude: np.ndarray | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Cascade attention with our Triton kernel: one launch over all prefix and suffix tiles of
    the step (BatchLLM §5 horizontal fusion), then one merge launch over the grouped tokens.

    Prefix tiles fold a group's query tokens and GQA heads into M (rows = tokens * H / H_kv per KV
    head) and read the prefix KV once per (row tile, KV split); they apply the same causal test as
    suffix tiles, which is vacuous there because `build_shared_prefix_metadata` only groups
    sequences whose queries all sit at positions >= prefix_len. Tokens without a group get their
    output straight from their suffix tile; grouped tokens merge prefix split partials and the
    suffix partial (float32 O and LSE) in the merge kernel.

    Args:
        query: [T, H, D] (last dim contiguous); kv_cache: [num_blocks, 2, block_size, H_kv, D]
            (last dim contiguous; read only; query's dtype or float8_e4m3fn, converted to the
            query's dtype on load, times k_scale / v_scale); attn_meta / sp_meta: the step and
            its groups;
        scale: softmax scale.
        block_m: query rows per tile (power of 2, >= 16; default from the widest segment);
        block_n: KV tokens per inner iteration (power of 2, >= 16; default 64, 32 for D > 128);
        prefix_splits: KV splits of every prefix (default: per group, see `_prefix_splits`);
        num_warps / num_stages: Triton launch options (defaults chosen by the kernel sweep of
            benchmarks/results/2026-11-23-h100/README.md).
        narrow_block_m: if set (power of 2, >= 16; default 16), suffix segments of at most this many rows
            (decode tokens) run in a second launch with this BLOCK_M (and `narrow_num_warps`,
            default `num_warps`; `narrow_block_n` and `narrow_num_stages`, default `block_n`
            and `num_stages`) instead of being padded to the wide tiles' BLOCK_M.
        fp8_math: with an FP8 cache and 16-bit queries, "f16" (default) computes in float16:
            K/V convert exactly and the query is pre-multiplied by the softmax scale (so its
            range fits float16); "q" converts K/V to the query's dtype (slower for bfloat16).
        exclude: bool [B] or None: ungrouped sequences computed elsewhere (their output rows are
            left unwritten for the caller); fixed for the step (the plan is cached per step).
        k_scale, v_scale: an FP8 cache's per-tensor scales (K and V read as stored * scale;
            see `launch_plan`); ignored for other caches.
    Returns:
        [T, H, D] in query.dtype; zeros for tokens past `query_start_loc[-1]`.
    Memory: a float32 buffer of (max splits + 1) * R * H * (D + 1) * 4 bytes, R = grouped query
        tokens of the step (<= 512 MiB by the split rule unless splits are forced), allocated
        once per step with the plan and reused by every layer.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("query and kv_cache need a contiguous last dimension")
    if kv_cache.shape[2] != attn_meta.block_size or num_heads % num_kv_heads:
        raise ValueError(f"bad geometry: query {tuple(query.shape)}, cache {tuple(kv_cache.shape)}")
    if query.dtype == torch.float64:
        raise ValueError(
            "the Triton kernel takes float32/16 and bfloat16 (float64: use the reference)"
        )
    gqa = num_heads // num_kv_heads
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    dev = query.device
    key = ("triton", num_heads, num_kv_heads, head_dim, block_m, block_n, prefix_splits,
           narrow_block_m, dev, exclude is not None)  # fmt: skip
    plan = sp_meta.plan_cache.get(key)
    if plan is None:  # once per step: the layers share the plan and its partial-state buffers
        partial_bytes = num_heads * (head_dim + 1) * 4  # float32 O and LSE of one token
        host = plan_tiles(attn_meta, sp_meta, num_kv_heads, gqa, dev, block_m, block_n,
                          prefix_splits, partial_bytes, narrow_block_m, exclude=exclude)  # fmt: skip
        plan = upload(host, dev, block_n, narrow_block_m)
        rows = max(plan.num_grouped, 1)
        f32 = dict(dtype=torch.float32, device=dev)
        plan.opart = torch.empty(plan.num_slots, rows, num_heads, head_dim, **f32)
        plan.lpart = torch.full((plan.num_slots, rows, num_heads), float("-inf"), **f32)
        sp_meta.plan_cache[key] = plan
    out = torch.empty_like(query)
    if attn_meta.query_start_loc_cpu[-1] < num_tokens:
        out[attn_meta.query_start_loc_cpu[-1] :].zero_()
    launch_plan(plan, query, kv_cache, out, scale, attn_meta.block_size, num_warps, num_stages,
            narrow_num_warps, narrow_block_n, narrow_num_stages, fp8_math, k_scale,
            v_scale)  # fmt: skip
    return out
