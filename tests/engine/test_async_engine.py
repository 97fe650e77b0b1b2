"""AsyncLLMEngine (the server's engine loop) under faults of one request: the request fails
alone (RequestFailedError on its stream, counted once in phloem:request_failed_total) while a
concurrent stream completes, and the loop stays alive for later requests.

Faults are injected by the tests only (a monkeypatched function, or the test-only
`FaultExecutor` given to the engine as its executor factory)."""

from __future__ import annotations

import asyncio

import pytest

import phloem.worker.sampling_rows as sampling_rows_module
from phloem import SamplingParams
from phloem.engine.async_engine import AsyncLLMEngine, RequestFailedError
from phloem.engine.llm_engine import LLMEngine, OutputMode
from phloem.engine_args import EngineArgs
from phloem.sampling_params import SEED_MAX
from tests.engine.tiny_models import tiny_model_dir
from tests.entrypoints.fault_executor import NAN_TOKEN, FaultExecutor

PROMPT = [3, 40, 41, 42, 43, 44, 45, 5]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_async", 6)


def make_engine(model_path, executor_factory=None) -> tuple[AsyncLLMEngine, object]:
    pytest.importorskip("prometheus_client")
    from phloem.metrics_prometheus import EngineMetrics

    args = EngineArgs(str(model_path), block_size=4, max_num_batched_tokens=32)
    engine = LLMEngine(
        args.create_engine_config(),
        executor_factory=executor_factory,
        output_mode=OutputMode.STREAM,
    )
    assert engine.scheduler_config.async_scheduling
    metrics = EngineMetrics("tiny")
    return AsyncLLMEngine(engine, metrics=metrics), metrics


def num_failed(metrics) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith("phloem:request_failed_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no phloem:request_failed_total series")


async def collect(engine: AsyncLLMEngine, params: SamplingParams, request_id: str, prompt=PROMPT):
    """The final output of one request (its stream's last item)."""
    last = None
    async for output in engine.generate(prompt, params, request_id):
        last = output
    return last


async def one_fails_one_completes(engine: AsyncLLMEngine, bad: SamplingParams, **kw):
    """Run a failing and a good request concurrently, then a later good one; returns the
    failing request's error."""
    engine.start()
    good = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = await asyncio.gather(
        collect(engine, bad, "bad", **kw), collect(engine, good, "good"), return_exceptions=True
    )
    error, output = results
    assert isinstance(error, RequestFailedError), results
    assert output.finished and len(output.outputs[0].token_ids) == 12
    assert not engine.is_dead
    later = await collect(engine, good, "later")
    assert later.outputs[0].token_ids == output.outputs[0].token_ids
    return error


def test_setup_failure_fails_alone_while_a_concurrent_stream_completes(model_path, monkeypatch):
    real = sampling_rows_module.seeded_generator

    def seeded_generator(seed, device):
        if seed == 1234:
            raise RuntimeError("injected generator fault")
        return real(seed, device)

    monkeypatch.setattr(sampling_rows_module, "seeded_generator", seeded_generator)
    engine, metrics = make_engine(model_path)
    bad = SamplingParams(seed=1234, max_tokens=12, ignore_eos=True)
    try:
        error = asyncio.run(one_fails_one_completes(engine, bad))
    finally:
        engine.shutdown()
    assert "injected generator fault" in str(error)
    assert num_failed(metrics) == 1
    assert engine.stats()["num_running"] == 0


def test_non_finite_logits_count_one_failure_under_async_scheduling(model_path):
    """A prompt holding the fault executor's NaN marker: the sampler flags its rows, the engine
    fails it alone (no wrapper around the executor or the sampler)."""
    engine, metrics = make_engine(model_path, executor_factory=FaultExecutor)
    bad = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        error = asyncio.run(one_fails_one_completes(engine, bad, prompt=[NAN_TOKEN, *PROMPT]))
    finally:
        engine.shutdown()
    assert "non-finite logits" in str(error)
    assert num_failed(metrics) == 1


def test_largest_seed_with_n_2_runs(model_path):
    """Child 1 of seed 2^64 - 1 wraps to seed 0 instead of overflowing torch's seed."""
    engine, _ = make_engine(model_path)

    async def main():
        engine.start()
        params = SamplingParams(seed=SEED_MAX, n=2, max_tokens=4, ignore_eos=True)
        return await collect(engine, params, "seeded")

    try:
        output = asyncio.run(main())
    finally:
        engine.shutdown()
    assert not engine.is_dead and output.error is None
    assert [len(c.token_ids) for c in output.outputs] == [4, 4]


def test_the_async_front_replaces_nothing_and_counts_from_the_step_observer(model_path):
    """The executor and the runner's sampler stay the engine's own; which requests ran (for
    the running/waiting split of aborts) comes from the step observer."""
    engine, _ = make_engine(model_path)
    inner = engine.engine
    executor, sampler = inner.executor, inner.executor.worker.model_runner.sampler

    async def main():
        engine.start()
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        return await collect(engine, params, "one")

    try:
        output = asyncio.run(main())
    finally:
        engine.shutdown()
    assert output.finished and output.error is None
    assert inner.executor is executor and inner.executor.worker.model_runner.sampler is sampler
    assert engine.stats()["num_preemptions"] == 0 and not engine._started  # forgotten when done
