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
  `phloem:request_failed_total`): non-finite logits in its row (the row is replaced before
  sampling so the batch goes on), or an exception in its own admission, sampling setup,
  detokenization or stop rules (`LLMEngine` turns those into an output with `error` set), or
  an exception while the engine queues it.
- An exception out of `step()` (a fault of the whole step: the forward pass, the device) kills
  the loop: every stream and every later call gets `EngineDeadError`, `is_dead` turns True and
  `on_death` is called (the server then exits non-zero).
- Test-only fault injection (`fault_injection=True`): a request submitted with
  `fault="nan"` gets NaN logits; `fault="die"` makes the engine loop raise when it is scheduled.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from phloem.outputs import RequestOutput
from phloem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FAULTS = ("nan", "die")
NON_FINITE_MESSAGE = "the model produced non-finite logits (NaN or inf) for this request"


class EngineDeadError(RuntimeError):
    """The engine loop has died; no request can run any more."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (e.g. non-finite logits); the others go on."""


@dataclass
class _Stream:
    """Event-loop-side state of one request (touched only on the event loop)."""

    request_id: str
    event: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None
    error: BaseException | None = None
    finished: bool = False


class _GuardedExecutor:
    """Wraps the engine's executor: records which requests ran, checks logits, injects faults.

    The model runner samples the rows of `[s for s in sched.scheduled if s.sample]` in order; the
    wrapped sampler maps its row i to that request. Rows with a NaN/inf logit are replaced by
    zeros on the device (so the sampler does not fail the whole batch); which rows those were is
    copied to the host behind the step's own tokens, so the check adds no device sync (async
    scheduling keeps its overlap), and their request ids are added to the collected output's
    `failed`, for the engine to fail them alone after the step.
    """

    def __init__(self, inner, faults: dict[str, str]) -> None:
        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.faults = faults  # seq/prompt id -> fault name (engine thread only)
        self.scheduled_ids: set[str] = set()  # sequences that have been scheduled at least once
        self.num_preemptions = 0
        self._rows: list[str] = []
        self._checks: dict[int, tuple[list[str], object]] = {}  # id(launched) -> rows, finite
        self._pending_check: tuple[list[str], object] | None = None
        runner = getattr(getattr(inner, "worker", None), "model_runner", None)
        sampler = getattr(runner, "sampler", None)
        if sampler is None:
            logger.warning("no model_runner.sampler to guard: non-finite logits are not checked")
        else:
            runner.sampler = _GuardedSampler(sampler, self._check_logits)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _fault_of(self, seq_id: str) -> str | None:
        return self.faults.get(seq_id) or self.faults.get(seq_id.split("#", 1)[0])

    def _record(self, sched) -> None:
        self._rows = []
        self._pending_check = None
        self.num_preemptions += len(sched.preempted_request_ids)
        for s in sched.scheduled:
            seq_id = s.request.request_id
            self.scheduled_ids.add(seq_id)
            if s.sample:
                self._rows.append(seq_id)
            if self.faults and self._fault_of(seq_id) == "die":
                raise RuntimeError(f"injected engine fault (request {seq_id})")

    def execute_model(self, sched):
        return self.collect(self.launch(sched))

    def launch(self, sched):
        self._record(sched)
        launched = self.inner.launch(sched)
        if launched is not None and self._pending_check is not None:
            self._checks[id(launched)] = self._pending_check
        return launched

    def collect(self, launched):
        out = self.inner.collect(launched)  # waits for the step, finite flags included
        check = self._checks.pop(id(launched), None) if launched is not None else None
        if check is not None:
            rows, finite = check
            for i, ok in enumerate(finite.tolist()):
                if not ok and i < len(rows):
                    out.failed.setdefault(rows[i], NON_FINITE_MESSAGE)
        return out

    def _check_logits(self, logits):
        """Fault injection, then zero the non-finite rows (device only)."""
        import torch

        from phloem.ops.staging import to_host

        if self.faults:
            for i, seq_id in enumerate(self._rows[: logits.shape[0]]):
                if self._fault_of(seq_id) == "nan":
                    logits = logits.clone()
                    logits[i] = float("nan")
        finite = torch.isfinite(logits).all(dim=-1)
        logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))
        # read in `collect`, after the sampler's event (recorded behind this copy) completed
        self._pending_check = (list(self._rows), to_host(finite))
        return logits


class _GuardedSampler:
    """The model runner's sampler with `check` applied to the logits first."""

    def __init__(self, inner, check) -> None:
        self.inner = inner
        self.check = check

    def __call__(self, logits, rows):
        return self.inner(self.check(logits), rows)

    def launch(self, logits, rows):
        return self.inner.launch(self.check(logits), rows)


