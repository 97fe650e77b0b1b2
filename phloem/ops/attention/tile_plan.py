"""The tile planner of our shared-prefix kernel: one step's tile tables, on the host, without Triton.

A step's prefix-shared attention (`shared_prefix_triton.py`) runs as tiles: per-group prefix
tiles (a group's query tokens x GQA heads folded into M, against the paged prefix KV, optionally
split along the KV) and per-sequence suffix tiles (own paged KV, causal). `plan_tiles` lays them
out as int32 tables (numpy), `upload` turns a plan into the device tensors of an eager step's
launches; `decode_graph_plan.py` writes them into fixed buffers for CUDA graphs. Nothing here
imports Triton, so the planner is unit-tested anywhere.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata
from phloem.ops.staging import to_device

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
TILE_FIELDS = 8


@dataclass
class HostPlan:
    """One step's tile tables and index arrays on the host (numpy int64), before upload."""

    wide: np.ndarray  # [tiles, 8] prefix tiles and suffix tiles of more than narrow rows
    narrow: np.ndarray  # [tiles, 8] suffix tiles of at most narrow_block_m rows (decode tokens)
    block_m: int  # BLOCK_M of the wide launch
    tokens: np.ndarray  # [R + ungrouped tokens]
    blocks: np.ndarray  # [prefix blocks + suffix blocks]
    qpos: np.ndarray  # [T] position of each query token (-1 past query_start_loc[-1])
    num_grouped: int  # R
    num_slots: int  # prefix splits + 1 (the suffix slot is the last)


class Launch(NamedTuple):
    """One tile-kernel launch: its table (int32 [tiles, 8]), BLOCK_M and whether it is the narrow
    (decode) launch. With `programs`, a persistent launch of that many programs per KV head over
    the first `count[0]` rows of the table (CUDA graphs: `count` is written per step)."""

    tiles: torch.Tensor
    block_m: int
    narrow: bool
    programs: int | None = None
    count: torch.Tensor | None = None


@dataclass
class DevicePlan:
    """Device tensors of one step's launch (built once per step, reused by every layer)."""

    launches: list[Launch]
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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


MIN_SPLIT_KV = 512  # fewest prefix KV tokens worth a split of their own
MAX_SPLITS = 16
MAX_PARTIAL_BYTES = 512 << 20  # bound on the float32 partial-state buffer of one call


def split_counts(
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
    each piece >= share >= MIN_SPLIT_KV tokens; at most MAX_SPLITS, and fewer when the partial
    states of the step would exceed MAX_PARTIAL_BYTES).
    """
    if forced is not None:
        return [forced] * sp.num_groups
    prefix_lens = np.array(sp.group_prefix_lens, dtype=np.int64)
    work = int((-(-group_rows // block_m) * prefix_lens).sum()) + suffix_work
    share = max(MIN_SPLIT_KV, work * num_kv_heads // (2 * num_sms(device)))
    by_memory = MAX_PARTIAL_BYTES // max(1, num_grouped * partial_bytes) - 1
    cap = max(1, min(MAX_SPLITS, by_memory))
    return [max(1, min(cap, p // share)) for p in sp.group_prefix_lens]


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], starts[i] + lengths[i]) (int64)."""
    offsets = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - offsets, lengths)


def _concat(lists) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64)


