"""The engine's side of structured outputs: compiled grammars cached by constraint, one matcher
per sequence, and each step's bitmask.

    add_request ─► register(seq, params): compile(key) submitted to the pool once per distinct
                   constraint (a batch under one schema compiles it once), then the sequence's
                   own matcher built from it (in the pool), while prompts prefill
    step N+1    ─► bitmask(seq_ids): waits for a grammar only here (its first sampled token),
                   fills the rows of the step's constrained samples, after step N's tokens were
                   accepted (`LLMEngine.step`)
    update(N)   ─► accept(seq, token): advance; the grammar complete -> the sequence stops

Matchers are keyed by sequence id, so n > 1 siblings walk their own, and a preempted sequence
keeps its matcher (its output tokens are kept, so its grammar state is still right). A
constraint that fails to compile (rare: `validate` ran at admission) fails the sequence alone.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass

import numpy as np

from phloem.sampling_params import StructuredOutputsParams
from phloem.structured_output.backend import GrammarBackend, GrammarMatcher, bitmask_width

logger = logging.getLogger(__name__)

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


class StructuredOutputManager:
    """Compiles constraints in a thread pool and keeps the matchers of constrained sequences.

    Args:
        backend: the grammar library over the model's tokenizer.
        vocab_size: the logits' width [tokens].
        num_compile_threads: threads compiling grammars (the pool starts with the first one).
        pin_memory: keep the bitmask buffers in page-locked memory (with a GPU: the worker's
            copy to the device then skips its staging copy, 16 MB a 1,024-row step at 128K
            tokens; a buffer is rewritten only after the step that read it was collected).
    """

    def __init__(
        self,
        backend: GrammarBackend,
        vocab_size: int,
        num_compile_threads: int = 2,
        pin_memory: bool = False,
    ):
        self.backend = backend
        self.width = bitmask_width(vocab_size)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_compile_threads, thread_name_prefix="phloem-grammar"
        )
        self._compiled: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._sequences: dict[str, _Sequence] = {}
        self.num_compiled = 0  # distinct constraints submitted for compilation
        # two bitmask buffers used in turn, grown as needed: a fresh [1,024, 4,008] array a
        # step cost ~8 ms of page faults on the loop (np.full), plus ~1.3 ms to scatter the
        # filled rows into it (benchmarks/results/2026-11-26c-cpu-structured-masks)
        self._buffers: list[np.ndarray] = [np.empty((0, self.width), dtype=np.int32)] * 2
        self._turn = 0
        self._pin_memory = pin_memory

    def register(self, seq_id: str, params: StructuredOutputsParams) -> None:
        """Start compiling the sequence's constraint unless the cache has it; returns at once."""
        key = params.key()
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._pool.submit(self.backend.compile, params)
            self._compiled[key] = compiled
            self.num_compiled += 1
        # the matcher is built in the pool too (llguidance: ~1 ms each, a batch's first
        # constrained step would pay them all); the compile was submitted first, and the pool
        # runs tasks in order, so this task never waits on one that cannot start
        matcher = self._pool.submit(self._new_matcher, compiled)
        self._sequences[seq_id] = _Sequence(matcher)

    def _new_matcher(self, compiled: concurrent.futures.Future) -> GrammarMatcher:
        return self.backend.matcher(compiled.result())

    def forget(self, seq_id: str) -> None:
        """Drop a finished sequence's matcher (unknown ids are ignored)."""
        self._sequences.pop(seq_id, None)

    def is_constrained(self, seq_id: str) -> bool:
        return seq_id in self._sequences

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
            seq.matcher = seq.future.result()
        return seq.matcher

    def _buffer(self, num_rows: int) -> np.ndarray:
        """int32 [num_rows, W], uninitialized: the other buffer than last call's."""
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer.shape[0] < num_rows:
            shape = (max(num_rows, 2 * buffer.shape[0]), self.width)
            if self._pin_memory:
                import torch

                buffer = torch.empty(shape, dtype=torch.int32, pin_memory=True).numpy()
            else:
                buffer = np.empty(shape, dtype=np.int32)
            self._buffers[self._turn] = buffer
        return buffer[:num_rows]

    def bitmask(self, seq_ids: list[str]) -> tuple[GrammarBitmask, dict[str, str]]:
        """The bitmask of these sampled rows (waiting for grammars not compiled yet), and
        {seq id: reason} for rows that must fail alone (no grammar, or none of the vocabulary
        allowed); those rows, and rows of sequences no longer known (finished after this step
        was scheduled), allow every token. The library writes each row in place."""
        bitmask = self._buffer(len(seq_ids))
        failed: dict[str, str] = {}
        rows: list[int] = []
        free: list[int] = []
        matchers: list[GrammarMatcher] = []
        for i, seq_id in enumerate(seq_ids):
            seq = self._sequences.get(seq_id)
            matcher = None
            if seq is not None:
                try:
                    matcher = self._matcher(seq)
                except Exception as e:  # noqa: BLE001 - this constraint's fault: it fails alone
                    failed[seq_id] = f"structured output: {e}"
            if matcher is None or matcher.is_terminated():
                free.append(i)
                continue
            rows.append(i)
            matchers.append(matcher)
        bitmask[free] = -1
        if matchers:
            self.backend.fill_bitmasks(matchers, bitmask, rows)
            for i in np.flatnonzero(~bitmask.any(axis=1)):  # free rows are all ones
                failed[seq_ids[i]] = NO_TOKEN_MESSAGE
                bitmask[i] = -1
        return GrammarBitmask(list(seq_ids), bitmask), failed

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
        live: list[int] = []
        matchers: list[GrammarMatcher] = []
        tokens: list[int] = []
        for k, (seq_id, token_id) in enumerate(seq_tokens):
            seq = self._sequences.get(seq_id)
            if seq is None or seq.matcher is None:
                continue
            if seq.matcher.is_terminated():
                results[k] = True
                continue
            live.append(k)
            matchers.append(seq.matcher)
            tokens.append(token_id)
        if matchers:
            accepted = self.backend.accept_tokens(matchers, tokens)
            for k, matcher, ok in zip(live, matchers, accepted):
                results[k] = matcher.is_terminated() if ok else None
        return results

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """Undo the sequence's last `num_tokens` accepted tokens (speculative decoding)."""
        seq = self._sequences.get(seq_id)
        if seq is not None and seq.matcher is not None:
            seq.matcher.rollback(num_tokens)

    def shutdown(self) -> None:
        """Stop the compile threads (pending compilations are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
