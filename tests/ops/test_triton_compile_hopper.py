"""phloem's Triton kernels compile for Hopper (sm_90) on the CPU: Triton's frontend, its PTX and
ptxas, in a process without TRITON_INTERPRET (no GPU needed).

The other kernel tests run under the interpreter, which accepts what the GPU compiler rejects (a
plain float global read inside a kernel failed all 17 FP8 GPU tests of 2026-11-26 although
every CPU test passed). Here each kernel is compiled with the launch constants the engine uses
on the default path (bf16, head dim 128, GQA 4, page 16) and with an FP8 (e4m3) KV cache. The
FP8 activation quantizers are compiled by tests/ops/test_fp8_fused_quant_kernels.py."""

from __future__ import annotations

COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from phloem.ops import activation, rope_kv
from phloem.ops.attention import shared_prefix_triton as sp

TARGET = GPUTarget("cuda", 90, 32)


def build(fn, types, constexprs, **options):
    # every argument that is not a constexpr has a type in `types` (a missing one is a KeyError)
    signature = {n: "constexpr" if n in constexprs else types[n] for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=TARGET, options=options).asm["ptx"]


def tile_types(kv):
    t = {n: "i32" for n in sp.tile_kernel.arg_names if n.startswith("s_")}
    t.update(q_ptr="*bf16", kv_ptr=kv, out_ptr="*bf16", opart_ptr="*fp32", lpart_ptr="*fp32",
             tiles_ptr="*i32", ntiles_ptr="*i32", tok_ptr="*i32", qpos_ptr="*i32",
             blk_ptr="*i32", scale_log2="fp32", k_scale="fp32", v_scale="fp32")
    return t


built = []
for kv, f16_math, block_m, persistent in (
    ("*bf16", False, 16, False), ("*bf16", False, 64, False), ("*bf16", False, 16, True),
    ("*fp8e4nv", True, 16, True), ("*fp8e4nv", True, 64, False), ("*fp8e4nv", False, 16, False),
):
    const = dict(GQA=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=block_m, BLOCK_N=64, PAGE=16,
                 PRECISION="tf32", INTERPRET=False, F16_MATH=f16_math, PERSISTENT=persistent)
    ptx = build(sp.tile_kernel, tile_types(kv), const, num_warps=4, num_stages=3)
    assert "mma" in ptx, "the tile kernel's dots did not lower to tensor-core MMA"
    built.append(f"tile_kernel kv={kv} BLOCK_M={block_m} persistent={persistent}")

merge = {n: "i32" for n in sp.merge_kernel.arg_names if n.startswith("s_")}
merge.update(out_ptr="*bf16", opart_ptr="*fp32", lpart_ptr="*fp32", tok_ptr="*i32",
             count_ptr="*i32", num_slots="i32")
build(sp.merge_kernel, merge, dict(NUM_HEADS=32, HEAD_DIM=128, BLOCK_H=32, BLOCK_D=128),
      num_warps=4)
built.append("merge_kernel")

for cache, clamp in (("*bf16", False), ("*fp8e4nv", True)):
    rope = {n: "i32" for n in rope_kv._rope_kv_kernel.arg_names if n.startswith("s_")}
    rope.update(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", pos_ptr="*i64", cos_ptr="*fp32",
                sin_ptr="*fp32", slot_ptr="*i64", cache_ptr=cache, q_out_ptr="*bf16",
                k_scale="fp32", v_scale="fp32")
    ptx = build(rope_kv._rope_kv_kernel, rope,
                dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, BLOCK_H=32,
                     BLOCK_HALF=64, HAS_REST=False, BLOCK_REST=1, PAGE=16, CLAMP=clamp,
                     LIMIT=rope_kv.FP8_MAX),
                num_warps=4)
    if clamp:
        assert "e4m3" in ptx, "the FP8 cache write did not convert to e4m3"
    built.append(f"_rope_kv_kernel cache={cache}")

build(activation._silu_and_mul_kernel,
      dict(x_ptr="*bf16", out_ptr="*bf16", d="i32", s_x="i32", s_o="i32"),
      dict(BLOCK=16384), num_warps=4)
built.append("_silu_and_mul_kernel")
print("compiled:", "; ".join(built))
"""


def test_kernels_compile_for_hopper(compile_for_hopper):
    out = compile_for_hopper(COMPILE)
    assert "compiled:" in out and out.count("tile_kernel") == 6
