"""A verify step's sampling on the device: the target's distribution at every scored position
(exactly the sampler's, `phloem.layers.sampler.processed_probs`), exact verification of each
row's drafts (`rejection_sample`), and the copy of what it emitted to the host.

The logits of a verify step come packed, row b's 1 + k_b scored positions in a run (k_b = 0 for
a row without drafts: its one sampled position):

    logits rows: |-- b=0: last, d_1..d_k0 --|-- b=1: last --|-- b=2: last, d_1..d_k2 --| ...

and are gathered into the rejection sampler's [S, k + 1, V] (k = the widest row; a short row
repeats its last position, which the sampler never reads). Rows reaching here carry no bans,
penalties or log-probs (the engine drafts only for rows without them), so the processed
distribution at every position is the same function of that position's logits. A row without
drafts draws what the sampler would (one length-V exponential vector from its generator).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from phloem.layers.sampler import (
    GREEDY_TEMPERATURE,
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
        num_accepted: [S] host ints, drafts accepted per row; set by `result()`.
    """

    def __init__(
        self, tokens: torch.Tensor, num_accepted: torch.Tensor, flags: torch.Tensor, num_rows: int
    ) -> None:
        self.tokens = tokens
        self.num_accepted: list[int] = []
        self._num_rows = num_rows
        self._host = to_host(torch.stack((tokens, num_accepted, flags)))
        self._event = None
        if tokens.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SamplerOutput:
        """The rows' last tokens and non-finite flags (waits for this step's copy only)."""
        if self._event is not None:
            self._event.synchronize()
        token_ids, self.num_accepted, flags = self._host.tolist()
        none = [None] * self._num_rows
        return SamplerOutput(token_ids, none, list(none), flags)


def verify_drafts(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[Sequence[int]],
    fallback_generator: torch.Generator | None,
) -> VerifiedTokens:
    """Verify each row's drafts against the target and emit its accepted run plus one token.

    Args:
        logits: [N, V] (the model's dtype), N = sum(1 + len(drafts[b])), packed as in the module
            docstring; not modified.
        rows: [S] the rows' sampling rows (no bans, penalties or log-probs); a row's generator
            (or `fallback_generator`) supplies its randomness.
        drafts: [S] each row's draft ids (empty: none).

    Returns `VerifiedTokens` (nothing waits for the device). A row whose logits hold a NaN or
    +inf at any scored position is flagged (its tokens are placeholders). Raises ValueError when
    N does not match the drafts. Leviathan et al. 2023 §2.3; Chen et al. 2023 Alg. 2.
    """
    counts = [len(d) for d in drafts]
    num_rows, width = len(rows), max(counts, default=0)
    if logits.shape[0] != num_rows + sum(counts):
        raise ValueError(
            f"logits must have sum(1 + k_b) = {num_rows + sum(counts)} rows, got {logits.shape[0]}"
        )
    device = logits.device
    starts = [0, *itertools.accumulate(1 + k for k in counts)]
    flags = non_finite(logits.amax(dim=-1))  # [N]
    x = logits.float().masked_fill((flags != 0)[:, None], 0.0)
    greedy = [r.params.temperature < GREEDY_TEMPERATURE for r in rows]
    random_positions = [
        p for b in range(num_rows) if not greedy[b] for p in range(starts[b], starts[b + 1])
    ]
    if random_positions:
        params = [
            rows[b].params for b in range(num_rows) if not greedy[b] for _ in range(1 + counts[b])
        ]
        index = to_device(torch.tensor(random_positions, dtype=torch.long), device)
        x[index] = processed_probs(x[index], params)
    gather = [[starts[b] + min(j, counts[b]) for j in range(width + 1)] for b in range(num_rows)]
    gather_t = to_device(torch.tensor(gather, dtype=torch.long), device)  # [S, k + 1]
    padded = [list(d) + [PAD_TOKEN_ID] * (width - len(d)) for d in drafts]
    draft_t = to_device(torch.tensor(padded, dtype=torch.long).view(num_rows, width), device)
    out = rejection_sample(
        x[gather_t],
        draft_t,
        counts,
        is_greedy=greedy,
        generators=[r.generator for r in rows],
        fallback_generator=fallback_generator,
    )
    final = out.token_ids.gather(1, out.num_accepted[:, None]).squeeze(1)
    row_flags = flags[gather_t].amax(dim=1)
    return VerifiedTokens(final, out.num_accepted, row_flags, num_rows)
