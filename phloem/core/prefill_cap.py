"""The prefill cap of a step under online load (docs/DESIGN.md, "Steady inter-token latency").

While requests stream, a step that also computes a whole arriving prompt takes as long as the
prompt's compute (15-18 ms for 512 tokens of an 8B model on an H200, against ~5.6 ms for a
decode step), and every stream waits for it: `max_prefill_tokens_per_step` caps the prompt tokens
of such a step (Sarathi-Serve's stall-free batching, arXiv 2308.16369 §4). Under a burst the cap
would only slow the queue down: a thousand waiting prompts then wait behind steps that each admit
512 tokens, and the streams of the few admitted early gain little (measured on an H200, a
1,000-request burst of 512/128 ran at 48.5 req/s capped vs 55.2 uncapped, the shared-prefix
burst 72.3 vs 81.9; benchmarks/results/2026-11-27g-h200/). So a burst -- the prompt tokens waiting
for admission exceed `BURST_BUDGETS` steps' budgets (one long prompt is not a burst) -- lifts the
cap, and it stays lifted until the burst's queue is empty: re-capping the last few budgets of it
admitted its last 64 prompts one a step over 56 steps of ~60 ms (3.3 s of an 18.7 s burst on an
H200, the last request's 128 tokens starting that much later; benchmarks/results/
2026-11-27h-cpu-burst-trace/). Requests arriving after the queue emptied are capped again.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from phloem.config import SchedulerConfig
from phloem.core.request import Request

BURST_BUDGETS = 4  # waiting prompt tokens beyond this many step budgets make a burst


class PrefillCap:
    """The prompt tokens a step may compute, with the burst state kept between steps."""

    def __init__(self) -> None:
        self.in_burst = False  # a burst's queue is not empty yet: no cap

    def __call__(
        self, config: SchedulerConfig, running: Iterable[Request], waiting: Collection[Request]
    ) -> int | None:
        """The cap for this step [tokens], None for no cap: the config's
        `max_prefill_tokens_per_step` while a running request streams (has sampled a token, or
        one is pending) and no burst is on; else None. A burst begins when the waiting
        requests' uncomputed tokens exceed `BURST_BUDGETS` x `max_num_batched_tokens` and ends
        when `waiting` is empty (mutates `in_burst`). Walks `waiting` only until the backlog
        exceeds that (never more requests than that many tokens), and not at all during a
        burst."""
        cap = config.max_prefill_tokens_per_step
        if cap is None:
            return None
        if self.in_burst and waiting:
            return None
        self.in_burst = False
        if not any(r.output_token_ids or r.num_pending_tokens for r in running):
            return None  # nothing streams: prefill takes the whole budget
        backlog, limit = 0, BURST_BUDGETS * config.max_num_batched_tokens
        for request in waiting:
            backlog += request.num_tokens - request.num_computed_tokens
            if backlog > limit:
                self.in_burst = True
                return None  # a burst: throughput first
        return cap
