"""Structured outputs end to end: a batch mixing JSON schemas, a regex, a choice and
unconstrained requests, greedy and seeded sampling, n > 1, async and synchronous scheduling,
prefix sharing and preemption. Every constrained output parses and validates (`jsonschema`),
matches its regex or is one of its choices, and finishes "stop"; the unconstrained outputs equal
those of a run without constrained requests. Aborts, and faults of a whole step, beside a step
held for its bitmask (async scheduling) leave the engine consistent."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from phloem import LLM, SamplingParams
from phloem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from phloem.engine.executor import UniProcExecutor
from phloem.engine.llm_engine import LLMEngine
from phloem.sampling_params import StructuredOutputsParams
from tests.engine.tiny_models import VOCAB, tiny_model_dir

# held-out schemas: never used while building the feature
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "user": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "active": {"type": "boolean"},
            },
            "required": ["name", "active"],
        },
    },
    "required": ["id", "user"],
}
LABELS = {
    "type": "object",
    "properties": {
        "labels": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "level": {"enum": [1, 2, 3]},
        "ok": {"type": "boolean"},
    },
    "required": ["labels", "level", "ok"],
}
NUMBERS = {
    "type": "array",
    "items": {"type": "integer", "minimum": -5, "maximum": 5},
    "maxItems": 4,
}
REGEX = r"[A-Z]{2}-\d{3}"
CHOICE = ["positive", "negative", "neutral"]


def constraint_cases() -> list[tuple[str, object, StructuredOutputsParams]]:
    return [
        ("json", NESTED, StructuredOutputsParams(json=NESTED)),
        ("json", LABELS, StructuredOutputsParams(json=json.dumps(LABELS))),  # as JSON text
        ("json", NUMBERS, StructuredOutputsParams(json=NUMBERS)),
        ("regex", REGEX, StructuredOutputsParams(regex=REGEX)),
        ("choice", CHOICE, StructuredOutputsParams(choice=CHOICE)),
        ("json_object", None, StructuredOutputsParams(json_object=True)),
    ]


def check_output(kind: str, spec, text: str) -> None:
    """Assert `text` satisfies the constraint."""
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    else:
        assert text in spec, text


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_so", 5)


def prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(20)]  # a shared prefix
    return [
        system + [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 9))] for _ in range(num)
    ]


def mixed_batch(sampled: bool):
    """(prompts, params, cases): per constraint two requests, plus four unconstrained ones
    (indices -4..-1). Sampled batches leave out json_object: its keys and strings have no
    length bound, which a random-weight model sampling freely need not reach in any budget."""
    cases = [c for c in constraint_cases() for _ in range(2)]
    if sampled:
        cases = [c for c in cases if c[0] != "json_object"]
    params = [
        SamplingParams(
            temperature=0.8 if sampled else 0.0,
            seed=100 + i if sampled else None,
            max_tokens=60,
            structured_outputs=c[2],
        )
        for i, c in enumerate(cases)
    ]
    free = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=1.0, seed=11, top_p=0.9, max_tokens=6),
    ]
    return prompts(len(params) + len(free)), params + free, cases


def generate(llm, batch, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    llm.llm_engine.scheduler.check_integrity()
    assert not llm.llm_engine.has_unfinished_requests()
    return outs


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("sampled", [False, True])
def test_mixed_batch_every_output_valid(tiny_llama, async_scheduling, sampled):
    llm = LLM(
        str(tiny_llama), block_size=4, max_num_batched_tokens=32, async_scheduling=async_scheduling
    )
    batch, params, cases = mixed_batch(sampled)
    outs = generate(llm, batch, params)
    for (kind, spec, _), out in zip(cases, outs):
        completion = out.outputs[0]
        assert out.error is None
        assert completion.finish_reason == "stop", (kind, completion.text)
        check_output(kind, spec, completion.text)
    free = len(cases)
    alone = generate(llm, batch[free:], params[free:])
    assert [o.outputs[0].token_ids for o in outs[free:]] == [o.outputs[0].token_ids for o in alone]
    manager = llm.llm_engine.structured.manager
    assert manager.num_compiled == len({c[2].key() for c in cases})  # once per constraint
    assert manager.num_live == 0  # every matcher forgotten
    times = llm.llm_engine.structured.times  # the loop's structured-output work was timed
    assert times.num_bitmasks > 0 and times.fill_s > 0 and times.advance_s > 0
    assert times.mark_s > 0 and (times.fill_wait_s > 0) == async_scheduling  # early fills
    handed = (times.handover_s, times.advance_wait_s, times.advanced_s)  # the thread's advance
    assert all(t > 0 for t in handed) == async_scheduling == any(t > 0 for t in handed)
    assert times.handover_s + times.advance_wait_s <= times.advance_s + 1e-9


def test_n_samples_preemption_and_prefix_sharing(tiny_llama):
    """n = 3 seeded samples walk their own matchers; a pool too small for the batch preempts
    requests mid-grammar; async equals sync."""
    params = SamplingParams(
        n=3, temperature=1.0, seed=3, max_tokens=60, structured_outputs={"json": NESTED}
    )
    common = dict(
        block_size=4,
        max_num_batched_tokens=32,
        num_gpu_blocks=40,
        memory_centric_admission=False,
    )
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(tiny_llama), async_scheduling=async_scheduling, **common)
        outs = generate(llm, prompts(6, seed=1), params)
        assert llm.llm_engine.scheduler.num_preemptions > 0
        for out in outs:
            assert len(out.outputs) == 3
            for c in out.outputs:
                assert c.finish_reason == "stop"
                check_output("json", NESTED, c.text)
        results.append([[c.token_ids for c in o.outputs] for o in outs])
    assert results[0] == results[1]
    assert len({tuple(t) for o in results[0] for t in o}) > 1  # the samples differ


def test_embedded_model_mixed_batch(embedded_llm):
    """The embedded model (SmolLM2-135M): three held-out schemas, a regex and a choice, greedy
    and seeded, beside unconstrained requests whose outputs equal a run without the others."""
    texts = ["Describe a user account as JSON.", "Classify this sentence: I love it.",
             "List some small numbers.", "Give a code like AB-123.", "How does this sound?"]  # fmt: skip
    cases = constraint_cases()[:5]
    params, expected = [], []
    for temperature, seed in ((0.0, None), (0.7, 21)):
        for kind, spec, constraint in cases:
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=80,
                                         structured_outputs=constraint))  # fmt: skip
            expected.append((kind, spec))
    prompts_ = [texts[i % len(texts)] for i in range(len(params))]
    free_prompts = ["The capital of France is", "Once upon a time"]
    free = [SamplingParams(temperature=0.0, max_tokens=12),
            SamplingParams(temperature=0.8, seed=5, max_tokens=12)]  # fmt: skip
    outs = embedded_llm.generate(prompts_ + free_prompts, params + free, use_tqdm=False)
    for (kind, spec), out in zip(expected, outs):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check_output(kind, spec, out.outputs[0].text)
    alone = embedded_llm.generate(free_prompts, free, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[-2:]] == [o.outputs[0].token_ids for o in alone]


def test_data_parallel_replicas(tiny_llama):
    """Constraints travel to data-parallel replicas inside the pickled SamplingParams; the parent
    refuses a bad one before any replica runs."""
    batch, params, cases = mixed_batch(sampled=True)
    with LLM(str(tiny_llama), block_size=4, data_parallel_size=2) as llm:
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            llm.generate("x", SamplingParams(structured_outputs={"regex": "(a"}), use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for (kind, spec, _), out in zip(cases, outs):
        assert out.outputs[0].finish_reason == "stop"
        check_output(kind, spec, out.outputs[0].text)


def test_xgrammar_backend(tiny_llama):
    """The other grammar library behind the same interface (`structured_outputs_backend`)."""
    llm = LLM(
        str(tiny_llama), block_size=4, max_num_batched_tokens=32,
        structured_outputs_backend="xgrammar",
    )  # fmt: skip
    with pytest.raises(ValueError, match="structured_outputs.json"):
        llm.llm_engine.validate_params(SamplingParams(structured_outputs={"json": {"type": "x"}}))
    batch, params, cases = mixed_batch(sampled=True)
    outs = generate(llm, batch, params)
    assert llm.llm_engine.structured.manager.backend.name == "xgrammar"
    for (kind, spec, _), out in zip(cases, outs):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check_output(kind, spec, out.outputs[0].text)


def test_tensor_parallel_ranks_sample_under_the_same_bitmask(tiny_llama):
    """TP = 2 on gloo: every rank applies the step's bitmask (a "sample" message), so the
    constrained and unconstrained outputs, greedy and seeded, equal TP = 1's token for token."""
    batch, params, cases = mixed_batch(sampled=True)
    tokens = {}
    for size in (1, 2):
        with LLM(str(tiny_llama), block_size=4, max_num_batched_tokens=32,
                 tensor_parallel_size=size, dtype="float32") as llm:  # fmt: skip
            outs = generate(llm, batch, params)
        tokens[size] = [o.outputs[0].token_ids for o in outs]
        for (kind, spec, _), out in zip(cases, outs):
            check_output(kind, spec, out.outputs[0].text)
    assert tokens[2] == tokens[1]


