"""The tensor-parallel executor: rank 0's `Worker` in the engine's process (the driver), ranks
1..N-1 in spawned processes (`phloem.distributed.worker_process`), all fed the same data-only
`SchedulerOutput` (Megatron-LM, Shoeybi et al. 2019, §3 for what each rank holds).

Each step the driver encodes the scheduler output once (`distributed/step_codec.py`: ~0.4 us a
sequence) and writes it to every rank's pipe, then runs its own share; the ranks meet in the
model's collectives (NCCL on CUDA, gloo on the CPU). Every rank samples the all-gathered logits
with the same seeds, so only the driver's tokens are returned and no tokens travel back. A
watchdog thread waits on the rank processes: when one dies it aborts an NCCL group (whose
collectives would wait for the dead peer) and the symm_norm kernel's barriers (which would spin
forever), and the step collected next raises; gloo's collectives fail on their own. Any failure of a step, on
any rank, stops the group and raises `TensorParallelError` naming the rank; the executor refuses
later steps (so does an interrupt in the middle of a launch, after which the ranks could wait in
collectives the driver never reaches). `shutdown` (also at garbage collection and exit) stops
the processes and leaves the process group.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from phloem.config import EngineConfig, SchedulerConfig
from phloem.core.scheduler_output import SchedulerOutput
from phloem.distributed.parallel_state import (
    abort_tensor_parallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from phloem.distributed.step_codec import encode_step
from phloem.distributed.symm_all_reduce import all_reduce_choice
from phloem.distributed.worker_process import (
    RankProcess,
    RankSpec,
    TensorParallelError,
    send_stop,
    stop_ranks,
)
from phloem.engine.executor import Executor
from phloem.structured_output.manager import GrammarBitmask
from phloem.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # a rank must load its shards within this [s]
JOIN_TIMEOUT_S = 300.0  # and start its process (import torch) within this [s]


@dataclass
class _Handle:
    step_no: int
    inner: Any  # the driver's `LaunchedStep` (None for a step that samples nothing)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Group:
    """The rank processes and the driver's membership; `close` ends both (idempotent)."""

    def __init__(self, ranks: list[RankProcess]) -> None:
        self.ranks = ranks
        self.closed = False
        self.before_leave: Callable[[], None] | None = None  # the driver frees its CUDA graphs
        self.rank_died = False  # set by the watchdog, before it aborts the group
        self._stop_r, self._stop_w = os.pipe()
        self.watchdog = threading.Thread(target=self._watch, name="phloem-tp-watch", daemon=True)

    def _watch(self) -> None:
        """Abort the group's collectives when a rank dies (not when `close` stops them)."""
        ready = wait([r.process.sentinel for r in self.ranks] + [self._stop_r])
        if self._stop_r not in ready:
            self.rank_died = True
            abort_tensor_parallel()

    def failure(self, error: BaseException, when: str = "during a step") -> TensorParallelError:
        """The error to raise for a failed step: the first rank that reports one or died, else
        the driver's own (rank 0)."""
        for r in self.ranks:
            found = r.failure(when)
            if found is not None:
                return found
        return TensorParallelError(0, f"failed: {type(error).__name__}: {error}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        os.write(self._stop_w, b"x")
        if self.watchdog.is_alive():
            self.watchdog.join(timeout=5.0)
        os.close(self._stop_r)
        os.close(self._stop_w)
        send_stop(self.ranks)  # each rank leaves the group on "stop", as the driver does here
        if self.before_leave is not None:
            self.before_leave()
        destroy_tensor_parallel()
        stop_ranks(self.ranks, send=False)


class TensorParallelExecutor(Executor):
    """Runs each step on every rank; returns the driver's tokens (see the module docstring).

    Attributes:
        worker: rank 0's `Worker` (its device, KV dtype and runner describe every rank's).
    """

    def __init__(self, worker, group: _Group) -> None:
        self.worker = worker
        self.num_blocks = worker.num_blocks
        self._group = group
        self._step_no = 0
        self._collected: list[int] = []
        group.before_leave = worker.release_cuda_graphs
        self._finalizer = weakref.finalize(self, group.close)

    def launch(self, scheduler_output: SchedulerOutput) -> _Handle:
        self._check_open()
        self._step_no += 1
        payload = encode_step(("step", self._step_no, self._collected), scheduler_output)
        self._collected = []
        try:
            for r in self._group.ranks:
                r.conn.send_bytes(payload)
            inner = self.worker.model_runner.launch(scheduler_output)
        except Exception as e:
            raise self._fail(e) from e
        except BaseException:  # an interrupt: the ranks may wait in this step's collectives
            self.shutdown()
            raise
        return _Handle(self._step_no, inner)

    def collect(self, launched: _Handle | None) -> ModelRunnerOutput:
        if launched is None:
            return ModelRunnerOutput()
        self._collected.append(launched.step_no)
        try:
            output = self.worker.model_runner.collect(launched.inner)
        except Exception as e:
            raise self._fail(e) from e
        if self._group.rank_died:  # an aborted step ends with garbage in its all-reduces
            raise self._fail(RuntimeError("a rank died during the step"))
        return output

    def needs_token_history(self, scheduler_output: SchedulerOutput) -> bool:
        return self.worker.model_runner.needs_token_history(scheduler_output)

    def presample(self, launched: _Handle) -> None:
        """Every rank enqueues the constrained step's sampling up to the mask (noise and
        `Sampler.prepare`; a "presample" message, in pipe order before its "sample")."""
        self._check_open()
        payload = encode_step(("presample", launched.step_no), SchedulerOutput())
        try:
            for r in self._group.ranks:
                r.conn.send_bytes(payload)
            self.worker.model_runner.presample(launched.inner)
        except Exception as e:
            raise self._fail(e) from e

    def sample(self, launched: _Handle, grammar: GrammarBitmask) -> None:
        """Sample a launched constrained step on every rank under the same grammar bitmask (a
        "sample" message, in pipe order before the next step), so the ranks' tokens agree."""
        self._check_open()
        payload = encode_step(("sample", launched.step_no, grammar), SchedulerOutput())
        try:
            for r in self._group.ranks:
                r.conn.send_bytes(payload)
            self.worker.model_runner.sample(launched.inner, grammar)
        except Exception as e:
            raise self._fail(e) from e

    def shutdown(self) -> None:
        """Stop the rank processes and leave the process group (idempotent)."""
        self._finalizer()

    def _check_open(self) -> None:
        if self._group.closed:
            raise RuntimeError(
                "the tensor-parallel ranks were stopped (after a failure, or by close()); "
                "start a new engine"
            )

    def _fail(self, error: BaseException) -> TensorParallelError:
        failure = self._group.failure(error)
        logger.error("%s; stopping the tensor-parallel ranks", failure)
        self.shutdown()
        return failure


def start_tensor_parallel(
    config: EngineConfig,
    source,
    hf_config,
    eos_token_id: int | None,
    scheduler_config: SchedulerConfig,
) -> TensorParallelExecutor:
    """Spawn ranks 1..N-1, join the group as rank 0 and build the driver's `Worker` (the ranks
    build theirs meanwhile; their collectives meet). NCCL on CUDA (`NCCL_NVLS_ENABLE=0` unless
    set: no NVLink multicast), gloo on the CPU, where each rank gets its share of the threads.

    Raises:
        ValueError: the model does not split over tensor_parallel_size, (CUDA) there are
            fewer visible devices than ranks, this is a daemon process, or
            PHLOEM_TP_ALLREDUCE(_MAX_KB) is not a valid choice.
        TensorParallelError: naming the rank, when one fails or dies while starting.
    """
    import torch

    from phloem.worker.worker import resolve_device

    size = config.parallel.tensor_parallel_size
    if multiprocessing.current_process().daemon:
        raise ValueError(
            f"tensor_parallel_size={size} starts rank processes, which a daemon process cannot "
            "(start the engine from a non-daemon process)"
        )
    cuda = resolve_device(config.model.device).type == "cuda"
    config.parallel.validate_for_model(hf_config, torch.cuda.device_count() if cuda else None)
    all_reduce_choice()  # a bad PHLOEM_TP_ALLREDUCE* is named before any rank starts
    backend = "nccl" if cuda else "gloo"
    env = {"PHLOEM_TP_RANKS": str(size)}
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        env["NCCL_NVLS_ENABLE"] = os.environ["NCCL_NVLS_ENABLE"]
    threads = max(1, torch.get_num_threads() // size) if not cuda else torch.get_num_threads()
    kwargs = {
        "model_config": config.model, "cache_config": config.cache, "source": source,
        "hf_config": hf_config, "seed": config.seed, "eos_token_id": eos_token_id,
        "scheduler_config": scheduler_config, "speculative_config": config.speculative,
    }  # fmt: skip
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    level = logging.getLogger("phloem").getEffectiveLevel()
    specs = [RankSpec(r, size, init_method, backend, env, threads, kwargs, level)
             for r in range(1, size)]  # fmt: skip
    group = _Group([RankProcess(spec) for spec in specs])
    try:
        worker = _start_driver(group, specs[0])
    except BaseException:
        group.close()
        raise
    logger.info("tensor parallel: %d ranks over %s", size, backend)
    return TensorParallelExecutor(worker, group)


def _start_driver(group: _Group, spec: RankSpec):
    """Rank 0's part of the start: wait until every rank is joining, join the group, build the
    driver's `Worker`, then check every rank is ready with the same KV block count. Returns the
    `Worker`.

    Raises:
        TensorParallelError: naming the rank that failed, died or disagrees.
    """
    from phloem.worker.worker import Worker

    for r in group.ranks:
        r.expect("joining", JOIN_TIMEOUT_S)
    group.watchdog.start()
    init_tensor_parallel(0, spec.size, spec.init_method, spec.backend)
    try:
        worker = Worker(**spec.worker_kwargs)
    except Exception as e:
        raise group.failure(e, "while starting") from e
    for r in group.ranks:
        blocks = r.expect("ready", START_TIMEOUT_S)
        if blocks != worker.num_blocks:
            raise TensorParallelError(
                r.rank, f"holds {blocks} KV blocks, rank 0 {worker.num_blocks}"
            )
    return worker
