"""The cascade math in plain torch: the log-sum-exp merge and the shared-prefix oracle.

Softmax attention over a union of two disjoint KV sets is exactly the log-sum-exp merge of the
attention over each set (FlashInfer's "attention states", arXiv 2501.01005 §2.2; Hydragen arXiv
2402.05099 §3; BatchLLM arXiv 2412.03594 §5): with (O_i, LSE_i) the normalized output and
log-sum-exp of the scores over set i,

    LSE = log(exp(LSE_1) + exp(LSE_2)),   O = exp(LSE_1 - LSE) O_1 + exp(LSE_2 - LSE) O_2.

So a step splits into
  * prefix tiles, one per group: all query tokens of the group's members (GQA heads folded into the
    M dimension: row = token * (H / H_kv) + g) against the prefix KV -- a matrix-matrix product that
    reads the prefix once instead of once per member (the Hydragen / BatchLLM saving), and
  * suffix tiles, one per sequence: its queries against its own KV with the causal mask,
each producing a partial (O, LSE), then a merge. This module computes both partials and the merge
in plain torch: the CPU path of the shared-prefix backend and the oracle of its kernels.
"""

from __future__ import annotations

import torch

from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata
from phloem.ops.attention.reference import _gather_kv


def merge_attention_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint KV sets into the result over their union.

    Args:
        o1, o2: [T, H, D] normalized partial outputs (any float dtype).
        lse1, lse2: [T, H] log-sum-exp of the *scaled* scores of each set, NATURAL log:
            lse = log(sum_j exp(scale * q.k_j)); -inf for an empty set.
            FlashInfer (`run(return_lse=True)`, `merge_state`) uses base 2:
            lse_2 = log2(sum_j 2^(scale * log2(e) * q.k_j)) = lse / ln 2, so convert with
            `lse = lse_2 * math.log(2)` (and back with `lse_2 = lse / math.log(2)`).
    Returns:
        (o [T, H, D], lse [T, H]) in float32 (float64 if any input is float64). Rows where both
        sets are empty get o = 0 and lse = -inf. A partial output with lse = -inf is never read,
        so it may hold garbage (NaN).
    """
    cdt = torch.float64 if torch.float64 in (o1.dtype, o2.dtype, lse1.dtype) else torch.float32
    lse1, lse2 = lse1.to(cdt), lse2.to(cdt)
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)  # [T, H], in [0, 1]
    den = w1 + w2
    zero = torch.zeros((), dtype=cdt, device=o1.device)
    num = torch.where(w1[..., None] > 0, o1.to(cdt), zero) * w1[..., None]
    num = num + torch.where(w2[..., None] > 0, o2.to(cdt), zero) * w2[..., None]
    o = num / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return o, m + torch.log(den)


# -- plain-torch reference of the cascade math ------------------------------------------------


def _fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[n, H, D] -> [H_kv, n * G, D]; row t * G + g is token t, query head h_kv * G + g."""
    n, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    return (
        q.view(n, num_kv_heads, group, head_dim)
        .transpose(0, 1)
        .reshape(num_kv_heads, n * group, head_dim)
    )


