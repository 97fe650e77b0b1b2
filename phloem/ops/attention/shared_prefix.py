"""Prefix-shared (cascade) attention: read a group's shared prefix KV once per step for all members.

Members of a prefix group (core/prefix_planner.py, runtime `SharedPrefix` in core/request.py) hold
the same physical KV blocks for their first `prefix_len` tokens (a multiple of the block size):

    sequence b:  |-- shared prefix: group blocks, prefix_len --|-- own blocks: seq_len - prefix_len --|
                                                                  |-- this step's q_len queries --|

Every query of a member sits at a position >= prefix_len, so it attends to the *whole* prefix (no
causal mask there) and causally to its own tokens. Softmax attention over a union of two disjoint
KV sets is exactly the log-sum-exp merge of the attention over each set (FlashInfer's
"attention states", arXiv 2501.01005 §2.2; Hydragen arXiv 2402.05099 §3; BatchLLM arXiv 2412.03594
§5): with (O_i, LSE_i) the normalized output and log-sum-exp of the scores over set i,

    LSE = log(exp(LSE_1) + exp(LSE_2)),   O = exp(LSE_1 - LSE) O_1 + exp(LSE_2 - LSE) O_2.

So a step splits into
  * prefix tiles, one per group: all query tokens of the group's members (GQA heads folded into the
    M dimension: row = token * (H / H_kv) + g) against the prefix KV -- a matrix-matrix product that
    reads the prefix once instead of once per member (the Hydragen / BatchLLM saving), and
  * suffix tiles, one per sequence: its queries against its own KV with the causal mask,
each producing a partial (O, LSE), then a merge.

Parts of this module:
  * `SharedPrefixMetadata` and `build_shared_prefix_metadata`: the group structure of one step,
    derived from per-sequence prefix lengths and the block tables (group key = prefix block ids).
  * `merge_attention_states`: the merge, natural-log LSE (FlashInfer uses base 2; see there).
  * `shared_prefix_attention_reference`: the cascade math in plain torch (the CPU path, an oracle).
  * `shared_prefix_attention_triton`: our kernel -- ONE launch whose grid covers the prefix tiles
    and the suffix tiles of the step (BatchLLM's horizontal fusion), then a small merge kernel
    (in shared_prefix_triton.py, imported lazily).
  * `SharedPrefixAttention`: an `AttentionBackend` that chooses per step, by a documented cost
    rule, between the shared-prefix path and a plain paged backend, and counts which one ran;
    its "flashinfer" impl is the library baseline (shared_prefix_flashinfer.py, lazily).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from phloem.ops.attention.interface import AttentionBackend, AttentionMetadata
from phloem.ops.attention.reference import _gather_kv
from phloem.ops.kv_store import kv_layout
from phloem.ops.staging import to_device

# -- per-step group structure ------------------------------------------------------------------


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
    # Bucket by (length, first, last block) -- cheap to hash --, then compare the whole prefix
    # with the bucket's groups (a C-level list compare): same blocks, same group.
    buckets: dict[tuple[int, int, int], list[tuple[list[int], list[int]]]] = {}
    candidates: list[tuple[list[int], list[int]]] = []  # (prefix block ids, members)
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


# -- merging attention states -----------------------------------------------------------------


def merge_attention_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint KV sets into the result over their union.

    Args:
        o1, o2: [T, H, D] normalized partial outputs (any float dtype).
        lse1, lse2: [T, H] log-sum-exp of the *scaled* scores of each set, NATURAL log:
            lse = log(sum_j exp(scale * q.k_j)); -inf for an empty set.
            FlashInfer (`run(return_lse=True)`, `merge_state`) uses base 2:
            lse_2 = log2(sum_j 2^(scale * log2(e) * q.k_j)) = lse / ln 2, so convert with
            `lse = lse_2 * math.log(2)` (and back with `lse_2 = lse / math.log(2)`).
    Returns:
        (o [T, H, D], lse [T, H]) in float32 (float64 if any input is float64). Rows where both
        sets are empty get o = 0 and lse = -inf. A partial output with lse = -inf is never read,
        so it may hold garbage (NaN).
    """
    cdt = torch.float64 if torch.float64 in (o1.dtype, o2.dtype, lse1.dtype) else torch.float32
    lse1, lse2 = lse1.to(cdt), lse2.to(cdt)
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)  # [T, H], in [0, 1]
    den = w1 + w2
    zero = torch.zeros((), dtype=cdt, device=o1.device)
    num = torch.where(w1[..., None] > 0, o1.to(cdt), zero) * w1[..., None]
    num = num + torch.where(w2[..., None] > 0, o2.to(cdt), zero) * w2[..., None]
    o = num / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return o, m + torch.log(den)


