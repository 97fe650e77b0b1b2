"""The sampler's logits processors (`sampler.Sampler`, in its order): banned ids, the
repetition / frequency / presence penalties, min-p, and top-k then top-p truncation, each over
[B, V] logits on their device, plus the pinned staging of a step's small index tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from phloem.ops.staging import to_device


def device_tensor(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype, device=device)` staged through pinned memory: building it
    never waits for the device (async scheduling samples while the previous step runs)."""
    return to_device(torch.tensor(data, dtype=dtype), device)


def apply_banned(logits: torch.Tensor, banned_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set `logits[i, t] = -inf` for every t in banned_token_ids[i] with 0 <= t < V.

    logits: [B, V] float, modified in place and returned. One host-to-device index copy.
    """
    vocab_size = logits.shape[1]
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i, banned in enumerate(banned_token_ids):
        for t in banned:
            if 0 <= t < vocab_size:
                row_idx.append(i)
                col_idx.append(t)
    if row_idx:
        idx = device_tensor([row_idx, col_idx], dtype=torch.long, device=logits.device)
        logits[idx[0], idx[1]] = float("-inf")
    return logits


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """Per-row occurrence counts: [B, V] float32, counts[i, t] = token_ids[i].count(t).

    Rows are padded to the longest with the id V, scattered into a [B, V + 1] buffer whose last
    column is dropped (vLLM's padded bincount). Ids outside [0, V) are ignored.
    """
    num_rows = len(token_ids)
    max_len = max((len(ids) for ids in token_ids), default=0)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    padded = [
        [t if 0 <= t < vocab_size else vocab_size for t in ids]
        + [vocab_size] * (max_len - len(ids))
        for ids in token_ids
    ]
    index = device_tensor(padded, dtype=torch.long, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties; returns a new [B, V] float32 tensor.

    logits: [B, V] float32 (not modified). Penalty tensors: [B] float32 on logits' device.
    For each row i and token t, with c = count of t in output_token_ids[i]:
      repetition (CTRL, Keskar et al. 2019, sec. 4.1, as in HF/vLLM): if t occurs in the prompt
        or the output, logit > 0 -> logit / r, else logit * r;
      frequency and presence (OpenAI API): logit -= f * c + p * [c > 0]  (output only).
    """
    vocab_size = logits.shape[1]
    out_counts = token_counts(output_token_ids, vocab_size, logits.device)
    seen = token_counts(prompt_token_ids, vocab_size, logits.device) > 0
    seen |= out_counts > 0
    rep = repetition_penalties[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalties[:, None] * out_counts
    return logits - presence_penalties[:, None] * (out_counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop (set -inf) tokens whose probability is below min_p x the top probability.

    Min-p sampling (Nguyen et al. 2024, "Turning Up the Heat"). logits: [B, V] float (tempered),
    not modified; min_p: [B] float in [0, 1], 0 disables. Evaluated in logit space:
    p_t / p_max < m  <=>  logit_t - logit_max < log(m), which needs no softmax.
    """
    log_min_p = torch.log(min_p)[:, None]  # log(0) = -inf keeps everything
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p
    return logits.masked_fill(logits < threshold, float("-inf"))


_TOP_P_CANDIDATES = 1024  # tokens sorted on the fast path of top-k/top-p


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k, then top-p (nucleus) truncation with one descending sort; returns a new tensor.

    Top-k: Fan et al. 2018; top-p: Holtzman et al. 2020, sec. 3.1 ("The Curious Case of Neural
    Text Degeneration"). logits: [B, V] float, not modified; top_k: [B] int64 in [1, V] (pass V
    to disable); top_p: [B] float in (0, 1] (1 disables).
    Top-p keeps the smallest prefix of the sorted, top-k-renormalized distribution whose mass is
    >= top_p, i.e. the tokens whose mass strictly before them is < top_p (so the top token always
    stays). In sorted order:

        |-- kept: position < k and mass_before < p --|-- dropped --|
                                        threshold ^ = last kept value

    Every token with logit >= threshold is kept, so ties at the boundary all stay (vLLM's top-k
    does the same).
    """
    vocab_size = logits.shape[1]
    num_cand = min(vocab_size, _TOP_P_CANDIDATES)
    if num_cand < vocab_size and bool((top_k <= num_cand).all()):
        # Every row keeps at most num_cand tokens: sort only the candidates (exact).
        sorted_logits = logits.topk(num_cand, dim=-1).values
        return _truncate_sorted(logits, sorted_logits, top_k, top_p)
    if num_cand < vocab_size and bool((top_k >= vocab_size).all()):
        # Pure top-p: exact from the candidates for rows whose candidates hold >= top_p of the
        # mass (the nucleus ends inside them); the other rows fall back to a full sort.
        cand = logits.topk(num_cand, dim=-1).values
        mass = (cand - logits.logsumexp(dim=-1, keepdim=True)).exp().sum(dim=-1)
        fits = mass >= top_p
        if bool(fits.all()):
            return _truncate_sorted(logits, cand, top_k, top_p, logits.logsumexp(dim=-1))
    sorted_logits = logits.sort(dim=-1, descending=True).values
    return _truncate_sorted(logits, sorted_logits, top_k, top_p)


def _truncate_sorted(
    logits: torch.Tensor,
    sorted_logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    log_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """The top-k/top-p cut given the leading `sorted_logits` [B, C] (descending) of `logits`.

    `log_norm` [B]: log of the softmax normaliser over the whole kept-by-top-k set when the C
    candidates are fewer than it (pure top-p); None normalises over the candidates within top-k.
    """
    num_cand = sorted_logits.shape[1]
    position = torch.arange(num_cand, device=logits.device)
    in_top_k = position[None, :] < top_k[:, None]
    masked = sorted_logits.masked_fill(~in_top_k, float("-inf"))
    if log_norm is None:
        probs = masked.softmax(dim=-1)
    else:
        probs = (masked - log_norm[:, None]).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    num_keep = keep.sum(dim=-1).clamp_min(1)  # keep is a prefix: both conditions are monotone
    threshold = sorted_logits.gather(1, (num_keep - 1)[:, None])
    return logits.masked_fill(logits < threshold, float("-inf"))
