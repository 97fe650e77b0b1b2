"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket (vLLM, SGLang).

A decode step of B sequences (every q_len = 1) runs the graph of the smallest bucket >= B. The
step's tokens are copied into static input buffers and padded with dummy sequences up to the
bucket:

    rows |-- B real decode tokens --|-- bucket - B dummies --|
    dummy: token 0 at position 0, one KV token in the scratch block (never a real request's)

The attention backend plans the padded step into the fixed buffers of that bucket's wrapper
(`begin_step(meta, cuda_graph=True)`) before the replay, so only integers change between replays.
A backend may offer several graph variants (`graph_variants()`: name -> smallest batch captured),
e.g. the shared-prefix backend's "shared_prefix" graphs next to the "plain" ones; each is captured
for its buckets and planned with `begin_step(meta, cuda_graph=True, graph_variant=name)`.
The graph covers the model's forward pass (hidden states out); logits and sampling run eagerly on
the B real rows.

Invariants: graphs are captured after the KV cache is allocated and never re-captured, so the
cache tensors, the weights and the static buffers keep their addresses; every capture shares one
memory pool (largest bucket first, so the smaller ones reuse its blocks).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch
from torch import nn

from phloem.forward_context import ForwardContext, forward_context
from phloem.ops.attention.interface import AttentionBackend, AttentionMetadata
from phloem.ops.kv_store import write_kv_slots
from phloem.ops.staging import pinned

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured buckets: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (which is
    included, so every decode batch the scheduler can form has a bucket)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def write_kv_no_sync(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`phloem.ops.kv_store.write_kv` for slot mappings without -1 entries, with no host sync
    (a sync cannot be captured). Padding rows of a graph step write into the scratch block."""
    write_kv_slots(kv_cache, slot_mapping, key, value)


@contextlib.contextmanager
def sync_free_kv_writes() -> Iterator[None]:
    """Route the attention layer's KV write through `write_kv_no_sync` for the duration.

    `write_kv` filters -1 slots with a host sync, which stream capture forbids and which stalls
    the GPU once per layer in eager steps. The model runner's steps never carry -1 slots (graph
    dummies write to the scratch block), and a replay runs no Python, so swapping the function
    while a GPU forward is traced or captured is enough.
    TODO: drop once the attention layer asks the backend (or a sync-free kv_store) for the write.
    """
    import phloem.layers.attention as attention_layer

    original = attention_layer.write_kv
    attention_layer.write_kv = write_kv_no_sync
    try:
        yield
    finally:
        attention_layer.write_kv = original


class CUDAGraphRunner:
    """Captures and replays decode steps (see the module docstring).

    Args:
        model: the phloem model (forward(input_ids, positions) -> hidden).
        kv_caches: the per-layer caches the graphs will read and write (fixed addresses).
        backend: an attention backend with `begin_step(meta, cuda_graph=True)`.
        block_size: tokens per block; scratch_block: a block id no request ever owns.
        max_num_seqs: the largest decode batch; device: the CUDA device.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        block_size: int,
        scratch_block: int,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        if not hasattr(backend, "begin_step"):
            raise ValueError(f"attention backend {backend.name!r} cannot plan CUDA-graph steps")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.device = device
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch_size = self.batch_sizes[-1]
        # rows: input ids, positions, slots (int64 [3, max_batch])
        self._static_inputs = torch.zeros(3, self.max_batch_size, dtype=torch.int64, device=device)
        variants = getattr(backend, "graph_variants", None)
        self.variants: dict[str, int] = variants() if variants is not None else {"plain": 1}
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[str, int], torch.Tensor] = {}
        self._pool = None

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch size >= num_seqs, or None when there is none."""
        for size in self.batch_sizes:
            if size >= num_seqs:
                return size
        return None

    def has_graph(self, num_seqs: int, variant: str = "plain") -> bool:
        """Whether a graph of `variant` was captured for the bucket of num_seqs sequences."""
        return (variant, self.bucket(num_seqs)) in self._graphs

    def _metadata(
        self, batch: int, seq_lens: list[int], block_tables: list[list[int]]
    ) -> AttentionMetadata:
        """Decode metadata of a step padded to `batch` rows (device fields view static buffers)."""
        num_pad = batch - len(seq_lens)
        seq_lens = seq_lens + [1] * num_pad
        block_tables = block_tables + [[self.scratch_block]] * num_pad
        slots = self._static_inputs[2, :batch]
        return AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=slots,  # unused by a planning backend; kept off the host path
            seq_lens=slots,
            block_tables=slots,
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=list(range(batch + 1)),
            seq_lens_cpu=seq_lens,
            block_tables_cpu=block_tables,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket of every variant, largest first. Mutates the scratch block of
        the KV caches."""
        start = time.perf_counter()
        self._static_inputs.zero_()
        self._static_inputs[2].fill_(self.scratch_slot)
        for variant, min_batch in self.variants.items():
            kwargs = {} if variant == "plain" else {"graph_variant": variant}
            for batch in reversed(self.batch_sizes):
                if batch < min_batch:
                    continue
                meta = self._metadata(batch, [], [])
                ids, positions = self._static_inputs[0, :batch], self._static_inputs[1, :batch]
                ctx = ForwardContext(meta, self.kv_caches, self.backend)
                self.backend.begin_step(meta, cuda_graph=True, **kwargs)
                with forward_context(ctx), sync_free_kv_writes():
                    self.model(ids, positions)  # warm-up: lazy inits, compiles, cuBLAS
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool):
                        out = self.model(ids, positions)
                if self._pool is None:
                    self._pool = graph.pool()
                self._graphs[variant, batch] = graph
                self._outputs[variant, batch] = out
        torch.cuda.synchronize(self.device)
        reset = getattr(self.backend, "reset_stats", None)
        if reset is not None:  # step counters count the workload's steps, not the captures
            reset()
        logger.info(
            "captured %d CUDA graphs (variants %s; decode batch sizes %d..%d) in %.1f s",
            len(self._graphs),
            list(self.variants),
            self.batch_sizes[0],
            self.max_batch_size,
            time.perf_counter() - start,
        )

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        fill_inputs=None,
        variant: str = "plain",
        shared=None,
    ) -> torch.Tensor:
        """Replay the `variant` graph of the step's bucket; returns hidden [B, hidden_size] of
        the B real rows (a view of the graph's output: valid until the next replay).
        `fill_inputs`, if given, is called with the static input-id buffer after the host ids
        are copied in (it writes pending token ids on the device). `shared` (the step's prefix
        groups, from the backend's `plan_decode`) is passed to the "shared_prefix" variant's plan.

        Raises:
            ValueError: if no graph of `variant` holds B sequences.
        """
        num_seqs = len(input_ids)
        batch = self.bucket(num_seqs)
        if (variant, batch) not in self._graphs:
            raise ValueError(f"no {variant!r} CUDA graph for a decode batch of {num_seqs}")
        num_pad = batch - num_seqs
        host = torch.tensor(
            [
                input_ids + [0] * num_pad,
                positions + [0] * num_pad,
                slots + [self.scratch_slot] * num_pad,
            ],
            dtype=torch.int64,
        )
        self._static_inputs[:, :batch].copy_(pinned(host), non_blocking=True)
        if fill_inputs is not None:
            fill_inputs(self._static_inputs[0, :num_seqs])
        meta = self._metadata(batch, seq_lens, block_tables)
        if variant == "plain":
            self.backend.begin_step(meta, cuda_graph=True)
        else:
            self.backend.begin_step(meta, cuda_graph=True, graph_variant=variant, shared=shared)
        self._graphs[variant, batch].replay()
        return self._outputs[variant, batch][:num_seqs]
