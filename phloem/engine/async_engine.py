"""The asyncio front of the engine: one engine loop in a background thread, one stream per request.

`LLMEngine` is synchronous and single-threaded; the HTTP server is an asyncio program. This module
owns the boundary between them:

    event loop (HTTP handlers)                     engine thread (the only user of LLMEngine)
      generate() --- ("add", ...) ---> commands ---> drain -> step() -> outputs
      abort()    --- ("abort", id) --/                                      |
      stream.latest <--------- call_soon_threadsafe(_dispatch, [outputs]) <-/

- Every in-flight request is batched by the one engine (continuous batching); a request's stream
  keeps only its latest `RequestOutput` (outputs are cumulative: full text, all token ids), so a
  slow client costs no memory and loses nothing.
- A request whose consumer goes away (client disconnect, task cancelled) is aborted: its KV
  blocks return to the pool before the next step; a request still waiting never runs.
- A request that fails alone fails its stream only (`RequestFailedError`, counted once in
  `phloem:request_failed_total`): non-finite logits in its rows (the sampler flags them and the
  engine fails the request), or an exception in its own admission, sampling setup,
  detokenization or stop rules (`LLMEngine` turns each into an output with `error` set), or
  an exception while the engine queues it.
- An exception out of `step()` (a fault of the whole step: the forward pass, the device) kills
  the loop: every stream and every later call gets `EngineDeadError`, `is_dead` turns True and
  `on_death` is called (the server then exits non-zero).
- What the loop learns from the steps themselves (which requests have run, preemptions) comes
  from the engine's step observer (`LLMEngine.add_step_observer`), which also feeds the metrics.
  Faults are injected by tests through the engine's executor factory, never here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from phloem.engine.engine_client import EngineClient, EngineDeadError, RequestFailedError
from phloem.outputs import RequestOutput
from phloem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from phloem.engine.llm_engine import LLMEngine
    from phloem.engine.step_observer import StepRecord
    from phloem.metrics_prometheus import EngineMetrics

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Event-loop-side state of one request (touched only on the event loop)."""

    request_id: str
    event: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None
    error: BaseException | None = None
    finished: bool = False


