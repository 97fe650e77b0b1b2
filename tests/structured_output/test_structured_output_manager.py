"""The structured-output manager over a fake backend (compile cache, matchers per sequence,
bitmask rows, failures), the xgrammar backend's matcher (rollback, termination), and the
sampler's bitmask against a plain reference."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from phloem.layers.sampler import Sampler, SamplingRow
from phloem.ops.token_bitmask import apply_token_bitmask_
from phloem.sampling_params import SamplingParams, StructuredOutputsParams
from phloem.structured_output.backend import GrammarBackend, GrammarMatcher, bitmask_width
from phloem.structured_output.manager import NO_TOKEN_MESSAGE, StructuredOutputManager

VOCAB = 70  # not a multiple of 32: the last word is partial


class CountingMatcher(GrammarMatcher):
    """Allows exactly the tokens of its grammar, in order, then terminates on token 0."""

    def __init__(self, sequence: list[int]) -> None:
        self.sequence, self.pos = sequence + [0], 0

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        if self.pos < len(self.sequence):
            t = self.sequence[self.pos]
            bitmask[row, t // 32] = np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def accept_token(self, token_id):
        if self.pos >= len(self.sequence) or token_id != self.sequence[self.pos]:
            return False
        self.pos += 1
        return True

    def rollback(self, num_tokens):
        self.pos -= num_tokens

    def is_terminated(self):
        return self.pos == len(self.sequence)


class FakeBackend(GrammarBackend):
    """Grammar = the regex field read as comma-separated token ids ("" = nothing allowed)."""

    name = "fake"

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.lock = threading.Lock()

    def validate(self, params):
        pass

    def compile(self, params):
        with self.lock:
            self.compiled.append(params.regex)
        if params.regex == "fail":
            raise ValueError("structured_outputs.regex does not compile")
        return [int(t) for t in params.regex.split(",")] if params.regex != "none" else []

    def matcher(self, compiled):
        return CountingMatcher(list(compiled)) if compiled else EmptyMatcher([])


class EmptyMatcher(CountingMatcher):
    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0


def allowed(row: np.ndarray) -> list[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]
    return np.flatnonzero(bits).tolist()


def test_one_compilation_per_constraint_and_own_matchers():
    backend = FakeBackend()
    manager = StructuredOutputManager(backend, VOCAB)
    for i in range(5):  # one schema for the whole batch; n > 1 siblings are sequences too
        manager.register(f"r{i}", StructuredOutputsParams(regex="5,66,7"))
    manager.register("other", StructuredOutputsParams(regex="9"))
    grammar, failed = manager.bitmask(["r0", "r1", "gone", "other"])
    assert failed == {} and backend.compiled.count("5,66,7") == 1 and manager.num_compiled == 2
    assert grammar.seq_ids == ["r0", "r1", "gone", "other"]
    assert grammar.bitmask.shape == (4, bitmask_width(VOCAB)) == (4, 3)
    assert allowed(grammar.bitmask[0]) == [5] == allowed(grammar.bitmask[1])
    assert allowed(grammar.bitmask[2]) == list(range(VOCAB))  # unknown: unconstrained
    assert allowed(grammar.bitmask[3]) == [9]
    assert manager.accept("r0", 5) is False and manager.accept("r0", 66) is False
    assert allowed(manager.bitmask(["r0", "r1"])[0].bitmask[0]) == [7]  # r1 did not move
    assert manager.accept("r0", 3) is None  # rejected
    manager.rollback("r0", 1)
    assert allowed(manager.bitmask(["r0"])[0].bitmask[0]) == [66]
    assert manager.accept("r0", 66) is False and manager.accept("r0", 7) is False
    assert manager.accept("r0", 0) is True  # the stop token: complete
    manager.forget("r0")
    assert not manager.is_constrained("r0") and manager.num_live == 5
    manager.shutdown()


def test_failures_are_per_sequence():
    manager = StructuredOutputManager(FakeBackend(), VOCAB)
    manager.register("bad", StructuredOutputsParams(regex="fail"))
    manager.register("empty", StructuredOutputsParams(regex="none"))
    manager.register("ok", StructuredOutputsParams(regex="3"))
    grammar, failed = manager.bitmask(["bad", "empty", "ok"])
    assert "does not compile" in failed["bad"] and failed["empty"] == NO_TOKEN_MESSAGE
    assert allowed(grammar.bitmask[0]) == allowed(grammar.bitmask[1]) == list(range(VOCAB))
    assert allowed(grammar.bitmask[2]) == [3]
    manager.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_token_bitmask_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=gen).to(dtype)
    keep = torch.rand(3, VOCAB, generator=gen) < 0.3
    bitmask = np.zeros((3, bitmask_width(VOCAB)), dtype=np.int32)
    for r in range(3):
        for t in keep[r].nonzero().flatten().tolist():
            bitmask[r, t // 32] |= np.uint32(1 << (t % 32)).view(np.int32)
    rows = torch.tensor([4, 0, 2])
    out = apply_token_bitmask_(logits.clone(), torch.from_numpy(bitmask), rows)
    expected = logits.clone()
    for r, row in enumerate(rows.tolist()):
        expected[row] = logits[row].masked_fill(~keep[r], float("-inf"))
    assert torch.equal(out, expected)


def test_sampler_samples_only_allowed_tokens_and_flags_no_row():
    logits = torch.randn(4, VOCAB)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=1), [1], [], None),
        SamplingRow(SamplingParams(temperature=1.0), [1], [], torch.Generator().manual_seed(1)),
        SamplingRow(SamplingParams(temperature=0.0), [1], [], None),
        SamplingRow(SamplingParams(temperature=1.0, top_k=3), [1], [], None),
    ]
    bitmask = np.zeros((3, bitmask_width(VOCAB)), dtype=np.int32)
    bitmask[0, 2] = 1 << 1  # token 65
    bitmask[1, 0] = (1 << 3) | (1 << 9)  # tokens 3, 9
    bitmask[2, 1] = 1 << 0  # token 32
    grammar = (torch.from_numpy(bitmask), torch.tensor([0, 1, 3]))
    out = Sampler(seed=0).launch(logits, rows, grammar).result()
    assert out.token_ids[0] == 65 and out.token_ids[1] in (3, 9) and out.token_ids[3] == 32
    assert out.token_ids[2] == int(logits[2].argmax())  # unconstrained row untouched
    assert out.num_nonfinite == [0, 0, 0, 0]  # -inf from the mask is not a model fault
    assert out.logprobs[0] == pytest.approx(0.0)  # the only allowed token


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_backend_walk_rollback_and_termination(embedded_tokenizer_dir, name):
    from transformers import AutoTokenizer

    from phloem.structured_output import make_backend, tokenizer_data

    tok = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir))
    vocab = len(tok)
    backend = make_backend(tokenizer_data(tok, vocab, tok.eos_token_id), name=name)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(choice=["yes", "no"])))
    ids = tok.encode("yes", add_special_tokens=False)
    no = tok.encode("no", add_special_tokens=False)
    bitmask = np.zeros((1, bitmask_width(vocab)), dtype=np.int32)
    matcher.fill_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
    assert bits[ids[0]] and bits[no[0]] and not bits[tok.eos_token_id]  # EOS only at the end
    assert not matcher.accept_token(tok.encode("maybe", add_special_tokens=False)[0])
    for t in ids:  # a rejected token changed nothing
        assert matcher.accept_token(t)
    assert not matcher.accept_token(ids[0])  # nothing but the stop token after "yes"
    matcher.rollback(len(ids))
    assert matcher.accept_token(no[0])
    matcher.rollback(1)
    for t in ids:
        assert matcher.accept_token(t)
    if not matcher.is_terminated():  # xgrammar ends on the stop token, llguidance before it
        assert matcher.accept_token(tok.eos_token_id)
    assert matcher.is_terminated()


def _llguidance_manager(tokenizer_dir, templates_per_thread: int):
    """(tokenizer, manager over llguidance with 2 threads and these templates)."""
    from transformers import AutoTokenizer

    from phloem.structured_output import tokenizer_data
    from phloem.structured_output.llguidance_backend import LLGuidanceBackend

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    data = tokenizer_data(tok, len(tok), tok.eos_token_id)
    backend = LLGuidanceBackend(data, num_threads=2, templates_per_thread=templates_per_thread)
    return tok, StructuredOutputManager(backend, len(tok), num_compile_threads=2)


STRINGS = {"type": "object", "properties": {
    "a": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 3},
    "b": {"type": "integer"}}, "required": ["a", "b"]}  # fmt: skip


def test_llguidance_sequences_of_one_constraint_copy_a_few_templates(embedded_tokenizer_dir):
    """Under one schema the first sequence gets the compile's matcher, the other 8 copies of
    2 x 2 templates, round robin (each built once, copied twice): their lexers are shared, their positions
    not (one advanced leaves its siblings at the start). Once every template is built, a new
    sequence's matcher is made when it is registered."""
    tok, manager = _llguidance_manager(embedded_tokenizer_dir, templates_per_thread=2)
    params = StructuredOutputsParams(json=STRINGS)
    ids = [f"s{i}" for i in range(9)]
    for seq_id in ids:
        manager.register(seq_id, params)
    assert manager.wait_ready(ids, timeout=30)
    start, failed = manager.bitmask(ids)
    assert failed == {} and manager.num_compiled == 1
    assert all((row == start.bitmask[0]).all() for row in start.bitmask)
    matchers = [manager._sequences[i].matcher for i in ids]
    assert len({id(m.inner) for m in matchers}) == 9
    assert len({m.group for m in matchers}) == 5  # the compile's own, and 4 templates
    grammar = manager._compiled[params.key()].result()
    assert grammar.num_built == 4
    sibling = next(i for i in range(2, 9) if matchers[i].group == matchers[1].group)
    first = tok.encode('{"a":["x', add_special_tokens=False)[0]
    assert manager.accept("s1", first) is False  # its sibling is still at the start
    assert (manager.bitmask([ids[sibling]])[0].bitmask[0] == start.bitmask[0]).all()
    manager.register("late", params)
    assert manager.is_ready("late") and manager.stats.num_ready_at_once == 1
    manager.shutdown()


