"""Small-batch decode attention in one launch, split-KV merged inside the kernel (issues 19, 24).

At batch 1-16 and a few hundred KV tokens, a decode step's attention is launch and fixed
latency, not bytes: FlashInfer's q_len-1 attention plus its split-KV merge took 9.5 + 2.4 us a
layer of Llama-3.1-8B on an H200 (benchmarks/results/2026-11-26d-h200-serving). Here one Triton
launch (`small_decode_triton.py`) splits each sequence's KV over up to S_max programs per
(sequence, KV head) as Flash-Decoding does (Dao et al. 2023), as many as its length needs (one
per ~`split_tokens` tokens), and merges the partials in the same launch (the last program of a
pair to finish merges; an int32 counter per pair, reset by that program, so CUDA-graph replays
start from 0).

This module owns what is not the kernel: the split rule (`max_splits`: the grid's S_max per
batch bucket; `splits_used`: a sequence's splits, also computed on the device), the workspace
and fixed-address index buffers (`SmallDecodePlan`), the same split-and-merge math in torch
(`small_decode_torch`: the CPU path, without Triton), the backend that runs decode-only steps
of at most max_batch sequences within the KV-length rule here and hands every other step to a
plain backend (`SmallDecodeAttention`; the switch and the rule: `small_decode_rule.py`), and
the prebuild's launches (`compile_variants`). The index buffers, per step (one pinned copy,
before the capture or replay of a decode graph, or at an eager step's `begin_step`):

    int32 buf |-- seq_lens [max_batch] --|-- page indptr [max_batch] --|-- page ids ... --|
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from phloem.ops.attention.interface import AttentionBackend, DecodePath, DecodePlan
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata
from phloem.ops.attention.small_decode_rule import DEFAULT_MAX_BATCH, LengthRule, is_small_decode
from phloem.ops.kv_store import FP8_KV_DTYPE, allocate_kv_cache
from phloem.ops.staging import pinned

GRAPH_VARIANT = "small_decode"  # its CUDA graphs, beside the plain backend's "plain" ones

MAX_SPLITS = 32  # the merge reads <= 32 partials (a few chunked round trips)
WAVES = 4  # S_max: about this many waves of SMs when every sequence is long
DEFAULT_SPLIT_TOKENS = 64  # the target KV tokens a split: a sequence's splits grow with L
CPU_TARGET_PROGRAMS, CPU_SPLIT_TOKENS = 8, 4  # off a GPU: CPU runs of short sequences merge


def max_splits(
    batch: int,
    num_kv_heads: int,
    target_programs: int,
    max_seq_len: int | None = None,
    split_tokens: int = DEFAULT_SPLIT_TOKENS,
    waves: float = WAVES,
) -> int:
    """S_max, the grid's KV splits per (sequence, KV head) at `batch` sequences (fixed per
    batch bucket, as a CUDA graph's grid is): `waves` waves of `target_programs` (SMs) when
    every split is busy, floor(waves * target / (batch * H_kv)) in [1, MAX_SPLITS], at most
    ceil(max_seq_len / split_tokens). 8B (8 KV heads), 132 SMs: 32 / 16 / 4 at batch 1 / 4 /
    16. A sequence uses `splits_used` of them; its other programs exit at once."""
    s = int(waves * target_programs) // max(1, batch * num_kv_heads)
    if max_seq_len is not None:
        s = min(s, -(-max_seq_len // split_tokens))
    return max(1, min(MAX_SPLITS, s))


def splits_used(seq_len: int, s_max: int, split_tokens: int, block_n: int) -> int:
    """The splits a sequence of `seq_len` KV tokens uses (the kernel's rule): one per
    `split_tokens` tokens, clamp(ceil(L / split_tokens), 1, min(s_max, ceil(L / block_n)))
    (never more splits than BLOCK_N tiles, so none is empty)."""
    tiles = -(-seq_len // block_n)
    return max(1, min(-(-seq_len // split_tokens), s_max, tiles))


def target_programs(device: torch.device) -> int:
    """The SM count of a CUDA device; `CPU_TARGET_PROGRAMS` elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_TARGET_PROGRAMS


def default_split_tokens(device: torch.device) -> int:
    """`DEFAULT_SPLIT_TOKENS` on a CUDA device; `CPU_SPLIT_TOKENS` elsewhere."""
    return DEFAULT_SPLIT_TOKENS if device.type == "cuda" else CPU_SPLIT_TOKENS


def split_ranges(seq_len: int, used: int, block_n: int) -> list[tuple[int, int]]:
    """The kernel's KV range [begin, end) of each of the `used` splits of a sequence of
    `seq_len` tokens: whole BLOCK_N tiles, split s taking tiles [s * T // used, (s + 1) * T //
    used) of T = ceil(L / block_n) (balanced; none empty while used <= T), the last ragged."""
    edges = [(s * -(-seq_len // block_n) // used) * block_n for s in range(used + 1)]
    return [(edges[s], min(edges[s + 1], seq_len)) for s in range(used)]


def small_decode_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: list[int],
    block_tables: list[list[int]],
    splits: int,
    scale: float,
    block_n: int = 32,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    split_tokens: int = DEFAULT_SPLIT_TOKENS,
) -> torch.Tensor:
    """The kernel's math in torch (the CPU path): per sequence and used split, the partial
    softmax (O, LSE) of the split's KV range, then the LSE-weighted merge (Flash-Decoding).

    Args:
        query: [B, H, D]; kv_cache: [num_blocks, 2, block_size, H_kv, D] (any layout; an FP8
            cache is read as stored * k_scale / v_scale); seq_lens: [B] KV tokens (>= 1);
            block_tables: [B] block ids (at least ceil(L_b / block_size) each).
        splits, split_tokens, block_n: S_max and the kernel's rule (`splits_used`,
            `split_ranges`).
    Returns:
        [B, H, D] in query's dtype, computed in float32 (float64 for float64 queries).
    """
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    block_size, num_kv_heads = kv_cache.shape[2:4]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for b, (seq_len, table) in enumerate(zip(seq_lens, block_tables)):
        pos = torch.arange(seq_len, device=kv_cache.device)
        ids = torch.tensor(table, dtype=torch.int64, device=kv_cache.device)[pos // block_size]
        kv = kv_cache[ids, :, pos % block_size].to(compute)  # [L, 2, H_kv, D]
        if kv_cache.dtype == FP8_KV_DTYPE:
            scales = torch.tensor([k_scale, v_scale], dtype=compute, device=kv.device)
            kv = kv * scales.view(2, 1, 1)  # K and V of each token
        k = kv[:, 0].repeat_interleave(group, dim=1)  # [L, H, D]
        v = kv[:, 1].repeat_interleave(group, dim=1)
        q = query[b].to(compute)  # [H, D]
        parts, lses = [], []
        used = splits_used(seq_len, splits, split_tokens, block_n)
        for begin, end in split_ranges(seq_len, used, block_n):
            s = torch.einsum("hd,lhd->hl", q, k[begin:end]) * scale
            lse = torch.logsumexp(s, dim=-1)  # [H]
            parts.append(torch.einsum("hl,lhd->hd", torch.exp(s - lse[:, None]), v[begin:end]))
            lses.append(lse)
        weights = torch.softmax(torch.stack(lses), dim=0)  # [splits, H]
        out[b] = (weights[:, :, None] * torch.stack(parts)).sum(0).to(query.dtype)
    return out


class SmallDecodePlan:
    """Fixed-address device buffers of the small-decode kernel: the step's sequence lengths
    and page ids (layout in the module docstring), and the split partials' workspace.

    Args:
        max_batch: the largest decode step; num_heads, num_kv_heads, head_dim: the geometry.
        max_blocks_per_seq: the longest block table of a sequence (sizes the page-id region).
        device: where the buffers live.
        splits: S_max for every batch size (None: `max_splits` per batch size).
        split_tokens: the target KV tokens a split (`splits_used`; >= 1; None:
            `default_split_tokens`).
        max_seq_len: the longest sequence, if known (caps S_max at what it can use).
    Memory: int32 (2 + max_blocks_per_seq) * max_batch, int32 max_batch * H_kv counters, and
        float32 (D + 1) * H * max over B <= max_batch of B * S_max(B) (<= max(WAVES * SMs *
        GQA, 32 * H, max_batch * H) partial rows: ~1.1 MiB for Llama-3.1-8B on an H200).
    Raises:
        ValueError: for split_tokens < 1.
    """

    def __init__(
        self,
        max_batch: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_blocks_per_seq: int,
        device: torch.device | str,
        splits: int | None = None,
        split_tokens: int | None = None,
        max_seq_len: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        split_tokens = split_tokens or default_split_tokens(self.device)
        if split_tokens < 1:
            raise ValueError(f"small decode: split_tokens {split_tokens} (must be >= 1)")
        self.max_batch, self.max_blocks_per_seq = max_batch, max_blocks_per_seq
        self.num_kv_heads = num_kv_heads
        self.fixed_splits, self.split_tokens, self.max_seq_len = splits, split_tokens, max_seq_len
        self.programs = target_programs(self.device)
        rows = max(b * num_heads * self.splits(b) for b in range(1, max_batch + 1))
        f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
        self.opart = torch.zeros(rows * head_dim, **f32)
        self.lpart = torch.zeros(rows, **f32)
        self.counters = torch.zeros(max_batch * num_kv_heads, **i32)
        self.index = torch.zeros((2 + max_blocks_per_seq) * max_batch, **i32)
        self.seq_lens = self.index[:max_batch]
        self.page_indptr = self.index[max_batch : 2 * max_batch]
        self.page_ids = self.index[2 * max_batch :]

    def splits(self, batch: int) -> int:
        """S_max of a step of `batch` sequences (`max_splits`, or the fixed count)."""
        if self.fixed_splits is not None:
            return self.fixed_splits
        return max_splits(batch, self.num_kv_heads, self.programs, self.max_seq_len,
                          self.split_tokens)  # fmt: skip

    def upload(self, meta: AttentionMetadata) -> None:
        """Write a decode step's lengths and page ids into the buffers (one non-blocking copy
        from pinned memory, ordered on the current stream after the kernels that read them).

        Raises:
            ValueError: for more than max_batch sequences or a table shorter than its length.
        """
        batch, bs = meta.num_seqs, meta.block_size
        if batch > self.max_batch:
            raise ValueError(f"{batch} sequences; the small-decode buffers hold {self.max_batch}")
        lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
        pages = (lens + bs - 1) // bs
        tables = meta.block_tables_cpu
        if tables is None:
            tables = meta.block_tables.tolist()  # one device sync; builders pass host tables
        if any(len(t) < n for t, n in zip(tables, pages.tolist())):
            raise ValueError("a block table is shorter than its sequence")
        head = 2 * self.max_batch
        data = np.zeros(head + int(pages.sum()), dtype=np.int32)
        data[:batch] = lens
        np.cumsum(pages[:-1], out=data[self.max_batch + 1 : self.max_batch + batch])
        data[head:] = np.fromiter(
            itertools.chain.from_iterable(t[:n] for t, n in zip(tables, pages.tolist())),
            dtype=np.int32,
            count=len(data) - head,
        )
        if len(data) > self.index.numel():
            raise ValueError(f"the step's page ids exceed the buffer ({self.index.numel()})")
        self.index[: len(data)].copy_(pinned(data), non_blocking=True)

    def run(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        **options: Any,
    ) -> None:
        """The kernel over the uploaded step, B = query.shape[0] sequences, into `out`
        ([B, H, D], written); `options`: block_n, num_warps, num_stages of the launch."""
        from phloem.ops.attention.small_decode_triton import small_decode_launch

        small_decode_launch(
            query, kv_cache, out, self.seq_lens, self.page_indptr, self.page_ids, self.opart,
            self.lpart, self.counters, self.splits(query.shape[0]), self.split_tokens, scale,
            k_scale=k_scale, v_scale=v_scale, **options,
        )  # fmt: skip


class SmallDecodeAttention(AttentionBackend):
    """Decode-only steps of at most `max_batch` sequences whose longest sequence is within
    `length_rule` on the small-decode kernel; every other step on the plain backend it wraps.

    The factory (`get_attention_backend`) wraps the plain backend in it
    (`small_decode_rule.SmallDecodeSettings`: by default on CUDA over FlashInfer), below the
    shared-prefix backend (whose shared steps and graphs stay its own). CUDA graphs: the
    kernel's steps are captured as their own variant, "small_decode" (`GRAPH_VARIANT`), for the
    buckets of at most max_batch sequences, beside the fallback's "plain" graphs of every
    bucket; `plan_decode` says which of the two a step replays (the length rule), and
    `prepare_replay` plans the variant it is given, so a replay runs what its capture recorded.

    Args:
        fallback: the plain paged backend (FlashInfer on a GPU, the reference on a CPU).
        num_heads, num_kv_heads, head_dim: this rank's geometry; device: where the buffers live.
        max_batch: the largest decode step taken (PHLOEM_SMALL_DECODE_MAX_BATCH).
        max_num_blocks_per_seq: the longest block table (sizes the page-id buffer).
        impl: "triton" (the kernel; interpreted on a CPU under TRITON_INTERPRET=1), "torch"
            (`small_decode_torch`) or "auto" (Triton for CUDA queries, else torch).
        splits: S_max at every batch size (None: `max_splits`, about WAVES waves of SMs).
        split_tokens: the target KV tokens a split (`splits_used`; None: the device's default).
        max_seq_len: the longest sequence, if known (caps S_max).
        length_rule: the longest sequence a step taken here may have
            (`small_decode_rule.LengthRule`); None: any length.
        kernel_options: block_n, num_warps, num_stages of the launch.
    Raises:
        ValueError: for an unknown impl or max_batch < 1.
    """

    def __init__(
        self,
        fallback: AttentionBackend,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_num_blocks_per_seq: int = 8192,
        impl: str = "auto",
        splits: int | None = None,
        split_tokens: int | None = None,
        max_seq_len: int | None = None,
        length_rule: LengthRule | None = None,
        **kernel_options: Any,
    ) -> None:
        if impl not in ("auto", "triton", "torch") or max_batch < 1:
            raise ValueError(f"small decode: impl {impl!r}, max_batch {max_batch}")
        self.fallback = fallback
        self.name = f"{fallback.name}+small_decode"
        self.needs_block_tables = fallback.needs_block_tables
        self.supports_cuda_graphs = fallback.supports_cuda_graphs
        self.supports_verify_graphs = fallback.supports_verify_graphs
        self.max_batch, self.impl, self.length_rule = max_batch, impl, length_rule
        self.kernel_options = kernel_options
        self.plan = SmallDecodePlan(max_batch, num_heads, num_kv_heads, head_dim,
                                    max_num_blocks_per_seq, device, splits, split_tokens,
                                    max_seq_len)  # fmt: skip
        self._meta: AttentionMetadata | None = None
        self._small = False  # the current step runs here
        self.num_steps = 0

    # -- planning -------------------------------------------------------------------------------

    def takes(self, seq_lens: list[int]) -> bool:
        """Whether a decode step of these real sequences' KV lengths (host list) runs here:
        at most max_batch of them, the longest within the length rule."""
        n = len(seq_lens)
        return 0 < n <= self.max_batch and (
            self.length_rule is None or self.length_rule.allows(n, max(seq_lens))
        )

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Plan an eager step: a decode step we take (`takes`) uploads its lengths and page
        ids, any other is planned by the fallback."""
        self._meta = meta
        self._small = is_small_decode(meta, self.max_batch) and self.takes(meta.seq_lens_cpu)
        if self._small:
            self.num_steps += 1
            self.plan.upload(meta)
        else:
            self.fallback.begin_step(meta)

    def prepare_replay(
        self,
        meta: AttentionMetadata,
        variant: str = "plain",
        groups: SharedPrefixMetadata | None = None,
    ) -> None:
        """Plan a padded decode step for the `variant` graph of its bucket: "small_decode"
        reads our buffers (uploaded here), any other variant the fallback's.

        Raises:
            ValueError: "small_decode" for a step that is not decode-only or holds more than
                max_batch sequences; the fallback's for its variants.
        """
        self._meta, self._small = meta, variant == GRAPH_VARIANT
        if not self._small:
            self.fallback.prepare_replay(meta, variant, groups)
            return
        if not is_small_decode(meta, self.max_batch):
            raise ValueError(f"a {GRAPH_VARIANT!r} graph holds decode steps of <= "
                             f"{self.max_batch} sequences, not {meta.num_seqs}")  # fmt: skip
        self.num_steps += 1
        self.plan.upload(meta)

    def prepare_verify_replay(self, meta: AttentionMetadata) -> None:
        """Verify graphs run the fallback's kernels (q_len > 1)."""
        self._meta, self._small = meta, False
        self.fallback.prepare_verify_replay(meta)

    def end_step(self) -> None:
        """Forget the step's plan (and the fallback's)."""
        self._meta, self._small = None, False
        self.fallback.end_step()

    # -- the step -------------------------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Causal paged attention (`AttentionBackend.forward`) by the step's path; plans the
        step first if neither `begin_step` nor `prepare_replay` saw this `meta`. Query rows
        past the step's B sequences (padding) get zeros."""
        if meta is not self._meta:
            self.begin_step(meta)
        if not self._small:
            return self.fallback.forward(query, kv_cache, meta, scale, out, k_scale, v_scale)
        out = torch.empty_like(query) if out is None else out
        batch = meta.num_seqs
        if query.shape[0] > batch:
            out[batch:].zero_()
        q, dst = query[:batch], out[:batch]
        if self.impl == "triton" or (self.impl == "auto" and query.is_cuda):
            self.plan.run(q, kv_cache, dst, scale, k_scale, v_scale, **self.kernel_options)
        else:
            block_n = self.kernel_options.get("block_n", 32)
            dst.copy_(small_decode_torch(q, kv_cache, meta.seq_lens_cpu, meta.block_tables_cpu
                                         or meta.block_tables.tolist(), self.plan.splits(batch),
                                         scale, block_n, k_scale, v_scale,
                                         self.plan.split_tokens))  # fmt: skip
        return out

    # -- delegated ------------------------------------------------------------------------------

    def graph_variants(self) -> dict[str, int]:
        """The fallback's variants and, when it captures graphs, "small_decode" from batch 1
        (up to max_batch: `graph_variant_max_batch`)."""
        variants = dict(self.fallback.graph_variants())
        if self.fallback.supports_cuda_graphs:
            variants[GRAPH_VARIANT] = 1
        return variants

    def graph_variant_max_batch(self) -> dict[str, int]:
        """The "small_decode" graphs: captured up to max_batch sequences."""
        return {**self.fallback.graph_variant_max_batch(), GRAPH_VARIANT: self.max_batch}

    def plan_decode(
        self,
        seq_lens: list[int],
        block_tables: list[list[int]],
        prefix_lens: list[int],
        block_size: int,
        shared_graph: bool = False,
    ) -> DecodePlan:
        """The fallback's answer; where that is the plain graph and we take the step
        (`takes`: batch and length rule), the "small_decode" graph (`DecodePath.SMALL_GRAPH`).
        Host only, no counters."""
        plan = self.fallback.plan_decode(seq_lens, block_tables, prefix_lens, block_size,
                                         shared_graph)  # fmt: skip
        if plan.path is DecodePath.GRAPH and self.takes(seq_lens):
            return DecodePlan(DecodePath.SMALL_GRAPH)
        return plan

    def plan_verify(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        prefix_lens: list[int],
        block_size: int,
    ) -> bool:
        return self.fallback.plan_verify(
            query_lens, seq_lens, block_tables, prefix_lens, block_size
        )

    def warmup(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        block_id: int,
        scale: float,
        dtype: torch.dtype | None = None,
    ) -> None:
        """The fallback's warm-up, then one batch-1 decode step over block `block_id` on the
        kernel (compiled now rather than in the first step; no step is counted)."""
        self.fallback.warmup(kv_cache, num_heads, block_id, scale, dtype)
        meta = AttentionMetadata.from_host([1], [1], [[block_id]], kv_cache.shape[2])
        query = torch.zeros(1, num_heads, kv_cache.shape[4], dtype=dtype or kv_cache.dtype,
                            device=kv_cache.device)  # fmt: skip
        steps = self.num_steps
        self.begin_step(meta)
        self.forward(query, kv_cache, meta, scale)
        self.end_step()
        self.num_steps = steps

    def defer_prefill_backend(self, ready: Callable[[], bool]) -> None:
        self.fallback.defer_prefill_backend(ready)

    def stats(self) -> dict[str, Any]:
        """Decode steps run here (eager, captures excluded after `reset_stats`, and replays),
        and the fallback's counters."""
        return {**self.fallback.stats(), "small_decode_steps": self.num_steps}

    def reset_stats(self) -> None:
        self.num_steps = 0
        self.fallback.reset_stats()


def compile_variants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    kv_layout: str = "NHD",
    **kernel_options: Any,
) -> None:
    """Launch the kernel once as the engine does (`SmallDecodeAttention`'s eager steps, warm-up
    and graph captures: one variant, whatever the batch, splits and lengths, which are not
    specialized on), on CPU tensors for `phloem.worker.triton_prebuild`'s compile-only driver
    (the launch records the variant and runs nothing). The cache is in `kv_layout` ("NHD" or
    "HND", `kv_store.allocate_kv_cache`); `kernel_options`: the backend's launch options (none
    by default)."""
    cache = allocate_kv_cache(2, block_size, num_kv_heads, head_dim, kv_dtype, "cpu", kv_layout)
    plan = SmallDecodePlan(1, num_heads, num_kv_heads, head_dim, 1, "cpu")
    query = torch.zeros(1, num_heads, head_dim, dtype=dtype)
    plan.run(query, cache, torch.empty_like(query), head_dim**-0.5, **kernel_options)
