"""Writing a step's new K/V into the paged KV cache (the cache layout is in attention/interface.py).

kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
slot = block_id * block_size + offset_in_block;  slot -1 = padding, not written.

That shape is what every kernel sees. In memory a block is either token-major ("NHD", the
contiguous tensor) or head-major ("HND": stored as [num_blocks, 2, num_kv_heads, block_size,
head_dim] and handed out as its transposed view); `allocate_kv_cache` makes either and
`kv_layout` tells them apart by strides. Writers and readers index through the strides.

An FP8 cache (`torch.float8_e4m3fn`, `kv_cache_dtype="fp8"`) stores K and V of each layer with
one fp32 scale each, per tensor (`k_scale`, `v_scale`: from the checkpoint, else 1.0; see
`phloem.layers.attention`): a key k is stored as e4m3(clamp(k / k_scale, -448, 448)) (448 is the
format's largest finite value; the quotient in fp32, rounded to nearest even) and read back as
stored * k_scale, likewise for values (Micikevicius et al., arXiv 2209.05433, §3: e4m3 with
per-tensor scaling factors). Every writer (`write_kv`, the fused RoPE kernel) and reader (the
reference, our Triton kernels, FlashInfer with `k_scale`/`v_scale`) uses the same scales.
"""

from __future__ import annotations

import numpy as np
import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x in the cache dtype: a plain cast, or for FP8 x / scale in fp32, clamped to +-448 (no
    NaN/inf), rounded to nearest even. `scale` (> 0) is read only for FP8."""
    if dtype == FP8_KV_DTYPE:
        return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def check_kv_scale(name: str, value: float) -> float:
    """`value` as a float when it is a usable KV scale (finite, > 0); else ValueError naming
    `name` (e.g. "model.layers.3.self_attn.k_scale")."""
    value = float(value)
    if not (value > 0.0 and value < float("inf")):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    layout: str = "NHD",
) -> torch.Tensor:
    """A zeroed cache of shape [num_blocks, 2, block_size, num_kv_heads, head_dim] in `layout`
    ("NHD": contiguous; "HND": a transposed view of a contiguous [num_blocks, 2, num_kv_heads,
    block_size, head_dim] tensor). Raises ValueError for another layout.

    On the CPU the zeros come from `calloc` (through numpy), whose large blocks are fresh pages
    the OS zeroes on first touch: a 2 GiB pool costs nothing until blocks are written, where
    `torch.zeros` would write all of it at start."""
    if layout == "NHD":
        shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    elif layout == "HND":
        shape = (num_blocks, 2, num_kv_heads, block_size, head_dim)
    else:
        raise ValueError(f"kv layout must be 'NHD' or 'HND', got {layout!r}")
    if torch.device(device).type == "cpu":
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        cache = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    return cache.transpose(2, 3) if layout == "HND" else cache


def kv_layout(kv_cache: torch.Tensor) -> str:
    """ "NHD" or "HND": which of `allocate_kv_cache`'s layouts a cache has (by its strides).
    Raises ValueError for any other memory layout."""
    if kv_cache.is_contiguous():
        return "NHD"
    if kv_cache.transpose(2, 3).is_contiguous():
        return "HND"
    raise ValueError(f"KV cache strides {kv_cache.stride()} are neither NHD nor HND")


def write_kv_slots(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """kv_cache[slot's block, 0/1, slot's offset] = key/value row by row, cast to the cache
    dtype (FP8: key / k_scale and value / v_scale, clamped; written through a byte view, which
    every device supports). slots: int64 [T], all >= 0 (no host sync here); any layout of
    `allocate_kv_cache`."""
    block_size = kv_cache.shape[2]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    key = to_cache_dtype(key, kv_cache.dtype, k_scale)
    value = to_cache_dtype(value, kv_cache.dtype, v_scale)
    if kv_cache.dtype == FP8_KV_DTYPE:
        kv_cache = kv_cache.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    kv_cache[blocks, 0, offsets] = key
    kv_cache[blocks, 1, offsets] = value


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter each token's K and V into its slot of the paged cache (in place, no Python loop).

    Args:
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim] in either layout of
            `allocate_kv_cache`; mutated.
        key, value: [T, num_kv_heads, head_dim]; cast to the cache dtype on write (FP8: divided
            by k_scale / v_scale, clamped to +-448).
        slot_mapping: int64 [T]; the slot of each token, -1 to skip the token (padding).
        k_scale, v_scale: the layer's FP8 scales (> 0; read only for an FP8 cache).

    Raises:
        ValueError: for mismatched shapes.

    Each slot must appear at most once among the non-negative entries (duplicate indices leave
    an unspecified winner). On GPU the -1 filter costs one host sync.
    """
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
    write_kv_slots(kv_cache, slots, key, value, k_scale, v_scale)
