"""The engine's hooks for structured outputs: which rows of a step are constrained, the step's
grammar bitmask, the grammars advanced by the tokens the scheduler appended, and the launched
constrained step held until its bitmask is filled.

    step(): schedule(N+1) -> mark(N+1) -> launch(N+1: forward, presample) -> collect(N)
            -> collected(N): advance(N's tokens), then fill(N+1), start on the fill thread
            -> update(N) -> advance: its results applied -> outputs of N
    next:   schedule(N+2) -> mark(N+2) -> prepare(N+2) -> bitmask(N+1) -> sample(N+1)
            -> launch(N+2) -> collect(N+1) -> ...

The bitmask of a row is filled after the row's previous token was accepted: under async
scheduling the forward pass of step N+1 runs on the device while the host waits for step N's
tokens, and only step N+1's sampling waits for the host's bitmask (no extra device sync). When
step N+1 was marked before step N's tokens came (async scheduling), the matchers consume N's
tokens and N+1's fill starts, one after the other on the fill thread, as soon as the tokens
are collected (`collected`), before the scheduler's update: the loop's update of N runs beside
the matchers' advance, waits for its results in `advance` (rows whose grammar completed or
rejected their token), and its work on N's outputs runs beside the fill; `bitmask` then waits
for the fill (N+1's sampling up to the mask, `Executor.presample`, was enqueued at its launch,
before N was collected, so its host work overlaps the loop's wait for N's tokens):

    collect(N) -> collected: advance(N), then fill(N+1) ───────────┐ fill thread (library's
                  update_from_output(N) (engine loop)              │ threads, GIL released)
                  advance: the matchers' results ◄ (after the advance)
                  process N's outputs                              │
                  schedule, mark and prepare N+2 (async)           │
                  bitmask(N+1): wait ◄─────────────────────────────┘ -> sample(N+1)

Where the loop advanced the matchers itself after the scheduler's update and then handed the
fill over (until 2026-11-27c), the fill started that update, the advance and the thread's wait
for the GIL (the loop's Python after the hand-over) later: on an H200 host the advance alone was
2.3-2.7 ms and the wait 1.9-2.1 ms of a 1,024-row step
(benchmarks/results/2026-11-27c-cpu-structured-path). `collected` waits until the
thread has begun (a thread woken while the loop runs Python gets the GIL only at the
interpreter's switch interval, 5 ms), so the library's advance runs beside the update. Without
a marked step (synchronous scheduling, speculative decoding) the loop advances the matchers in
`advance`, after the update, as before.

Under async scheduling the step after a constrained one is scheduled and its host arrays built
(`Executor.prepare`) before `bitmask` waits, so that work no longer follows the fill; `mark` of
that step may thus come between a step's `advance` and its `bitmask`. The launched constrained
step waits here meanwhile (`hold`, the *held* step) until `sample_held`: in the next `step()`,
before its launch, or at once when no request is left unfinished (`sample_if_idle`: after the
last ones finished, failed, or were aborted or stopped by a front, which then calls no
`step()`; the step stays in flight, sampled, as any step after which every request finished).
`LLMEngine.abort_all` (after an exception out of `step()`) drops it unsampled (`drop_held`).

A request's grammar starts compiling when it is added (`register`: a batch's are all queued
in the pool before its first step). The scheduler admits a request only once its matcher is
ready (`_ready`, its `admission_gate`; vLLM's WAITING_FOR_FSM): a request whose grammar is slow
to compile waits in the queue, keeping its place, while the others run, and no step's bitmask
waits for a grammar.

The grammar library (and its tokenizer info) is loaded with the first constrained request.

With `grammar_process` (opt-in: `StructuredOutputsConfig.grammar_process`) the manager runs in
a process of its own (`structured_output/grammar_process.py`): `collected` sends the advance and
the fill as one message and returns, `advance` and `bitmask` wait on the pipe for the replies
(the GIL released), and no fill thread runs here, so the fill never waits for the loop's GIL.

With PHLOEM_CONSTRAINED_DEVICE_WAIT=1 (the default on CUDA; 0 off) `sample_held` enqueues the held step's
sampling behind a device-side wait for its fill and does not wait (`engine/device_wait.py`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from phloem.core.request import Request, RequestStatus
from phloem.core.scheduler import Scheduler, SchedulerOutput
from phloem.engine.device_wait import DeviceWait, device_wait_mode
from phloem.engine.structured_times import LoopTimes
from phloem.sampling_params import SamplingParams
from phloem.structured_output.grammar_process import (
    GrammarProcessClient,
    GrammarProcessSpec,
    grammar_process_from_env,
)
from phloem.structured_output.manager import GrammarBitmask, StructuredOutputManager

if TYPE_CHECKING:
    from phloem.engine.executor import Executor
    from phloem.engine.step_observer import LaunchedStep

logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05  # longest wait of an empty step for the held requests' grammars [s]


def default_num_threads() -> int:
    """All CPUs but two, 1 to 16: a constrained step's bitmask is filled while the engine loop
    waits for it (the fill overlaps the device's forward pass, not the loop's own work), and a
    mask inside a JSON string can walk much of the vocabulary (0.15 ms a row on average over
    the GPU benchmark's walk at 128K tokens), so 1,024 constrained rows need every core the
    loop does not; two are left to the loop and the device's feeders."""
    return min(16, max(1, (os.cpu_count() or 2) - 2))


class StructuredOutputs:
    """Args: scheduler: the engine's (requests fail or stop through it); tokenizer, eos_token_id,
    vocab_size: the model's (for the grammar library's tokenizer info); backend: the grammar
    library (`StructuredOutputsConfig.backend`); num_compile_threads:
    threads compiling grammars and filling bitmasks (the library releases the GIL in both;
    default `default_num_threads()`); grammar_process: the manager in a process of its own
    (`StructuredOutputsConfig.grammar_process`; PHLOEM_GRAMMAR_PROCESS=1 or 0 overrides it:
    `structured_output/grammar_process.py`).

    Raises:
        ValueError: PHLOEM_GRAMMAR_PROCESS or PHLOEM_CONSTRAINED_DEVICE_WAIT set wrong."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer,
        eos_token_id: int | None,
        vocab_size: int,
        backend: str = "llguidance",
        num_compile_threads: int | None = None,
        grammar_process: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.backend = backend
        self._tokenizer_args = (tokenizer, vocab_size, eos_token_id)  # tokenizer_data's
        self.num_threads = num_compile_threads or default_num_threads()
        self.grammar_process = grammar_process_from_env(grammar_process)
        self.manager: StructuredOutputManager | GrammarProcessClient | None = None
        self.process: GrammarProcessClient | None = None  # the manager, when in a process
        self._next: SchedulerOutput | None = None  # marked, its bitmask not taken yet
        self.held: LaunchedStep | None = None  # launched, its sampling not enqueued yet
        # (step, its fill started by `advance`)
        self._fill: tuple[SchedulerOutput, concurrent.futures.Future] | None = None
        self._filler: concurrent.futures.ThreadPoolExecutor | None = None
        # (seq ids, token ids, the fill thread's advance of them) started by `collected`
        self._advanced: tuple[list[str], list[int], concurrent.futures.Future] | None = None
        self.num_early_fills = 0  # bitmasks whose fill started in `advance`
        self.num_held = 0  # times a waiting request was passed over, its grammar not ready
        self.times = LoopTimes()
        mode = device_wait_mode()  # the held step sampled behind a device wait for its fill
        self.device_wait = DeviceWait(mode == "device") if mode else None

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError naming the field when the request's constraint cannot run on this
        engine: it does not compile with this engine's backend (`input_checks.check_params`
        checked the default one). Any tensor-parallel size: every rank samples under the same
        bitmask (`TensorParallelExecutor.sample`)."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        from phloem.structured_output import validate_constraint

        validate_constraint(constraint, self.backend)

    def register(self, seq_id: str, params: SamplingParams) -> None:
        """Start compiling a new sequence's constraint, if it has one (in the background)."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        if self.manager is None:
            self.manager = self._build_manager()
            self.scheduler.admission_gate = self._ready
        self.manager.register(seq_id, constraint)

    def _build_manager(self) -> StructuredOutputManager | GrammarProcessClient:
        """The manager over the grammar library and the model's tokenizer: in the engine's
        process, or with `grammar_process` in a process of its own (in the engine's process,
        with a warning, when that cannot start: `GrammarProcessClient`). Bitmask buffers
        page-locked with a GPU."""
        import torch

        from phloem.structured_output import make_backend, tokenizer_data

        data = tokenizer_data(*self._tokenizer_args)
        pin = torch.cuda.is_available()
        if self.grammar_process:
            try:  # a fast tokenizer's JSON (what both libraries read)
                spec = GrammarProcessSpec(
                    self.backend, data.tokenizer.backend_tokenizer.to_str(), data.vocab_size,
                    data.stop_token_ids, self.num_threads, self.scheduler.config.max_num_seqs,
                )  # fmt: skip
                self.process = GrammarProcessClient(spec, pin, self._count_fill)
                return self.process
            except (AttributeError, ValueError) as e:  # not a fast tokenizer; no /dev/shm room
                logger.warning("%s: the grammars stay in the engine's process", e)
        backend = make_backend(data, self.num_threads, self.backend)
        return StructuredOutputManager(backend, data.vocab_size, self.num_threads, pin)

    def _count_fill(self, lag_s: float, fill_s: float, total_s: float) -> None:
        """A grammar process's fill read back: its lag and its own time [s] (`LoopTimes`)."""
        self.times.fill_lag_s += lag_s
        self.times.fill_s += fill_s
        self.times.fill_done_s += total_s

    def _ready(self, request: Request) -> bool:
        """The scheduler's admission gate: False while the request's grammar compiles, so it
        waits without holding up the step (its place in the queue kept; vLLM's
        WAITING_FOR_FSM). Its prefill thus starts once its matcher is ready, and its first
        sample never waits for it."""
        assert self.manager is not None
        if self.manager.is_ready(request.request_id):
            return True
        self.num_held += 1
        return False

    def forget(self, seq_id: str) -> None:
        if self.manager is not None:
            self.manager.forget(seq_id)

    def mark(self, sched: SchedulerOutput) -> None:
        """Set `sched.structured_seq_ids`: its sampled rows that are constrained (row order).
        An empty step with nothing running (requests held for their grammars) waits until every
        waiting request's grammar is ready, at most `_IDLE_WAIT_S`: the loop does not spin,
        and the next step admits them together (waiting for the first one only, a batch's
        first step would start with the one or two requests ready at that instant)."""
        self._next = None
        manager = self.manager
        if manager is None or not manager.num_live:
            return
        start = time.perf_counter()
        if not sched.scheduled and not self.scheduler.running:
            held = [r.request_id for r in self.scheduler.waiting]
            manager.wait_ready(held, _IDLE_WAIT_S)
        constrained = manager.constrained_ids
        sched.structured_seq_ids = [
            s.seq_id for s in sched.scheduled if s.sample and s.seq_id in constrained
        ]
        self._next = sched if sched.structured_seq_ids else None
        self.times.mark_s += time.perf_counter() - start

    def bitmask(self, sched: SchedulerOutput) -> GrammarBitmask:
        """The step's `GrammarBitmask` (after the previous step's tokens were advanced); rows
        that cannot be constrained fail their sequence alone (`Scheduler.fail_request`)."""
        assert self.manager is not None
        start = time.perf_counter()
        started = self._take_fill()
        if self._next is sched:  # not the step after it, marked meanwhile (`LLMEngine.step`)
            self._next = None
        if started is not None and started[0] is sched:
            self.times.fill_wait_s += time.perf_counter() - start
            grammar, failed = started[1].result()
        else:
            grammar, failed = self._timed_fill(sched.structured_seq_ids)
        self.times.num_bitmasks += 1
        self._fail_rows(failed)
        return grammar

    def _fail_rows(self, failed: dict[str, str]) -> None:
        for seq_id, message in failed.items():  # {seq id: why its row cannot be constrained}
            request = self.scheduler.requests.get(seq_id)
            if request is not None and not request.is_finished:
                self.scheduler.fail_request(request, message)

    def collected(self, sched: SchedulerOutput, sampled_token_ids: dict[str, int]) -> None:
        """A launched step's tokens are in ({seq id: token id}, `Executor.collect`), before the
        scheduler's update: when the next step is marked (async scheduling) and `sched` verified
        no drafts, hand the matchers' advance by these tokens and then the marked step's fill
        to the fill thread (module docstring); `advance` applies the advance's results. Waits
        until the thread has begun. Otherwise nothing (`advance` does it all).

        Every sampled row with a matcher advances, also a request the update will skip
        (aborted, stopped or failed meanwhile: finished, its matcher unused after). First, a
        step sampled behind a device wait gets its fill's host results (`DeviceWait.settle`)."""
        if self.device_wait is not None:  # rows its fill could not constrain fail here
            self._fail_rows(self.device_wait.settle(sched) or {})
        manager, marked = self.manager, self._next
        if manager is None or marked is None or not manager.num_live:
            return
        if any(s.draft_token_ids for s in sched.scheduled):
            return  # several tokens a row (speculative decoding): `advance`
        start = time.perf_counter()
        self._take_fill()  # none in flight here; a stale one is dropped
        ids, tokens = list(sampled_token_ids), list(sampled_token_ids.values())
        fill_ids = list(marked.structured_seq_ids)
        if self.process is not None:  # one message; nothing waits for the process to begin
            advanced, filled = self.process.start_step(ids, tokens, fill_ids)
        else:
            out = None if self.device_wait is None else self.device_wait.reserve(
                marked, len(fill_ids), manager.width)  # fmt: skip
            advanced, filled = self._start_advance_then_fill(ids, tokens, fill_ids, start, out)
        self._fill = (marked, filled)
        self._advanced = (ids, tokens, advanced)
        self.num_early_fills += 1
        took = time.perf_counter() - start
        self.times.advance_s += took
        self.times.handover_s += took

    def _start_advance_then_fill(
        self, ids: list[str], tokens: list[int], fill_ids: list[str], start: float, out=None
    ) -> tuple[concurrent.futures.Future, concurrent.futures.Future]:
        """(the advance's future, the fill's) of `_advance_then_fill` on the fill thread,
        once the thread has begun; the fill writes into `out` if given."""
        if self._filler is None:
            self._filler = concurrent.futures.ThreadPoolExecutor(1, "phloem-grammar-fill")
        begun, advanced = threading.Event(), concurrent.futures.Future()  # type: ignore[var-annotated]
        job = (ids, tokens, fill_ids, begun, advanced, out)
        filled = self._filler.submit(self._advance_then_fill, job, start)
        begun.wait()
        return advanced, filled

    def _advance_then_fill(self, job: tuple, submitted: float) -> tuple[GrammarBitmask, dict]:
        """On the fill thread: `manager.accept_rows(ids, tokens)` (its result or exception set
        on the `advanced` future), then `manager.bitmask(fill_ids)` (returned). `begun` is set
        first (the loop waits for it in `collected`)."""
        ids, tokens, fill_ids, begun, advanced, out = job
        assert self.manager is not None
        self.times.fill_lag_s += time.perf_counter() - submitted
        begun.set()
        try:
            ended = self.manager.accept_rows(ids, tokens)
        except BaseException as e:
            advanced.set_exception(e)
            raise
        advanced.set_result(ended)
        self.times.advanced_s += time.perf_counter() - submitted
        try:
            return self._timed_fill(fill_ids, out=out)
        finally:
            self.times.fill_done_s += time.perf_counter() - submitted

    def advance(self, updated: list[Request]) -> None:
        """Accept each updated constrained request's new token (or, after `collected`, wait for
        the fill thread's advance): the grammar complete finishes it "stop"; a token the
        grammar rejects fails it alone."""
        started, self._advanced = self._advanced, None
        if started is not None:
            start = time.perf_counter()
            ids, tokens, future = started
            ended = future.result()
            if ended:  # rows that complete or reject: those of requests the update kept
                kept = {r.request_id: r for r in updated}
                rows = [
                    (kept[ids[k]], tokens[k], done) for k, done in ended.items() if ids[k] in kept
                ]
                self._end(rows)
            took = time.perf_counter() - start
            self.times.advance_s += took
            self.times.advance_wait_s += took
            return
        manager = self.manager
        if manager is None or not manager.num_live:
            return
        self._take_fill()  # a fill of the states before these tokens: stale (not in `step`)
        start = time.perf_counter()
        # together (1,024 rows one by one were ~5 ms of the loop a step), and only the rows
        # that end come back: no Python per row here beyond reading its token
        tokens = [r.output_token_ids[-1] for r in updated]
        ended = manager.accept_rows([r.request_id for r in updated], tokens)
        self._end([(updated[k], tokens[k], done) for k, done in ended.items()])
        self.times.advance_s += time.perf_counter() - start
        if self._next is not None:
            self._start_fill(self._next)

    def _end(self, rows: list[tuple[Request, int, bool | None]]) -> None:
        """Finish "stop" each (request, token, True: its grammar complete) and fail each
        (request, token, None: its token rejected), in order."""
        for request, token, done in rows:
            if done is None:
                message = f"structured output: the grammar rejected token {token}"
                self.scheduler.fail_request(request, message)
            elif not request.is_finished:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)

    def _timed_fill(
        self, seq_ids: list[str], submitted: float | None = None, out=None
    ) -> tuple[GrammarBitmask, dict[str, str]]:
        """`manager.bitmask(seq_ids)`, its time added to `times.fill_s` (any thread: one fill
        runs at a time) and, for a fill handed over at `submitted` (perf_counter seconds), the
        wait for its thread to `times.fill_lag_s` and the hand-over to its end to
        `times.fill_done_s`; written into `out` if given (`DeviceWait.reserve`)."""
        assert self.manager is not None
        if self.process is not None:  # its fill's times come back with it (`_count_fill`)
            return self.process.bitmask(seq_ids)
        start = time.perf_counter()
        if submitted is not None:
            self.times.fill_lag_s += start - submitted
        try:
            return self.manager.bitmask(seq_ids, out)  # type: ignore[call-arg]
        finally:
            end = time.perf_counter()
            self.times.fill_s += end - start
            if submitted is not None:
                self.times.fill_done_s += end - submitted

    def _start_fill(self, sched: SchedulerOutput) -> None:
        """Fill the marked step's bitmask in a background thread (its rows' previous tokens are
        all accepted: `advance` runs once between a step's `mark` and its `bitmask`; the next
        step's `mark` may come before that `bitmask`, never before that `advance`). The
        library releases the GIL while filling; `forget` and `fail_request` stay on the loop.

        Not waited for: the thread needs the GIL to start and to gather its rows, which the
        loop's Python hands over at its next blocking or torch call or after the switch
        interval (5 ms); on the CPU stand-in the fill began 3-4 ms late behind 3 ms of such
        Python (benchmarks/results/2026-11-26h-cpu-structured-wait), but on an H200 waiting
        here for the thread to have its rows raised the loop's update time by
        ~3 ms a step with no less fill wait (one schema 0.76 / 0.83x with the wait, 0.89 /
        0.81x without; benchmarks/results/2026-11-26h-h200)."""
        assert self.manager is not None
        ids = list(sched.structured_seq_ids)
        if self.process is not None:  # a grammar process: its reply waited for in `bitmask`
            self._fill = (sched, self.process.start_fill(ids))
            self.num_early_fills += 1
            return
        if self._filler is None:
            self._filler = concurrent.futures.ThreadPoolExecutor(1, "phloem-grammar-fill")
        future = self._filler.submit(self._timed_fill, ids, time.perf_counter())
        self._fill = (sched, future)
        self.num_early_fills += 1

    def _take_fill(self) -> tuple[SchedulerOutput, concurrent.futures.Future] | None:
        """The started fill (finished: waited for), or None; no fill is in flight after."""
        started, self._fill = self._fill, None
        if started is not None:
            started[1].exception()  # waits (a thread's future, or a grammar process's reply)
        return started

    # -- the held step: launched, sampled once its bitmask is filled ---------------------------

    def hold(self, launched: LaunchedStep, executor: Executor, defer: bool) -> None:
        """Take a launched step with constrained samples, its sampling up to the mask enqueued
        (`Executor.presample`: by `LLMEngine._launch`, before the step before is collected, so
        beside the device's step; a no-op here then); the rest now or, with `defer` (async
        scheduling), by `sample_held` in the next `step()`, after that step's scheduling and
        `Executor.prepare` ran beside the fill. At most one step is held."""
        assert self.held is None, "the step held before was never sampled"
        executor.presample(launched.handle)
        self.held = launched
        if not defer:
            self.sample_held(executor)

    def sample_held(self, executor: Executor) -> None:
        """Enqueue the held step's sampling under its bitmask (waiting for its fill); a no-op
        when no step is held. Before the next step's launch and before the held step's
        collection; rows that cannot be constrained fail alone (`bitmask`). With the device
        wait, enqueued behind its fill without waiting (`DeviceWait.start`)."""
        launched, self.held = self.held, None
        if launched is None:
            return
        sched, started, waits = launched.scheduler_output, self._fill, self.device_wait
        if waits and executor.device_wait and started and started[0] is waits.has_buffer(sched):
            self._fill, self._next = None, None if self._next is sched else self._next
            self.times.num_bitmasks += 1  # its fill writes a buffer of `waits`: sampled behind it
            return waits.start(executor, launched, sched.structured_seq_ids, started[1])
        executor.sample(launched.handle, self.bitmask(sched))

    def sample_if_idle(self, executor: Executor) -> None:
        """`sample_held` when no request is left unfinished (all finished, failed, aborted or
        stopped): a server then calls no `step()` until a request comes, and until then a held
        step would keep its logits [S, V] on the device and, under tensor parallelism, every
        rank's step half done. The step stays in flight, sampled, as any step after which every
        request finished (the next `step()` collects it). After `LLMEngine.step`,
        `abort_request` and `stop_sequences`; O(1) otherwise."""
        if self.held is not None and not self.scheduler.has_unfinished_requests():
            self.sample_held(executor)

    def drop_held(self) -> None:
        """Forget the held step unsampled, the marked step, and a started fill (waited for, its
        result or exception discarded): for `LLMEngine.abort_all` after an exception out of
        `step()`, whose state is unknown, so no device work. The worker drops the aborted
        sequences' states at the next step (their finished ids)."""
        self.held = self._next = self._advanced = None
        if self.device_wait is not None:  # before the wait for the fill: nothing waits on it
            self.device_wait.release()
        self._take_fill()

    def close(self) -> None:
        if self.device_wait is not None:
            self.device_wait.release()
        self._take_fill()
        if self._filler is not None:
            self._filler.shutdown(wait=True)
        if self.manager is not None:
            self.manager.shutdown()
