"""Greedy outputs equal transformers' token for token (float32, CPU), whatever the schedule."""

from __future__ import annotations

import random

import pytest
import torch

from phloem import LLM, SamplingParams
from tests.engine.tiny_models import VOCAB, hf_greedy, write_tiny_model

MAX_TOKENS = 12


def make_prompts(n: int, seed: int) -> list[list[int]]:
    """Mixed lengths; half of them share a 13-token prefix and two share a 9-token one."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    system, other = prompts[0][:2] + [rng.randrange(3, VOCAB) for _ in range(11)], [7] * 9
    for i in range(1, n, 2):
        prompts[i] = system + prompts[i][:20]
    prompts[-2:] = [other + p[:5] for p in prompts[-2:]]
    return prompts


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory, embedded_tokenizer_dir):
    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp(request.param)
    reference = write_tiny_model(request.param, path, embedded_tokenizer_dir)
    prompts = make_prompts(6, seed=len(request.param))
    short = [p[:8] for p in prompts]  # all admitted at once, then their decodes outgrow the pool
    workloads = {
        "mixed": (prompts, [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]),
        "short": (short, [hf_greedy(reference, p, MAX_TOKENS) for p in short]),
    }
    return path, workloads


SCHEDULES = {
    "one_step_prefill": dict(max_num_batched_tokens=512, enable_chunked_prefill=False),
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "preemption": dict(
        max_num_batched_tokens=64,
        num_gpu_blocks=16,
        memory_centric_admission=False,
        enable_prefix_caching=False,
    ),
    "prefix_sharing": dict(max_num_batched_tokens=16, num_gpu_blocks=40),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_matches_transformers(tiny, schedule):
    path, workloads = tiny
    prompts, expected = workloads["short" if schedule == "preemption" else "mixed"]
    llm = LLM(str(path), block_size=4, max_model_len=64, dtype="float32", **SCHEDULES[schedule])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == expected
    engine = llm.llm_engine
    kv = engine.kv_manager
    cached = kv.prefix_cache.num_cached_blocks if kv.prefix_cache else 0
    assert kv.num_free_blocks + cached == kv.num_blocks
    if schedule == "preemption":
        assert engine.scheduler.num_preemptions > 0, "no preemption happened"
