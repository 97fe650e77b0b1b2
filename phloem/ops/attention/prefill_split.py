"""The prefill split of an eager step: long prefill chunks on another backend.

Prefill chunks are compute-bound, where a library kernel tuned per GPU beats the general one
(FlashInfer's Hopper "fa3" kernels against our portable tiles and FlashInfer's "fa2";
`get_attention_backend` sets one up on Hopper GPUs), while decode rows are memory-bound, where
fa3 is slower than fa2 (2026-11-23-h200-b). The sequences of a step with at least
`min_query_len` queries are planned as a sub-step of their own on that backend; the step's other
kernel computes the rest and leaves their output rows to it:

    step tokens   |-- decode / short chunks (rest) --|-- long chunk (prefill backend) --|-- ... --|

Two kinds of step split (`SharedPrefixAttention` picks):
- a shared step (`PrefillSplit.plan`): the long chunks *without a prefix group* (group leaders
  computing a prefix, members computing their own prompt) go to the prefill backend; our
  cascade kernel runs the whole step with those sequences excluded;
- a plain step (`PrefillSplit.plan_plain`): the long chunks go to the prefill backend, the other
  sequences to the plain backend as a sub-step of their own; a step made only of long chunks
  goes to the prefill backend whole. PHLOEM_FA3_PLAIN_PREFILL=0 turns this kind off (A/B runs).

Each sub-step's query rows are a slice of the step's when its sequences are contiguous (run in
place), else an index tensor (gathered and scattered), uploaded once for the step's layers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from phloem.ops.attention.interface import AttentionBackend
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata
from phloem.ops.staging import to_device

PLAIN_PREFILL_ENV = "PHLOEM_FA3_PLAIN_PREFILL"


def plain_prefill_split(environ: Mapping[str, str] | None = None) -> bool:
    """Whether plain eager steps split their long chunks too: PHLOEM_FA3_PLAIN_PREFILL "1"
    (default) or "0" (only shared steps do, as before 2026-11-27). The factory reads it once,
    when it makes the backend.

    Raises:
        ValueError: naming PHLOEM_FA3_PLAIN_PREFILL for another value.
    """
    env = os.environ if environ is None else environ
    value = env.get(PLAIN_PREFILL_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{PLAIN_PREFILL_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


class SubStep(NamedTuple):
    """Some sequences of a step as a step of their own: `index` their query tokens in the step
    (a slice, or an int64 index tensor), `sub` their metadata."""

    index: Any
    sub: AttentionMetadata


class SplitPlan(NamedTuple):
    """A shared step's split: `exclude` (bool [B]) marks the sequences the prefill backend
    computes; `index` their query tokens (a slice when contiguous, else an int64 index tensor);
    `sub` the sub-step's metadata, planned on the prefill backend."""

    exclude: np.ndarray
    index: Any
    sub: AttentionMetadata


class PlainSplitPlan(NamedTuple):
    """A plain step's split: `prefill` the long chunks (on the prefill backend; the whole step,
    `index` slice(None), when every sequence is one), `rest` the other sequences (on the plain
    backend; None for a whole step), `num_tokens` the step's real query tokens."""

    prefill: SubStep
    rest: SubStep | None
    num_tokens: int


