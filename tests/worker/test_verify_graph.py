"""Verify graphs of speculative decoding (phloem/worker/verify_graph.py) on the CPU: the buckets,
the fallback decisions, the padding (positions, slots, page tables, gathered rows, pending ids)
as host data, and the whole path through graphs that re-run the forward pass on the same
buffers: hidden states and KV cache equal the eager step's, and an engine with n-gram drafts
generates the same greedy tokens with them, without them and with speculation off."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from phloem.config import SpeculativeConfig
from phloem.ops.attention.reference import ReferenceAttention
from phloem.worker.input_batch import HostStep
from phloem.worker.piecewise_graph import RerunPieceGraphs
from phloem.worker.verify_graph import (
    VerifyGraphRunner,
    pad_verify_step,
    pick_verify_shape,
    verify_batch_sizes,
    verify_graph_fits,
)
from tests.worker.piecewise_harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    CountingGraphs,
    make_runner,
    tiny_phloem_model,
)
from tests.worker.verify_harness import (
    K,
    ReplanningReference,
    prefill,
    sequences,
    verify_both_ways,
    verify_step,
    verify_steps,
)

SCRATCH = NUM_BLOCKS
Q = 1 + K


def _host(q_lens, starts, drafts, tables, sampled=None, prefix_lens=None, pending=()):
    """A hand-built step: row b computes q_lens[b] tokens from starts[b] (ids 100 * b + j,
    slots block-table based), sampling every row by default; drafts [S] per sampled row."""
    ids, positions, slots, logits = [], [], [], []
    sampled = list(range(len(q_lens))) if sampled is None else sampled
    for b, (q, start, table) in enumerate(zip(q_lens, starts, tables)):
        for j in range(q):
            pos = start + j
            ids.append(100 * b + j)
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    qsl = np.cumsum([0, *q_lens])
    for i, b in enumerate(sampled):
        first = qsl[b + 1] - 1 - (drafts[i] if drafts else 0)
        logits += range(first, qsl[b + 1])
    return HostStep(
        input_ids=np.array(ids, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        slots=np.array(slots, dtype=np.int64),
        query_lens=list(q_lens),
        seq_lens=[s + q for s, q in zip(starts, q_lens)],
        block_tables=tables,
        logits_indices=[int(i) for i in logits],
        sampled=sampled,
        prefix_lens=prefix_lens,
        pending=list(pending),
        draft_counts=list(drafts),
    )


def test_batch_sizes():
    assert verify_batch_sizes(64, 256, 6, 4096) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert verify_batch_sizes(64, 20, 6, 4096) == [1, 2, 4, 8, 16, 20]
    assert verify_batch_sizes(64, 256, 17, 512) == [1, 2, 4, 8, 16, 30]  # 30 x 17 <= 512
    assert verify_batch_sizes(0, 256, 6, 4096) == []
    assert verify_batch_sizes(64, 256, 17, 16) == []
    with pytest.raises(ValueError, match="query_len"):
        verify_batch_sizes(64, 256, 1, 4096)


def test_config_limit():
    assert SpeculativeConfig().verify_graph_max_batch == 64
    SpeculativeConfig(verify_graph_max_batch=0).validate()
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="speculative_config.verify_graph_max_batch"):
            SpeculativeConfig(verify_graph_max_batch=bad).validate()


def test_config_widths():
    """`verify_graph_widths`: None means [k] (one width, today's graphs); a list of integers in
    [1, k], sorted and deduplicated; anything else is refused naming the field."""
    assert SpeculativeConfig(num_speculative_tokens=16).verify_widths() == [16]
    spec = SpeculativeConfig(num_speculative_tokens=16, verify_graph_widths=[16, 2, 8, 4, 2])
    spec.validate()
    assert spec.verify_widths() == [2, 4, 8, 16]
    SpeculativeConfig(num_speculative_tokens=3, verify_graph_widths=[1]).validate()
    for bad in ([], [0], [17], [2, 2.5], [True], 4, "2,4"):
        with pytest.raises(ValueError, match="speculative_config.verify_graph_widths"):
            SpeculativeConfig(num_speculative_tokens=16, verify_graph_widths=bad).validate()
    from_json = SpeculativeConfig.from_dict({"verify_graph_widths": [2, 4]})
    assert from_json.verify_widths() == [2, 4]


def test_width_selection():
    """The smallest width whose q = 1 + w holds the step's longest row and that has a bucket
    for its rows; a wider one when the narrow one has none; None when nothing fits."""
    shapes = {3: [1], 5: [1, 2, 4], 9: [1, 2, 4, 8]}
    assert pick_verify_shape(shapes, 1, 2) == (3, 1)  # 1 draft at most: width 2
    assert pick_verify_shape(shapes, 1, 3) == (3, 1)
    assert pick_verify_shape(shapes, 2, 3) == (5, 2)  # width 2 has no bucket of 2
    assert pick_verify_shape(shapes, 3, 4) == (5, 4)
    assert pick_verify_shape(shapes, 3, 6) == (9, 4)
    assert pick_verify_shape(shapes, 5, 2) == (9, 8)
    assert pick_verify_shape(shapes, 9, 2) is None  # no bucket of 9 rows
    assert pick_verify_shape(shapes, 1, 10) is None  # more drafts than the widest width
    assert pick_verify_shape({}, 1, 2) is None


def test_padding_to_a_narrow_width():
    """Rows of 1 and 0 drafts padded to width 1 (q = 2) and to width 3 (q = 4): the same real
    tokens, each row padded only to its width's q."""
    tables = [[0, 7, 3, 9], [5, 1]]
    host = _host([2, 1], [9, 7], [1, 0], tables)
    narrow = pad_verify_step(host, 2, 2, SCRATCH, BLOCK_SIZE)
    wide = pad_verify_step(host, Q, 2, SCRATCH, BLOCK_SIZE)
    assert narrow.gather.tolist() == [0, 1, 2] and wide.gather.tolist() == [0, 1, 4]
    assert len(narrow.step.input_ids) == 4 and len(wide.step.input_ids) == 2 * Q
    assert narrow.step.query_lens == [2, 2] and narrow.step.seq_lens == [11, 9]
    for padding in (narrow, wide):
        assert padding.step.input_ids[padding.gather].tolist() == host.input_ids.tolist()
        assert padding.step.positions[padding.gather].tolist() == host.positions.tolist()


def test_which_steps_fit():
    tables = [[0, 1, 2], [3, 4, 5]]
    assert verify_graph_fits(_host([3, 1], [5, 6], [2, 0], tables), Q)
    assert verify_graph_fits(_host([4, 4], [5, 6], [3, 3], tables), Q)
    # a plain decode step (no drafts) replays the decode graph instead
    assert not verify_graph_fits(_host([1, 1], [5, 6], [], tables), Q)
    # more than k drafts
    assert not verify_graph_fits(_host([5, 1], [5, 6], [4, 0], tables), Q)
    # a prompt chunk beside the verify rows: it does not sample ...
    assert not verify_graph_fits(_host([3, 6], [5, 0], [2], tables, sampled=[0]), Q)
    # ... or samples its last token only (q_len != 1 + drafts)
    assert not verify_graph_fits(_host([3, 3], [5, 0], [2, 0], tables), Q)
    # prefix groups are the backend's call (`plan_verify`, below), not the shape's
    assert verify_graph_fits(_host([3, 1], [5, 6], [2, 0], tables, prefix_lens=[4, 0]), Q)


def test_padding_layout():
    """Rows of 2, 0 and 3 drafts (q = 4) padded to a bucket of 4: real tokens at b * q + j,
    padding token 0 at position 0 in the scratch slot, page tables extended by the scratch
    block only where padding starts a page, a dummy row of scratch pages, the gathered rows in
    the real step's order, and a pending id moved to its padded token."""
    tables = [[0, 7, 3, 9], [5, 1], [20, 21, 22, 23]]
    host = _host([3, 1, 4], [9, 7, 8], [2, 0, 3], tables, pending=[(3, "B")])
    padding = pad_verify_step(host, Q, 4, SCRATCH, BLOCK_SIZE)
    step = padding.step
    real = [0, 1, 2, 4, 8, 9, 10, 11]  # the real tokens' padded indices
    assert padding.gather.tolist() == [0, 1, 2, 4, 8, 9, 10, 11] == step.logits_indices
    assert step.input_ids[real].tolist() == host.input_ids.tolist()
    assert step.positions[real].tolist() == host.positions.tolist()
    assert step.slots[real].tolist() == host.slots.tolist()
    pad = sorted(set(range(16)) - set(real))
    assert (step.input_ids[pad] == 0).all() and (step.positions[pad] == 0).all()
    assert (step.slots[pad] == SCRATCH * BLOCK_SIZE).all()
    assert step.query_lens == [Q] * 4
    assert step.seq_lens == [13, 11, 12, Q]  # start + q; a dummy row: q
    # A: 12 real KV tokens -> 3 pages, 13 -> 4: its 4th page is the scratch block (not its own
    # block 9: a real block the padding must not stand for); B: 8 real -> 2 pages, 11 -> 3;
    # C: 12 -> 3 pages either way
    assert step.block_tables == [[0, 7, 3, SCRATCH], [5, 1, SCRATCH], [20, 21, 22], [SCRATCH]]
    assert step.pending == [(4, "B")]
    assert step.sampled == host.sampled and step.draft_counts == host.draft_counts
    assert host.block_tables == tables  # not modified


def _runner(model, sizes, graphs=None, backend=None):
    runner = make_runner(model)
    runner.capture_verify_graphs(
        {Q: sizes}, graphs or RerunPieceGraphs(), backend=backend or ReplanningReference()
    )
    return runner


def test_runner_refuses_a_backend_without_verify_graphs():
    runner = make_runner(tiny_phloem_model("llama"))
    with pytest.raises(ValueError, match="cannot plan verify graphs"):
        runner.capture_verify_graphs({Q: [1, 2]}, RerunPieceGraphs(), backend=ReferenceAttention())
    with pytest.raises(ValueError, match="query_len"):
        VerifyGraphRunner(runner.model, runner.kv_caches, ReplanningReference(), BLOCK_SIZE,
                          NUM_BLOCKS, {1: [1]}, runner.device, RerunPieceGraphs())  # fmt: skip
    with pytest.raises(ValueError, match="batch_sizes"):
        VerifyGraphRunner(runner.model, runner.kv_caches, ReplanningReference(), BLOCK_SIZE,
                          NUM_BLOCKS, {Q: [2, 1]}, runner.device, RerunPieceGraphs())  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_verify_graph_steps_equal_eager(arch):
    """Five verify steps (module `verify_harness.verify_steps`): the hidden states of the rows
    the verifier reads and the KV cache outside the scratch block equal the eager step's; a
    padded step writes the scratch block; the row with k + 1 drafts takes no graph."""
    model = tiny_phloem_model(arch)
    graphs, backend = CountingGraphs(), ReplanningReference()
    runner = _runner(model, [1, 2, 4], graphs, backend)
    assert backend.plans == 3 and graphs.replays == 0  # one capture per bucket
    a, b, c = sequences(model.config.vocab_size)
    prefill(runner, [(a, 10), (b, 7), (c, 13)])
    replays = 0
    for rows in verify_steps(a, b, c):
        for cache in runner.kv_caches:
            cache[SCRATCH].zero_()
        eager, graph, eager_caches, caches, before, host = verify_both_ways(
            runner, verify_step(rows)
        )
        if any(len(d) > K for _, d, _ in rows):
            assert graph is None and graphs.replays == replays
            continue
        replays += 1
        assert graphs.replays == replays == runner.verify_runner.num_replays
        assert graph.shape == eager.shape == (len(host.logits_indices), model.config.hidden_size)
        torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
        padded = any(len(d) < K for _, d, _ in rows) or runner.verify_runner.bucket(
            len(rows)
        ) > len(rows)
        for got, want, old in zip(caches, eager_caches, before):
            torch.testing.assert_close(got[:SCRATCH], want[:SCRATCH], rtol=1e-5, atol=1e-5)
            assert padded == (not torch.equal(got[SCRATCH], old[SCRATCH]))
    assert replays == 4


def test_verify_graph_widths_equal_eager():
    """Widths 2 (buckets 1) and 3 = k (buckets 1, 2, 4): each verify step replays the
    narrowest shape that holds it and its hidden states equal the eager step's."""
    model = tiny_phloem_model("llama")
    graphs, backend = CountingGraphs(), ReplanningReference()
    runner = make_runner(model)
    runner.capture_verify_graphs({3: [1], Q: [1, 2, 4]}, graphs, backend=backend)
    assert backend.plans == 4  # one capture per (width, bucket)
    a, b, c = sequences(model.config.vocab_size)
    prefill(runner, [(a, 10), (b, 7), (c, 13)])
    verify = runner.verify_runner
    shapes = []
    for rows in verify_steps(a, b, c)[:4]:
        shapes.append(verify.shape(len(rows), 1 + max(len(d) for _, d, _ in rows)))
        eager, graph, *_ = verify_both_ways(runner, verify_step(rows))
        torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
    assert shapes == [(Q, 4), (Q, 4), (3, 1), (Q, 2)]
    assert graphs.replays == verify.num_replays == 4


def test_steps_without_a_bucket_keep_their_path():
    """Buckets 1 and 2 only: a verify step of three rows is not replayed (None)."""
    model = tiny_phloem_model("llama")
    runner = _runner(model, [1, 2])
    a, b, c = sequences(model.config.vocab_size)
    prefill(runner, [(a, 10), (b, 7), (c, 13)])
    _, graph, *_ = verify_both_ways(runner, verify_step(verify_steps(a, b, c)[0]))
    assert graph is None and runner.verify_runner.num_replays == 0
    _, graph, *_ = verify_both_ways(runner, verify_step(verify_steps(a, b, c)[2]))
    assert graph is not None and runner.verify_runner.num_replays == 1


def test_prefix_groups_worth_sharing_keep_their_path():
    """A verify step of prefix groups asks the backend (`plan_verify`, only then): the test
    double says no, then yes; the shared-prefix backend says no only where a decode step would
    leave its plain graph (2^19 saved KV tokens), not for a chat template's few blocks."""
    from phloem.ops.attention import get_attention_backend

    model = tiny_phloem_model("llama")
    backend = ReplanningReference()
    runner = _runner(model, [1, 2, 4], backend=backend)
    a, b, c = sequences(model.config.vocab_size)
    prefill(runner, [(a, 10), (b, 7), (c, 13)])
    rows = verify_steps(a, b, c)
    sched = verify_step(rows[0])
    # as if A, B and C shared their first block (host data only)
    sched.scheduled = [dataclasses.replace(s, prefix_len=4) for s in sched.scheduled]
    states = runner.input_batch.update(sched)
    host = HostStep.build(sched, states, BLOCK_SIZE, prefix_lens=True)
    assert host.prefix_lens == [4, 4, 4]
    backend.share = True
    assert runner.verify_runner.run(host) is None and backend.asked == 1
    backend.share = False
    assert runner.verify_runner.run(host) is not None and backend.asked == 2
    host.prefix_lens = [0, 0, 0]
    assert runner.verify_runner.run(host) is not None and backend.asked == 2  # not asked
    shared = get_attention_backend("shared_prefix")
    tables = [list(range(600))] * 64
    # 64 members of a 64-token prefix (a chat template): 63 x 64 KV tokens saved
    assert shared.plan_verify([Q] * 64, [64 + 40] * 64, tables, [64] * 64, 16)
    # of an 8,448-token one: 63 x 8,448 >= 2^19 saved, worth the eager path's launches
    assert not shared.plan_verify([Q] * 64, [8448 + 40] * 64, tables, [8448] * 64, 16)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, embedded_tokenizer_dir):
    from tests.engine.tiny_models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_verify", 7)


