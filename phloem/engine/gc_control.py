"""Python's garbage collector around big offline batches (`LLM.generate`, the JSONL jobs).

Building a batch of thousands of prompts allocates objects holding millions of token ids, all of
which survive; every automatic collection would traverse them again, while the batch is built
(the collections' cost grows with the batch, so a big batch's setup spends most of its time in
them) and while it runs (each full collection stalls the step loop). So: collection is paused
while a batch is built (`gc_paused`), and the built batch is frozen out of collection while it
runs (`gc_frozen`), entered before collection resumes. The pauses this removes are measured in
benchmarks/results/2026-11-23-h200-c/README.md (`bench` reports them as `gc`).

A long-lived process (the server's engine core) instead freezes what its start-up built once,
for good (`freeze_start_up`), as `phloem serve`'s front does.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

YOUNG_GC_THRESHOLD = 50_000  # allocations between young-generation collections while a batch runs
_depth = 0  # `gc_frozen` blocks open now: only the outermost one may unfreeze
# Objects were frozen by another party (a library at import, `phloem serve`'s start-up) before a
# block here froze the batch: then no block unfreezes, and this is never counted again, because
# counting walks the whole permanent generation (`gc.get_freeze_count` is O(frozen objects):
# 60 ms a call on an H200 process after the first batch stayed frozen, all of it in batch-1 TTFT).
_foreign_frozen = False


@contextlib.contextmanager
def gc_paused() -> Iterator[bool]:
    """Pause automatic garbage collection in the block; yields whether it was on, and restores
    that state on exit (also on errors).

    Encoding, planning and queueing a batch allocate objects holding millions of token ids,
    all of which survive; every automatic collection meanwhile would traverse all of them
    again, a cost that grows with the batch and for thousands of long prompts exceeds the work.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield enabled
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """`gc.freeze()` every object alive now (the queued batch above all) for the block, and
    collect the young generation less often, so that collections while a batch runs are few and
    only traverse objects made since; without it each full
    collection re-traverses every queued prompt, a stall between steps that grows with the batch.
    Frozen objects are still freed by reference count; only cyclic garbage
    among them waits for the unfreeze.

    On exit `gc.unfreeze()` returns them to collection, unless the process held frozen objects
    before (an import or its own start-up froze them, as vLLM does; on a GPU machine a library
    freezes a few hundred at import): unfreezing would release theirs too, so the batch stays
    in the permanent generation with them (it is still freed by reference count). Whether
    others froze objects is counted only while nothing of phloem's is frozen (see
    `_foreign_frozen`); a nested block never unfreezes.
    """
    global _depth, _foreign_frozen
    if _depth == 0 and not _foreign_frozen:  # ours were unfrozen: only others' are counted
        _foreign_frozen = gc.get_freeze_count() > 0
    owner = _depth == 0 and not _foreign_frozen
    _depth += 1
    gc.freeze()
    thresholds = gc.get_threshold()
    # Young collections: eager GPU steps allocate thousands of short-lived objects, nearly all
    # freed by reference count; at the default threshold (700 allocations) a long run collects
    # thousands of times for little garbage. One young collection per YOUNG_GC_THRESHOLD
    # allocations finds the same garbage at a fraction of the count.
    gc.set_threshold(max(thresholds[0], YOUNG_GC_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        _depth -= 1
        gc.set_threshold(*thresholds)
        if owner:
            gc.unfreeze()


def freeze_start_up() -> int:
    """Collect once, then freeze every object alive now for the life of the process, and collect
    the young generation once per `YOUNG_GC_THRESHOLD` allocations; returns how many objects
    were frozen.

    For a process that serves after its start-up (the engine core): the model, the CUDA graphs'
    Python objects and the engine live until the process ends, and without this every full
    collection that the serving loop sets off walks all of them again, a pause between two
    steps that every running stream sees as inter-token latency (vLLM's engine core freezes
    its start-up heap the same way). Frozen objects are still freed by reference count.
    """
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], YOUNG_GC_THRESHOLD), *thresholds[1:])
    return gc.get_freeze_count()
