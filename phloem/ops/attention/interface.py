"""The attention-backend interface: every method the model runner, the CUDA-graph runner and the
attention layer call on a backend, declared once (mini-sglang's `BaseAttnBackend` is the model).

The step a backend sees is an `AttentionMetadata` (layout and token packing in `metadata.py`). Per
step the callers do, in order:

    eager step:   begin_step(meta) -> forward(...) per layer -> end_step()
    graph step:   plan_decode(...) -> prepare_replay(padded meta, variant, groups) -> replay
    verify graph: plan_verify(...) -> prepare_verify_replay(padded meta) -> replay   (spec decoding)

A CUDA graph replays kernels whose inputs live at fixed addresses, so `prepare_replay` writes the
step's plan into buffers of the variant's graph for `meta.num_seqs` sequences (the same call,
with no groups, plans the capture; the largest batch is captured first, so buffers sized at the
first call hold every bucket). Backends with nothing to plan inherit the no-op defaults here;
what a backend can do is said by class attributes, never discovered by probing.

This module imports no backend: backends import it, and the factory (`ops/attention/__init__.py`)
imports them lazily.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "DecodePath", "DecodePlan"]


class DecodePath(enum.StrEnum):
    """How a decode-only step runs (`AttentionBackend.plan_decode`)."""

    GRAPH = "graph"  # replay the "plain" CUDA graph of the step's bucket
    SHARED_GRAPH = "shared_graph"  # replay the "shared_prefix" graph with the step's groups
    EAGER = "eager"  # prefix sharing pays and no graph has it: the shared path, eagerly
    SMALL_GRAPH = "small_graph"  # replay the "small_decode" graph (a few short sequences)


class DecodePlan(NamedTuple):
    """`plan_decode`'s answer: the path, and the step's prefix groups for the shared paths
    (None for `DecodePath.GRAPH`)."""

    path: DecodePath
    groups: SharedPrefixMetadata | None = None


class AttentionBackend(abc.ABC):
    """A paged causal attention kernel behind the step protocol of the module docstring.

    Implementations: `reference.ReferenceAttention` (plain torch, the CPU path and the oracle),
    `flashinfer_backend.FlashInferAttention`, `shared_prefix.SharedPrefixAttention`; the factory
    `phloem.ops.attention.get_attention_backend` makes them by name.

    Class attributes (a backend may set them per instance when they depend on what it wraps):
        name: the backend's name in configs and reports.
        needs_block_tables: whether `forward` reads the padded device table `meta.block_tables`;
            False when the backend plans from `meta.block_tables_cpu` (the model runner then
            skips building it).
        reads_prefix_lens: whether the backend reads `meta.prefix_lens_cpu` (the model runner
            fills it, and asks `plan_decode` before replaying a decode graph).
        supports_cuda_graphs: whether `prepare_replay` can plan the "plain" variant, i.e. the
            backend's decode kernels read only fixed-address buffers.
        supports_verify_graphs: whether `prepare_verify_replay` can plan a verify step whose
            sequences all have the same query length (`worker/verify_graph.py`) into
            fixed-address buffers.
    """

    name: str = "abstract"
    needs_block_tables: bool = True
    reads_prefix_lens: bool = False
    supports_cuda_graphs: bool = False
    supports_verify_graphs: bool = False

    @abc.abstractmethod
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
        """Causal attention of the step's queries over each sequence's paged KV.

        Args:
            query: [T, num_heads, head_dim], model dtype.
            kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]; this step's K/V are
                already written (see `phloem.ops.kv_store.write_kv`); read only.
            meta: the step's metadata.
            scale: softmax scale (usually head_dim ** -0.5).
            out: if given (query's shape and dtype, contiguous), receives the result and is
                returned; else a new tensor is.
            k_scale, v_scale: the layer's per-tensor FP8 KV scales (> 0): an FP8 cache holds
                K / k_scale and V / v_scale (`phloem.ops.kv_store`); read only for an FP8 cache.
        Returns:
            [T, num_heads, head_dim], same dtype as `query`; zeros for query tokens past
            `meta.query_start_loc_cpu[-1]` (padding). num_heads must be a multiple of
            num_kv_heads (GQA: query head h reads KV head h // (num_heads // num_kv_heads)).
        """

    # -- per-step planning (defaults: nothing to plan) ---------------------------------------

    def begin_step(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Plan an eager step once, before its forward pass (not once per layer: FlashInfer's
        `plan()`, the shared-prefix cost rule). A backend may also plan lazily in `forward`
        when a caller skipped this (tests)."""

    def end_step(self) -> None:  # noqa: B027 - optional hook
        """Forget the step's plan (the next `forward` without `begin_step` plans again)."""

    # -- CUDA graphs ----------------------------------------------------------------------------

    def graph_variants(self) -> dict[str, int]:
        """The decode-graph variants to capture, each with the smallest batch size captured for
        it. Every backend has "plain" (captured only where `supports_cuda_graphs`)."""
        return {"plain": 1}

    def graph_variant_max_batch(self) -> dict[str, int]:
        """The variants captured only up to a batch size, each with the largest batch (its
        buckets above are not captured); the others are captured at every bucket from their
        smallest. Default: none."""
        return {}

    def plan_decode(
        self,
        seq_lens: list[int],
        block_tables: list[list[int]],
        prefix_lens: list[int],
        block_size: int,
        shared_graph: bool = False,
    ) -> DecodePlan:
        """How a decode-only step (one query per sequence, given as host lists) runs; the model
        runner asks before replaying a graph of a step with prefix groups or of a bucket that
        has a "small_decode" graph (`DecodePath.SMALL_GRAPH` is only an offer: the runner replays
        the plain graph where that bucket has none). `shared_graph`: a "shared_prefix" graph
        exists for the step's batch. Host only, no counters. Default: the plain graph."""
        return DecodePlan(DecodePath.GRAPH)

    def prepare_replay(
        self,
        meta: AttentionMetadata,
        variant: str = "plain",
        groups: SharedPrefixMetadata | None = None,
    ) -> None:
        """Plan a padded decode step (q_len 1 for every sequence) into the fixed buffers the
        `variant` graph of `meta.num_seqs` sequences reads; called before its capture and before
        each replay. `groups`: the real sequences' prefix groups from `plan_decode` (padding
        sequences follow them, without a group).

        Raises:
            ValueError: when the backend cannot plan that variant (default: any).
        """
        raise ValueError(f"attention backend {self.name!r} cannot plan CUDA graphs ({variant!r})")

    def plan_verify(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        prefix_lens: list[int],
        block_size: int,
    ) -> bool:
        """Whether a verify step of sequences in prefix groups (host lists of the real,
        unpadded step; some `prefix_lens` > 0) may replay a verify graph, which runs the
        backend's plain kernels; False when the backend would run it another way (the
        shared-prefix backend: its cost rule shares the prefixes). The model runner asks only
        for steps with prefix groups. Host only, no counters. Default: True."""
        return True

    def prepare_verify_replay(self, meta: AttentionMetadata) -> None:
        """Plan a padded verify step into the fixed buffers of the verify graph of
        `meta.num_seqs` sequences; called before its capture and before each replay. Every
        sequence has the same query length (`meta.max_query_len`, 1 + k), its padding tokens
        after its real ones (`worker/verify_graph.py`); no prefix groups.

        Raises:
            ValueError: when the backend cannot plan verify graphs (default: any).
        """
        raise ValueError(f"attention backend {self.name!r} cannot plan verify CUDA graphs")

    # -- start-up and counters ------------------------------------------------------------------

    def warmup(  # noqa: B027 - optional hook
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        block_id: int,
        scale: float,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Compile the backend's kernels for common shapes now rather than in the first steps,
        reading only block `block_id` of `kv_cache` (queries in `dtype`, default the cache's);
        writes nothing, counts nothing. Default: nothing to compile."""

    def defer_prefill_backend(self, ready: Callable[[], bool]) -> None:  # noqa: B027
        """Use a prefill backend whose kernels build after start-up only in steps begun once
        `ready()` (`worker.kernel_prebuild.KernelPrebuild.deferred_ready`). Default: the
        backend has none, nothing to defer."""

    def stats(self) -> dict[str, Any]:
        """Per-path step counters for reports (JSON-ready); empty when the backend keeps none."""
        return {}

    def reset_stats(self) -> None:  # noqa: B027 - optional hook
        """Zero the counters of `stats()` (after captures and warm-up steps)."""
