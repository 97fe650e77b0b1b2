"""A verify step's sampling on the device: the target's distribution at every scored position
(exactly the sampler's, `phloem.layers.sampler.processed_probs`), exact verification of each
row's drafts (`rejection_sample`), and the copy of what it emitted to the host.

The logits of a verify step come packed, row b's 1 + k_b scored positions in a run (k_b = 0 for
a row without drafts: its one sampled position):

    logits rows: |-- b=0: last, d_1..d_k0 --|-- b=1: last --|-- b=2: last, d_1..d_k2 --| ...

and the drafted rows' positions are gathered into the rejection sampler's [R, k + 1, V] (k = the
widest row; a short row repeats its last position, which the sampler never reads). Drafted rows
carry no bans, penalties or log-probs (the engine drafts only for rows without them), so the
processed distribution at every position is the same function of that position's logits. The
rows without drafts go through the sampler itself (`VerifyStep` merges both halves), so they
draw exactly what they would in a step without drafts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from phloem.layers.sampler import (
    GREEDY_TEMPERATURE,
    SampledTokens,
    SamplerOutput,
    SamplingRow,
    non_finite,
    processed_probs,
)
from phloem.ops.staging import to_device, to_host
from phloem.spec_decode.rejection_sampler import PAD_TOKEN_ID, rejection_sample


class VerifiedTokens:
    """A verify step's emitted tokens on their way to the host (`SampledTokens`' counterpart).

    Attributes:
        tokens: int64 [S] on the device: each row's last emitted token (residual or bonus).
        full: bool [S] on the device: the row accepted all its drafts.
        num_accepted: [S] host ints, drafts accepted per row; set by `result()`.
        verified: [S] host ints, 1 where the row's drafts were verified, 0 where they followed
            a guess of the pending token that failed (`valid`: they verified nothing, and its
            0 accepted is no trial); set by `result()`. It rides in the tokens' copy.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        num_accepted: torch.Tensor,
        flags: torch.Tensor,
        num_rows: int,
        full: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> None:
        self.tokens, self.full = tokens, full
        self.num_accepted: list[int] = []
        self.verified: list[int] = []
        self._num_rows = num_rows
        parts = (tokens, num_accepted, flags)  # (+ `valid`: without it every row verified)
        self._host = to_host(torch.stack(parts if valid is None else (*parts, valid.long())))
        self._event = None
        if tokens.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SamplerOutput:
        """The rows' last tokens and non-finite flags (waits for this step's copy only)."""
        if self._event is not None:
            self._event.synchronize()
        token_ids, self.num_accepted, flags, *verified = self._host.tolist()
        self.verified = verified[0] if verified else [1] * self._num_rows
        num_rows = self._num_rows
        return SamplerOutput(token_ids, [None] * num_rows, [None] * num_rows, flags)


def split_verify_rows(drafts: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[int]]:
    """(each row's first packed logits position [S + 1], the last one's end appended; drafted
    rows; rows without drafts) of a verify step whose row b has 1 + len(drafts[b]) packed
    positions (module docstring). Per row, not per draft: a drafted row's positions are
    `starts[b]:starts[b + 1]`, listed only where a path needs them (`launch_verify`'s
    non-greedy one)."""
    starts = [0, *itertools.accumulate(1 + len(d) for d in drafts)]
    drafted = [b for b, d in enumerate(drafts) if d]
    plain = [b for b, d in enumerate(drafts) if not d]
    return starts, drafted, plain


def verify_drafts(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[Sequence[int]],
    fallback_generator: torch.Generator | None,
    valid: torch.Tensor | None = None,
) -> VerifiedTokens:
    """Verify each row's drafts against the target and emit its accepted run plus one token.

    Args:
        logits: [N, V] (the model's dtype), N = sum(1 + len(drafts[b])), packed as in the module
            docstring; not modified.
        rows: [S] the rows' sampling rows (no bans, penalties or log-probs); a row's generator
            (or `fallback_generator`) supplies its randomness.
        drafts: [S] each row's draft ids (empty: none).
        valid: bool [S] on the device: rows whose drafts count (a guess row whose guess failed
            verifies nothing, `rejection_sample(valid=...)`); None: all.

    Returns `VerifiedTokens` (nothing waits for the device). A row whose logits hold a NaN or
    +inf at any scored position is flagged (its tokens are placeholders). Raises ValueError when
    N does not match the drafts. Leviathan et al. 2023 §2.3; Chen et al. 2023 Alg. 2.
    """
    counts = [len(d) for d in drafts]
    num_rows = len(rows)
    if logits.shape[0] != num_rows + sum(counts):
        raise ValueError(
            f"logits must have sum(1 + k_b) = {num_rows + sum(counts)} rows, got {logits.shape[0]}"
        )
    starts = [0, *itertools.accumulate(1 + k for k in counts)]
    staged = _stage_rows(drafts, counts, starts, logits.device)
    if all(r.params.temperature < GREEDY_TEMPERATURE for r in rows):
        return _verify_greedy(logits, staged, valid)
    flags = non_finite(logits.amax(dim=-1))  # [N]
    gather_t, draft_t, num_drafts = staged
    greedy = [r.params.temperature < GREEDY_TEMPERATURE for r in rows]
    x = _target_distributions(logits, flags, rows, greedy, counts, starts)
    out = rejection_sample(
        x[gather_t],
        draft_t,
        counts,
        is_greedy=greedy,
        generators=[r.generator for r in rows],
        fallback_generator=fallback_generator,
        valid=valid,
    )
    final = out.token_ids.gather(1, out.num_accepted[:, None]).squeeze(1)
    row_flags = flags[gather_t].amax(dim=1)
    full = out.num_accepted == num_drafts
    return VerifiedTokens(final, out.num_accepted, row_flags, num_rows, full, valid)


