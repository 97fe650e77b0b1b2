"""The variants of the shared-prefix Triton kernels the engine can launch, compiled ahead of use.

`compile_variants` drives each launch once on CPU tensors for `phloem.worker.triton_prebuild`'s
compile-only driver (see `phloem.ops.rope_kv.compile_variants`); `GRAPH_TRITON_OPTIONS` are the
kernel options the CUDA-graph buffers (`DecodeGraphPlan`) take as well (`SharedPrefixAttention`
passes those on to its graphs)."""

from __future__ import annotations

import torch

from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import build_shared_prefix_metadata

# Options of the Triton kernel that the CUDA-graph buffers (`DecodeGraphPlan`) take as well.
GRAPH_TRITON_OPTIONS = ("block_n", "num_warps", "num_stages", "narrow_block_m")

# Every BLOCK_M of a wide launch: `tile_plan._auto_block_m` rounds the widest segment's rows up
# to a power of two in [16, 64] (a test checks the two agree).
WIDE_BLOCK_MS = (16, 32, 64)


def compile_variants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    graphs: bool,
    kv_layout: str = "NHD",
    **options,
) -> None:
    """Run the kernels once per variant the engine can launch, on CPU tensors, for
    `phloem.worker.triton_prebuild`'s compile-only driver (the launches record the variants and
    run nothing; see `phloem.ops.rope_kv.compile_variants`): an eager step of a 16-member
    decode group and a lone decode token (the wide launch at each BLOCK_M of `WIDE_BLOCK_MS`,
    or at `options["block_m"]`; the narrow launch; the merge) and, with `graphs`, a CUDA-graph
    step (`DecodeGraphPlan`: the persistent wide launch), over a cache in `kv_layout` ("NHD" or
    "HND", `kv_store.allocate_kv_cache`). `options`: the backend's
    `triton_options` (`shared_prefix_attention`'s keywords), so the launch options match."""
    from phloem.ops.attention.decode_graph_plan import DecodeGraphPlan
    from phloem.ops.attention.shared_prefix_triton import shared_prefix_attention
    from phloem.ops.kv_store import allocate_kv_cache

    cache = allocate_kv_cache(2, block_size, num_kv_heads, head_dim, kv_dtype, "cpu", kv_layout)
    query = torch.zeros(17, num_heads, head_dim, dtype=dtype)
    tables = [[0, 1]] * 16 + [[1]]
    meta = AttentionMetadata.from_host([1] * 17, [block_size + 1] * 16 + [1], tables, block_size,
                                       "cpu", prefix_lens=[block_size] * 16 + [0])  # fmt: skip
    sp = build_shared_prefix_metadata(meta, meta.prefix_lens_cpu, 2, 1)
    block_m = options.pop("block_m", None)
    for bm in (block_m,) if block_m else WIDE_BLOCK_MS:
        sp.plan_cache.clear()
        shared_prefix_attention(query, cache, meta, sp, 1.0, block_m=bm, **options)
    if graphs:  # the graph's tables are zeros: every launch finds no tile to run
        graph_options = {k: v for k, v in options.items() if k in GRAPH_TRITON_OPTIONS}
        plan = DecodeGraphPlan(16, num_heads, num_kv_heads, head_dim, "cpu", 64, **graph_options)
        plan.forward(query[:16], cache, 1.0, block_size)
