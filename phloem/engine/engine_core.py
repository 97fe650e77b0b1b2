"""The engine core process: the scheduler and executor loop, fed and read over ZeroMQ.

The server process spawns it (`EngineCoreClient`, engine/core_client.py). It builds an
`LLMEngine` in DELTA mode (token ids only: no text, no stop strings) from the same `EngineArgs`
and runs:

    loop:  idle?  block on the input socket (1 s polls: exit if the parent is gone)
           a step in flight?  wait on the input socket until a message comes or the step is
                              about to end (`StepPacing`: late drain)
           drain every queued message without blocking: add / abort / stop sequences
           step()  ->  one CoreStep (every touched request's delta + stats)  ->  output socket

It never waits on a client: the output socket has no high-water mark (the front buffers), and
the front's aborts arrive as messages between steps. With a step trace path (`phloem serve
--step-trace`) a step observer writes one JSON line per step (`phloem.bench.step_trace_file`),
flushed every 256 steps and when the loop ends. An exception out of `step()` is sent as
`CoreDead` and the process exits 1; a failure to build the engine is sent the same way before
`CoreReady`. Prior art: vLLM v1's EngineCore process (ZeroMQ + msgspec), SGLang's scheduler
process; the code is our own.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import zmq

from phloem.core.scheduler_output import SchedulerOutput
from phloem.distributed.worker_process import exit_with_parent
from phloem.engine.core_messages import (
    CoreAbort,
    CoreDead,
    CoreReady,
    CoreRequest,
    CoreShutdown,
    CoreStats,
    CoreStep,
    RequestDelta,
    core_decoder,
)
from phloem.engine.gc_control import freeze_start_up
from phloem.engine.llm_engine import LLMEngine, OutputMode
from phloem.engine.step_observer import StepRecord
from phloem.engine_args import EngineArgs
from phloem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # how often an idle core checks that its parent still lives
_PACING_MARGIN_S = 1e-3  # host time kept in hand beyond the longest recent lead [s]
_PACING_SAMPLES = 4  # remaining-time samples kept per step shape
_PACING_MAX_AGE = 64  # a sample older than this many collected steps is not used
_PACING_LEADS = 16  # host leads (schedule + launch) kept


def import_factory(path: str):
    """The object named by "package.module:attribute" (an executor factory for tests)."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"executor factory must be 'module:attribute', got {path!r}")
    return vars(importlib.import_module(module))[name]


class StepPacing:
    """When the core builds the next step while one is in flight (async scheduling).

    Building step N+1 right after step N-1 is collected (N just began on the device) leaves a
    request that reaches the core while N runs for N+2: it waits for N and all of N+1 before
    its own step (benchmarks/results/2026-11-27g-cpu-ttft-path: 167 of 174 Poisson arrivals).
    The host is idle for most of N anyway (it waits in `collect`), so the core spends that idle
    time waiting on its input socket instead, until a message comes (at once: the request goes
    into N+1) or `deadline`: the time N is expected to end less the longest recent host lead
    (drain + schedule + launch) and `margin_s`, so N+1 is on the device's queue before N ends.

    The expectation is measured, not modelled. For each collected step, `remaining` is the time
    from the `step()` return before it to its collection (the device time that was left once
    the core could build the next step), kept per step shape (`_shape`); the prediction is the
    least of the last `_PACING_SAMPLES` of the in-flight step's shape, or, with fewer than two
    of it, of the nearest smaller shape measured (fewer tokens, then decode-only: a step takes
    at least as long as one with less work); none measured: no waiting. Samples older than
    `_PACING_MAX_AGE` steps are not used (contexts grow, batches change), and all are dropped
    when the core runs out of requests. A step whose collection waited less than the margin
    (the host was behind) counts as 0: its shape gets no waiting until unhurried steps of it
    are measured again. A step with constrained sequences gets none (its sampling is held for
    the next `step()`).
    Outputs do not change: only the step in which a request's prompt starts. `enabled` False
    (`PHLOEM_LATE_DRAIN=0` in the server's environment, for A/B runs) never waits: the next step
    is built as soon as the step before is collected.
    """

    def __init__(self, margin_s: float = _PACING_MARGIN_S, enabled: bool = True) -> None:
        self.margin_s = margin_s
        self.enabled = enabled
        self._returned_at: float | None = None  # monotonic [s] of the last step() return
        self._num_observed = 0  # steps collected
        # per shape: (the step's number in `_num_observed`, its remaining time [s])
        self._remaining: dict[tuple[bool, int], deque[tuple[int, float]]] = {}
        self._leads: deque[float] = deque(maxlen=_PACING_LEADS)  # schedule + launch [s]
        self._drains: deque[float] = deque(maxlen=_PACING_LEADS)  # the input's drain [s]
        self._shapes: tuple[SchedulerOutput | None, tuple[bool, int]] = (None, (False, 0))

    def _shape(self, sched: SchedulerOutput) -> tuple[bool, int]:
        """(computes more tokens than sequences: prompt chunks or drafts, the token count's
        bit length): steps of one shape take about as long. Cached for the last step asked."""
        if self._shapes[0] is not sched:
            tokens = sched.total_num_scheduled_tokens
            self._shapes = (sched, (tokens > len(sched.scheduled), tokens.bit_length()))
        return self._shapes[1]

    def returned(self, now: float | None) -> None:
        """`step()` returned at `now` (monotonic [s]): remaining times count from here. None:
        the core waits for requests (nothing to time until the next step() returns; the samples
        are dropped: the next requests may be of another kind)."""
        self._returned_at = now
        if now is None:
            self._remaining.clear()

    def drained(self, seconds: float) -> None:
        """The core drained its input in `seconds` before a step (host lead too)."""
        self._drains.append(seconds)

    def observe(self, record: StepRecord) -> None:
        """Step observer: a collected step's remaining time and host lead."""
        self._leads.append(record.schedule_s + record.launch_s)
        self._num_observed += 1
        if self._returned_at is None:
            return
        remaining = time.monotonic() - record.update_s - self._returned_at
        if record.wait_s < self.margin_s:
            remaining = 0.0
        key = self._shape(record.scheduler_output)
        samples = self._remaining.setdefault(key, deque(maxlen=_PACING_SAMPLES))
        samples.append((self._num_observed, remaining))

    def deadline(self, in_flight: SchedulerOutput) -> float:
        """Until when (monotonic [s]) the core may wait for news before building the next step
        (in the past: build it now)."""
        if not self.enabled or self._returned_at is None or in_flight.structured_seq_ids:
            return 0.0
        mixed, bits = self._shape(in_flight)
        shapes = [(mixed, b) for b in range(bits, 0, -1)]
        if mixed:
            shapes += [(False, b) for b in range(bits, 0, -1)]
        oldest = self._num_observed - _PACING_MAX_AGE
        for shape in shapes:
            fresh = [r for n, r in self._remaining.get(shape, ()) if n > oldest]
            if len(fresh) >= 2:
                lead = max(self._leads, default=0.0) + max(self._drains, default=0.0)
                return self._returned_at + min(fresh) - lead - self.margin_s
        return 0.0


