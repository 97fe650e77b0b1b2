"""The worker's persistent per-sequence state and the one builder of a step's host inputs.

The scheduler sends a sequence in full once (`NewSequenceData`) and deltas after
(`ScheduledSequence.new_block_ids`); `InputBatch` keeps what it was sent, keyed by sequence id,
and appends the tokens the worker samples (vLLM v1's persistent batch). Everything a step's
tensors are made of comes from here: `HostStep.build` for eager steps and CUDA-graph replays
(`HostStep.padded` pads a decode step to its graph's bucket), `HostStep.dummy` for the memory
profile's step.

A token whose position is past what the worker knows (`SequenceState.num_known_tokens`) was
sampled by the step still in flight (async scheduling): its input id is filled in on the device
from that step's sampled tensor (`HostStep.pending`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from phloem.core.request import token_slice
from phloem.core.scheduler_output import SchedulerOutput
from phloem.layers.sampler import SamplingRow
from phloem.ops.seeded_noise import SeedStream
from phloem.sampling_params import SamplingParams


@dataclass(eq=False)
class SequenceState:
    """What the worker knows of one sequence between steps.

    Attributes:
        prompt_token_ids: the prompt [tokens] (read only).
        output_token_ids: outputs known on this host: those sent at admission plus those sampled
            here since (appended in place; sampling rows read the same list) [tokens].
        params: its sampling parameters.
        block_ids: its block table (appended from each step's `new_block_ids`).
        row: its sampling row, cached when nothing in it depends on the step (no min_tokens).
    """

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    row: SamplingRow | None = None
    num_prompt_tokens: int = field(init=False, repr=False)  # len(prompt_token_ids), stored

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output (known tokens only)."""
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)


class InputBatch:
    """The sequences the worker holds state for, kept in step with the scheduler's outputs."""

    def __init__(self) -> None:
        self.states: dict[str, SequenceState] = {}
        # states whose sampling reads earlier outputs (penalties): 0 lets
        # `needs_token_history` look at a step's new sequences only
        self.num_with_penalties = 0

    def update(self, sched: SchedulerOutput) -> list[SequenceState]:
        """Apply one scheduler output (each exactly once, in order): drop finished and preempted
        sequences, add new ones, extend block tables. Returns the scheduled sequences' states
        in row order.

        Raises:
            KeyError: a scheduled sequence was never sent as new.
        """
        states = self.states
        for seq_id in (*sched.finished_seq_ids, *sched.preempted_seq_ids):
            self._drop(seq_id)
        rows = []
        for s in sched.scheduled:
            new = s.new_sequence
            if new is not None:
                self._drop(s.seq_id)
                state = SequenceState(
                    new.prompt_token_ids, list(new.output_token_ids), new.sampling_params
                )
                states[s.seq_id] = state
                self.num_with_penalties += state.params.has_penalties
            else:
                state = states[s.seq_id]
            if s.new_block_ids:
                state.block_ids.extend(s.new_block_ids)
            rows.append(state)
        return rows

    def needs_token_history(self, sched: SchedulerOutput) -> bool:
        """True if sampling this step reads earlier output tokens (penalties), so a step in
        flight must be collected (its tokens appended) before this one is launched."""
        held = self.num_with_penalties > 0  # else only new sequences can have them
        for s in sched.scheduled:
            new = s.new_sequence
            if new is not None:
                if new.sampling_params.has_penalties:
                    return True
            elif held and self.states[s.seq_id].params.has_penalties:
                return True
        return False

    def _drop(self, seq_id: str) -> None:
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.num_with_penalties -= state.params.has_penalties


