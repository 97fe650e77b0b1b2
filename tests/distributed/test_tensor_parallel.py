"""Tensor parallelism end to end on the CPU (gloo, spawned rank processes): TP = 2 generates what
TP = 1 and transformers generate (float32; Llama, Qwen2 with one KV head (replicated), Qwen3;
tied and untied embeddings), and so does the embedded model at TP = 3; a bad
tensor_parallel_size is refused naming the field, and a killed rank or one that raises gives an
error naming it, with no process left behind."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import random
import re
import signal

import pytest
import torch

from phloem import LLM, SamplingParams
from phloem.distributed.worker_process import TensorParallelError
from tests.engine.tiny_models import VOCAB, hf_greedy, write_tiny_model


def write_model(arch: str, path, tokenizer_dir, num_kv_heads: int):
    """A seeded random float32 `arch` model with `num_kv_heads` KV heads, saved with tokenizer."""
    return write_tiny_model(arch, path, tokenizer_dir, seed=11, num_kv_heads=num_kv_heads)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(3, VOCAB) for _ in range(20)]
    return [(system if i % 2 else []) + [rng.randrange(3, VOCAB) for _ in range(3 + 2 * i)]
            for i in range(6)]  # fmt: skip


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=4, n=2, max_tokens=5,
                         repetition_penalty=1.2)  # fmt: skip


def run(llm: LLM, params: SamplingParams):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in outs]


@pytest.mark.parametrize(
    ("arch", "num_kv_heads", "all_reduce"),
    [("llama", 2, "nccl"), ("qwen2", 1, "fused_norm"), ("qwen3", 2, "symm_norm")],
)
def test_tp2_matches_tp1_and_transformers(
    arch, num_kv_heads, all_reduce, tmp_path, embedded_tokenizer_dir, capfd, monkeypatch
):
    """fused_norm, symm_norm: the row-parallel layers leave their all-reduce to the next RMSNorm
    (on gloo the norm all-reduces, then adds and normalizes: a lost or doubled sum changes the
    tokens); the norms after o_proj take buffer slot 0, those after down_proj slot 1."""
    torch.set_num_threads(2)
    ref = write_model(arch, tmp_path, embedded_tokenizer_dir, num_kv_heads)
    results = {}
    monkeypatch.setattr(logging.getLogger("phloem"), "level", logging.INFO)
    monkeypatch.setenv("PHLOEM_TP_ALLREDUCE", all_reduce)  # the ranks inherit it
    for size in (1, 2):
        llm = LLM(str(tmp_path), tensor_parallel_size=size, dtype="float32", block_size=4,
                  max_num_batched_tokens=32)  # fmt: skip
        results[size] = (run(llm, GREEDY), run(llm, SAMPLED))
        layers = llm.llm_engine.executor.worker.model.model.layers
        deferred = [(x.self_attn.o_proj.defers_all_reduce, x.mlp.down_proj.defers_all_reduce,
                     x.post_attention_layernorm.reduces_input) for x in layers]  # fmt: skip
        fused = size == 2 and all_reduce in ("fused_norm", "symm_norm")
        assert set(deferred) == {(fused,) * 3}
        slots = [(x.post_attention_layernorm.reduce_slot, x.input_layernorm.reduce_slot)
                 for x in layers] + [(llm.llm_engine.executor.worker.model.model.norm.reduce_slot,)]  # fmt: skip
        assert slots == ([(0, 0)] + [(0, int(fused))] * (len(layers) - 1) + [(int(fused),)])
        ranks = llm.llm_engine.executor._group.ranks if size == 2 else []
        del llm  # collecting the LLM stops its rank processes (no close())
        gc.collect()
    assert ranks and all(not r.process.is_alive() for r in ranks)
    # the rank process logs at the driver's level, naming itself (its KV cache line)
    assert re.search(r"rank 1 INFO phloem\.worker\.worker: KV cache", capfd.readouterr().err)
    (greedy1, sampled1), (greedy2, sampled2) = results[1], results[2]
    assert [[c[0] for c in o] for o in greedy2] == [[c[0] for c in o] for o in greedy1]
    for o1, o2 in zip(greedy1, greedy2):
        assert o2[0][1] == pytest.approx(o1[0][1], abs=1e-5)
    assert [[c[0] for c in o] for o in sampled2] == [[c[0] for c in o] for o in sampled1]
    expected = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts()]
    assert [o[0][0] for o in greedy2] == expected


def test_bad_tensor_parallel_size(tmp_path, embedded_tokenizer_dir):
    write_model("llama", tmp_path, embedded_tokenizer_dir, 2)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3 must divide num_attention_heads=4"
    ):
        LLM(str(tmp_path), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(str(tmp_path), tensor_parallel_size=0)
    assert not multiprocessing.active_children()


def test_killed_rank_raises_naming_it(tmp_path, embedded_tokenizer_dir):
    write_model("llama", tmp_path, embedded_tokenizer_dir, 2)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, dtype="float32", block_size=4)
    process = llm.llm_engine.executor._group.ranks[0].process
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=10)
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 \(pid \d+\) died"):
        run(llm, GREEDY)
    with pytest.raises(RuntimeError, match="tensor-parallel ranks were stopped"):
        run(llm, GREEDY)
    llm.close()
    assert not multiprocessing.active_children()


def test_rank_exception_is_reported_naming_the_rank():
    from phloem.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
    from phloem.distributed.worker_process import RankProcess, RankSpec, stop_ranks
    from phloem.engine.tp_executor import _free_port

    init_method = f"tcp://127.0.0.1:{_free_port()}"
    spec = RankSpec(1, 2, init_method, "gloo", {}, 1, {"no_such_argument": 1})
    rank = RankProcess(spec)
    try:
        rank.expect("joining", 60)
        init_tensor_parallel(0, 2, init_method, "gloo")
        with pytest.raises(TensorParallelError, match=r"(?s)rank 1 failed:.*TypeError.*no_such"):
            rank.expect("ready", 60)
    finally:
        destroy_tensor_parallel()
        stop_ranks([rank])
    assert not rank.process.is_alive()


def test_embedded_model_at_tp3_matches_tp1(embedded_llm):
    """The embedded SmolLM2 (GGUF through its converted checkpoint: 9 query and 3 KV heads, so
    TP = 3) generates the session engine's greedy tokens."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in embedded_llm.generate(prompts, params, use_tqdm=False)
    ]
    with LLM(tensor_parallel_size=3, max_num_batched_tokens=64, dtype="float32") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_data_parallel_replicas_of_tp_groups_match_tp1(tmp_path, embedded_tokenizer_dir):
    """DP = 2 replicas, each a TP = 2 group (4 processes on gloo), under one plan: TP = 1's
    greedy tokens, and each replica reports its TP size."""
    write_model("llama", tmp_path, embedded_tokenizer_dir, 2)
    with LLM(str(tmp_path), dtype="float32", block_size=4) as llm:
        expected = [[c[0] for c in o] for o in run(llm, GREEDY)]
    with LLM(str(tmp_path), data_parallel_size=2, tensor_parallel_size=2, dtype="float32",
             block_size=4) as llm:  # fmt: skip
        got = [[c[0] for c in o] for o in run(llm, GREEDY)]
        assert [e["tensor_parallel_size"] for e in llm.llm_engine.replica_engines] == [2, 2]
    assert got == expected
    assert not multiprocessing.active_children()