class AsyncLLMEngine(EngineClient):
    """Runs an `LLMEngine` in a background thread and streams each request's outputs.

    Args:
        engine: the engine, built with `output_mode=OutputMode.STREAM`; from `start()` on only
            the engine thread touches it.
        metrics: optional `phloem.metrics_prometheus.EngineMetrics`, updated from the loop (and
            registered as a step observer of `engine`).
        on_death: called on the event loop with the exception when the engine loop dies.
    Raises:
        ValueError: the engine was not built in STREAM mode.
    """

    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        from phloem.engine.llm_engine import OutputMode

        if engine.output_mode is not OutputMode.STREAM:
            raise ValueError("AsyncLLMEngine needs an LLMEngine built with OutputMode.STREAM")
        self.engine = engine
        self.metrics = metrics
        self.on_death = on_death
        self.dead_error: BaseException | None = None
        self._started: set[str] = set()  # request ids with a step computed (engine thread)
        self.num_preemptions = 0
        engine.add_step_observer(self._observe_step)
        if metrics is not None:
            engine.add_step_observer(metrics.observe_step)
        self._streams: dict[str, _Stream] = {}
        self._commands: deque[tuple] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._num_output_tokens: dict[str, int] = {}
        self.num_aborted_waiting = 0
        self.num_aborted_running = 0
        self._update_gauges()

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def start(self) -> None:
        """Start the engine thread; must be called on the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="phloem-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (in-flight requests are left as they are)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the event-loop side ---------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError naming the limit when a prompt cannot run."""
        self.engine.validate_prompt(prompt_token_ids)

    def validate(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Raise ValueError when the prompt cannot run (empty, out-of-vocab ids, too long) or
        the sampling parameters exceed what the model can do (`LLMEngine.validate_params`)."""
        self.engine.validate_prompt(prompt_token_ids)
        self.engine.validate_params(sampling_params)

    async def submit(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue one prompt at the first iteration and yield its outputs (cumulative) until it
        finishes (`EngineClient.submit`; `generate` iterates this). A request never iterated is
        never queued, so its `abort` has nothing to do.

        Intermediate outputs may be coalesced; the last one has `finished=True`. Leaving the
        iteration early (break, cancellation, disconnect) aborts the request.

        Raises:
            ValueError: the prompt cannot run (raised before anything is queued, or by the
                engine when it rejects the request).
            RequestFailedError: the request failed alone in the engine (non-finite logits, or
                an exception in its own setup, sampling, detokenization or stop rules).
            EngineDeadError: the engine loop is dead or died meanwhile.
            asyncio.CancelledError: `abort(request_id)` was called.
        """
        self._check_new(request_id, prompt_token_ids, sampling_params)
        stream = _Stream(request_id)
        self._streams[request_id] = stream
        now = arrival_time if arrival_time is not None else time.monotonic()
        self._submit(("add", request_id, list(prompt_token_ids), sampling_params, prompt, now))
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                output, stream.latest = stream.latest, None
                if output is not None:
                    yield output
                    if output.finished:
                        return
                if stream.error is not None:
                    raise stream.error
        finally:
            if not stream.finished:
                stream.finished = True
                self._submit(("abort", request_id))
            self._streams.pop(request_id, None)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request from the event loop; its `generate` raises `error` (default
        CancelledError)."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return
        stream.finished = True
        stream.error = error or asyncio.CancelledError(f"request {request_id} aborted")
        stream.event.set()
        self._submit(("abort", request_id))

    def _submit(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    def _dispatch(self, outputs: list[RequestOutput], errors: dict[str, BaseException]) -> None:
        """On the event loop: hand the step's outputs and errors to their streams."""
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None or stream.finished:
                continue
            stream.latest = output
            if output.finished:
                stream.finished = True
            stream.event.set()
        for request_id, error in errors.items():
            stream = self._streams.get(request_id)
            if stream is None or (stream.finished and stream.error is not None):
                continue
            stream.finished = True
            stream.error = error
            stream.event.set()

    def _die(self, error: BaseException) -> None:
        """On the event loop: fail every stream; tell the owner."""
        dead = EngineDeadError(f"the engine loop has died: {type(error).__name__}: {error}")
        for stream in list(self._streams.values()):
            if not stream.finished:
                stream.finished = True
                stream.error = dead
                stream.event.set()
        if self.on_death is not None:
            self.on_death(error)

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                errors = self._drain_commands()
                if not engine.has_unfinished_requests():
                    if errors:
                        self._post(self._dispatch, [], errors)
                    self._update_gauges()
                    self._wake.wait()
                    self._wake.clear()
                    continue
                # STREAM mode (checked in __init__): every step output is a RequestOutput
                outputs = cast("list[RequestOutput]", engine.step())
                errors.update(self._failed(outputs))
                outputs = [o for o in outputs if o.error is None]
                self._record(outputs)
                self._post(self._dispatch, outputs, errors)
        except BaseException as e:  # noqa: BLE001 - any escape is engine death
            logger.exception("engine loop died")
            self.dead_error = e
            self._post(self._die, e)

    def _post(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _drain_commands(self) -> dict[str, BaseException]:
        """Apply queued adds and aborts in order; returns per-request rejection errors."""
        errors: dict[str, BaseException] = {}
        engine = self.engine
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "add":
                _, request_id, ids, params, prompt, arrival = command
                try:
                    engine.add_request(ids, params, request_id, prompt, arrival)
                except ValueError as e:
                    errors[request_id] = e
                    continue
                except Exception as e:  # noqa: BLE001 - this request's fault: it fails alone
                    logger.exception("request %s could not be queued", request_id)
                    errors[request_id] = RequestFailedError(
                        f"the request could not be queued: {type(e).__name__}: {e}"
                    )
                    if self.metrics is not None:
                        self.metrics.on_request_failed()
                    continue
                self._num_output_tokens[request_id] = 0
                if self.metrics is not None:
                    self.metrics.on_request_added(len(ids))
            else:
                self._abort_in_engine(command[1])
        return errors

    def _abort_in_engine(self, request_id: str) -> None:
        if request_id not in self._num_output_tokens:
            return  # finished, failed or never added
        running = request_id in self._started
        if running:
            self.num_aborted_running += 1
        else:
            self.num_aborted_waiting += 1
        self.engine.abort_request([request_id])
        self._forget(request_id)
        if self.metrics is not None:
            self.metrics.on_request_aborted(running=running)

    def _forget(self, request_id: str) -> None:
        self._num_output_tokens.pop(request_id, None)
        self._started.discard(request_id)

    def _observe_step(self, record: StepRecord) -> None:
        """The step observer (engine thread): which requests have had a step computed (an abort
        then counts as "running"), and preemptions. A sequence id is its request id, or
        "<request id>#<i>" for sample i of n > 1."""
        sched = record.scheduler_output
        self.num_preemptions += len(sched.preempted_seq_ids)
        for s in sched.scheduled:
            request_id = s.seq_id.split("#", 1)[0]
            if request_id in self._num_output_tokens:  # still one of ours (not aborted meanwhile)
                self._started.add(request_id)

    def _failed(self, outputs: list[RequestOutput]) -> dict[str, BaseException]:
        """The step's failed requests (outputs with `error`; the engine reports each once) as
        stream errors; counts each in the metrics once and forgets it."""
        errors: dict[str, BaseException] = {}
        for output in outputs:
            if output.error is None:
                continue
            errors[output.request_id] = RequestFailedError(output.error)
            self._forget(output.request_id)
            if self.metrics is not None:
                self.metrics.on_request_failed()
        return errors

    def _record(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            request_id = output.request_id
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            previous = self._num_output_tokens.get(request_id, 0)
            if self.metrics is not None:
                self.metrics.on_output(output, previous, num_tokens)
            if output.finished:
                self._forget(request_id)
            else:
                self._num_output_tokens[request_id] = num_tokens
        self._update_gauges()

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        kv = self.engine.kv_manager
        self.metrics.set_gauges(
            num_running=self.engine.scheduler.num_running,
            num_waiting=self.engine.scheduler.num_waiting,
            num_free_blocks=kv.num_reclaimable_blocks,
            num_blocks=kv.num_blocks,
        )
        self.metrics.set_prefix_cache_totals(
            queries=kv.num_prefix_cache_queries, hits=kv.num_prefix_cache_hits
        )

    # -- introspection (thread-safe snapshots) ---------------------------------------------------

    def stats(self) -> dict:
        """Counts for /metrics and tests: running, waiting, KV blocks, aborts."""
        engine = self.engine
        return {
            "num_running": engine.scheduler.num_running,
            "num_waiting": engine.scheduler.num_waiting,
            "num_free_blocks": engine.kv_manager.num_reclaimable_blocks,
            "num_blocks": engine.kv_manager.num_blocks,
            "num_preemptions": self.num_preemptions,
            "num_aborted_waiting": self.num_aborted_waiting,
            "num_aborted_running": self.num_aborted_running,
            "num_streams": len(self._streams),
        }