# -- plain-torch reference of the cascade math ------------------------------------------------


def _fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[n, H, D] -> [H_kv, n * G, D]; row t * G + g is token t, query head h_kv * G + g."""
    n, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    return (
        q.view(n, num_kv_heads, group, head_dim)
        .transpose(0, 1)
        .reshape(num_kv_heads, n * group, head_dim)
    )


def _unfold_gqa(o: torch.Tensor, lse: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_fold_gqa` for outputs [H_kv, n * G, D] and LSE [H_kv, n * G]."""
    num_kv_heads, rows, head_dim = o.shape
    group = rows // n
    o = o.view(num_kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, -1, head_dim)
    return o, lse.view(num_kv_heads, n, group).transpose(0, 1).reshape(n, -1)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H_kv, M, D], k/v [N, H_kv, D], keep [M, N] or None -> (o [H_kv, M, D], lse [H_kv, M])."""
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [H_kv, N, D]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H_kv, M, N]
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def shared_prefix_partials_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_meta: AttentionMetadata,
    sp_meta: SharedPrefixMetadata,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two partial attention states of every query token, in plain torch.

    Returns:
        (o_prefix [T, H, D], lse_prefix [T, H], o_suffix [T, H, D], lse_suffix [T, H]) in float32
        (float64 for float64 queries); natural-log LSE. Tokens without a group have
        lse_prefix = -inf and o_prefix = 0; tokens outside `query_start_loc` have both LSE -inf.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    cdt = torch.float64 if query.dtype == torch.float64 else torch.float32
    dev = query.device
    o_pre = torch.zeros(num_tokens, num_heads, head_dim, dtype=cdt, device=dev)
    lse_pre = torch.full((num_tokens, num_heads), float("-inf"), dtype=cdt, device=dev)
    o_suf, lse_suf = o_pre.clone(), lse_pre.clone()
    i64 = dict(dtype=torch.int64, device=dev)
    # Prefix: all queries of a group against the prefix KV, one matmul per group (no mask).
    for g in range(sp_meta.num_groups):
        tokens = torch.tensor(sp_meta.group_token_indices(g), **i64)
        p = sp_meta.group_prefix_lens[g]
        table = torch.tensor([sp_meta.group_block_ids[g]], **i64)
        k, v = _gather_kv(kv_cache, table, torch.tensor([p], **i64), p, cdt)
        q = _fold_gqa(query[tokens].to(cdt), num_kv_heads)
        o, lse = _unfold_gqa(*_attend(q, k[0], v[0], scale, None), len(tokens))
        o_pre[tokens], lse_pre[tokens] = o, lse
    # Suffix: each sequence against its own KV, causal: query i sits at position seq_len - q_len
    # + i and sees own KV index j (position prefix_len + j) iff prefix_len + j <= that position.
    qsl = attn_meta.query_start_loc_cpu
    for b in range(attn_meta.num_seqs):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        p, n_own = sp_meta.seq_prefix_lens[b], sp_meta.suffix_lens[b]
        table = torch.tensor([sp_meta.suffix_block_ids[b]], **i64)
        k, v = _gather_kv(kv_cache, table, torch.tensor([n_own], **i64), n_own, cdt)
        q_pos = torch.arange(attn_meta.seq_lens_cpu[b] - (end - start), attn_meta.seq_lens_cpu[b])
        keep = (p + torch.arange(n_own))[None, :] <= q_pos[:, None]  # [q_len, n_own]
        keep = keep.to(dev).repeat_interleave(num_heads // num_kv_heads, dim=0)
        q = _fold_gqa(query[start:end].to(cdt), num_kv_heads)
        o_suf[start:end], lse_suf[start:end] = _unfold_gqa(
            *_attend(q, k[0], v[0], scale, keep), end - start
        )
    return o_pre, lse_pre, o_suf, lse_suf


def shared_prefix_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_meta: AttentionMetadata,
    sp_meta: SharedPrefixMetadata,
    scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cascade attention in plain torch: prefix part per group + suffix part per sequence, merged.

    Equal (up to rounding) to causal paged attention over each sequence's whole KV
    (`paged_attention_reference`); reads each group's prefix KV once.

    Args:
        query: [T, H, D]; kv_cache: [num_blocks, 2, block_size, H_kv, D] (read only);
        attn_meta: the step's metadata; sp_meta: its groups (`build_shared_prefix_metadata`);
        scale: softmax scale; return_lse: also return the merged natural-log LSE [T, H].
    Returns:
        [T, H, D] in query.dtype (zeros for tokens outside `query_start_loc`), and the LSE in
        float32 (float64 for float64 queries) if asked.
    """
    o, lse = merge_attention_states(
        *shared_prefix_partials_reference(query, kv_cache, attn_meta, sp_meta, scale)
    )
    out = o.to(query.dtype)
    return (out, lse) if return_lse else out


