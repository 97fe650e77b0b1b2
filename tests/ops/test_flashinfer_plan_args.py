"""FlashInferAttention plans a step with its longest query and KV given (CPU, no FlashInfer).

Without `max_token_per_sequence` / `max_sequence_kv`, FlashInfer's `plan()` finds both with
Python's `max` over host tensors, one tensor op a sequence: ~9 ms a step at 1,024 sequences on an
H200 host, in series with the step's launch (benchmarks/results/2026-11-27d-h200). A stand-in
`flashinfer` module records what `plan()` receives.
"""

from __future__ import annotations

import sys
import types

import torch

from phloem.ops.attention.metadata import AttentionMetadata


class _Wrapper:
    def __init__(self, *args, **kwargs):
        self.calls: list[tuple[tuple, dict]] = []

    def plan(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def test_plan_gets_the_longest_query_and_kv(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = _Wrapper
    fake.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (_Wrapper,), {})
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention

    backend = FlashInferAttention(4, 2, 16, torch.bfloat16, "cpu", max_num_seqs=8)
    query_lens, seq_lens = [3, 1, 7, 1], [40, 9, 23, 65]
    tables = [list(range(i * 8, i * 8 + 5)) for i in range(4)]
    meta = AttentionMetadata.from_host(query_lens, seq_lens, tables, block_size=16)
    backend.begin_step(meta)
    ((args, kwargs),) = backend._eager.calls
    assert kwargs["max_token_per_sequence"] == 7
    assert kwargs["max_sequence_kv"] == 65
    assert args[0].tolist() == [0, 3, 4, 11, 12]  # qo_indptr
