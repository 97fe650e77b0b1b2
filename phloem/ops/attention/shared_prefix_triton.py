"""Our Triton kernel for prefix-shared (cascade) attention; imported lazily by `shared_prefix.py`.

One launch covers every tile of a step (BatchLLM arXiv 2412.03594 §5, "horizontal fusion"):
per-group prefix tiles (a group's query tokens x GQA heads folded into M, against the paged prefix
KV, optionally split along the KV) and per-sequence suffix tiles (own paged KV, causal). Each tile
runs a FlashAttention-style online softmax (log2 domain, float32 state) and writes either its final
output (a sequence without a group) or a partial (O, LSE) of a grouped token. A second, small
launch merges the partials of the grouped tokens (LSE-weighted, as FlashInfer's merge_states).

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported (the
decorator reads it); tensors may then live on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from phloem.ops.attention.interface import AttentionMetadata
from phloem.ops.attention.shared_prefix import SharedPrefixMetadata

_LOG2E = 1.4426950408889634

# Tile table (int32 [num_tiles, 8], one row per program along grid axis 0; axis 1 = KV head):
#   0 tok_off   offset into `tokens` of the tile's segment (a group's tokens or one sequence's)
#   1 row0      first folded row of the tile in its segment (rows = tokens * GQA, token-major)
#   2 n_rows    folded rows of the whole segment
#   3 blk_off   offset into `blocks` of the segment's KV block ids
#   4 kv_begin  first KV index (within the segment's KV) the tile reads
#   5 kv_end    one past its last KV index
#   6 pos0      absolute position of the segment's KV index 0 (0 for a prefix, prefix_len for a
#               suffix); the causal test is pos0 + j <= position of the query token
#   7 slot      -1: write the normalized output straight to `out` (a sequence without a group);
#               s >= 0: write partial (O, LSE) to slot s at partial row tok_off + token-in-segment
# The first R = (grouped tokens) entries of `tokens` list every grouped token once, group-major;
# a grouped token's partial row is its index there, for its prefix tiles (slots 0..S-1, one per
# KV split of the prefix) and its suffix tile (slot S) alike. The merge then reduces S + 1 slots.
_TILE_FIELDS = 8


@dataclass
class _TritonPlan:
    """Device tensors of one step's launch (built once per step, reused by every layer)."""

    tiles: torch.Tensor  # int32 [num_tiles, 8]
    tokens: torch.Tensor  # int32 [R + ungrouped tokens]
    blocks: torch.Tensor  # int32 [prefix blocks + suffix blocks]
    qpos: torch.Tensor  # int32 [T] position of each query token (-1 past query_start_loc[-1])
    num_grouped: int  # R
    num_slots: int  # prefix splits + 1
    block_m: int
    block_n: int
    # float32 partial states [slots, R, H, D] and LSE [slots, R, H], allocated with the plan and
    # shared by the step's layers: every layer runs the same tile table, so the LSE entries no
    # tile writes (splits a group does not have) stay -inf from the one fill.
    opart: torch.Tensor | None = None
    lpart: torch.Tensor | None = None


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
def tile_kernel(
    q_ptr, kv_ptr, out_ptr, opart_ptr, lpart_ptr,
    tiles_ptr, tok_ptr, qpos_ptr, blk_ptr,
    scale_log2,
    s_qt, s_qh, s_kb, s_kkv, s_ks, s_kh, s_ot, s_oh, s_ps, s_pt, s_ph, s_ls, s_lt,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    desc = tiles_ptr + tl.program_id(0) * 8
    kvh = tl.program_id(1)
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
    q = q.to(kv_ptr.dtype.element_ty)

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
                scale_log2, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok, BLOCK_N, PAGE, PRECISION,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(kv_begin, kv_end, BLOCK_N):
            m_i, l_i, acc = kv_step(
                q, m_i, l_i, acc, start, kv_end, pos0, qpos, kv_ptr, blk_ptr, blk_off, kvh,
                scale_log2, s_kb, s_kkv, s_ks, s_kh, offs_d, d_ok, BLOCK_N, PAGE, PRECISION,
            )  # fmt: skip
    has = l_i > 0
    l_use = tl.where(has, l_i, 1.0)
    o = acc / l_use[:, None]
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


@triton.jit
def merge_kernel(
    out_ptr, opart_ptr, lpart_ptr, tok_ptr,
    s_ot, s_oh, s_ps, s_pt, s_ph, s_ls, s_lt,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SLOTS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < NUM_HEADS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SLOTS):
        lse = tl.load(lpart_ptr + s * s_ls + r * s_lt + h, mask=h_ok, other=float("-inf"))
        m = tl.maximum(m, lse)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in tl.static_range(NUM_SLOTS):
        lse = tl.load(lpart_ptr + s * s_ls + r * s_lt + h, mask=h_ok, other=float("-inf"))
        w = tl.exp(lse - m_use)  # 0 for an unwritten slot (lse -inf); never read its O
        src = opart_ptr + s * s_ps + r * s_pt + h[:, None] * s_ph + d[None, :]
        o = tl.load(src, mask=(h_ok & (w > 0))[:, None] & d_ok[None, :], other=0.0)
        acc += o * w[:, None]
        den += w
    o = acc / tl.where(den > 0, den, 1.0)[:, None]
    tok = tl.load(tok_ptr + r).to(tl.int64)
    dst = out_ptr + tok * s_ot + h[:, None] * s_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


def _interpreting() -> bool:
    return isinstance(tile_kernel, InterpretedFunction)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


_MIN_SPLIT_KV = 512  # fewest prefix KV tokens worth a split of their own
_MAX_SPLITS = 16
_MAX_PARTIAL_BYTES = 512 << 20  # bound on the float32 partial-state buffer of one call


def _prefix_splits(
    attn_meta: AttentionMetadata,
    sp: SharedPrefixMetadata,
    group_rows: list[int],
    num_kv_heads: int,
    gqa: int,
    block_m: int,
    partial_bytes: int,
    device: torch.device,
    forced: int | None,
) -> list[int]:
    """KV splits of each group's prefix, so that no prefix program is the critical path.

    Work of the launch W = sum over programs of the KV tokens each reads. Spread over 2 programs
    per SM, one program's fair share is W / (2 * num_SMs); a prefix tile longer than that is split
    into floor(P / share) pieces (so each piece >= share >= _MIN_SPLIT_KV tokens; at most
    _MAX_SPLITS, and fewer when the partial states of the step would exceed _MAX_PARTIAL_BYTES).
    """
    if forced is not None:
        return [forced] * sp.num_groups
    qsl = attn_meta.query_start_loc_cpu
    work = sum(_cdiv(r, block_m) * p for r, p in zip(group_rows, sp.group_prefix_lens))
    work += sum(_cdiv((qsl[b + 1] - qsl[b]) * gqa, block_m) * sp.suffix_lens[b]
                for b in range(attn_meta.num_seqs))  # fmt: skip
    share = max(_MIN_SPLIT_KV, work * num_kv_heads // (2 * _num_sms(device)))
    num_grouped = sum(group_rows) // gqa
    by_memory = _MAX_PARTIAL_BYTES // max(1, num_grouped * partial_bytes) - 1
    cap = max(1, min(_MAX_SPLITS, by_memory))
    return [max(1, min(cap, p // share)) for p in sp.group_prefix_lens]


def _plan_triton(
    attn_meta: AttentionMetadata,
    sp: SharedPrefixMetadata,
    num_kv_heads: int,
    gqa: int,
    device: torch.device,
    block_m: int | None,
    block_n: int,
    prefix_splits: int | None,
    partial_bytes: int,
) -> _TritonPlan:
    """Host-side tile table of one step (see the table layout above). Prefix tiles come first,
    longest KV range first, so the heavy tiles start early (a greedy longest-first schedule)."""
    qsl, seq_lens = attn_meta.query_start_loc_cpu, attn_meta.seq_lens_cpu
    tokens: list[int] = []
    group_off = []
    for g in range(sp.num_groups):
        group_off.append(len(tokens))
        tokens.extend(sp.group_token_indices(g))
    num_grouped = len(tokens)
    member_off = {}
    for g, members in enumerate(sp.group_seq_ids):
        off = group_off[g]
        for b in members:
            member_off[b] = off
            off += qsl[b + 1] - qsl[b]
    bounds = [*group_off, num_grouped]
    group_rows = [(bounds[g + 1] - bounds[g]) * gqa for g in range(sp.num_groups)]
    if block_m is None:  # 16 for decode-only singles, up to 64 for large groups / chunks
        widest = max([*group_rows, *((qsl[b + 1] - qsl[b]) * gqa for b in range(len(seq_lens)))])
        block_m = min(64, max(16, 1 << max(0, widest - 1).bit_length()))
    splits = _prefix_splits(attn_meta, sp, group_rows, num_kv_heads, gqa, block_m, partial_bytes,
                            device, prefix_splits)  # fmt: skip
    suffix_slot = max(splits, default=0)
    blocks: list[int] = []
    prefix_tiles, suffix_tiles = [], []
    for g in range(sp.num_groups):
        blk_off = len(blocks)
        blocks.extend(sp.group_block_ids[g])
        p = sp.group_prefix_lens[g]
        chunk = _cdiv(_cdiv(p, splits[g]), block_n) * block_n  # KV tokens per split
        for s in range(splits[g]):
            kb, ke = s * chunk, min(p, (s + 1) * chunk)
            for row0 in range(0, group_rows[g], block_m) if kb < ke else ():
                prefix_tiles.append((group_off[g], row0, group_rows[g], blk_off, kb, ke, 0, s))
    for b in range(len(seq_lens)):
        q_len = qsl[b + 1] - qsl[b]
        if q_len == 0:
            continue
        if sp.seq_group[b] >= 0:
            tok_off, slot = member_off[b], suffix_slot
        else:
            tok_off, slot = len(tokens), -1
            tokens.extend(range(qsl[b], qsl[b + 1]))
        blk_off = len(blocks)
        blocks.extend(sp.suffix_block_ids[b])
        pos0, first = sp.seq_prefix_lens[b], seq_lens[b] - q_len
        n_rows = q_len * gqa
        for row0 in range(0, n_rows, block_m):
            last = first + (min(n_rows, row0 + block_m) - 1) // gqa  # causal: KV past it unused
            suffix_tiles.append((tok_off, row0, n_rows, blk_off, 0, last - pos0 + 1, pos0, slot))
    prefix_tiles.sort(key=lambda t: t[4] - t[5])
    suffix_tiles.sort(key=lambda t: -t[5])
    num_tokens = qsl[-1]
    qpos = [-1] * num_tokens
    for b in range(len(seq_lens)):
        q_len = qsl[b + 1] - qsl[b]
        qpos[qsl[b] : qsl[b + 1]] = range(seq_lens[b] - q_len, seq_lens[b])
    as_i32 = functools.partial(torch.tensor, dtype=torch.int32)
    host = [as_i32(prefix_tiles + suffix_tiles).view(-1, _TILE_FIELDS), as_i32(tokens),
            as_i32(blocks or [0]), as_i32(qpos or [0])]  # fmt: skip
    dev = [t.to(device, non_blocking=True) for t in host]
    return _TritonPlan(*dev, num_grouped, suffix_slot + 1, block_m, block_n)


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
    num_stages: int = 2,
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
            (last dim contiguous; read only); attn_meta / sp_meta: the step and its groups;
        scale: softmax scale.
        block_m: query rows per tile (power of 2, >= 16; default from the widest segment);
        block_n: KV tokens per inner iteration (power of 2, >= 16; default 64, 32 for D > 128);
        prefix_splits: KV splits of every prefix (default: per group, see `_prefix_splits`);
        num_warps / num_stages: Triton launch options.
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
    key = ("triton", num_heads, num_kv_heads, head_dim, block_m, block_n, prefix_splits, dev)
    plan = sp_meta.plan_cache.get(key)
    if plan is None:  # once per step: the layers share the plan and its partial-state buffers
        partial_bytes = num_heads * (head_dim + 1) * 4  # float32 O and LSE of one token
        plan = _plan_triton(attn_meta, sp_meta, num_kv_heads, gqa, dev, block_m, block_n,
                            prefix_splits, partial_bytes)  # fmt: skip
        rows = max(plan.num_grouped, 1)
        f32 = dict(dtype=torch.float32, device=dev)
        plan.opart = torch.empty(plan.num_slots, rows, num_heads, head_dim, **f32)
        plan.lpart = torch.full((plan.num_slots, rows, num_heads), float("-inf"), **f32)
        sp_meta.plan_cache[key] = plan
    opart, lpart = plan.opart, plan.lpart
    out = torch.empty_like(query)
    if attn_meta.query_start_loc_cpu[-1] < num_tokens:
        out[attn_meta.query_start_loc_cpu[-1] :].zero_()
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    precision = "ieee" if query.dtype in (torch.float32, torch.float64) else "tf32"
    if plan.tiles.shape[0]:
        tile_kernel[(plan.tiles.shape[0], num_kv_heads)](
            query, kv_cache, out, opart, lpart,
            plan.tiles, plan.tokens, plan.qpos, plan.blocks,
            scale * _LOG2E,
            query.stride(0), query.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            out.stride(0), out.stride(1),
            opart.stride(0), opart.stride(1), opart.stride(2), lpart.stride(0), lpart.stride(1),
            GQA=gqa, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n, PAGE=attn_meta.block_size, PRECISION=precision,
            INTERPRET=_interpreting(),
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    if plan.num_grouped:
        merge_kernel[(plan.num_grouped,)](
            out, opart, lpart, plan.tokens,
            out.stride(0), out.stride(1),
            opart.stride(0), opart.stride(1), opart.stride(2), lpart.stride(0), lpart.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=1 << (num_heads - 1).bit_length(),
            BLOCK_D=block_d, NUM_SLOTS=plan.num_slots, num_warps=num_warps,
        )  # fmt: skip
    return out
