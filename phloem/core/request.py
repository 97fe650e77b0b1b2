"""A request's scheduling state: its tokens and how many of them have KV in the cache.

The one number that drives scheduling (vLLM v1's contract):

    |------------------------------ num_tokens ------------------------------|
    |---------- prompt_token_ids ----------|------- output_token_ids -------|
    |---- num_computed_tokens (KV cached) ----|--- still to compute ---|

Each step the scheduler gives a request some tokens to compute; when `num_computed_tokens`
reaches `num_tokens`, the step's logits at the last position yield one new output token. Prefill,
chunked prefill, decode, resumption after preemption and prefix hits are all this one loop.

With async scheduling, a token sampled by a step still on the device is *pending*: counted in
`num_tokens` (so the next step can be scheduled to compute it) but not yet in `output_token_ids`:

    |---------------- num_known_tokens ----------------|-- num_pending_tokens --|

Speculative decoding: the engine sets `draft_token_ids` before `schedule()`; a decoding request
computes its last token and the drafts in one step (`ScheduledSequence.draft_token_ids`), and
its update appends the accepted drafts plus one token, rolling `num_computed_tokens` back past
the rejected ones. Drafts are never part of the history:

    |-- computed --|-- last token, d_1 .. d_k (this step) --|
                    after: |-- last, d_1..d_a --| computed, then one new token (no KV yet)

Until the update, a verify row's 1 + k tokens count as pending (all drafts assumed accepted),
so the next step can be scheduled on top of it before it is collected (`core/draft_tokens.py`).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from phloem.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its KV blocks were taken back (recompute)
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # failed alone: an exception in its own setup or update

    @property
    def finished(self) -> bool:
        return self in _FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        # a module-level table: read for every sequence of every step (the core's deltas)
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
_FINISHED_STATUSES = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
)


_GROUP_IDS = itertools.count()  # SharedPrefix.group_id: unique in the process


def token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Token ids at positions [start, end) of prompt + output, without concatenating them."""
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    if start >= num_prompt:
        return output[start - num_prompt : end - num_prompt]
    return prompt[start:] + output[: end - num_prompt]


@dataclass(eq=False)
class SharedPrefix:
    """A prefix whose KV is computed once and shared by its members (BatchLLM §4.2 groups, and
    the n > 1 sequences of one prompt).

    The first member to run (`leader`) computes the prefix as part of its own prompt; when its
    KV is complete, the group takes one reference to its blocks (`block_ids`) and every other
    member starts from them. The group's reference lives as long as the group: it is dropped
    when the last member finishes (BatchLLM's group lifetime, no LRU guesswork), or earlier if
    the group is idle (no member running) when KV runs short; a later member then recomputes
    the prefix as the new leader (the scheduler's `_release_idle_prefixes*`).

    This is the *runtime* group; the offline planner's `PrefixGroup` (core/prefix_planner.py)
    is the plan it is made from, and the attention backends' per-step view of it is
    `SharedPrefixMetadata` (ops/attention/prefix_groups.py).

    Attributes:
        prefix_len: shared tokens, a multiple of the block size [tokens].
        num_unfinished: members not yet finished.
        block_ids: the prefix's blocks once computed and held by the group, else None.
        leader: the member computing the prefix right now, if any.
        group_id: unique in the process (the worker's name for the group).
    """

    prefix_len: int
    num_unfinished: int
    block_ids: list[int] | None = None
    leader: Request | None = None
    group_id: int = field(default_factory=lambda: next(_GROUP_IDS))


@dataclass(eq=False)
class Request:
    """One sequence to generate (a prompt with n > 1 becomes n Requests).

    Attributes:
        request_id: the sequence id, unique among live sequences: the user's request id when
            n is 1, else `"<request id>#<i>"` (the contract's `seq_id`).
        prompt_token_ids: the prompt [tokens]; never changed after construction.
        num_prompt_tokens: len(prompt_token_ids), stored (the scheduler reads it for every
            request every step) [tokens].
        sampling_params: how to sample; `max_tokens` None means up to the context length.
        eos_token_id: the model's end-of-sequence token (None: no EOS rule).
        arrival_time: seconds (time.monotonic) when the request was added.
        shared_prefix: the group whose prefix KV this request starts from, if any.
        output_token_ids: generated tokens so far.
        num_computed_tokens: tokens whose KV is in the cache [tokens].
        num_cached_tokens: prompt tokens taken from shared blocks instead of computed [tokens].
        num_preemptions: times its blocks were taken back.
        num_pending_tokens: tokens sampled by steps still in flight (async scheduling), not yet
            appended to `output_token_ids` [tokens].
        stop_reason: the stop string or stop token id that finished it, if any.
        num_sent_blocks: entries of its block table the worker has been sent (the scheduler
            sends the rest as `ScheduledSequence.new_block_ids`) [blocks].
        draft_token_ids: drafts the engine proposed for its next step (speculative decoding);
            the scheduler takes them (or drops them) when it schedules the request [tokens].
        draft_guess: with `draft_token_ids`, the guessed id of its last (pending) token, or -1
            when the drafts follow known tokens (`ScheduledSequence.pending_guess`).
        void_next_row: its row in the step after the one just applied assumed drafts that were
            rejected, so it computed nothing: its update is skipped (`draft_tokens`).
        table_prefix: the scheduler's cache of (its group's `block_ids` when worked out,
            `prefix_len`, `group_id`) for its current block table (None: not worked out since
            the table was made).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    shared_prefix: SharedPrefix | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_pending_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_sent_blocks: int = 0
    draft_token_ids: list[int] = field(default_factory=list, repr=False)
    draft_guess: int = field(default=-1, repr=False)
    void_next_row: bool = field(default=False, repr=False)
    table_prefix: tuple[list[int] | None, int, int] | None = field(default=None, repr=False)
    num_prompt_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known plus pending tokens: what the scheduler may compute."""
        return self.num_prompt_tokens + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus appended output tokens (their ids are on the host)."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED_STATUSES

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output (known tokens only)."""
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    def append_output_token(self, token_id: int) -> None:
        """Append a sampled token; a pending one (async scheduling) stops being pending."""
        self.output_token_ids.append(token_id)
        if self.num_pending_tokens:
            self.num_pending_tokens -= 1


def table_prefix(group: SharedPrefix, block_ids: list[int]) -> tuple[list[int] | None, int, int]:
    """(the group's `block_ids` now, `prefix_len`, `group_id`) of a scheduled sequence of
    `group`: the group's when the table starts with the group's held blocks, else 0 and -1.
    Stays true for the table while the group holds the same blocks (`Request.table_prefix`).

    Comparing the first and the last prefix block is enough: a table holds a group's block at
    the same index only by attaching the group's blocks (or a radix-cache path through them,
    which fixes every block before it), never by a fresh allocation.
    """
    held = group.block_ids
    if held is None:
        return None, 0, -1
    n = len(held)
    if len(block_ids) >= n and block_ids[n - 1] == held[-1] and block_ids[0] == held[0]:
        return held, group.prefix_len, group.group_id
    return held, 0, -1
