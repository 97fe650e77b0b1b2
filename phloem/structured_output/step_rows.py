"""A step's constrained rows as the manager hands them to the grammar library: which rows have a
matcher and the matchers themselves, gathered once per row set and kept while a decode batch
stays the same, and the bitmask rows that allow no token.

Under async scheduling the fill thread advances a step's matchers by its tokens and then fills
the next step's bitmask, and between the end of the library's batched advance and the start of
its batched fill the engine loop waits for the GIL (it waits in `StructuredOutputs.advance` for
the advance's results, and the thread holds the GIL until the fill releases it). Gathering the
rows there was a dictionary lookup per row, twice a step, plus the library backend's ordering of
the rows by shared lexer, twice: at 1,024 rows ~0.5 ms of the loop's wait on a CPU
(benchmarks/results/2026-11-27f-cpu-structured-loop). A batch whose rows did not change (most
decode steps) now finds its lists here, the same list objects, so a backend can keep what it
derives from them (`llguidance_backend`: the rows' order and the fill's pairs).

A cached entry holds only rows whose matcher was made; `RowCache.clear` runs whenever a
sequence is forgotten or rolled back, so an entry never names a forgotten sequence's matcher.
"""

from __future__ import annotations

import numpy as np


class StepRows:
    """The rows of `seq_ids` that have a matcher: rows[j] (an index into `seq_ids`) and
    matchers[j]. Never mutated (backends key on these lists' identity)."""

    __slots__ = ("seq_ids", "rows", "matchers")

    def __init__(self, seq_ids: list[str], rows: list[int], matchers: list) -> None:
        self.seq_ids = seq_ids
        self.rows = rows
        self.matchers = matchers


class RowCache:
    """The last `size` row sets gathered in full (every row with a matcher), found by their
    sequence ids (list equality: ~10 us at 1,024 ids, the same string objects). Under async
    scheduling a step's advance and the next step's fill use two row sets (equal in a steady
    decode batch, then one entry serves both)."""

    def __init__(self, size: int = 2) -> None:
        self._size = size
        self._entries: list[StepRows] = []
        self.generation = 0  # clears so far: an entry gathered across one is not kept

    def get(self, seq_ids: list[str]) -> StepRows | None:
        for entry in self._entries:
            if entry.seq_ids == seq_ids:
                return entry
        return None

    def put(self, entry: StepRows, generation: int) -> None:
        """Keep `entry` (its `seq_ids` copied by the caller: the caller's list may change),
        gathered when `generation` was read: not if a `clear` came since (the fill thread
        gathers while the loop forgets sequences)."""
        if generation == self.generation:
            self._entries = [entry, *self._entries[: self._size - 1]]

    def clear(self) -> None:
        self.generation += 1
        self._entries = []


def empty_rows(bitmask: np.ndarray, head_words: int = 8) -> np.ndarray:
    """Indices of the rows of `bitmask` (int32 [R, W]) that allow no token, ascending. A row
    allowing one of the first `head_words` x 32 tokens (single bytes and the commonest merges
    of byte-level vocabularies: nearly every mask) is not read further; only the others are
    read whole. 1,024 rows of 128K tokens: 0.50 -> 0.03 ms, serial after the library's fill
    (benchmarks/results/2026-11-26h-cpu-structured-wait)."""
    rest = np.flatnonzero(~bitmask[:, :head_words].any(axis=1))
    return rest[~bitmask[rest].any(axis=1)]
