"""The KV cache's storage options end to end. kv_cache_dtype="fp8": the KV pool is float8 e4m3 (a
quarter of float32's bytes per token, so 4x the blocks for the same byte budget), every step
writes and reads it, and greedy outputs stay close to the full-precision cache's (FP8 rounds K and
V: ~6% relative error per element). kv_layout="HND": head-major blocks, identical outputs."""

from __future__ import annotations

import random

import pytest
import torch

from phloem import LLM, SamplingParams
from tests.engine.tiny_models import VOCAB, tiny_model_dir


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_fp8kv", 5)


def run(path, kv_cache_dtype: str, kv_layout: str = "NHD"):
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20,
              kv_cache_dtype=kv_cache_dtype, kv_layout=kv_layout, dtype="float32")  # fmt: skip
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    batch = [
        shared + [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))] for _ in range(8)
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    llm.llm_engine.scheduler.check_integrity()
    return llm.llm_engine.executor.worker, [o.outputs[0].token_ids for o in outs]


def test_fp8_kv_cache_end_to_end(tiny_llama):
    full_worker, full = run(tiny_llama, "auto")
    fp8_worker, fp8 = run(tiny_llama, "fp8")
    caches = fp8_worker.model_runner.kv_caches
    assert caches[0].dtype == torch.float8_e4m3fn and full_worker.kv_dtype == torch.float32
    assert fp8_worker.num_blocks + 1 == 4 * (full_worker.num_blocks + 1)  # same bytes, 1/4 each
    assert any(c.float().abs().sum() > 0 for c in caches)  # written through the byte view
    assert all(len(t) == 8 for t in fp8)
    # Tokens before the first divergence from the full-precision cache's greedy output: 46 of
    # 64 when written (this tiny model's sharpened weights give large K/V); a cache read as the
    # wrong type or at the wrong place diverges at the first token (~0).
    agree = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 8)
                for x, y in zip(fp8, full))  # fmt: skip
    assert agree >= 0.5 * 8 * len(full), (agree, fp8, full)


def test_kv_cache_dtype_is_validated(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(tiny_llama), kv_cache_dtype="int4")


def test_head_major_kv_layout_gives_identical_outputs(tiny_llama):
    from phloem.ops.kv_store import kv_layout

    nhd_worker, nhd = run(tiny_llama, "auto")
    hnd_worker, hnd = run(tiny_llama, "auto", "HND")
    caches = hnd_worker.model_runner.kv_caches
    assert (
        kv_layout(caches[0]) == "HND" and kv_layout(nhd_worker.model_runner.kv_caches[0]) == "NHD"
    )
    assert hnd_worker.num_blocks == nhd_worker.num_blocks
    assert hnd == nhd and all(len(t) == 8 for t in hnd)
    with pytest.raises(ValueError, match="kv_layout"):
        LLM(str(tiny_llama), kv_layout="NDH")
