"""q = RoPE(x W_q^T) and the paged-cache write of RoPE(x W_k^T) and x W_v^T for decode-sized x:
the QKV projection's skinny GEMM with `phloem.ops.rope_kv`'s work as its epilogue (issues 19
and 24), one kernel where a decode layer ran two (optionally three: the residual add + RMSNorm
before it, as `phloem.ops.skinny_norm` fuses it).

Tiling: rotate-half pairs column i of a head with column i + D/2. Each program keeps the plain
GEMM's `block_n` and grid (cdiv(N, block_n) programs, one split of K) but takes block_n / 2
such pairs instead of block_n consecutive columns (`skinny_rope_tiles.paired_cols`): its W
rows are two runs of block_n / 2 rows D/2 apart, each row still one contiguous run in K, so
the weight stream is the plain kernel's. No whole-head tiles are needed (they would cut
qkv's 768 programs at block_n 8 to 48).

Arithmetic: the tile's sums are rounded to the model dtype exactly as the plain kernel stores
them, then rotated in fp32 from the fp32 cos/sin table with `rope_kv`'s expression and stored
(q into a new [T, H, D] tensor, k and v into their cache slots; FP8 caches as `rope_kv` stores
them, x / scale clamped to +-448; negative slots skipped). For one config the outputs equal
the unfused pair's (`skinny_linear` or `rms_norm_linear`, then `rope_and_write_kv`) bit for bit
where the compiler contracts `x1 cos - x2 sin` the same way in both kernels (always under the
interpreter).

What falls back (`takes` says no; the caller runs the two kernels): partial rotary
(rotary_dim < head_dim), an odd head_dim, a config that splits K or whose block_n is < 2, a
cache dtype other than x's or FP8, > 16 rows and what `skinny_gemm.takes_rows` refuses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from phloem.ops import skinny_gemm as sk
from phloem.ops.kv_store import FP8_KV_DTYPE, FP8_MAX

# (rows bucket, N, K, norm fused) -> the fused kernel's config, or None: keep the kernels apart.
# Empty until benchmarks/qkv_rope_fusion.py measures it on a GPU (it prints the entries); without
# an entry a launch takes the config of the GEMM it replaces (`config_for`).
CONFIGS: dict[tuple[int, int, int, bool], sk.SkinnyConfig | None] = {}


class RopeKv(NamedTuple):
    """What the epilogue needs: the step's positions and slots, the model's RoPE table, the
    layer's cache and its FP8 scales, the layer's heads (this rank's)."""

    positions: torch.Tensor  # int64 [T], each in [0, cos.shape[0])
    cos: torch.Tensor  # float32 [max_position, head_dim / 2] (`RotaryEmbedding.cos`)
    sin: torch.Tensor  # as cos
    kv_cache: torch.Tensor  # [blocks, 2, block_size, num_kv_heads, head_dim], last dim contiguous
    slot_mapping: torch.Tensor  # int64 [T]; negative: not written
    k_scale: float  # FP8 cache: k / k_scale is stored (> 0; else unread)
    v_scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int


def rope_fits(rope: RopeKv, rows: int, n: int, dtype: torch.dtype) -> bool:
    """Whether the epilogue takes `rope` for `rows` rows of a QKV output of n columns in
    `dtype`: whole-head rotary, shapes that agree, a cache of `dtype` or FP8."""
    d = rope.head_dim
    cache = rope.kv_cache
    return (
        d % 2 == 0
        and n == (rope.num_heads + 2 * rope.num_kv_heads) * d
        and tuple(rope.cos.shape[1:]) == (d // 2,)
        and rope.sin.shape == rope.cos.shape
        and rope.cos.stride(-1) == 1
        and rope.sin.stride() == rope.cos.stride()
        and cache.dim() == 5
        and cache.shape[1] == 2
        and tuple(cache.shape[3:]) == (rope.num_kv_heads, d)
        and cache.stride(-1) == 1
        and cache.dtype in (dtype, FP8_KV_DTYPE)
        and rope.positions.shape == (rows,)
        and rope.slot_mapping.shape == (rows,)
    )


def config_fits(config: sk.SkinnyConfig, rows: int, norm: bool) -> bool:
    """Whether a launch of `rows` rows can run `config` with the epilogue: one split of K, an
    even block_n, and with `norm` a tensor-core tile that fits (`skinny_gemm.fused_fits`)."""
    if config.block_n < 2 or config.split_k != 1:
        return False
    return not norm or sk.fused_fits(config, rows)


def takes(
    x: torch.Tensor, weight: torch.Tensor, rope: RopeKv, norm: bool, measured_only: bool = False
) -> bool:
    """Whether `qkv_rope_kv(x, weight, bias, rope, norm=...)` runs here and is meant for this
    call: x [T, K] of the rows and shape `skinny_gemm.takes` sends to the kernel
    (`measured_only` as there), `rope_fits`, a config that `config_fits`, and with `norm` rows
    the norm-fused kernel takes (`skinny_norm.fuses`)."""
    if x.dim() != 2 or weight.dim() != 2 or x.stride(-1) != 1 or x.shape[1] != weight.shape[1]:
        return False
    rows, (n, k) = x.shape[0], weight.shape
    if not (sk.takes_rows(x, rows, weight, measured_only) and rope_fits(rope, rows, n, x.dtype)):
        return False
    if norm:
        from phloem.ops import skinny_norm

        if not skinny_norm.fuses(rows, n, k):
            return False
    if CONFIGS.get((sk.rows_bucket(rows), n, k, norm), 0) is None:
        return False  # measured: apart is faster
    return config_fits(config_for(rows, n, k, norm), rows, norm)


def qkv_rope_kv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rope: RopeKv,
    norm: sk.NormArgs | None = None,
    config: sk.SkinnyConfig | None = None,
) -> torch.Tensor:
    """The QKV projection of x with RoPE and the KV write fused (see the module docstring).

    Args:
        x: [T, K], 1 <= T <= `skinny_gemm.MAX_ROWS`, bf16 or fp16, rows with a unit stride
            (contiguous with `norm`). weight: [N, K] = [q | k | v] rows of x's dtype, N =
            (num_heads + 2 num_kv_heads) head_dim; bias [N] or None.
        rope: `RopeKv` (`rope_fits`). norm: the residual add + RMSNorm to apply to x first
            (`skinny_gemm.NormArgs`; writes its residual_out), or None.
        config: one split of K, even block_n; None: `config_for` the shape (`skinny_norm`'s
            table with `norm`).
    Returns:
        q rotated, a new [T, num_heads, head_dim] tensor of x's dtype; mutates the cache.
    Raises:
        ValueError: for inputs or a config this launch does not take.
    """
    sk.check_inputs(x, weight, bias)
    rows, (n, k) = x.shape[0], weight.shape
    if x.dim() != 2 or not 0 < rows <= sk.MAX_ROWS or x.stride(-1) != 1:
        raise ValueError(f"x must be [1..{sk.MAX_ROWS}, K] with unit stride, got {tuple(x.shape)}")
    if not rope_fits(rope, rows, n, x.dtype):
        raise ValueError(
            f"RoPE/KV arguments do not fit W {tuple(weight.shape)}: {rope_shapes(rope)}"
        )
    config = config or config_for(rows, n, k, norm is not None)
    config.validate(rows)
    if not config_fits(config, rows, norm is not None):
        raise ValueError(f"the RoPE epilogue takes one split of K and an even block_n: {config}")
    q = torch.empty(rows, rope.num_heads, rope.head_dim, dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, rope, norm, config, q)
    return q


def rope_shapes(rope: RopeKv) -> str:
    """The shapes of `rope`'s tensors, for error messages."""
    return ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in zip(
        ("positions", "cos", "sin", "kv_cache", "slot_mapping"), rope[:5]))  # fmt: skip


