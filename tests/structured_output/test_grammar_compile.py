"""Compiling grammars: once per distinct constraint, the compile's own matcher handed to the
constraint's first sequence, a bounded cache, the manager's counters, and readiness (a sequence
whose grammar is still compiling is not ready; waiting for it is counted)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from phloem.sampling_params import StructuredOutputsParams
from phloem.structured_output.backend import GrammarBackend, bitmask_width
from phloem.structured_output.manager import StructuredOutputManager
from tests.structured_output.test_structured_output_manager import (
    VOCAB,
    CountingMatcher,
    FakeBackend,
    allowed,
)


class SlowBackend(FakeBackend):
    """FakeBackend whose "slow" constraints compile only once `release` is set, and which
    counts the matchers it builds apart from a compile."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.num_matchers = 0

    def compile(self, params):
        if params.regex.startswith("slow"):
            assert self.release.wait(10)
            params = StructuredOutputsParams(regex=params.regex.split(":")[1])
        return super().compile(params)

    def matcher(self, compiled):
        with self.lock:
            self.num_matchers += 1
        return super().matcher(compiled)

    def compile_with_matcher(self, params):
        compiled = self.compile(params)
        return compiled, CountingMatcher(list(compiled))  # the "check" matcher, handed out


def test_distinct_constraints_compile_once_and_give_their_first_matcher():
    backend = SlowBackend()
    manager = StructuredOutputManager(backend, VOCAB, num_compile_threads=2)
    ids = []
    for i in range(6):  # three distinct constraints, two sequences each
        ids.append(f"s{i}")
        manager.register(ids[-1], StructuredOutputsParams(regex=str(3 + i % 3)))
    grammar, failed = manager.bitmask(ids)
    assert failed == {} and [allowed(r) for r in grammar.bitmask] == [[3], [4], [5]] * 2
    assert sorted(backend.compiled) == ["3", "4", "5"] and manager.num_compiled == 3
    assert backend.num_matchers == 3  # the second sequence of each; the first got the compile's
    stats = manager.stats
    assert stats.num_sequences == 6 and stats.num_rows_waited <= 6
    assert 0 <= stats.max_ready_lag_s and stats.ready_lag_s >= stats.max_ready_lag_s
    manager.shutdown()


def test_compile_cache_is_bounded():
    backend = SlowBackend()
    manager = StructuredOutputManager(backend, VOCAB, num_compile_threads=1, max_cached=2)
    for i, regex in enumerate(["1", "2", "1", "3", "2", "1"]):
        manager.register(f"s{i}", StructuredOutputsParams(regex=regex))
    grammar, failed = manager.bitmask([f"s{i}" for i in range(6)])
    assert failed == {} and [allowed(r) for r in grammar.bitmask] == [[1], [2], [1], [3], [2], [1]]
    # "1" was used again before "3" came, so "2" went out first; then "1" went out for "2"
    assert backend.compiled == ["1", "2", "3", "2", "1"] and manager.num_compiled == 5
    manager.shutdown()


def test_readiness_and_waits_are_per_sequence():
    backend = SlowBackend()
    manager = StructuredOutputManager(backend, VOCAB, num_compile_threads=2)
    manager.register("slow", StructuredOutputsParams(regex="slow:7"))
    manager.register("fast", StructuredOutputsParams(regex="8"))
    assert manager.wait_ready(["fast"], timeout=10) and manager.is_ready("fast")
    assert manager.is_ready("unconstrained") and not manager.is_ready("slow")
    assert not manager.wait_ready(["slow", "fast"], timeout=0.01)
    grammar, failed = manager.bitmask(["fast"])  # the slow grammar holds no one else up
    assert failed == {} and allowed(grammar.bitmask[0]) == [8]
    assert manager.stats.num_rows_waited == 0
    threading.Timer(0.05, backend.release.set).start()
    grammar, failed = manager.bitmask(["slow", "fast"])  # waits: counted
    assert failed == {} and [allowed(r) for r in grammar.bitmask] == [[7], [8]]
    assert manager.stats.num_rows_waited == 1 and manager.stats.wait_s > 0
    assert manager.is_ready("slow")
    manager.shutdown()


