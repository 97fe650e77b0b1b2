"""The engine's declared seams: an injected executor, step observers, and requests whose logits
are non-finite failing alone (the sampler's per-row flag, no wrapper around the sampler)."""

from __future__ import annotations

import pytest
import torch

from phloem import SamplingParams
from phloem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from phloem.engine.executor import UniProcExecutor
from phloem.engine.llm_engine import LLMEngine
from phloem.engine.step_observer import StepRecord
from phloem.worker.model_runner import NON_FINITE_MESSAGE
from tests.engine.tiny_models import tiny_model_dir

POISON = 4321  # a token id whose embedding row is NaN in the poisoned engines
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, POISON, 13], [14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_seams", 9)


def make_engine(path, async_scheduling: bool, executor_factory=None) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(str(path)),
        cache=CacheConfig(block_size=4, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, async_scheduling=async_scheduling),
    )
    return LLMEngine(config, executor_factory=executor_factory)


def poisoned_executor(worker) -> UniProcExecutor:
    """The default executor over a worker whose embedding of POISON is NaN: a request with that
    token in its prompt gets NaN hidden states, so NaN logits, in its own rows only."""
    with torch.no_grad():
        worker.model.model.embed_tokens.weight[POISON] = float("nan")
    return UniProcExecutor(worker)


def run(engine: LLMEngine, prompts, params) -> dict[str, object]:
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    engine.scheduler.check_integrity()
    return {i: outputs[i] for i in ids}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_non_finite_logits_fail_their_request_alone(model_dir, async_scheduling, params):
    clean = run(make_engine(model_dir, async_scheduling), PROMPTS, params)
    engine = make_engine(model_dir, async_scheduling, poisoned_executor)
    nans: dict[str, int] = {}
    engine.add_step_observer(lambda r: nans.update(r.runner_output.num_nans_in_logits))
    outputs = run(engine, PROMPTS, params)
    bad = outputs["1"]
    assert bad.finished and bad.error == NON_FINITE_MESSAGE
    assert bad.outputs[0].finish_reason == "error"
    assert set(nans) == {"1"} and nans["1"] > 0
    for i in ("0", "2"):
        assert outputs[i].error is None
        assert outputs[i].outputs[0].token_ids == clean[i].outputs[0].token_ids
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    again = run(engine, [PROMPTS[0]], params)  # the engine goes on
    assert next(iter(again.values())).outputs[0].token_ids == clean["0"].outputs[0].token_ids


class CountingExecutor(UniProcExecutor):
    """The default executor, counting what it is asked to do."""

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self.launched: list[int] = []
        self.collected = 0

    def launch(self, scheduler_output):
        self.launched.append(scheduler_output.total_num_scheduled_tokens)
        return super().launch(scheduler_output)

    def collect(self, launched):
        self.collected += 1
        return super().collect(launched)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_executor_factory_and_step_observers(model_dir, async_scheduling):
    engine = make_engine(model_dir, async_scheduling, CountingExecutor)
    executor = engine.executor
    assert isinstance(executor, CountingExecutor)
    records: list[StepRecord] = []
    engine.add_step_observer(records.append)
    outputs = run(engine, PROMPTS[::2], GREEDY)
    assert all(o.finished and o.error is None for o in outputs.values())
    non_empty = [n for n in executor.launched if n]
    assert [r.step_index for r in records] == list(range(len(non_empty)))
    assert [r.scheduler_output.total_num_scheduled_tokens for r in records] == non_empty
    assert executor.collected == len(non_empty)
    for r in records:
        assert min(r.schedule_s, r.launch_s, r.wait_s, r.update_s) >= 0.0
    sampled = [t for r in records for t in r.runner_output.sampled_token_ids.items()]
    for request_id, out in outputs.items():
        assert [t for rid, t in sampled if rid == request_id] == out.outputs[0].token_ids
    engine.remove_step_observer(records.append)
    num_records = len(records)
    run(engine, PROMPTS[:1], GREEDY)
    assert len(records) == num_records
    with pytest.raises(ValueError):
        engine.remove_step_observer(records.append)
