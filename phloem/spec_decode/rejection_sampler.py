"""Exact verification of draft tokens: modified rejection sampling, batched on the device.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, §2.3; Chen et al. 2023, arXiv
2302.01318, Alg. 2). A proposer drafts `x_1..x_n` from distributions `q_1..q_n`; one target pass
scores n + 1 positions, giving `p_0..p_n` (p_j conditioned on the prompt, the outputs and the drafts
before position j). For j = 0, 1, ...: draw u ~ U[0, 1); accept draft j while `u * q_j(x) < p_j(x)`
(probability min(1, p/q)); at the first rejection emit one token from the residual
`norm(max(0, p_j - q_j))` and stop; when all n are accepted emit a bonus token from p_n. Every
emitted token is then distributed exactly as the target's sample at that position.

Per row b (drafts padded to the batch's widest row, k):

    position:   0      1     ...   a-1  |   a    |  a+1 ... k
    tokens:   |-- accepted drafts -----|-final-|-- -1 padding --|
    final:  residual of p_a, q_a (a < n_b)  or  bonus from p_{n_b} (a == n_b)

The probabilities are the sampler's *processed* distributions (after penalties, temperature,
min-p, top-k, top-p), so every sampling setting is honoured as the sampler honours it; q is the
proposer's distribution, or one-hot on the drafted ids for deterministic proposers (n-gram, suffix),
where the rule reduces to "accept with probability p(x)" and the residual is p with x removed.

Greedy rows (temperature 0): accept while the draft equals argmax p_j, then emit argmax p_a. Only
argmax is read on those rows, so the caller may pass the logits there instead of probabilities.

Randomness and reproducibility: a row with its own `torch.Generator` draws exactly n_b uniforms,
then one length-V `exponential_` vector (the exponential race: argmax(r / E) with E ~ Exp(1) is a
draw from r, as in `phloem.layers.sampler`), so its tokens depend on its seed and history only,
never on the batch. Rows without one share one batched draw from the fallback generator. Greedy
rows draw nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phloem.ops.staging import to_device

PAD_TOKEN_ID = -1  # the token id of positions past a row's emitted tokens


@dataclass
class RejectionOutput:
    """What verification emitted, one row per sequence.

    Fields:
        token_ids: int64 [B, k + 1]: the accepted drafts, then the final (residual or bonus)
            token, then `PAD_TOKEN_ID`; row b holds `num_accepted[b] + 1` tokens.
        num_accepted: int64 [B]: drafts accepted (0..n_b); the step emits one token more.
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor


