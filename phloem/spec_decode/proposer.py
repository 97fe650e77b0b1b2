"""The proposer interface: every method the engine calls on a draft proposer, declared once.

A proposer drafts up to k tokens per request from that request's token history (prompt + outputs
so far). It may keep per-request state between steps (an incremental index), keyed by the
request's id; the engine tells it when a request leaves (`finish`). Histories only grow between
calls (rejected drafts never enter them), so a proposer indexes only the tokens appended since its
last call; a history shorter than what it indexed (a reused id) restarts the request's state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One request to draft for this step.

    Attributes:
        request_id: the sequence id (`ScheduledSequence.seq_id`); a proposer's state key.
        token_ids: the request's prompt followed by its outputs so far [tokens] (read only).
        num_prompt_tokens: how many of `token_ids` are the prompt [tokens].
        max_draft_tokens: the most tokens to draft (the cost rule's k; 0 drafts none) [tokens].
        num_lead_tokens: how many of those predict tokens already on their way (sampled or
            drafted by the step in flight, `ahead.py`); a proposer whose draft length is capped
            by its own rule extends the cap by them [tokens].
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_draft_tokens: int
    num_lead_tokens: int = 0


class Proposer(ABC):
    """Drafts tokens for a batch of requests; deterministic (its q is one-hot on the drafts, so
    `rejection_sample(..., draft_probs=None)` verifies them).

    Attributes:
        costly: drafting runs a model (a pass per draft): the drafter applies the cost rule
            before proposing, on each request's full budget, and asks only for what it chose.
    """

    costly: bool = False

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Drafts per request, in order: at most `max_draft_tokens` ids each (empty: none).

        Updates the proposer's index with each request's new tokens. Raises ValueError on a
        negative `max_draft_tokens` or `num_prompt_tokens` outside [0, len(token_ids)].
        """

    @abstractmethod
    def finish(self, request_id: str) -> None:
        """Forget the request's private state (it finished, was aborted or preempted for good);
        an unknown id is ignored."""

    def preempted(self, request_id: str) -> None:  # noqa: B027 - a no-op by default
        """The request was preempted: it comes back later with the same history. Free what it
        holds that is worth freeing (a draft model's KV blocks); the default keeps its state."""


def check_draft_request(request: DraftRequest) -> None:
    """Raise ValueError naming the field of `request` that is out of range."""
    if request.max_draft_tokens < 0:
        raise ValueError(f"max_draft_tokens must be >= 0, got {request.max_draft_tokens}")
    if not 0 <= request.num_prompt_tokens <= len(request.token_ids):
        raise ValueError(
            f"num_prompt_tokens must lie in [0, len(token_ids) = {len(request.token_ids)}], "
            f"got {request.num_prompt_tokens}"
        )