class PrefillSplit:
    """Plans and runs the split part of an eager step (see the module docstring).

    Args:
        backend: the plain backend for the split-off chunks; its `forward` takes `out=`.
        min_query_len: the fewest queries of a chunk that goes to it [tokens].
        max_num_seqs: the most chunks one sub-step may hold (the backend's workspace is sized
            for them, `get_attention_backend`); a step with more is not split.
    """

    def __init__(
        self, backend: AttentionBackend, min_query_len: int = 64, max_num_seqs: int = 256
    ) -> None:
        self.backend = backend
        self.min_query_len = min_query_len
        self.max_num_seqs = max_num_seqs

    def plan(self, meta: AttentionMetadata, groups: SharedPrefixMetadata) -> SplitPlan | None:
        """The split of a shared step with these groups, planned on the backend (its
        `begin_step` on the sub-step); None when no chunk qualifies."""
        qsl = np.asarray(meta.query_start_loc_cpu)
        exclude = (np.diff(qsl) >= self.min_query_len) & (np.asarray(groups.seq_group) < 0)
        seqs = np.flatnonzero(exclude)
        if not 0 < seqs.size <= self.max_num_seqs:
            return None
        step = sub_step(meta, qsl, seqs, self.backend.needs_block_tables)
        self.backend.begin_step(step.sub)
        return SplitPlan(exclude, step.index, step.sub)

    def plan_plain(
        self, meta: AttentionMetadata, rest_backend: AttentionBackend
    ) -> PlainSplitPlan | None:
        """The split of a plain step: the long chunks planned on the prefill backend, the other
        sequences on `rest_backend` (each backend's `begin_step`); None when no chunk qualifies
        (nothing planned: the caller plans the whole step as before)."""
        if meta.max_query_len < self.min_query_len:  # decode steps: O(1)
            return None
        qsl = np.asarray(meta.query_start_loc_cpu)
        long = np.diff(qsl) >= self.min_query_len
        seqs = np.flatnonzero(long)
        if not 0 < seqs.size <= self.max_num_seqs:
            return None
        rest = None
        if seqs.size < meta.num_seqs:
            rest = sub_step(meta, qsl, np.flatnonzero(~long), rest_backend.needs_block_tables)
            prefill = sub_step(meta, qsl, seqs, self.backend.needs_block_tables)
            rest_backend.begin_step(rest.sub)
        elif self.backend.needs_block_tables and not meta.block_tables.numel():
            prefill = sub_step(meta, qsl, seqs, True)  # the step was built without its table
        else:  # the whole step, padding rows included (the backend zeroes them)
            prefill = SubStep(slice(None), meta)
        self.backend.begin_step(prefill.sub)
        return PlainSplitPlan(prefill, rest, int(qsl[-1]))

    def run(
        self,
        split: SplitPlan,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> SplitPlan:
        """Write the split-off chunks' attention into `out` (in place when their tokens are
        contiguous, else gathered and scattered; `kv_scales`: an FP8 cache's (k_scale,
        v_scale)). Returns the plan to keep for the step's next layers (its index moved to the
        query's device when the metadata was built elsewhere)."""
        step = SubStep(split.index, split.sub)
        moved = run_sub_step(self.backend, step, query, kv_cache, out, scale, kv_scales)
        return split if moved is step else split._replace(index=moved.index)

    def run_plain(
        self,
        split: PlainSplitPlan,
        rest_backend: AttentionBackend,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor | None,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> tuple[PlainSplitPlan, torch.Tensor]:
        """A planned plain step's attention (the `AttentionBackend.forward` contract: `out`, if
        given, receives it; padding rows past `split.num_tokens` get zeros): the rest on
        `rest_backend`, the long chunks on the prefill backend. Returns the plan to keep for
        the step's next layers (`run`) and the output."""
        out = torch.empty_like(query) if out is None else out
        rest = split.rest
        if rest is not None:
            rest = run_sub_step(rest_backend, rest, query, kv_cache, out, scale, kv_scales)
        whole = rest is None and split.prefill.index == slice(None)  # zeroes its own padding
        if query.shape[0] > split.num_tokens and not whole:
            out[split.num_tokens :].zero_()
        prefill = run_sub_step(self.backend, split.prefill, query, kv_cache, out, scale, kv_scales)
        if prefill is not split.prefill or rest is not split.rest:
            split = split._replace(prefill=prefill, rest=rest)
        return split, out

    def end_step(self) -> None:
        """Forget the backend's sub-step plan."""
        self.backend.end_step()


def sub_step(
    meta: AttentionMetadata, qsl: np.ndarray, seqs: np.ndarray, padded_tables: bool
) -> SubStep:
    """Sequences `seqs` (ascending, at least one) of the step `meta` (query offsets `qsl`
    [B + 1]) as a step of their own: host lists only (planning backends read those), or with
    `padded_tables` its device fields on the CPU too (for a backend that reads the padded
    table, `needs_block_tables`: the reference). The index tensor of
    non-contiguous tokens is uploaded to `meta.query_start_loc`'s device. Host work: numpy, and
    one list item per sequence for its seq_len and block table."""
    starts, ends = qsl[seqs], qsl[seqs + 1]
    lens = ends - starts
    tables = meta.block_tables_cpu
    if tables is None:
        tables = meta.block_tables.tolist()
    ids = seqs.tolist()
    seq_lens = meta.seq_lens_cpu
    sub = AttentionMetadata.from_host(
        lens.tolist(), [seq_lens[b] for b in ids], [tables[b] for b in ids], meta.block_size,
        device="cpu" if padded_tables else None, padded_tables=padded_tables,
    )  # fmt: skip
    if np.array_equal(starts[1:], ends[:-1]):
        return SubStep(slice(int(starts[0]), int(ends[-1])), sub)
    # token t of the sub-step is step token t - (sub offset - step offset) of its sequence
    offsets = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    tokens = np.arange(int(lens.sum()), dtype=np.int64) + offsets
    return SubStep(to_device(tokens, meta.query_start_loc.device), sub)


def run_sub_step(
    backend: AttentionBackend,
    step: SubStep,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    kv_scales: tuple[float, float],
) -> SubStep:
    """Write `backend`'s attention of a planned sub-step into its rows of `out` (in place for a
    slice, else gathered and scattered). Returns the sub-step to keep for the next layers (its
    index moved to the query's device when it was built elsewhere: tests), else `step`."""
    index, sub = step.index, step.sub
    if isinstance(index, slice):
        backend.forward(query[index], kv_cache, sub, scale, out[index], *kv_scales)
        return step
    if index.device != query.device:  # metadata built on another device (tests): once
        index = index.to(query.device)
        step = step._replace(index=index)
    attn = backend.forward(query.index_select(0, index), kv_cache, sub, scale, None, *kv_scales)
    out.index_copy_(0, index, attn)
    return step