class OrderExecutor(UniProcExecutor):
    """The default executor, recording the order of `prepare`, `launch`, `presample`, `sample`
    and `collect` and, at
    each `prepare`, whether a bitmask fill started since the last `sample` (`structured`: the
    engine's `StructuredOutputs`, set once the engine is built), and at each `sample` whether
    the step came prepared (`ModelRunner.presample`'s `PreparedSampling`, which leaves the
    sampling after the fill no Python a row: tests/ops/test_token_bitmask.py). Test-only
    fault injection: the next call named by `fail_next` raises (a fault of the whole step)
    before it does anything, and the next collected step that sampled `fail_row` fails that
    row alone."""

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self.events: list[tuple[str, bool]] = []
        self.presampled: list[bool] = []
        self.structured = None
        self._early_fills_sampled = 0  # fills started before the last `sample`
        self.fail_next: str | None = None
        self.fail_row: str | None = None

    def _event(self, name: str, filling: bool = False) -> None:
        if self.fail_next == name:
            self.fail_next = None
            raise RuntimeError(f"injected fault in {name}")
        self.events.append((name, filling))

    def prepare(self, scheduler_output) -> None:
        s = self.structured
        self._event("prepare", s is not None and s.num_early_fills > self._early_fills_sampled)
        super().prepare(scheduler_output)

    def launch(self, scheduler_output):
        self._event("launch")
        return super().launch(scheduler_output)

    def presample(self, launched) -> None:
        self._event("presample")
        super().presample(launched)

    def sample(self, launched, grammar, wait=None) -> None:
        self._event("sample")
        self._early_fills_sampled = self.structured.num_early_fills
        self.presampled.append(launched.presampled is not None)
        super().sample(launched, grammar, wait)

    def collect(self, launched):
        self._event("collect")
        out = super().collect(launched)
        if self.fail_row in out.sampled_token_ids:
            out.failed[self.fail_row], self.fail_row = "injected row fault", None
        return out