class ThreadRecordingBackend(SlowBackend):
    """SlowBackend that records the thread of every matcher it builds."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def matcher(self, compiled):
        self.threads.append(threading.get_ident())
        return super().matcher(compiled)


def test_sequences_of_a_compiling_constraint_queue_for_one_task():
    """Sequences registered while their constraint compiles are not a pool task each (each
    task's GIL hand-overs cost more than a cheap matcher): one task per 64 makes their matchers, in
    order, after the compile; a sequence registered once it compiled is made at once when the
    backend can (`ready_matcher`), else queued the same way; a failed compile fails the queue."""
    backend = ThreadRecordingBackend()
    manager = StructuredOutputManager(backend, VOCAB, num_compile_threads=4)
    ids = [f"s{i}" for i in range(40)]
    for seq_id in ids:
        manager.register(seq_id, StructuredOutputsParams(regex="slow:5"))
    assert not manager.wait_ready(ids[1:], timeout=0.05)
    backend.release.set()
    assert manager.wait_ready(ids, timeout=10)
    assert backend.num_matchers == 39 and len(set(backend.threads)) == 1
    grammar, failed = manager.bitmask(ids)
    assert failed == {} and all(allowed(r) == [5] for r in grammar.bitmask)
    manager.register("late", StructuredOutputsParams(regex="slow:5"))
    assert manager.wait_ready(["late"], timeout=10) and backend.num_matchers == 40
    for i in range(3):
        manager.register(f"f{i}", StructuredOutputsParams(regex="fail"))
    assert manager.wait_ready(["f0", "f1", "f2"], timeout=10)
    _, failed = manager.bitmask(["f0", "f1", "f2"])
    assert sorted(failed) == ["f0", "f1", "f2"]
    assert manager.stats.num_ready_at_once == 0  # FakeBackend has no cheap matchers
    manager.shutdown()


def test_a_failed_compile_fails_every_sequence_of_its_constraint():
    backend = SlowBackend()
    manager = StructuredOutputManager(backend, VOCAB)
    manager.register("a", StructuredOutputsParams(regex="fail"))
    manager.register("b", StructuredOutputsParams(regex="fail"))
    assert manager.wait_ready(["a", "b"], timeout=10)
    grammar, failed = manager.bitmask(["a", "b"])
    assert set(failed) == {"a", "b"} and "does not compile" in failed["b"]
    assert backend.compiled == ["fail"]
    assert grammar.bitmask.shape == (2, bitmask_width(VOCAB)) and (grammar.bitmask == -1).all()
    manager.shutdown()


def test_llguidance_first_matcher_is_the_compile_check(embedded_tokenizer_dir):
    """A distinct schema costs one llguidance grammar build: the matcher that checks the
    compile is the first sequence's, at the start of the grammar."""
    from transformers import AutoTokenizer

    from phloem.structured_output import make_backend, tokenizer_data

    tok = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir))
    backend = make_backend(tokenizer_data(tok, len(tok), tok.eos_token_id), name="llguidance")
    params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})  # fmt: skip
    grammar, first = backend.compile_with_matcher(params)
    assert grammar.text == backend.compile(params).text
    assert grammar.num_built == 0  # the check is the first sequence's, no template kept
    masks = np.zeros((2, bitmask_width(len(tok))), dtype=np.int32)
    first.fill_bitmask(masks, 0)
    backend.matcher(grammar).fill_bitmask(masks, 1)
    assert (masks[0] == masks[1]).all() and masks[0].any()


class HeldBackend(GrammarBackend):
    """A real backend whose regex constraints compile only once `release` is set."""

    name = "held"

    def __init__(self, inner: GrammarBackend) -> None:
        self.inner, self.release, self.timed_out = inner, threading.Event(), False

    def validate(self, params):
        self.inner.validate(params)

    def compile(self, params):
        if params.kind == "regex" and not self.release.wait(20):
            self.timed_out = True
        return self.inner.compile(params)

    def matcher(self, compiled):
        return self.inner.matcher(compiled)

    def accept_tokens(self, matchers, token_ids):
        return self.inner.accept_tokens(matchers, token_ids)

    def fill_bitmasks(self, matchers, bitmask, rows):
        self.inner.fill_bitmasks(matchers, bitmask, rows)


