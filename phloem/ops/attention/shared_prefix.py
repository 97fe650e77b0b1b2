"""Prefix-shared (cascade) attention as a backend: read a group's shared prefix KV once per step for
all members, on the steps where the cost rule says it pays; a plain backend runs the others.

The parts live beside it: the step's groups (`prefix_groups.py`), the cascade math and oracle
(`shared_prefix_reference.py`), the cost rule (`sharing_rule.py`), our Triton kernels
(`shared_prefix_triton.py`, its tile planner `tile_plan.py` and CUDA-graph buffers
`decode_graph_plan.py`, lazily; the variants prebuilt, `shared_prefix_variants.py`), the
prefill split (`prefill_split.py`) and the FlashInfer cascade baseline
(`shared_prefix_flashinfer.py`, lazily)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phloem.ops.attention import sharing_rule
from phloem.ops.attention.interface import AttentionBackend, DecodePath, DecodePlan
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefill_split import PlainSplitPlan, PrefillSplit, SplitPlan
from phloem.ops.attention.prefix_groups import (
    SharedPrefixMetadata,
    build_shared_prefix_metadata,
    pad_groups,
)
from phloem.ops.attention.shared_prefix_reference import shared_prefix_attention_reference
from phloem.ops.attention.shared_prefix_variants import GRAPH_TRITON_OPTIONS
from phloem.ops.attention.sharing_rule import SharingRule
from phloem.ops.kv_store import kv_layout

IMPLS = ("auto", "triton", "flashinfer", "reference")
# Block-id capacity of the shared-prefix graph buffers, per sequence of the largest batch
# (average own blocks: 4,096 tokens at block size 16); a step needing more runs eagerly.
_GRAPH_BLOCKS_PER_SEQ = 256


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


class SharedPrefixAttention(AttentionBackend):
    """An `AttentionBackend` that runs cascade attention on steps where prefix sharing pays
    (`sharing_rule`), and delegates every other step to a plain paged backend.

    How it learns the groups: the model runner sets `meta.prefix_lens_cpu` (one per sequence:
    the length of the group prefix its block table starts with, 0 for none); absent or all-zero
    means no sharing. `begin_step(meta)` builds the `SharedPrefixMetadata` once per step.

    CUDA graphs: decode steps replay captured graphs in one of two variants (`graph_variants`):
    "plain" (the fallback's kernels) or, with the Triton impl on CUDA, "shared_prefix" (our kernels
    over fixed-capacity tile tables, `decode_graph_plan.DecodeGraphPlan`). The model runner asks
    `plan_decode` which one a step takes (`sharing_rule.decode_path`). Verify graphs
    (speculative decoding) run the fallback's kernels, for steps whose groups a decode step
    would not leave its plain graph for (`plan_verify`).

    Counters (`stats()`, for `--json`): steps that ran the shared path (eagerly or in a graph),
    eager plain steps, CUDA-graph plain steps and shared-prefix graph steps (each replay plans
    once), shared and plain steps whose prefill chunks went to `prefill_backend`, and KV tokens
    saved.

    Args:
        fallback: the plain paged backend (FlashInfer on GPU, `ReferenceAttention` on CPU).
        impl: "triton" (ours), "flashinfer" (the library cascade baseline,
            `shared_prefix_flashinfer.FlashInferCascade`), "reference", or "auto" (Triton for CUDA
            tensors when it imports, else the reference), resolved at the first shared step.
        rule: the cost rule's thresholds (`sharing_rule.SharingRule`, defaults by default).
        cuda_graphs: offer the "shared_prefix" graph variant when the impl is Triton on CUDA.
        num_heads, num_kv_heads, head_dim, device: the attention geometry, needed for the
            shared-prefix graph variant (`get_attention_backend` passes them).
        prefill_backend: if set, eager shared steps hand their long ungrouped prefill chunks
            (at least `prefill_min_query_len` queries) to it (`prefill_split.PrefillSplit`),
            and, with `prefill_plain_steps`, eager plain steps their long chunks (the fallback
            computes the rest of the step; decode graphs never split).
        triton_options: passed to the Triton kernel (block_m, block_n, prefix_splits, ...).
    Raises:
        ValueError: for an unknown impl.
    """

    name = "shared_prefix"
    reads_prefix_lens = True

    def __init__(
        self,
        fallback: AttentionBackend,
        impl: str = "auto",
        rule: SharingRule | None = None,
        cuda_graphs: bool = True,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        device: torch.device | str | None = None,
        prefill_backend: AttentionBackend | None = None,
        prefill_min_query_len: int = 64,
        prefill_plain_steps: bool = True,
        **triton_options: Any,
    ) -> None:
        if impl not in IMPLS:
            raise ValueError(f"unknown shared-prefix impl {impl!r}; supported: {list(IMPLS)}")
        self.fallback = fallback
        self.impl = impl
        self.rule = rule or SharingRule()
        self.cuda_graphs = cuda_graphs
        self.geometry = (num_heads, num_kv_heads, head_dim)
        self.device = torch.device(device) if device is not None else None
        # the shared path plans from host lists; the fallback may read the device table
        self.needs_block_tables = fallback.needs_block_tables
        self.supports_cuda_graphs = fallback.supports_cuda_graphs
        self.supports_verify_graphs = fallback.supports_verify_graphs  # the fallback's kernels
        self.prefill_min_query_len = prefill_min_query_len
        self.prefill = None if prefill_backend is None else PrefillSplit(
            prefill_backend, prefill_min_query_len
        )  # fmt: skip
        self.prefill_ready: Callable[[], bool] | None = None  # `defer_prefill_backend`
        self.prefill_plain_steps = prefill_plain_steps
        self.triton_options = triton_options
        self.reset_stats()
        self.last_path: str | None = None
        self._meta: AttentionMetadata | None = None
        self._sp: SharedPrefixMetadata | None = None
        self._split: SplitPlan | PlainSplitPlan | None = None  # by the path: shared | plain
        self._cascade: Any = None  # FlashInferCascade, made at the first "flashinfer" step
        self._graph_plan: Any = None  # DecodeGraphPlan, made at the first shared graph capture
        self._graph_step = False  # the current step replays a shared-prefix graph

    # -- planning -----------------------------------------------------------------------------

    def plan(self, meta: AttentionMetadata) -> SharedPrefixMetadata | None:
        """The step's groups if the cost rule picks the shared path, else None. Host only, no
        side effects."""
        return sharing_rule.shared_groups(self.rule, meta)

    def plan_decode(
        self,
        seq_lens: list[int],
        block_tables: list[list[int]],
        prefix_lens: list[int],
        block_size: int,
        shared_graph: bool = False,
    ) -> DecodePlan:
        """How a decode-only step runs (`AttentionBackend.plan_decode`): the shared-prefix graph
        is offered only when `shared_graph` and the step fits its buffers; where the plain
        graph, the fallback's answer (e.g. the small-decode graph). Host only."""
        if not any(prefix_lens):  # no groups: nothing to share
            return self.fallback.plan_decode(seq_lens, block_tables, prefix_lens, block_size)
        meta = AttentionMetadata.from_host(
            [1] * len(seq_lens), seq_lens, block_tables, block_size, prefix_lens=prefix_lens
        )
        sp = self.plan(meta)
        fits = sp is not None and (self._graph_plan is None or self._graph_plan.fits(sp))
        path = sharing_rule.decode_path(self.rule, sp, shared_graph and fits)
        if path is DecodePath.GRAPH:
            return self.fallback.plan_decode(seq_lens, block_tables, prefix_lens, block_size)
        return DecodePlan(path, sp)

    def graph_variants(self) -> dict[str, int]:
        """The fallback's variants ("plain" always, e.g. "small_decode" too); "shared_prefix"
        (from batch 16) when the Triton impl can run on the configured CUDA device with known
        geometry (GQA <= the narrow tile, 16 rows) and the fallback can plan graph steps."""
        variants = dict(self.fallback.graph_variants())
        num_heads, num_kv_heads, _ = self.geometry
        narrow = self.triton_options.get("narrow_block_m", 16)
        ok = (
            self.cuda_graphs
            and self.impl in ("auto", "triton")
            and self.device is not None
            and self.device.type == "cuda"
            and num_heads is not None
            and num_kv_heads is not None
            and narrow is not None
            and num_heads // num_kv_heads <= narrow
            and self.fallback.supports_cuda_graphs
        )
        if ok:
            try:
                import triton  # noqa: F401
            except ImportError:
                ok = False
        if ok:
            variants["shared_prefix"] = 16
        return variants

    def graph_variant_max_batch(self) -> dict[str, int]:
        return self.fallback.graph_variant_max_batch()

    def defer_prefill_backend(self, ready: Callable[[], bool]) -> None:
        """Hand long prefill chunks to the prefill backend only in steps begun once `ready()`
        (`KernelPrebuild.deferred_ready`); our kernel computes them until then."""
        if self.prefill is not None:
            self.prefill_ready = ready

    def warmup(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        block_id: int,
        scale: float,
        dtype: torch.dtype | None = None,
    ) -> None:
        """One synthetic shared step (a group of 16 decode members, a lone decode and a
        max(32, prefill_min_query_len)-token prefill chunk, all reading block `block_id`), so
        the kernels of the common shapes compile at start-up. Writes and counts nothing."""
        bs, head_dim = kv_cache.shape[2], kv_cache.shape[4]
        prefix_blocks = max(1, -(-max(self.rule.min_saved_kv_tokens, 1) // (15 * bs)))
        prefix = [block_id] * prefix_blocks
        p = prefix_blocks * bs
        chunk = max(32, self.prefill_min_query_len)  # also loads the prefill backend's kernel
        tables = [prefix + [block_id]] * 16 + [[block_id]] + [[block_id] * -(-chunk // bs)]
        meta = AttentionMetadata.from_host(
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

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Choose an eager step's path and plan it; call once per step before the forward pass
        (the model runner, and the piecewise graph runner between its pieces, do). Mutates the
        counters and the plans of the fallback and the prefill backend: on the plain path, a
        step with long chunks is split between them once the prefill backend is ready
        (`PrefillSplit.plan_plain`), else the fallback plans it whole."""
        self._graph_step = False
        sp = self.plan(meta)
        self._meta, self._sp, self._split = meta, sp, None
        ready = self.prefill is not None and (self.prefill_ready is None or self.prefill_ready())
        if sp is None:
            self.num_plain_steps += 1
            self.last_path = self.fallback.name
            if ready and self.prefill_plain_steps:
                self._split = self.prefill.plan_plain(meta, self.fallback)
                self.num_plain_split_steps += self._split is not None
            if self._split is None:
                self.fallback.begin_step(meta)
            return
        if ready and self._resolve_impl(None) == "triton":  # fa3 built (cold starts)
            self._split = self.prefill.plan(meta, sp)
            self.num_prefill_split_steps += self._split is not None
        self._count_shared(sp)

    def prepare_replay(
        self,
        meta: AttentionMetadata,
        variant: str = "plain",
        groups: SharedPrefixMetadata | None = None,
    ) -> None:
        """Plan a padded decode step for the `variant` graph of `meta.num_seqs` sequences:
        "plain" (and the fallback's other variants) on the fallback; "shared_prefix" into our
        graph buffers (made at the first call, the capture of the largest batch), with `groups`
        from `plan_decode` (None, a capture: built from `meta.prefix_lens_cpu`).

        Raises:
            ValueError: for "plain" when the fallback cannot plan graph steps, for an unknown
                variant, or a shared step the graph buffers cannot hold.
        """
        self._graph_step = False
        if variant == "shared_prefix":
            self._prepare_shared_replay(meta, groups)
            return
        if variant not in self.fallback.graph_variants():
            raise ValueError(f"unknown CUDA-graph variant {variant!r}")
        if not self.fallback.supports_cuda_graphs:
            raise ValueError(f"fallback backend {self.fallback.name!r} cannot plan CUDA graphs")
        self._meta, self._sp, self._split = meta, None, None
        self.num_graph_steps += 1
        self.last_path = self.fallback.name
        self.fallback.prepare_replay(meta, variant)

    def plan_verify(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        prefix_lens: list[int],
        block_size: int,
    ) -> bool:
        """A verify step of prefix groups replays a verify graph (the fallback's kernels)
        where a decode step would replay the plain graph (`sharing_rule.decode_path` without a
        shared graph: sharing does not pay, or saves less than the graph's launch savings);
        else it keeps the eager or piecewise path, which shares the prefixes
        (`AttentionBackend.plan_verify`). Host only."""
        meta = AttentionMetadata.from_host(
            query_lens, seq_lens, block_tables, block_size, prefix_lens=prefix_lens
        )
        path = sharing_rule.decode_path(self.rule, self.plan(meta), shared_graph=False)
        return path is DecodePath.GRAPH

    def prepare_verify_replay(self, meta: AttentionMetadata) -> None:
        """Plan a padded verify step on the fallback (`AttentionBackend.prepare_verify_replay`;
        the step's groups, if any, were not worth sharing: `plan_verify`).

        Raises:
            ValueError: when the fallback cannot plan verify graphs.
        """
        self._graph_step = False
        self._meta, self._sp, self._split = meta, None, None
        self.fallback.prepare_verify_replay(meta)

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
        """Causal paged attention (the `AttentionBackend.forward` contract) by the step's path;
        plans the step first if `begin_step` was not called with this `meta`."""
        if meta is not self._meta:
            self.begin_step(meta)
        kv_scales = (k_scale, v_scale)
        if self._sp is None:
            if self._split is None:
                return self.fallback.forward(query, kv_cache, meta, scale, out, *kv_scales)
            self._split, res = self.prefill.run_plain(
                self._split, self.fallback, query, kv_cache, out, scale, kv_scales
            )
            return res
        if self._graph_step:
            res = self._graph_plan.forward(query, kv_cache, scale, meta.block_size, *kv_scales)
        else:
            res = self._forward_shared(query, kv_cache, meta, scale, kv_scales)
        return res if out is None else out.copy_(res)

    def _forward_shared(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[float, float],
    ) -> torch.Tensor:
        """The eager shared path of the planned step, by impl (`kv_scales`: an FP8 cache's
        (k_scale, v_scale))."""
        impl = self._resolve_impl(query)
        k_scale, v_scale = kv_scales
        if impl == "triton":
            split = self._split
            out = shared_prefix_attention_triton(
                query, kv_cache, meta, self._sp, scale,
                exclude=None if split is None else split.exclude, k_scale=k_scale,
                v_scale=v_scale, **self.triton_options,
            )  # fmt: skip
            if split is not None:
                self._split = self.prefill.run(split, query, kv_cache, out, scale, kv_scales)
            return out
        if impl == "flashinfer":
            return self._flashinfer_cascade(query, kv_cache, meta, scale)
        return shared_prefix_attention_reference(
            query, kv_cache, meta, self._sp, scale, k_scale=k_scale, v_scale=v_scale
        )

    def end_step(self) -> None:
        """Forget the step's plan (and the fallback's and prefill backend's)."""
        self._meta = self._sp = self._split = None
        self._graph_step = False
        self.fallback.end_step()
        if self.prefill is not None:
            self.prefill.end_step()

    # -- counters -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Which path ran how often (JSON-ready), with the fallback's counters (e.g. the
        small-decode wrapper's, `small_decode.SmallDecodeAttention`)."""
        return {
            **self.fallback.stats(),
            "attention_path_last": self.last_path,
            "shared_prefix_steps": self.num_shared_steps,
            "plain_steps": self.num_plain_steps,
            "cuda_graph_steps": self.num_graph_steps,
            "shared_prefix_graph_steps": self.num_shared_graph_steps,
            "prefill_split_steps": self.num_prefill_split_steps,
            "plain_prefill_split_steps": self.num_plain_split_steps,
            "shared_prefix_saved_kv_tokens": self.num_saved_kv_tokens,
        }

    def reset_stats(self) -> None:
        """Zero the counters of `stats()` (e.g. after CUDA-graph captures and warm-up steps),
        the fallback's too."""
        self._set_counters((0, 0, 0, 0, 0, 0, 0))
        self.fallback.reset_stats()

    def _counters(self) -> tuple[int, ...]:
        return (self.num_shared_steps, self.num_plain_steps, self.num_graph_steps,
                self.num_shared_graph_steps, self.num_prefill_split_steps,
                self.num_plain_split_steps, self.num_saved_kv_tokens)  # fmt: skip

    def _set_counters(self, values: tuple[int, ...]) -> None:
        (self.num_shared_steps, self.num_plain_steps, self.num_graph_steps,
         self.num_shared_graph_steps, self.num_prefill_split_steps,
         self.num_plain_split_steps, self.num_saved_kv_tokens) = values  # fmt: skip

    def _count_shared(self, sp: SharedPrefixMetadata) -> None:
        self.num_shared_steps += 1
        self.num_saved_kv_tokens += sp.saved_kv_tokens
        self.last_path = "shared_prefix"

    # -- helpers --------------------------------------------------------------------------------

    def _prepare_shared_replay(
        self, meta: AttentionMetadata, groups: SharedPrefixMetadata | None
    ) -> None:
        """Plan a padded decode step into the shared-prefix graph buffers."""
        from phloem.ops.attention.decode_graph_plan import DecodeGraphPlan

        if groups is None:
            prefix_lens = meta.prefix_lens_cpu or [0] * meta.num_seqs
            groups = build_shared_prefix_metadata(
                meta, prefix_lens, self.rule.min_group_size, self.rule.max_member_query_len
            )
        sp = pad_groups(groups, meta)
        if self._graph_plan is None:
            num_heads, num_kv_heads, head_dim = self.geometry
            options = {k: v for k, v in self.triton_options.items() if k in GRAPH_TRITON_OPTIONS}
            self._graph_plan = DecodeGraphPlan(
                meta.num_seqs, num_heads, num_kv_heads, head_dim, self.device or "cuda",
                max_blocks=meta.num_seqs * _GRAPH_BLOCKS_PER_SEQ, **options,
            )  # fmt: skip
        self._graph_plan.prepare(meta, sp)
        self._meta, self._sp, self._split, self._graph_step = meta, sp, None, True
        self.num_shared_graph_steps += 1
        self._count_shared(sp)

    def _flashinfer_cascade(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """FlashInfer's two-level cascade (made again when the dtype, scale or layout change)."""
        if kv_cache.dtype != query.dtype:
            raise ValueError("the FlashInfer cascade baseline needs a KV cache of the query dtype")
        if self._cascade is None or not self._cascade.fits(query, kv_cache, scale):
            from phloem.ops.attention.shared_prefix_flashinfer import FlashInferCascade

            num_heads, head_dim = query.shape[1:]
            self._cascade = FlashInferCascade(
                num_heads, kv_cache.shape[3], head_dim, query.dtype, query.device, scale,
                kv_layout(kv_cache),
            )  # fmt: skip
        return self._cascade.forward(query, kv_cache, meta, self._sp)

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
