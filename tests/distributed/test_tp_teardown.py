"""Leaving a tensor-parallel group never hangs the process: every member frees its CUDA graphs
before the teardown (a graph that captured NCCL collectives made `ncclCommAbort` wait forever on
two H200s), each teardown call is bounded in time, and the rank processes exit at once with
status 0 after "stop"."""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from phloem import LLM
from phloem.distributed import parallel_state
from phloem.distributed.parallel_state import (
    destroy_tensor_parallel,
    finished_within,
    init_tensor_parallel,
    tp_size,
)
from phloem.engine.tp_executor import _free_port
from tests.engine.tiny_models import write_tiny_model


def test_finished_within_reports_a_call_that_does_not_return():
    release = threading.Event()
    try:
        assert not finished_within(release.wait, 0.2)
        assert finished_within(lambda: None, 5.0)
    finally:
        release.set()


def test_destroy_gives_up_on_a_teardown_that_hangs(monkeypatch, caplog):
    init_tensor_parallel(0, 1, f"tcp://127.0.0.1:{_free_port()}", "gloo")
    real_destroy = dist.destroy_process_group
    release = threading.Event()
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait())
    monkeypatch.setattr(parallel_state, "abort_tensor_parallel", lambda: release.wait())
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="phloem.distributed.parallel_state"):
            destroy_tensor_parallel(timeout_s=0.2)
        assert time.monotonic() - start < 5.0
        assert tp_size() == 1
        assert "did not finish" in caplog.text
    finally:
        release.set()
        monkeypatch.undo()
        if dist.is_initialized():
            real_destroy()


def test_close_frees_cuda_graphs_before_leaving_and_ranks_exit_cleanly(
    tmp_path, embedded_tokenizer_dir
):
    write_tiny_model("llama", tmp_path, embedded_tokenizer_dir, seed=3, num_kv_heads=2)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, dtype="float32", block_size=4)
    group = llm.llm_engine.executor._group
    in_group_at_release = []
    free_graphs = group.before_leave

    def record() -> None:
        in_group_at_release.append(dist.is_initialized())
        free_graphs()

    group.before_leave = record
    processes = [r.process for r in group.ranks]
    llm.close()
    assert in_group_at_release == [True]  # the driver's graphs go before its group does
    assert not dist.is_initialized()
    assert [p.exitcode for p in processes] == [0]