def test_greedy_engine_outputs_identical_with_verify_graphs(tiny_llama_dir):
    """An engine with n-gram drafts (k = 3, every draft verified) whose verify steps replay the
    verify graphs generates the greedy tokens it generates without them, and those of
    speculation off; its verify steps really replayed them."""
    import random

    from phloem import LLM, SamplingParams

    rng = random.Random(0)
    motifs = [[rng.randrange(3, 40000) for _ in range(rng.randint(3, 6))] for _ in range(8)]
    batch = [m * rng.randint(2, 6) for m in motifs]  # repeats: n-gram drafts to verify
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": K, "use_cost_rule": False}

    def generate(llm) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    args = dict(block_size=4, max_num_batched_tokens=32, dtype="float32",
                enable_prefix_caching=False)  # fmt: skip
    off = generate(LLM(str(tiny_llama_dir), **args))
    llm = LLM(str(tiny_llama_dir), speculative_config=spec, **args)
    eager = generate(llm)
    runner = llm.llm_engine.executor.worker.model_runner
    assert runner.verify_runner is None  # the CPU captures none
    graphs = CountingGraphs()
    runner.capture_verify_graphs({Q: [1, 2, 4, 8]}, graphs, backend=ReplanningReference())
    graphs.replays = 0
    drafter = llm.llm_engine.drafter
    verified = drafter.stats.num_spec_steps
    assert generate(llm) == eager == off
    assert drafter.stats.num_spec_steps > verified
    assert graphs.replays >= 4 and graphs.replays == runner.verify_runner.num_replays
    # several widths (`verify_graph_widths` [1, 2, 3]): the same tokens
    runner.verify_runner.release()
    runner.capture_verify_graphs({2: [1, 2, 4, 8], 3: [1, 2, 4, 8], Q: [1, 2, 4, 8]},
                                 CountingGraphs(), backend=ReplanningReference())  # fmt: skip
    assert generate(llm) == eager
    assert runner.verify_runner.num_replays >= 4
    llm.llm_engine.scheduler.check_integrity()
