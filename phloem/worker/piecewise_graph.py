"""Piecewise CUDA graphs for the steps decode graphs do not take: prompt chunks mixed with decodes.

A step of T real tokens (any mix of prompt chunks, decodes and verified drafts) runs at the
smallest token bucket >= T (`piecewise_token_sizes`). The model's forward pass is captured per
bucket in L + 1 pieces that end and start at each layer's attention backend call
(`LlamaForCausalLM.pieces`; vLLM's "piecewise" graphs, split by the model's own interface rather
than by torch.compile):

    piece 0      embed -> layer 0: norm, QKV, RoPE + KV write            -> q, residual
    backend      layer 0 attention, EAGER, on the T real tokens          -> attn_out
    piece i      layer i-1: o_proj, norm, MLP -> layer i: norm, QKV, RoPE + KV write
    ...
    piece L      layer L-1: o_proj, norm, MLP -> final norm              -> hidden

The backend call runs eagerly with the step's real metadata, planned once by `begin_step` as in
an eager step, so every backend (FlashInfer's ragged prefill, the shared-prefix cascade) runs
unchanged and needs no graph support; the pieces hold everything else, tensor-parallel
all-reduces included. Rows are padded to the bucket:

    rows |-- T real tokens --|-- bucket - T padding --|
    padding: token 0 at position 0, its K/V written to the scratch slot (never a real sequence's)

Static buffers (inputs, q, residual, attention output, hidden) are allocated once for the largest
bucket; every piece of every bucket reads and writes leading slices of them, copying its results
in at its end, so a piece's temporaries die with its capture and all graphs share one memory
pool (largest bucket first). Padding rows of the attention output hold stale rows of earlier
steps: every op of a piece is row-wise, so they reach only padding rows.

The graph mechanism is injectable (`PieceGraphs`): `CUDAPieceGraphs` captures and replays CUDA
graphs; `RerunPieceGraphs` re-runs the captured callable on the same buffers, so the whole path
(buckets, padding, slices, piece boundaries) runs and is tested on the CPU.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from torch import nn

from phloem.forward_context import ForwardContext, forward_context
from phloem.layers.attention import Attention
from phloem.ops.attention.interface import AttentionBackend
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.staging import to_device
from phloem.worker.graph_inputs import GraphInputs, smallest_bucket
from phloem.worker.input_batch import HostStep

logger = logging.getLogger(__name__)

# token buckets: every multiple of 64 up to 1024 (Llama-3.1-8B on an H200: a step of a 512-token
# prompt chunk and a few dozen decodes is 550 tokens). No larger ones: measured on an H200
# (benchmarks/results/2026-11-26c-h200-piecewise), a 1,024-token step's GPU time (27 ms) already
# exceeds its eager launch (20 ms), and padding 1,100 tokens to 1,280 or 1,600 to 2,048 made the
# step 8-10% slower than eager.
_STEP, _LIMIT = 64, 1024


def piecewise_token_sizes(max_num_batched_tokens: int) -> list[int]:
    """The captured token buckets: 64, 128, ..., 1024, capped at max_num_batched_tokens (which
    is included when it is at most 1024, so every step the scheduler can form fits a bucket
    then; larger steps run eagerly).

    Raises:
        ValueError: if max_num_batched_tokens < 1.
    """
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    sizes = list(range(_STEP, _LIMIT + 1, _STEP))
    capped = [s for s in sizes if s < max_num_batched_tokens]
    if max_num_batched_tokens <= sizes[-1]:
        capped.append(max_num_batched_tokens)
    return capped


class PiecewiseModel(Protocol):
    """A forward pass split at the attention backend calls (`LlamaForCausalLM.pieces()`)."""

    def first_piece(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def middle_piece(
        self,
        layer_idx: int,
        positions: torch.Tensor,
        attn_out: torch.Tensor,
        residual: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def last_piece(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor: ...

    def attention(self, layer_idx: int) -> Attention: ...


class PieceGraph(Protocol):
    def replay(self) -> None: ...


class PieceGraphs(abc.ABC):
    """How a piece is captured and replayed (injectable: CUDA graphs, or re-runs on the CPU)."""

    @abc.abstractmethod
    def capture(self, piece: Callable[[], None]) -> PieceGraph:
        """Run `piece` once (warm-up: lazy inits, compiles) and capture it; `replay()` of the
        result does what `piece()` does, on the same buffers."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Free what the captures hold (their memory pool)."""


