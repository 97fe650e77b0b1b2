"""Structured outputs' grammar work in a process of its own (`StructuredOutputsConfig.
grammar_process`, PHLOEM_GRAMMAR_PROCESS=1): the engine holds a `GrammarProcessClient` with the
`StructuredOutputManager` calls it makes, and the manager runs in a spawned child
(`grammar_child.py`) with its own interpreter.

Why: in the engine's process the fill runs on a thread that needs the GIL each time it comes
back from one of the library's GIL-released calls (each row batch's advance and fill, its
thread hand-overs), while the engine loop runs Python beside it; a thread woken then waits up
to the interpreter's switch interval (5 ms). On an H200 host the library's fill of 1,024 rows
took 24-29 ms but ended ~42 ms after its tokens were handed over (benchmarks/results/
2026-11-27d-h200). In a child the fill never waits for the loop's GIL:

    engine loop                                       grammar process
    collected(N): send ("step", N's ids and tokens,  ─► advance ─► ("advanced", rows that end)
                   N+1's rows)                          fill N+1's rows into shared memory
    update(N), advance: wait for "advanced" ◄──────     ─► ("filled", buffer, failed rows)
    outputs, schedule, prepare N+2 (Python)              │
    bitmask(N+1): wait for "filled" ◄────────────────────┘ a view of the shared buffer

The bitmask is two int32 [rows, W] buffers in one `multiprocessing.shared_memory` segment,
filled in turn as the manager's own two are (a buffer is rewritten only after the step that
read it was collected); with a GPU the segment is page-locked (`cudaHostRegister`), so the
worker's copy to the device (`ops.token_bitmask.bitmask_to_device`) reads it directly, as the
in-process manager's pinned buffers. It starts at 256 rows and moves to a larger segment when a
step has more rows (up to the engine's `max_num_seqs`; the old one is unlinked two fills later),
so /dev/shm holds what the batch needs, not 2 x 2,048 rows (66 MB at 128K tokens). The parent keeps the registered ids (`constrained_ids`),
batches registrations and forgets into one message before its next request, and learns which
matchers are ready from the child's "ready" messages, read when it asks (`is_ready`) or waits.
It reads the pipe only on the engine loop's thread, blocking reads releasing the GIL.

A constraint is still checked in the engine's process (`StructuredOutputs.check`: a bad schema
is a ValueError at add time). When the child dies (or stops answering for `_REPLY_TIMEOUT_S`),
every constrained row fails with a message naming the grammar process, from then on: advances
end nothing, fills allow every token and fail their rows, matchers count as ready; unconstrained
requests go on. `shutdown` stops and joins the child and unlinks the segment.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, KeysView

import numpy as np

from phloem.sampling_params import StructuredOutputsParams
from phloem.structured_output.backend import bitmask_width
from phloem.structured_output.bitmask_segment import BitmaskSegment
from phloem.structured_output.grammar_child import GrammarProcessSpec, child_main
from phloem.structured_output.manager import GrammarBitmask, GrammarStats

logger = logging.getLogger(__name__)

GRAMMAR_PROCESS_ENV = "PHLOEM_GRAMMAR_PROCESS"
_LIVENESS_S = 0.5  # how often a wait looks at whether the child is alive [s]
_REPLY_TIMEOUT_S = 120.0  # a reply not come by then: the child is taken as dead [s]
_READY_POLL_S = 0.0005  # `is_ready` reads the pipe at most this often [s]
_FIRST_ROWS = 256  # rows of the first segment (grown to a step's rows, up to `max_rows`)


class GrammarProcessError(RuntimeError):
    """The grammar process raised on a request (its message is the child's exception)."""


def grammar_process_from_env(default: bool) -> bool:
    """PHLOEM_GRAMMAR_PROCESS "1" (on) or "0" (off), else `default`.

    Raises:
        ValueError: naming PHLOEM_GRAMMAR_PROCESS for another value.
    """
    value = os.environ.get(GRAMMAR_PROCESS_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{GRAMMAR_PROCESS_ENV} must be 0 or 1, got {value!r}")
    return default if not value else value == "1"


class _Reply:
    """A request's reply, read from the pipe by `result()` (on the engine loop's thread).

    Attributes:
        kind: "advanced", "filled" or "stats". fill_ids: a fill's rows. sent_at: when the
            request was sent [perf_counter s]. rows: the indices of an advance's rows sent
            (None: all), to which the child's row numbers are mapped back.
    """

    __slots__ = ("kind", "fill_ids", "rows", "sent_at", "value", "error", "is_done", "_client")

    def __init__(self, client: GrammarProcessClient, kind: str, fill_ids=None) -> None:
        self._client, self.kind, self.fill_ids = client, kind, fill_ids
        self.rows: list[int] | None = None  # an advance's rows sent, where not all were
        self.sent_at = time.perf_counter()
        self.value: object = None
        self.error: str | None = None
        self.is_done = False

    def result(self):
        """The reply's value, waiting for it.

        Raises:
            GrammarProcessError: the child raised handling the request.
        """
        deadline = self.sent_at + _REPLY_TIMEOUT_S
        while not self.is_done:
            if self._client.dead is not None:  # (settled at its death; a safeguard)
                self._client.settle(self)
                break
            self._client.receive(deadline)
            if not self.is_done and time.perf_counter() >= deadline:
                self._client.kill(f"did not answer in {_REPLY_TIMEOUT_S:.0f} s")
        if self.error is not None:
            raise GrammarProcessError(f"grammar process: {self.error}")
        return self.value

    def exception(self) -> BaseException | None:
        """`result()`'s exception or None, waiting for the reply (as a Future's)."""
        try:
            self.result()
        except GrammarProcessError as e:
            return e
        return None


class GrammarProcessClient:
    """The `StructuredOutputManager` calls of the engine (`engine/structured_outputs.py`),
    answered by a manager in a grammar process (module docstring); plus `start_step` and
    `start_fill`, which return replies to wait for instead of results. Not thread-safe: the
    engine loop's thread only.

    Args:
        spec: the child's backend and manager (`GrammarProcessSpec`).
        pin_memory: page-lock the shared bitmask (with a GPU; see the module docstring).
        on_fill: called with (lag, fill, total) seconds for each fill read back: from the
            request's send to the child's receipt, the child's fill, and from the send to the
            fill's end.
        first_rows: rows of the first shared-memory segment (grown to a step's rows, up to
            `spec.max_rows`: 2 x 2,048 rows of a 128K vocabulary would be 66 MB, more than a
            container's usual /dev/shm).

    Raises:
        ValueError: /dev/shm has no room for the first segment, or this is a daemon process
            (which cannot start one).
    """

    def __init__(
        self,
        spec: GrammarProcessSpec,
        pin_memory: bool = False,
        on_fill: Callable[[float, float, float], None] | None = None,
        first_rows: int = _FIRST_ROWS,
    ) -> None:
        if multiprocessing.current_process().daemon:
            raise ValueError("a daemon process cannot start the grammar process")
        self.width = bitmask_width(spec.vocab_size)
        self._pin = pin_memory
        self._segment = BitmaskSegment(min(spec.max_rows, first_rows), self.width, pin_memory)
        self._segments = [self._segment]  # not released yet (the finalizer's)
        self._retired: list[tuple[int, BitmaskSegment]] = []  # (released after that many fills, it)
        self._num_fills = 0
        ctx = multiprocessing.get_context("spawn")  # the parent has CUDA and threads: no fork
        self._conn, child = ctx.Pipe()
        args = (child, spec, self._segment.shm.name, self._segment.rows)
        self._process = ctx.Process(target=child_main, args=args, name="phloem-grammar",
                                    daemon=True)  # fmt: skip
        self._process.start()
        child.close()
        self._finalizer = weakref.finalize(self, _release, self._process, self._conn,
                                           self._segments)  # fmt: skip
        self._live: dict[str, None] = {}  # registered, not forgotten (insertion order)
        self._ready: set[str] = set()  # of those, matchers built (or failed)
        self._sampled: set[str] = set()  # of those, in a fill: the child made their matchers
        self._ops: list[tuple] = []  # registrations and forgets not sent yet
        self._replies: deque[_Reply] = deque()  # sent requests, in the child's reply order
        self._polled_at = 0.0
        self._last_turn = 1
        self._stats = GrammarStats()
        self._on_fill = on_fill
        self.max_rows = spec.max_rows
        self.dead: str | None = None  # why constrained rows fail, once the child is gone

    # -- the manager's calls ---------------------------------------------------------------------

    def register(self, seq_id: str, params: StructuredOutputsParams) -> None:
        """Queue the sequence's registration (sent with the next request)."""
        self._live[seq_id] = None
        self._ops.append(("r", seq_id, params))

    def forget(self, seq_id: str) -> None:
        """Drop a finished sequence (unknown ids are ignored)."""
        if self._live.pop(seq_id, 0) is None:
            self._ready.discard(seq_id)
            self._sampled.discard(seq_id)
            self._ops.append(("f", seq_id))

    def is_constrained(self, seq_id: str) -> bool:
        return seq_id in self._live

    @property
    def constrained_ids(self) -> KeysView[str]:
        """The ids registered and not forgotten (a live view)."""
        return self._live.keys()

    @property
    def num_live(self) -> int:
        return len(self._live)

    def is_ready(self, seq_id: str) -> bool:
        """As `StructuredOutputManager.is_ready`, from the child's "ready" messages read so far
        (the pipe is read here at most every `_READY_POLL_S`)."""
        if seq_id in self._ready or seq_id not in self._live or self.dead is not None:
            return True
        now = time.perf_counter()
        if now - self._polled_at >= _READY_POLL_S:
            self._polled_at = now
            self._send(None)
            while self.dead is None and self._conn.poll(0):
                self.receive(None)
        return seq_id in self._ready or self.dead is not None

    def wait_ready(self, seq_ids: list[str], timeout: float | None = None) -> bool:
        """Wait until these sequences are ready or `timeout` seconds [s] passed (None: no
        limit); True if all are."""
        self._send(None)
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            todo = [s for s in seq_ids if s in self._live and s not in self._ready]
            if not todo or self.dead is not None:
                return True
            if deadline is not None and time.perf_counter() >= deadline:
                return False
            self.receive(deadline)

    def start_step(
        self, ids: list[str] | None, tokens: list[int] | None, fill_ids: list[str] | None
    ) -> tuple[_Reply | None, _Reply | None]:
        """Send one request: advance the rows (ids[k] by tokens[k]), then fill `fill_ids`
        (either None: skipped). Returns the replies: "advanced" ({k: True or None} as
        `StructuredOutputManager.accept_rows`), then "filled" ((GrammarBitmask, {seq id:
        reason}) as `StructuredOutputManager.bitmask`; its bitmask a view of the shared
        memory, valid until the second fill after it).

        Raises:
            ValueError: more fill rows than `max_rows`.
        """
        if fill_ids is not None and len(fill_ids) > self._segment.rows and self.dead is None:
            self._grow(len(fill_ids))
        advanced = None if ids is None else _Reply(self, "advanced")
        if ids is not None:  # only rows with matchers (made by a fill) advance
            sampled = self._sampled
            rows = [k for k, seq_id in enumerate(ids) if seq_id in sampled]
            if len(rows) < len(ids):
                advanced.rows = rows  # type: ignore[union-attr]
                ids, tokens = [ids[k] for k in rows], [tokens[k] for k in rows]  # type: ignore[index]
        filled = None if fill_ids is None else _Reply(self, "filled", list(fill_ids))
        if fill_ids is not None:
            self._sampled.update(s for s in fill_ids if s in self._live)
        replies = [r for r in (advanced, filled) if r is not None]
        if advanced is not None and not ids:  # nothing to advance: ends no row
            advanced.value, advanced.is_done = {}, True
            replies.remove(advanced)
            ids = tokens = None
        if replies and self._send(("step", ids, tokens, fill_ids), replies):
            self._replies.extend(replies)
        return advanced, filled

    def start_fill(self, fill_ids: list[str]) -> _Reply:
        """`start_step(None, None, fill_ids)`'s "filled" reply."""
        return self.start_step(None, None, fill_ids)[1]  # type: ignore[return-value]

    def accept_rows(self, seq_ids: list[str], token_ids: list[int]) -> dict[int, bool | None]:
        """As `StructuredOutputManager.accept_rows` (waits for the child)."""
        return self.start_step(seq_ids, token_ids, None)[0].result()  # type: ignore[union-attr]

    def bitmask(self, seq_ids: list[str]) -> tuple[GrammarBitmask, dict[str, str]]:
        """As `StructuredOutputManager.bitmask` (waits for the child)."""
        return self.start_fill(seq_ids).result()

    @property
    def stats(self) -> GrammarStats:
        """The child manager's `GrammarStats` (asked for: benchmarks; the last known once the
        child is gone)."""
        reply = _Reply(self, "stats")
        if self._send(("stats",), [reply]):
            self._replies.append(reply)
            self._stats = GrammarStats(**reply.result())
        return self._stats

    def _grow(self, num_rows: int) -> None:
        """Move the fills to a segment of at least `num_rows` rows (twice the current one's, at
        most `max_rows`); the old one is released once two fills came after it (the views it
        gave are read until then: `GrammarBitmask`). No room in /dev/shm: the child is
        `kill`ed (constrained rows fail, with the reason).

        Raises:
            ValueError: more rows than `max_rows`.
        """
        if num_rows > self.max_rows:
            raise ValueError(f"{num_rows} bitmask rows, the grammar process holds {self.max_rows}")
        rows = min(self.max_rows, max(num_rows, 2 * self._segment.rows))
        try:
            segment = BitmaskSegment(rows, self.width, self._pin)
        except ValueError as e:
            self.kill(f"could not grow its bitmask: {e}")
            return
        self._segments.append(segment)
        self._retired.append((self._num_fills + 2, self._segment))
        self._segment = segment
        self._send(("buffers", segment.shm.name, rows))

    def _filled(self) -> None:
        """Count a fill read back (or settled); release the segments it retired."""
        self._num_fills += 1
        while self._retired and self._retired[0][0] <= self._num_fills:
            segment = self._retired.pop(0)[1]
            segment.release()
            self._segments.remove(segment)

    @property
    def pid(self) -> int | None:
        """The grammar process's id."""
        return self._process.pid

    def reset_max_ready_lag(self) -> None:
        self._send(("reset_lag",))

    def shutdown(self) -> None:
        """Stop and join the child, then close and unlink the shared memory; idempotent."""
        if self.dead is None:
            self._send(("stop",))
            self.dead = "structured output: the grammar process was shut down"
        self._finalizer()

    # -- the pipe --------------------------------------------------------------------------------

    def receive(self, deadline: float | None) -> None:
        """Read and handle one message from the child, waiting at most until `deadline`
        (perf_counter s; None: no limit) and looking at the child's liveness every
        `_LIVENESS_S`: a child gone (its pipe closed, or not alive) is `_died`."""
        while self.dead is None:
            wait = _LIVENESS_S
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.perf_counter()))
            try:
                if self._conn.poll(wait):
                    self._handle(self._conn.recv())
                    return
            except (EOFError, OSError):
                self._died(None)
                return
            if not self._process.is_alive():
                self._died(None)
            elif deadline is not None and time.perf_counter() >= deadline:
                return

    def kill(self, reason: str) -> None:
        """Take the child as dead for `reason` (it is terminated): see the module docstring."""
        if self.dead is None:
            self._process.terminate()
            self._died(reason)

    def _send(self, message: tuple | None, replies: list[_Reply] | None = None) -> bool:
        """Send the queued registrations and forgets, then `message` (None: none); True when
        sent. With the child gone, `replies` (the message's) are settled at once instead."""
        if self.dead is None:
            try:
                while self._conn.poll(0):  # what came first (ready lists): no pipe fills up
                    self._handle(self._conn.recv())
            except (EOFError, OSError):
                self._died(None)
        if self.dead is None:
            try:
                if self._ops:
                    ops, self._ops = self._ops, []
                    self._conn.send(("ops", ops))
                if message is not None:
                    self._conn.send(message)
                return True
            except (OSError, ValueError):  # the pipe is broken or closed
                self._died(None)
        self._ops.clear()
        for reply in replies or ():
            self.settle(reply)
        return False

    def _handle(self, message: tuple) -> None:
        """Apply one message of the child (`grammar_child` module docstring)."""
        kind = message[0]
        if kind == "ready":
            self._ready.update(s for s in message[1] if s in self._live)
            return
        if kind == "fatal":
            self._died(f"could not build its grammar backend: {message[1]}")
            return
        reply = self._replies.popleft()
        assert reply.kind == kind, (reply.kind, kind)
        if kind == "stats":
            reply.value = message[1]
        elif kind == "advanced":
            ended, reply.error = message[1], message[2]
            if ended and reply.rows is not None:
                ended = {reply.rows[j]: done for j, done in ended.items()}
            reply.value = ended
        else:
            value, reply.error, (received, start, end) = message[1:]
            if value is not None:
                turn, failed = value
                self._last_turn = turn
                rows = self._segment.views[turn][: len(reply.fill_ids)]  # type: ignore[index]
                reply.value = (GrammarBitmask(reply.fill_ids, rows), failed)
            self._filled()
            if self._on_fill is not None:
                self._on_fill(received - reply.sent_at, end - start, end - reply.sent_at)
        reply.is_done = True

    def _died(self, reason: str | None) -> None:
        """The child is gone: say why from now on (`dead`) and settle every reply waited for."""
        if self.dead is not None:
            return
        self._process.join(timeout=1.0)
        if reason is None:
            reason = f"exited with code {self._process.exitcode}"
        self.dead = f"structured output: the grammar process (pid {self._process.pid}) {reason}"
        logger.error("%s; constrained requests fail from now on", self.dead)
        self._ops.clear()
        while self._replies:
            self.settle(self._replies.popleft())

    def settle(self, reply: _Reply) -> None:
        """Resolve a reply the dead child will not send: an advance ends no row, a fill allows
        every token and fails every row (`dead`)."""
        if reply.kind == "advanced":
            reply.value = {}
        elif reply.kind == "stats":
            reply.value = {f: getattr(self._stats, f) for f in self._stats.__dataclass_fields__}
        else:
            ids, message = reply.fill_ids, self.dead or "structured output: no grammar process"
            views = self._segment.views
            if views is not None and len(ids) <= self._segment.rows:
                self._last_turn ^= 1
                rows = views[self._last_turn][: len(ids)]
                rows[:] = -1
            else:
                rows = np.full((len(ids), self.width), -1, dtype=np.int32)
            reply.value = (GrammarBitmask(ids, rows), dict.fromkeys(ids, message))
            self._filled()
        reply.is_done = True


def _release(process, conn, segments: list[BitmaskSegment]) -> None:
    """Stop and join the child (terminated after 5 s), then release every segment
    (`GrammarProcessClient.shutdown`, or at collection or exit)."""
    try:
        conn.send(("stop",))
    except (OSError, ValueError):
        pass
    process.join(timeout=5.0)
    if process.is_alive():
        process.terminate()
        process.join(timeout=1.0)
    conn.close()
    for segment in segments:
        segment.release()
    segments.clear()