def _check_shapes(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    is_greedy: Sequence[bool],
) -> None:
    """Raise ValueError naming the first argument whose shape or range is wrong."""
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, k + 1, V], got {tuple(target_probs.shape)}")
    batch, width, vocab = target_probs.shape
    if tuple(draft_token_ids.shape) != (batch, width - 1):
        raise ValueError(
            f"draft_token_ids must be [B, k] = [{batch}, {width - 1}], "
            f"got {tuple(draft_token_ids.shape)}"
        )
    if len(num_draft_tokens) != batch:
        raise ValueError(
            f"num_draft_tokens must have B = {batch} entries, got {len(num_draft_tokens)}"
        )
    if any(not 0 <= n <= width - 1 for n in num_draft_tokens):
        raise ValueError(
            f"num_draft_tokens must lie in [0, k = {width - 1}], got {num_draft_tokens}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, width - 1, vocab):
        raise ValueError(
            f"draft_probs must be [B, k, V] = [{batch}, {width - 1}, {vocab}], "
            f"got {tuple(draft_probs.shape)}"
        )
    if len(is_greedy) != batch:
        raise ValueError(f"is_greedy must have B = {batch} entries, got {len(is_greedy)}")


def _row_draws(
    num_draft_tokens: Sequence[int],
    vocab_size: int,
    generators: Sequence[torch.Generator | None],
    fallback: torch.Generator | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms float32 [B, k] (zero past a row's drafts) and Exp(1) noise float32 [B, V].

    A row with a generator draws `num_draft_tokens[b]` uniforms then V exponentials from it;
    the others share one [n, k] and one [n, V] draw from `fallback` (None: torch's default).
    """
    batch, width = len(num_draft_tokens), max(num_draft_tokens, default=0)
    uniforms = torch.zeros(batch, width, device=device)
    noise = torch.empty(batch, vocab_size, device=device)
    shared = [b for b, g in enumerate(generators) if g is None]
    if shared:
        idx = to_device(torch.tensor(shared, dtype=torch.long), device)
        uniforms[idx] = torch.rand(len(shared), width, device=device, generator=fallback)
        noise[idx] = torch.empty(len(shared), vocab_size, device=device).exponential_(
            generator=fallback
        )
    for b, gen in enumerate(generators):
        if gen is not None:
            n = num_draft_tokens[b]
            uniforms[b, :n] = torch.rand(n, device=device, generator=gen)
            noise[b] = torch.empty(vocab_size, device=device).exponential_(generator=gen)
    return uniforms, noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _accepted_counts(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_drafts: torch.Tensor,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """int64 [B]: the length of each row's accepted run of drafts (0..n_b)."""
    width = draft_token_ids.shape[1]
    p_k = target_probs[:, :width]  # [B, k, V]
    index = draft_token_ids.clamp_min(0)[..., None]  # padding may hold -1
    p_draft = p_k.gather(-1, index).squeeze(-1)  # [B, k]
    if draft_probs is None:
        accept = uniforms < p_draft  # q one-hot: accept with probability p(x)
    else:
        accept = uniforms * draft_probs.gather(-1, index).squeeze(-1) < p_draft
    greedy_accept = draft_token_ids == p_k.argmax(dim=-1)
    accept = torch.where(is_greedy[:, None], greedy_accept, accept)
    position = torch.arange(width, device=accept.device)
    accept &= position[None, :] < num_drafts[:, None]
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def _final_distribution(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_drafts: torch.Tensor,
    num_accepted: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [B, V]: norm(max(0, p_a - q_a)) where a draft was rejected, p_n as the bonus,
    p_0 on rows whose drafts are not `valid` (verified nothing: a plain sample).

    A residual whose mass underflows to 0 (p == q up to rounding: a rejection there has
    probability ~0) falls back to p_a, so no row divides by zero.
    """
    rows = torch.arange(target_probs.shape[0], device=target_probs.device)
    p_final = target_probs[rows, num_accepted]  # [B, V]
    width = draft_token_ids.shape[1]
    if width == 0:
        return p_final
    rejected = num_accepted < num_drafts
    rejected = (rejected if valid is None else rejected & valid)[:, None]
    at = num_accepted.clamp_max(width - 1)
    if draft_probs is None:
        drafted = draft_token_ids[rows, at].clamp_min(0)
        q_final = torch.zeros_like(p_final).scatter_(1, drafted[:, None], 1.0)
    else:
        q_final = draft_probs[rows, at]
    residual = (p_final - torch.where(rejected, q_final, 0.0)).clamp_min_(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p_final)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    *,
    draft_probs: torch.Tensor | None = None,
    is_greedy: Sequence[bool] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    fallback_generator: torch.Generator | None = None,
    valid: torch.Tensor | None = None,
) -> RejectionOutput:
    """Verify each row's drafts against the target and emit the accepted run plus one token.

    Args:
        target_probs: float32 [B, k + 1, V]: the target's processed next-token distributions at
            the n_b + 1 scored positions of row b (rows past n_b + 1 are ignored). Greedy rows:
            only argmax is read (logits are fine).
        draft_token_ids: int64 [B, k]: the drafts; entries past `num_draft_tokens[b]` are
            padding (any value, e.g. -1).
        num_draft_tokens: [B] host ints in [0, k]: drafts per row (ragged).
        draft_probs: float32 [B, k, V]: the proposer's distributions q_j, each row summing to 1;
            None for deterministic proposers (q one-hot on the drafted id).
        is_greedy: [B] host bools (temperature 0 rows); None: no greedy rows.
        generators: [B] per-row seeded generators on the device, None entries use
            `fallback_generator`; None: every row uses it.
        fallback_generator: the generator of unseeded rows (None: torch's default).
        valid: bool [B] on the device: rows whose drafts count (None: all). A row that is not
            accepts none and emits a sample of p_0, exactly what a step without drafts would
            (its drafts followed a guess of its last token that failed,
            `worker/stacked_rows.py`); its draws are made all the same, so seeded rows stay
            reproducible.

    Returns `RejectionOutput` (on the device; nothing waits for it: host inputs are staged
    through pinned memory). Mutates nothing but the generators' states. Raises ValueError when
    a shape or count does not match. Leviathan et al. 2023 §2.3 (Algorithm 1); Chen et al. 2023
    Alg. 2.
    """
    batch, _, vocab_size = target_probs.shape if target_probs.dim() == 3 else (0, 0, 0)
    greedy_host = [False] * batch if is_greedy is None else list(is_greedy)
    gens = [None] * batch if generators is None else list(generators)
    _check_shapes(target_probs, draft_token_ids, num_draft_tokens, draft_probs, greedy_host)
    if len(gens) != batch:
        raise ValueError(f"generators must have B = {batch} entries, got {len(gens)}")
    device = target_probs.device
    greedy = to_device(torch.tensor(greedy_host, dtype=torch.bool), device)
    uniforms, noise = _random_draws(
        num_draft_tokens, greedy_host, draft_token_ids.shape[1], vocab_size, gens,
        fallback_generator, device,
    )  # fmt: skip
    num_drafts = to_device(torch.tensor(list(num_draft_tokens), dtype=torch.long), device)
    args = (target_probs, draft_token_ids, draft_probs, num_drafts)
    num_accepted = _accepted_counts(*args, greedy, uniforms)
    if valid is not None:
        num_accepted = torch.where(valid, num_accepted, 0)
    final = _final_distribution(*args, num_accepted, valid)
    rows = torch.arange(batch, device=device)
    greedy_ids = target_probs[rows, num_accepted].argmax(dim=-1)
    final_ids = torch.where(greedy, greedy_ids, (final / noise).argmax(dim=-1))
    return RejectionOutput(_emitted(draft_token_ids, num_accepted, final_ids), num_accepted)


def _random_draws(
    num_draft_tokens: Sequence[int],
    greedy: Sequence[bool],
    width: int,
    vocab_size: int,
    generators: Sequence[torch.Generator | None],
    fallback: torch.Generator | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms float32 [B, width] and Exp(1) noise float32 [B, V] of the random rows
    (`_row_draws`); greedy rows get zeros and ones and draw nothing."""
    batch = len(num_draft_tokens)
    uniforms = torch.zeros(batch, width, device=device)
    noise = torch.ones(batch, vocab_size, device=device)
    random_rows = [b for b in range(batch) if not greedy[b]]
    if random_rows:
        u, e = _row_draws(
            [num_draft_tokens[b] for b in random_rows],
            vocab_size,
            [generators[b] for b in random_rows],
            fallback,
            device,
        )
        idx = to_device(torch.tensor(random_rows, dtype=torch.long), device)
        uniforms[idx, : u.shape[1]] = u
        noise[idx] = e
    return uniforms, noise


def _emitted(
    draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, final_ids: torch.Tensor
) -> torch.Tensor:
    """int64 [B, k + 1]: accepted drafts, the final token at position a, then padding."""
    batch, width = draft_token_ids.shape
    out = torch.full((batch, width + 1), PAD_TOKEN_ID, dtype=torch.long, device=final_ids.device)
    position = torch.arange(width, device=out.device)
    out[:, :width] = torch.where(
        position[None, :] < num_accepted[:, None], draft_token_ids, PAD_TOKEN_ID
    )
    out.scatter_(1, num_accepted[:, None], final_ids[:, None])
    return out