def test_llguidance_copies_walk_as_matchers_built_apart(embedded_tokenizer_dir):
    """Exactness of the copies and of the batched calls' row order: 9 sequences under one
    schema (copies of 2 templates, rows of one template not together) and the same sequences
    with every matcher built apart, advanced by the same sampled tokens (`accept_many`), give
    the same masks bit for bit at every step (`bitmask`, rows in a shuffled order)."""
    rng = np.random.default_rng(0)
    params = StructuredOutputsParams(json=STRINGS)
    managers = []
    for templates in (1, 0):
        tok, manager = _llguidance_manager(embedded_tokenizer_dir, templates)
        ids = [f"s{i}" for i in range(9)]
        for seq_id in ids:
            manager.register(seq_id, params)
        assert manager.wait_ready(ids, timeout=30)
        managers.append(manager)
    copies, apart = managers
    groups = [{m._matcher(m._sequences[i]).group for i in ids} for m in managers]
    assert [len(g) for g in groups] == [3, 9]  # the compile's own and 2 templates; 9 apart
    live = list(ids)
    for _ in range(40):
        order = [live[i] for i in rng.permutation(len(live))]
        masks = [m.bitmask(order)[0].bitmask.copy() for m in managers]
        assert (masks[0] == masks[1]).all()
        tokens = []
        for row in masks[0]:
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: len(tok)]
            bits[tok.eos_token_id] = 0
            tokens.append(int(rng.choice(np.flatnonzero(bits))))
        pairs = list(zip(order, tokens))
        done = [m.accept_many(pairs) for m in managers]
        assert done[0] == done[1] and None not in done[0]
        live = [seq_id for seq_id, end in zip(order, done[0]) if not end]
        if not live:
            break
    for manager in managers:
        manager.shutdown()


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 1), (4, 2), (16, 14), (64, 16)])
def test_grammar_threads_take_all_cpus_but_two(monkeypatch, cpus, threads):
    from phloem.engine import structured_outputs

    monkeypatch.setattr(structured_outputs.os, "cpu_count", lambda: cpus)
    assert structured_outputs.default_num_threads() == threads
