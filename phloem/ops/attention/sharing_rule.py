"""The cost rule of prefix-shared attention: on which steps sharing a prefix pays, as pure functions.

With S = `SharedPrefixMetadata.saved_kv_tokens` = sum over the step's groups of (members - 1) *
prefix_len (the KV tokens, per layer and KV head, that plain paged attention would read again)
and R = the grouped query tokens:

    shared  iff  S >= min_saved_kv_tokens  and  S >= partial_cost_tokens * R

Each grouped token costs the shared path a float32 partial (O, LSE) write and read for the prefix
and suffix states: 2 states * 2 passes * H * D * 4 bytes, against 2 * H_kv * D * kv_bytes per
saved KV token -- about 16 KV tokens for Llama-3-8B (H / H_kv = 4, bf16), the default. The floor
`min_saved_kv_tokens` covers the fixed cost of the extra merge launch.

Decode-only steps can replay a CUDA graph instead (`decode_path`): the "shared_prefix" graph
when the step saves at least `shared_graph_min_saved_kv_tokens` (our three launches per layer
against the plain backend's one cost a few microseconds each, about the time 16K KV tokens take
to read), else the plain graph unless the step saves at least `graph_min_saved_kv_tokens`: an
eager step gives up the graph's launch savings (of the order of 10 ms for a 32-layer 8B model:
every kernel launch of every layer), about what 2^19 saved KV tokens of Llama-3-8B (128 KiB each
over all layers, 64 GiB in all) take to read at HBM bandwidth (4-5 TB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from phloem.ops.attention.interface import DecodePath
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata, build_shared_prefix_metadata


@dataclass(frozen=True)
class SharingRule:
    """The thresholds of the cost rule (module docstring) and of group formation.

    Attributes:
        min_saved_kv_tokens: least S of a shared step [KV tokens].
        partial_cost_tokens: least S per grouped query token [KV tokens per token].
        graph_min_saved_kv_tokens: least S of a decode step to run shared and eagerly rather
            than replay the plain CUDA graph [KV tokens].
        shared_graph_min_saved_kv_tokens: least S of a decode step to replay the
            "shared_prefix" graph rather than the plain one [KV tokens].
        min_group_size: fewest members of a step that form a group (`build_shared_prefix_metadata`).
        max_member_query_len: longest q_len that joins a group [tokens] (None: any); a longer
            prefill chunk is already a matrix-matrix pass over the prefix and reads its whole
            KV in its own tiles.
    """

    min_saved_kv_tokens: int = 1024
    partial_cost_tokens: float = 16.0
    graph_min_saved_kv_tokens: int = 1 << 19
    shared_graph_min_saved_kv_tokens: int = 1 << 14
    min_group_size: int = 2
    max_member_query_len: int | None = 16


def pays(rule: SharingRule, groups: SharedPrefixMetadata) -> bool:
    """Whether the shared path pays for a step with these groups (the rule above)."""
    saved = groups.saved_kv_tokens
    grouped = sum(e - s for ranges in groups.group_query_ranges for s, e in ranges)
    return saved >= rule.min_saved_kv_tokens and saved >= rule.partial_cost_tokens * grouped


def shared_groups(rule: SharingRule, meta: AttentionMetadata) -> SharedPrefixMetadata | None:
    """The step's groups (from `meta.prefix_lens_cpu`) if the shared path pays, else None
    (also when no sequence has a prefix). Host only, no side effects."""
    prefix_lens = meta.prefix_lens_cpu
    if not prefix_lens or not any(prefix_lens):
        return None
    groups = build_shared_prefix_metadata(
        meta, prefix_lens, rule.min_group_size, rule.max_member_query_len
    )
    return groups if pays(rule, groups) else None


def decode_path(
    rule: SharingRule, groups: SharedPrefixMetadata | None, shared_graph: bool
) -> DecodePath:
    """How a decode-only step whose shared path pays (`groups`, None when it does not) runs;
    `shared_graph`: a "shared_prefix" graph can take the step (captured for its batch, and the
    step fits its buffers)."""
    if groups is None:
        return DecodePath.GRAPH
    saved = groups.saved_kv_tokens
    if shared_graph and saved >= rule.shared_graph_min_saved_kv_tokens:
        return DecodePath.SHARED_GRAPH
    if saved < rule.graph_min_saved_kv_tokens:
        return DecodePath.GRAPH  # the plain graph's launch savings beat the eager shared path's
    return DecodePath.EAGER
