"""The llguidance backend's split bitmask fill: rows partitioned into whole templates, one
single-thread llguidance executor per Python thread, so no two threads ever fill rows whose
matchers share a lexer.

Why: copies of one template (`LLMatcher.deep_copy`) share its lexer behind a lock held for a
whole mask; the batched fill on one N-thread `LLExecutor` (a work-stealing pool over the row
list) cuts the list into pieces that, on many threads, are smaller than a template's run of
rows, so neighbouring pieces of one template run at once and wait on each other
(benchmarks/results/2026-11-27g-cpu-fill-threads). Here each of N Python threads fills its own
group of whole templates with `fill_next_token_bitmask_par` on its own 1-thread executor (the
library releases the GIL for the call: 1.87 cores busy on 2), all writing into rows of the same
bitmask: no lexer is ever wanted by two threads. "split": N parts balanced by row count, one a
thread (static: masks cost 0.02-0.9 ms by the row's state, so at 14 threads the busiest part
works ~1.3x an even share); "pull": a part a template, each thread taking the next one when
free (one library call a template). Numbers: benchmarks/results/2026-11-27g-cpu-fill-split/.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

FILL_MODES = ("pool", "split", "pull")


def split_by_group(groups: list[int], num_parts: int) -> list[list[int]]:
    """Indices 0..len(groups)-1 partitioned into at most `num_parts` non-empty parts, each
    holding every index of the groups it has (a group, i.e. a shared lexer, is never split
    between parts), balanced by count: groups largest first, each to the part with the fewest
    indices so far (ties: the lower part). Within a part, one group's indices are together, in
    their given order.

    Args:
        groups: each row's group id (`LLGuidanceMatcher.group`), [rows].
        num_parts: >= 1.

    Returns:
        [part][i] row indices; no empty part; one part when `num_parts` is 1.
    """
    members: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    by_size = sorted(members.values(), key=len, reverse=True)
    if num_parts >= len(by_size):  # a group a part ("pull")
        return by_size
    parts: list[list[int]] = [[] for _ in range(max(1, num_parts))]
    for rows in by_size:
        min(parts, key=len).extend(rows)  # min picks the first of equals
    return [p for p in parts if p]


class SplitFill:
    """Fills bitmask rows on `num_threads` Python threads (the calling one and a pool of
    `num_threads - 1`), each with its own 1-thread `LLExecutor`. Not for concurrent use: one
    fill at a time (the backend's caller, the manager, fills from one thread).

    Args:
        llg: the `llguidance` module.
        num_threads: >= 1.
    """

    def __init__(self, llg, num_threads: int) -> None:
        self.num_threads = max(1, num_threads)
        self._executors = [llg.LLExecutor(1) for _ in range(self.num_threads)]
        self._pool: ThreadPoolExecutor | None = None
        if self.num_threads > 1:
            self._pool = ThreadPoolExecutor(self.num_threads - 1, "phloem-grammar-fill")

    def fill(self, parts: list[list[tuple]], bitmask: np.ndarray) -> None:
        """Fill every part's (matcher, row) pairs into `bitmask` (int32 [R, W], C-contiguous):
        up to `num_threads` threads (the calling one first) each take the next part not yet
        taken, one library call a part, until none is left (with at most `num_threads` parts:
        one each; with more, "pull": whoever is free takes the next); returns when all are done.
        A part is only ever filled by one thread.

        Raises:
            whatever a part's fill raises, once every part has finished (the calling thread's
            first, else the lowest thread's).
        """
        taken = itertools.count()  # next() is atomic under the GIL: each part taken once
        futures = []
        if self._pool is not None:
            futures = [
                self._pool.submit(_drain, ex, parts, taken, bitmask)
                for ex in self._executors[1 : len(parts)]
            ]
        try:
            _drain(self._executors[0], parts, taken, bitmask)
        finally:
            wait(futures)  # no thread may still write into `bitmask` after this returns
        for future in futures:
            future.result()


def _drain(executor, parts: list[list[tuple]], taken, bitmask: np.ndarray) -> None:
    """Fill parts[next(taken)] on `executor` until `taken` passes the last part."""
    from llguidance.numpy import fill_next_token_bitmask_par

    for k in taken:
        if k >= len(parts):
            return
        fill_next_token_bitmask_par(executor, parts[k], bitmask)
