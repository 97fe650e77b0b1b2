"""A request's draft tokens (speculative decoding): how many a step verifies (the budget,
`max_tokens` and the context bound them), and applying what the verification accepted. Pure
Python.

A decoding request that verifies k drafts computes 1 + k tokens and emits between 1 and k + 1:

    |-- computed --|-- last token | d_1 ... d_k --|  -> up to k + 1 new output tokens

Verify steps keep async scheduling's overlap: a row's 1 + k tokens count as pending until its
update (all drafts assumed accepted), so the next step can schedule the request on top of it
while it runs, its last token (the bonus) pending and, when the drafter proposed ahead, drafts
after a guess of that token (`ScheduledSequence.pending_guess`):

    step N   (in flight): |-- computed --|-- last | d_1 .. d_k --|
    step N+1 (launched):                                         |-- bonus? | e_1 .. e_j --|

Where step N accepts a < k drafts, its update rolls the request back to its known tokens and
marks its row in step N+1 void (`Request.void_next_row`): that row computed at the wrong
positions, so its update is skipped (the worker drops its tokens by the same rule) and the
request is scheduled again from its known tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from phloem.core.request import Request, RequestStatus
from phloem.core.scheduler_output import ScheduledSequence
from phloem.core.stop_checker import check_stop

if TYPE_CHECKING:
    from phloem.core.kv_manager import KVManager

NO_DRAFTS: tuple[int, ...] = ()  # `ScheduledSequence.draft_token_ids` of a step without drafts


def take_drafts(
    request: Request, num_new: int, budget: int, max_model_len: int
) -> tuple[tuple[int, ...], int]:
    """The drafts `request` verifies in the step being scheduled and the guess of its pending
    last token (-1: none), taken from (and clearing) `request.draft_token_ids` and
    `request.draft_guess`.

    Drafts are verified only by a request that decodes this step (`num_new` == 1, only its last
    token uncomputed): known on the host (no guess, nothing pending), or pending with a guess
    (proposed ahead). They are cut so that 1 + k fits in `budget` [tokens] (the step's budget
    less one token for each running request after it), the k + 1 tokens it may emit fit in
    `max_tokens`, and its tokens stay within `max_model_len` (one token less after a guess, so
    that the optimistic pending tokens never stop the request early, `check_stop`).
    """
    drafts, guess = request.draft_token_ids, request.draft_guess
    request.draft_token_ids, request.draft_guess = [], -1
    num_tokens, pending = request.num_tokens, request.num_pending_tokens
    if (
        num_new != 1
        or (guess < 0) == (pending > 0)
        or request.num_computed_tokens + 1 != num_tokens
    ):
        return NO_DRAFTS, -1
    k = min(len(drafts), budget - 1, max_model_len - num_tokens - 1 - (guess >= 0))
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        k = min(k, max_tokens - len(request.output_token_ids) - pending - 1)
    return (tuple(drafts[:k]), guess) if k > 0 else (NO_DRAFTS, -1)


def apply_verified(
    request: Request,
    scheduled: ScheduledSequence,
    token_id: int,
    num_accepted_drafts: Mapping[str, int],
    kv: KVManager,
    max_model_len: int,
) -> tuple[RequestStatus | None, int]:
    """Apply a verify step: drop the rejected drafts from the pending tokens, roll
    `num_computed_tokens` back past them and free the blocks past it (`KVManager.trim`; not for
    a request preempted since, which holds none), then append the accepted drafts and
    `token_id` (the residual or bonus token), checking the stop rules after each: a stop drops
    the rest. Returns (the stop status or None, tokens appended).

        before: |-- computed --|-- last, d_1 .. d_a | d_a+1 .. d_k (rejected) --|-- next row? --|
        after:  |-- computed ------------------------|  + outputs d_1 .. d_a, token_id

    A row of the next step stacked on this one (module docstring; seen as pending tokens
    beyond this row's a + 1) assumed all k accepted: where a < k it is void, its pending
    tokens and computed positions dropped too (`Request.void_next_row`).
    """
    drafts = scheduled.draft_token_ids
    num_accepted = num_accepted_drafts.get(request.request_id, 0)
    num_rejected = len(drafts) - num_accepted
    request.num_pending_tokens = max(0, request.num_pending_tokens - num_rejected)
    if num_rejected and request.num_pending_tokens > num_accepted + 1:  # a row stacked on it
        request.void_next_row = True  # (preempted since or not: its tokens are wrong)
        request.num_pending_tokens = num_accepted + 1
    if num_rejected and request.status is RequestStatus.RUNNING:
        request.num_computed_tokens = request.num_known_tokens + num_accepted
        kv.trim(request)
    run = (*drafts[:num_accepted], token_id)
    if not _may_stop(request, run, max_model_len):  # (the common run: appended at once)
        request.output_token_ids.extend(run)
        request.num_pending_tokens = max(0, request.num_pending_tokens - len(run))
        return None, len(run)
    status, num_new = None, 0
    for token in run:
        request.append_output_token(token)
        num_new += 1
        status = check_stop(request, max_model_len)
        if status is not None:
            break
    return status, num_new


def _may_stop(request: Request, run: tuple[int, ...], max_model_len: int) -> bool:
    """False when no token of `run`, appended one at a time, would meet a `check_stop` rule,
    so the run can be appended at once (not a Python loop per accepted draft: a verify step's
    update is host time, results/2026-11-27c-cpu-spec-per-draft). The length rules grow with
    each appended token (outputs + 1, pending - 1 down to 0), so the last token meets them if
    any does; the token rules are checked on the whole run, whatever `min_tokens` (True where
    one matches: the caller's per-token loop decides). Conservative: True may still not stop."""
    params = request.sampling_params
    if not params.ignore_eos and request.eos_token_id in run:
        return True
    if params.stop_token_ids and not set(run).isdisjoint(params.stop_token_ids):
        return True
    num_output = len(request.output_token_ids) + len(run)
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return True
    pending = max(0, request.num_pending_tokens - len(run))
    return request.num_prompt_tokens + num_output + pending >= max_model_len