def held_backends(monkeypatch) -> list[HeldBackend]:
    """Make every grammar backend the engine builds a `HeldBackend` (its compiles wait for
    `release`); returns the list they are appended to, in order."""
    import phloem.structured_output as so

    held: list[HeldBackend] = []
    make = so.make_backend

    def make_held(*args, **kwargs):
        held.append(HeldBackend(make(*args, **kwargs)))
        return held[-1]

    monkeypatch.setattr(so, "make_backend", make_held)
    return held


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    from tests.engine.tiny_models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_held", 5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_still_compiling_holds_up_no_other_request(
    tiny_llama, monkeypatch, async_scheduling
):
    """A request whose grammar is slow to compile waits in the queue (the scheduler's admission
    gate) while the others run to the end; no step waits for it. Without the gate its first
    sample would block every row of its step until the compile ends."""
    from phloem import LLM, SamplingParams
    from tests.engine.test_structured_outputs import CHOICE, REGEX, check_output, prompts

    held = held_backends(monkeypatch)
    llm = LLM(str(tiny_llama), block_size=4, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    slow, fast, free = prompts(3)
    choice = StructuredOutputsParams(choice=CHOICE)
    engine.add_request(fast, SamplingParams(max_tokens=20, structured_outputs=choice), "fast")
    engine.add_request(free, SamplingParams(max_tokens=6, ignore_eos=True), "free")
    regex = StructuredOutputsParams(regex=REGEX)
    engine.add_request(slow, SamplingParams(max_tokens=20, structured_outputs=regex), "slow")
    outputs: dict = {}
    while not {"fast", "free"} <= outputs.keys():
        outputs.update((o.request_id, o) for o in engine.step())
    request = engine.scheduler.requests["slow"]
    assert "slow" not in outputs and request.num_computed_tokens == 0
    manager = engine.structured.manager
    assert engine.structured.num_held > 0 and manager.stats.num_rows_waited == 0
    check_output("choice", CHOICE, outputs["fast"].outputs[0].text)
    held[0].release.set()
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    assert outputs["slow"].outputs[0].finish_reason == "stop" and not held[0].timed_out
    check_output("regex", REGEX, outputs["slow"].outputs[0].text)
    assert manager.num_live == 0
    engine.scheduler.check_integrity()
    llm.close()


def test_a_batch_is_validated_on_threads_once_per_distinct_constraint():
    """`validate_constraints` caches a verdict per distinct constraint of a batch (checked on
    threads), so the requests' own checks read them; a bad one still raises, naming its field."""
    import phloem.structured_output as so
    from phloem import SamplingParams

    schemas = [{"type": "object", "properties": {f"k{i}_{id(so)}": {"type": "integer"}}}
               for i in range(3)]  # fmt: skip
    bad = StructuredOutputsParams(regex="[unclosed")
    shared = StructuredOutputsParams(json=schemas[0])
    batch = [SamplingParams(structured_outputs=StructuredOutputsParams(json=s)) for s in schemas]
    batch += [SamplingParams(structured_outputs=shared)] * 2 + [SamplingParams(), {"n": 1}]
    batch.append(SamplingParams(structured_outputs=bad))
    so.validate_constraints(batch, num_threads=2)
    keys = {("llguidance", StructuredOutputsParams(json=s).key()) for s in schemas}
    assert keys <= so._VERDICTS.keys() and all(so._VERDICTS[k] is None for k in keys)
    assert "structured_outputs.regex" in so._VERDICTS[("llguidance", bad.key())]
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        so.validate_constraint(bad)
    assert shared.key() is shared.key()  # computed once per constraint object


def test_an_idle_engine_waits_for_every_held_grammar(tiny_llama, monkeypatch):
    """With nothing running and every request held for its grammar, the empty step waits until
    all of their grammars are ready (not just the first), so the batch's first prefill step
    takes them together."""
    import phloem.engine.structured_outputs as engine_so
    from phloem import LLM, SamplingParams
    from tests.engine.test_structured_outputs import prompts

    held = held_backends(monkeypatch)
    monkeypatch.setattr(engine_so, "_IDLE_WAIT_S", 20.0)  # the wait ends when all are ready
    llm = LLM(str(tiny_llama), block_size=4)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts(4)):  # no shared prefix: admitted as one group
        prompt = prompt[20:] + [3 + i]
        regex = StructuredOutputsParams(regex=f"[a-z]{{{i + 1}}}")  # four distinct grammars
        engine.add_request(prompt, SamplingParams(max_tokens=8, structured_outputs=regex))
    rows: list[int] = []
    engine.add_step_observer(lambda record: rows.append(len(record.scheduler_output.scheduled)))
    threading.Timer(0.05, held[0].release.set).start()
    while engine.has_unfinished_requests():
        engine.step()
    assert rows[0] == 4 and engine.structured.num_held >= 4 and not held[0].timed_out
    llm.close()
