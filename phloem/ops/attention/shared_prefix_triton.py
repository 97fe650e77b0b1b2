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

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from phloem.ops.attention.interface import AttentionMetadata
from phloem.ops.attention.shared_prefix import SharedPrefixMetadata
from phloem.ops.kv_store import FP8_KV_DTYPE
from phloem.ops.staging import pinned, to_device

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
class _HostPlan:
    """One step's tile tables and index arrays on the host (numpy int64), before upload."""

    wide: np.ndarray  # [tiles, 8] prefix tiles and suffix tiles of more than narrow rows
    narrow: np.ndarray  # [tiles, 8] suffix tiles of at most narrow_block_m rows (decode tokens)
    block_m: int  # BLOCK_M of the wide launch
    tokens: np.ndarray  # [R + ungrouped tokens]
    blocks: np.ndarray  # [prefix blocks + suffix blocks]
    qpos: np.ndarray  # [T] position of each query token (-1 past query_start_loc[-1])
    num_grouped: int  # R
    num_slots: int  # prefix splits + 1 (the suffix slot is the last)


class _Launch(NamedTuple):
    """One tile-kernel launch: its table (int32 [tiles, 8]), BLOCK_M and whether it is the narrow
    (decode) launch. With `programs`, a persistent launch of that many programs per KV head over
    the first `count[0]` rows of the table (CUDA graphs: `count` is written per step)."""

    tiles: torch.Tensor
    block_m: int
    narrow: bool
    programs: int | None = None
    count: torch.Tensor | None = None


@dataclass
class _TritonPlan:
    """Device tensors of one step's launch (built once per step, reused by every layer)."""

    launches: list[_Launch]
    tokens: torch.Tensor  # int32 [R + ungrouped tokens]
    blocks: torch.Tensor  # int32 [prefix blocks + suffix blocks]
    qpos: torch.Tensor  # int32 [T] position of each query token (-1 past query_start_loc[-1])
    count: torch.Tensor  # int32 [1]: R, the rows the merge kernel reduces
    num_grouped: int  # R
    num_slots: int  # prefix splits + 1
    block_n: int
    # float32 partial states [slots, R, H, D] and LSE [slots, R, H], allocated with the plan and
    # shared by the step's layers: every layer runs the same tile table, so the LSE entries no
    # tile writes (splits a group does not have) stay -inf from the one fill.
    opart: torch.Tensor | None = None
    lpart: torch.Tensor | None = None
    merge_grid: int = 0  # merge programs (R eagerly; the batch in a CUDA graph)


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
    scale_log2,
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
    if F16_MATH:  # FP8 cache: e4m3 -> float16 is one exact conversion (bf16 is not)
        q = (q.to(tl.float32) * scale_log2).to(tl.float16)  # pre-scaled: |q| far below 65504
        s_mul = 1.0
    else:
        s_mul = scale_log2

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
def tile_kernel(
    q_ptr, kv_ptr, out_ptr, opart_ptr, lpart_ptr,
    tiles_ptr, ntiles_ptr, tok_ptr, qpos_ptr, blk_ptr,
    scale_log2,
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
                qpos_ptr, blk_ptr, scale_log2, s_qt, s_qh, s_kb, s_kkv, s_ks, s_kh, s_ot, s_oh,
                s_ps, s_pt, s_ph, s_ls, s_lt, GQA, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE,
                PRECISION, INTERPRET, F16_MATH,
            )  # fmt: skip
    else:
        run_tile(
            tl.program_id(0), kvh, q_ptr, kv_ptr, out_ptr, opart_ptr, lpart_ptr, tiles_ptr,
            tok_ptr, qpos_ptr, blk_ptr, scale_log2, s_qt, s_qh, s_kb, s_kkv, s_ks, s_kh, s_ot,
            s_oh, s_ps, s_pt, s_ph, s_ls, s_lt, GQA, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE,
            PRECISION, INTERPRET, F16_MATH,
        )  # fmt: skip