def _unfold_gqa(o: torch.Tensor, lse: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_fold_gqa` for outputs [H_kv, n * G, D] and LSE [H_kv, n * G]."""
    num_kv_heads, rows, head_dim = o.shape
    group = rows // n
    o = o.view(num_kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, -1, head_dim)
    return o, lse.view(num_kv_heads, n, group).transpose(0, 1).reshape(n, -1)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H_kv, M, D], k/v [N, H_kv, D], keep [M, N] or None -> (o [H_kv, M, D], lse [H_kv, M])."""
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [H_kv, N, D]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H_kv, M, N]
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def shared_prefix_partials_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_meta: AttentionMetadata,
    sp_meta: SharedPrefixMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two partial attention states of every query token, in plain torch (an FP8 cache's
    K and V read as stored * k_scale / v_scale).

    Returns:
        (o_prefix [T, H, D], lse_prefix [T, H], o_suffix [T, H, D], lse_suffix [T, H]) in float32
        (float64 for float64 queries); natural-log LSE. Tokens without a group have
        lse_prefix = -inf and o_prefix = 0; tokens outside `query_start_loc` have both LSE -inf.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    cdt = torch.float64 if query.dtype == torch.float64 else torch.float32
    dev = query.device
    o_pre = torch.zeros(num_tokens, num_heads, head_dim, dtype=cdt, device=dev)
    lse_pre = torch.full((num_tokens, num_heads), float("-inf"), dtype=cdt, device=dev)
    o_suf, lse_suf = o_pre.clone(), lse_pre.clone()
    i64 = dict(dtype=torch.int64, device=dev)
    # Prefix: all queries of a group against the prefix KV, one matmul per group (no mask).
    for g in range(sp_meta.num_groups):
        tokens = torch.tensor(sp_meta.group_token_indices(g), **i64)
        p = sp_meta.group_prefix_lens[g]
        table = torch.tensor([sp_meta.group_block_ids[g]], **i64)
        k, v = _gather_kv(kv_cache, table, torch.tensor([p], **i64), p, cdt, k_scale, v_scale)
        q = _fold_gqa(query[tokens].to(cdt), num_kv_heads)
        o, lse = _unfold_gqa(*_attend(q, k[0], v[0], scale, None), len(tokens))
        o_pre[tokens], lse_pre[tokens] = o, lse
    # Suffix: each sequence against its own KV, causal: query i sits at position seq_len - q_len
    # + i and sees own KV index j (position prefix_len + j) iff prefix_len + j <= that position.
    qsl = attn_meta.query_start_loc_cpu
    for b in range(attn_meta.num_seqs):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        p, n_own = sp_meta.seq_prefix_lens[b], sp_meta.suffix_lens[b]
        table = torch.tensor([sp_meta.suffix_block_ids[b]], **i64)
        lens = torch.tensor([n_own], **i64)
        k, v = _gather_kv(kv_cache, table, lens, n_own, cdt, k_scale, v_scale)
        q_pos = torch.arange(attn_meta.seq_lens_cpu[b] - (end - start), attn_meta.seq_lens_cpu[b])
        keep = (p + torch.arange(n_own))[None, :] <= q_pos[:, None]  # [q_len, n_own]
        keep = keep.to(dev).repeat_interleave(num_heads // num_kv_heads, dim=0)
        q = _fold_gqa(query[start:end].to(cdt), num_kv_heads)
        o_suf[start:end], lse_suf[start:end] = _unfold_gqa(
            *_attend(q, k[0], v[0], scale, keep), end - start
        )
    return o_pre, lse_pre, o_suf, lse_suf


def shared_prefix_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_meta: AttentionMetadata,
    sp_meta: SharedPrefixMetadata,
    scale: float,
    return_lse: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cascade attention in plain torch: prefix part per group + suffix part per sequence, merged.

    Equal (up to rounding) to causal paged attention over each sequence's whole KV
    (`paged_attention_reference`); reads each group's prefix KV once.

    Args:
        query: [T, H, D]; kv_cache: [num_blocks, 2, block_size, H_kv, D] (read only);
        attn_meta: the step's metadata; sp_meta: its groups (`build_shared_prefix_metadata`);
        scale: softmax scale; return_lse: also return the merged natural-log LSE [T, H];
        k_scale, v_scale: an FP8 cache's per-tensor scales (ignored for other caches).
    Returns:
        [T, H, D] in query.dtype (zeros for tokens outside `query_start_loc`), and the LSE in
        float32 (float64 for float64 queries) if asked.
    """
    o, lse = merge_attention_states(
        *shared_prefix_partials_reference(
            query, kv_cache, attn_meta, sp_meta, scale, k_scale, v_scale
        )
    )
    out = o.to(query.dtype)
    return (out, lse) if return_lse else out
