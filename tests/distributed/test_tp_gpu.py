"""Tensor parallelism on CUDA (skipped without two GPUs; run by benchmarks/tp_device.sh): TP = 2
over NCCL, with decode CUDA graphs (their replays hold the all-reduces) and eagerly, generates
TP = 1's greedy tokens for a tiny bfloat16 Llama and Qwen2 with one KV head. In bfloat16 the
sums' order differs between TP sizes, so a rare near-tie may flip: the first tokens of nearly
every sequence must agree (large weights keep the logits' margins wide)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from phloem import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)


def write_model(path, arch: str, num_kv_heads: int) -> None:
    import transformers

    from phloem.model_configs import synthetic_tokenizer
    from tests.engine.tiny_models import tiny_config

    torch.manual_seed(5)
    config = tiny_config(arch)
    config.num_key_value_heads = num_kv_heads
    # head_dim 64: FlashInfer's kernels (which the CUDA graphs replay) compile 64, 128 and 256 only
    config.hidden_size, config.head_dim, config.intermediate_size = 256, 64, 512
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    synthetic_tokenizer(config.vocab_size, config.eos_token_id).save_pretrained(path)


@pytest.mark.parametrize(
    ("arch", "num_kv_heads", "all_reduce"),
    [("llama", 2, "nccl"), ("qwen2", 1, "nccl"), ("llama", 2, "symm_mem")],
)
def test_tp2_matches_tp1_on_cuda(arch, num_kv_heads, all_reduce, tmp_path, monkeypatch):
    """symm_mem: decode steps' all-reduces through the one-shot symmetric-memory kernel, captured
    in the CUDA graphs (the ranks inherit PHLOEM_TP_ALLREDUCE)."""
    from phloem.distributed.parallel_state import tp_small_all_reduce

    monkeypatch.setenv("PHLOEM_TP_ALLREDUCE", all_reduce)
    write_model(tmp_path, arch, num_kv_heads)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(5 + 3 * i)]}
               for i in range(12)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for size, eager in ((1, False), (2, False), (2, True)):
        with LLM(str(tmp_path), tensor_parallel_size=size, dtype="bfloat16", enforce_eager=eager,
                 max_num_seqs=16, num_gpu_blocks=512) as llm:  # fmt: skip
            assert llm.llm_engine.executor.worker.cuda_graphs is not eager
            assert (tp_small_all_reduce() is not None) == (size == 2 and all_reduce == "symm_mem")
            outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[size, eager] = [o.outputs[0].token_ids for o in outs]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for key in ((2, False), (2, True)):
        same = [a[:8] == b[:8] for a, b in zip(tokens[key], tokens[1, False])]
        assert sum(same) >= len(same) - 1, (key, tokens[key], tokens[1, False])
