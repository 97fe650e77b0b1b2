"""The sampler's logits processors (`sampler.Sampler`, in its order): banned ids, the
repetition / frequency / presence penalties, min-p, and top-k then top-p truncation, each over
[B, V] logits on their device, `Truncation` (the random rows' min-p and top-k/top-p settings
as device tensors and host lists), plus the pinned staging of a step's small index tensors."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phloem.ops.staging import to_device
from phloem.sampling_params import SamplingParams


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


_SYNC_FREE_TOP_P = os.environ.get("PHLOEM_SYNC_FREE_TOP_P", "0") == "1"  # see apply_top_k_top_p
_TOP_P_CANDIDATES = 1024  # tokens sorted on the fast path of top-k/top-p
_SEARCH_STEPS = 32  # binary search steps over the 2^32 ordered float32 bit patterns
_BLOCK = 256  # tokens summed in float32 by the search before its float64 sum
_NEG_INF_KEY, _POS_INF_KEY = -2139095041, 2139095040  # `_float_key` of -inf, +inf: < 2^32 apart


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    host_top_k: Sequence[int] | None = None,
    host_top_p: Sequence[float] | None = None,
    host_reads: bool | None = None,
) -> torch.Tensor:
    """Top-k, then top-p (nucleus) truncation; returns a new tensor.

    Top-k: Fan et al. 2018; top-p: Holtzman et al. 2020, sec. 3.1 ("The Curious Case of Neural
    Text Degeneration"). logits: [B, V] float, not modified; top_k: [B] int64 in [1, V] (pass V
    to disable); top_p: [B] float in (0, 1] (1 disables). host_top_k, host_top_p: the same
    values as host lists (`Truncation` has them), from which the path is chosen; None
    reads them from the tensors (a device-to-host copy: a synchronization on a GPU).
    host_reads: whether the host may read the device to skip a search no row needs; None: where
    that read is free (CPU tensors), and on a GPU unless `PHLOEM_SYNC_FREE_TOP_P=1` (the search
    for every pure top-p row costs ~7 ms of device time at 256 x 128K by estimate, against the
    read's wait for the step in flight: unmeasured on a GPU, 2026-11-27d-cpu-topp-sync-free).
    The kept set is the same either way.
    Top-p keeps the smallest prefix of the sorted, top-k-renormalized distribution whose mass is
    >= top_p, i.e. the tokens whose mass strictly before them is < top_p (so the top token always
    stays). In sorted order:

        |-- kept: position < k and mass_before < p --|-- dropped --|
                                        threshold ^ = last kept value

    Every token with logit >= threshold is kept, so ties at the boundary all stay (vLLM's top-k
    does the same). The path is chosen from host values only (no device read unless
    host_reads, so async scheduling keeps running ahead of the device):
      - some row has C < k < V, or C = V (C = min(V, _TOP_P_CANDIDATES)): one full sort;
      - else the top C candidates, exact for rows with k <= C; rows with k = V (pure top-p)
        take them too where they hold >= top_p of the mass, else `_top_p_threshold`'s binary
        search, picked per row on the device (`_wide_threshold`). The search runs for every
        pure top-p row (the host cannot know which need it) unless top_p <= C / (2V): the
        top C of V tokens always hold >= C / V of the mass.
    """
    vocab_size = logits.shape[1]
    num_cand = min(vocab_size, _TOP_P_CANDIDATES)
    ks = top_k.tolist() if host_top_k is None else host_top_k
    ps = top_p.tolist() if host_top_p is None else host_top_p
    if num_cand == vocab_size or any(num_cand < k < vocab_size for k in ks):
        sorted_logits = logits.sort(dim=-1, descending=True).values
        return _masked(logits, _sorted_threshold(sorted_logits, top_k, top_p))
    cand = logits.topk(num_cand, dim=-1).values
    if all(k <= num_cand for k in ks):  # every row keeps at most C tokens: the candidates
        return _masked(logits, _sorted_threshold(cand, top_k, top_p))
    bound = num_cand / (2 * vocab_size)  # margin 2x over C / V for the float32 masses
    search = [i for i, (k, p) in enumerate(zip(ks, ps)) if k >= vocab_size and p > bound]
    reads = (
        (logits.device.type == "cpu" or not _SYNC_FREE_TOP_P) if host_reads is None else host_reads
    )
    return _masked(logits, _wide_threshold(logits, cand, top_k, top_p, search, reads))


def _wide_threshold(
    logits: torch.Tensor,
    cand: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    search: Sequence[int],
    host_reads: bool,
) -> torch.Tensor:
    """The cut [B, 1] of `apply_top_k_top_p` from the candidates `cand` [B, C] (descending)
    where some rows have k = V: the candidates' cut, replaced in the rows `search` (host
    indices) whose candidates hold < top_p of the mass by `_top_p_threshold`'s. host_reads:
    skip the search when the host sees that no such row needs it (one device read)."""
    lse = logits.logsumexp(dim=-1)
    threshold = _sorted_threshold(cand, top_k, top_p, lse)
    if not search:
        return threshold
    # rows whose candidates hold the nucleus keep the candidates' cut (exact; the floats the
    # old all-rows-fit path computed)
    fits = ((cand - lse[:, None]).exp().sum(dim=-1) >= top_p) & (top_p < 1.0)
    if host_reads and not bool((~fits & (top_k > cand.shape[1])).any()):
        return threshold
    if len(search) == logits.shape[0]:
        exact = _top_p_threshold(logits, top_p)
        return torch.where(fits, threshold[:, 0], exact)[:, None]
    rows = device_tensor(search, torch.long, logits.device)
    exact = _top_p_threshold(logits.index_select(0, rows), top_p.index_select(0, rows))
    searched = torch.where(fits.index_select(0, rows), threshold[rows, 0], exact)
    return threshold.index_put((rows, torch.zeros_like(rows)), searched)


def _masked(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every entry below its row's threshold [B, 1] set to -inf (new)."""
    return logits.masked_fill(logits < threshold, float("-inf"))