class AsyncLLMEngine:
    """Runs an `LLMEngine` in a background thread and streams each request's outputs.

    Args:
        engine: the engine; from `start()` on only the engine thread touches it.
        metrics: optional `phloem.metrics_prometheus.EngineMetrics`, updated from the loop.
        fault_injection: honour `fault=` on `generate` (tests only).
        on_death: called on the event loop with the exception when the engine loop dies.
    """

    def __init__(
        self,
        engine,
        metrics=None,
        fault_injection: bool = False,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        engine.stream_outputs = True  # every step's tokens reach the streams
        self.metrics = metrics
        self.fault_injection = fault_injection
        self.on_death = on_death
        self.dead_error: BaseException | None = None
        self._faults: dict[str, str] = {}
        self._executor = _GuardedExecutor(engine.executor, self._faults)
        engine.executor = self._executor
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
    def is_dead(self) -> bool:
        return self.dead_error is not None

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

    def validate(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Raise ValueError when the prompt cannot run (empty, out-of-vocab ids, too long) or
        the sampling parameters exceed what the model can do (`LLMEngine.validate_params`)."""
        self.engine.validate_prompt(prompt_token_ids)
        self.engine.validate_params(sampling_params)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        arrival_time: float | None = None,
        fault: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue one prompt and yield its outputs (cumulative) until it finishes.

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
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has died: {self.dead_error}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate(prompt_token_ids, sampling_params)
        if fault is not None and not self.fault_injection:
            fault = None
        stream = _Stream(request_id)
        self._streams[request_id] = stream
        now = arrival_time if arrival_time is not None else time.monotonic()
        self._submit(
            ("add", request_id, list(prompt_token_ids), sampling_params, prompt, now, fault)
        )
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

    def abort_all(self, error: BaseException) -> int:
        """Abort every unfinished request from the event loop, each `generate` raising
        `error` (a server ending what is left at its shutdown timeout); returns how many."""
        request_ids = [rid for rid, stream in self._streams.items() if not stream.finished]
        for request_id in request_ids:
            self.abort(request_id, error)
        return len(request_ids)

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
                outputs = engine.step()
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
                _, request_id, ids, params, prompt, arrival, fault = command
                if fault is not None:
                    self._faults[request_id] = fault
                try:
                    engine.add_request(ids, params, request_id, prompt, arrival)
                except ValueError as e:
                    self._faults.pop(request_id, None)
                    errors[request_id] = e
                    continue
                except Exception as e:  # noqa: BLE001 - this request's fault: it fails alone
                    logger.exception("request %s could not be queued", request_id)
                    self._faults.pop(request_id, None)
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
        seq_ids = [s for s in self._executor.scheduled_ids if s.split("#", 1)[0] == request_id]
        if seq_ids:
            self.num_aborted_running += 1
        else:
            self.num_aborted_waiting += 1
        self.engine.abort_request([request_id])
        self._forget(request_id)
        if self.metrics is not None:
            self.metrics.on_request_aborted(running=bool(seq_ids))

    def _forget(self, request_id: str) -> None:
        self._num_output_tokens.pop(request_id, None)
        self._faults.pop(request_id, None)
        self._executor.scheduled_ids.difference_update(
            [s for s in self._executor.scheduled_ids if s.split("#", 1)[0] == request_id]
        )

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
            num_free_blocks=_num_reclaimable_blocks(kv),
            num_blocks=kv.num_blocks,
        )
        self.metrics.set_totals(
            num_preemptions=self._executor.num_preemptions,
            prefix_cache_queries=getattr(kv, "num_prefix_cache_queries", None),
            prefix_cache_hits=getattr(kv, "num_prefix_cache_hits", None),
        )

    # -- introspection (thread-safe snapshots) ---------------------------------------------------

    def stats(self) -> dict:
        """Counts for /metrics and tests: running, waiting, KV blocks, aborts."""
        engine = self.engine
        return {
            "num_running": engine.scheduler.num_running,
            "num_waiting": engine.scheduler.num_waiting,
            "num_free_blocks": _num_reclaimable_blocks(engine.kv_manager),
            "num_blocks": engine.kv_manager.num_blocks,
            "num_preemptions": self._executor.num_preemptions,
            "num_aborted_waiting": self.num_aborted_waiting,
            "num_aborted_running": self.num_aborted_running,
            "num_streams": len(self._streams),
        }


def _num_reclaimable_blocks(kv) -> int:
    """Free blocks, counting those only the prefix cache holds (evictable on demand) as free."""
    return getattr(kv, "num_reclaimable_blocks", kv.num_free_blocks)
