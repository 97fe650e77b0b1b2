"""Leaving a tensor-parallel group never hangs the process: every member frees its CUDA graphs
before the teardown (a graph that captured NCCL collectives made `ncclCommAbort` wait forever on
two H200s), each teardown call is bounded in time, and the rank processes exit at once with
status 0 after "stop". A rank's death ends the step in flight: the watchdog's abort reaches the
fused all-reduce's barriers, and the step collected next raises instead of returning tokens."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch.distributed as dist

from phloem import LLM
from phloem.distributed import parallel_state
from phloem.distributed.parallel_state import (
    destroy_tensor_parallel,
    finished_within,
    init_tensor_parallel,
    tp_size,
)
from phloem.distributed.worker_process import TensorParallelError
from phloem.engine.tp_executor import TensorParallelExecutor, _free_port, _Group, _Handle
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


def test_abort_tells_the_fused_all_reduce(monkeypatch):
    calls = []

    class Fused:
        def abort(self) -> None:
            calls.append("abort")

    state = parallel_state.TensorParallelState(fused_norm=Fused())
    monkeypatch.setattr(parallel_state, "_state", state)
    parallel_state.abort_tensor_parallel()
    assert calls == ["abort"]


def test_step_collected_after_a_rank_died_raises():
    """The watchdog saw a rank die and aborted the group: the step's all-reduces ended with
    garbage (an aborted NCCL collective, a symm_norm barrier that gave up), so its tokens are
    not returned; the executor stops the group."""

    class Runner:
        def collect(self, inner) -> str:
            return "tokens"

    class Worker:
        num_blocks = 4
        model_runner = Runner()

        def release_cuda_graphs(self) -> None:
            pass

    group = _Group([])
    executor = TensorParallelExecutor(Worker(), group)
    assert executor.collect(_Handle(1, None)) == "tokens"
    group.rank_died = True
    with pytest.raises(TensorParallelError, match="a rank died during the step"):
        executor.collect(_Handle(2, None))
    assert group.closed
