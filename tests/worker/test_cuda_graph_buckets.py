"""CUDA-graph bucket choice and the sync-free KV write (both testable on the CPU)."""

import torch

from phloem.ops.kv_store import write_kv
from phloem.worker.cuda_graph import graph_batch_sizes, write_kv_no_sync


def test_buckets_cover_every_batch():
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 20
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]
    for n in range(1, 257):
        assert any(s >= n for s in sizes)


def test_write_kv_no_sync_matches_write_kv():
    gen = torch.Generator().manual_seed(0)
    cache_a = torch.randn(6, 2, 4, 2, 8, generator=gen)
    cache_b = cache_a.clone()
    slots = torch.tensor([0, 5, 13, 22, 23])
    k = torch.randn(5, 2, 8, generator=gen)
    v = torch.randn(5, 2, 8, generator=gen)
    write_kv(cache_a, k, v, slots)
    write_kv_no_sync(cache_b, k, v, slots)
    assert torch.equal(cache_a, cache_b)
