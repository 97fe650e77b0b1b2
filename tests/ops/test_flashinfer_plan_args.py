"""FlashInferAttention's host planning without per-sequence tensor ops (CPU, no FlashInfer).

FlashInfer 0.6's `plan()` finds a step's longest query and KV with Python's `max` over host
tensors, four tensor ops a sequence: ~5 ms a step each at 1,024 sequences on an H200 host, in
series with the step's launch (benchmarks/results/2026-11-27d-h200). The backend gives the
longest query as an argument and shadows `max` in FlashInfer's prefill module with
`tensor_max`. A stand-in `flashinfer` module records what `plan()` receives.
"""

from __future__ import annotations

import builtins
import sys
import types

import pytest
import torch

from phloem.ops.attention.flashinfer_backend import tensor_max
from phloem.ops.attention.metadata import AttentionMetadata


class _Wrapper:
    def __init__(self, *args, **kwargs):
        self.calls: list[tuple[tuple, dict]] = []

    def plan(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def test_plan_gets_the_longest_query_and_flashinfer_gets_tensor_max(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.prefill = types.ModuleType("flashinfer.prefill")
    fake.BatchPrefillWithPagedKVCacheWrapper = _Wrapper
    fake.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (_Wrapper,), {})
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", fake.prefill)
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention

    backend = FlashInferAttention(4, 2, 16, torch.bfloat16, "cpu", max_num_seqs=8)
    assert fake.prefill.max is tensor_max
    query_lens, seq_lens = [3, 1, 7, 1], [40, 9, 23, 65]
    tables = [list(range(i * 8, i * 8 + 5)) for i in range(4)]
    meta = AttentionMetadata.from_host(query_lens, seq_lens, tables, block_size=16)
    backend.begin_step(meta)
    ((args, kwargs),) = backend._eager.calls
    assert kwargs["max_token_per_sequence"] == 7
    assert args[0].tolist() == [0, 3, 4, 11, 12]  # qo_indptr


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_tensor_max_returns_what_the_builtin_returns(dtype):
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 17, 1024):
        x = torch.randint(-50, 5000, (n,), generator=g).to(dtype)
        got, want = tensor_max(x), builtins.max(x)
        assert isinstance(got, torch.Tensor) and got.dim() == 0 and got.dtype == want.dtype
        assert got.item() == want.item()
    assert tensor_max([3, 9, 2]) == 9 and tensor_max(4, 1) == 4 and tensor_max([], default=-1) == -1
    two_d = torch.arange(6).reshape(2, 3)  # the builtin's behaviour (rows compared) is kept
    with pytest.raises(RuntimeError):
        tensor_max(two_d)
    with pytest.raises(ValueError):
        tensor_max(torch.empty(0))