def _stage_rows(
    drafts: Sequence[Sequence[int]], counts: list[int], starts: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' host facts on the device in one copy: int64 [S, k + 1] each row's scored
    positions in the packed logits (a short row repeats its last one), int64 [S, k] its
    drafts padded with `PAD_TOKEN_ID`, int64 [S] its draft counts. Built with numpy over the
    [S, 2k + 2] table (one Python pass over the drafts to flatten them), not per draft:

        row b: |-- starts_b + min(j, k_b), j <= k --|-- drafts, PAD --|-- k_b --|"""
    num_rows, width = len(counts), max(counts, default=0)
    counts_a = np.array(counts, dtype=np.int64).reshape(num_rows)
    host = np.empty((num_rows, 2 * width + 2), dtype=np.int64)
    cols = np.arange(width + 1, dtype=np.int64)
    np.minimum(cols[None, :], counts_a[:, None], out=host[:, : width + 1])
    host[:, : width + 1] += np.array(starts[:num_rows], dtype=np.int64).reshape(num_rows, 1)
    draft_part = np.full((num_rows, width), PAD_TOKEN_ID, dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(drafts), dtype=np.int64, count=sum(counts))
    draft_part[cols[None, :width] < counts_a[:, None]] = flat  # (row-major: each row's in order)
    host[:, width + 1 : -1] = draft_part
    host[:, -1] = counts_a
    staged = to_device(host, device)
    return staged[:, : width + 1], staged[:, width + 1 : -1], staged[:, -1]


def _target_distributions(
    logits: torch.Tensor,
    flags: torch.Tensor,
    rows: Sequence[SamplingRow],
    greedy: list[bool],
    counts: list[int],
    starts: list[int],
) -> torch.Tensor:
    """float32 [N, V]: the processed distribution at every scored position of the random rows
    (`processed_probs`), the logits at the greedy rows' (only their argmax is read), zeros at
    non-finite positions (`flags`)."""
    x = logits.float().masked_fill((flags != 0)[:, None], 0.0)
    random_rows = [b for b in range(len(rows)) if not greedy[b]]
    positions = [p for b in random_rows for p in range(starts[b], starts[b + 1])]
    if positions:
        params = [rows[b].params for b in random_rows for _ in range(1 + counts[b])]
        index = to_device(torch.tensor(positions, dtype=torch.long), logits.device)
        x[index] = processed_probs(x[index], params)
    return x


def _verify_greedy(
    logits: torch.Tensor,
    staged: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    valid: torch.Tensor | None,
) -> VerifiedTokens:
    """`verify_drafts` where every row is greedy: only each position's argmax is read, so
    neither the float32 copy of the logits nor their [S, k + 1, V] gather is made (the general
    path's ~40 kernels become ~12 on [N] and [S, k + 1] tensors; a verify step's launch is host
    time on a small model, results/2026-11-27b-h200). `staged` (`_stage_rows`) may index
    positions of a larger `logits` [N', V] (`launch_verify`: the step's every sampled position,
    so the drafted ones are not copied out first). Same tokens and counts as the general path:
    argmax of the logits is argmax of their float32 copy (exact conversion; `max` returns the
    first maximal index, as `argmax` does), and a non-finite position (zeroed there) argmaxes
    to 0. One pass over the vocabulary gives the maximum (the non-finite flags) and its index;
    a padding draft (`PAD_TOKEN_ID` < 0) never equals an index, so no mask of each row's
    draft count is needed."""
    gather_t, draft_t, num_drafts = staged
    num_rows, width = draft_t.shape
    # (on the CPU a float32 copy first: its reductions over bf16 are ~2x slower than the copy)
    source = logits if logits.is_cuda or logits.dtype == torch.float32 else logits.float()
    values, ids = source.max(dim=-1)  # [N']
    flags = non_finite(values)
    ids.masked_fill_(flags != 0, 0)
    target = ids[gather_t]  # [S, k + 1]
    accept = target[:, :width] == draft_t  # (PAD_TOKEN_ID past a row's drafts: never equal)
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)
    if valid is not None:
        num_accepted = torch.where(valid, num_accepted, 0)
    final = target.gather(1, num_accepted[:, None]).squeeze(1)
    row_flags = flags[gather_t].amax(dim=1)
    return VerifiedTokens(
        final, num_accepted, row_flags, num_rows, num_accepted == num_drafts, valid
    )


class VerifyStep:
    """All sampled rows of a verify step: the drafted rows' `VerifiedTokens` and the other rows'
    `SampledTokens` (from the sampler), merged back into row order.

    Attributes:
        tokens: int64 [S] on the device: each row's last token (feeds the next step's inputs).
        full: bool [S] on the device: the row accepted all its drafts (rows without: True).
        num_accepted: [S] host ints, drafts accepted per row (0 for rows without drafts); set by
            `result()`.
        verified: [S] host bools: the row's drafts were verified (False for a row whose guess
            of its pending token failed, `VerifiedTokens.verified`, and rows without drafts);
            set by `result()`.
    """

    def __init__(
        self,
        verified: VerifiedTokens,
        drafted: list[int],
        sampled: SampledTokens | None,
        plain: list[int],
        rows_on_device: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """`rows_on_device`: `drafted` and `plain` as int64 tensors on the device (staged by
        `launch_verify` with its other indexes: one host-to-device copy a step)."""
        self._parts = [(verified, drafted), (sampled, plain)]
        self.num_accepted: list[int] = []
        self.verified: list[bool] = []
        self.tokens, self.full = verified.tokens, verified.full
        if sampled is not None:
            device = verified.tokens.device
            drafted_t, plain_t = rows_on_device
            self.tokens = torch.empty(len(drafted) + len(plain), dtype=torch.long, device=device)
            self.full = torch.ones(len(drafted) + len(plain), dtype=torch.bool, device=device)
            self.tokens.index_copy_(0, drafted_t, verified.tokens)
            self.tokens.index_copy_(0, plain_t, sampled.tokens)
            self.full.index_copy_(0, drafted_t, verified.full)

    def result(self) -> SamplerOutput:
        """The merged rows (waits for this step's copies only)."""
        num_rows = len(self._parts[0][1]) + len(self._parts[1][1])
        out = SamplerOutput([0] * num_rows, [None] * num_rows, [None] * num_rows, [0] * num_rows)
        self.num_accepted, self.verified = [0] * num_rows, [False] * num_rows
        for part, rows in self._parts:
            if part is None:
                continue
            got = part.result()
            for j, b in enumerate(rows):
                out.token_ids[b], out.logprobs[b] = got.token_ids[j], got.logprobs[j]
                out.top_logprobs[b], out.num_nonfinite[b] = (
                    got.top_logprobs[j],
                    got.num_nonfinite[j],
                )
        verified, drafted = self._parts[0]
        for j, b in enumerate(drafted):
            self.num_accepted[b] = verified.num_accepted[j]  # type: ignore[union-attr]
            self.verified[b] = bool(verified.verified[j])  # type: ignore[union-attr]
        return out


def launch_verify(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[Sequence[int]],
    fallback_generator: torch.Generator | None,
    sample_plain: Callable[[torch.Tensor, list[int]], SampledTokens],
    valid: torch.Tensor | None = None,
) -> VerifyStep:
    """Enqueue a verify step's sampling: drafted rows through `verify_drafts` (their 1 + k_b
    packed positions of `logits` [N, V], module docstring), the others through
    `sample_plain(their logits [P, V], their row indices)` (their one position each: the
    caller's sampler); `valid`: bool [S] on the device, the rows whose drafts count (None:
    all). Nothing waits for the device."""
    starts, drafted, plain = split_verify_rows(drafts)
    plain_positions = [starts[b] for b in plain]
    # all greedy: the argmaxes are read in place (`_verify_greedy`), no copy of the drafted rows
    greedy = all(rows[b].params.temperature < GREEDY_TEMPERATURE for b in drafted)
    gathered = [] if greedy else [p for b in drafted for p in range(starts[b], starts[b + 1])]
    # every index of the step in one host-to-device copy, sliced on the device
    host = np.array(gathered + drafted + plain_positions + plain, dtype=np.int64)
    staged = to_device(host, logits.device)
    ends = list(itertools.accumulate((len(gathered), len(drafted), len(plain_positions))))
    index, drafted_t = staged[: ends[0]], staged[ends[0] : ends[1]]
    plain_index, plain_t = staged[ends[1] : ends[2]], staged[ends[2] :]
    if valid is not None:
        valid = valid[drafted_t]
    drafted_drafts = [drafts[b] for b in drafted]
    if greedy:
        counts = [len(d) for d in drafted_drafts]
        rows_staged = _stage_rows(drafted_drafts, counts, [starts[b] for b in drafted],
                                  logits.device)  # fmt: skip
        verified = _verify_greedy(logits, rows_staged, valid)
    else:
        verified = verify_drafts(
            logits[index], [rows[b] for b in drafted], drafted_drafts, fallback_generator, valid
        )
    sampled = sample_plain(logits[plain_index], plain) if plain else None
    return VerifyStep(verified, drafted, sampled, plain, (drafted_t, plain_t))
