"""The step's bitmask is written in place: the manager's two reused buffers (stale rows are
overwritten, unconstrained rows allow everything), the backends' fills by row index, and
xgrammar's compact JSON (the language llguidance's backend allows)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from phloem.sampling_params import StructuredOutputsParams
from phloem.structured_output.backend import bitmask_width
from phloem.structured_output.manager import NO_TOKEN_MESSAGE, StructuredOutputManager
from tests.structured_output.test_structured_output_manager import (
    VOCAB,
    CountingMatcher,
    FakeBackend,
    allowed,
)


def test_reused_buffers_are_rewritten_every_step():
    manager = StructuredOutputManager(FakeBackend(), VOCAB)
    manager.register("a", StructuredOutputsParams(regex="5"))
    manager.register("b", StructuredOutputsParams(regex="9"))
    manager.register("empty", StructuredOutputsParams(regex="none"))
    everything = list(range(VOCAB))
    first, failed = manager.bitmask(["a", "gone", "b", "gone"])
    assert failed == {}
    assert [allowed(r) for r in first.bitmask] == [[5], everything, [9], everything]
    second, _ = manager.bitmask(["b", "a"])
    assert not np.shares_memory(first.bitmask, second.bitmask)  # the previous one still reads
    assert [allowed(r) for r in first.bitmask] == [[5], everything, [9], everything]
    # the first buffer again, its stale rows (a's, everything, b's, everything) overwritten
    third, failed = manager.bitmask(["gone", "b", "empty", "a"])
    assert np.shares_memory(first.bitmask, third.bitmask)
    assert failed == {"empty": NO_TOKEN_MESSAGE}
    assert [allowed(r) for r in third.bitmask] == [everything, [9], everything, [5]]
    big, _ = manager.bitmask(["a"] * 9)  # grows
    assert big.bitmask.shape == (9, bitmask_width(VOCAB))
    assert all(allowed(r) == [5] for r in big.bitmask)
    manager.shutdown()


def _embedded_backend(tokenizer_dir, name: str):
    """(tokenizer, vocab size, the `name` grammar backend over it with 2 threads)."""
    from transformers import AutoTokenizer

    from phloem.structured_output import make_backend, tokenizer_data

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab = len(tok)
    return tok, vocab, make_backend(tokenizer_data(tok, vocab, tok.eos_token_id), 2, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_pinned_buffers_skip_the_staging_copy():
    manager = StructuredOutputManager(FakeBackend(), VOCAB, pin_memory=True)
    manager.register("a", StructuredOutputsParams(regex="5"))
    for _ in range(3):
        grammar, _ = manager.bitmask(["gone", "a"])
        host = torch.from_numpy(grammar.bitmask)
        assert host.is_pinned() and host.pin_memory().data_ptr() == host.data_ptr()
        assert [allowed(r) for r in grammar.bitmask] == [list(range(VOCAB)), [5]]
    manager.shutdown()


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_backend_fills_the_rows_it_is_given(embedded_tokenizer_dir, name):
    tok, vocab, backend = _embedded_backend(embedded_tokenizer_dir, name)
    yes = backend.matcher(backend.compile(StructuredOutputsParams(choice=["yes"])))
    no = backend.matcher(backend.compile(StructuredOutputsParams(choice=["no"])))
    bitmask = np.full((3, bitmask_width(vocab)), 7, dtype=np.int32)
    backend.fill_bitmasks([yes, no], bitmask, [2, 0])
    alone = np.zeros((2, bitmask_width(vocab)), dtype=np.int32)
    yes.fill_bitmask(alone, 0)
    no.fill_bitmask(alone, 1)
    assert (bitmask[2] == alone[0]).all() and (bitmask[0] == alone[1]).all()
    assert (bitmask[1] == 7).all()  # not given: left alone
    matchers, rows = [no, yes], [1, 2]  # the same lists twice (llguidance keeps their order)
    for _ in range(2):
        bitmask[:] = 7
        backend.fill_bitmasks(matchers, bitmask, rows)
        assert (bitmask[2] == alone[0]).all() and (bitmask[1] == alone[1]).all()
        assert (bitmask[0] == 7).all()


def test_xgrammar_json_is_compact(embedded_tokenizer_dir):
    """xgrammar without free whitespace defaults to ", " and ": "; phloem asks for compact
    separators, as llguidance's backend allows."""
    from transformers import AutoTokenizer

    from phloem.structured_output import make_backend, tokenizer_data

    tok = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir))
    vocab = len(tok)
    params = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    for name in ("xgrammar", "llguidance"):
        backend = make_backend(tokenizer_data(tok, vocab, tok.eos_token_id), name=name)
        matcher = backend.matcher(backend.compile(params))
        for ch in '{"a":':
            ids = tok.encode(ch, add_special_tokens=False)
            assert len(ids) == 1 and matcher.accept_token(ids[0]), (name, ch)
        bitmask = np.zeros((1, bitmask_width(vocab)), dtype=np.int32)
        matcher.fill_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
        space, digit = tok.encode(" ", add_special_tokens=False), tok.encode("1")
        assert not bits[space[0]] and bits[digit[0]], name


