"""Online prefix groups through the engine (issue 24, item 4): requests added at the same moment
with a common 3-block prefix compute it once, with async scheduling on and off, and their greedy
outputs are those of the same requests computed without any sharing; the engine core's stats
message carries the computed and reused prompt tokens."""

from __future__ import annotations

import random

import pytest

from phloem import SamplingParams
from phloem.engine.engine_core import EngineCore
from phloem.engine.llm_engine import LLMEngine, OutputMode
from phloem.engine_args import EngineArgs
from tests.engine.tiny_models import VOCAB, tiny_model_dir

BS = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_online", 7)


def prompts(num=4, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(3 * BS)]
    return [
        prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))] for _ in range(num)
    ]


def serve(model_path, batch, every=0, **kw) -> tuple[LLMEngine, dict[str, list[int]]]:
    """Add the prompts before the first step (the core's drain), or one every `every` steps,
    step to the end in DELTA mode (the core's), return the engine and each request's token
    ids."""
    args = EngineArgs(str(model_path), block_size=BS, max_num_batched_tokens=32, **kw)
    engine = LLMEngine(args.create_engine_config(), output_mode=OutputMode.DELTA)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    arrivals = [(i * every, f"r{i}", p) for i, p in enumerate(batch)]
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
    num_steps = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= num_steps:
            _, request_id, prompt = arrivals.pop(0)
            engine.add_request(prompt, params, request_id)
        num_steps += 1
        for delta in engine.step():
            for seq in delta.seqs:
                tokens[delta.request_id] += seq.token_ids
    engine.scheduler.check_integrity()
    return engine, tokens


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_simultaneous_arrivals_compute_the_prefix_once(model_path, async_scheduling):
    batch = prompts()
    engine, tokens = serve(model_path, batch, async_scheduling=async_scheduling)
    suffixes = sum(len(p) - 3 * BS for p in batch)
    assert engine.num_computed_prompt_tokens == 3 * BS + suffixes
    stats = EngineCore(engine, None, None)._stats()
    assert stats.num_computed_prompt_tokens == 3 * BS + suffixes
    assert stats.num_reused_prompt_tokens == (len(batch) - 1) * 3 * BS
    _, alone = serve(model_path, batch, enable_prefix_caching=False)
    assert tokens == alone


def test_arrivals_over_steps_reuse_the_prefix(model_path):
    batch = prompts(num=3, seed=2)
    engine, tokens = serve(model_path, batch, every=2)
    assert engine.num_computed_prompt_tokens == 3 * BS + sum(len(p) - 3 * BS for p in batch)
    _, alone = serve(model_path, batch, every=2, enable_prefix_caching=False)
    assert tokens == alone


def test_grouping_off_computes_the_prefix_per_request(model_path):
    batch = prompts(seed=1)
    engine, tokens = serve(model_path, batch, online_prefix_grouping=False)
    assert engine.num_computed_prompt_tokens == sum(map(len, batch))
    _, grouped = serve(model_path, batch)
    assert tokens == grouped


def test_offline_batches_are_not_regrouped(model_path):
    """`LLM` plans its batch as a whole: its requests never reach the online grouping."""
    from phloem import LLM

    llm = LLM(str(model_path), block_size=BS)
    batch = prompts(seed=3) + [[5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.add_requests([(None, p) for p in batch], [params] * len(batch))
    groups = llm.llm_engine.scheduler.arrival_groups
    assert groups is not None and not groups.has_arrivals
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert not groups._index
