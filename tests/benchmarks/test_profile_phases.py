"""`phloem bench throughput --profile` finds its decode window: `_all_decoding` turns true once
every request has its first token, so the next steps compute one token per sequence (the offline
engine's outputs cannot tell it: they report a request only when it finishes)."""

from __future__ import annotations

import pytest

from phloem import SamplingParams
from phloem.bench.profile import _all_decoding
from phloem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from phloem.engine.llm_engine import LLMEngine
from phloem.engine.step_observer import StepRecord
from tests.engine.tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_profile", 5)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_decode_window_starts_after_every_first_token(model_dir, async_scheduling):
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32"),
            cache=CacheConfig(block_size=4, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=24, async_scheduling=async_scheduling),
        )
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(10 + 20 * i, 30 + 20 * i)) for i in range(3)]  # 60 tokens: 3 steps
    for p in prompts:
        engine.add_request(p, params)
    records: list[StepRecord] = []
    engine.add_step_observer(records.append)
    assert not _all_decoding(engine.scheduler)
    steps = 0
    while not _all_decoding(engine.scheduler):
        engine.step()
        steps += 1
        assert steps < 20
    assert steps >= 3  # the prompts need three 24-token steps before all of them decode
    first = len(records)
    for _ in range(3):
        engine.step()
    window = [r.scheduler_output for r in records[first:]]
    if async_scheduling:  # the step launched before the check completes inside the window
        window = window[1:]
    assert window and all(s.total_num_scheduled_tokens == len(prompts) for s in window)
