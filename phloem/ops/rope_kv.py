"""RoPE on q and k plus the KV-cache write as one Triton kernel, imported lazily.

Between the QKV GEMM and attention, each layer rotates q and k (RoPE) and scatters k and v into
the paged cache. As separate steps (inductor's fused RoPE, then `index_copy_` for K and V) the
rotated k makes a round trip through memory and each step is its own launch, several times the
traffic the work needs: one read of q, k, v and one write of q, k, v. This kernel reads q, k, v
once (strided views of the QKV output are fine), writes the rotated q to a new tensor and the
rotated k and v straight into their cache slots: one launch, no intermediate k, no host sync for
padding slots (slot -1 is skipped in the kernel). Its time against the separate steps:
benchmarks/results/2026-11-23-h200-c/README.md.

Math as `phloem.layers.rotary.RotaryEmbedding` (neox / `rotate_half` layout, rotation in float32
from the float32 cos/sin table, the first `rotary_dim` of each head rotated, the rest passed
through) and `phloem.ops.kv_store.write_kv` (cast to the cache dtype; FP8: k / k_scale and
v / v_scale in float32, clamped to +-448, rounded to nearest even).

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phloem.ops.kv_store import FP8_KV_DTYPE, FP8_MAX


@triton.jit
def rotate_pair(x1, x2, cos, sin):
    """The neox rotation of float32 halves: (x1 cos - x2 sin, x2 cos + x1 sin), the one
    expression of it in phloem's kernels (this module's and `phloem.ops.skinny_rope`'s), with
    the contraction written out (x1 cos and x1 sin exact inside an FMA, the other product
    rounded): what sm_90 compiled `x1 * cos - x2 * sin, x2 * cos + x1 * sin` to (Triton 3.9),
    so two kernels round alike whatever the compiler's FP-fusion default."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x1, sin, x2 * cos)


