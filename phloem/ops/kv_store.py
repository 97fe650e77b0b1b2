"""Writing a step's new K/V into the paged KV cache (the cache layout is in attention/interface.py).

kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
slot = block_id * block_size + offset_in_block;  slot -1 = padding, not written.
"""

from __future__ import annotations

import torch


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each token's K and V into its slot of the paged cache (in place, no Python loop).

    Args:
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim], contiguous; mutated.
        key, value: [T, num_kv_heads, head_dim]; cast to the cache dtype on write.
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
    flat.index_copy_(0, k_rows, key.to(kv_cache.dtype))
    flat.index_copy_(0, k_rows + block_size, value.to(kv_cache.dtype))
