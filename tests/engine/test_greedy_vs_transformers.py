"""Greedy outputs equal transformers' token for token (float32, CPU), whatever the schedule."""

from __future__ import annotations

import random

import pytest
import torch

from phloem import LLM, SamplingParams
from tests.engine.tiny_models import VOCAB, hf_greedy, write_tiny_model

MAX_TOKENS = 12


def make_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory, embedded_tokenizer_dir):
    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp(request.param)
    reference = write_tiny_model(request.param, path, embedded_tokenizer_dir)
    prompts = make_prompts(6, seed=hash(request.param) % 1000)
    expected = [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
    return path, prompts, expected


SCHEDULES = {
    "one_step_prefill": dict(max_num_batched_tokens=512, enable_chunked_prefill=False),
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "preemption": dict(max_num_batched_tokens=32, num_gpu_blocks=16),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_matches_transformers(tiny, schedule):
    path, prompts, expected = tiny
    llm = LLM(str(path), block_size=4, max_model_len=64, **SCHEDULES[schedule])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == expected
    engine = llm.llm_engine
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    if schedule == "preemption":
        assert engine.num_computed_prompt_tokens > sum(map(len, prompts)), "no preemption happened"