# -- our Triton kernel (shared_prefix_triton.py, imported lazily) ------------------------------


def shared_prefix_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_meta: AttentionMetadata,
    sp_meta: SharedPrefixMetadata,
    scale: float,
    **options: Any,
) -> torch.Tensor:
    """Cascade attention with our Triton kernel: one horizontally fused launch over the step's
    prefix tiles (per group, GQA heads folded into M) and suffix tiles (per sequence, causal),
    then a merge launch. Same contract as `shared_prefix_attention_reference` (output only);
    `options` (block_m, block_n, prefix_splits, num_warps, num_stages) are documented in
    `shared_prefix_triton.shared_prefix_attention`. Imports triton on first use.
    """
    from phloem.ops.attention.shared_prefix_triton import shared_prefix_attention

    return shared_prefix_attention(query, kv_cache, attn_meta, sp_meta, scale, **options)


# -- the backend: per-step choice between the shared-prefix path and plain paged attention ------


IMPLS = ("auto", "triton", "flashinfer", "reference")
# Block-id capacity of the shared-prefix graph buffers, per sequence of the largest batch
# (average own blocks: 4,096 tokens at block size 16); a step needing more runs eagerly.
_GRAPH_BLOCKS_PER_SEQ = 256


def _pad_groups(sp: SharedPrefixMetadata, meta: AttentionMetadata) -> SharedPrefixMetadata:
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


def _host_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str | None = None,
    padded_tables: bool = False,
    prefix_lens: list[int] | None = None,
) -> AttentionMetadata:
    """A step's metadata from host lists (what planning backends read). Device fields:
    `query_start_loc` and `seq_lens` on `device` (empty when None), the 0-padded block table
    only with `padded_tables` (for backends that read it), no slot mapping."""
    qsl = [0, *itertools.accumulate(query_lens)]
    i32 = dict(dtype=torch.int32, device=device)
    empty = torch.empty(0, **i32)
    tables = empty
    if padded_tables:
        width = max(map(len, block_tables), default=0)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], **i32)
    return AttentionMetadata(
        slot_mapping=empty,
        query_start_loc=empty if device is None else torch.tensor(qsl, **i32),
        seq_lens=empty if device is None else torch.tensor(seq_lens, **i32),
        block_tables=tables,
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_tables_cpu=block_tables,
        prefix_lens_cpu=prefix_lens,
    )


