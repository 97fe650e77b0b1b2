"""The offline `LLM` under faults: a request whose own setup, sampling, detokenization, stop
rules or admission raises fails alone (an output with `error`, finish_reason "error") while the
others finish; seeds at the ends of their range run; a fault of a whole step leaves the object
usable; calls from two threads are serialized; bad arguments get errors naming them.

Faults are injected by the tests only: a monkeypatched function, or a test-only executor."""

from __future__ import annotations

import threading

import pytest

import phloem.core.scheduler as scheduler_module
import phloem.layers.logits_processors as processors_module
import phloem.worker.sampling_rows as sampling_rows_module
from phloem import LLM, SamplingParams
from phloem.core.prefix_groups import PrefixGroups
from phloem.engine.detokenizer import IncrementalDetokenizer
from phloem.sampling_params import SEED_MAX, SEED_MIN
from tests.engine.tiny_models import VOCAB, tiny_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [3 + i, 40, 41, 42, 43, 7 * i + 5]} for i in range(3)]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, tmp_path_factory, embedded_tokenizer_dir):
    path = tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_faults", 5)
    return LLM(str(path), block_size=4, max_num_batched_tokens=32, async_scheduling=request.param)


def assert_clean(llm: LLM) -> None:
    """Nothing left queued or running, and every KV block free or only cached."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert not engine._prompts and not engine._sequences
    engine.scheduler.check_integrity()
    assert engine.kv_manager.num_reclaimable_blocks == engine.kv_manager.num_blocks


def run_with_one_bad(llm: LLM, bad: SamplingParams) -> list:
    """Generate PROMPTS with `bad` params for the middle prompt; check the failure stayed
    alone, the others match a clean run and a later call still works."""
    expected = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    outputs = llm.generate(PROMPTS, [GREEDY, bad, GREEDY], use_tqdm=False)
    assert outputs[1].finished and outputs[1].error
    assert all(c.finish_reason == "error" for c in outputs[1].outputs)
    for i in (0, 2):
        assert outputs[i].error is None
        assert outputs[i].outputs[0].token_ids == expected[i].outputs[0].token_ids
    assert_clean(llm)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]
    return outputs


def test_seeds_at_the_ends_of_their_range_run(llm):
    """2^64 - 1 with n = 2 (the second child's seed wraps to 0), -2^63 and -1 all run; -1 and
    2^64 - 1 seed the same generator (seeds are taken modulo 2^64)."""
    params = [
        SamplingParams(seed=SEED_MAX, n=2, max_tokens=4, ignore_eos=True),
        SamplingParams(seed=SEED_MIN, n=2, max_tokens=4, ignore_eos=True),
        SamplingParams(seed=-1, max_tokens=4, ignore_eos=True),
    ]
    outputs = llm.generate(PROMPTS[:1] * 3, params, use_tqdm=False)
    assert all(o.error is None for o in outputs)
    assert [len(o.outputs) for o in outputs] == [2, 2, 1]
    assert all(c.finish_reason == "length" for o in outputs for c in o.outputs)
    assert outputs[2].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"seed must be in \[-2\^63"):
        llm.generate(PROMPTS, {"seed": 2**64, "max_tokens": 4})
    assert_clean(llm)


def test_sampling_setup_failure_fails_alone(llm, monkeypatch):
    real = sampling_rows_module.seeded_generator

    def seeded_generator(seed, device):
        if seed == 1234:
            raise RuntimeError("injected generator fault")
        return real(seed, device)

    monkeypatch.setattr(sampling_rows_module, "seeded_generator", seeded_generator)
    outputs = run_with_one_bad(llm, SamplingParams(seed=1234, max_tokens=4, ignore_eos=True))
    assert "injected generator fault" in outputs[1].error


def test_detokenizer_failure_fails_alone(llm, monkeypatch):
    real = IncrementalDetokenizer.add_token

    def add_token(self, token_id):
        if "BOOM" in self.stop:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", add_token)
    bad = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=["BOOM"], n=2)
    outputs = run_with_one_bad(llm, bad)
    assert "UnicodeDecodeError" in outputs[1].error and len(outputs[1].outputs) == 2


def test_sampling_failure_fails_alone_and_seeded_neighbours_draw_the_same(llm, monkeypatch):
    real = processors_module.apply_min_p

    def apply_min_p(logits, min_p):
        if bool(((min_p - 0.125).abs() < 1e-6).any()):
            raise IndexError("injected sampling fault")
        return real(logits, min_p)

    seeded = SamplingParams(seed=7, min_p=0.01, max_tokens=4, ignore_eos=True)
    expected = llm.generate(PROMPTS, seeded, use_tqdm=False)
    monkeypatch.setattr(processors_module, "apply_min_p", apply_min_p)  # `Truncation.probs`
    bad = SamplingParams(seed=8, min_p=0.125, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [seeded, bad, seeded], use_tqdm=False)
    assert "injected sampling fault" in outputs[1].error
    for i in (0, 2):
        assert outputs[i].error is None
        assert outputs[i].outputs[0].token_ids == expected[i].outputs[0].token_ids
    assert_clean(llm)


def test_stop_rule_failure_fails_alone(llm, monkeypatch):
    real = scheduler_module.check_stop

    def check_stop(request, max_model_len):
        if 4242 in request.sampling_params.stop_token_ids:
            raise KeyError("injected stop-rule fault")
        return real(request, max_model_len)

    monkeypatch.setattr(scheduler_module, "check_stop", check_stop)
    bad = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop_token_ids=[4242])
    assert "injected stop-rule fault" in run_with_one_bad(llm, bad)[1].error


def test_admission_failure_fails_alone(llm, monkeypatch):
    real = PrefixGroups.attach

    def attach(self, request):
        if 4343 in request.sampling_params.stop_token_ids:
            raise AssertionError("injected admission fault")
        return real(self, request)

    monkeypatch.setattr(PrefixGroups, "attach", attach)
    bad = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop_token_ids=[4343])
    assert "injected admission fault" in run_with_one_bad(llm, bad)[1].error


class _FailingExecutor:
    """Test-only executor: the engine's own, except that its next launch raises (a fault of the
    whole step, as a lost device would be)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.armed = True

    def _maybe_fail(self) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("injected step fault")

    def execute_model(self, sched):
        self._maybe_fail()
        return self.inner.execute_model(sched)

    def prepare(self, sched):
        self.inner.prepare(sched)

    def launch(self, sched):
        self._maybe_fail()
        return self.inner.launch(sched)

    def collect(self, launched):
        return self.inner.collect(launched)

    def needs_token_history(self, sched):
        return self.inner.needs_token_history(sched)


