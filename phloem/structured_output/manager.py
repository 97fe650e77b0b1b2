"""The engine's side of structured outputs: compiled grammars cached by constraint, one matcher
per sequence, and each step's bitmask.

    add_request ─► register(seq, params): a constraint not in the cache (keyed by its
                   canonical text, least recently used dropped) is compiled in the pool with
                   the sequence's matcher; a cached one gives a matcher at once when the
                   backend makes one in microseconds (`GrammarBackend.ready_matcher`), else
                   the sequence queues for one pool task making its constraint's matchers
    schedule    ─► is_ready(seq): the scheduler admits a sequence once its matcher is built
    step N+1    ─► bitmask(seq_ids): fills the rows of the step's constrained samples, after
                   step N's tokens were accepted (`LLMEngine.step`); waits for a matcher only
                   for a sequence admitted without the gate (counted in `stats`)
    update(N)   ─► accept(seq, token): advance; the grammar complete -> the sequence stops

Matchers are keyed by sequence id, so n > 1 siblings walk their own, and a preempted sequence
keeps its matcher (its output tokens are kept, so its grammar state is still right). A
constraint that fails to compile (rare: `validate` ran at admission) fails the sequence alone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import KeysView
from dataclasses import dataclass

import numpy as np

from phloem.sampling_params import StructuredOutputsParams
from phloem.structured_output.backend import GrammarBackend, GrammarMatcher, bitmask_width
from phloem.structured_output.step_rows import RowCache, StepRows, empty_rows

logger = logging.getLogger(__name__)

# sequences a task makes matchers for before it looks at the queue again (and queued per task)
_MATCHERS_PER_TASK = 64
# why a sequence fails when its grammar allows no token of the vocabulary
NO_TOKEN_MESSAGE = "structured output: the grammar allows no token of the vocabulary here"


@dataclass
class GrammarBitmask:
    """The constrained rows of one step, as data for the worker.

    Attributes:
        seq_ids: the sequences whose sample is constrained, in the step's row order.
        bitmask: int32 [len(seq_ids), ceil(V / 32)]; bit t % 32 of word t // 32 set = token t
            allowed. A view of one of the manager's two reused buffers: valid until the
            manager's second `bitmask` call after this one (the worker copies it when
            sampling, before the next call).
    """

    seq_ids: list[str]
    bitmask: np.ndarray


class _Sequence:
    """One constrained sequence: the future of its matcher (built in the pool once its
    constraint compiled), then the matcher."""

    __slots__ = ("future", "matcher")

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future
        self.matcher: GrammarMatcher | None = None


@dataclass
class GrammarStats:
    """Counters since the manager started (benchmarks read them; seconds are wall time).

    Attributes:
        num_compiled: distinct constraints compiled (cache misses).
        num_sequences: sequences registered.
        compile_s: summed over compile tasks (each with its first matcher).
        matcher_s: summed over the matchers made in the pool of an already compiled constraint.
        ready_lag_s: summed over sequences, registration to matcher ready.
        max_ready_lag_s: the longest of those.
        num_ready_at_once: sequences whose matcher was made when they were registered
            (`GrammarBackend.ready_matcher`), not in the pool.
        num_rows_waited: bitmask rows that waited for their matcher (the step stood still).
        wait_s: how long `bitmask` waited for matchers, summed over steps.
        library_fill_s: the library's fills (`GrammarBackend.fill_bitmasks`), summed over
            `bitmask` calls: the rest of a call is the manager's Python, per row.
        library_advance_s: the backend's batched advances (`GrammarBackend.advance`: the
            library's and the backend's per-row Python), summed over `accept_rows` calls: the
            rest of the engine's `advance` is the manager's and the engine's Python, per row.
    """

    num_compiled: int = 0
    num_sequences: int = 0
    compile_s: float = 0.0
    matcher_s: float = 0.0
    ready_lag_s: float = 0.0
    max_ready_lag_s: float = 0.0
    num_ready_at_once: int = 0
    num_rows_waited: int = 0
    wait_s: float = 0.0
    library_fill_s: float = 0.0
    library_advance_s: float = 0.0


class StructuredOutputManager:
    """Compiles constraints in a thread pool and keeps the matchers of constrained sequences.

    Args:
        backend: the grammar library over the model's tokenizer.
        vocab_size: the logits' width [tokens].
        num_compile_threads: threads compiling grammars (the pool starts with the first one).
        pin_memory: keep the bitmask buffers in page-locked memory (with a GPU: the worker's
            copy to the device then skips its staging copy, 16 MB a 1,024-row step at 128K
            tokens; a buffer is rewritten only after the step that read it was collected).
        max_cached: compiled constraints kept (least recently registered dropped first).
        buffers: two int32 [rows, W] arrays to fill in turn instead of the manager's own (the
            grammar process's shared memory, `grammar_process.py`): never grown, so a step
            of more rows raises ValueError.
    """

    def __init__(
        self,
        backend: GrammarBackend,
        vocab_size: int,
        num_compile_threads: int = 2,
        pin_memory: bool = False,
        max_cached: int = 4096,
        buffers: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        self.backend = backend
        self.width = bitmask_width(vocab_size)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_compile_threads, thread_name_prefix="phloem-grammar"
        )
        # constraint key -> future of its compiled grammar, in least recently used order
        self._compiled: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._max_cached = max_cached
        self._sequences: dict[str, _Sequence] = {}
        self._rows = RowCache()  # the last row sets gathered whole (`_gather`)
        self.stats = GrammarStats()
        self._stats_lock = threading.Lock()  # the pool's threads add to `stats`
        # constraint key -> [(future of a sequence's matcher, registered at)] still to make
        self._waiting: dict[tuple[str, str], list[tuple[concurrent.futures.Future, float]]] = {}
        self._num_making: dict[tuple[str, str], int] = {}  # its tasks emptying the queue
        self._waiting_lock = threading.Lock()
        self._num_threads = num_compile_threads
        # two bitmask buffers used in turn, grown as needed: a fresh [1,024, 4,008] array a
        # step cost ~8 ms of page faults on the loop (np.full), plus ~1.3 ms to scatter the
        # filled rows into it (benchmarks/results/2026-11-26c-cpu-structured-masks)
        self._buffers: list[np.ndarray] = [np.empty((0, self.width), dtype=np.int32)] * 2
        self._fixed = False
        if buffers is not None:
            self.use_buffers(buffers)
        self._turn = 0
        self._pin_memory = pin_memory

    @property
    def num_compiled(self) -> int:
        """Distinct constraints submitted for compilation."""
        return self.stats.num_compiled

    def register(self, seq_id: str, params: StructuredOutputsParams) -> None:
        """Start building the sequence's matcher in the pool; returns at once. A constraint not
        in the cache is compiled by a task of its own, which builds the sequence's matcher with
        it (`GrammarBackend.compile_with_matcher`: llguidance's compile check is that matcher,
        so a distinct schema costs one grammar build, not two). A later sequence of a compiled
        constraint gets its matcher at once where the backend makes one in microseconds
        (`GrammarBackend.ready_matcher`: llguidance's copy of a built template, xgrammar's
        matcher); otherwise it joins the constraint's queue, which pool tasks empty in
        admission order (`_make_waiting`: one per 64 queued, up to the pool's threads).

        Few tasks, not one per sequence: the pool's threads need the GIL between the library's
        calls, and while another thread runs Python each hand-over can wait for the
        interpreter's switch interval (5 ms); 1,024 sequences of one schema are ready 15-27 ms
        after their registration on 1-2 threads (benchmarks/results/
        2026-11-26d-cpu-structured-distinct, 2026-11-26e-cpu-structured-one-schema)."""
        key = params.key()
        compiled = self._compiled.get(key)
        registered = time.perf_counter()
        if compiled is None:
            first: concurrent.futures.Future = concurrent.futures.Future()
            compiled = self._pool.submit(self._compile, params, first, registered)
            self._compiled[key] = compiled
            self.stats.num_compiled += 1
            while len(self._compiled) > self._max_cached:
                self._compiled.popitem(last=False)  # its sequences hold their own futures
            matcher = first
        else:
            self._compiled.move_to_end(key)
            matcher = concurrent.futures.Future()
            ready = self._ready_matcher(compiled)
            if ready is not None:
                matcher.set_result(ready)
                self.stats.num_ready_at_once += 1
            else:
                self._wait_for_matcher(key, compiled, matcher, registered)
        self.stats.num_sequences += 1
        self._sequences[seq_id] = _Sequence(matcher)

    def _ready_matcher(self, compiled: concurrent.futures.Future) -> GrammarMatcher | None:
        """`GrammarBackend.ready_matcher` of a compiled constraint (None while it compiles or
        when it failed)."""
        if not compiled.done() or compiled.exception() is not None:
            return None
        return self.backend.ready_matcher(compiled.result())

    def _compile(
        self, params: StructuredOutputsParams, first: concurrent.futures.Future, registered: float
    ) -> object:
        """Compile (in the pool), resolving `first` with the first sequence's matcher."""
        start = time.perf_counter()
        try:
            compiled, matcher = self.backend.compile_with_matcher(params)
        except BaseException as e:
            first.set_exception(e)
            raise
        first.set_result(matcher)
        self._count(registered, compile_s=time.perf_counter() - start)
        return compiled

    def _wait_for_matcher(
        self,
        key: tuple[str, str],
        compiled: concurrent.futures.Future,
        matcher: concurrent.futures.Future,
        registered: float,
    ) -> None:
        """Queue `matcher` (a sequence's future) on the constraint, starting a task to empty
        the queue for every `_MATCHERS_PER_TASK` queued (up to the pool's threads)."""
        with self._waiting_lock:
            queue = self._waiting.setdefault(key, [])
            queue.append((matcher, registered))
            active = self._num_making.get(key, 0)
            start = len(queue) > _MATCHERS_PER_TASK * active and active < self._num_threads
            if start:
                self._num_making[key] = active + 1
        if start:
            self._pool.submit(self._make_waiting, key, compiled)

    def _make_waiting(self, key: tuple[str, str], compiled: concurrent.futures.Future) -> None:
        """Resolve the constraint's queued futures with matchers (in the pool, after its
        compile), `_MATCHERS_PER_TASK` at a time until the queue is empty; a failed compile
        fails them all. A long queue has several of these tasks (one per
        `_MATCHERS_PER_TASK` queued, up to the pool's threads): matchers built apart take ~1 ms
        each."""
        error: BaseException | None = None
        try:
            grammar = compiled.result()
        except BaseException as e:  # noqa: BLE001 - the constraint's own failure
            error = e
        while True:
            with self._waiting_lock:
                queue = self._waiting.get(key, [])
                batch = queue[:_MATCHERS_PER_TASK]
                del queue[:_MATCHERS_PER_TASK]
                if not batch:
                    self._waiting.pop(key, None)
                    self._num_making[key] -= 1
                    if not self._num_making[key]:
                        del self._num_making[key]
                    return
            for future, registered in batch:
                if error is not None:
                    future.set_exception(error)
                    continue
                start = time.perf_counter()
                try:
                    made = self.backend.ready_matcher(grammar)
                    if made is None:
                        made = self.backend.matcher(grammar)
                except BaseException as e:  # noqa: BLE001 - this sequence fails alone
                    future.set_exception(e)
                    continue
                future.set_result(made)
                self._count(registered, matcher_s=time.perf_counter() - start)

    def _count(self, registered: float, compile_s: float = 0.0, matcher_s: float = 0.0) -> None:
        """Add a finished task to `stats` (its sequence registered at `registered`)."""
        now = time.perf_counter()
        with self._stats_lock:
            stats = self.stats
            stats.compile_s += compile_s
            stats.matcher_s += matcher_s
            stats.ready_lag_s += now - registered
            stats.max_ready_lag_s = max(stats.max_ready_lag_s, now - registered)

    def use_buffers(self, buffers: tuple[np.ndarray, np.ndarray]) -> None:
        """Fill these two int32 [rows, W] arrays in turn from the next `bitmask` call on (the
        grammar process's shared memory); never grown: a step of more rows raises ValueError."""
        self._buffers = list(buffers)
        self._fixed = True

    def reset_max_ready_lag(self) -> None:
        """Start `stats.max_ready_lag_s` over (benchmarks: the longest lag of one run)."""
        with self._stats_lock:
            self.stats.max_ready_lag_s = 0.0

    def forget(self, seq_id: str) -> None:
        """Drop a finished sequence's matcher (unknown ids are ignored)."""
        if self._sequences.pop(seq_id, None) is not None:
            self._rows.clear()

    def is_constrained(self, seq_id: str) -> bool:
        return seq_id in self._sequences

    @property
    def constrained_ids(self) -> KeysView[str]:
        """The ids of the constrained sequences (registered, not forgotten): a live view, so a
        step's rows are tested with `in`, no call per row."""
        return self._sequences.keys()

    def is_ready(self, seq_id: str) -> bool:
        """True unless the sequence is constrained and its matcher is still being built (its
        grammar compiling): a ready sequence's `bitmask` row never waits. A constraint that
        failed to compile is ready (its row fails at once)."""
        seq = self._sequences.get(seq_id)
        return seq is None or seq.matcher is not None or seq.future.done()

    def wait_ready(self, seq_ids: list[str], timeout: float | None = None) -> bool:
        """Wait until these sequences are ready (`is_ready`) or `timeout` seconds [s] passed
        (None: no limit); True if all are."""
        futures = [s.future for i in seq_ids if (s := self._sequences.get(i)) is not None]
        return not concurrent.futures.wait(futures, timeout).not_done

    @property
    def num_live(self) -> int:
        """Constrained sequences registered and not forgotten."""
        return len(self._sequences)

    def _matcher(self, seq: _Sequence) -> GrammarMatcher:
        """The sequence's matcher, made (after waiting for its grammar) on first use.

        Raises:
            ValueError: its constraint did not compile.
        """
        if seq.matcher is None:
            if not seq.future.done():
                start = time.perf_counter()
                concurrent.futures.wait([seq.future])
                with self._stats_lock:
                    self.stats.num_rows_waited += 1
                    self.stats.wait_s += time.perf_counter() - start
            seq.matcher = seq.future.result()
        return seq.matcher

    def _buffer(self, num_rows: int) -> np.ndarray:
        """int32 [num_rows, W], uninitialized: the other buffer than last call's."""
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer.shape[0] < num_rows:
            if self._fixed:
                raise ValueError(f"{num_rows} bitmask rows, the buffers hold {buffer.shape[0]}")
            shape = (max(num_rows, 2 * buffer.shape[0]), self.width)
            if self._pin_memory:
                import torch

                buffer = torch.empty(shape, dtype=torch.int32, pin_memory=True).numpy()
            else:
                buffer = np.empty(shape, dtype=np.int32)
            self._buffers[self._turn] = buffer
        return buffer[:num_rows]

    def bitmask(
        self, seq_ids: list[str], out: np.ndarray | None = None
    ) -> tuple[GrammarBitmask, dict[str, str]]:
        """The bitmask of these sampled rows (waiting for grammars not compiled yet), and
        {seq id: reason} for rows that must fail alone (no grammar, or none of the vocabulary
        allowed); those rows, rows of sequences no longer known (finished after this step
        was scheduled) and rows whose grammar is complete allow every token. The library
        writes each row in place.

        Runs in the fill thread, holding the GIL outside the library's calls while the engine
        loop runs Python (`engine/structured_outputs.py`), so the rows come from `_gather`
        and their grammars' completion is read in one backend call. With `out` (int32
        [len(seq_ids), W]: a buffer the caller chose, `engine/device_wait.py`) the rows are
        written there instead of into the manager's own buffers; ValueError if its shape does
        not fit."""
        if out is not None and out.shape != (len(seq_ids), self.width):
            raise ValueError(f"out must be [{len(seq_ids)}, {self.width}], got {out.shape}")
        bitmask = self._buffer(len(seq_ids)) if out is None else out
        failed: dict[str, str] = {}
        gathered = self._gather(seq_ids)
        if len(gathered.rows) < len(seq_ids):  # matchers to make (first use), or unknown rows
            gathered = self._rows_to_make(seq_ids, failed)
        rows, matchers = gathered.rows, gathered.matchers
        terminated = self.backend.terminated(matchers)
        if any(terminated):
            rows = [i for i, done in zip(rows, terminated) if not done]
            matchers = [m for m, done in zip(matchers, terminated) if not done]
        if len(rows) < len(seq_ids):
            free = np.ones(len(seq_ids), dtype=bool)
            free[rows] = False
            bitmask[free] = -1
        if matchers:
            start = time.perf_counter()
            self.backend.fill_bitmasks(matchers, bitmask, rows)
            self.stats.library_fill_s += time.perf_counter() - start  # one fill at a time
            for i in empty_rows(bitmask):  # free rows are all ones
                failed[seq_ids[i]] = NO_TOKEN_MESSAGE
                bitmask[i] = -1
        return GrammarBitmask(list(seq_ids), bitmask), failed

    def _rows_to_make(self, seq_ids: list[str], failed: dict[str, str]) -> StepRows:
        """The rows of `seq_ids` whose sequence is known, each matcher made
        (`_matcher`, waiting for its grammar) where it is not yet; a sequence whose constraint
        did not compile gets its reason in `failed` and no row."""
        made: list[tuple[int, GrammarMatcher]] = []
        for i, seq_id in enumerate(seq_ids):
            seq = self._sequences.get(seq_id)
            if seq is None:
                continue
            try:
                made.append((i, self._matcher(seq)))
            except Exception as e:  # noqa: BLE001 - this constraint's fault: it fails alone
                failed[seq_id] = f"structured output: {e}"
        return StepRows(seq_ids, [i for i, _ in made], [m for _, m in made])

    def accept(self, seq_id: str, token_id: int) -> bool | None:
        """Advance the sequence's matcher by its new token. Returns True when the grammar is
        complete (the sequence should stop), False to go on, None for a token the grammar
        rejects (a sequence whose row was unconstrained after a failure).

        A sequence whose matcher was never made (no constrained sample yet) is ignored."""
        seq = self._sequences.get(seq_id)
        if seq is None or seq.matcher is None:
            return False
        matcher = seq.matcher
        if matcher.is_terminated():
            return True
        if not matcher.accept_token(token_id):
            return None
        return matcher.is_terminated()

    def accept_many(self, seq_tokens: list[tuple[str, int]]) -> list[bool | None]:
        """`accept` of each (seq id, token id) pair (distinct ids), the matchers advanced
        together by the backend (llguidance: on its threads), with `accept`'s results; a
        matcher that rejects its token may be left unusable (its sequence is to fail)."""
        results: list[bool | None] = [False] * len(seq_tokens)
        ended = self.accept_rows([i for i, _ in seq_tokens], [t for _, t in seq_tokens])
        for k, done in ended.items():
            results[k] = done
        return results

    def accept_rows(self, seq_ids: list[str], token_ids: list[int]) -> dict[int, bool | None]:
        """Advance the matcher of seq_ids[k] by token_ids[k] (distinct ids; the matchers
        advanced together by the backend, `GrammarBackend.advance`: llguidance's threads).
        Returns {k: True} for the rows whose grammar is complete (before or after the token:
        the sequence should stop) and {k: None} for a rejected token (its matcher may be left
        unusable: the sequence is to fail); the other rows go on (`accept` False), as do
        sequences not constrained or whose matcher was never made (no constrained sample yet).

        The engine loop waits for this each step before building the step's outputs, so the
        rows come from `_gather` (`step_rows`) and only the rows that end are returned."""
        gathered = self._gather(seq_ids)
        rows, matchers = gathered.rows, gathered.matchers
        if not rows:
            return {}
        tokens = token_ids if len(rows) == len(token_ids) else [token_ids[k] for k in rows]
        start = time.perf_counter()
        results = self.backend.advance(matchers, tokens)
        self.stats.library_advance_s += time.perf_counter() - start  # one advance at a time
        if True not in results and None not in results:  # nearly every step: none ended
            return {}
        return {rows[j]: done for j, done in enumerate(results) if done is not False}

    def _gather(self, seq_ids: list[str]) -> StepRows:
        """The rows of `seq_ids` whose sequence has a matcher (`StepRows`): from the cache
        when these ids were gathered whole before (the same lists: `step_rows`), else one
        comprehension, cached when every row has its matcher."""
        cached = self._rows.get(seq_ids)
        if cached is not None:
            return cached
        sequences, generation = self._sequences, self._rows.generation
        live = [
            (k, seq.matcher)
            for k, seq_id in enumerate(seq_ids)
            if (seq := sequences.get(seq_id)) is not None and seq.matcher is not None
        ]
        gathered = StepRows(list(seq_ids), [k for k, _ in live], [m for _, m in live])
        if len(live) == len(seq_ids):
            self._rows.put(gathered, generation)
        return gathered

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """Undo the sequence's last `num_tokens` accepted tokens (speculative decoding)."""
        seq = self._sequences.get(seq_id)
        if seq is not None and seq.matcher is not None:
            self._rows.clear()
            seq.matcher.rollback(num_tokens)

    def shutdown(self) -> None:
        """Stop the compile threads (pending compilations and queued matchers are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._waiting_lock:
            for queue in self._waiting.values():
                for future, _ in queue:
                    future.cancel()
            self._waiting.clear()
