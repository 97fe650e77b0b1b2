"""The fused RoPE + KV-cache-write Triton kernel against RotaryEmbedding + write_kv (the torch
path it replaces) on fresh random inputs; interpreted on the CPU, compiled on a GPU."""

import pytest
import torch

from phloem.layers.rotary import RotaryEmbedding
from phloem.ops.kv_store import write_kv


@pytest.fixture(scope="module")
def kernel(triton_kernels):
    """The kernel; on the CPU, interpreted (tests/conftest.py sets TRITON_INTERPRET)."""
    return triton_kernels("phloem.ops.rope_kv", "_rope_kv_kernel").rope_and_write_kv


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_step(num_tokens, heads, kv_heads, head_dim, rotary_dim, dtype, seed, pad=0):
    """Packed qkv (as the QKV GEMM writes it), positions, distinct slots (the last `pad` = -1)
    and a NaN-filled cache (so any write to a wrong place or any missed write shows)."""
    g = torch.Generator().manual_seed(seed)
    rope = {"rope_theta": 10000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    rotary = RotaryEmbedding(head_dim, rotary_dim, 512, rope)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(num_tokens, width, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 512, (num_tokens,), generator=g)
    num_blocks, block_size = 8, 4
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if pad:
        slots[-pad:] = -1
    return rotary, qkv, positions, slots, (num_blocks, 2, block_size, kv_heads, head_dim)


def split(qkv, heads, kv_heads, head_dim):
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    t = qkv.shape[0]
    return (q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim),
            v.view(t, kv_heads, head_dim))  # fmt: skip


@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim,rotary_dim,dtype,pad", [
    (9, 4, 2, 16, 16, torch.float32, 0),  # GQA, whole head rotated
    (7, 6, 2, 16, 8, torch.float32, 2),  # partial rotary (tail passes through), padding slots
    (5, 4, 4, 32, 32, torch.float16, 0),  # MHA, 16-bit
])  # fmt: skip
def test_matches_rotary_then_write_kv(kernel, num_tokens, heads, kv_heads, head_dim, rotary_dim,
                                      dtype, pad):  # fmt: skip
    rotary, qkv, positions, slots, cache_shape = make_step(
        num_tokens, heads, kv_heads, head_dim, rotary_dim, dtype, seed=num_tokens + heads, pad=pad
    )
    q, k, v = split(qkv, heads, kv_heads, head_dim)
    want_q, want_k = rotary(positions, q, k)
    want_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    write_kv(want_cache, want_k, v, slots)
    dev = device()
    cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=dev)
    q_d, k_d, v_d = split(qkv.to(dev), heads, kv_heads, head_dim)  # strided views, as in a model
    rotary = rotary.to(dev)
    got_q = kernel(positions.to(dev), q_d, k_d, v_d, rotary.cos, rotary.sin, cache, slots.to(dev))
    assert got_q.shape == (num_tokens, heads, head_dim) and got_q.dtype == dtype
    # float32: the GPU contracts x1 * cos - x2 * sin into an FMA (one rounding fewer)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got_q.cpu(), want_q.reshape(got_q.shape), **tol, equal_nan=True)
    torch.testing.assert_close(cache.cpu(), want_cache, **tol, equal_nan=True)


def test_head_major_cache_gets_the_same_values(kernel):
    """An HND cache (kv_store.allocate_kv_cache): same logical contents as write_kv's."""
    from phloem.ops.kv_store import allocate_kv_cache, kv_layout

    rotary, qkv, positions, slots, cache_shape = make_step(8, 4, 2, 16, 16, torch.float32, 3, 1)
    q, k, v = split(qkv, 4, 2, 16)
    _, want_k = rotary(positions, q, k)
    want = allocate_kv_cache(*cache_shape[:1], *cache_shape[2:], torch.float32, "cpu", "HND")
    write_kv(want.fill_(float("nan")), want_k, v, slots)
    dev = device()
    cache = allocate_kv_cache(*cache_shape[:1], *cache_shape[2:], torch.float32, dev, "HND")
    cache.fill_(float("nan"))
    q_d, k_d, v_d = split(qkv.to(dev), 4, 2, 16)
    rotary = rotary.to(dev)
    kernel(positions.to(dev), q_d, k_d, v_d, rotary.cos, rotary.sin, cache, slots.to(dev))
    assert kv_layout(cache) == "HND"
    torch.testing.assert_close(cache.cpu(), want, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_empty_step_writes_nothing(kernel):
    rotary, qkv, positions, slots, cache_shape = make_step(0, 4, 2, 16, 16, torch.float32, seed=0)
    cache = torch.zeros(cache_shape, device=device())
    q, k, v = split(qkv.to(device()), 4, 2, 16)
    rotary = rotary.to(device())
    out = kernel(positions.to(device()), q, k, v, rotary.cos, rotary.sin, cache, slots.to(device()))
    assert out.shape == (0, 4, 16) and not cache.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fp8_cache_clamps_like_write_kv(kernel):
    """An FP8 cache gets the clamped, rounded values `write_kv` stores (compared as float). GPU
    only: the Triton interpreter rounds float32 -> e4m3 wrongly where rounding up crosses a
    power of two (124.6 -> 64 instead of 128)."""
    rotary, qkv, positions, slots, cache_shape = make_step(6, 4, 2, 16, 16, torch.float16, seed=5)
    qkv = qkv * 100  # beyond e4m3's +-448 after rotation
    q, k, v = split(qkv, 4, 2, 16)
    _, want_k = rotary(positions, q, k)
    want = torch.zeros(cache_shape, dtype=torch.float8_e4m3fn)
    write_kv(want, want_k, v, slots)
    dev = device()
    cache = torch.zeros(cache_shape, dtype=torch.float8_e4m3fn, device=dev)
    q_d, k_d, v_d = split(qkv.to(dev), 4, 2, 16)
    rotary = rotary.to(dev)
    kernel(positions.to(dev), q_d, k_d, v_d, rotary.cos, rotary.sin, cache, slots.to(dev))
    got = cache.cpu().float()
    assert got.abs().max() == 448
    # the torch path rounds the rotation to fp16 first: allow one e4m3 step (12.5% relative)
    torch.testing.assert_close(got, want.float(), rtol=0.13, atol=1e-2)


def test_bad_shapes_raise(kernel):
    rotary, qkv, positions, slots, cache_shape = make_step(3, 4, 2, 16, 16, torch.float32, seed=0)
    q, k, v = split(qkv, 4, 2, 16)
    cache = torch.zeros(cache_shape)
    with pytest.raises(ValueError, match="shape mismatch"):
        kernel(positions, q, k[:, :1], v, rotary.cos, rotary.sin, cache, slots)
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros(cache_shape[::-1]).permute(
            4, 3, 2, 1, 0
        )  # same shape, not contiguous
        kernel(positions, q, k, v, rotary.cos, rotary.sin, strided, slots)
