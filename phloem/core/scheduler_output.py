"""The scheduler -> worker contract: what one step computes, as plain data (picklable, nothing live).

The worker keeps per-sequence state keyed by sequence id (vLLM v1's persistent batch): a sequence
is sent in full once, when it is admitted (`NewSequenceData`: prompt, outputs so far, sampling
parameters), and after that each step sends only its deltas (`ScheduledSequence`: the blocks
appended to its table since the worker last heard of it, and how many tokens to compute). The
worker appends the tokens it samples to its own copy of the outputs, so the scheduler never sends
them back. A preempted sequence loses its worker state (its id is in `preempted_seq_ids`) and is
sent in full again when it resumes.

Names: a *request* is what a user submitted (its request id); a *sequence* is one of its n
samples, the unit the scheduler and the worker deal in (`seq_id`: the request id when n is 1,
else `"<request id>#<i>"`; `phloem.core.request.Request` is one sequence).

Nothing here aliases a list the scheduler mutates later: block ids are fresh slices, the prompt
is never mutated after the request is built, and the outputs are copied.

Per scheduled sequence b, positions [num_computed_tokens, num_computed_tokens + num_tokens):

    |-- computed (KV cached) --|-- this step: num_tokens --|-- later --|
    |-- prefix_len (group's shared blocks) --|

A sequence verifying drafts (speculative decoding) computes its last known token and its k
drafts: num_tokens = 1 + k, and the step scores all 1 + k positions:

    |-- computed --|-- last token | d_1 ... d_k --|

A verify row may be scheduled before the step that samples its last token is collected (async
scheduling): its drafts were proposed one token short, and `pending_guess` is the proposer's
guess of that token; the worker accepts the drafts only where the token sampled equals it. A row
scheduled on top of a verify row still in flight assumes that row accepts all its drafts; where
it does not, the later row computes nothing (*void*, `core/draft_tokens.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from phloem.sampling_params import SamplingParams

NO_BLOCKS: tuple[int, ...] = ()  # the `new_block_ids` of a step that adds none (shared, immutable)


@dataclass(slots=True)
class NewSequenceData:
    """A sequence the worker holds no state for (fresh, or resumed after preemption).

    Attributes:
        prompt_token_ids: the prompt [tokens] (never mutated after the request is built).
        output_token_ids: outputs known on the host when it was admitted (a copy; empty for a
            fresh sequence) [tokens].
        sampling_params: how to sample it; the seed of its generator is
            `sampling_params.generator_seed()` (the worker keeps the generator's state across
            preemptions, until the sequence finishes).
    """

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step.

    Attributes:
        seq_id: the sequence id (the user's request id, or `"<request id>#<i>"` for sample i of
            n > 1).
        num_computed_tokens: tokens with KV before this step [tokens].
        num_tokens: tokens computed this step [tokens].
        sample: the step reaches the end of the sequence's tokens, so its last logits give a new
            token.
        new_block_ids: blocks appended to the sequence's block table since the previous step
            that scheduled it (its whole table when `new_sequence` is set).
        prefix_len: tokens at the start of its block table that are its runtime prefix group's
            shared blocks (0: none held, or its table does not start with them) [tokens].
        group_id: the runtime prefix group (`SharedPrefix.group_id`) those blocks belong to, -1
            when `prefix_len` is 0.
        new_sequence: set the step it is admitted (the worker builds its state from it).
        draft_token_ids: the drafts this step verifies (speculative decoding; `sample` is
            set, `num_tokens` = 1 + len(draft_token_ids)); empty: none.
        pending_guess: the guessed id of the row's last token, still pending (sampled by the
            step in flight): its drafts count only if the sampled token equals it; -1: the
            drafts follow known tokens.
    """

    seq_id: str
    num_computed_tokens: int
    num_tokens: int
    sample: bool
    new_block_ids: Sequence[int] = NO_BLOCKS
    prefix_len: int = 0
    group_id: int = -1
    new_sequence: NewSequenceData | None = None
    draft_token_ids: tuple[int, ...] = ()
    pending_guess: int = -1


@dataclass
class SchedulerOutput:
    """What one step computes, in row order.

    Attributes:
        scheduled: the step's sequences (the worker's row order).
        finished_seq_ids: sequences that left since the previous step (finished, aborted, failed):
            the worker drops their state and generators.
        preempted_seq_ids: sequences preempted while scheduling this step: the worker drops their
            state (not their generators); they come back as new sequences.
        structured_seq_ids: the sampled sequences whose token is constrained by a grammar, in
            row order (set by the engine after `schedule()`). When non-empty, the worker runs the
            forward pass at launch and samples only when handed the step's grammar bitmask
            (`ModelRunner.sample`), which the engine fills after the previous step's tokens
            advanced the grammars.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)
    preempted_seq_ids: list[str] = field(default_factory=list)
    structured_seq_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