def test_accept_many_gives_accepts_results():
    """The engine advances a step's rows together; each result is `accept`'s: go on (False),
    complete (True), rejected (None), and False for sequences without a matcher yet."""
    manager = StructuredOutputManager(FakeBackend(), VOCAB)
    for seq_id, grammar in [("a", "5,6"), ("b", "5"), ("c", "5"), ("late", "5")]:
        manager.register(seq_id, StructuredOutputsParams(regex=grammar))
    manager.bitmask(["a", "b", "c"])  # "late" never sampled: no matcher yet
    pairs = [("a", 5), ("b", 5), ("c", 9), ("late", 5), ("gone", 5)]
    assert manager.accept_many(pairs) == [False, False, None, False, False]
    assert manager.accept_many([("b", 0), ("a", 6)]) == [True, False]
    assert manager.accept_many([("b", 0)]) == [True]  # complete stays complete
    assert manager.accept_many([]) == []
    manager.shutdown()


class ListRecordingBackend(FakeBackend):
    """`FakeBackend` recording the matcher lists its batched advance and fill are given."""

    def __init__(self) -> None:
        super().__init__()
        self.lists: list[list] = []

    def advance(self, matchers, token_ids):
        self.lists.append(matchers)
        return super().advance(matchers, token_ids)

    def fill_bitmasks(self, matchers, bitmask, rows):
        self.lists.append(matchers)
        super().fill_bitmasks(matchers, bitmask, rows)


def test_a_steady_batch_hands_the_same_rows_and_a_forgotten_one_drops_out():
    """While a step's ids stay the same, the backend gets the same matcher list (gathered once:
    `step_rows`), advance and fill alike; a forgotten sequence drops out of the next step (its
    matcher is not advanced), a rejected token fails its row alone, and a row whose matcher is
    made later joins."""
    backend = ListRecordingBackend()
    manager = StructuredOutputManager(backend, VOCAB)
    for seq_id in ("a", "b", "c"):
        manager.register(seq_id, StructuredOutputsParams(regex="5,6,7"))
    ids = ["a", "b"]  # "c": no matcher until its first fill
    manager.bitmask(ids)
    assert manager.accept_rows(list(ids), [5, 5]) == {}
    grammar, _ = manager.bitmask(list(ids))
    assert [allowed(r) for r in grammar.bitmask] == [[6], [6]]
    assert backend.lists[1] is backend.lists[2]  # one gathering for the advance and the fill
    b = backend.lists[1][1]
    manager.forget("b")
    assert manager.accept_rows(["a", "b"], [6, 6]) == {}
    assert b.pos == 1 and backend.lists[-1] is not backend.lists[2]  # "b" not advanced
    manager.bitmask(["a", "c"])  # "c"'s matcher made
    assert manager.accept_rows(["a", "c"], [9, 5]) == {0: None}  # "a" rejected, "c" goes on
    assert manager.accept_rows(["a", "c"], [7, 6]) == {}
    assert manager.accept_rows(["c", "a"], [7, 0]) == {1: True}  # order changed: regathered
    manager.shutdown()