@dataclass
class _Counts:
    """Totals the core keeps for the front's /metrics."""

    started: set[str] = field(default_factory=set)  # request ids with a step computed
    num_preemptions: int = 0
    num_aborted_waiting: int = 0
    num_aborted_running: int = 0


class EngineCore:
    """The loop of the engine core process over one `LLMEngine` (DELTA mode).

    Args:
        engine: the engine; only this loop touches it.
        input_socket: PULL socket of `FrontMessage`s.
        output_socket: PUSH socket for `CoreMessage`s.
        pacing: when to build a step while one is in flight (default `StepPacing()`).
    """

    def __init__(
        self, engine: LLMEngine, input_socket, output_socket, pacing: StepPacing | None = None
    ) -> None:
        self.engine = engine
        self.pacing = pacing if pacing is not None else StepPacing()
        self.input = input_socket
        self.output = output_socket
        self.decoder = core_decoder()
        self.encoder = msgspec.msgpack.Encoder()
        self.counts = _Counts()
        self.parent_pid = os.getppid()
        self._rejected: list[RequestDelta] = []
        engine.add_step_observer(self._observe_step)
        engine.add_step_observer(self.pacing.observe)

    def run(self) -> None:
        """Serve until `CoreShutdown` or the parent's death; exceptions out of `step()` leave."""
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():
                self.pacing.returned(None)
                if self._rejected:
                    self._send([])
                while not self.input.poll(_IDLE_POLL_MS):
                    if os.getppid() != self.parent_pid:
                        return  # orphaned: the server is gone
            else:
                self._wait_for_news()
            drain_start = time.monotonic()
            if not self._drain():
                return
            self.pacing.drained(time.monotonic() - drain_start)
            if not engine.has_unfinished_requests():
                self._send([])  # aborts while idle: the front's gauges go back to zero
                continue
            outputs = engine.step()
            self.pacing.returned(time.monotonic())
            self._send(outputs)

    def _wait_for_news(self) -> None:
        """While a step is in flight, wait on the input socket until a message comes or the
        pacing's deadline passes. The socket's poll counts whole milliseconds; the fraction
        left is slept (a message coming then is still drained before the step is built)."""
        in_flight = self.engine.in_flight
        if in_flight is None:
            return
        deadline = self.pacing.deadline(in_flight)
        wait_s = deadline - time.monotonic()
        if wait_s > 0 and not self.input.poll(int(wait_s * 1000)):
            rest_s = deadline - time.monotonic()
            if rest_s > 0:
                time.sleep(rest_s)

    def _drain(self) -> bool:
        """Apply every queued message; False on `CoreShutdown`."""
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            message = self.decoder.decode(frame)
            if isinstance(message, CoreRequest):
                self._add(message)
            elif isinstance(message, CoreAbort):
                self._abort(message)
            elif isinstance(message, CoreShutdown):
                return False

    def _add(self, message: CoreRequest) -> None:
        rid = message.request_id
        try:
            params = SamplingParams.from_dict(message.sampling_params)
            self.engine.add_request(
                message.prompt_token_ids, params, rid, arrival_time=message.arrival_time
            )
        except ValueError as e:
            self._rejected.append(RequestDelta(rid, [], True, error=str(e), rejected=True))
        except Exception as e:  # noqa: BLE001 - this request's fault: it fails alone
            logger.exception("request %s could not be queued", rid)
            error = f"the request could not be queued: {type(e).__name__}: {e}"
            self._rejected.append(RequestDelta(rid, [], True, error=error))

    def _abort(self, message: CoreAbort) -> None:
        engine, counts = self.engine, self.counts
        for rid in message.request_ids:
            if not engine.is_unfinished(rid):
                continue
            if rid in counts.started:
                counts.num_aborted_running += 1
            else:
                counts.num_aborted_waiting += 1
            counts.started.discard(rid)
        engine.abort_request(message.request_ids)
        if message.stop_seq_ids:
            engine.stop_sequences(message.stop_seq_ids)
            for seq_id in message.stop_seq_ids:
                rid = seq_id.split("#", 1)[0]
                if not engine.is_unfinished(rid):
                    counts.started.discard(rid)

    def _observe_step(self, record) -> None:
        """Counts a step's preemptions and the requests it started. A request's first row (and
        its first after a preemption) is always sent as new (`new_sequence`); only those rows
        are looked at: a later row may be the wasted one after an EOS (async scheduling), whose
        request's finish was already sent (`_send` dropped its id: adding it back would keep it
        for good)."""
        sched = record.scheduler_output
        self.counts.num_preemptions += len(sched.preempted_seq_ids)
        started = self.counts.started
        for s in sched.scheduled:
            if s.new_sequence is not None:
                started.add(s.seq_id.split("#", 1)[0])

    def _send(self, deltas: list) -> None:
        if self._rejected:
            deltas = self._rejected + deltas
            self._rejected = []
        started = self.counts.started
        for delta in deltas:
            if delta.finished:
                started.discard(delta.request_id)
        self.output.send(self.encoder.encode(CoreStep(deltas, self._stats())), copy=False)

    def _stats(self) -> CoreStats:
        engine, counts = self.engine, self.counts
        kv = engine.kv_manager
        return CoreStats(
            engine.scheduler.num_running,
            engine.scheduler.num_waiting,
            kv.num_reclaimable_blocks,
            kv.num_blocks,
            kv.num_prefix_cache_queries,
            kv.num_prefix_cache_hits,
            counts.num_preemptions,
            counts.num_aborted_waiting,
            counts.num_aborted_running,
            engine.scheduler.num_computed_prompt_tokens,
            engine.scheduler.num_reused_prompt_tokens,
            *(
                (engine.drafter.stats.num_draft_tokens, engine.drafter.stats.num_accepted_tokens)
                if engine.drafter is not None
                else (0, 0)
            ),
        )