def plan_tiles(
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
) -> HostPlan:
    """Host-side tile tables of one step (see the table layout above): prefix tiles first
    (`_prefix_tiles`), then suffix tiles (`_suffix_tiles`), longest KV range first within each.
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
    lay = _token_layout(sp, qsl, q_lens, gqa, exclude)
    n_rows = q_lens[lay.active] * gqa
    narrow = n_rows <= (narrow_block_m if narrow_block_m is not None else -1)
    if block_m is None:  # 16 for decode-only singles, up to 64 for large groups / chunks
        block_m = _auto_block_m(lay, n_rows[~narrow])
    tile_m = np.where(narrow, narrow_block_m or block_m, block_m)
    # Suffix tiles: every sequence with queries, ceil(q_len * gqa / BLOCK_M) row tiles each.
    n_tiles = -(-n_rows // tile_m)
    suffix_work = int((n_tiles * np.array(sp.suffix_lens, dtype=np.int64)[lay.active]).sum())
    splits = split_counts(sp, lay.group_rows, suffix_work, num_kv_heads, lay.num_grouped, block_m,
                          partial_bytes, device, prefix_splits)  # fmt: skip
    if max_splits is not None:
        splits = _graph_splits(splits, -(-lay.group_rows // block_m), max_splits, max_prefix_tiles)
    suffix_slot = max(splits, default=0) if max_splits is None else max_splits
    active = lay.active.tolist()
    prefix_blocks, suffix_blocks, blk_off = _block_arrays(sp, active)
    prefix_tiles = _prefix_tiles(sp, lay, splits, block_m, block_n)
    tile_seq = np.repeat(np.arange(len(active)), n_tiles)
    suffix_tiles = _suffix_tiles(
        sp, lay, tile_seq, n_tiles, tile_m, n_rows, seq_lens - q_lens, blk_off, suffix_slot, gqa
    )
    order = np.argsort(-suffix_tiles[:, 5], kind="stable")
    suffix_tiles, tile_narrow = suffix_tiles[order], narrow[tile_seq][order]
    wide = np.concatenate([prefix_tiles, suffix_tiles[~tile_narrow]])
    blocks, qpos = np.concatenate([prefix_blocks, suffix_blocks]), _query_positions(qsl, seq_lens)
    return HostPlan(wide, suffix_tiles[tile_narrow], block_m, lay.tokens, blocks, qpos,
                    lay.num_grouped, suffix_slot + 1)  # fmt: skip


def _query_positions(qsl: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """int64 [T]: the position of each query token of the packed step."""
    q_lens = qsl[1:] - qsl[:-1]
    qpos = np.full(int(qsl[-1]), -1, dtype=np.int64)
    qpos[_ranges(qsl[:-1], q_lens)] = _ranges(seq_lens - q_lens, q_lens)
    return qpos


def _auto_block_m(lay: _TokenLayout, wide_rows: np.ndarray) -> int:
    """BLOCK_M of the wide tiles: the widest group or wide segment's rows, rounded up to a power
    of two within [16, 64]."""
    widest = int(max(lay.group_rows.max(initial=0), wide_rows.max(initial=0)))
    return min(64, max(16, 1 << max(0, widest - 1).bit_length()))


def _graph_splits(
    splits: list[int], row_tiles: np.ndarray, max_splits: int, max_prefix_tiles: int | None
) -> list[int]:
    """Prefix splits of a CUDA-graph step: at most `max_splits` each, and 1 everywhere when the
    prefix tiles would exceed `max_prefix_tiles`."""
    splits = [min(s, max_splits) for s in splits]
    if max_prefix_tiles is not None and int((row_tiles * splits).sum()) > max_prefix_tiles:
        splits = [1] * len(splits)
    return splits


def _block_arrays(
    sp: SharedPrefixMetadata, active: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The groups' prefix block ids, the active sequences' suffix block ids (each
    concatenated), and each active sequence's offset into prefix + suffix blocks."""
    prefix_blocks = _concat(sp.group_block_ids)
    suffix_ids = sp.suffix_block_ids
    suffix_blocks = _concat(suffix_ids[b] for b in active)
    suffix_counts = np.fromiter((len(suffix_ids[b]) for b in active), np.int64, len(active))
    blk_off = len(prefix_blocks) + np.cumsum(suffix_counts) - suffix_counts
    return prefix_blocks, suffix_blocks, blk_off


class _TokenLayout(NamedTuple):
    """Where a step's query tokens sit in the `tokens` array of its plan."""

    tokens: np.ndarray  # [R + ungrouped tokens]: grouped ones group-major, then the lone ones
    tok_off: np.ndarray  # [B] offset of each sequence's tokens in `tokens`
    num_grouped: int  # R
    group_off: np.ndarray  # [NG] offset of each group's tokens
    group_rows: np.ndarray  # [NG] folded rows of each group's tokens (tokens * GQA)
    active: np.ndarray  # indices of the sequences that get tiles (queries, not excluded)
    seq_group: np.ndarray  # [B] as `sp.seq_group`


