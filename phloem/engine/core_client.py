"""The server's asyncio front of an engine core running in its own process.

    server process (this module, the event loop)              engine core process
      generate() -- CoreRequest --> PUSH ==ipc==> PULL -->   drain -> step() -> deltas
      abort()    -- CoreAbort  --/                              |
      RequestStream.apply <-- _on_readable <-- PULL <==ipc== PUSH <- CoreStep (per step)
      _on_core_exit <-- process sentinel (exit, kill -9)

The core sends token deltas only; each request's `RequestStream` (engine/core_stream.py) turns
them into text with its own incremental detokenizer and applies stop strings (then tells the
core to stop the sequence). The surface is `EngineClient` (engine/engine_client.py), as for
`AsyncLLMEngine`: `generate` (cumulative `RequestOutput`s), `submit` (the same iterator, the
prompt queued at the call), `abort`, `abort_all`, `validate`, `validate_prompt`, `is_dead`,
`max_model_len`, `start`, `shutdown`; and `tokenizer`, `vocab_size`, `stats` and `pid` of its own.

- A stream keeps only its latest state (outputs are coalesced), so a slow reader costs no
  memory and never slows the core: the core's socket has no high-water mark and the front reads
  it from a callback of the event loop (the socket's file descriptor), never waiting on clients.
- A consumer that leaves (disconnect, cancellation) aborts its request in the core.
- The core dying (a `CoreDead` message after an exception out of `step()`, or the process gone:
  `kill -9`, found by its sentinel at once) fails every open stream with `EngineDeadError`,
  turns `is_dead` True and calls `on_death` (the server then exits non-zero).
Prior art: vLLM v1's AsyncLLM / EngineCoreClient; SGLang's tokenizer manager. Our own code.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING

import msgspec
import zmq

from phloem.engine.core_messages import (
    CoreAbort,
    CoreDead,
    CoreReady,
    CoreRequest,
    CoreShutdown,
    CoreStats,
    CoreStep,
    front_decoder,
    params_to_dict,
)
from phloem.engine.core_stream import RequestStream
from phloem.engine.engine_client import EngineClient, EngineDeadError, RequestFailedError
from phloem.engine.input_checks import check_params, check_prompt
from phloem.outputs import RequestOutput
from phloem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from phloem.engine_args import EngineArgs
    from phloem.metrics_prometheus import EngineMetrics

logger = logging.getLogger(__name__)

_MAX_MESSAGES_PER_CALLBACK = 16  # core steps handled before the event loop's other work


class EngineCoreClient(EngineClient):
    """Starts the engine core process and streams each request's outputs from it.
    `submit` may run on any thread (`submits_from_any_thread`).

    Args:
        args: the engine settings (the core builds its `LLMEngine` from them).
        metrics: optional `EngineMetrics`, updated from the core's steps.
        on_death: called on the event loop with the error when the core dies.
        executor_factory: "module:attribute" of an executor factory for the core (tests'
            fault injection), or None.
        ready_timeout_s: how long to wait for the core to load the model [s].
        step_trace: the core writes its step trace to this path (`phloem.bench.step_trace_file`;
            None: no trace).
    Raises:
        ValueError: invalid settings (naming the field), or what loading the tokenizer raises.
        RuntimeError: the core failed to start (its error), died or did not answer in time.
    """

    submits_from_any_thread = True

    def __init__(
        self,
        args: EngineArgs,
        metrics: EngineMetrics | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        executor_factory: str | None = None,
        ready_timeout_s: float = 900.0,
        step_trace: str | None = None,
    ) -> None:
        from phloem.engine.engine_core import run_engine_core
        from phloem.models.loader import (
            load_tokenizer,
            resolve_model,
            startup_source,
        )

        config = args.create_engine_config("serve")  # ValueError naming the field, before spawning
        # a GGUF model is converted here once, before the core loads the converted files
        self.tokenizer = load_tokenizer(startup_source(resolve_model(args.model), config.model))
        self.metrics = metrics
        self.on_death = on_death
        self.dead_error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._unconsumed: set[str] = set()  # submitted, their output iterator not started yet
        self._stats: CoreStats | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._encoder = msgspec.msgpack.Encoder()
        # `submit` may run on the server's preparation thread: the input socket (not
        # thread-safe) and its encoder are used under this lock
        self._send_lock = threading.Lock()
        self._decoder = front_decoder()
        self._dir = tempfile.mkdtemp(prefix="phloem-core-")
        self._context = zmq.Context(1)
        self._to_core = self._socket(zmq.PUSH, "in")
        self._from_core = self._socket(zmq.PULL, "out")
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=run_engine_core,
            args=(
                args,
                f"ipc://{self._dir}/in",
                f"ipc://{self._dir}/out",
                executor_factory,
                step_trace,
            ),
            name="phloem-engine-core",
            daemon=False,  # it starts tensor-parallel ranks; it exits with this process
        )
        self.process.start()
        atexit.register(self.shutdown)  # before multiprocessing's exit hook joins the core
        ready = self._wait_ready(ready_timeout_s)
        self._max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size

    def _socket(self, kind: int, name: str):
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{self._dir}/{name}")
        return sock

    def _wait_ready(self, timeout_s: float) -> CoreReady:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._from_core.poll(200):
                message = self._decoder.decode(self._from_core.recv())
                if isinstance(message, CoreReady):
                    return message
                if isinstance(message, CoreDead):
                    self._abandon()
                    raise RuntimeError(f"the engine core failed to start: {message.error}")
            if not self.process.is_alive():
                self._abandon()
                raise RuntimeError(
                    f"the engine core exited with {self.process.exitcode} while starting"
                )
        self._abandon()
        raise RuntimeError(f"the engine core did not start within {timeout_s:g} s")

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def pid(self) -> int | None:
        """The engine core's process id."""
        return self.process.pid

    def start(self) -> None:
        """Begin reading the core's messages on the running event loop."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._from_core.getsockopt(zmq.FD), self._on_readable)
        self._loop.add_reader(self.process.sentinel, self._on_core_exit)
        self._on_readable()  # the descriptor is edge-triggered: read what came before

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (a `CoreShutdown`, then terminate) and release the sockets."""
        if self._stopping:
            return
        self._stopping = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.process.sentinel)
            self._loop.remove_reader(self._from_core.getsockopt(zmq.FD))
        if self.process.is_alive():
            self._send(CoreShutdown())
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)
        self._close()

    def _abandon(self) -> None:
        """A core that failed to start: stop it at once and release the sockets."""
        self._stopping = True
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        self._close()

    def _close(self) -> None:
        with self._send_lock:  # not under a send from the preparation thread
            self._context.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- requests (event loop) --------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError naming the limit when a prompt cannot run (`LLMEngine`'s checks)."""
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)

    def validate(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Raise ValueError when the prompt cannot run or stop_token_ids lie outside the
        vocabulary (`input_checks`)."""
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)
        check_params(sampling_params, self.vocab_size)

    def submit(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue one prompt in the core now and return the iterator of its outputs (what
        `generate` yields). The request runs from this call on: leaving the iteration early
        aborts it, and a caller that never starts it must `abort(request_id)`, which then
        forgets it too. Why: a burst's responses start one event-loop round after another, so a
        request sent only when its stream is first read reached the core ~0.3 s after it was
        prepared (benchmarks/results/2026-11-26f-cpu-serving-burst).

        Thread-safe (`submits_from_any_thread`): the server calls it on its preparation thread
        as soon as a request is prepared, since even the result's way back to the handler
        waits for a loop round behind the rest of a burst (0.1-0.25 s on a 2-core CPU,
        benchmarks/results/2026-11-27h-cpu-burst-trace). It adds to `_streams` and
        `_unconsumed` (one dict / set operation each, atomic under the GIL; the loop only
        looks entries up or snapshots them), builds the stream (the detokenizer decodes the
        prompt's tail: a shared borrow of the tokenizer, as the loop's decodes are) and sends
        under `_send_lock`.

        Raises at once: ValueError (the prompt or the parameters cannot run, or `request_id` is
        in use), EngineDeadError; the iteration raises RequestFailedError, EngineDeadError, or
        asyncio.CancelledError after `abort`.
        """
        self._check_new(request_id, prompt_token_ids, sampling_params)
        now = arrival_time if arrival_time is not None else time.monotonic()
        ids = list(prompt_token_ids)
        stream = RequestStream(request_id, prompt, ids, sampling_params, self.tokenizer, now)
        self._streams[request_id] = stream
        self._unconsumed.add(request_id)
        self._send(CoreRequest(request_id, ids, params_to_dict(sampling_params), now))
        if self.dead_error is not None and not stream.finished:
            # the core died between the check and the insert: `_die`, on the loop, may have
            # failed the open streams without this one (nobody waits on it yet: no wake-up)
            stream.fail(EngineDeadError(f"the engine loop has died: {self.dead_error}"))
        return self._outputs(stream)

    async def _outputs(self, stream: RequestStream) -> AsyncGenerator[RequestOutput, None]:
        request_id = stream.request_id
        self._unconsumed.discard(request_id)
        try:
            while True:
                await stream.wait()
                if stream.error is not None:
                    raise stream.error
                if stream.dirty:
                    stream.dirty = False
                    output = stream.output()
                    yield output
                    if output.finished:
                        return
        finally:
            if not stream.finished:
                stream.finished = True
                self._send(CoreAbort([request_id]))
            self._streams.pop(request_id, None)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request; its `generate` raises `error` (default CancelledError). A request
        `submit`ted whose outputs were never read is forgotten here (no reader will)."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            stream.fail(error or asyncio.CancelledError(f"request {request_id} aborted"))
            self._send(CoreAbort([request_id]))
        if request_id in self._unconsumed:
            self._unconsumed.discard(request_id)
            self._streams.pop(request_id, None)

    def _send(self, message) -> None:
        with self._send_lock:
            if self.dead_error is None and not self._context.closed:
                self._to_core.send(self._encoder.encode(message), zmq.NOBLOCK)

    # -- the core's messages (event loop callbacks) -------------------------------------------------

    def _on_readable(self) -> None:
        """Read the messages queued on the socket. Its descriptor signals edges only, so a
        backlog left after `_MAX_MESSAGES_PER_CALLBACK` (other callbacks, HTTP, get their turn)
        is read by a callback scheduled again."""
        sock = self._from_core
        for _ in range(_MAX_MESSAGES_PER_CALLBACK):
            if self._context.closed or not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            message = self._decoder.decode(sock.recv(zmq.NOBLOCK))
            if isinstance(message, CoreStep):
                self._on_step(message)
            elif isinstance(message, CoreDead):
                self._die(RuntimeError(message.error))
        if self._loop is not None:
            self._loop.call_soon(self._on_readable)

    def _on_step(self, step: CoreStep) -> None:
        now = time.monotonic()
        streams, metrics = self._streams, self.metrics
        stop_seqs: list[str] = []
        num_new = 0
        for delta in step.deltas:
            stream = streams.get(delta.request_id)
            if stream is None or stream.finished:
                continue
            if delta.error is not None:
                self._fail(stream, delta.error, delta.rejected)
                continue
            was_started = stream.num_tokens > 0
            new, stopped = stream.apply(delta, now)
            num_new += new
            stop_seqs.extend(stopped)
            if metrics is not None:
                if new and not was_started:
                    metrics.on_first_token(len(stream.prompt_token_ids), stream.metrics.ttft)
                if stream.finished:
                    metrics.on_finished(stream.output())
        if stop_seqs:
            self._send(CoreAbort([], stop_seqs))
        self._stats = step.stats
        if metrics is not None:
            metrics.on_generated(num_new)
            metrics.set_core_stats(step.stats)

    def _fail(self, stream: RequestStream, error: str, rejected: bool) -> None:
        if rejected:
            stream.fail(ValueError(error))
            return
        stream.fail(RequestFailedError(error))
        if self.metrics is not None:
            self.metrics.on_request_failed()

    def _on_core_exit(self) -> None:
        self._loop.remove_reader(self.process.sentinel)  # type: ignore[union-attr]
        if self._stopping or self.dead_error is not None:
            return
        self._on_readable()  # a CoreDead sent before the exit names the cause
        if self.dead_error is None:
            self.process.join(1)
            self._die(RuntimeError(f"the engine core process exited ({self.process.exitcode})"))

    def _die(self, error: BaseException) -> None:
        """Fail every open stream; tell the owner (once)."""
        if self.dead_error is not None:
            return
        logger.error("engine core died: %s", error)
        self.dead_error = error
        dead = EngineDeadError(f"the engine loop has died: {error}")
        for stream in list(self._streams.values()):
            if not stream.finished:
                stream.fail(dead)
        if self.on_death is not None:
            self.on_death(error)

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counts for tests: running, waiting, KV blocks, aborts (as of the core's last step)."""
        s = self._stats
        values = msgspec.structs.asdict(s) if s is not None else {}
        values["num_streams"] = len(self._streams)
        return values