@triton.jit
def _rotated_halves(src, offs, mask, cos, sin, HALF: tl.constexpr):
    """RoPE of the first 2 * HALF dims of a [heads, ...] tile at `src`: the two rotated halves,
    float32 [heads, BLOCK_HALF] each (neox layout: `rotate_pair`)."""
    x1 = tl.load(src + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    return rotate_pair(x1, x2, cos, sin)


@triton.jit
def store_cache(dst, x, mask, scale, CLAMP: tl.constexpr, LIMIT: tl.constexpr):
    """Store float32 `x` in the cache's dtype; an FP8 cache stores x / scale clamped to +-LIMIT
    (as `write_kv` does: an IEEE-rounded division, so both store the same bytes)."""
    if CLAMP:
        x = tl.math.div_rn(x, scale)
        x = tl.minimum(tl.maximum(x, -LIMIT), LIMIT)
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


# The position and slot pointers are read one scalar per program: their 16-byte alignment buys
# nothing, and not specializing on it keeps the CUDA graphs' views (rows of one int64 buffer) on
# the eager steps' compiled kernel.
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, q_out_ptr,
    k_scale, v_scale, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh, s_cos,
    s_cb, s_ckv, s_cs, s_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_REST: tl.constexpr, BLOCK_REST: tl.constexpr, PAGE: tl.constexpr, CLAMP: tl.constexpr,
    LIMIT: tl.constexpr,
):  # fmt: skip
    """One program per token: its q heads rotated into q_out; its k heads rotated and its v
    heads copied into the cache slot (nothing written for a negative slot)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    c_ok = offs < HALF
    cos = tl.load(cos_ptr + pos * s_cos + offs, mask=c_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * s_cos + offs, mask=c_ok, other=0.0)[None, :]
    heads = tl.arange(0, BLOCK_H)
    rest = 2 * HALF + tl.arange(0, BLOCK_REST)  # the pass-through tail of each head
    r_ok = rest < HEAD_DIM

    q_ok = heads < NUM_HEADS
    qm = q_ok[:, None] & c_ok[None, :]
    q_src = q_ptr + t * s_qt + heads[:, None] * s_qh
    q_dst = q_out_ptr + t * s_ot + heads[:, None] * s_oh
    q1, q2 = _rotated_halves(q_src, offs, qm, cos, sin, HALF)
    q_ty = q_out_ptr.dtype.element_ty
    tl.store(q_dst + offs[None, :], q1.to(q_ty), mask=qm)
    tl.store(q_dst + HALF + offs[None, :], q2.to(q_ty), mask=qm)
    if HAS_REST:
        qr = q_ok[:, None] & r_ok[None, :]
        tl.store(q_dst + rest[None, :], tl.load(q_src + rest[None, :], mask=qr), mask=qr)

    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        # K of a slot lives at [block, 0, offset], its V at [block, 1, offset]
        k_dst = cache_ptr + (slot // PAGE) * s_cb + (slot % PAGE) * s_cs + heads[:, None] * s_ch
        v_dst = k_dst + s_ckv
        kv_ok = heads < NUM_KV_HEADS
        km = kv_ok[:, None] & c_ok[None, :]
        k_src = k_ptr + t * s_kt + heads[:, None] * s_kh
        v_src = v_ptr + t * s_vt + heads[:, None] * s_vh
        k1, k2 = _rotated_halves(k_src, offs, km, cos, sin, HALF)
        v1 = tl.load(v_src + offs[None, :], mask=km, other=0.0).to(tl.float32)
        v2 = tl.load(v_src + HALF + offs[None, :], mask=km, other=0.0).to(tl.float32)
        store_cache(k_dst + offs[None, :], k1, km, k_scale, CLAMP, LIMIT)
        store_cache(k_dst + HALF + offs[None, :], k2, km, k_scale, CLAMP, LIMIT)
        store_cache(v_dst + offs[None, :], v1, km, v_scale, CLAMP, LIMIT)
        store_cache(v_dst + HALF + offs[None, :], v2, km, v_scale, CLAMP, LIMIT)
        if HAS_REST:
            rm = kv_ok[:, None] & r_ok[None, :]
            kr = tl.load(k_src + rest[None, :], mask=rm, other=0.0).to(tl.float32)
            vr = tl.load(v_src + rest[None, :], mask=rm, other=0.0).to(tl.float32)
            store_cache(k_dst + rest[None, :], kr, rm, k_scale, CLAMP, LIMIT)
            store_cache(v_dst + rest[None, :], vr, rm, v_scale, CLAMP, LIMIT)


def rope_and_write_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Rotate q and k by position (RoPE) and write the rotated k and v into the paged cache.

    Args:
        positions: int64 [T], each in [0, cos.shape[0]).
        query: [T, H, D]; key, value: [T, H_kv, D] (any strides with a contiguous last dim,
            e.g. views of the fused QKV output).
        cos, sin: float32 [max_position, rotary_dim / 2] (`RotaryEmbedding.cos` / `.sin`);
            the first rotary_dim of each head rotate, the rest pass through.
        kv_cache: [num_blocks, 2, block_size, H_kv, D] with a contiguous last dim (either layout
            of `kv_store.allocate_kv_cache`), query's dtype or float8_e4m3fn (k / k_scale and
            v / v_scale, clamped to +-448); mutated at the slots.
        slot_mapping: int64 [T]: the cache slot of each token (block * block_size + offset);
            negative slots are not written.
        k_scale, v_scale: the layer's FP8 KV scales (> 0; read only for an FP8 cache).
    Returns:
        The rotated query, a new [T, H, D] tensor in query's dtype.
    Raises:
        ValueError: for mismatched shapes or a non-contiguous last dimension.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, two, block_size, num_kv_heads, cache_dim = kv_cache.shape
    half = cos.shape[1]
    expected = (num_tokens, num_kv_heads, head_dim)
    if (
        two != 2
        or cache_dim != head_dim
        or tuple(key.shape) != expected
        or tuple(value.shape) != expected
        or slot_mapping.shape[0] != num_tokens
        or 2 * half > head_dim
        or tuple(sin.shape) != tuple(cos.shape)
    ):
        raise ValueError(
            f"shape mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
            f"{tuple(value.shape)}, kv_cache {tuple(kv_cache.shape)}, cos {tuple(cos.shape)}, "
            f"slot_mapping {tuple(slot_mapping.shape)}"
        )
    if any(x.stride(-1) != 1 for x in (query, key, value, cos, kv_cache)):
        raise ValueError("q/k/v, cos and kv_cache need a contiguous last dim")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    rest = head_dim - 2 * half
    _rope_kv_kernel[(num_tokens,)](
        query, key, value, positions, cos, sin, slot_mapping, kv_cache, out,
        float(k_scale), float(v_scale), query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), out.stride(0), out.stride(1), cos.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        BLOCK_HALF=triton.next_power_of_2(half),
        HAS_REST=rest > 0, BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
        PAGE=block_size, CLAMP=kv_cache.dtype == FP8_KV_DTYPE, LIMIT=FP8_MAX, num_warps=4,
    )  # fmt: skip
    return out


def compile_variants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    kv_layout: str = "NHD",
) -> None:
    """Call `rope_and_write_kv` once on CPU tensors laid out as a model's layer passes them (q, k
    and v views of one fused QKV row, a cos/sin table of rotary_dim / 2 columns, a one-block
    cache of `kv_store.allocate_kv_cache`), for `phloem.worker.triton_prebuild`: under its
    compile-only Triton driver the launch records the kernel variant the engine compiles (Triton
    specializes on dtypes, 16-byte alignment and integers equal to 1 or divisible by 16, none of
    which depend on the token count) and runs nothing. Under a real driver it would launch on
    CPU memory: call it only there."""
    from phloem.ops.kv_store import allocate_kv_cache

    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.zeros(1, q_size + 2 * kv_size, dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    table = torch.zeros(2, rotary_dim // 2, dtype=torch.float32)
    cache = allocate_kv_cache(1, block_size, num_kv_heads, head_dim, cache_dtype, "cpu", kv_layout)
    rope_and_write_kv(
        torch.zeros(1, dtype=torch.int64), q.reshape(1, num_heads, head_dim),
        k.reshape(1, num_kv_heads, head_dim), v.reshape(1, num_kv_heads, head_dim), table, table,
        cache, torch.zeros(1, dtype=torch.int64),
    )  # fmt: skip
