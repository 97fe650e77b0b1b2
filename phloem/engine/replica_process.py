"""One data-parallel replica process (`engine.data_parallel`): the process's main loop, and the
parent's handle on it (the process, its pipe, how it is stopped and how its death is reported).

The pipe's protocol: parent -> replica ("batch", `replica_share.Share`) | ("abort",) |
("stop",); replica -> parent ("ready", info) | ("output", index, RequestOutput) | ("done",
stats) | ("error", message, traceback text); an output travels without its prompt text and
ids (the parent puts them back). The replica ignores SIGINT (its parent handles
interrupts and stops it) and exits when the parent's end of the pipe closes, so it never
outlives the parent. During a batch it looks at its pipe after every engine step (a step
observer), so an "abort" or "stop" ends the batch within one step; the parent still terminates
a replica that does not stop within `STOP_GRACE_S` (loading its model, or hung) and kills one
that survives `KILL_GRACE_S` more.
This module imports no torch at import time: a spawned replica sets its thread count and
CUDA_VISIBLE_DEVICES before torch loads.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Sequence

from phloem.engine.replica_share import Share, decode_share
from phloem.engine_args import EngineArgs

STOP_GRACE_S = 5.0  # a replica told to stop must exit within this before it is terminated [s]
KILL_GRACE_S = 2.0  # a terminated replica must exit within this before it is killed [s]


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a replica process, as text: the `__cause__` of
    the `ReplicaError` that reports it, so Python prints it under the parent's error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "the replica's traceback:\n" + self.text.rstrip()


class ReplicaError(RuntimeError):
    """A data-parallel replica died or failed; the message (one line) names the replica.

    Attributes:
        replica: its index. remote_traceback: the replica's traceback text when an exception
            in it caused the failure (also the `__cause__`, a `RemoteTraceback`), else None.
    """

    def __init__(self, replica: int, message: str, remote_traceback: str | None = None) -> None:
        super().__init__(f"data-parallel replica {replica} {message}")
        self.replica = replica
        self.remote_traceback = remote_traceback
        if remote_traceback:
            self.__cause__ = RemoteTraceback(remote_traceback)


class _ParentSpoke(Exception):
    """The parent sent a message during a batch ("abort" or "stop"): raised by the replica's
    step observer so that the batch ends after the step that saw it."""


def _error(e: BaseException) -> tuple[str, str, str]:
    """The "error" message of an exception raised in this replica: one line and the traceback."""
    first = f"{type(e).__name__}: {e}".splitlines()
    return "error", first[0] if first else type(e).__name__, traceback.format_exc()


def _replica_main(rank: int, args: EngineArgs, env: dict[str, str], threads: int, conn) -> None:
    """A replica's process: build the engine, say "ready", then serve batches until "stop" or
    until the parent's end of the pipe closes. Interrupts are the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        import torch

        torch.set_num_threads(threads)
        from phloem.bench.report import engine_info
        from phloem.engine.llm import LLM

        llm = LLM.from_engine_args(args)
        info = {"max_model_len": llm.llm_engine.max_model_len, "pid": os.getpid()}
        conn.send(("ready", {**info, "engine": engine_info(llm)}))
    except BaseException as e:  # start-up failed: the parent raises it naming this replica
        conn.send(_error(e))
        return
    try:
        while (message := conn.recv())[0] != "stop":
            if message[0] == "batch" and not _serve_batch(llm, conn, message[1]):
                return
    except (EOFError, OSError):  # the parent is gone
        return


def _serve_batch(llm, conn, share: Share) -> bool:
    """Run one share (unpacked here, queued under the driver's plan when it carries one) and
    stream its outputs back, each under its index in the parent's batch and without its prompt
    (the parent has it); a message from the parent meanwhile ("abort" or "stop") ends it after
    the current step. Ends with "done" (stats) or "error". Returns False when the parent said
    "stop". The stats carry `received_at` and `queued_at`: `time.monotonic()` when the share was
    unpacked and queued (the clock is the host's, the same in the parent).

    Raises:
        EOFError, OSError: the parent is gone.
    """
    from phloem.bench.report import attention_stats

    engine = llm.llm_engine
    before = engine.num_computed_prompt_tokens

    def watch(record) -> None:  # a step observer: the pipe is looked at once per step
        if conn.poll():
            raise _ParentSpoke()

    engine.add_step_observer(watch)
    keep_running, outputs = True, None
    try:
        encoded, params, plan = decode_share(share)
        received_at = time.monotonic()
        request_ids = llm.add_requests(encoded, params, validated=True, plan=plan)
        queued_at = time.monotonic()
        index = {request_id: share.indices[k] for k, request_id in enumerate(request_ids)}
        outputs = llm.iter_outputs(request_ids, use_tqdm=False)
        for output in outputs:
            bare = dataclasses.replace(output, prompt=None, prompt_token_ids=[])
            conn.send(("output", index[output.request_id], bare))
    except _ParentSpoke:  # the engine aborted the batch's requests on the way out
        keep_running = conn.recv()[0] != "stop"
    except OSError:
        raise
    except Exception as e:  # the engine stopped this batch; this replica stays usable
        conn.send(_error(e))
        return True
    finally:
        engine.remove_step_observer(watch)
        if outputs is not None:
            outputs.close()  # aborts what did not finish
    computed = engine.num_computed_prompt_tokens - before
    times = {"received_at": received_at, "queued_at": queued_at}
    stats = {"num_computed_prompt_tokens": computed, "attention": attention_stats(llm)}
    conn.send(("done", {**stats, **times}))
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
        self.engine_info: dict = {}  # its engine's resolved settings, from its "ready"

    def died(self, when: str) -> ReplicaError:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return ReplicaError(self.rank, f"(pid {self.process.pid}) died {when} ({how})")

    def stop(self) -> None:
        """Ask the process to exit; terminate it after `STOP_GRACE_S`, kill it after
        `KILL_GRACE_S` more (`shutdown`)."""
        shutdown([self])


def shutdown(replicas: Sequence[Replica]) -> None:
    """Stop every replica process and reap it (also the finalizer of `DataParallelEngine`: at
    exit or collection): "stop" to all, then each still alive after `STOP_GRACE_S` (all of them
    together) is terminated, and killed if it is still alive `KILL_GRACE_S` later. When it
    returns, every process has exited. Idempotent."""
    for r in replicas:
        if r.process.is_alive():
            try:
                r.conn.send(("stop",))
            except (OSError, ValueError):
                pass
    _join_all(replicas, STOP_GRACE_S)
    for r in replicas:
        if r.process.is_alive():
            r.process.terminate()
    _join_all(replicas, KILL_GRACE_S)
    for r in replicas:
        if r.process.is_alive():
            r.process.kill()
        r.process.join()  # exited: reaped
        r.conn.close()


def _join_all(replicas: Sequence[Replica], timeout_s: float) -> None:
    """Wait until every process exited or `timeout_s` passed (one deadline for all)."""
    deadline = time.monotonic() + timeout_s
    for r in replicas:
        r.process.join(timeout=max(deadline - time.monotonic(), 0.0))


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