def test_row_cache_drops_rows_gathered_across_a_clear():
    """The fill thread may gather while the loop forgets a sequence: what it gathered before
    that `clear` is not kept; two row sets are kept, the newest first."""
    from phloem.structured_output.step_rows import RowCache, StepRows

    cache = RowCache()
    stale = cache.generation
    cache.clear()  # a sequence forgotten meanwhile
    cache.put(StepRows(["a"], [0], ["m"]), stale)
    assert cache.get(["a"]) is None
    for ids in (["a"], ["b"], ["c"]):
        cache.put(StepRows(ids, [0], ["m"]), cache.generation)
    assert cache.get(["a"]) is None and cache.get(["b"]).seq_ids == ["b"]


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_backend_accept_tokens_advance_each_matcher(embedded_tokenizer_dir, name):
    tok, vocab, backend = _embedded_backend(embedded_tokenizer_dir, name)
    compiled = backend.compile(StructuredOutputsParams(choice=["yes", "no"]))
    yes, no = (tok.encode(w, add_special_tokens=False) for w in ("yes", "no"))
    matchers = [backend.matcher(compiled) for _ in range(3)]
    assert backend.accept_tokens(matchers, [yes[0], no[0], tok.eos_token_id]) == [
        True,
        True,
        False,
    ]
    bitmask = np.zeros((2, bitmask_width(vocab)), dtype=np.int32)
    backend.fill_bitmasks(matchers[:2], bitmask, [0, 1])
    if len(yes) > 1:
        assert allowed_bit(bitmask[0], yes[1]) and not allowed_bit(bitmask[1], yes[1])
    for matcher, rest in ((matchers[0], yes[1:]), (matchers[1], no[1:])):
        assert all(matcher.accept_token(t) for t in rest)
        assert matcher.is_terminated() or matcher.accept_token(tok.eos_token_id)
        assert matcher.is_terminated()
    # `advance`: a complete matcher stays complete (not advanced), a rejected token gives None
    assert backend.advance(matchers[:2], [yes[0], no[0]]) == [True, True]
    fresh = backend.matcher(compiled)
    assert backend.advance([fresh, matchers[0]], [tok.eos_token_id, yes[0]]) == [None, True]


def allowed_bit(row: np.ndarray, token: int) -> bool:
    return bool(np.unpackbits(row.view(np.uint8), bitorder="little")[token])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    from tests.engine.tiny_models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_fill", 5)


def test_async_steps_fill_while_outputs_are_processed(tiny_llama):
    """Under async scheduling a step's bitmask is filled in the background from the moment the
    previous step's tokens are accepted (`StructuredOutputs.collected`: the matchers advance
    on the fill thread before the scheduler's update, then the fill runs); the tokens equal those
    of synchronous scheduling, where every fill happens in `bitmask`. A fill started before
    the accepts, or on a stale step, would give other tokens or invalid JSON."""
    from phloem import LLM, SamplingParams
    from tests.engine.test_structured_outputs import NESTED, check_output, prompts

    params = [
        SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=60,
            structured_outputs=StructuredOutputsParams(json=NESTED),
        )
        for i in range(6)
    ] + [SamplingParams(temperature=0.9, seed=9, max_tokens=8, ignore_eos=True)]
    batch = [{"prompt_token_ids": p} for p in prompts(len(params))]
    tokens, early = {}, {}
    for async_scheduling in (False, True):
        llm = LLM(str(tiny_llama), block_size=4, async_scheduling=async_scheduling)
        outs = llm.generate(batch, params, use_tqdm=False)
        tokens[async_scheduling] = [o.outputs[0].token_ids for o in outs]
        early[async_scheduling] = llm.llm_engine.structured.num_early_fills
        for out in outs[:6]:
            assert out.outputs[0].finish_reason == "stop"
            check_output("json", NESTED, out.outputs[0].text)
    assert tokens[True] == tokens[False]
    assert early[False] == 0 and early[True] > 10


def test_llguidance_extra_slices_give_the_same_masks(embedded_tokenizer_dir):
    """The backend's slices (a JSON string of every remaining length from 3 to 10) change how a mask
    is computed, never what it is: masks inside and around strings with maxLength, and an
    unbounded one, equal those of llguidance's default slices along sampled walks."""
    import llguidance as llg
    import llguidance.hf
    from llguidance.numpy import fill_next_token_bitmask_par

    from phloem.structured_output.llguidance_backend import SLICES, grammar_text

    tok, vocab, backend = _embedded_backend(embedded_tokenizer_dir, "llguidance")
    default = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=[tok.eos_token_id])
    assert set(llg.LLTokenizer.general_slices()) < set(SLICES)
    schema = {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "string", "maxLength": 7}, "minItems": 6},
        "b": {"type": "string", "maxLength": 13}, "c": {"type": "string"}},
        "required": ["a", "b", "c"]}  # fmt: skip
    grammar = grammar_text(StructuredOutputsParams(json=schema))
    rows, executor = 6, llg.LLExecutor(1)
    ours = [llg.LLMatcher(backend.tokenizer, grammar) for _ in range(rows)]
    theirs = [llg.LLMatcher(default, grammar) for _ in range(rows)]
    masks = np.zeros((2, rows, bitmask_width(vocab)), dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(60):
        for k, matchers in enumerate((ours, theirs)):
            fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in enumerate(matchers)], masks[k]
            )
        assert (masks[0] == masks[1]).all()
        for i in range(rows):
            allowed = np.flatnonzero(
                np.unpackbits(masks[0, i].view(np.uint8), bitorder="little")[:vocab]
            )
            token = int(rng.choice(allowed))
            assert ours[i].consume_token(token) and theirs[i].consume_token(token)