@dataclass
class HostStep:
    """A step's inputs on the host (T tokens, B sequences, S sampled): numpy arrays for what
    becomes a tensor, lists for what backends plan from."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]
    query_lens: list[int]  # [B]
    seq_lens: list[int]  # [B]
    block_tables: list[list[int]]  # [B] the states' lists (not copies: read only)
    logits_indices: list[int]  # [S]
    sampled: list[int]  # [S] row of each sampled sequence
    prefix_lens: list[int] | None  # [B], only when the backend batches prefix groups
    pending: list[tuple[int, str]]  # (token index, seq id): ids sampled by the step in
    # flight (async scheduling), filled in on the device from that step's sampled tokens
    draft_counts: list[int] = field(default_factory=list)  # [S] drafts per sampled row (a
    # verify step, speculative decoding: its 1 + k positions all take logits); [] when none

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token and samples (a CUDA-graph step)."""
        return len(self.sampled) == len(self.query_lens) == len(self.input_ids)

    @classmethod
    def build(
        cls,
        sched: SchedulerOutput,
        states: list[SequenceState],
        block_size: int,
        prefix_lens: bool,
    ) -> HostStep:
        """Each scheduled sequence b computes positions [start_b, end_b):

            |-- computed (start_b) --|-- this step: q_len_b tokens --|-- later --|

        Per-sequence work is a few list slices; per-token work is vectorized (numpy). A step
        of one token per sequence (decode) takes one loop (`_build_decode`)."""
        scheduled = sched.scheduled
        if len(scheduled) == sum(s.num_tokens for s in scheduled):
            return cls._build_decode(sched, states, block_size, prefix_lens)
        bs = block_size
        ids: list[int] = []
        blocks: list[int] = []  # per sequence, the blocks its new tokens fall in, concatenated
        starts = [s.num_computed_tokens for s in scheduled]
        q_lens = [s.num_tokens for s in scheduled]
        tables = [state.block_ids for state in states]
        pending: list[tuple[int, str]] = []
        for s, state, start, q_len, table in zip(scheduled, states, starts, q_lens, tables):
            end = start + q_len
            known_end = end - len(s.draft_token_ids)  # |-- known ids --|-- drafts --|
            ids += token_slice(state.prompt_token_ids, state.output_token_ids, start, known_end)
            if known_end > state.num_prompt_tokens + len(
                state.output_token_ids
            ):  # the last one is pending (one step in flight)
                pending.append((len(ids), s.seq_id))
                ids.append(0)
            ids += s.draft_token_ids
            blocks += table[start // bs : (end - 1) // bs + 1]
        positions, slots = _positions_and_slots(starts, q_lens, blocks, bs)
        qsl = [0, *itertools.accumulate(q_lens)]
        sampled = [i for i, s in enumerate(scheduled) if s.sample]
        logits_indices = [qsl[i + 1] - 1 for i in sampled]
        draft_counts = [len(scheduled[i].draft_token_ids) for i in sampled]
        if any(draft_counts):  # a verify step: every position of a drafted row is scored
            logits_indices = [p for i in sampled for p in range(qsl[i + 1] - 1 - len(
                scheduled[i].draft_token_ids), qsl[i + 1])]  # fmt: skip
        else:
            draft_counts = []
        return cls(
            input_ids=np.array(ids, dtype=np.int64),
            positions=positions,
            slots=slots,
            query_lens=q_lens,
            seq_lens=[a + n for a, n in zip(starts, q_lens)],
            block_tables=tables,
            logits_indices=logits_indices,
            sampled=sampled,
            prefix_lens=[s.prefix_len for s in scheduled] if prefix_lens else None,
            pending=pending,
            draft_counts=draft_counts,
        )

    @classmethod
    def _build_decode(
        cls,
        sched: SchedulerOutput,
        states: list[SequenceState],
        block_size: int,
        prefix_lens: bool,
    ) -> HostStep:
        """`build` of a step in which each sequence computes one token, at position
        num_computed_tokens (its slot: that position in its block table)."""
        bs = block_size
        scheduled = sched.scheduled
        ids: list[int] = []
        starts: list[int] = []
        slots: list[int] = []
        sampled: list[int] = []
        pending: list[tuple[int, str]] = []
        for b, (s, state) in enumerate(zip(scheduled, states)):
            pos = s.num_computed_tokens
            starts.append(pos)
            k = pos - state.num_prompt_tokens
            if k < 0:
                ids.append(state.prompt_token_ids[pos])
            elif k < len(state.output_token_ids):
                ids.append(state.output_token_ids[k])
            else:  # sampled by the step in flight
                pending.append((b, s.seq_id))
                ids.append(0)
            slots.append(state.block_ids[pos // bs] * bs + pos % bs)
            if s.sample:
                sampled.append(b)
        return cls(
            input_ids=np.array(ids, dtype=np.int64),
            positions=np.array(starts, dtype=np.int64),
            slots=np.array(slots, dtype=np.int64),
            query_lens=[1] * len(starts),
            seq_lens=[pos + 1 for pos in starts],
            block_tables=[state.block_ids for state in states],
            logits_indices=list(sampled),  # token b is sequence b's
            sampled=sampled,
            prefix_lens=[s.prefix_len for s in scheduled] if prefix_lens else None,
            pending=pending,
        )

    @classmethod
    def padding(cls, batch: int, scratch_block: int, block_size: int) -> HostStep:
        """A decode step of `batch` dummy rows only (what CUDA graphs are captured with)."""
        empty = np.zeros(0, dtype=np.int64)
        step = cls(empty, empty, empty, [], [], [], [], [], None, [])
        return step.padded(batch, scratch_block, block_size)

    def padded(self, batch: int, scratch_block: int, block_size: int) -> HostStep:
        """This decode step padded with dummy rows up to `batch` (a CUDA-graph bucket): token 0
        at position 0, one KV token in the scratch block (never a real sequence's):

            rows |-- B real decode tokens --|-- batch - B dummies --|
        """
        num_pad = batch - len(self.seq_lens)
        pad = np.zeros(num_pad, dtype=np.int64)
        return HostStep(
            input_ids=np.concatenate((self.input_ids, pad)),
            positions=np.concatenate((self.positions, pad)),
            slots=np.concatenate((self.slots, pad + scratch_block * block_size)),
            query_lens=self.query_lens + [1] * num_pad,
            seq_lens=self.seq_lens + [1] * num_pad,
            block_tables=self.block_tables + [[scratch_block]] * num_pad,
            logits_indices=self.logits_indices,
            sampled=self.sampled,
            prefix_lens=None if self.prefix_lens is None else self.prefix_lens + [0] * num_pad,
            pending=self.pending,
        )

    @classmethod
    def dummy(
        cls, num_tokens: int, num_logits: int, block_size: int, vocab_size: int, seed: int = 0
    ) -> HostStep:
        """One prompt chunk of `num_tokens` random tokens over blocks 0.. (the memory profile's
        step: as large as any the scheduler can form) whose first `num_logits` tokens take
        logits (the step's widest sampling)."""
        table = list(range(-(-num_tokens // block_size)))
        rng = np.random.default_rng(seed)
        positions = np.arange(num_tokens, dtype=np.int64)
        return cls(
            input_ids=rng.integers(0, vocab_size, num_tokens, dtype=np.int64),
            positions=positions,
            slots=positions.copy(),  # blocks 0.. in order: slot == position
            query_lens=[num_tokens],
            seq_lens=[num_tokens],
            block_tables=[table],
            logits_indices=list(range(num_logits)),
            sampled=[0],
            prefix_lens=None,
            pending=[],
        )


def _positions_and_slots(
    starts: list[int], q_lens: list[int], blocks: list[int], block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """int64 [T] positions and KV slots of the packed tokens. Token t of sequence b sits at
    position start_b + (t - qsl_b); its block is entry position // bs - start_b // bs of b's
    run in `blocks` (the blocks its new tokens fall in, per sequence, concatenated)."""
    bs = block_size
    start_a = np.array(starts, dtype=np.int64)
    q_len_a = np.array(q_lens, dtype=np.int64)
    seq_of = np.repeat(np.arange(len(starts)), q_len_a)
    qsl = np.cumsum(q_len_a) - q_len_a
    positions = np.arange(int(q_len_a.sum()), dtype=np.int64) + np.repeat(start_a - qsl, q_len_a)
    first_block = start_a // bs
    run_len = (start_a + q_len_a - 1) // bs - first_block + 1
    run_off = np.cumsum(run_len) - run_len
    block_of = np.array(blocks, dtype=np.int64)[(run_off - first_block)[seq_of] + positions // bs]
    return positions, block_of * bs + positions % bs


def sampling_row(
    state: SequenceState,
    num_outputs_before: int,
    generator,
    eos_token_id: int | None,
    seed_stream: SeedStream | None = None,
) -> SamplingRow:
    """The sequence's sampling row for a step whose sample is output number
    `num_outputs_before` (0-based): EOS and the stop ids are banned below `min_tokens`, except
    in a structured-output row (its grammar alone decides where it may end). The row
    reads the state's output list in place (penalties see every token sampled so far);
    `generator` and `seed_stream` are the seeded sequence's (`SamplingRow`), held by the row.
    Cached on the state when nothing in it depends on the step."""
    if state.row is not None:
        return state.row
    params = state.params
    banned: list[int] = []
    if num_outputs_before < params.min_tokens and params.structured_outputs is None:
        banned = list(params.stop_token_ids)
        if eos_token_id is not None:
            banned.append(eos_token_id)
    row = SamplingRow(
        params=params,
        prompt_token_ids=state.prompt_token_ids,
        output_token_ids=state.output_token_ids,
        generator=generator,
        banned_token_ids=banned,
        seed_stream=seed_stream,
    )
    if params.min_tokens == 0:
        state.row = row
    return row


def append_verified(
    states: list[SequenceState],
    drafts: list[tuple[int, ...]],
    num_accepted: list[int],
    token_ids: list[int],
    block_size: int,
) -> None:
    """Apply a verify step to its sampled rows' states: each gets its accepted drafts, then its
    token, and a row that rejected drafts drops the blocks past its last computed token (the
    scheduler's `KVManager.trim` rule: cdiv(num_computed_tokens, block_size) kept, the last
    known token having no KV yet), with them those of a row launched on top of it (void,
    `worker/stacked_rows.py`); a row that accepted all keeps its table (a row on top of it
    may need the blocks past it)."""
    for state, row_drafts, num, token_id in zip(states, drafts, num_accepted, token_ids):
        state.output_token_ids.extend(row_drafts[:num])
        state.output_token_ids.append(token_id)
        if num < len(row_drafts):
            del state.block_ids[-(-(state.num_known_tokens - 1) // block_size) :]
