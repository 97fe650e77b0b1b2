"""The llguidance backend's split bitmask fill: rows partitioned into whole templates, one
single-thread llguidance executor per Python thread, so no two threads ever fill rows whose
matchers share a lexer.

Why: copies of one template (`LLMatcher.deep_copy`) share its lexer behind a lock held for a
whole mask; the batched fill on one N-thread `LLExecutor` (a work-stealing pool over the row
list) cuts the list into pieces that, on many threads, are smaller than a template's run of
rows, so neighbouring pieces of one template run at once and wait on each other
(benchmarks/results/2026-11-27g-cpu-fill-threads). Here each of N Python threads fills its own
group of whole templates with `fill_next_token_bitmask_par` on its own 1-thread executor (the
library releases the GIL for the call), all writing into rows of the same bitmask: no lexer is
ever wanted by two threads, at the price of a static split (balanced by row count, not cost).
Numbers: benchmarks/results/2026-11-27g-cpu-fill-split/.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

FILL_MODES = ("pool", "split")


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
    parts: list[list[int]] = [[] for _ in range(max(1, num_parts))]
    for rows in sorted(members.values(), key=len, reverse=True):
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
        """Fill every part's (matcher, row) pairs into `bitmask` (int32 [R, W], C-contiguous),
        part k on thread k (part 0 on the calling thread); returns when all are done.

        Raises:
            whatever a part's fill raises, once every part has finished (the calling thread's
            first, else the lowest part's).
        """
        from llguidance.numpy import fill_next_token_bitmask_par

        if len(parts) > self.num_threads:
            raise ValueError(f"{len(parts)} parts for {self.num_threads} threads")
        futures = []
        if self._pool is not None:
            futures = [
                self._pool.submit(fill_next_token_bitmask_par, ex, pairs, bitmask)
                for ex, pairs in zip(self._executors[1:], parts[1:])
            ]
        try:
            if parts:
                fill_next_token_bitmask_par(self._executors[0], parts[0], bitmask)
        finally:
            wait(futures)  # no thread may still write into `bitmask` after this returns
        for future in futures:
            future.result()
