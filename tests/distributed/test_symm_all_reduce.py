"""The all-reduce choice for tensor parallelism (PHLOEM_TP_ALLREDUCE): parsed and validated before
any rank starts; the symmetric-memory path itself runs on two GPUs (tests/distributed/
test_tp_gpu.py), and gloo groups never take it. The ranks agree whether a group may join a
symmetric-memory rendezvous (not where a rank joined one in an earlier group: the driver of a
second engine in one process), checked with gloo groups and a stand-in set-up."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_and_set_up(rank: int, port: int, built, engine: int) -> None:
    """Rank `rank` of a two-rank gloo group (engine `engine`'s): `symm_mem_setup` with a stand-in
    set-up; built[engine, rank] = 1 where it ran the set-up. Leaves the group."""
    import torch.distributed as dist

    from phloem.distributed.parallel_state import symm_mem_setup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        done = symm_mem_setup(dist.group.WORLD, torch.device("cpu"), lambda: "set up", "test")
        built[engine, rank] = int(done == "set up")
    finally:
        dist.destroy_process_group()


def _driver(built) -> None:
    """A driver process (rank 0) that starts two engines one after the other, each with a new
    rank-1 process, as `TensorParallelExecutor` does."""
    context = multiprocessing.get_context("fork")
    for engine in range(2):
        port = _free_port()
        peer = context.Process(target=_join_and_set_up, args=(1, port, built, engine))
        peer.start()
        _join_and_set_up(0, port, built, engine)
        peer.join(timeout=30)
        assert peer.exitcode == 0


def test_second_engine_of_a_process_skips_symmetric_memory():
    """The first engine's ranks set symmetric memory up; in the second, the driver has joined a
    rendezvous before and its new peer has not (torch would wait in the rendezvous for 30 min,
    benchmarks/results/2026-11-27c-cpu-symm-norm-hang): neither rank sets it up."""
    built = torch.full((2, 2), -1, dtype=torch.int32).share_memory_()
    driver = multiprocessing.get_context("fork").Process(target=_driver, args=(built,))
    driver.start()
    driver.join(timeout=60)
    if driver.is_alive():
        driver.kill()
        pytest.fail("the ranks did not agree within 60 s")
    assert driver.exitcode == 0
    assert built.tolist() == [[1, 1], [0, 0]]
