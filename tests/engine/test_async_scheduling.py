"""Async scheduling (step N+1 launched before step N's tokens reach the host) changes nothing a
user can see: outputs match the synchronous engine token for token, for greedy and seeded
sampling, with stop strings and ids, min_tokens, penalties, logprobs, n > 1, prefix sharing and
preemption; and the pipeline really runs one step ahead."""

from __future__ import annotations

import random

import pytest

from phloem import LLM, SamplingParams
from tests.engine.tiny_models import VOCAB, tiny_model_dir


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_async", 3)


def prompts(seed: int = 0, num: int = 10) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(24)]
    return [
        (system if i % 2 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 20))]
        for i in range(num)
    ]


def run(path, async_scheduling: bool, params, batch=None, **engine_args):
    llm = LLM(
        str(path),
        block_size=4,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
        **engine_args,
    )
    batch = batch or prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    llm.llm_engine.scheduler.check_integrity()
    assert not llm.llm_engine.has_unfinished_requests()
    return llm, [
        [(c.token_ids, c.text, c.finish_reason, c.cumulative_logprob) for c in o.outputs]
        for o in outs
    ]


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    "seeded_sampling_n2": SamplingParams(temperature=0.9, top_p=0.9, seed=5, n=2, max_tokens=6),
    "min_tokens_and_stop_ids": SamplingParams(
        temperature=1.0, seed=1, min_tokens=3, max_tokens=8, stop_token_ids=list(range(3, 20000))
    ),
    "penalties": SamplingParams(
        temperature=0.7, seed=2, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=6
    ),
    "logprobs": SamplingParams(temperature=0, logprobs=2, max_tokens=5, ignore_eos=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_async_matches_sync(tiny_llama, name):
    params = CASES[name]
    _, sync = run(tiny_llama, False, params)
    _, overlapped = run(tiny_llama, True, params)
    assert overlapped == sync


def test_async_matches_sync_with_stop_strings(tiny_llama):
    llm, sync = run(tiny_llama, False, SamplingParams(temperature=0, max_tokens=12))
    texts = [o[0][1] for o in sync]
    stop = next(t[2:5] for t in texts if len(t) >= 6)  # a string some output contains
    params = SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    _, sync = run(tiny_llama, False, params)
    _, overlapped = run(tiny_llama, True, params)
    assert overlapped == sync
    assert any(o[0][2] == "stop" for o in sync)


def test_async_matches_sync_under_preemption(tiny_llama):
    """A pool too small for the batch: requests are preempted while their tokens are pending."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    common = dict(num_gpu_blocks=24, memory_centric_admission=False, enable_prefix_caching=False)
    llm_sync, sync = run(tiny_llama, False, params, **common)
    llm_async, overlapped = run(tiny_llama, True, params, **common)
    assert overlapped == sync
    assert llm_async.llm_engine.scheduler.num_preemptions > 0


def test_async_runs_one_step_ahead(tiny_llama):
    """Each step() launches the next step before collecting the previous one: the first call
    returns nothing and leaves a step in flight, and every launched decode input after the
    first is a token the host had not seen yet (filled in on the device)."""
    llm = LLM(str(tiny_llama), block_size=4, max_num_batched_tokens=64, async_scheduling=True)
    engine = llm.llm_engine
    runner = engine.executor.worker.model_runner
    filled = []
    original = runner._fill_pending

    def spy(input_ids, pending):
        filled.append(len(pending))
        return original(input_ids, pending)

    runner._fill_pending = spy
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for p in prompts(1, 3):
        engine.add_request(p, params)
    assert engine.step() == [] and engine._in_flight is not None
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) == 3 and all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert filled and all(n == 3 for n in filled)  # three decoding requests per step
    # max_tokens is known: no step computes a token past the last one (no wasted work)
    assert engine.num_computed_prompt_tokens == sum(len(p) for p in prompts(1, 3))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_string_on_the_last_allowed_token(tiny_llama, async_scheduling):
    """A stop string completed by the max_tokens-th token: the request finished by length in the
    same update; the stop string still wins (text cut, finish reason "stop") and nothing fails
    on the request the scheduler already freed."""
    _, plain = run(tiny_llama, async_scheduling, SamplingParams(temperature=0, max_tokens=8))
    text = next(o[0][1] for o in plain if len(o[0][1]) >= 4 and o[0][1][-2:] not in o[0][1][:-1])
    stop = text[-2:]  # appears only where the 8th token completes it
    params = SamplingParams(temperature=0, max_tokens=8, stop=[stop])
    llm, outs = run(tiny_llama, async_scheduling, params)
    hit = [o[0] for o in outs if o[0][1] == text[:-2]]
    assert hit and all(c[2] == "stop" for c in hit)


def test_stop_string_revealed_by_flush_after_a_length_finish(tiny_llama, monkeypatch):
    """Text held back at the end (an incomplete character) is emitted by flush() when the
    request ends by length; a stop string found there is recorded (finish reason "stop"),
    not looked up again in the scheduler, which freed the request already."""
    from phloem.engine.detokenizer import IncrementalDetokenizer

    flush = IncrementalDetokenizer.flush

    def flush_finding_a_stop(self):
        flush(self)
        self.text = self.text[:1]
        return "<held back>"

    monkeypatch.setattr(IncrementalDetokenizer, "flush", flush_finding_a_stop)
    params = SamplingParams(temperature=0, max_tokens=3, stop=["never in the text"])
    llm = LLM(str(tiny_llama), block_size=4, max_num_batched_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    assert all(c.finish_reason == "stop" and c.stop_reason == "<held back>"
               for o in outs for c in o.outputs)  # fmt: skip
    llm.llm_engine.scheduler.check_integrity()