def test_step_fault_raises_and_leaves_the_llm_usable(llm):
    expected = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    inner = engine.executor
    engine.executor = _FailingExecutor(inner)
    try:
        with pytest.raises(RuntimeError, match="injected step fault"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        engine.executor = inner
    assert_clean(llm)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


def test_generate_from_two_threads_is_serialized(llm):
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(k: int) -> None:
        try:
            start.wait()
            results[k] = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for k in range(2):
        assert [o.outputs[0].token_ids for o in results[k]] == expected
    assert_clean(llm)


def test_a_call_nested_in_another_raises_and_leaves_the_llm_usable(llm):
    request_ids = llm.add_requests([llm.encode_prompt(p) for p in PROMPTS], [GREEDY] * 3)
    with pytest.raises(RuntimeError, match="already running a call in this thread"):
        for _ in llm.iter_outputs(request_ids, use_tqdm=False):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_clean(llm)  # the outer call's unfinished requests were aborted
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 3


def test_argument_errors_name_the_argument(llm):
    with pytest.raises(TypeError, match="^prompts must be a prompt"):
        llm.generate(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^prompts must be a prompt"):
        llm.generate(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^conversations must be a conversation"):
        llm.chat(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^sampling_params must be a SamplingParams"):
        llm.generate(PROMPTS, 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^sampling_params\[1\] must be a SamplingParams"):
        llm.generate(PROMPTS[:2], [GREEDY, "greedy"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"^sampling_params\[1\]: unknown sampling field"):
        llm.generate(PROMPTS[:2], [{"max_tokens": 2}, {"colour": "blue"}])
    with pytest.raises(ValueError, match=r"^sampling_params: stop_token_ids holds ids outside"):
        llm.generate(PROMPTS, SamplingParams(stop_token_ids=[VOCAB]))
    assert_clean(llm)
    outputs = llm.generate(PROMPTS[:1], {"temperature": 0, "max_tokens": 3}, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3
    assert llm.plan(PROMPTS, {"max_tokens": 3}).describe()  # dicts for plan() too


def test_chat_takes_content_parts_like_the_server(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]  # fmt: skip
    plain = [{"role": "user", "content": "Hi there"}]
    assert llm.encode_chat(parts) == llm.encode_chat(plain)
    params = SamplingParams(temperature=0, max_tokens=2)
    assert llm.chat(parts, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"^conversations\[0\]: messages\[0\]\.role must be"):
        llm.chat([{"role": "robot", "content": "hi"}], params)


def test_job_summary_counts_engine_failures(llm, monkeypatch):
    """A request that failed in the engine counts as failed in the job summary, beside the
    lines that failed before reaching it."""
    from phloem.engine.metrics import summarize

    def seeded_generator(seed, device):
        raise RuntimeError("injected generator fault")

    monkeypatch.setattr(sampling_rows_module, "seeded_generator", seeded_generator)
    bad = SamplingParams(seed=99, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [GREEDY, bad, GREEDY], use_tqdm=False)
    summary = summarize(outputs, wall_s=1.0, num_failed_requests=2)
    assert summary["num_requests"] == 5
    assert summary["num_failed_requests"] == 3


def test_run_batch_yields_every_index_and_a_closed_iteration_aborts_the_rest(llm):
    """`LLM.run_batch`, the runner behind generate/chat and the JSONL jobs: one (index, output)
    per built prompt, the same tokens as `generate`; closing it early aborts what is left and
    releases the call lock."""
    prompts = [p["prompt_token_ids"] for p in PROMPTS]

    def build():
        return [(None, ids) for ids in prompts], [GREEDY] * len(prompts)

    got = dict(llm.run_batch(build, use_tqdm=False))
    expected = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert sorted(got) == [0, 1, 2]
    assert [got[i].outputs[0].token_ids for i in range(3)] == [
        o.outputs[0].token_ids for o in expected
    ]
    batch = llm.run_batch(build, use_tqdm=False)
    next(batch)
    batch.close()
    assert_clean(llm)
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 3  # the lock was released