def varied_batch():
    """Constrained and free requests whose sampling rows differ (temperature, seed, top-k,
    top-p, min_tokens, a penalty) and finish at different steps, so a step's rows change."""
    c = StructuredOutputsParams
    params = [
        SamplingParams(temperature=0.7, seed=1, top_k=5, max_tokens=30, structured_outputs=c(json=NESTED)),
        SamplingParams(temperature=1.0, seed=2, top_p=0.8, max_tokens=20, structured_outputs=c(regex=REGEX)),
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=c(choice=CHOICE)),
        SamplingParams(temperature=0.5, seed=3, top_k=20, min_tokens=3, max_tokens=30,
                       structured_outputs=c(json=NUMBERS)),
        SamplingParams(temperature=0.9, seed=4, top_k=3, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7),
        SamplingParams(temperature=1.2, seed=5, min_tokens=4, max_tokens=9),
        SamplingParams(temperature=0.8, seed=6, frequency_penalty=0.5, max_tokens=5),
    ]  # fmt: skip
    return prompts(len(params), seed=2), params


def test_next_step_prepared_beside_the_fill_and_sampling_unchanged(tiny_llama, monkeypatch):
    """Async scheduling prepares step N+2 (`Executor.prepare`) while step N+1's bitmask fill
    runs, before N+1 is sampled; the outputs, under per-request sampling settings, equal the
    synchronous run's (which samples each step before preparing the next), also with the held
    step sampled behind a wait for its fill (PHLOEM_CONSTRAINED_DEVICE_WAIT; on the CPU a host
    wait inside the deferred sampling: tests/engine/test_constrained_device_wait.py)."""
    batch, params = varied_batch()
    tokens, executors = [], []
    for async_scheduling, wait in ((False, "0"), (True, "0"), (True, "host")):
        monkeypatch.setenv("PHLOEM_CONSTRAINED_DEVICE_WAIT", wait)
        config = EngineConfig(
            model=ModelConfig(str(tiny_llama)),
            cache=CacheConfig(block_size=4),
            scheduler=SchedulerConfig(max_num_batched_tokens=32, async_scheduling=async_scheduling),
        )
        engine = LLMEngine(config, executor_factory=OrderExecutor)
        engine.executor.structured = engine.structured
        ids = [engine.add_request(p, sp) for p, sp in zip(batch, params)]
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
        engine.scheduler.check_integrity()
        tokens.append(
            [(outs[i].outputs[0].token_ids, outs[i].outputs[0].finish_reason) for i in ids]
        )
        executors.append(engine.executor)
        waits = engine.structured.device_wait
        assert (waits is not None and waits._seq >= 10) == (wait == "host")  # steps deferred
        engine.close()
    assert tokens[0] == tokens[1] == tokens[2]
    for executor, overlap in zip(executors, (False, True, True)):
        events = executor.events
        samples = [k for k, (name, _) in enumerate(events) if name == "sample"]
        prepared_first = [k for k in samples if events[k - 1] == ("prepare", True)]
        assert len(samples) > 5 and all(executor.presampled), executor.presampled
        # each constrained step's sampling up to the mask is enqueued at its launch, before
        # the step before is collected (`LLMEngine._launch`), as an unconstrained step's is
        at_launch = [
            k for k, e in enumerate(events) if (events[k - 1][0], e[0]) == ("launch", "presample")
        ]
        assert len(at_launch) == len(samples)
        if overlap:
            assert sum(events[k + 1][0] == "collect" for k in at_launch) >= 10
        if overlap:  # not while the penalty request runs: its steps collect before prepare
            assert len(prepared_first) >= 10, " ".join(n[0] + "*" * f for n, f in events)
        else:
            assert not prepared_first


