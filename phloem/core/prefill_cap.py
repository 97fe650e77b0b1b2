"""The prefill cap of a step under online load (docs/DESIGN.md, "Steady inter-token latency").

While requests stream, a step that also computes a whole arriving prompt takes as long as the
prompt's compute (15-18 ms for 512 tokens of an 8B model on an H200, against ~5.6 ms for a
decode step), and every stream waits for it: `max_prefill_tokens_per_step` caps the prompt tokens
of such a step (Sarathi-Serve's stall-free batching, arXiv 2308.16369 §4). Under a burst the cap
would only slow the queue down: a thousand waiting prompts then wait behind steps that each admit
512 tokens, and the streams of the few admitted early gain little (measured on an H200, a
1,000-request burst of 512/128 ran at 48.5 req/s capped vs 55.2 uncapped, the shared-prefix
burst 72.3 vs 81.9; benchmarks/results/2026-11-27g-h200/). So the cap holds only while the
prompt tokens waiting for admission fit in `BURST_BUDGETS` steps' budgets (one long prompt is
not a burst); past that the queue takes the whole budget, as it does with nothing streaming.
"""

from __future__ import annotations

from collections.abc import Iterable

from phloem.config import SchedulerConfig
from phloem.core.request import Request

BURST_BUDGETS = 4  # waiting prompt tokens beyond this many step budgets make a burst


def prefill_cap(
    config: SchedulerConfig, running: Iterable[Request], waiting: Iterable[Request]
) -> int | None:
    """The prompt tokens a step may compute in all [tokens], None for no cap: the config's
    `max_prefill_tokens_per_step` while a running request streams (has sampled a token, or
    one is pending) and the waiting requests' uncomputed tokens are at most `BURST_BUDGETS` x
    `max_num_batched_tokens`; else None. Walks `waiting` only until the backlog exceeds that
    (never more requests than that many tokens)."""
    cap = config.max_prefill_tokens_per_step
    if cap is None:
        return None
    if not any(r.output_token_ids or r.num_pending_tokens for r in running):
        return None  # nothing streams: prefill takes the whole budget
    backlog, limit = 0, BURST_BUDGETS * config.max_num_batched_tokens
    for request in waiting:
        backlog += request.num_tokens - request.num_computed_tokens
        if backlog > limit:
            return None  # a burst: throughput first
    return cap
