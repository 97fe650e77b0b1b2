"""A request's draft tokens (speculative decoding): how many a step verifies (the budget,
`max_tokens` and the context bound them), and applying what the verification accepted. Pure
Python.

A decoding request that verifies k drafts computes 1 + k tokens and emits between 1 and k + 1:

    |-- computed --|-- last token | d_1 ... d_k --|  -> up to k + 1 new output tokens
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


def take_drafts(request: Request, num_new: int, budget: int, max_model_len: int) -> tuple[int, ...]:
    """The drafts `request` verifies in the step being scheduled, taken from (and clearing)
    `request.draft_token_ids`.

    Drafts are verified only by a request that decodes this step (`num_new` == 1, its last
    token known on the host, nothing pending) and are cut so that 1 + k fits in `budget`
    [tokens] (the step's budget less one token for each running request after it), the k + 1
    tokens it may emit fit in `max_tokens`, and its tokens stay within `max_model_len`.
    """
    drafts = request.draft_token_ids
    request.draft_token_ids = []
    num_tokens = request.num_tokens
    if num_new != 1 or request.num_pending_tokens or request.num_computed_tokens + 1 != num_tokens:
        return NO_DRAFTS
    k = min(len(drafts), budget - 1, max_model_len - num_tokens - 1)
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        k = min(k, max_tokens - len(request.output_token_ids) - 1)
    return tuple(drafts[:k]) if k > 0 else NO_DRAFTS


def apply_verified(
    request: Request,
    scheduled: ScheduledSequence,
    token_id: int,
    num_accepted_drafts: Mapping[str, int],
    kv: KVManager,
    max_model_len: int,
) -> tuple[RequestStatus | None, int]:
    """Apply a verify step: roll `num_computed_tokens` back past the rejected drafts and free
    the blocks past it (`KVManager.trim`; not for a request preempted since, which holds none),
    then append the accepted drafts and `token_id` (the residual or bonus token), checking the
    stop rules after each: a stop drops the rest. Returns (the stop status or None, tokens
    appended).

        before: |-- computed --|-- last, d_1 .. d_a | d_a+1 .. d_k (rejected) --|
        after:  |-- computed ------------------------|  + outputs d_1 .. d_a, token_id
    """
    drafts = scheduled.draft_token_ids
    num_accepted = num_accepted_drafts.get(request.request_id, 0)
    if request.status is RequestStatus.RUNNING:
        request.num_computed_tokens -= len(drafts) - num_accepted
        kv.trim(request)
    status, num_new = None, 0
    for token in (*drafts[:num_accepted], token_id):
        request.append_output_token(token)
        num_new += 1
        status = check_stop(request, max_model_len)
        if status is not None:
            break
    return status, num_new
