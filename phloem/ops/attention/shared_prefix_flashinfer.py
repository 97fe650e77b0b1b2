"""The library baseline for prefix-shared attention: FlashInfer cascade (arXiv 2501.01005 §3.2).

Two batch-prefill wrappers over the same paged cache, each returning its attention state, merged
by `flashinfer.merge_state`:

  * prefix level: the step's grouped query tokens, gathered group-major (one "request" per group,
    qo_indptr = group token offsets), against each group's prefix pages, NOT causal (every member
    query sits after the prefix, see `build_shared_prefix_metadata`);
  * suffix level: every sequence's queries against its own pages, causal (FlashInfer aligns the
    q_len queries with the last q_len of the kv_len keys, which is phloem's layout);
  * merge: suffix state of the grouped tokens with their prefix state; FlashInfer's LSE is base 2
    on both sides, so the states merge as they come.

Imported lazily (CUDA + flashinfer only) by the shared-prefix backend's "flashinfer" impl, which
`benchmarks/shared_prefix_attention.py` measures against our kernel. Not captured in CUDA graphs:
the token count of the prefix level changes from step to step.
"""

from __future__ import annotations

import itertools

import torch

from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata
from phloem.ops.kv_store import kv_layout

_WORKSPACE_BYTES = 128 << 20


def _pages(block_ids: list[list[int]], lens: list[int], block_size: int):
    """CSR page table (indptr, indices, last_page_len) of sequences with the given KV lengths."""
    indptr, indices, last = [0], [], []
    for ids, n in zip(block_ids, lens):
        num = -(-n // block_size)
        indices.extend(ids[:num])
        indptr.append(len(indices))
        last.append(n - (num - 1) * block_size)
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return as_i32(indptr), as_i32(indices), as_i32(last)


class FlashInferCascade:
    """Plan once per step (`plan`), then `run` per layer (`forward` does both).

    Args:
        num_heads, num_kv_heads, head_dim: attention geometry; dtype: of q and the KV cache;
        device: the CUDA device; scale: softmax scale; kv_layout: "NHD" or "HND", the layout of
        the caches `run` gets (`kv_store.allocate_kv_cache`).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scale: float,
        kv_layout: str = "NHD",
    ) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.device, self.scale = dtype, torch.device(device), scale
        self._ws_prefix = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._ws_suffix = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper
        self.kv_layout = kv_layout
        self._prefix = wrapper(self._ws_prefix, kv_layout, backend="fa2")
        self._suffix = wrapper(self._ws_suffix, kv_layout, backend="fa2")
        self._grouped: torch.Tensor | None = None
        self._num_tokens = 0
        self._planned: SharedPrefixMetadata | None = None

    def fits(self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> bool:
        """Whether this cascade was made for the query's dtype, the scale and the cache layout."""
        return (
            self.scale == scale
            and self.dtype == query.dtype
            and self.kv_layout == kv_layout(kv_cache)
        )

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_meta: AttentionMetadata,
        sp: SharedPrefixMetadata,
    ) -> torch.Tensor:
        """`run`, planning the step at its first layer (a new `sp` is a new step)."""
        if self._planned is not sp:
            self.plan(attn_meta, sp)
            self._planned = sp
        return self.run(query, kv_cache)

    def plan(self, attn_meta: AttentionMetadata, sp: SharedPrefixMetadata) -> None:
        """Plan both levels for the step (host work, small host-to-device copies)."""
        bs = attn_meta.block_size
        geometry = (self.num_heads, self.num_kv_heads, self.head_dim, bs)  # as flashinfer_backend
        common = dict(sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        grouped = [sp.group_token_indices(g) for g in range(sp.num_groups)]
        flat = [t for tokens in grouped for t in tokens]
        self._grouped = torch.tensor(flat, dtype=torch.int64).to(self.device, non_blocking=True)
        if flat:
            qo = torch.tensor([0, *itertools.accumulate(len(t) for t in grouped)])
            pages = _pages(sp.group_block_ids, sp.group_prefix_lens, bs)
            self._prefix.plan(qo.to(torch.int32), *pages, *geometry, causal=False, **common)
        qsl = torch.tensor(attn_meta.query_start_loc_cpu, dtype=torch.int32)
        pages = _pages(sp.suffix_block_ids, sp.suffix_lens, bs)
        self._suffix.plan(qsl, *pages, *geometry, causal=True, **common)
        self._num_tokens = attn_meta.query_start_loc_cpu[-1]

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """[T, H, D] output of the planned step (zeros past query_start_loc[-1])."""
        n = self._num_tokens
        if self.kv_layout == "HND":
            kv_cache = kv_cache.transpose(2, 3)  # the contiguous [num_blocks, 2, H_kv, bs, D]
        o_suf, lse_suf = self._suffix.run(query[:n], kv_cache, return_lse=True)
        if self._grouped is not None and self._grouped.numel():
            idx = self._grouped
            o_pre, lse_pre = self._prefix.run(query.index_select(0, idx), kv_cache, return_lse=True)
            merged, _ = self._flashinfer.merge_state(o_pre, lse_pre, o_suf[idx], lse_suf[idx])
            o_suf.index_copy_(0, idx, merged.to(o_suf.dtype))
        if n == query.shape[0]:
            return o_suf
        out = torch.zeros_like(query)
        out[:n] = o_suf
        return out
