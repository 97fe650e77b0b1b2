"""Speculative decoding's part of `LLMEngine.step`: the drafts for the next step, set before
`schedule()` without collecting the step in flight where possible, so that verify steps keep
async scheduling's overlap.

The step in flight stays in flight: the drafter proposes one step ahead of its pending tokens
(`spec_decode/ahead.py`), the scheduler counts a verify row's drafts as pending so that the next
step is scheduled on top of it (`core/draft_tokens.py`), and the worker checks the guesses and
voids rows stacked on rejected drafts on the device (`worker/stacked_rows.py`):

    schedule(N+1, drafts ahead of N's tokens) -> launch(N+1) -> collect(N) -> update(N)

Collecting first (a host sync: `Drafter.num_syncs`) is left for three cases: a costly proposer
that may draft (a draft model drafts from known tokens only), a seeded sampling request that
may draft (its tokens repeat only where its drafts follow its known tokens, `ahead.needs_known`),
and a verify row in flight while a
request with penalties runs or waits (the engine collects the step in flight before launching a
step that samples with penalties, `Executor.needs_token_history`; that must not fall between a
verify row and a row stacked on it, whose void rule assumes the row below is collected after
the row above is launched). Before, every verify step synced: on a host-bound GPU run a verify
step cost ~3.4x an overlapped plain step (benchmarks/results/2026-11-26h-cpu-spec-gpu-gaps).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from phloem.core.scheduler import Scheduler
from phloem.engine.step_observer import LaunchedStep
from phloem.spec_decode.ahead import needs_known

if TYPE_CHECKING:
    from phloem.engine.prompt_entry import StepOutput
    from phloem.spec_decode.drafter import Drafter


def propose_drafts(
    drafter: Drafter,
    scheduler: Scheduler,
    flight: LaunchedStep | None,
    blocked: bool,
    collect: Callable[[], list[StepOutput]],
) -> list[StepOutput]:
    """Set the running requests' drafts for the next `schedule()` (module docstring); returns
    the outputs of the step in flight where it had to be collected first (`collect`, counted in
    `drafter.num_syncs`). `blocked`: a constrained request runs, nobody drafts."""
    running = scheduler.running
    may_draft = drafter.may_draft(running)
    outputs: list[StepOutput] = []
    if flight is not None and _must_collect(drafter, scheduler, flight, may_draft and not blocked):
        outputs = collect()
        drafter.num_syncs += 1
        flight = None
    if may_draft:
        drafter.propose(running, blocked, None if flight is None else flight.scheduler_output)
    return outputs


def _must_collect(
    drafter: Drafter, scheduler: Scheduler, flight: LaunchedStep, may_draft: bool
) -> bool:
    """Whether the step in flight is collected before proposing (module docstring)."""
    if may_draft and (drafter.proposer.costly or any(map(needs_known, scheduler.running))):
        return True
    if not any(s.draft_token_ids for s in flight.scheduler_output.scheduled):
        return False
    queues = itertools.chain(scheduler.running, scheduler.waiting)
    return any(r.sampling_params.has_penalties for r in queues)