def test_rows_allowing_only_late_tokens_are_not_empty():
    """The no-token check reads a row whole only when none of its first 256 tokens is allowed:
    a row allowing one token past them is not failed, an empty one is (`empty_rows` equals the
    plain check on sparse random rows)."""
    from phloem.structured_output.manager import empty_rows

    vocab = 1000  # 32 words: past the 8 read first
    manager = StructuredOutputManager(FakeBackend(), vocab)
    for seq_id, grammar in [("late", "900"), ("empty", "none"), ("early", "3")]:
        manager.register(seq_id, StructuredOutputsParams(regex=grammar))
    grammar, failed = manager.bitmask(["late", "empty", "early"])
    assert failed == {"empty": NO_TOKEN_MESSAGE}
    bits = np.unpackbits(grammar.bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    assert [np.flatnonzero(r).tolist() for r in bits[[0, 2]]] == [[900], [3]]
    assert bits[1].all()  # failed: unconstrained
    manager.shutdown()
    rng = np.random.default_rng(0)
    rows = np.zeros((64, 40), dtype=np.int32)
    hits = rng.integers(0, rows.size, 40)
    rows.flat[hits] = rng.integers(1, 1 << 30, 40)
    assert empty_rows(rows).tolist() == np.flatnonzero(~rows.any(axis=1)).tolist()


class _Matcher(CountingMatcher):
    """Records the threads that asked whether it terminated."""

    threads: list[str] = []

    def is_terminated(self):
        _Matcher.threads.append(threading.current_thread().name)
        return super().is_terminated()


class _Backend(FakeBackend):
    def matcher(self, compiled):
        return _Matcher(list(compiled))


class _Scheduler:
    """What `StructuredOutputs` reads of the scheduler here."""

    requests: dict = {}
    running: list = []
    waiting: list = []

    def fail_request(self, request, message):
        raise AssertionError(message)

    def finish_request(self, request, status):
        request.is_finished = True


def test_advance_hands_the_next_fill_to_the_fill_thread():
    """Under async scheduling the matchers' advance by a step's tokens and the next step's fill
    run on the fill thread: handed over by `collected` (the tokens just collected; `advance`
    applies the advance's results: a complete grammar finishes its request) or, without
    `collected`, by `advance` (the matchers advanced on the loop); `bitmask` takes the fill's
    result, and the hand-over's lag is counted."""
    from types import SimpleNamespace

    from phloem.core.scheduler_output import ScheduledSequence, SchedulerOutput
    from phloem.engine.structured_outputs import StructuredOutputs

    hooks = StructuredOutputs(_Scheduler(), None, None, VOCAB)  # type: ignore[arg-type]
    hooks.manager = StructuredOutputManager(_Backend(), VOCAB)
    ids = ["a", "b"]
    for seq_id in ids:
        hooks.manager.register(seq_id, StructuredOutputsParams(regex="5,6,7"))
    requests = [SimpleNamespace(request_id=i, output_token_ids=[], is_finished=False) for i in ids]

    def step(num: int) -> SchedulerOutput:
        sched = SchedulerOutput([ScheduledSequence(i, num, 1, True) for i in ids])
        hooks.mark(sched)
        return sched

    sched = step(0)
    hooks.bitmask(sched)  # the first step's fill, on the loop
    walk = [(5, False, [6]), (6, True, [7]), (7, True, [0]), (0, True, list(range(VOCAB)))]
    for num, (token, early, expected) in enumerate(walk, start=1):  # 0 completes: unconstrained
        collected, sched = sched, step(num)
        for request in requests:
            request.output_token_ids.append(token)
        _Matcher.threads.clear()
        if early:
            hooks.collected(collected, dict.fromkeys(ids, token))
        hooks.advance(requests)  # type: ignore[arg-type]
        grammar = hooks.bitmask(sched)
        assert "phloem-grammar-fill" in " ".join(_Matcher.threads), _Matcher.threads
        assert ("MainThread" in _Matcher.threads) is not early  # the advance's is_terminated
        assert [allowed(r) for r in grammar.bitmask] == [expected] * 2
    assert all(r.is_finished for r in requests)
    assert hooks.num_early_fills == 4 and hooks.times.fill_lag_s > 0
    hooks.close()