@pytest.fixture(scope="module")
def async_engine(tiny_llama):
    """One async-scheduling engine for the fault tests (executor: `OrderExecutor`), and the
    outputs of `add`'s batch on it without a fault."""
    config = EngineConfig(
        model=ModelConfig(str(tiny_llama)),
        cache=CacheConfig(block_size=4, num_gpu_blocks=256),  # (integrity checks walk it)
        scheduler=SchedulerConfig(max_num_batched_tokens=32, async_scheduling=True),
    )
    engine = LLMEngine(config, executor_factory=OrderExecutor)
    engine.executor.structured = engine.structured
    expected = finish(engine, add(engine))
    assert_idle(engine)
    yield engine, expected
    engine.close()


def add(engine) -> list[str]:
    """Queue constrained and free requests, greedy or seeded: every run of them draws the same."""
    c = StructuredOutputsParams
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=c(json=NESTED)),
        SamplingParams(temperature=0.8, seed=1, max_tokens=16, structured_outputs=c(regex=REGEX)),
        SamplingParams(temperature=0.7, seed=2, max_tokens=16, structured_outputs=c(choice=CHOICE)),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=9, ignore_eos=True),
    ]  # fmt: skip
    return [engine.add_request(p, sp) for p, sp in zip(prompts(len(params), seed=3), params)]


def assert_consistent(engine) -> None:
    """The scheduler's queues and blocks agree, and the worker holds the state of every running
    sequence and otherwise only of finished ones whose ids it has not been sent yet."""
    engine.scheduler.check_integrity()
    states = set(engine.executor.worker.model_runner.input_batch.states)
    running = {r.request_id for r in engine.scheduler.running}
    assert running <= states and states - running <= set(engine.scheduler._finished_ids)


