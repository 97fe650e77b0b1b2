"""Engine runs shared by the GPU tests: a 2-layer Llama-3.1-8B-shaped model with random weights
and greedy generation that frees the GPU afterwards."""

from __future__ import annotations

import gc
import random

import torch


def llama8b_two_layers(directory) -> tuple[str, list[list[int]]]:
    """A loadable 2-layer Llama-3.1-8B directory under `directory` (random weights:
    load_format="dummy") and 8 prompts of 8-300 random token ids."""
    from phloem.model_configs import materialize

    path = materialize("llama-3.1-8b", directory, num_hidden_layers=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 128000) for _ in range(rng.randint(8, 300))] for _ in range(8)]
    return str(path), prompts


def greedy(path: str, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], bool]:
    """16 greedy tokens per prompt from `LLM(path, load_format="dummy", **kwargs)`, and whether
    its worker replayed CUDA graphs; the engine is released and the CUDA cache emptied. The KV
    cache gets a fixed 2 GiB (not a share of the GPU): engines of earlier test files in the same
    process may still hold memory, which a `gpu_memory_utilization` budget would subtract."""
    from phloem import LLM, SamplingParams

    kwargs.setdefault("kv_cache_memory_bytes", 2 << 30)
    llm = LLM(path, load_format="dummy", max_model_len=1024, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    graphs = llm.llm_engine.executor.worker.cuda_graphs
    llm.llm_engine = None
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, graphs


def first_token_agreement(got: list[list[int]], want: list[list[int]]):
    """(share of sequences whose first token agrees, each sequence's tokens before the first
    difference) of two greedy runs over the same prompts."""
    first = sum(a[0] == b[0] for a, b in zip(got, want)) / len(want)
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
              for a, b in zip(got, want)]  # fmt: skip
    return first, prefix