def _token_layout(
    sp: SharedPrefixMetadata,
    qsl: np.ndarray,
    q_lens: np.ndarray,
    gqa: int,
    exclude: np.ndarray | None,
) -> _TokenLayout:
    """Grouped tokens first (group-major, then member order: token r is partial row r of the
    merge), then the tokens of ungrouped sequences with queries, in step order."""
    seq_group = np.array(sp.seq_group, dtype=np.int64)
    members = _concat(sp.group_seq_ids)
    member_lens = q_lens[members]
    grouped_tokens = _ranges(qsl[:-1][members], member_lens)
    num_grouped = len(grouped_tokens)
    tok_off = np.zeros(len(q_lens), dtype=np.int64)
    tok_off[members] = np.cumsum(member_lens) - member_lens
    group_sizes = np.array([len(m) for m in sp.group_seq_ids], dtype=np.int64)
    group_first = np.cumsum(group_sizes) - group_sizes
    group_off = tok_off[members[group_first]] if sp.num_groups else np.zeros(0, np.int64)
    group_rows = np.add.reduceat(member_lens, group_first) * gqa if sp.num_groups else group_off
    has_queries = q_lens > 0
    if exclude is not None:
        if (exclude & (seq_group >= 0)).any():
            raise ValueError("only sequences without a group can be excluded")
        has_queries &= ~exclude
    lone = np.flatnonzero((seq_group < 0) & has_queries)
    tok_off[lone] = num_grouped + np.cumsum(q_lens[lone]) - q_lens[lone]
    tokens = np.concatenate([grouped_tokens, _ranges(qsl[:-1][lone], q_lens[lone])])
    active = np.flatnonzero(has_queries)
    return _TokenLayout(tokens, tok_off, num_grouped, group_off, group_rows, active, seq_group)


def _prefix_tiles(
    sp: SharedPrefixMetadata, lay: _TokenLayout, splits: list[int], block_m: int, block_n: int
) -> np.ndarray:
    """[tiles, 8] prefix tiles: per group, per KV split (chunks of whole BLOCK_N), per BLOCK_M
    rows; longest KV range first, so the heavy tiles start early (a greedy longest-first
    schedule)."""
    tiles = []
    group_blk_off = 0
    for g in range(sp.num_groups):
        p, rows = sp.group_prefix_lens[g], int(lay.group_rows[g])
        chunk = cdiv(cdiv(p, splits[g]), block_n) * block_n  # KV tokens per split
        off = int(lay.group_off[g])
        for s in range(splits[g]):
            kb, ke = s * chunk, min(p, (s + 1) * chunk)
            for row0 in range(0, rows, block_m) if kb < ke else ():
                tiles.append((off, row0, rows, group_blk_off, kb, ke, 0, s))
        group_blk_off += len(sp.group_block_ids[g])
    tiles.sort(key=lambda t: t[4] - t[5])
    return np.array(tiles, dtype=np.int64).reshape(-1, TILE_FIELDS)


def _suffix_tiles(
    sp: SharedPrefixMetadata,
    lay: _TokenLayout,
    tile_seq: np.ndarray,
    n_tiles: np.ndarray,
    tile_m: np.ndarray,
    n_rows: np.ndarray,
    first_pos: np.ndarray,
    blk_off: np.ndarray,
    suffix_slot: int,
    gqa: int,
) -> np.ndarray:
    """[tiles, 8] suffix tiles in step order: tile t covers rows [row0, row0 + tile_m) of the
    active sequence tile_seq[t] and its own KV up to the last of those rows' positions (causal):

        own KV |-- pos0 = prefix_len ... --|-- ... position of the tile's last row --|-- past --|
    """
    active = lay.active
    pos0 = np.array(sp.seq_prefix_lens, dtype=np.int64)[active]
    row0 = np.arange(len(tile_seq)) - np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    row0 = row0 * tile_m[tile_seq]
    rows_t = n_rows[tile_seq]
    first = first_pos[active][tile_seq]
    last = first + (np.minimum(rows_t, row0 + tile_m[tile_seq]) - 1) // gqa  # causal: KV past it
    slot = np.where(lay.seq_group[active] >= 0, suffix_slot, -1)[tile_seq]
    return np.stack(
        [lay.tok_off[active][tile_seq], row0, rows_t, blk_off[tile_seq],
         np.zeros_like(row0), last - pos0[tile_seq] + 1, pos0[tile_seq], slot], axis=1,
    )  # fmt: skip


def upload(
    host: HostPlan, device: torch.device, block_n: int, narrow_block_m: int | None
) -> DevicePlan:
    """A `plan_tiles` plan as the device tensors of an eager step's launches."""

    def dev(t: np.ndarray) -> torch.Tensor:
        return to_device(t.astype(np.int32), device)

    launches = [Launch(dev(host.wide), host.block_m, False)] if len(host.wide) else []
    if len(host.narrow):
        launches.append(Launch(dev(host.narrow), narrow_block_m, True))
    return DevicePlan(
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
