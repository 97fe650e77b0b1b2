"""The prefix-group structure of one step: which sequences share which prefix blocks.

Members of a prefix group (core/prefix_planner.py, runtime `SharedPrefix` in core/request.py) hold
the same physical KV blocks for their first `prefix_len` tokens (a multiple of the block size):

    sequence b:  |-- shared prefix: group blocks, prefix_len --|-- own blocks: seq_len - prefix_len --|
                                                                  |-- this step's q_len queries --|

Every query of a member sits at a position >= prefix_len, so it attends to the *whole* prefix (no
causal mask there) and causally to its own tokens. `build_shared_prefix_metadata` derives the
groups of a step from per-sequence prefix lengths and the block tables (group key = prefix block
ids); every shared-prefix implementation (reference, Triton, FlashInfer cascade) reads them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from phloem.ops.attention.metadata import AttentionMetadata


@dataclass
class SharedPrefixMetadata:
    """The prefix-group structure of one step (host lists; built by `build_shared_prefix_metadata`).

    B = sequences of the step (as in `AttentionMetadata`), NG = groups in this step.

    Per group g:
        group_block_ids[g]: the prefix's block ids (prefix_len / block_size of them).
        group_prefix_lens[g]: prefix length [tokens], a multiple of block_size, > 0.
        group_seq_ids[g]: member sequences (indices into the step's B sequences), step order.
        group_query_ranges[g]: the members' query-token ranges (start, end) into the step's T
            tokens, same order as group_seq_ids.
    Per sequence b:
        seq_group[b]: its group index, or -1 (attends to all its KV as one "suffix").
        seq_prefix_lens[b]: KV tokens covered by its group's prefix tile (0 without a group).
        suffix_block_ids[b]: its own block ids after the prefix, ceil(suffix_lens[b] / block_size)
            of them (its whole table without a group).
        suffix_lens[b]: own KV length = seq_lens[b] - seq_prefix_lens[b] [tokens].

    `plan_cache` holds per-implementation derived tensors (the Triton tile table) so one step's
    layers plan once; it is owned by the implementations.
    """

    block_size: int
    group_block_ids: list[list[int]]
    group_prefix_lens: list[int]
    group_seq_ids: list[list[int]]
    group_query_ranges: list[list[tuple[int, int]]]
    seq_group: list[int]
    seq_prefix_lens: list[int]
    suffix_block_ids: list[list[int]]
    suffix_lens: list[int]
    plan_cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_groups(self) -> int:
        return len(self.group_prefix_lens)

    def group_token_indices(self, g: int) -> list[int]:
        """Query-token indices of group g, member by member (the M order of its prefix tile)."""
        return [t for start, end in self.group_query_ranges[g] for t in range(start, end)]

    @property
    def saved_kv_tokens(self) -> int:
        """KV tokens (per layer, per KV head) the shared path does not read this step versus
        plain paged attention: sum over groups of (members - 1) * prefix_len."""
        return sum((len(m) - 1) * p for m, p in zip(self.group_seq_ids, self.group_prefix_lens))


def build_shared_prefix_metadata(
    attn_meta: AttentionMetadata,
    prefix_lens: list[int],
    min_group_size: int = 2,
    max_member_query_len: int | None = None,
) -> SharedPrefixMetadata:
    """Derive a step's prefix groups from per-sequence shared-prefix lengths.

    Sequences b with prefix_lens[b] = p > 0 are grouped by the tuple of their first p / block_size
    block ids (same physical prefix = same group). A sequence stays without a group (its whole KV
    is its "suffix") when p == 0, when it has no query tokens this step, when its first query
    position is < p (a group leader still computing the prefix: its queries must see the prefix
    causally), or when fewer than `min_group_size` sequences of the step share its prefix (a group
    of one reads the prefix once either way; pass 1 to force groups of one, e.g. in tests), or when
    it computes more than `max_member_query_len` tokens this step (a long prefill chunk is already
    a matrix-matrix pass over the prefix: grouping it saves no KV reads, only adds partial states).

    Args:
        attn_meta: the step's metadata; `block_tables_cpu` is used when present (else one
            device-to-host copy of `block_tables`).
        prefix_lens: [B] shared-prefix length of each sequence [tokens], 0 for none.
        min_group_size: smallest group kept.
        max_member_query_len: longest q_len that may join a group (None: any).
    Returns:
        The step's `SharedPrefixMetadata`; groups in order of their first member.
    Raises:
        ValueError: if len(prefix_lens) != B, a length is negative or not a multiple of the block
            size, or a block table is shorter than its prefix or its KV.
    """
    num_seqs, bs = attn_meta.num_seqs, attn_meta.block_size
    if len(prefix_lens) != num_seqs:
        raise ValueError(f"prefix_lens has {len(prefix_lens)} entries for {num_seqs} sequences")
    tables = attn_meta.block_tables_cpu
    if tables is None:
        tables = attn_meta.block_tables.tolist()
    qsl, seq_lens = attn_meta.query_start_loc_cpu, attn_meta.seq_lens_cpu
    candidates = _candidate_groups(attn_meta, tables, prefix_lens, max_member_query_len)
    seq_group = [-1] * num_seqs
    sp = SharedPrefixMetadata(bs, [], [], [], [], seq_group, [0] * num_seqs, [], [])
    for ids, members in candidates:
        if len(members) < max(min_group_size, 1):
            continue
        g, p = sp.num_groups, len(ids) * bs
        sp.group_block_ids.append(list(ids))
        sp.group_prefix_lens.append(p)
        sp.group_seq_ids.append(members)
        sp.group_query_ranges.append([(qsl[b], qsl[b + 1]) for b in members])
        for b in members:
            seq_group[b] = g
            sp.seq_prefix_lens[b] = p
    for b in range(num_seqs):
        p = sp.seq_prefix_lens[b]
        sp.suffix_lens.append(seq_lens[b] - p)
        sp.suffix_block_ids.append(list(tables[b][p // bs : -(-seq_lens[b] // bs)]))
    return sp


def _candidate_groups(
    attn_meta: AttentionMetadata,
    tables: list[list[int]],
    prefix_lens: list[int],
    max_member_query_len: int | None,
) -> list[tuple[list[int], list[int]]]:
    """(prefix block ids, members) of each distinct prefix the step's eligible sequences
    start with, in order of first member (see `build_shared_prefix_metadata`; checks its
    arguments the same way)."""
    bs = attn_meta.block_size
    qsl, seq_lens = attn_meta.query_start_loc_cpu, attn_meta.seq_lens_cpu
    # Bucket by (length, first, last block) -- cheap to hash --, then compare the whole prefix
    # with the bucket's groups (a C-level list compare): same blocks, same group.
    buckets: dict[tuple[int, int, int], list[tuple[list[int], list[int]]]] = {}
    candidates: list[tuple[list[int], list[int]]] = []
    for b, p in enumerate(prefix_lens):
        if p < 0 or p % bs:
            raise ValueError(f"sequence {b}: prefix_len {p} is not a multiple of block size {bs}")
        if len(tables[b]) < -(-seq_lens[b] // bs):
            raise ValueError(f"sequence {b}: block table too short for {seq_lens[b]} tokens")
        q_len = qsl[b + 1] - qsl[b]
        if p == 0 or q_len == 0 or seq_lens[b] - q_len < p:
            continue
        if max_member_query_len is not None and q_len > max_member_query_len:
            continue
        prefix = tables[b][: p // bs]
        bucket = buckets.setdefault((p, prefix[0], prefix[-1]), [])
        for ids, members in bucket:
            if ids == prefix:
                members.append(b)
                break
        else:
            bucket.append((prefix, [b]))
            candidates.append(bucket[-1])
    return candidates


def pad_groups(sp: SharedPrefixMetadata, meta: AttentionMetadata) -> SharedPrefixMetadata:
    """The groups of a step's first len(sp.seq_group) sequences, extended by the padding
    sequences that follow them in `meta` (each without a group, its whole KV its own)."""
    num_real, bs = len(sp.seq_group), meta.block_size
    pad = range(num_real, meta.num_seqs)
    if not pad:
        return sp
    seq_lens, tables = meta.seq_lens_cpu, meta.block_tables_cpu
    return dataclasses.replace(
        sp,
        seq_group=sp.seq_group + [-1] * len(pad),
        seq_prefix_lens=sp.seq_prefix_lens + [0] * len(pad),
        suffix_block_ids=sp.suffix_block_ids + [tables[b][: -(-seq_lens[b] // bs)] for b in pad],
        suffix_lens=sp.suffix_lens + [seq_lens[b] for b in pad],
        plan_cache={},
    )