class SharedPrefixAttention:
    """An `AttentionBackend` that runs cascade attention on steps where prefix sharing pays, and
    delegates every other step (and every CUDA-graph step) to a plain paged backend.

    How it learns the groups: the model runner sets `meta.prefix_lens_cpu` (list[int], one per
    sequence: the length of the group prefix its block table starts with, 0 for none); absent or
    all-zero means no sharing. `begin_step(meta)` builds the `SharedPrefixMetadata` once per step.

    Cost rule (per step, host only), with S = `SharedPrefixMetadata.saved_kv_tokens` =
    sum over groups of (members in the step - 1) * prefix_len, and R = grouped query tokens:

        shared  iff  S >= min_saved_kv_tokens  and  S >= partial_cost_tokens * R

    S is the KV tokens (per layer and KV head) plain paged attention would read again; each
    grouped token costs the shared path a float32 partial (O, LSE) write and read for the prefix
    and suffix states: 2 states * 2 passes * H * D * 4 bytes, against 2 * H_kv * D * kv_bytes per
    saved KV token -- about 16 KV tokens for Llama-3-8B (H / H_kv = 4, bf16), the default. The
    floor `min_saved_kv_tokens` (default 1024) covers the fixed cost of the extra merge launch.

    CUDA graphs: decode steps replay captured graphs in one of two variants (`graph_variants`):
    "plain" (the fallback's kernels) or, with the Triton impl on CUDA, "shared_prefix" (our kernels
    over fixed-capacity tile tables, `shared_prefix_triton.DecodeGraphPlan`). The model runner
    asks `plan_decode` which one a step takes; with a shared-prefix graph the threshold is
    `shared_graph_min_saved_kv_tokens` (the graph keeps its launch savings either way), without
    one `graph_min_saved_kv_tokens` (the shared path gives them up by running eagerly).

    Counters (`stats()`, for `--json`): steps that ran the shared path (eagerly or in a graph),
    eager plain steps, CUDA-graph plain steps and shared-prefix graph steps (each replay plans
    once), shared steps whose prefill chunks went to `prefill_backend`, and KV tokens saved.
    `reset_stats()` zeroes them (the graph runner does after its captures).

    Args:
        fallback: the plain paged backend (FlashInfer on GPU, `ReferenceAttention` on CPU).
        impl: "triton" (ours), "flashinfer" (the library cascade baseline,
            `shared_prefix_flashinfer.FlashInferCascade`), "reference", or "auto" (Triton for CUDA
            tensors when it imports, else the reference), resolved at the first shared step.
        min_saved_kv_tokens, partial_cost_tokens: the cost rule above.
        min_group_size, max_member_query_len: which sequences form groups
            (`build_shared_prefix_metadata`); by default prefill chunks longer than 16 tokens
            stay out of groups and read their whole KV in their own tiles.
        graph_min_saved_kv_tokens: a decode step that a CUDA graph could replay (`plan_decode`)
            takes the shared path only if S is at least this: the eager step gives up the
            graph's launch savings (~10-15 ms for a 32-layer 8B model), about what 2^19 saved
            KV tokens of Llama-3-8B (128 KiB each over all layers, 64 GiB) take to read at
            4-5 TB/s. On an H200 (benchmarks/results/2026-11-23-h200), 16 groups of 16 (S ~ 480k)
            ran 2.2x slower end to end with eager shared decode steps (and kernels compiling
            mid-run, since fixed by `warmup`); with this rule it runs on par with FlashInfer.
        cuda_graphs: offer the "shared_prefix" graph variant when the impl is Triton on CUDA.
        shared_graph_min_saved_kv_tokens: S a decode step needs to replay the shared-prefix
            graph rather than the plain one: our three launches per layer against the fallback's
            one cost a few microseconds each, about the time 16K KV tokens take to read.
        num_heads, num_kv_heads, head_dim, device: the attention geometry, needed for the
            shared-prefix graph variant (`get_attention_backend` passes them).
        prefill_backend: if set, eager shared steps hand their long prefill chunks (sequences
            without a group and with at least `prefill_min_query_len` queries: group leaders
            computing a prefix, members computing their own prompt) to this plain backend,
            planned for just those sequences, and our kernel computes the rest. Prefill chunks
            are compute-bound, where a library kernel tuned per GPU beats our portable tiles
            (FlashInfer's Hopper "fa3" kernels: 399 vs 259 TFLOP/s on an H200,
            benchmarks/results/2026-11-23-h200-b/prefill-attention.json);
            `get_attention_backend` sets it on Hopper GPUs.
        triton_options: passed to the Triton kernel (block_m, block_n, prefix_splits, ...).
    """

    name = "shared_prefix"

    def __init__(
        self,
        fallback: AttentionBackend,
        impl: str = "auto",
        min_saved_kv_tokens: int = 1024,
        partial_cost_tokens: float = 16.0,
        min_group_size: int = 2,
        max_member_query_len: int | None = 16,
        graph_min_saved_kv_tokens: int = 1 << 19,
        cuda_graphs: bool = True,
        shared_graph_min_saved_kv_tokens: int = 1 << 14,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        device: torch.device | str | None = None,
        prefill_backend: AttentionBackend | None = None,
        prefill_min_query_len: int = 64,
        **triton_options: Any,
    ) -> None:
        if impl not in IMPLS:
            raise ValueError(f"unknown shared-prefix impl {impl!r}; supported: {list(IMPLS)}")
        self.fallback = fallback
        self.impl = impl
        self.min_saved_kv_tokens = min_saved_kv_tokens
        self.partial_cost_tokens = partial_cost_tokens
        self.min_group_size = min_group_size
        self.max_member_query_len = max_member_query_len
        self.graph_min_saved_kv_tokens = graph_min_saved_kv_tokens
        self.cuda_graphs = cuda_graphs
        self.shared_graph_min_saved_kv_tokens = shared_graph_min_saved_kv_tokens
        self.geometry = (num_heads, num_kv_heads, head_dim)
        self.device = torch.device(device) if device is not None else None
        self.prefill_backend = prefill_backend
        self.prefill_min_query_len = prefill_min_query_len
        self._prefill_takes_out = prefill_backend is not None and (
            "out" in inspect.signature(prefill_backend.forward).parameters
        )
        self._split: tuple[np.ndarray, Any, AttentionMetadata] | None = None
        self.triton_options = triton_options
        self.num_shared_steps = 0
        self.num_plain_steps = 0
        self.num_graph_steps = 0
        self.num_shared_graph_steps = 0
        self.num_prefill_split_steps = 0
        self.num_saved_kv_tokens = 0
        self.last_path: str | None = None
        self._meta: AttentionMetadata | None = None
        self._sp: SharedPrefixMetadata | None = None
        self._cascade: Any = None  # FlashInferCascade, made at the first "flashinfer" step
        self._cascade_step: SharedPrefixMetadata | None = None
        self._graph_plan: Any = None  # DecodeGraphPlan, made at the first shared graph capture
        self._graph_step = False  # the current step replays a shared-prefix graph

    @property
    def needs_block_tables(self) -> bool:
        """The shared path plans from host lists; the fallback may read the device table."""
        return getattr(self.fallback, "needs_block_tables", True)

    def plan(self, meta: AttentionMetadata) -> SharedPrefixMetadata | None:
        """The step's groups if the cost rule picks the shared path, else None. Host only, no
        side effects: the model runner may call it to decide whether to replay a CUDA graph."""
        prefix_lens = getattr(meta, "prefix_lens_cpu", None)
        if not prefix_lens or not any(prefix_lens):
            return None
        sp = build_shared_prefix_metadata(
            meta, prefix_lens, self.min_group_size, self.max_member_query_len
        )
        saved = sp.saved_kv_tokens
        grouped = sum(e - s for ranges in sp.group_query_ranges for s, e in ranges)
        if saved < self.min_saved_kv_tokens or saved < self.partial_cost_tokens * grouped:
            return None
        return sp

    def plan_decode(
        self,
        seq_lens: list[int],
        block_tables: list[list[int]],
        prefix_lens: list[int],
        block_size: int,
        shared_graph: bool = False,
    ) -> tuple[str, SharedPrefixMetadata | None]:
        """How a decode-only step given as host lists (one query per sequence) runs, for the
        model runner's CUDA-graph decision: ("graph", None) replays the plain graph;
        ("shared_graph", groups) the "shared_prefix" graph (offered only when `shared_graph`:
        the runner has one for the step's batch; the step must also fit its buffers);
        ("eager", groups) the shared path without a graph. Host only, no counters."""
        meta = _host_metadata(
            [1] * len(seq_lens), seq_lens, block_tables, block_size, prefix_lens=prefix_lens
        )
        sp = self.plan(meta)
        if sp is None:
            return "graph", None
        in_graph = shared_graph and (self._graph_plan is None or self._graph_plan.fits(sp))
        if in_graph and sp.saved_kv_tokens >= self.shared_graph_min_saved_kv_tokens:
            return "shared_graph", sp
        if sp.saved_kv_tokens < self.graph_min_saved_kv_tokens:
            return "graph", None  # the plain graph's launch savings beat the eager shared path's
        return "eager", sp

    def graph_variants(self) -> dict[str, int]:
        """The decode CUDA-graph variants to capture, each with the smallest batch size it is
        captured for: "plain" always; "shared_prefix" when the Triton impl can run on the
        configured CUDA device with known geometry (GQA <= the narrow tile, 16 rows)."""
        variants = {"plain": 1}
        num_heads, num_kv_heads, _ = self.geometry
        narrow = self.triton_options.get("narrow_block_m", 16)
        ok = (
            self.cuda_graphs
            and self.impl in ("auto", "triton")
            and self.device is not None
            and self.device.type == "cuda"
            and num_heads is not None
            and narrow is not None
            and num_heads // num_kv_heads <= narrow
            and hasattr(self.fallback, "begin_step")
        )
        if ok:
            try:
                import triton  # noqa: F401
            except ImportError:
                ok = False
        if ok:
            variants["shared_prefix"] = 16
        return variants

    def warmup(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        block_id: int,
        scale: float,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Run one synthetic shared step (a group of 16 decode members, a lone decode and a
        max(32, prefill_min_query_len)-token prefill chunk, all reading block `block_id`) so
        the kernels of the common shapes compile at start-up rather than in the first real
        steps. Queries in `dtype` (default the cache's). Writes nothing."""
        bs, head_dim = kv_cache.shape[2], kv_cache.shape[4]
        prefix_blocks = max(1, -(-max(self.min_saved_kv_tokens, 1) // (15 * bs)))
        prefix = [block_id] * prefix_blocks
        p = prefix_blocks * bs
        chunk = max(32, self.prefill_min_query_len)  # also loads `prefill_backend`'s kernel
        tables = [prefix + [block_id]] * 16 + [[block_id]] + [[block_id] * -(-chunk // bs)]
        meta = _host_metadata(
            [1] * 17 + [chunk], [p + 1] * 16 + [1, chunk], tables, bs, device=kv_cache.device,
            prefix_lens=[p] * 16 + [0, 0],
        )  # fmt: skip
        num_tokens = meta.query_start_loc_cpu[-1]
        query = torch.randn(num_tokens, num_heads, head_dim, device=kv_cache.device)
        counters = self._counters()
        self.begin_step(meta)
        if self._sp is not None:
            self.forward(query.to(dtype or kv_cache.dtype), kv_cache, meta, scale)
        self.end_step()
        self._set_counters(counters)  # not a step of the workload

    def begin_step(
        self,
        meta: AttentionMetadata,
        cuda_graph: bool = False,
        graph_variant: str = "plain",
        shared: SharedPrefixMetadata | None = None,
    ) -> None:
        """Choose the step's path and plan it; call once per step before the forward pass (the
        model runner does). Mutates the counters and, on the plain path, the fallback's plan.

        With `cuda_graph` and `graph_variant="shared_prefix"`, plans the (padded) decode step
        into the shared-prefix graph buffers: `shared` is the step's groups from `plan_decode`
        over the real sequences (padding rows follow them, without a group); None (a capture)
        builds them from `meta.prefix_lens_cpu`.

        Raises:
            ValueError: with `cuda_graph` when the fallback cannot plan graph steps, for an
                unknown graph variant, or a shared step the graph buffers cannot hold.
        """
        self._graph_step = False
        if cuda_graph and graph_variant == "shared_prefix":
            self._begin_shared_graph_step(meta, shared)
            return
        if graph_variant != "plain":
            raise ValueError(f"unknown CUDA-graph variant {graph_variant!r}")
        sp = None if cuda_graph else self.plan(meta)
        self._meta, self._sp = meta, sp
        self._split = None
        if sp is not None:
            if self.prefill_backend is not None and self._resolve_impl(None) == "triton":
                self._split = self._plan_prefill_split(meta, sp)
                self.num_prefill_split_steps += self._split is not None
            self.num_shared_steps += 1
            self.num_saved_kv_tokens += sp.saved_kv_tokens
            self.last_path = "shared_prefix"
            return
        if cuda_graph:
            self.num_graph_steps += 1
        else:
            self.num_plain_steps += 1
        self.last_path = self.fallback.name
        begin = getattr(self.fallback, "begin_step", None)
        if begin is not None:
            begin(meta, cuda_graph=cuda_graph)
        elif cuda_graph:
            raise ValueError(f"fallback backend {self.fallback.name!r} cannot plan CUDA graphs")

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal paged attention (the `AttentionBackend.forward` contract) by the step's path;
        plans the step first if `begin_step` was not called with this `meta`."""
        if meta is not self._meta:
            self.begin_step(meta)
        if self._graph_step:
            return self._graph_plan.forward(query, kv_cache, scale, meta.block_size)
        if self._sp is None:
            return self.fallback.forward(query, kv_cache, meta, scale)
        impl = self._resolve_impl(query)
        if impl == "triton":
            split = self._split
            out = shared_prefix_attention_triton(
                query, kv_cache, meta, self._sp, scale,
                exclude=None if split is None else split[0], **self.triton_options,
            )  # fmt: skip
            if split is not None:
                self._run_prefill_split(query, kv_cache, out, scale)
            return out
        if impl == "flashinfer":
            return self._flashinfer_cascade(query, kv_cache, meta, scale)
        return shared_prefix_attention_reference(query, kv_cache, meta, self._sp, scale)

    def end_step(self) -> None:
        """Forget the step's plan (and the fallback's)."""
        self._meta = self._sp = self._split = None
        self._graph_step = False
        for backend in (self.fallback, self.prefill_backend):
            end = getattr(backend, "end_step", None)
            if end is not None:
                end()

    def stats(self) -> dict[str, Any]:
        """Which path ran how often (JSON-ready)."""
        return {
            "attention_path_last": self.last_path,
            "shared_prefix_steps": self.num_shared_steps,
            "plain_steps": self.num_plain_steps,
            "cuda_graph_steps": self.num_graph_steps,
            "shared_prefix_graph_steps": self.num_shared_graph_steps,
            "prefill_split_steps": self.num_prefill_split_steps,
            "shared_prefix_saved_kv_tokens": self.num_saved_kv_tokens,
        }

    _COUNTERS = ("num_shared_steps", "num_plain_steps", "num_graph_steps",
                 "num_shared_graph_steps", "num_prefill_split_steps", "num_saved_kv_tokens")  # fmt: skip

    def _counters(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self._COUNTERS)

    def _set_counters(self, values: tuple[int, ...]) -> None:
        for name, value in zip(self._COUNTERS, values, strict=True):
            setattr(self, name, value)

    def reset_stats(self) -> None:
        """Zero the counters of `stats()` (e.g. after CUDA-graph captures and warm-up steps)."""
        self._set_counters((0,) * len(self._COUNTERS))

    def _plan_prefill_split(
        self, meta: AttentionMetadata, sp: SharedPrefixMetadata
    ) -> tuple[np.ndarray, Any, AttentionMetadata] | None:
        """(exclude mask [B], token slice or index tensor, sub-step metadata) for the step's long
        ungrouped prefill chunks, planned on `prefill_backend`; None when there are none."""
        qsl, bs = meta.query_start_loc_cpu, meta.block_size
        seqs = [
            b for b in range(meta.num_seqs)
            if sp.seq_group[b] < 0 and qsl[b + 1] - qsl[b] >= self.prefill_min_query_len
        ]  # fmt: skip
        if not seqs:
            return None
        tables = meta.block_tables_cpu
        if tables is None:
            tables = meta.block_tables.tolist()
        seq_lens = [meta.seq_lens_cpu[b] for b in seqs]
        sub = _host_metadata(
            [qsl[b + 1] - qsl[b] for b in seqs], seq_lens,
            [tables[b][: -(-n // bs)] for b, n in zip(seqs, seq_lens)], bs, device="cpu",
            padded_tables=getattr(self.prefill_backend, "needs_block_tables", True),
        )  # fmt: skip
        if all(qsl[a + 1] == qsl[b] for a, b in zip(seqs, seqs[1:])):
            index: Any = slice(qsl[seqs[0]], qsl[seqs[-1] + 1])
        else:  # the chunks' token indices, uploaded once for the step's layers
            tokens = np.concatenate([np.arange(qsl[b], qsl[b + 1]) for b in seqs])
            index = to_device(tokens, meta.query_start_loc.device)
        begin = getattr(self.prefill_backend, "begin_step", None)
        if begin is not None:
            begin(sub)
        exclude = np.zeros(meta.num_seqs, dtype=bool)
        exclude[seqs] = True
        return exclude, index, sub

    def _run_prefill_split(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scale: float
    ) -> None:
        """Write the split-off prefill chunks' attention into `out` (in place when the chunks'
        tokens are contiguous and the backend takes `out`, else gathered and scattered)."""
        _, index, sub = self._split
        prefill = self.prefill_backend
        if isinstance(index, slice):
            dst = out[index]
            if self._prefill_takes_out:
                prefill.forward(query[index], kv_cache, sub, scale, out=dst)
            else:
                dst.copy_(prefill.forward(query[index], kv_cache, sub, scale))
            return
        if index.device != query.device:  # metadata built on another device (tests): once
            index = index.to(query.device)
            self._split = (self._split[0], index, sub)
        out.index_copy_(0, index, prefill.forward(query.index_select(0, index), kv_cache, sub,
                                                  scale))  # fmt: skip

    def _begin_shared_graph_step(
        self, meta: AttentionMetadata, shared: SharedPrefixMetadata | None
    ) -> None:
        """Plan a padded decode step into the shared-prefix graph buffers (made at the first
        call, the capture of the largest batch)."""
        from phloem.ops.attention.shared_prefix_triton import DecodeGraphPlan

        if shared is None:
            prefix_lens = meta.prefix_lens_cpu or [0] * meta.num_seqs
            shared = build_shared_prefix_metadata(
                meta, prefix_lens, self.min_group_size, self.max_member_query_len
            )
        sp = _pad_groups(shared, meta)
        if self._graph_plan is None:
            num_heads, num_kv_heads, head_dim = self.geometry
            options = {k: v for k, v in self.triton_options.items()
                       if k in ("block_n", "num_warps", "num_stages", "narrow_block_m")}  # fmt: skip
            self._graph_plan = DecodeGraphPlan(
                meta.num_seqs, num_heads, num_kv_heads, head_dim, self.device or "cuda",
                max_blocks=meta.num_seqs * _GRAPH_BLOCKS_PER_SEQ, **options,
            )  # fmt: skip
        self._graph_plan.prepare(meta, sp)
        self._meta, self._sp, self._graph_step = meta, sp, True
        self.num_shared_graph_steps += 1
        self.num_shared_steps += 1
        self.num_saved_kv_tokens += sp.saved_kv_tokens
        self.last_path = "shared_prefix"

    def _flashinfer_cascade(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """FlashInfer's two-level cascade, planned at the step's first layer."""
        if kv_cache.dtype != query.dtype:
            raise ValueError("the FlashInfer cascade baseline needs a KV cache of the query dtype")
        cascade = self._cascade
        layout = kv_layout(kv_cache)
        if (
            cascade is None
            or cascade.scale != scale
            or cascade.dtype != query.dtype
            or cascade.kv_layout != layout
        ):
            from phloem.ops.attention.shared_prefix_flashinfer import FlashInferCascade

            num_heads, head_dim = query.shape[1:]
            cascade = FlashInferCascade(
                num_heads, kv_cache.shape[3], head_dim, query.dtype, query.device, scale, layout
            )
            self._cascade, self._cascade_step = cascade, None
        if self._cascade_step is not self._sp:
            cascade.plan(meta, self._sp)
            self._cascade_step = self._sp
        return cascade.run(query, kv_cache)

    def _resolve_impl(self, query: torch.Tensor | None) -> str:
        """The impl to run; "auto" resolves at the first step with a query tensor (Triton for
        CUDA tensors when it imports, else the reference); before that, by `device`."""
        if self.impl == "auto":
            on_cuda = (
                query.is_cuda
                if query is not None
                else (self.device is not None and self.device.type == "cuda")
            )
            if query is None and not on_cuda:
                return "auto"
            impl = "reference"
            if on_cuda:
                try:
                    import triton  # noqa: F401

                    impl = "triton"
                except ImportError:
                    pass
            self.impl = impl
        return self.impl