@triton.jit
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
    # num_slots is a runtime argument (not constexpr): one compiled merge for any split count
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
    sp: SharedPrefixMetadata,
    group_rows: np.ndarray,
    suffix_work: int,
    num_kv_heads: int,
    num_grouped: int,
    block_m: int,
    partial_bytes: int,
    device: torch.device,
    forced: int | None,
) -> list[int]:
    """KV splits of each group's prefix, so that no prefix program is the critical path.

    Work of the launch W = sum over programs of the KV tokens each reads (`suffix_work` is the
    suffix tiles' part). Spread over 2 programs per SM, one program's fair share is
    W / (2 * num_SMs); a prefix tile longer than that is split into floor(P / share) pieces (so
    each piece >= share >= _MIN_SPLIT_KV tokens; at most _MAX_SPLITS, and fewer when the partial
    states of the step would exceed _MAX_PARTIAL_BYTES).
    """
    if forced is not None:
        return [forced] * sp.num_groups
    prefix_lens = np.array(sp.group_prefix_lens, dtype=np.int64)
    work = int((-(-group_rows // block_m) * prefix_lens).sum()) + suffix_work
    share = max(_MIN_SPLIT_KV, work * num_kv_heads // (2 * _num_sms(device)))
    by_memory = _MAX_PARTIAL_BYTES // max(1, num_grouped * partial_bytes) - 1
    cap = max(1, min(_MAX_SPLITS, by_memory))
    return [max(1, min(cap, p // share)) for p in sp.group_prefix_lens]


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], starts[i] + lengths[i]) (int64)."""
    offsets = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - offsets, lengths)


def _concat(lists) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64)


def _plan_host(
    attn_meta: AttentionMetadata,
    sp: SharedPrefixMetadata,
    num_kv_heads: int,
    gqa: int,
    device: torch.device,
    block_m: int | None,
    block_n: int,
    prefix_splits: int | None,
    partial_bytes: int,
    narrow_block_m: int | None = None,
    max_splits: int | None = None,
    max_prefix_tiles: int | None = None,
    exclude: np.ndarray | None = None,
) -> _HostPlan:
    """Host-side tile tables of one step (see the table layout above). Prefix tiles come first,
    longest KV range first, so the heavy tiles start early (a greedy longest-first schedule).
    Per-sequence work is vectorized (numpy); only groups are looped over.

    With `narrow_block_m`, suffix segments of at most that many rows (decode tokens: q_len * GQA
    rows) get tiles of their own in a second launch with that BLOCK_M, so a step that mixes long
    prefill chunks (wide tiles) with decode tokens does not pad each decode tile to the wide M.

    For CUDA-graph steps (fixed buffers): `max_splits` caps the prefix splits and fixes the
    suffix slot at `max_splits` (so the merge always reduces max_splits + 1 slots), and
    `max_prefix_tiles` bounds the prefix tiles (splits fall back to 1 when they would exceed it).
    `exclude` (bool [B]) marks ungrouped sequences whose queries another kernel computes: they
    get no tiles (and their rows of the output are left unwritten).
    """
    qsl = np.array(attn_meta.query_start_loc_cpu, dtype=np.int64)
    seq_lens = np.array(attn_meta.seq_lens_cpu, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    seq_group = np.array(sp.seq_group, dtype=np.int64)
    # Grouped tokens, group-major then member order: partial row r of the merge.
    members = _concat(sp.group_seq_ids)
    member_lens = q_lens[members]
    grouped_tokens = _ranges(qsl[:-1][members], member_lens)
    num_grouped = len(grouped_tokens)
    tok_off = np.zeros(len(seq_lens), dtype=np.int64)
    tok_off[members] = np.cumsum(member_lens) - member_lens
    group_sizes = np.array([len(m) for m in sp.group_seq_ids], dtype=np.int64)
    group_first = np.cumsum(group_sizes) - group_sizes
    group_off = tok_off[members[group_first]] if sp.num_groups else np.zeros(0, np.int64)
    group_rows = np.add.reduceat(member_lens, group_first) * gqa if sp.num_groups else group_off
    # Ungrouped sequences with queries: their tokens follow, in step order.
    has_queries = q_lens > 0
    if exclude is not None:
        if (exclude & (seq_group >= 0)).any():
            raise ValueError("only sequences without a group can be excluded")
        has_queries &= ~exclude
    lone = np.flatnonzero((seq_group < 0) & has_queries)
    tok_off[lone] = num_grouped + np.cumsum(q_lens[lone]) - q_lens[lone]
    tokens = np.concatenate([grouped_tokens, _ranges(qsl[:-1][lone], q_lens[lone])])
    active = np.flatnonzero(has_queries)
    n_rows = q_lens[active] * gqa
    narrow = np.zeros(len(active), dtype=bool)
    if narrow_block_m is not None:
        narrow = n_rows <= narrow_block_m
    if block_m is None:  # 16 for decode-only singles, up to 64 for large groups / chunks
        widest = int(max(group_rows.max(initial=0), n_rows[~narrow].max(initial=0)))
        block_m = min(64, max(16, 1 << max(0, widest - 1).bit_length()))
    tile_m = np.where(narrow, narrow_block_m or block_m, block_m)
    # Suffix tiles: every sequence with queries, ceil(q_len * gqa / BLOCK_M) row tiles each.
    n_tiles = -(-n_rows // tile_m)
    pos0 = np.array(sp.seq_prefix_lens, dtype=np.int64)[active]
    suffix_lens = np.array(sp.suffix_lens, dtype=np.int64)[active]
    suffix_work = int((n_tiles * suffix_lens).sum())
    splits = _prefix_splits(sp, group_rows, suffix_work, num_kv_heads, num_grouped, block_m,
                            partial_bytes, device, prefix_splits)  # fmt: skip
    row_tiles = -(-group_rows // block_m)
    if max_splits is not None:
        splits = [min(s, max_splits) for s in splits]
        if max_prefix_tiles is not None and int((row_tiles * splits).sum()) > max_prefix_tiles:
            splits = [1] * sp.num_groups
    suffix_slot = max(splits, default=0) if max_splits is None else max_splits
    prefix_blocks = _concat(sp.group_block_ids)
    suffix_ids = sp.suffix_block_ids
    suffix_blocks = _concat(suffix_ids[b] for b in active.tolist())
    suffix_counts = np.fromiter(
        (len(suffix_ids[b]) for b in active.tolist()), np.int64, len(active)
    )
    blk_off = len(prefix_blocks) + np.cumsum(suffix_counts) - suffix_counts
    prefix_tiles = []
    group_blk_off = 0
    for g in range(sp.num_groups):
        p, rows = sp.group_prefix_lens[g], int(group_rows[g])
        chunk = _cdiv(_cdiv(p, splits[g]), block_n) * block_n  # KV tokens per split
        off = int(group_off[g])
        for s in range(splits[g]):
            kb, ke = s * chunk, min(p, (s + 1) * chunk)
            for row0 in range(0, rows, block_m) if kb < ke else ():
                prefix_tiles.append((off, row0, rows, group_blk_off, kb, ke, 0, s))
        group_blk_off += len(sp.group_block_ids[g])
    prefix_tiles.sort(key=lambda t: t[4] - t[5])
    tile_seq = np.repeat(np.arange(len(active)), n_tiles)
    row0 = np.arange(len(tile_seq)) - np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    row0 = row0 * tile_m[tile_seq]
    rows_t = n_rows[tile_seq]
    first = (seq_lens[active] - q_lens[active])[tile_seq]
    last = first + (np.minimum(rows_t, row0 + tile_m[tile_seq]) - 1) // gqa  # causal: KV past it
    slot = np.where(seq_group[active] >= 0, suffix_slot, -1)[tile_seq]
    suffix_tiles = np.stack(
        [tok_off[active][tile_seq], row0, rows_t, blk_off[tile_seq],
         np.zeros_like(row0), last - pos0[tile_seq] + 1, pos0[tile_seq], slot], axis=1,
    )  # fmt: skip
    order = np.argsort(-suffix_tiles[:, 5], kind="stable")
    suffix_tiles, tile_narrow = suffix_tiles[order], narrow[tile_seq][order]
    wide = np.concatenate(
        [
            np.array(prefix_tiles, dtype=np.int64).reshape(-1, _TILE_FIELDS),
            suffix_tiles[~tile_narrow],
        ]
    )
    qpos = np.full(int(qsl[-1]), -1, dtype=np.int64)
    qpos[_ranges(qsl[:-1], q_lens)] = _ranges(seq_lens - q_lens, q_lens)
    blocks = np.concatenate([prefix_blocks, suffix_blocks])
    return _HostPlan(
        wide, suffix_tiles[tile_narrow], block_m, tokens, blocks, qpos, num_grouped,
        suffix_slot + 1,
    )  # fmt: skip


def _upload(
    host: _HostPlan, device: torch.device, block_n: int, narrow_block_m: int | None
) -> _TritonPlan:
    """A `_plan_host` plan as the device tensors of an eager step's launches."""

    def dev(t: np.ndarray) -> torch.Tensor:
        return to_device(t.astype(np.int32), device)

    launches = [_Launch(dev(host.wide), host.block_m, False)] if len(host.wide) else []
    if len(host.narrow):
        launches.append(_Launch(dev(host.narrow), narrow_block_m, True))
    return _TritonPlan(
        launches,
        dev(host.tokens),
        dev(host.blocks if len(host.blocks) else np.zeros(1, np.int64)),
        dev(host.qpos if len(host.qpos) else np.zeros(1, np.int64)),
        dev(np.array([host.num_grouped])),
        host.num_grouped,
        host.num_slots,
        block_n,
        merge_grid=host.num_grouped,
    )


def _launch(
    plan: _TritonPlan,
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
) -> None:
    """The step's tile launches, then the merge (when it has rows to merge). The narrow launch
    (suffix tiles only: each starts at KV index 0) may use its own BLOCK_N and stage count.
    `fp8_math` (FP8 cache, 16-bit queries): "f16" converts K/V and the pre-scaled query to
    float16 (e4m3 -> f16 is exact and cheap), "q" to the query's dtype."""
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
            scale * _LOG2E,
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
            query's dtype on load); attn_meta / sp_meta: the step and its groups;
        scale: softmax scale.
        block_m: query rows per tile (power of 2, >= 16; default from the widest segment);
        block_n: KV tokens per inner iteration (power of 2, >= 16; default 64, 32 for D > 128);
        prefix_splits: KV splits of every prefix (default: per group, see `_prefix_splits`);
        num_warps / num_stages: Triton launch options (defaults measured on an H100,
            benchmarks/results/2026-11-23-h100/attention-sweep-*.json).
        narrow_block_m: if set (power of 2, >= 16; default 16), suffix segments of at most this many rows
            (decode tokens) run in a second launch with this BLOCK_M (and `narrow_num_warps`,
            default `num_warps`; `narrow_block_n` and `narrow_num_stages`, default `block_n`
            and `num_stages`) instead of being padded to the wide tiles' BLOCK_M.
        fp8_math: with an FP8 cache and 16-bit queries, "f16" (default) computes in float16:
            K/V convert exactly and the query is pre-multiplied by the softmax scale (so its
            range fits float16); "q" converts K/V to the query's dtype (slower for bfloat16).
        exclude: bool [B] or None: ungrouped sequences computed elsewhere (their output rows are
            left unwritten for the caller); fixed for the step (the plan is cached per step).
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
        host = _plan_host(attn_meta, sp_meta, num_kv_heads, gqa, dev, block_m, block_n,
                          prefix_splits, partial_bytes, narrow_block_m, exclude=exclude)  # fmt: skip
        plan = _upload(host, dev, block_n, narrow_block_m)
        rows = max(plan.num_grouped, 1)
        f32 = dict(dtype=torch.float32, device=dev)
        plan.opart = torch.empty(plan.num_slots, rows, num_heads, head_dim, **f32)
        plan.lpart = torch.full((plan.num_slots, rows, num_heads), float("-inf"), **f32)
        sp_meta.plan_cache[key] = plan
    out = torch.empty_like(query)
    if attn_meta.query_start_loc_cpu[-1] < num_tokens:
        out[attn_meta.query_start_loc_cpu[-1] :].zero_()
    _launch(plan, query, kv_cache, out, scale, attn_meta.block_size, num_warps, num_stages,
            narrow_num_warps, narrow_block_n, narrow_num_stages, fp8_math)  # fmt: skip
    return out


class DecodeGraphPlan:
    """Fixed-address tile tables and partial states for shared-prefix decode steps replayed
    from CUDA graphs (one instance serves every captured batch size).

    A graph captured for a batch of B decode sequences (q_len 1, padded with dummy sequences)
    launches per layer, with grids fixed at capture:
      * the wide launch over the prefix-tile table of B rows: a step's prefix tiles (at most B:
        with one KV split a group of m members has ceil(m * GQA / BLOCK_M) <= m row tiles). By
        default it is persistent: min(B, `wide_programs`) programs per KV head stride over the
        step's tiles, their number read from the device; otherwise one program per row, the
        rows past the step's tiles zero, i.e. no-op tiles (n_rows = 0 and an empty KV range).
        The no-op programs are not free: the wide tiles' registers and shared memory leave room
        for 2 programs per SM, so B = 1,024 with 64 prefix tiles queued 7,680 empty programs
        (x 8 KV heads) behind and between the real ones;
      * the narrow launch over B rows, one suffix tile per sequence (a decode token's GQA rows
        fit one narrow tile);
      * the merge over B programs, of which the first `count[0]` (the grouped tokens) work.
    Prefix splits are capped at `max_splits` and the suffix partial always goes to slot
    `max_splits`, so the merge reduces a fixed number of slots; `prepare` resets their LSE to
    -inf each step (a slot no tile of this step writes must not keep an older step's LSE).

    `prepare(meta, sp)` plans a step on the host and uploads every table in one pinned copy into
    one int32 buffer laid out as [wide | narrow | tokens | qpos | counts | blocks], each region
    sized for `max_batch` (counts: the grouped tokens the merge reduces, the wide tiles); graphs
    of smaller batches read prefixes of the regions.

    Args:
        max_batch: the largest captured batch B.
        num_heads, num_kv_heads, head_dim: attention geometry (GQA = num_heads / num_kv_heads
            must be <= narrow_block_m).
        device: the CUDA device (or CPU under the Triton interpreter, for tests).
        max_blocks: capacity of the block-id region (prefix blocks + own blocks of a step);
            `fits(sp)` tells whether a step fits.
        block_m, narrow_block_m, block_n, max_splits, num_warps, num_stages: kernel options as in
            `shared_prefix_attention`.
        wide_programs: programs per KV head of the persistent wide launch (default: enough for
            two per SM over all KV heads, the residency of the wide tiles); None with
            `persistent_wide=False`, one program per table row.
    Memory: (max_splits + 1) * max_batch * num_heads * (head_dim + 1) * 4 bytes of float32
        partial states (168 MiB for B = 2048, 32 heads of 128, 4 splits) plus the tables.
    Raises:
        ValueError: if GQA > narrow_block_m.
    """

    def __init__(
        self,
        max_batch: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        max_blocks: int,
        block_m: int = 64,
        narrow_block_m: int = 16,
        block_n: int | None = None,
        max_splits: int = 4,
        num_warps: int = 4,
        num_stages: int = 3,
        persistent_wide: bool = True,
        wide_programs: int | None = None,
    ) -> None:
        gqa = num_heads // num_kv_heads
        if gqa > narrow_block_m:
            raise ValueError(f"GQA ratio {gqa} exceeds narrow_block_m {narrow_block_m}")
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.device = torch.device(device)
        self.block_m, self.narrow_block_m, self.max_splits = block_m, narrow_block_m, max_splits
        self.block_n = block_n or (64 if head_dim <= 128 else 32)
        self.num_warps, self.num_stages = num_warps, num_stages
        if persistent_wide and wide_programs is None:
            wide_programs = _cdiv(2 * _num_sms(self.device), num_kv_heads)
        self.wide_programs = wide_programs if persistent_wide else None
        m = max_batch
        # region offsets in the int32 buffer
        self._off = dict(wide=0, narrow=8 * m, tokens=16 * m, qpos=17 * m, count=18 * m)
        self._off["wide_count"] = 18 * m + 1
        self._off["blocks"] = 18 * m + 2
        self._buf = torch.zeros(self._off["blocks"] + max_blocks, dtype=torch.int32, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        self.opart = torch.zeros(max_splits + 1, m, num_heads, head_dim, **f32)
        self.lpart = torch.full((max_splits + 1, m, num_heads), float("-inf"), **f32)
        self._plans: dict[int, _TritonPlan] = {}

    def fits(self, sp: SharedPrefixMetadata) -> bool:
        """Whether a step's block ids fit the buffer (else run it eagerly), with room for the
        padding sequences of its bucket (fewer than 16, one block each)."""
        used = sum(map(len, sp.group_block_ids)) + sum(map(len, sp.suffix_block_ids))
        return used + 16 <= self.max_blocks

    def _view(self, name: str, length: int) -> torch.Tensor:
        start = self._off[name]
        return self._buf[start : start + length]

    def plan_for(self, batch: int) -> _TritonPlan:
        """The launch description a graph of `batch` sequences captures (views of the buffers)."""
        plan = self._plans.get(batch)
        if plan is None:
            programs = None if self.wide_programs is None else min(batch, self.wide_programs)
            wide = _Launch(self._view("wide", 8 * batch).view(batch, 8), self.block_m, False,
                           programs, self._view("wide_count", 1))  # fmt: skip
            narrow = _Launch(self._view("narrow", 8 * batch).view(batch, 8), self.narrow_block_m,
                             True)  # fmt: skip
            plan = _TritonPlan(
                [wide, narrow],
                self._view("tokens", batch),
                self._buf[self._off["blocks"] :],
                self._view("qpos", batch),
                self._view("count", 1),
                batch,
                self.max_splits + 1,
                self.block_n,
                self.opart,
                self.lpart,
                merge_grid=batch,
            )  # fmt: skip
            self._plans[batch] = plan
        return plan

    def prepare(self, attn_meta: AttentionMetadata, sp: SharedPrefixMetadata) -> None:
        """Plan a decode step of B = attn_meta.num_seqs sequences (q_len 1 each, real ones and
        padding) into the buffers, before the replay of the graph of batch B.

        Raises:
            ValueError: if B > max_batch, a sequence has q_len != 1, or the blocks do not fit.
        """
        batch = attn_meta.num_seqs
        if batch > self.max_batch or attn_meta.query_start_loc_cpu[-1] != batch:
            raise ValueError(f"a graph step needs <= {self.max_batch} decode sequences (q_len 1)")
        host = _plan_host(
            attn_meta, sp, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.device,
            self.block_m, self.block_n, None, self.num_heads * (self.head_dim + 1) * 4,
            self.narrow_block_m, max_splits=self.max_splits, max_prefix_tiles=batch,
        )  # fmt: skip
        if len(host.narrow) != batch or len(host.wide) > batch:
            raise ValueError("not a decode step: tiles do not match the graph's grid")
        if len(host.blocks) > self.max_blocks:
            raise ValueError(f"the step's block ids exceed the graph buffer ({self.max_blocks})")
        off = self._off
        data = np.zeros(off["blocks"] + len(host.blocks), dtype=np.int32)
        data[off["wide"] : off["wide"] + host.wide.size] = host.wide.ravel()
        data[off["narrow"] : off["narrow"] + host.narrow.size] = host.narrow.ravel()
        data[off["tokens"] : off["tokens"] + batch] = host.tokens
        data[off["qpos"] : off["qpos"] + batch] = host.qpos
        data[off["count"]] = host.num_grouped
        data[off["wide_count"]] = len(host.wide)
        data[off["blocks"] :] = host.blocks
        self._buf[: len(data)].copy_(pinned(data), non_blocking=True)
        self.lpart[:, :batch].fill_(float("-inf"))

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float, block_size: int
    ) -> torch.Tensor:
        """The planned step's attention, [B, H, D] in query.dtype (capturable: no host work
        depends on the step)."""
        out = torch.empty_like(query)
        _launch(self.plan_for(query.shape[0]), query, kv_cache, out, scale, block_size,
                self.num_warps, self.num_stages, None)  # fmt: skip
        return out
