"""write_kv against a per-token loop, including skipped (-1) slots and untouched slots, in both
cache layouts (token-major NHD, head-major HND)."""

import pytest
import torch

from phloem.ops.kv_store import allocate_kv_cache, kv_layout, write_kv

torch.set_num_threads(1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_loop(block_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 7, 3, 8, 11
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    before = cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if num_tokens > num_blocks * block_size:
        slots = torch.cat([slots, torch.full((num_tokens - len(slots),), -1)])
    slots[[2, 5]] = -1  # padding tokens
    write_kv(cache, key, value, slots)

    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            expected[block, 0, offset] = key[t].to(dtype)
            expected[block, 1, offset] = value[t].to(dtype)
    assert torch.equal(cache, expected)
    assert not torch.equal(cache, before)


def test_write_kv_rejects_bad_shapes() -> None:
    cache = torch.zeros(4, 2, 4, 2, 8)
    with pytest.raises(ValueError, match="shape mismatch"):
        write_kv(
            cache, torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), torch.zeros(3, dtype=torch.long)
        )


def test_write_kv_fp8_clamps_and_rounds() -> None:
    """An FP8 cache stores clamp(x, +-448) rounded to e4m3 (no NaN from large values), through
    the byte view that also works where index_copy_ has no FP8 kernel (the CPU)."""
    from phloem.ops.kv_store import FP8_KV_DTYPE

    gen = torch.Generator().manual_seed(3)
    cache = torch.zeros(4, 2, 4, 2, 8, dtype=FP8_KV_DTYPE)
    key = torch.randn(5, 2, 8, generator=gen) * 300  # many beyond 448
    value = torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([0, 7, -1, 9, 15])
    write_kv(cache, key, value, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, 4)
        want_k = key[t].clamp(-448, 448).to(FP8_KV_DTYPE).float()
        assert torch.equal(cache[block, 0, offset].float(), want_k)
        assert torch.equal(cache[block, 1, offset].float(), value[t].to(FP8_KV_DTYPE).float())
    assert cache.float().isfinite().all() and cache.float().abs().max() == 448
    written = torch.zeros(16, dtype=torch.bool)
    written[[0, 7, 9, 15]] = True
    assert (cache.float().permute(0, 2, 1, 3, 4).reshape(16, -1)[~written] == 0).all()


def test_allocate_layouts() -> None:
    nhd = allocate_kv_cache(5, 4, 3, 8, torch.float32, "cpu", "NHD")
    hnd = allocate_kv_cache(5, 4, 3, 8, torch.float32, "cpu", "HND")
    assert nhd.shape == hnd.shape == (5, 2, 4, 3, 8) and not hnd.any()
    assert kv_layout(nhd) == "NHD" and kv_layout(hnd) == "HND"
    # head-major: one head's block_size x head_dim slice of a block is contiguous
    assert hnd.stride() == (2 * 3 * 4 * 8, 3 * 4 * 8, 8, 4 * 8, 1)
    with pytest.raises(ValueError, match="layout"):
        allocate_kv_cache(5, 4, 3, 8, torch.float32, "cpu", "NHWC")
    with pytest.raises(ValueError, match="neither"):
        kv_layout(nhd.transpose(0, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_write_kv_hnd_equals_nhd(dtype) -> None:
    """The same writes land at the same logical [block, kv, offset, head] places either way."""
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(9, 3, 8, generator=gen) * 10
    value = torch.randn(9, 3, 8, generator=gen)
    slots = torch.tensor([0, 3, 4, 9, -1, 13, 18, 19, 6])
    caches = [allocate_kv_cache(5, 4, 3, 8, dtype, "cpu", layout) for layout in ("NHD", "HND")]
    for cache in caches:
        write_kv(cache, key, value, slots)
    assert caches[1].float().any()
    assert torch.equal(caches[0].float(), caches[1].float())
    assert kv_layout(caches[1]) == "HND"  # written in place, still the view of its storage
