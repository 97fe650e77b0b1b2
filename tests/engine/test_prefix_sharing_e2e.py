"""Prefix sharing on vs off gives token-identical greedy outputs, and counts what it saves."""

from __future__ import annotations

import random

import pytest

from phloem import LLM, SamplingParams
from tests.engine.tiny_models import VOCAB, tiny_model_dir


def workloads(seed: int = 0) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    system = toks(37)
    fewshot = toks(29)
    return {
        "one_system_prompt": [system + toks(rng.randint(2, 12)) for _ in range(8)],
        "many_groups": [
            p + toks(rng.randint(1, 9)) for p in [toks(20) for _ in range(4)] for _ in range(3)
        ],
        "nested": [
            fewshot + q + toks(rng.randint(1, 6))
            for q in [toks(17) for _ in range(3)]
            for _ in range(3)
        ],
        "no_sharing": [toks(rng.randint(5, 40)) for _ in range(6)],
    }


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_share", 1)


@pytest.mark.parametrize("name", list(workloads()))
def test_sharing_on_off_identical(tiny_llama, name):
    prompts = workloads()[name]
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    prompts = [prompts[i] for i in order]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for sharing in (True, False):
        llm = LLM(
            str(tiny_llama), block_size=4, max_num_batched_tokens=24, enable_prefix_caching=sharing
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[sharing] = [o.outputs[0].token_ids for o in outs]
        engine = llm.llm_engine
        if sharing:
            plan = llm.last_plan
            computed = engine.num_computed_prompt_tokens
            reused = sum(o.num_cached_tokens for o in outs)
            assert computed + reused == plan.num_logical_prompt_tokens
            if name == "nested":  # the radix cache also shares the few-shot part across groups
                assert computed < plan.num_physical_prompt_tokens
            else:  # each planned prefix computed exactly once, nothing else shared
                assert computed == plan.num_physical_prompt_tokens
            assert (reused > 0) == (name != "no_sharing")
        else:
            assert engine.num_computed_prompt_tokens == sum(map(len, prompts))
            assert all(o.num_cached_tokens == 0 for o in outs)
    assert results[True] == results[False]


def test_radix_cache_across_generate_calls(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4)
    system = [11] * 30
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": system + [5, 6]}, params, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": system + [7, 8, 9]}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 28
    fresh = LLM(str(tiny_llama), block_size=4, enable_prefix_caching=False)
    alone = fresh.generate({"prompt_token_ids": system + [7, 8, 9]}, params, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == alone.outputs[0].token_ids


def test_plan_is_inspectable(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4)
    prompts = workloads()["many_groups"]
    plan = llm.plan([{"prompt_token_ids": p} for p in prompts])
    assert plan.num_logical_prompt_tokens == sum(map(len, prompts))
    assert len(plan.shared_groups) == 4 and 0 < plan.planned_reuse_ratio < 1
    assert "4 shared-prefix groups" in plan.describe()
    assert llm.plan(prompts, SamplingParams(max_tokens=3)).order == plan.order