class CUDAPieceGraphs(PieceGraphs):
    """`torch.cuda.CUDAGraph`s sharing one memory pool, captured on a side stream (without
    `torch.cuda.graph`'s cache emptying per capture: hundreds of pieces are captured)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._pool = None
        self._captured: list[torch.cuda.CUDAGraph] = []

    def capture(self, piece: Callable[[], None]) -> PieceGraph:
        piece()  # warm-up, on the current stream
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool)
            try:
                piece()
            finally:
                graph.capture_end()
        if self._pool is None:
            self._pool = graph.pool()
        self._captured.append(graph)
        return graph

    def release(self) -> None:
        """Wait for the device, then free every graph (and the collectives they captured)."""
        torch.cuda.synchronize(self.device)
        for graph in self._captured:
            graph.reset()
        self._captured.clear()
        self._pool = None


class _Rerun:
    def __init__(self, piece: Callable[[], None]) -> None:
        self.replay = piece


class RerunPieceGraphs(PieceGraphs):
    """A stand-in whose replay re-runs the captured callable (the CPU path of tests: the same
    buffers, slices and piece boundaries as CUDA graphs, computed eagerly)."""

    def capture(self, piece: Callable[[], None]) -> PieceGraph:
        piece()
        return _Rerun(piece)


class PiecewiseGraphRunner:
    """Captures and replays the pieces of non-decode steps (see the module docstring).

    Args:
        model: a phloem model with `pieces()` (a `PiecewiseModel`), `config.hidden_size` and
            `dtype`.
        kv_caches: the per-layer caches (fixed addresses); backend: the attention backend.
        block_size: tokens per block; scratch_block: a block id no request ever owns.
        token_sizes: the buckets (`piecewise_token_sizes`), ascending, each >= 1.
        device: where the buffers live; graphs: the capture mechanism.
    Raises:
        ValueError: for empty or unsorted token_sizes.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        block_size: int,
        scratch_block: int,
        token_sizes: list[int],
        device: torch.device,
        graphs: PieceGraphs,
    ) -> None:
        if not token_sizes or token_sizes != sorted(set(token_sizes)) or token_sizes[0] < 1:
            raise ValueError(f"token_sizes must be ascending positive counts, got {token_sizes}")
        self.pieces: PiecewiseModel = model.pieces()
        self.num_layers: int = model.num_layers
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.token_sizes = token_sizes
        self.max_num_tokens = token_sizes[-1]
        self.device = device
        self.graphs = graphs
        self._graphs: dict[int, list[PieceGraph]] = {}
        self._attention = [self.pieces.attention(i) for i in range(self.num_layers)]
        first = self._attention[0]
        rows, dtype = self.max_num_tokens, model.dtype
        heads = (rows, first.num_heads, first.head_dim)
        self._inputs = GraphInputs(rows, device)  # [3, max tokens]
        self._q = torch.zeros(heads, dtype=dtype, device=device)
        self._attn_out = torch.zeros(heads, dtype=dtype, device=device)
        self._residual = torch.zeros(rows, model.config.hidden_size, dtype=dtype, device=device)
        self._hidden = torch.zeros_like(self._residual)

    @property
    def num_graphs(self) -> int:
        return sum(map(len, self._graphs.values()))

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest captured bucket >= num_tokens, or None when there is none."""
        return smallest_bucket((s for s in self.token_sizes if s in self._graphs), num_tokens)

    def _pieces(self, size: int) -> list[Callable[[], None]]:
        """The L + 1 pieces of bucket `size`: each reads and writes the first `size` rows of the
        static buffers, under a context whose slot mapping is the static slot buffer."""
        ids, positions, slots = self._inputs.buffer[:, :size]
        q, residual = self._q[:size], self._residual[:size]
        attn_out, hidden = self._attn_out[:size], self._hidden[:size]
        model = self.pieces
        # the pieces read only the slot mapping (`Attention.store_kv`); no backend call in them
        meta = AttentionMetadata.from_host([size], [size], [[]], self.block_size,
                                           slot_mapping=slots)  # fmt: skip
        ctx = ForwardContext(meta, self.kv_caches, self.backend, valid_slots=True)

        def first() -> None:
            with forward_context(ctx):
                q_out, res = model.first_piece(ids, positions)
                q.copy_(q_out)
                residual.copy_(res)

        def middle(layer_idx: int) -> Callable[[], None]:
            def piece() -> None:
                with forward_context(ctx):
                    q_out, res = model.middle_piece(layer_idx, positions, attn_out, residual)
                    q.copy_(q_out)
                    residual.copy_(res)

            return piece

        def last() -> None:
            with forward_context(ctx):
                hidden.copy_(model.last_piece(attn_out, residual))

        return [first, *(middle(i) for i in range(1, self.num_layers)), last]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's pieces, largest bucket first. Mutates the scratch block of
        the KV caches (the capture's rows all write the scratch slot)."""
        start = time.perf_counter()
        self._inputs.reset(self.scratch_block * self.block_size)
        for size in reversed(self.token_sizes):
            self._graphs[size] = [self.graphs.capture(piece) for piece in self._pieces(size)]
        logger.info(
            "captured %d piecewise CUDA graphs (token buckets %d..%d, %d pieces each) in %.1f s",
            self.num_graphs,
            self.token_sizes[0],
            self.max_num_tokens,
            self.num_layers + 1,
            time.perf_counter() - start,
        )

    def release(self) -> None:
        """Free every captured piece and the graphs' memory pool."""
        self._graphs.clear()
        self.graphs.release()

    def run(
        self,
        host: HostStep,
        fill_inputs: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Run the step's T tokens through the pieces of its bucket, each layer's attention
        between two pieces (eager, on the T real rows, with the step's metadata, planned here
        by `begin_step`). `fill_inputs`, if given, is called with the static input-id rows
        [T] after the host ids are copied in (it writes pending ids on the device). Mutates
        the KV caches at the step's slots and the scratch slot.

        Returns:
            hidden [S, hidden_size] of the rows `host.logits_indices`.
        Raises:
            ValueError: if no bucket holds T tokens.
        """
        num_tokens = len(host.input_ids)
        size = self.bucket(num_tokens)
        if size is None:
            raise ValueError(f"no piecewise CUDA graph holds a step of {num_tokens} tokens")
        inputs = np.zeros((3, size), dtype=np.int64)  # padding: token 0 at position 0
        inputs[:, :num_tokens] = (host.input_ids, host.positions, host.slots)
        inputs[2, num_tokens:] = self.scratch_block * self.block_size
        self._inputs.load_rows(inputs)
        if fill_inputs is not None:
            fill_inputs(self._inputs.ids(num_tokens))
        meta = AttentionMetadata.from_host(
            host.query_lens,
            host.seq_lens,
            host.block_tables,
            self.block_size,
            self.device,
            slot_mapping=self._inputs.slots(num_tokens),
            padded_tables=self.backend.needs_block_tables,
            prefix_lens=host.prefix_lens,
        )
        self.backend.begin_step(meta)
        ctx = ForwardContext(meta, self.kv_caches, self.backend, valid_slots=True)
        graphs = self._graphs[size]
        q, attn_out = self._q[:num_tokens], self._attn_out[:num_tokens]
        with forward_context(ctx):
            graphs[0].replay()
            for attention, graph in zip(self._attention, graphs[1:]):
                attention.attend(q, out=attn_out)
                graph.replay()
        logits_indices = to_device(np.array(host.logits_indices, dtype=np.int64), self.device)
        return self._hidden[:num_tokens][logits_indices]