def config_for(rows: int, n: int, k: int, norm: bool) -> sk.SkinnyConfig:
    """The config of a fused launch: `CONFIGS`' entry, else the norm-fused kernel's
    (`skinny_norm.config_for`) with `norm`, else the plain GEMM's (`skinny_gemm.config_for`)."""
    measured = CONFIGS.get((sk.rows_bucket(rows), n, k, norm))
    if measured is not None:
        return measured
    if norm:
        from phloem.ops import skinny_norm

        return skinny_norm.config_for(rows, n, k)
    return sk.config_for(rows, n, k)


def _launch(x, weight, bias, rope: RopeKv, norm, config: sk.SkinnyConfig, q) -> None:
    """The kernel launch of `qkv_rope_kv` (arguments checked), writing q and the cache."""
    from phloem.ops.skinny_rope_kernels import _rope_dot_kernel, _rope_fma_kernel

    rows, (n, k) = x.shape[0], weight.shape
    cache = rope.kv_cache
    has_res = norm is not None and norm.residual is not None
    r, nw, ro = (weight, weight, weight)  # unread without `norm`
    if norm is not None:
        r, nw, ro = norm.residual if has_res else weight, norm.weight, norm.residual_out
    args = (x, weight, bias if bias is not None else weight, r, nw, ro, rope.positions,
            rope.slot_mapping, q, cache, rope.cos, rope.sin, rows, n, k, x.stride(0),
            weight.stride(0), norm.eps if norm is not None else 0.0, rope.cos.stride(0),
            cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            float(rope.k_scale), float(rope.v_scale))  # fmt: skip
    consts = dict(HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  EVEN_K=k % config.block_k == 0, NORM=norm is not None, HAS_RES=has_res,
                  NUM_HEADS=rope.num_heads, NUM_KV_HEADS=rope.num_kv_heads,
                  HEAD_DIM=rope.head_dim, PAGE=cache.shape[2], CLAMP=cache.dtype == FP8_KV_DTYPE,
                  LIMIT=FP8_MAX, num_warps=config.num_warps,
                  num_stages=config.num_stages)  # fmt: skip
    grid = (triton.cdiv(n, config.block_n),)
    if config.uses_tensor_cores(rows):
        _rope_dot_kernel[grid](*args, INTERPRET=sk.INTERPRETED, **consts)
    else:
        _rope_fma_kernel[grid](*args, ROWS=sk.rows_bucket(rows), **consts)


