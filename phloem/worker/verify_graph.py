"""Full CUDA graphs for verify steps (speculative decoding): one captured forward pass per
(batch bucket, width), every sequence padded to the same query length q = 1 + w (vLLM's "uniform
decode" graphs for speculative decoding). The widths w are `SpeculativeConfig.verify_graph_widths`
(default: k alone, q = 1 + k).

A verify step whose sequences each compute their last token and at most k drafts (rows without
drafts included; no prompt chunk) runs the graph of the smallest captured width w >= its largest
draft count, at the smallest bucket >= B sequences of that width (`pick_verify_shape`; a larger
width when the smaller has no such bucket), unless the backend would share its prefix groups' KV
(`AttentionBackend.plan_verify`: the shared-prefix backend's cost rule); anything else keeps the
piecewise or eager path (`verify_graph_fits`):

    row b    |-- last, d_1 .. d_kb (real) --|-- w - k_b padding tokens --|     q tokens
    rows     |-- B real rows --|-- bucket - B dummy rows (q padding tokens each) --|
    padding  token 0 at position 0, its K/V written to the scratch slot

A padded row's KV length counts its padding (start_b + q), so its real tokens keep their
positions; attention is causal (query i of row b reads KV positions <= start_b + i), so no real
token reads a padding position. The row's page table is its real pages, then the scratch block
for pages only padding falls in; a dummy row's pages are all the scratch block. Padding queries
read stale or scratch K/V and their outputs are never gathered (`VerifyPadding.gather`); every
op outside attention is row-wise, so they reach no real row. The sampling and verification then
see exactly the eager step's rows, in its order.

The backend plans each padded step into the fixed buffers of its (bucket, q) wrapper
(`AttentionBackend.prepare_verify_replay`, declared by `supports_verify_graphs`), before the
capture and before each replay. The capture mechanism is the piecewise graphs' (`PieceGraphs`):
CUDA graphs on a GPU, re-runs of the same forward on the same buffers in the CPU tests.

Memory: one graph per (bucket, width), all in one pool (most tokens first), captured only with
a speculative config, for buckets up to `SpeculativeConfig.verify_graph_max_batch` whose
bucket x q tokens fit `max_num_batched_tokens` (`verify_batch_sizes`, per width); the static
buffers hold the largest bucket x q; the worker measures the graphs with the other graphs
(`worker/graph_memory.py`). Each extra width adds its buckets' captures (start-up time).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from phloem.forward_context import ForwardContext, forward_context
from phloem.ops.attention.interface import AttentionBackend
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.staging import to_device
from phloem.worker.cuda_graph import graph_batch_sizes
from phloem.worker.graph_inputs import GraphInputs, smallest_bucket
from phloem.worker.input_batch import HostStep
from phloem.worker.piecewise_graph import PieceGraph, PieceGraphs

logger = logging.getLogger(__name__)

FillPending = Callable[[torch.Tensor, list[tuple[int, str]]], None]


def verify_batch_sizes(
    max_batch: int, max_num_seqs: int, query_len: int, max_num_batched_tokens: int
) -> list[int]:
    """The verify graphs' buckets (`cuda_graph.graph_batch_sizes` up to the limit): at most
    `max_batch` (`SpeculativeConfig.verify_graph_max_batch`; 0: none) and `max_num_seqs`
    sequences, and bucket x query_len <= max_num_batched_tokens (the memory profile's step).
    Empty when no bucket fits.

    Raises:
        ValueError: if query_len < 2 (a verify step has at least one draft).
    """
    if query_len < 2:
        raise ValueError(f"verify graphs need query_len >= 2 (1 + k), got {query_len}")
    limit = min(max_batch, max_num_seqs, max_num_batched_tokens // query_len)
    return graph_batch_sizes(limit) if limit >= 1 else []


def pick_verify_shape(
    shapes: dict[int, list[int]], num_seqs: int, max_query_len: int
) -> tuple[int, int] | None:
    """The (query length q, bucket) a verify step replays: the smallest q >= max_query_len
    (1 + the step's largest draft count) among `shapes` (q -> its captured buckets) that has
    a bucket >= num_seqs, with its smallest such bucket; None when no shape fits."""
    for q in sorted(shapes):
        if q < max_query_len:
            continue
        batch = smallest_bucket(shapes[q], num_seqs)
        if batch is not None:
            return q, batch
    return None


def verify_graph_fits(host: HostStep, query_len: int) -> bool:
    """Whether a step has the shape of a verify graph of `query_len` (1 + k) tokens a
    sequence: it verifies drafts, and every sequence samples and computes exactly its last
    token plus its drafts (no prompt chunk), at most query_len tokens. (Prefix groups are the
    backend's call: `AttentionBackend.plan_verify`.)"""
    if not host.draft_counts or len(host.sampled) != len(host.query_lens):
        return False
    return all(
        q == 1 + d <= query_len for q, d in zip(host.query_lens, host.draft_counts, strict=True)
    )


@dataclass
class VerifyPadding:
    """A verify step padded to a bucket (module docstring).

    Attributes:
        step: the padded step: bucket x q tokens, bucket sequences of q queries each; its
            `logits_indices` and `pending` index the padded tokens.
        gather: int64 [N], the padded token of each of the real step's `logits_indices`, in
            its order (the rows the sampling and verification read).
    """

    step: HostStep
    gather: np.ndarray


def pad_verify_step(
    host: HostStep, query_len: int, batch: int, scratch_block: int, block_size: int
) -> VerifyPadding:
    """Pad a step that `verify_graph_fits` (B sequences, T tokens) to `batch` >= B sequences of
    `query_len` tokens each; real token t of row b, at offset j of the row, goes to b * q + j.
    Pure host work: the host lists are not modified (block tables are sliced, not copied,
    where no page is added)."""
    q, bs = query_len, block_size
    num_seqs = len(host.query_lens)
    q_lens = np.array(host.query_lens, dtype=np.int64)
    seq_lens = np.array(host.seq_lens, dtype=np.int64)
    row_of = np.repeat(np.arange(num_seqs, dtype=np.int64), q_lens)
    row_start = np.cumsum(q_lens) - q_lens
    where = row_of * q + (np.arange(len(row_of), dtype=np.int64) - row_start[row_of])
    total = batch * q
    ids = np.zeros(total, dtype=np.int64)
    positions = np.zeros(total, dtype=np.int64)
    slots = np.full(total, scratch_block * bs, dtype=np.int64)
    ids[where], positions[where], slots[where] = host.input_ids, host.positions, host.slots
    padded_lens = seq_lens - q_lens + q
    tables = []
    real_lens, lens = seq_lens.tolist(), padded_lens.tolist()
    for table, real_len, padded_len in zip(host.block_tables, real_lens, lens):
        real_pages, pages = -(-real_len // bs), -(-padded_len // bs)
        head = table if len(table) == real_pages else table[:real_pages]
        tables.append(
            head if pages == real_pages else head + [scratch_block] * (pages - real_pages)
        )
    num_dummies = batch - num_seqs
    tables += [[scratch_block] * -(-q // bs)] * num_dummies
    gather = where[np.array(host.logits_indices, dtype=np.int64)]
    step = HostStep(
        input_ids=ids,
        positions=positions,
        slots=slots,
        query_lens=[q] * batch,
        seq_lens=padded_lens.tolist() + [q] * num_dummies,
        block_tables=tables,
        logits_indices=gather.tolist(),
        sampled=host.sampled,
        prefix_lens=None,
        pending=[(int(where[i]), seq_id) for i, seq_id in host.pending],
        draft_counts=host.draft_counts,
    )
    return VerifyPadding(step, gather)


def _no_step() -> HostStep:
    """A step of no sequence (what the graphs are captured with, padded: dummy rows only)."""
    empty = np.zeros(0, dtype=np.int64)
    return HostStep(empty, empty, empty, [], [], [], [], [], None, [])


class VerifyGraphRunner:
    """Captures and replays verify steps (see the module docstring).

    Args:
        model: the phloem model (forward(input_ids, positions) -> hidden; `config.hidden_size`
            and `dtype`).
        kv_caches: the per-layer caches (fixed addresses); backend: one that
            `supports_verify_graphs`.
        block_size: tokens per block; scratch_block: a block id no request ever owns.
        shapes: query length q = 1 + w (a width w of `verify_graph_widths`) -> its buckets
            (`verify_batch_sizes`), ascending, each >= 1; device: where the buffers live.
        graphs: the capture mechanism (`CUDAPieceGraphs`; CPU tests re-run, `RerunPieceGraphs`).
    Raises:
        ValueError: for a backend without verify graphs, no shape, a q < 2 or bad buckets.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        block_size: int,
        scratch_block: int,
        shapes: dict[int, list[int]],
        device: torch.device,
        graphs: PieceGraphs,
    ) -> None:
        if not backend.supports_verify_graphs:
            raise ValueError(f"attention backend {backend.name!r} cannot plan verify graphs")
        if not shapes or min(shapes) < 2:
            raise ValueError(f"verify graphs need query_len >= 2 (1 + w), got {sorted(shapes)}")
        for sizes in shapes.values():
            if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
                raise ValueError(f"batch_sizes must be ascending positive counts, got {sizes}")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.shapes = {q: shapes[q] for q in sorted(shapes)}
        self.query_len = max(shapes)  # the widest: the longest row a step may have
        self.device = device
        self.graphs = graphs
        rows = max(q * sizes[-1] for q, sizes in shapes.items())
        self._inputs = GraphInputs(rows, device)  # [3, largest bucket x q]
        self._hidden = torch.zeros(rows, model.config.hidden_size, dtype=model.dtype, device=device)
        self._graphs: dict[tuple[int, int], PieceGraph] = {}  # (q, bucket) -> graph
        self._captured: dict[int, list[int]] = {}  # q -> its captured buckets, both ascending
        self._ctx: ForwardContext | None = None  # the step being replayed (read by re-runs)
        self.num_replays = 0

    def shape(self, num_seqs: int, max_query_len: int) -> tuple[int, int] | None:
        """The captured (q, bucket) a step of num_seqs rows of at most max_query_len tokens
        replays (`pick_verify_shape`), or None when there is none."""
        return pick_verify_shape(self._captured, num_seqs, max_query_len)

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured bucket >= num_seqs of the widest q, or None."""
        shape = self.shape(num_seqs, self.query_len)
        return None if shape is None else shape[1]

    def _plain_prefixes(self, host: HostStep) -> bool:
        """True unless the step has prefix groups the backend would share (`plan_verify`)."""
        if host.prefix_lens is None or not any(host.prefix_lens):
            return True
        return self.backend.plan_verify(
            host.query_lens, host.seq_lens, host.block_tables, host.prefix_lens, self.block_size
        )

    def _prepare(self, padded: HostStep) -> None:
        """Plan the padded step (`prepare_verify_replay`) and make its forward context; the
        slot mapping views the static buffer. Device copies of the step's lists only for a
        backend that reads the padded device table (the CPU tests' reference)."""
        slots = self._inputs.slots(len(padded.input_ids))
        args = (padded.query_lens, padded.seq_lens, padded.block_tables, self.block_size)
        if self.backend.needs_block_tables:
            meta = AttentionMetadata.from_host(*args, self.device, slot_mapping=slots,
                                               padded_tables=True)  # fmt: skip
        else:
            meta = AttentionMetadata.from_host(*args, slot_mapping=slots, placeholder=slots)
        self.backend.prepare_verify_replay(meta)
        self._ctx = ForwardContext(meta, self.kv_caches, self.backend, valid_slots=True)

    def _forward(self, query_len: int, batch: int) -> Callable[[], None]:
        """The captured step of bucket `batch` at q = query_len: the forward pass over the
        first batch x q rows of the static buffers, its hidden states copied into the static
        output."""
        rows = batch * query_len
        ids, positions = self._inputs.ids(rows), self._inputs.positions(rows)
        hidden = self._hidden[:rows]

        def forward() -> None:
            with forward_context(self._ctx):
                hidden.copy_(self.model(ids, positions))

        return forward

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (q, bucket), most tokens first (the pool's largest allocation first).
        Mutates the scratch block of the KV caches."""
        start = time.perf_counter()
        self._inputs.reset(self.scratch_block * self.block_size)
        order = sorted(((q * b, q, b) for q, sizes in self.shapes.items() for b in sizes),
                       reverse=True)  # fmt: skip
        for _, q, batch in order:
            padded = pad_verify_step(_no_step(), q, batch, self.scratch_block, self.block_size)
            self._prepare(padded.step)
            self._graphs[q, batch] = self.graphs.capture(self._forward(q, batch))
        self._captured = {q: [b for b in sizes if (q, b) in self._graphs]
                          for q, sizes in self.shapes.items()}  # fmt: skip
        self.backend.reset_stats()  # the counters count the workload's steps
        logger.info(
            "captured %d verify CUDA graphs (query tokens a sequence -> batch sizes: %s) "
            "in %.1f s", len(self._graphs), self.shapes, time.perf_counter() - start,
        )  # fmt: skip

    def release(self) -> None:
        """Free every captured graph and their memory pool."""
        self._graphs.clear()
        self._captured = {}
        self.graphs.release()

    def run(self, host: HostStep, fill_pending: FillPending | None = None) -> torch.Tensor | None:
        """Replay the verify graph of the step's shape when it fits (`verify_graph_fits`, a
        captured (width, bucket): `shape`, and for a step of prefix groups the backend's
        `plan_verify`); None
        otherwise (the caller runs its other path). `fill_pending`, if given, is called with
        the static input-id rows and the padded step's pending (token index, seq id) pairs (it
        writes ids sampled by the step in flight). Mutates the KV caches at the step's slots
        and the scratch slot.

        Returns:
            hidden [N, hidden_size] of the real step's `logits_indices`, in its order.
        """
        if not verify_graph_fits(host, self.query_len):
            return None
        shape = self.shape(len(host.query_lens), max(host.query_lens))
        if shape is None or not self._plain_prefixes(host):
            return None
        q, batch = shape
        padding = pad_verify_step(host, q, batch, self.scratch_block, self.block_size)
        step, rows = padding.step, batch * q
        self._inputs.load(step)
        if step.pending and fill_pending is not None:
            fill_pending(self._inputs.ids(rows), step.pending)
        self._prepare(step)
        self._graphs[q, batch].replay()
        self.num_replays += 1
        return self._hidden[:rows][to_device(padding.gather, self.device)]