def _sorted_threshold(
    sorted_logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    log_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """The top-k/top-p cut [B, 1] given the leading `sorted_logits` [B, C] (descending) of the
    logits: the last kept value, exact for every row whose kept set lies within the C.

    `log_norm` [B]: log of the softmax normaliser over the whole row, used for the rows with
    k > C (k = V: pure top-p, their candidates fewer than their top-k set); None, or a row with
    k <= C, normalises over the candidates within top-k.
    """
    num_cand = sorted_logits.shape[1]
    position = torch.arange(num_cand, device=sorted_logits.device)
    in_top_k = position[None, :] < top_k[:, None]
    masked = sorted_logits.masked_fill(~in_top_k, float("-inf"))
    probs = masked.softmax(dim=-1)
    if log_norm is not None:
        wide = (top_k > num_cand)[:, None]
        probs = torch.where(wide, (masked - log_norm[:, None]).exp(), probs)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    num_keep = keep.sum(dim=-1).clamp_min(1)  # keep is a prefix: both conditions are monotone
    return sorted_logits.gather(1, (num_keep - 1)[:, None])


def _top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The pure top-p cut [B] of logits [B, V] float (top_p [B], 1: -inf, keep all) without
    sorting and without a device read: the smallest float t whose mass strictly above,
    m(t) = sum of softmax over logits > t, is < top_p. m is non-increasing in t, and a token
    is kept (its mass before < top_p, ties first) exactly when its logit >= t.

    Binary search over the float32 values as int keys in float order (`_float_key`): `lo` is
    the largest key known bad (m >= p), from the key below -inf's (bad by fiat: if
    m(-inf) < p every token is kept, as by the reference); bit by bit from 2^31 down,
    lo + 2^b (at most +inf's key) replaces it where that value is bad too. _SEARCH_STEPS = 32
    steps, each one masked sum over [B, V] (about 10 small kernels), cover the < 2^32 keys
    from -inf to +inf; the cut is the value after lo. The masses are sums of
    w = exp(logit - max), float32 within blocks of _BLOCK tokens and float64 over the blocks,
    compared with top_p x the sum of all w: no float32 normaliser's rounding and no long
    float32 sum moves the cut (closer to a float64 reference than a float32 cumsum).
    """
    pad = -logits.shape[1] % _BLOCK  # padding: logit -inf, weight 0, never above a cut
    x = torch.nn.functional.pad(logits.float(), (0, pad), value=float("-inf"))
    weight = (x - x.amax(dim=-1, keepdim=True)).exp()
    target = _block_sum(weight) * top_p
    lo = torch.full_like(target, _NEG_INF_KEY - 1, dtype=torch.long)  # below all: bad by fiat
    above = torch.empty_like(weight)
    for bit in reversed(range(_SEARCH_STEPS)):
        cand = (lo + (1 << bit)).clamp_(max=_POS_INF_KEY)  # +inf: m = 0, good
        torch.gt(x, _key_float(cand)[:, None], out=above)  # 1.0 / 0.0 (a float compare:
        # 2-4x faster than an int32 one on a CPU)
        lo = torch.where(_block_sum(above.mul_(weight)) >= target, cand, lo)
    return torch.where(top_p < 1.0, _key_float(lo + 1), float("-inf"))


def _block_sum(x: torch.Tensor) -> torch.Tensor:
    """Row sums [B] float64 of x [B, n * _BLOCK] float32: float32 within blocks, then float64."""
    return x.view(x.shape[0], -1, _BLOCK).sum(dim=-1).sum(dim=-1, dtype=torch.float64)


def _float_key(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 keys ordered as the floats (-0.0 = -1 just below +0.0 = 0; -inf
    -2139095041, +inf 2139095040): a negative float's low 31 bits flipped."""
    bits = x.float().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _key_float(key: torch.Tensor) -> torch.Tensor:
    """`_float_key`'s inverse: integer keys in the int32 range -> float32."""
    bits = torch.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.int().view(torch.float32)


@dataclass
class Truncation:
    """Random rows' min-p and top-k/top-p settings as tensors on the device, built from their
    params on the host (`build`), applied by `probs` without reading a row's params.

    Fields:
        min_p: [R] (0: off); None when no row uses min-p.
        top_k: [T] int64 (V: off) and top_p: [T] (1: off) of the T rows that truncate; both
            None when none does. top_rows: int64 [T], those rows' indices; None when all do.
        host_top_k, host_top_p: top_k's and top_p's values on the host, from which
            `apply_top_k_top_p` picks its path without reading the device.
        host_reads: `apply_top_k_top_p`'s (None: only where a read is free, on the CPU).
    """

    min_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    top_rows: torch.Tensor | None = None
    host_top_k: list[int] | None = None
    host_top_p: list[float] | None = None
    host_reads: bool | None = None

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], vocab_size: int, dtype: torch.dtype, device
    ) -> Truncation:
        """params: [R] (random rows); dtype: the tempered logits' (min_p's and top_p's)."""
        out = cls()
        if any(p.min_p > 0.0 for p in params):
            out.min_p = device_tensor([p.min_p for p in params], dtype=dtype, device=device)
        trunc = [i for i, p in enumerate(params) if 0 < p.top_k < vocab_size or p.top_p < 1.0]
        if trunc:
            k = [t if 0 < (t := params[i].top_k) < vocab_size else vocab_size for i in trunc]
            out.top_k = device_tensor(k, dtype=torch.long, device=device)
            out.host_top_k, out.host_top_p = k, [params[i].top_p for i in trunc]
            out.top_p = device_tensor(out.host_top_p, dtype=dtype, device=device)
            if len(trunc) < len(params):
                out.top_rows = device_tensor(trunc, dtype=torch.long, device=device)
        return out

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """Min-p, then top-k/top-p, then softmax of tempered x [R, V] float32 (written in place
        where only some rows truncate): float32 [R, V] rows summing to 1."""
        if self.min_p is not None:
            x = apply_min_p(x, self.min_p)
        if self.top_k is not None and self.top_p is not None:
            host = (self.host_top_k, self.host_top_p, self.host_reads)
            if self.top_rows is None:
                x = apply_top_k_top_p(x, self.top_k, self.top_p, *host)
            else:
                rows = self.top_rows
                x[rows] = apply_top_k_top_p(x[rows], self.top_k, self.top_p, *host)
        return x.softmax(dim=-1)