def compile_variants(
    num_heads: int, num_kv_heads: int, head_dim: int, hidden: int, block_size: int,
    dtype: torch.dtype, cache_dtype: torch.dtype, kv_layout: str, measured_only: bool = False,
) -> None:  # fmt: skip
    """Call `qkv_rope_kv` on CPU tensors as a decode step's layers would at 1, 2, 4, 8 and 16
    rows (where the skinny GEMM takes the qkv shape [(H + 2 H_kv) D, hidden], `measured_only`
    as in `skinny_gemm.takes`): with the norm fused (with a residual, and without one for the
    first layer) where `skinny_norm.fuses` the rows, else without it; for
    `phloem.worker.triton_prebuild`'s compile-only driver (see
    `skinny_gemm.compile_variants`). Under a real driver it would launch on CPU memory: call
    it only there."""
    from phloem.ops import skinny_norm
    from phloem.ops.kv_store import allocate_kv_cache

    n = (num_heads + 2 * num_kv_heads) * head_dim
    weight, norm_weight = torch.empty(n, hidden, dtype=dtype), torch.empty(hidden, dtype=dtype)
    table = torch.zeros(2, head_dim // 2, dtype=torch.float32)
    cache = allocate_kv_cache(1, block_size, num_kv_heads, head_dim, cache_dtype, "cpu", kv_layout)
    for rows in (1, 2, 4, 8, 16):
        norm = skinny_norm.fuses(rows, n, hidden)
        config = config_for(rows, n, hidden, norm)
        if not (sk.runs_shape(rows, n, hidden, measured_only) and config_fits(config, rows, norm)):
            continue
        x = torch.empty(rows, hidden, dtype=dtype)
        index = torch.zeros(rows, dtype=torch.int64)
        rope = RopeKv(index, table, table, cache, index, 1.0, 1.0, num_heads, num_kv_heads,
                      head_dim)  # fmt: skip
        for residual in (torch.empty_like(x), None) if norm else (None,):
            args = sk.NormArgs(residual, norm_weight, 1e-6, torch.empty_like(x)) if norm else None
            qkv_rope_kv(x, weight, None, rope, args)
