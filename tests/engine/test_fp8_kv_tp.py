"""The FP8 KV cache with checkpoint scales under tensor parallelism (gloo, CPU; issue 18): the
scales are 0-dim tensors read through lazy slices on every rank, and TP = 2 generates TP = 1's
greedy tokens (each rank stores its KV heads with the same per-tensor scales)."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from phloem import LLM, SamplingParams
from phloem.layers.attention import Attention
from tests.engine.tiny_models import VOCAB, write_tiny_model


def test_tp2_fp8_kv_with_scales_equals_tp1(tmp_path, embedded_tokenizer_dir):
    torch.set_num_threads(2)
    write_tiny_model("llama", tmp_path, embedded_tokenizer_dir, seed=13)
    (weights,) = tmp_path.glob("*.safetensors")
    scales = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(s)  # 0-dim, as HF's
              for i in range(2) for kind, s in (("k", 0.05), ("v", 0.02))}  # fmt: skip
    save_file({**load_file(weights), **scales}, weights, metadata={"format": "pt"})
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(4 + 3 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for size in (1, 2):
        llm = LLM(str(tmp_path), tensor_parallel_size=size, dtype="float32", block_size=4,
                  max_num_batched_tokens=32, kv_cache_dtype="fp8")  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[size] = [o.outputs[0].token_ids for o in outs]
        model = llm.llm_engine.executor.worker.model
        got = [
            s for m in model.modules() if isinstance(m, Attention) for s in (m.k_scale, m.v_scale)
        ]
        assert got == pytest.approx([0.05, 0.02] * 2)
        llm.close()  # leaves the process group (the next TP engine in this process starts one)
        del llm, model
        gc.collect()
    assert runs[2] == runs[1]