def finish(engine, ids: list[str]) -> dict[int, tuple]:
    """Step until nothing is unfinished, checking the engine after every step; {k: (tokens,
    finish reason)} of each request `ids[k]` that finished (aborted ones are left out)."""
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in engine.step()})
        assert_consistent(engine)
    return {k: (outs[i].token_ids, outs[i].finish_reason) for k, i in enumerate(ids) if i in outs}


def assert_idle(engine) -> None:
    """Nothing queued or running, every block reclaimable, and one empty step (it collects the
    step in flight and tells the worker the finished ids) leaves the worker without state."""
    assert not engine.has_unfinished_requests() and not engine._prompts
    assert engine.kv_manager.num_reclaimable_blocks == engine.kv_manager.num_blocks
    assert engine.step() == []
    runner = engine.executor.worker.model_runner
    assert not runner.input_batch.states and runner._prepared is None
    assert engine._in_flight is None and engine.structured.held is None


def step_until_held(engine, min_steps: int = 3) -> None:
    """Step (at least `min_steps` times) until a constrained step waits for its bitmask."""
    for k in range(100):
        engine.step()
        if k + 1 >= min_steps and engine.structured.held is not None:
            return
    raise AssertionError("no constrained step was held")


def test_aborts_while_a_step_waits_for_its_bitmask(async_engine):
    """A constrained step waiting for its bitmask when the last requests are aborted or stopped
    (a server whose clients all left: no next step() comes) is sampled at once; after some are
    aborted the others finish as in a run without the abort; after `abort_all` (no fault) a new
    batch runs as before. The engine is consistent after every step, and idle after each."""
    engine, expected = async_engine
    ids = add(engine)
    step_until_held(engine)
    engine.abort_request(ids[1:])
    assert engine.structured.held is not None  # a request is left: the next step() samples it
    engine.stop_sequences(ids[:1])  # (a front's stop string)
    assert engine.structured.held is None  # sampled: no next step() need come
    assert_consistent(engine)
    assert_idle(engine)
    ids = add(engine)
    step_until_held(engine)
    engine.abort_request(ids[::2])
    assert finish(engine, ids) == {k: expected[k] for k in (1, 3)}
    assert_idle(engine)
    add(engine)
    step_until_held(engine)
    engine.abort_all()
    assert_consistent(engine)
    # the next step: new requests beside the finished ids
    assert finish(engine, add(engine)) == expected
    assert_idle(engine)


@pytest.mark.parametrize("where", ["prepare", "sample", "launch"])
def test_step_fault_beside_a_held_step_then_abort_all(async_engine, where):
    """A fault of a whole step while a constrained step waits for its bitmask: in `prepare`,
    between `prepare` and the launch (the held step's `sample`: the worker's states are then
    one step ahead of what ran), or in the launch. A step() then raises until `abort_all`,
    after which the next step is consistent and a new batch's outputs equal a run without it."""
    engine, expected = async_engine
    add(engine)
    step_until_held(engine)
    engine.executor.fail_next = where
    with pytest.raises(RuntimeError, match=f"injected fault in {where}"):
        engine.step()
    runner = engine.executor.worker.model_runner
    assert (runner._prepared is not None) == (where != "prepare")  # prepared, never launched
    with pytest.raises(RuntimeError, match="call abort_all"):  # its state is unknown
        engine.step()
    engine.abort_all()
    assert_consistent(engine)
    assert finish(engine, add(engine)) == expected
    assert_idle(engine)


def test_a_sequence_failing_alone_leaves_no_step_held(async_engine):
    """The only prompt, n = 2 under a grammar: one sequence fails alone, so the step launched
    beside it is held for the next step(); the failure finishes the sibling at the end of that
    step(), which, nothing being left, samples the held step before it returns."""
    engine, _ = async_engine
    params = SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(json=NESTED))  # fmt: skip
    request_id = engine.add_request(prompts(1, seed=5)[0], params)
    step_until_held(engine)
    engine.executor.fail_row = f"{request_id}#1"
    assert finish(engine, [request_id])[0][1] == "error"  # (the prompt's output)
    assert engine.structured.held is None
    assert_idle(engine)
