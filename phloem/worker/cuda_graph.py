"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket (vLLM, SGLang).

A decode step of B sequences (every q_len = 1) runs the graph of the smallest bucket >= B. The
step's host inputs (`input_batch.HostStep`, the builder eager steps use too) are padded with
dummy sequences up to the bucket (`HostStep.padded`) and copied into static input buffers:

    rows |-- B real decode tokens --|-- bucket - B dummies --|
    dummy: token 0 at position 0, one KV token in the scratch block (never a real sequence's)

The attention backend plans the padded step into the fixed buffers of that bucket's wrapper
(`prepare_replay(meta, variant, groups)`) before the capture and before each replay, so only
integers change between replays. A backend may offer several graph variants (`graph_variants()`:
name -> smallest batch captured; `graph_variant_max_batch()`: the largest, for variants capped),
e.g. the shared-prefix backend's "shared_prefix" graphs next to the "plain" ones, and the
small-decode backend's "small_decode" graphs of the buckets <= its max batch (16); each is
captured for its buckets. Which variant a decode step replays is the backend's `plan_decode`
(asked for steps with prefix groups, and for steps whose bucket has a "small_decode" graph):

    DecodePath.GRAPH -> "plain", SHARED_GRAPH -> "shared_prefix", SMALL_GRAPH -> "small_decode"

A capture records the kernels of the variant it was planned for, and a replay is planned for
the variant it replays, so a replay runs what its capture recorded. The step's K/V writes are
sync-free (a sync cannot be captured): the forward context says every slot is valid
(`ForwardContext.valid_slots`; dummy rows write to the scratch block).
The graph covers the model's forward pass (hidden states out); logits and sampling run eagerly on
the B real rows. With `PHLOEM_GRAPH_LOGITS_MAX_BATCH=N` the graphs of buckets <= N also compute
the logits (the LM head, and under tensor parallelism the all-gather of the vocabulary slices),
as SGLang's decode graphs do: at batch 1 their eager launches are on the host's critical path
(TP = 2 at batch 1 left the GPU idle 0.38 ms a step; benchmarks/results/2026-11-26g-h200x2).
Off (0) by default until the GPU A/B (benchmarks/tp_device.sh latency) says it pays.

Invariants: graphs are captured after the KV cache is allocated and never re-captured, so the
cache tensors, the weights and the static buffers keep their addresses; every capture shares one
memory pool (largest bucket first, so the smaller ones reuse its blocks).
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import nn

from phloem.forward_context import ForwardContext, forward_context
from phloem.ops.attention.interface import AttentionBackend, DecodePath
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata
from phloem.worker.graph_inputs import GraphInputs, smallest_bucket
from phloem.worker.input_batch import HostStep

logger = logging.getLogger(__name__)

# the graph variant each decode path replays (`AttentionBackend.plan_decode`; EAGER replays none)
PATH_VARIANTS = {
    DecodePath.GRAPH: "plain",
    DecodePath.SHARED_GRAPH: "shared_prefix",
    DecodePath.SMALL_GRAPH: "small_decode",
}


def env_count(name: str, environ: dict[str, str] | None = None) -> int:
    """The non-negative integer environment variable `name` (0 when unset).

    Raises:
        ValueError: naming the variable when it is not a non-negative integer.
    """
    raw = (os.environ if environ is None else environ).get(name, "0")
    if not raw.isdigit():
        raise ValueError(f"{name} must be an integer >= 0, got {raw!r}")
    return int(raw)


def graph_logits_max_batch(environ: dict[str, str] | None = None) -> int:
    """The largest bucket whose decode graphs also compute the logits (0: none), from
    PHLOEM_GRAPH_LOGITS_MAX_BATCH (raises ValueError naming it when malformed)."""
    return env_count("PHLOEM_GRAPH_LOGITS_MAX_BATCH", environ)


DECODE_GRAPH_MAX_BATCH = 512  # sequences; the default cap (vLLM's default capture size too)


def decode_graph_max_batch(max_num_seqs: int, environ: dict[str, str] | None = None) -> int:
    """The largest decode batch captured in a full graph: min(max_num_seqs, cap), the cap from
    PHLOEM_DECODE_GRAPH_MAX_BATCH (unset: `DECODE_GRAPH_MAX_BATCH`, 512; 0: no cap). A larger
    decode step's GPU time hides its eager launches under async scheduling, and each bucket
    costs start-up: on an H200, 8B shapes at 2,048 sequences, the cap cut graph capture from
    24.5 to 6.2 s with batchllm 100 x 16 at 79.6 vs 80.0 req/s (benchmarks/results/2026-11-26h-h200);
    260 graphs of an 80-layer model took 80-103 s. Larger decode steps replay the piecewise
    graphs of their token bucket or run eagerly.
    Raises ValueError naming the variable when malformed."""
    env = os.environ if environ is None else environ
    if "PHLOEM_DECODE_GRAPH_MAX_BATCH" not in env:
        return min(max_num_seqs, DECODE_GRAPH_MAX_BATCH)
    cap = env_count("PHLOEM_DECODE_GRAPH_MAX_BATCH", environ)
    return min(max_num_seqs, cap) if cap else max_num_seqs


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured buckets: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (which is
    included, so every decode batch the scheduler can form has a bucket)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class CUDAGraphRunner:
    """Captures and replays decode steps (see the module docstring).

    Args:
        model: the phloem model (forward(input_ids, positions) -> hidden).
        kv_caches: the per-layer caches the graphs will read and write (fixed addresses).
        backend: an attention backend that `supports_cuda_graphs`.
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
        if not backend.supports_cuda_graphs:
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
        self._inputs = GraphInputs(self.max_batch_size, device)
        self.variants: dict[str, int] = backend.graph_variants()
        self.variant_max_batch: dict[str, int] = backend.graph_variant_max_batch()
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[str, int], torch.Tensor] = {}
        # every graph copies its hidden states into this one buffer (made before the first
        # capture, outside the graphs' pool): kept per graph, the outputs summed to
        # bucket x hidden x 2 bytes over every bucket and variant (~2 GiB for an 8B model's
        # 264 graphs up to 2,048 sequences)
        self._static_out: torch.Tensor | None = None
        # the logits of the buckets <= logits_max_batch, likewise one buffer [max, vocab]
        self.logits_max_batch = min(graph_logits_max_batch(), self.max_batch_size)
        self._static_logits: torch.Tensor | None = None
        self._pool = None

    def release(self) -> None:
        """Wait for the device, then free every captured graph and the graphs' memory pool."""
        torch.cuda.synchronize(self.device)
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()
        self._static_out = self._static_logits = None
        self._pool = None

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch size >= num_seqs, or None when there is none."""
        return smallest_bucket(self.batch_sizes, num_seqs)

    def has_graph(self, num_seqs: int, variant: str = "plain") -> bool:
        """Whether a graph of `variant` was captured for the bucket of num_seqs sequences."""
        return (variant, self.bucket(num_seqs)) in self._graphs

    def _metadata(self, padded: HostStep) -> AttentionMetadata:
        """Metadata of a step padded to its bucket: the slot mapping views the static buffer,
        the other device fields are that view too (a planning backend reads the host lists and
        the graph's own buffers; nothing is copied)."""
        slots = self._inputs.slots(len(padded.seq_lens))
        return AttentionMetadata.from_host(
            padded.query_lens,
            padded.seq_lens,
            padded.block_tables,
            self.block_size,
            slot_mapping=slots,
            placeholder=slots,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket of every variant, largest first. Mutates the scratch block of
        the KV caches."""
        start = time.perf_counter()
        self._inputs.reset(self.scratch_slot)
        for variant, batch in self.captured():
            meta = self._metadata(HostStep.padding(batch, self.scratch_block, self.block_size))
            ids, positions = self._inputs.ids(batch), self._inputs.positions(batch)
            ctx = ForwardContext(meta, self.kv_caches, self.backend, valid_slots=True)
            self.backend.prepare_replay(meta, variant)
            with forward_context(ctx):
                graph = self._capture_one(batch, ids, positions)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[variant, batch] = graph
            self._outputs[variant, batch] = self._static_out[:batch]
        torch.cuda.synchronize(self.device)
        self.backend.reset_stats()  # step counters count the workload's steps, not the captures
        logger.info(
            "captured %d CUDA graphs (variants %s; decode batch sizes %d..%d) in %.1f s",
            len(self._graphs),
            list(self.variants),
            self.batch_sizes[0],
            self.max_batch_size,
            time.perf_counter() - start,
        )

    def captured(self) -> list[tuple[str, int]]:
        """(variant, batch) of every graph to capture, each variant's buckets largest first:
        those >= its smallest batch and <= its largest (`graph_variant_max_batch`)."""
        return [
            (variant, batch)
            for variant, min_batch in self.variants.items()
            for batch in reversed(self.batch_sizes)
            if min_batch <= batch <= self.variant_max_batch.get(variant, batch)
        ]

    def _capture_one(
        self, batch: int, ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.cuda.CUDAGraph:
        """One bucket's graph (inside the capture's forward context): a warm-up pass (lazy
        inits, compiles, cuBLAS), then the capture of the forward pass into the static hidden
        buffer, and of the logits into theirs for buckets <= `logits_max_batch`."""
        with_logits = batch <= self.logits_max_batch
        out = self.model(ids, positions)
        if self._static_out is None:
            self._static_out = out.new_empty((self.max_batch_size, *out.shape[1:]))
        if with_logits and self._static_logits is None:
            logits = self.model.compute_logits(out[: self.logits_max_batch])
            self._static_logits = torch.empty_like(logits)
        del out
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._static_out[:batch].copy_(self.model(ids, positions))
            if with_logits:
                hidden = self._static_out[:batch]
                self._static_logits[:batch].copy_(self.model.compute_logits(hidden))
        return graph

    def logits(self, num_seqs: int) -> torch.Tensor | None:
        """The logits [B, vocab] the last replay computed for its B real rows (a view: valid
        until the next replay), or None when B's bucket is above `logits_max_batch`."""
        batch = self.bucket(num_seqs)
        if self._static_logits is None or batch is None or batch > self.logits_max_batch:
            return None
        return self._static_logits[:num_seqs]

    def run_decode(self, host: HostStep, fill_inputs=None) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a decode-only step from a replay (`run`) when a bucket
        fits it and the backend does not want the eager (cascade) path; None otherwise. The
        variant is the backend's `plan_decode` (`PATH_VARIANTS`) for a step with prefix groups
        or one whose bucket has a "small_decode" graph, else "plain"; an offered variant its
        bucket lacks replays "plain"."""
        num_seqs = len(host.seq_lens)
        if num_seqs > self.max_batch_size:
            return None
        path, groups = DecodePath.GRAPH, None
        shared = host.prefix_lens is not None and any(host.prefix_lens)
        if shared or self.has_graph(num_seqs, "small_decode"):
            in_graph = self.has_graph(num_seqs, "shared_prefix")
            prefix_lens = host.prefix_lens or [0] * num_seqs
            path, groups = self.backend.plan_decode(
                host.seq_lens, host.block_tables, prefix_lens, self.block_size, in_graph
            )
            if path is DecodePath.EAGER:
                return None  # prefix sharing pays this step: the cascade path, eagerly
        variant = PATH_VARIANTS[path]
        if not self.has_graph(num_seqs, variant):
            variant, groups = "plain", None
        return self.run(host, fill_inputs, variant, groups)

    def run(
        self,
        host: HostStep,
        fill_inputs=None,
        variant: str = "plain",
        groups: SharedPrefixMetadata | None = None,
    ) -> torch.Tensor:
        """Replay the `variant` graph of the decode step's bucket; returns hidden [B,
        hidden_size] of the B real rows (a view of the graph's output: valid until the next
        replay). `fill_inputs`, if given, is called with the static input-id buffer after the
        host ids are copied in (it writes pending token ids on the device). `groups` (the
        step's prefix groups, from the backend's `plan_decode`) is passed to the variant's plan.

        Raises:
            ValueError: if no graph of `variant` holds B sequences.
        """
        num_seqs = len(host.seq_lens)
        batch = self.bucket(num_seqs)
        if (variant, batch) not in self._graphs:
            raise ValueError(f"no {variant!r} CUDA graph for a decode batch of {num_seqs}")
        padded = host.padded(batch, self.scratch_block, self.block_size)
        self._inputs.load(padded)
        if fill_inputs is not None:
            fill_inputs(self._inputs.ids(num_seqs))
        meta = self._metadata(padded)
        self.backend.prepare_replay(meta, variant, groups)
        self._graphs[variant, batch].replay()
        return self._outputs[variant, batch][:num_seqs]
