"""The tensor-parallel worker processes: ranks 1..N-1 of a group whose rank 0 is the engine's
own process (the driver). Spawned with `multiprocessing`'s spawn context, no torchrun.

Each rank process joins the group, builds its `Worker` (its shards of the weights, its KV heads'
cache) and then runs the steps the driver sends over its pipe, in the driver's order:

    driver -> rank: `step_codec` bytes: ("step", step_no, collected) + SchedulerOutput |
        ("sample", step_no, GrammarBitmask) (a structured-output step's sampling) | ("stop",)
    rank -> driver: ("joining", pid) | ("ready", num_blocks) | ("error", traceback text)

`collected` lists the driver's step numbers collected since its last message, so a rank collects
(appends its sampled tokens to its sequence state) and launches in the driver's order. Every rank
samples the same all-gathered logits with the same generators, so every rank's sequence state and
pending input tokens stay the driver's without a broadcast of tokens.

A rank that raises sends ("error", ...) and exits; its closed connections fail the other ranks'
collectives. A rank exits when its parent process dies (a watchdog thread on the parent's
sentinel), so no rank outlives the engine. This module imports no torch at import time: the
spawned process sets its threads and environment first.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from phloem.core.scheduler_output import SchedulerOutput
from phloem.distributed.step_codec import decode_step, encode_step

STOP_TIMEOUT_S = 10.0  # a rank told to stop must exit within this before it is terminated


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed; the message names the rank."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} {message}")
        self.rank = rank


@dataclass
class RankSpec:
    """What a rank process needs to start: its place in the group and its `Worker`'s arguments."""

    rank: int
    size: int
    init_method: str
    backend: str
    env: dict[str, str]
    threads: int
    worker_kwargs: dict[str, Any]
    log_level: int = logging.WARNING  # the driver's "phloem" logger level: the rank logs alike


def exit_with_parent() -> None:
    """Exit this process (at once, no cleanup) when the parent process dies (a thread waits on
    the parent's sentinel; for non-daemon children, which nothing else would stop)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="phloem-tp-parent-watch", daemon=True).start()


def _log_as_rank(rank: int, level: int) -> None:
    """Send this process's phloem log records to stderr at `level`, each naming the rank and
    the time (a spawned process starts with no logging set up)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    )
    logger = logging.getLogger("phloem")
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def _rank_main(spec: RankSpec, conn) -> None:
    """A rank's process: join the group, build the worker, say "ready", serve steps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver handles interrupts
    os.environ.update(spec.env)
    exit_with_parent()
    _log_as_rank(spec.rank, spec.log_level)
    try:
        conn.send(("joining", os.getpid()))
        import torch

        torch.set_num_threads(spec.threads)
        from phloem.distributed.parallel_state import init_tensor_parallel
        from phloem.worker.host_threads import cap_torch_threads
        from phloem.worker.worker import Worker

        init_tensor_parallel(spec.rank, spec.size, spec.init_method, spec.backend)
        worker = Worker(**spec.worker_kwargs)
        cap_torch_threads(worker.device.type)  # GPU ranks: 1 thread once started (`host_threads`)
        conn.send(("ready", worker.num_blocks))
        _serve(worker, conn)
        logging.shutdown()
        os._exit(0)  # no interpreter teardown: a communicator's destructor must not hang the exit
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the driver is gone
        return
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which names this rank
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except OSError:
            pass
        os._exit(1)  # closes this rank's connections: the others' collectives fail, not hang


def _serve(worker, conn) -> None:
    """Run the driver's steps until "stop": collect what the driver collected, then launch."""
    import torch

    runner = worker.model_runner
    handles: dict[int, Any] = {}
    with torch.inference_mode():
        while True:
            header, sched = decode_step(conn.recv_bytes())
            if header[0] == "stop":  # leave the group as the driver does
                from phloem.distributed.parallel_state import destroy_tensor_parallel

                worker.release_cuda_graphs()
                destroy_tensor_parallel()
                return
            if header[0] == "presample":  # a constrained step's noise, before its bitmask
                runner.presample(handles.get(header[1]))
                continue
            if header[0] == "sample":  # a constrained step's sampling, with its bitmask
                runner.sample(handles.get(header[1]), header[2])
                continue
            _, step_no, collected = header
            for no in collected:
                runner.collect(handles.pop(no, None))
            if collected:  # older steps were dropped by the driver (an aborted step in flight)
                for no in [n for n in handles if n < collected[-1]]:
                    del handles[no]
            handles[step_no] = runner.launch(sched)


class RankProcess:
    """The driver's handle on one rank process and its pipe."""

    def __init__(self, spec: RankSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.rank = spec.rank
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_rank_main,
            args=(spec, child),
            name=f"phloem-tp-rank-{spec.rank}",
            daemon=False,  # it may start processes of its own (torch.compile workers)
        )
        self.process.start()
        child.close()  # the driver keeps one end: the pipe reports EOF when the rank dies

    def expect(self, kind: str, timeout_s: float) -> Any:
        """Wait for this rank's next message, which must be `kind`; returns its payload.

        Raises:
            TensorParallelError: naming the rank, when it reports an error, dies, or says
                nothing within `timeout_s`.
        """
        ready = wait([self.conn, self.process.sentinel], timeout=timeout_s)
        if not ready:
            raise TensorParallelError(self.rank, f"sent no {kind!r} within {timeout_s:.0f} s")
        message = self.error_message()
        if message is None:
            raise self.died(f"before {kind!r}")
        if message[0] != kind:
            raise TensorParallelError(self.rank, f"failed:\n{message[1]}")
        return message[1]

    def error_message(self) -> tuple | None:
        """The next message waiting on the pipe, or None when there is none (or it closed)."""
        try:
            if self.conn.poll():
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def died(self, when: str) -> TensorParallelError:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return TensorParallelError(self.rank, f"(pid {self.process.pid}) died {when} ({how})")

    def failure(self, when: str = "during a step") -> TensorParallelError | None:
        """Why this rank stopped, when it did: its error message, or its death `when`; else
        None."""
        message = self.error_message()
        if message is not None and message[0] == "error":
            return TensorParallelError(self.rank, f"failed:\n{message[1]}")
        if not self.process.is_alive():
            return self.died(when)
        return None


def send_stop(ranks: list[RankProcess]) -> None:
    """Tell every live rank to leave the group and exit (its `_serve` returns)."""
    stop = encode_step(("stop",), SchedulerOutput())
    for r in ranks:
        if r.process.is_alive():
            try:
                r.conn.send_bytes(stop)
            except (OSError, ValueError):
                pass


def stop_ranks(ranks: list[RankProcess], send: bool = True) -> None:
    """Stop every rank process: "stop" (unless `send` is False: `send_stop` was called), then
    terminate, then kill (idempotent)."""
    if send:
        send_stop(ranks)
    for r in ranks:
        r.process.join(timeout=STOP_TIMEOUT_S)
        for end in (r.process.terminate, r.process.kill):
            if r.process.is_alive():
                end()
                r.process.join(timeout=STOP_TIMEOUT_S)
        r.conn.close()
