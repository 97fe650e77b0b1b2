"""Writing a step's new K/V into the paged KV cache (the cache layout is in attention/interface.py).

kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
slot = block_id * block_size + offset_in_block;  slot -1 = padding, not written.

An FP8 cache (`torch.float8_e4m3fn`, `kv_cache_dtype="fp8"`) stores K and V with a scale of 1
(as vLLM's uncalibrated "fp8" KV cache): values are clamped to +-448, the format's largest finite
value, and rounded to nearest; readers convert back to the query dtype.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache dtype: a plain cast, or for FP8 a clamp to +-448 first (no NaN/inf)."""
    if dtype == FP8_KV_DTYPE:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def index_copy_rows(flat: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """flat[rows] = src cast to flat's dtype (`index_copy_`; FP8 through a byte view, which every
    device supports)."""
    src = to_cache_dtype(src, flat.dtype)
    if flat.dtype == FP8_KV_DTYPE:
        flat, src = flat.view(torch.uint8), src.view(torch.uint8)
    flat.index_copy_(0, rows, src)


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each token's K and V into its slot of the paged cache (in place, no Python loop).

    Args:
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim], contiguous; mutated.
        key, value: [T, num_kv_heads, head_dim]; cast to the cache dtype on write (FP8: clamped).
        slot_mapping: int64 [T]; the slot of each token, -1 to skip the token (padding).

    Raises:
        ValueError: for mismatched shapes or a non-contiguous cache (it is written through a view).

    Each slot must appear at most once among the non-negative entries (index_copy_ with duplicate
    indices leaves an unspecified winner). On GPU the -1 filter costs one host sync.
    """
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (it is written through a flat view)")
    num_blocks, two, block_size, num_kv_heads, head_dim = kv_cache.shape
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    if two != 2 or tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"shape mismatch: kv_cache {tuple(kv_cache.shape)}, key {tuple(key.shape)}, "
            f"value {tuple(value.shape)}, slot_mapping {tuple(slot_mapping.shape)}"
        )
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    # Row r of the flat view [num_blocks * 2 * block_size, H, D] is (block, kv, offset) with
    # r = (block * 2 + kv) * block_size + offset, so K of a slot is at block*2*bs + offset and its
    # V one block_size further.
    k_rows = torch.div(slots, block_size, rounding_mode="floor") * (2 * block_size)
    k_rows += slots % block_size
    flat = kv_cache.view(num_blocks * 2 * block_size, num_kv_heads, head_dim)
    index_copy_rows(flat, k_rows, key)
    index_copy_rows(flat, k_rows + block_size, value)