def run_engine_core(
    args: EngineArgs,
    input_path: str,
    output_path: str,
    executor_factory: str | None,
    step_trace: str | None = None,
) -> None:
    """The process's entry point (multiprocessing spawn target): build, announce, loop.

    Args:
        args: the server's engine settings.
        input_path / output_path: ipc:// addresses the front bound (PUSH -> our PULL, our PUSH
            -> its PULL).
        executor_factory: "module:attribute" of a test executor factory, or None.
        step_trace: write the step trace to this path (None: no trace).
    Exits 1 (after sending `CoreDead`) when building the engine or a step raises.
    """
    # Ctrl-C reaches the whole process group: the server drains, then stops us itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()  # not a daemon (it may start tensor-parallel ranks): never outlive the front
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    context = zmq.Context(1)
    output = context.socket(zmq.PUSH)
    output.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a slow front
    output.setsockopt(zmq.LINGER, 5000)
    output.connect(output_path)
    input_socket = context.socket(zmq.PULL)
    input_socket.setsockopt(zmq.RCVHWM, 0)
    input_socket.connect(input_path)
    encoder = msgspec.msgpack.Encoder()
    trace = None
    try:
        factory = import_factory(executor_factory) if executor_factory else None
        config = args.create_engine_config("serve")
        engine = LLMEngine(config, executor_factory=factory, output_mode=OutputMode.DELTA)
        if step_trace is not None:
            from phloem.bench.step_trace_file import StepTraceFile

            trace = StepTraceFile.for_engine(step_trace, engine)
        vocab = engine.hf_config.vocab_size
        frozen = freeze_start_up()  # full collections in the loop then walk only requests' objects
        logger.info("engine core: %d start-up objects frozen out of garbage collection", frozen)
        output.send(encoder.encode(CoreReady(engine.max_model_len, vocab, os.getpid())))
        pacing = StepPacing(enabled=os.environ.get("PHLOEM_LATE_DRAIN", "1") != "0")
        EngineCore(engine, input_socket, output, pacing).run()
    except BaseException as e:  # noqa: BLE001 - any escape ends the core: tell the front
        logger.exception("engine core died")
        output.send(encoder.encode(CoreDead(f"{type(e).__name__}: {e}")))
        time.sleep(0.2)
        context.destroy(linger=2000)
        sys.exit(1)
    finally:
        if trace is not None:
            trace.close()
    context.destroy(linger=2000)
