"""One data-parallel replica process (`engine.data_parallel`): the process's main loop, and the
parent's handle on it (the process, its pipe, how it is stopped and how its death is reported).

The pipe's protocol: parent -> replica ("batch", indices, encoded, params) | ("abort",) |
("stop",); replica -> parent ("ready", info) | ("output", index, RequestOutput) | ("done",
stats) | ("error", text). The replica ignores SIGINT (its parent handles interrupts and stops
it) and exits when the parent's end of the pipe closes, so it never outlives the parent.
This module imports no torch at import time: a spawned replica sets its thread count and
CUDA_VISIBLE_DEVICES before torch loads.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Sequence

from phloem.engine_args import EngineArgs

STOP_TIMEOUT_S = 10.0  # a replica told to stop must exit within this before it is terminated


class ReplicaError(RuntimeError):
    """A data-parallel replica died or failed; the message names the replica."""

    def __init__(self, replica: int, message: str) -> None:
        super().__init__(f"data-parallel replica {replica} {message}")
        self.replica = replica


def _replica_main(rank: int, args: EngineArgs, env: dict[str, str], threads: int, conn) -> None:
    """A replica's process: build the engine, say "ready", then serve batches until "stop" or
    until the parent's end of the pipe closes. Interrupts are the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        import torch

        torch.set_num_threads(threads)
        from phloem.engine.llm import LLM

        llm = LLM.from_engine_args(args)
        conn.send(("ready", {"max_model_len": llm.llm_engine.max_model_len, "pid": os.getpid()}))
    except BaseException as e:  # start-up failed: the parent raises it naming this replica
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    try:
        while (message := conn.recv())[0] != "stop":
            if message[0] == "batch" and not _serve_batch(llm, conn, *message[1:]):
                return
    except (EOFError, OSError):  # the parent is gone
        return


def _serve_batch(llm, conn, indices: list[int], encoded: list, params: list) -> bool:
    """Run one share and stream its outputs back, each under its index in the parent's batch;
    a message from the parent meanwhile ("abort" or "stop") ends it early. Ends with "done"
    (stats) or "error". Returns False when the parent said "stop".

    Raises:
        EOFError, OSError: the parent is gone.
    """
    engine = llm.llm_engine
    before = engine.num_computed_prompt_tokens
    outputs = llm.run_batch(lambda: (encoded, params), use_tqdm=False)
    keep_running = True
    try:
        for k, output in outputs:
            conn.send(("output", indices[k], output))
            if conn.poll():
                keep_running = conn.recv()[0] != "stop"
                break
    except OSError:
        raise
    except Exception as e:  # the engine stopped this batch; this replica stays usable
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return True
    finally:
        outputs.close()  # aborts what did not finish
    conn.send(("done", {"num_computed_prompt_tokens": engine.num_computed_prompt_tokens - before}))
    return keep_running


class Replica:
    """The parent's handle on one replica process and its pipe."""

    def __init__(self, rank: int, args: EngineArgs, env: dict[str, str], threads: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.rank = rank
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_replica_main,
            args=(rank, args, env, threads, child),
            name=f"phloem-replica-{rank}",
            daemon=False,  # a replica may start worker processes of its own (torch.compile)
        )
        self.process.start()
        child.close()  # the parent keeps one end: the pipe reports EOF when the replica dies
        self.max_model_len = 0  # its engine's context length [tokens], from its "ready"

    def died(self, when: str) -> ReplicaError:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return ReplicaError(self.rank, f"(pid {self.process.pid}) died {when} ({how})")

    def stop(self) -> None:
        """Ask the process to exit; terminate it after `STOP_TIMEOUT_S`, kill it after that."""
        shutdown([self])


def shutdown(replicas: Sequence[Replica]) -> None:
    """Stop every replica process (also the finalizer of `DataParallelEngine`: at exit or
    collection). Idempotent."""
    for r in replicas:
        if r.process.is_alive():
            try:
                r.conn.send(("stop",))
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for r in replicas:
        r.process.join(timeout=max(deadline - time.monotonic(), 0.0))
        for end in (r.process.terminate, r.process.kill):
            if r.process.is_alive():
                end()
                r.process.join(timeout=STOP_TIMEOUT_S)
        r.conn.close()


def receive(replica: Replica, when: str) -> tuple:
    """The next message of `replica` that `wait` found ready (its pipe or its sentinel).

    Raises:
        ReplicaError: the replica died (its pipe is closed and empty).
    """
    try:
        if replica.conn.poll():
            return replica.conn.recv()
    except (EOFError, OSError):
        pass
    raise replica.died(when)
