"""Rows scheduled on top of the step in flight (async scheduling with speculative decoding,
`core/draft_tokens.py`): which of them are void and which verify rows' guesses held, decided on
the device from the step in flight's tensors, and the update of the sequence states that drops
the void rows.

The last launched step (N) leaves, per sampled row, its last token and whether the row emitted
all its 1 + k tokens (`full`: every draft accepted, or none to verify). A row of step N+1 whose
input token is pending (N's token for it) sits after N's drafts, as if all were accepted:

    step N:    |-- last | d_1 .. d_k --|            full: a == k (or k == 0)
    step N+1:                         |-- N's token | e_1 .. e_j --|   void unless N's row full

A verify row of N+1 with a `pending_guess` g (its drafts proposed before N's token was known)
accepts its drafts only where N's token equals g; else it verifies nothing, as if its first
draft were rejected, and still samples its next token from the target's distribution there
(`rejection_sample(valid=...)`), so greedy outputs and the sampled distribution are unchanged.
Its drafts were never verified: the engine's acceptance counts leave them out (`verify_counts`),
as they leave out a void row's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from phloem.core.scheduler_output import SchedulerOutput
from phloem.ops.staging import to_device, to_host
from phloem.worker.input_batch import HostStep, SequenceState, append_verified


@dataclass
class PreviousStep:
    """The last launched step's sampled rows, as the next step's inputs read them.

    Attributes:
        tokens: int64 [S] on the device: each sampled row's last token.
        rows: seq id -> its row in `tokens`.
        full: bool [S] on the device: the row emitted all its tokens (no draft rejected, no
            void row); None: every row did (a step without drafts on top of full rows).
    """

    tokens: torch.Tensor
    rows: dict[str, int]
    full: torch.Tensor | None = None


@dataclass
class StackChecks:
    """A step's checks of its rows against the step before (module docstring).

    Attributes:
        void: bool [S] on the device: the sampled row sits on a row that did not emit all its
            tokens (its token is dropped); None: no row does.
        void_host: `void`'s copy to the host (read once the step's tokens are in).
        valid: bool [S] on the device: a guess row's guess held (True for rows without one);
            None: the step has no guess rows.
    """

    void: torch.Tensor | None = None
    void_host: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    def full(self, full: torch.Tensor | None) -> torch.Tensor | None:
        """This step's `PreviousStep.full` from its rows' own (None: all full): void rows are
        not full."""
        if self.void is None:
            return full
        return ~self.void if full is None else full & ~self.void


def stack_checks(
    host: HostStep,
    sched: SchedulerOutput,
    states: list[SequenceState],
    prev: PreviousStep | None,
    device: torch.device,
) -> StackChecks:
    """The void rows and the guesses' outcomes of a step (module docstring); enqueued on the
    device, nothing waits. A guess row whose input token is known on the host (its step was
    collected before this one launched) is checked on the host. O(1) and no tensors when
    nothing is stacked on drafts and no row guesses (a step without drafts after one
    without). The host's indexes and guesses go to the device in one copy, sliced there:

        staged: |-- void rows, their rows in prev --|-- held [S] --|-- guess rows, rows in
        prev, guesses --|"""
    checks = StackChecks()
    scheduled, sampled = sched.scheduled, host.sampled
    on_drafts = prev is not None and prev.full is not None and bool(host.pending)
    guessed = bool(host.draft_counts) and any(scheduled[i].pending_guess >= 0 for i in sampled)
    if not (on_drafts or guessed):  # (the common step: O(1) here)
        return checks
    pending = {seq_id for _, seq_id in host.pending}
    void_rows: list[int] = []  # rows on a row of prev, and that row's index in prev
    void_src: list[int] = []
    if on_drafts:
        assert prev is not None
        void_rows = [b for b, i in enumerate(sampled) if scheduled[i].seq_id in pending]
        void_src = [prev.rows[scheduled[sampled[b]].seq_id] for b in void_rows]
    held, dev_rows, dev_src, guesses = (
        _guess_rows(sched, sampled, states, pending, prev) if guessed else ([], [], [], [])
    )
    parts = (void_rows, void_src, held, dev_rows, dev_src, guesses)
    if not any(parts):
        return checks
    staged = to_device(np.array([x for part in parts for x in part], dtype=np.int64), device)
    ends = list(itertools.accumulate(len(part) for part in parts))
    if void_rows:
        assert prev is not None and prev.full is not None
        checks.void = torch.zeros(len(sampled), dtype=torch.bool, device=device)
        checks.void[staged[: ends[0]]] = ~prev.full[staged[ends[0] : ends[1]]]
        checks.void_host = to_host(checks.void)
    if guessed:
        valid = staged[ends[1] : ends[2]].bool()
        if dev_rows:
            assert prev is not None
            rows_t, src_t = staged[ends[2] : ends[3]], staged[ends[3] : ends[4]]
            valid[rows_t] = prev.tokens[src_t] == staged[ends[4] :]
        checks.valid = valid
    return checks


def _guess_rows(
    sched: SchedulerOutput,
    sampled: list[int],
    states: list[SequenceState],
    pending: set[str],
    prev: PreviousStep | None,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """`stack_checks`' guesses: (held [S]: 1 where a row has no guess or its guess checked on the
    host holds, else 0; the rows whose guess is checked on the device, their rows in prev, their
    guesses)."""
    scheduled = sched.scheduled
    held = [1] * len(sampled)
    dev_rows: list[int] = []
    dev_src: list[int] = []
    guesses: list[int] = []
    for b, i in enumerate(sampled):
        s = scheduled[i]
        if s.pending_guess < 0:
            continue
        if s.seq_id in pending:
            assert prev is not None  # (the input's fill needs it too)
            dev_rows.append(b)
            dev_src.append(prev.rows[s.seq_id])
            guesses.append(s.pending_guess)
        else:
            start = s.num_computed_tokens
            held[b] = int(states[i].token_ids(start, start + 1) == [s.pending_guess])
    return held, dev_rows, dev_src, guesses


def append_tokens(
    states: list[SequenceState],
    seq_ids: list[str],
    token_ids: list[int],
    drafts: list[tuple[int, ...]] | None,
    num_accepted: list[int],
    void_host: torch.Tensor | None,
    block_size: int,
) -> tuple[list[str], list[int]]:
    """Append a collected step's tokens to its sampled rows' states (`drafts` None: one token
    each; else `append_verified`); a void row gets nothing (its blocks were cut when the row
    below it was collected, `append_verified`: the engine collects steps in order, never the
    step in flight before launching one stacked on it). Returns (seq ids, tokens) of the
    rows that are not void, with a verify step's accepted counts left in `num_accepted`."""
    keep = list(range(len(seq_ids)))
    if void_host is not None:  # (their blocks went when the row below was collected)
        void = void_host.tolist()
        keep = [b for b in keep if not void[b]]
    if drafts is not None:
        append_verified(
            [states[b] for b in keep],
            [drafts[b] for b in keep],
            [num_accepted[b] for b in keep],
            [token_ids[b] for b in keep],
            block_size,
        )
    else:
        for b in keep:
            states[b].output_token_ids.append(token_ids[b])
    return [seq_ids[b] for b in keep], [token_ids[b] for b in keep]


def verify_counts(
    seq_ids: list[str],
    drafts: list[tuple[int, ...]],
    num_accepted: list[int],
    verified: list[bool],
    kept: list[str],
) -> tuple[dict[str, int], list[str]]:
    """A collected verify step's counts for the engine (`ModelRunnerOutput`): (drafts accepted
    per kept row whose drafts were verified, the kept rows with drafts whose guess of their
    pending token failed). A guess row that failed verified nothing: its 0 accepted is no
    trial of its drafts, so it is listed apart, not counted (only the worker knows which rows
    failed: the flag came back with the step's tokens, `VerifiedTokens.verified`). Void rows
    (not in `kept`) are in neither. Rows are in `seq_ids`' order; all lists [S]."""
    keep = set(kept) if len(kept) < len(seq_ids) else None
    accepted: dict[str, int] = {}
    missed: list[str] = []
    for seq_id, d, n, ok in zip(seq_ids, drafts, num_accepted, verified):
        if d and (keep is None or seq_id in keep):
            if ok:
                accepted[seq_id] = n
            else:
                missed.append(seq_id)
    return accepted, missed
