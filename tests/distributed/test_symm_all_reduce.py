"""The all-reduce choice for tensor parallelism (PHLOEM_TP_ALLREDUCE): parsed and validated before
any rank starts; the symmetric-memory path itself runs on two GPUs (tests/distributed/
test_tp_gpu.py), and gloo groups never take it."""

from __future__ import annotations

import multiprocessing

import pytest

from phloem import LLM
from phloem.distributed.symm_all_reduce import DEFAULT_MAX_KB, all_reduce_choice
from tests.distributed.test_tensor_parallel import write_model


def test_choice_defaults_to_nccl_and_reads_the_size_limit():
    assert all_reduce_choice({}) == ("nccl", DEFAULT_MAX_KB << 10)
    env = {"PHLOEM_TP_ALLREDUCE": "symm_mem", "PHLOEM_TP_ALLREDUCE_MAX_KB": "64"}
    assert all_reduce_choice(env) == ("symm_mem", 64 << 10)
    assert all_reduce_choice({"PHLOEM_TP_ALLREDUCE": "fused_norm"})[0] == "fused_norm"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"PHLOEM_TP_ALLREDUCE": "custom"}, "PHLOEM_TP_ALLREDUCE must be one of"),
        ({"PHLOEM_TP_ALLREDUCE_MAX_KB": "0"}, "PHLOEM_TP_ALLREDUCE_MAX_KB must be a positive"),
        ({"PHLOEM_TP_ALLREDUCE_MAX_KB": "1.5"}, "PHLOEM_TP_ALLREDUCE_MAX_KB must be a positive"),
    ],
)
def test_bad_choice_is_named(env, named):
    with pytest.raises(ValueError, match=named):
        all_reduce_choice(env)


def test_bad_choice_fails_before_any_rank_starts(tmp_path, embedded_tokenizer_dir, monkeypatch):
    write_model("llama", tmp_path, embedded_tokenizer_dir, 2)
    monkeypatch.setenv("PHLOEM_TP_ALLREDUCE", "ring")
    with pytest.raises(ValueError, match="PHLOEM_TP_ALLREDUCE must be one of"):
        LLM(str(tmp_path), tensor_parallel_size=2, dtype="float32")
    assert not multiprocessing.active_children()


def test_gloo_group_keeps_the_backend_all_reduce(tmp_path, embedded_tokenizer_dir, monkeypatch):
    from phloem.distributed.parallel_state import tp_small_all_reduce

    write_model("llama", tmp_path, embedded_tokenizer_dir, 2)
    monkeypatch.setenv("PHLOEM_TP_ALLREDUCE", "symm_mem")  # CUDA only: ignored on gloo
    with LLM(str(tmp_path), tensor_parallel_size=2, dtype="float32", block_size=4) as llm:
        assert tp_small_all_reduce() is None
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) > 0
