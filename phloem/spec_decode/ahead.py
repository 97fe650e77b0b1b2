"""Drafts proposed one step ahead: for a request whose last tokens are still on the device (the
step in flight samples them, async scheduling), so that a verify step is scheduled without
collecting the step in flight first (that collection, a host sync, made a verify step cost host
+ device time serially: ~3.4x an overlapped plain step on a host-bound GPU run,
benchmarks/results/2026-11-26h-cpu-spec-gpu-gaps).

The proposer sees only known tokens, so it drafts `lead` more: the request's row in flight
drafted d_1..d_m after its last token, and samples up to m + 1 tokens; assuming it accepts all,
the tokens still to come are d_1..d_m and one more (its bonus, or for a plain row its one token).
A proposal of lead = m + 1 + k tokens must repeat d_1..d_m; its next token is the *guess* of the
pending bonus, and the k after it are the drafts the next step verifies:

    known: |-- history --|   in flight: | last? | d_1 .. d_m | (bonus) |
    proposal:                                  | d_1 .. d_m |  guess   | e_1 .. e_k |

The worker accepts e_1.. only where the bonus sampled equals the guess (`worker/stacked_rows.py`),
and the scheduler voids the row where the row in flight rejects a draft (`core/draft_tokens.py`),
so outputs are those of a step without drafts wherever the assumption fails.

A seeded request that samples (not greedy) drafts from known tokens only (`needs_known`): its
rejection sampling draws one uniform per draft from its own generator, so its tokens repeat
only where its drafts depend on its history alone, not on which of its tokens were pending when
the proposer ran (that varies with the schedule: prefix cache hits, chunking). The engine
collects the step in flight first while such a request may draft (`engine/spec_step.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

from phloem.core.request import Request
from phloem.core.scheduler_output import ScheduledSequence, SchedulerOutput

NO_ROWS: Mapping[str, ScheduledSequence] = {}  # no step in flight (never mutated)


def rows_in_flight(flight: SchedulerOutput | None) -> Mapping[str, ScheduledSequence]:
    """Seq id -> its sampled row in the step in flight (empty: none in flight)."""
    if flight is None:
        return NO_ROWS
    return {s.seq_id: s for s in flight.scheduled if s.sample}


def needs_known(request: Request) -> bool:
    """Whether `request` drafts from known tokens only (seeded sampling, module docstring)."""
    params = request.sampling_params
    return params.seed is not None and not params.greedy


def lead(request: Request, rows: Mapping[str, ScheduledSequence]) -> int:
    """Tokens a proposal for `request` must predict before its drafts: 0 when its tokens are
    all known, 1 + the drafts of its row in flight when only that row's tokens are pending (the
    row's sampled tokens), -1 when it cannot draft: not decoding next step (a prompt chunk
    left), pending tokens of another kind, or a row in flight whose own guess already failed
    (the guess's token is known now and differs: the row next step is void), or pending
    tokens of a request that drafts from known tokens only (`needs_known`)."""
    pending = request.num_pending_tokens
    num_known = request.num_prompt_tokens + len(request.output_token_ids)
    if request.num_computed_tokens + 1 != num_known + pending:
        return -1
    if not pending:
        return 0
    if needs_known(request):
        return -1
    row = rows.get(request.request_id)
    if row is None or pending != 1 + len(row.draft_token_ids):
        return -1
    guess, at = row.pending_guess, row.num_computed_tokens
    if guess >= 0 and at < num_known and request.token_ids(at, at + 1) != [guess]:
        return -1
    return pending


def split(
    proposal: list[int], num_lead: int, row: ScheduledSequence | None
) -> tuple[int, list[int]]:
    """(guess or -1, drafts) of a proposal that predicted `num_lead` tokens first (`lead`):
    no drafts unless it repeats the drafts of the row in flight and drafts past its guess."""
    if not num_lead:
        return -1, proposal
    assert row is not None
    drafts = row.draft_token_ids
    if len(proposal) <= num_lead or tuple(proposal[: num_lead - 1]) != drafts:
        return -1, []
    return proposal[num_lead - 1], proposal[num_lead:]
