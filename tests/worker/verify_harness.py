"""Verify steps (speculative decoding) through a `ModelRunner` twice, eagerly and through its
verify graphs, from the same KV cache: for the CPU tests (graphs that re-run the forward pass,
planned by a re-planning reference backend) and the GPU test (CUDA graphs, FlashInfer)."""

from __future__ import annotations

import torch

from phloem.core.scheduler_output import NewSequenceData, ScheduledSequence, SchedulerOutput
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.reference import ReferenceAttention
from phloem.sampling_params import SamplingParams
from phloem.worker.input_batch import HostStep
from phloem.worker.model_runner import ModelRunner
from tests.worker.piecewise_harness import BLOCK_SIZE, Seq

K = 3  # drafts a row at most: verify graphs of q = 4 tokens a sequence


class ReplanningReference(ReferenceAttention):
    """The reference attention declared able to replay verify graphs: its forward reads the
    step's metadata each call, which graphs that re-run their forward pass (CPU tests) give it
    (it could not serve real CUDA graphs, hence a test double). Checks the padded step's
    shape as FlashInfer's plan would."""

    supports_verify_graphs = True

    def __init__(self) -> None:
        super().__init__()
        self.plans = 0
        self.share = False  # `plan_verify`'s answer: would it share the step's prefix groups
        self.asked = 0

    def plan_verify(self, query_lens, seq_lens, block_tables, prefix_lens, block_size) -> bool:
        self.asked += 1
        return not self.share

    def prepare_verify_replay(self, meta: AttentionMetadata) -> None:
        if meta.query_start_loc_cpu[-1] != meta.max_query_len * meta.num_seqs:
            raise ValueError("verify graph steps need the same query length a sequence")
        self.plans += 1


def verify_step(rows: list[tuple[Seq, tuple[int, ...], int]]) -> SchedulerOutput:
    """The scheduler output verifying each (seq, drafts, accepted): the sequence computes its
    next prompt token and the drafts, samples, and then has 1 + accepted more tokens computed
    (a prompt stands in for the known tokens, so no id is pending)."""
    scheduled = []
    for seq, drafts, accepted in rows:
        new = None
        if seq.computed == 0:
            new = NewSequenceData(seq.prompt, [], SamplingParams(temperature=0.0))
        scheduled.append(
            ScheduledSequence(
                seq.seq_id, seq.computed, 1 + len(drafts), True,
                new_block_ids=seq.blocks if new else (), new_sequence=new, draft_token_ids=drafts,
            )
        )  # fmt: skip
        seq.computed += 1 + accepted
    return SchedulerOutput(scheduled=scheduled)


def prefill(runner: ModelRunner, rows: list[tuple[Seq, int]]) -> None:
    """Compute the first n prompt tokens of each (seq, n) eagerly (sequences sent as new)."""
    from tests.worker.piecewise_harness import step

    sched = step(rows)
    states = runner.input_batch.update(sched)
    host = HostStep.build(sched, states, BLOCK_SIZE, runner.backend.reads_prefix_lens)
    with torch.inference_mode():
        inputs = runner.prepare_inputs(host)
        runner.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)


def verify_both_ways(runner: ModelRunner, sched: SchedulerOutput):
    """Run one verify step eagerly, then (from the same cache) through the verify graphs.
    Returns (eager hidden [N, hidden] of the step's logits rows, graph hidden or None when the
    step does not fit a graph, eager caches, graph caches, caches before, the HostStep); the
    runner is left with the graph's caches (the eager ones when no graph ran)."""
    states = runner.input_batch.update(sched)
    host = HostStep.build(sched, states, BLOCK_SIZE, runner.backend.reads_prefix_lens)
    before = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        inputs = runner.prepare_inputs(host)
        hidden = runner.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        eager = hidden[inputs.logits_indices].clone()
        eager_caches = [c.clone() for c in runner.kv_caches]
        for cache, saved in zip(runner.kv_caches, before):
            cache.copy_(saved)
        graph = runner.verify_runner.run(host, runner._fill_pending)
        if graph is None:
            for cache, saved in zip(runner.kv_caches, eager_caches):
                cache.copy_(saved)
        else:
            graph = graph.clone()
    caches = [c.clone() for c in runner.kv_caches]
    return eager, graph, eager_caches, caches, before, host


def sequences(vocab: int, seed: int = 0) -> tuple[Seq, Seq, Seq]:
    """Three sequences with long prompts and whole block tables (A owns block 0, whose slot 0
    a padding token would hit if it wrote position 0 of a real block)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    a = Seq("A", ids(40), [0, 7, 3, 31, 32, 33, 34, 35, 36, 37])
    b = Seq("B", ids(40), [5, 1, 9, 2, 11, 12, 13, 14, 15, 16])
    c = Seq("C", ids(40), [20, 21, 22, 23, 24, 25, 26, 27, 28, 29])
    return a, b, c


def verify_steps(a: Seq, b: Seq, c: Seq) -> list[list[tuple[Seq, tuple[int, ...], int]]]:
    """(seq, drafts, accepted) rows of five verify steps after prompts of 10, 7 and 13 tokens:
    3 rows (a dummy row pads them to bucket 4; B has no drafts and its padding spills into a
    page only the scratch block fills), 3 rows again, one row alone (bucket 1), 2 rows of k
    drafts each (no token padding), then a row with k + 1 drafts (no graph: the fallback)."""
    return [
        [(a, (5, 6), 1), (b, (), 0), (c, (7, 8, 9), 3)],
        [(a, (9, 9, 9), 0), (b, (4,), 1), (c, (), 0)],
        [(b, (3, 3), 2)],
        [(c, (1, 2, 3), 1), (a, (4, 5, 6), 2)],
        [(a, (1, 2, 3, 4), 0)],
    ]
