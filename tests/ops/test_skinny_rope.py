"""RoPE + the KV-cache write fused into the QKV projection's skinny GEMM (interpreted on the CPU):
bit for bit against the unfused pair (the skinny GEMM, then `rope_and_write_kv`) and against
float64 torch, with the norm fused too, FP8 and head-major caches; the launch checks,
PHLOEM_FUSED_QKV_ROPE, and a decoder layer's pre-attention with and without it."""

from __future__ import annotations

import types

import pytest
import torch

from phloem.layers.quantization import base as quant_base
from phloem.layers.rotary import RotaryEmbedding
from phloem.ops.kv_store import allocate_kv_cache


@pytest.fixture(scope="module")
def sr(triton_kernels):
    """The fused module; on the CPU, interpreted (tests/conftest.py sets TRITON_INTERPRET)."""
    triton_kernels("phloem.ops.skinny_gemm", "_skinny_dot_kernel")
    triton_kernels("phloem.ops.rope_kv", "_rope_kv_kernel")
    from phloem.ops import skinny_rope

    return skinny_rope


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def llama3_rotary(head_dim: int) -> RotaryEmbedding:
    rope = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    return RotaryEmbedding(head_dim, head_dim, 512, rope).to(device())


def step(sr, rows, heads, kv_heads, d, k, dtype, cache_dtype, layout, seed):
    """Fresh x [rows, k], W [(heads + 2 kv_heads) d, k] ~ N(0, 1/k), bias, a residual and a norm
    weight, random positions, distinct non-contiguous slots (the first -1: skipped) and a
    cache full of a marker byte (0xff: NaN in bf16, fp16 and e4m3), so a wrong or missed write
    shows. Returns (x, w, b, residual, norm weight, RopeKv)."""
    g = torch.Generator().manual_seed(seed)
    n = (heads + 2 * kv_heads) * d
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5 * 3).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    r = torch.randn(rows, k, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    positions = torch.randint(0, 512, (rows,), generator=g)
    slots = torch.randperm(6 * 4, generator=g)[:rows] * 2  # 12 blocks of 4, every other slot
    slots[0] = -1
    cache = allocate_kv_cache(12, 4, kv_heads, d, cache_dtype, device(), layout)
    cache.view(torch.uint8).fill_(0xFF)
    dev = device()
    rot = llama3_rotary(d)
    rope = sr.RopeKv(positions.to(dev), rot.cos, rot.sin, cache, slots.to(dev), 0.5, 2.0, heads,
                     kv_heads, d)  # fmt: skip
    return (*(t.to(dev) for t in (x, w, b, r, nw)), rope)


def unfused(sr, x, w, b, rope, norm, config):
    """The two kernels the fusion replaces on a GPU: the skinny GEMM (norm-fused with `norm`),
    then `rope_and_write_kv`, into a copy of the cache. Returns (q, cache, qkv)."""
    from phloem.ops.rope_kv import rope_and_write_kv

    qkv = sr.sk.launch(x, w, b, config, False, norm)
    t, h, kv, d = x.shape[0], rope.num_heads, rope.num_kv_heads, rope.head_dim
    q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
    cache = rope.kv_cache.clone()
    out = rope_and_write_kv(rope.positions, q.view(t, h, d), k.view(t, kv, d), v.view(t, kv, d),
                            rope.cos, rope.sin, cache, rope.slot_mapping, rope.k_scale,
                            rope.v_scale)  # fmt: skip
    return out, cache, qkv


def float64_reference(qkv64, rope):
    """RoPE of the q and k heads of qkv64 [T, N] (float64) by the table (float64 of its fp32
    values): (q [T, H, D], k [T, H_kv, D], v [T, H_kv, D])."""
    t, h, kv, d = qkv64.shape[0], rope.num_heads, rope.num_kv_heads, rope.head_dim
    heads = qkv64.view(t, h + 2 * kv, d)
    cos = rope.cos.cpu().double()[rope.positions.cpu()][:, None, :]
    sin = rope.sin.cpu().double()[rope.positions.cpu()][:, None, :]
    x1, x2 = heads[..., : d // 2], heads[..., d // 2 :]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rot[:, :h], rot[:, h : h + kv], heads[:, h + kv :]


def fp8_comparable(x: torch.Tensor) -> torch.Tensor:
    """Where x (float64) rounds to e4m3 within its own power of two: on the CPU, Triton's
    interpreter rounds float32 -> e4m3 wrongly where rounding crosses one (see
    tests/ops/test_fp8_kv_scales.py); everywhere on a GPU."""
    if torch.cuda.is_available():
        return torch.ones_like(x).bool()
    rounded = x.float().to(torch.float8_e4m3fn).double()
    return torch.frexp(rounded)[1] == torch.frexp(x)[1]


CASES = [  # (rows, heads, kv_heads, head_dim, dtype, cache, layout, tensor cores, norm)
    (1, 4, 2, 64, torch.bfloat16, "same", "NHD", False, True),  # decode at batch 1, norm fused
    (3, 4, 2, 64, torch.float16, "fp8", "HND", False, False),  # CUDA cores, 4-row bucket
    (5, 2, 1, 128, torch.bfloat16, "same", "HND", None, False),  # tensor cores (5+ rows)
    (16, 4, 2, 64, torch.float16, "same", "NHD", True, True),  # 16 rows, norm on tl.dot
    (2, 4, 2, 64, torch.bfloat16, "fp8", "NHD", True, False),  # tl.dot at 2 rows, FP8
    (4, 4, 2, 16, torch.bfloat16, "same", "NHD", False, False),  # a tile spans q, k, v heads
]


@pytest.mark.parametrize("rows,heads,kv_heads,d,dtype,cache,layout,tc,norm", CASES)
def test_fused_equals_the_unfused_pair(sr, rows, heads, kv_heads, d, dtype, cache, layout, tc,
                                       norm):  # fmt: skip
    """q and every cache byte as the skinny GEMM then `rope_and_write_kv` (same config) write
    them, bit for bit (the same roundings in the same order: the GEMM's output rounded to the
    model dtype, then the fp32 rotation), the -1 slot untouched; the new residual too. And
    within roundings of float64: one of the projection's output (2^-8 bf16, 2^-11 fp16
    relative, on each half) plus one of the rotated value (plus the FP8 cache's 2^-4)."""
    cache_dtype = torch.float8_e4m3fn if cache == "fp8" else dtype
    x, w, b, r, nw, rope = step(sr, rows, heads, kv_heads, d, 32, dtype, cache_dtype, layout,
                                seed=rows + d)  # fmt: skip
    config = sr.sk.SkinnyConfig(block_n=32, block_k=16, tensor_cores=tc)
    res_a, res_b = torch.empty_like(x), torch.empty_like(x)
    norm_a = sr.sk.NormArgs(r, nw, 1e-5, res_a) if norm else None
    norm_b = sr.sk.NormArgs(r, nw, 1e-5, res_b) if norm else None
    want_q, want_cache, qkv = unfused(sr, x, w, b, rope, norm_b, config)
    got_q = sr.qkv_rope_kv(x, w, b, rope, norm_a, config)
    assert got_q.shape == (rows, heads, d) and got_q.dtype == dtype
    assert torch.equal(got_q, want_q)
    assert torch.equal(rope.kv_cache.view(torch.uint8), want_cache.view(torch.uint8))
    if norm:
        assert torch.equal(res_a, res_b)
    ref_q, ref_k, ref_v = float64_reference(qkv.cpu().double(), rope)  # from the rounded qkv
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got_q.cpu().double(), ref_q, rtol=eps, atol=eps)
    slots = rope.slot_mapping.cpu()
    cached = rope.kv_cache.cpu().double()
    tol = dict(rtol=2**-3, atol=2**-6) if cache == "fp8" else dict(rtol=eps, atol=eps)
    ks, vs = (rope.k_scale, rope.v_scale) if cache == "fp8" else (1.0, 1.0)
    for t in range(1, rows):  # row 0's slot is -1
        block, off = divmod(int(slots[t]), 4)
        for which, scale, ref in ((0, ks, ref_k[t]), (1, vs, ref_v[t])):
            got = cached[block, which, off] * scale
            keep = fp8_comparable(ref / scale) if cache == "fp8" else torch.ones_like(ref).bool()
            torch.testing.assert_close(got[keep], ref[keep], **tol)
    untouched = torch.ones(12 * 4, dtype=torch.bool)
    untouched[slots[1:]] = False
    by_slot = cached.transpose(1, 2).reshape(12 * 4, -1)  # [slot, (k | v) heads and dims]
    assert by_slot[untouched].isnan().all()  # every other slot keeps the marker


def test_fused_matches_float64_through_the_gemm(sr):
    """The whole chain against float64 (x W^T + b, then RoPE): bf16, 1 row, head_dim 128, the
    default config; within one bf16 rounding of the projection on each half and one of q."""
    x, w, b, _, _, rope = step(sr, 1, 2, 1, 128, 64, torch.bfloat16, torch.bfloat16, "NHD", 7)
    got_q = sr.qkv_rope_kv(x, w, b, rope)
    qkv64 = x.cpu().double() @ w.cpu().double().T + b.cpu().double()
    ref_q, _, _ = float64_reference(qkv64, rope)
    scale = qkv64.abs().max()
    torch.testing.assert_close(got_q.cpu().double(), ref_q, rtol=2**-7, atol=2**-7 * scale)


def test_what_the_epilogue_does_not_take_falls_back(sr, monkeypatch):
    """`takes` says no (the layer then runs the two kernels) for partial rotary, a config that
    splits K, a cache of another dtype, 17 rows, a norm the norm-fused kernel would not fuse,
    a `CONFIGS` entry of None; `qkv_rope_kv` raises for the first three."""
    x, w, b, _, nw, rope = step(sr, 2, 4, 2, 16, 32, torch.float16, torch.float16, "NHD", 3)
    assert sr.takes(x, w, rope, False) and sr.takes(x, w, rope, True)
    half = rope._replace(cos=rope.cos[:, :4], sin=rope.sin[:, :4])  # rotary_dim 8 of 16
    bf16 = rope._replace(kv_cache=rope.kv_cache.to(torch.bfloat16))
    for bad in (half, bf16):
        assert not sr.takes(x, w, bad, False)
        with pytest.raises(ValueError, match="RoPE/KV arguments do not fit"):
            sr.qkv_rope_kv(x, w, b, bad)
    split = sr.sk.SkinnyConfig(block_n=16, block_k=16, split_k=2)
    with pytest.raises(ValueError, match="one split of K"):
        sr.qkv_rope_kv(x, w, b, rope, config=split)
    monkeypatch.setitem(sr.sk.CONFIGS, (2, w.shape[0], 32), split)
    assert not sr.takes(x, w, rope, False)
    monkeypatch.setitem(sr.sk.CONFIGS, (2, w.shape[0], 32), None)  # measured: cuBLAS
    assert not sr.takes(x, w, rope, False)
    monkeypatch.delitem(sr.sk.CONFIGS, (2, w.shape[0], 32))
    from phloem.ops import skinny_norm

    monkeypatch.setitem(skinny_norm.CONFIGS, (2, w.shape[0], 32), None)  # norm apart
    assert sr.takes(x, w, rope, False) and not sr.takes(x, w, rope, True)
    monkeypatch.setitem(sr.CONFIGS, (2, w.shape[0], 32, False), None)  # measured: apart
    assert not sr.takes(x, w, rope, False)
    best = sr.sk.SkinnyConfig(block_n=4, block_k=16)
    monkeypatch.setitem(sr.CONFIGS, (2, w.shape[0], 32, False), best)
    assert sr.takes(x, w, rope, False) and sr.config_for(2, w.shape[0], 32, False) is best
    x17 = torch.zeros(17, 32, dtype=x.dtype, device=x.device)
    rope17 = rope._replace(positions=rope.positions.repeat(9)[:17],
                           slot_mapping=rope.slot_mapping.repeat(9)[:17])  # fmt: skip
    assert not sr.takes(x17, w, rope17, False)


@pytest.fixture
def flags(fusion_flags):
    """`set(skinny, fused)`: PHLOEM_SKINNY_GEMM and PHLOEM_FUSED_QKV_ROPE (None: unset), read
    afresh (tests/ops/conftest.py)."""
    quant_base.skinny_norm_module.cache_clear()
    return fusion_flags(quant_base.FUSED_QKV_ROPE_ENV, quant_base.skinny_rope_module)


def test_flag_is_on_by_default_and_validated(sr, flags):
    flags(None, None)
    assert quant_base.skinny_rope_module() is sr
    flags(None, "0")
    assert quant_base.skinny_rope_module() is None
    flags(None, "1")
    assert quant_base.skinny_rope_module() is sr
    flags("0", "1")  # no skinny GEMM: nothing to fuse into
    assert quant_base.skinny_rope_module() is None
    flags(None, "yes")
    with pytest.raises(ValueError, match="PHLOEM_FUSED_QKV_ROPE must be 0 or 1"):
        quant_base.skinny_rope_module()


def decoder_layer(dtype: torch.dtype):
    """A Llama decoder layer (hidden 32, 4 heads of 16, 2 KV heads, qkv bias) with random
    weights on the test device."""
    from phloem.models.llama import LlamaDecoderLayer

    cfg = types.SimpleNamespace(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, rms_norm_eps=1e-5, intermediate_size=48,
                                hidden_act="silu", mlp_bias=False)  # fmt: skip
    layer = LlamaDecoderLayer(cfg, 0, dtype, rotary_emb=llama3_rotary(16), qkv_bias=True,
                              o_bias=False).to(device())  # fmt: skip
    g = torch.Generator().manual_seed(2)
    for name, p in layer.named_parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / 4 + ("norm" in name))
    return layer


def test_decoder_layer_pre_attention_with_and_without_the_fusion(sr, flags, monkeypatch):
    """A decoder layer's pre-attention (fp16; with a residual, and without one as the first
    layer has): PHLOEM_FUSED_QKV_ROPE=1 gives the rotated q, the residual stream and the
    cache bytes of the unfused path as a GPU runs it (norm-fused GEMM, then `rope_kv`'s
    kernel, interpreted here) bit for bit at 1 and 5 rows, in one launch a layer (none at 17
    rows, nor with the flag off)."""
    from phloem.forward_context import ForwardContext, forward_context
    from phloem.layers import attention
    from phloem.ops.rope_kv import rope_and_write_kv

    monkeypatch.setattr(attention, "_rope_kv_kernel", lambda q: rope_and_write_kv)
    layer = decoder_layer(torch.float16)
    calls = []
    real = sr.qkv_rope_kv
    monkeypatch.setattr(sr, "qkv_rope_kv", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(rows: int, residual: bool):
        g = torch.Generator().manual_seed(rows)
        hidden = torch.randn(rows, 32, generator=g).to(torch.float16).to(device())
        res = torch.randn(rows, 32, generator=g).to(hidden) if residual else None
        cache = allocate_kv_cache(12, 4, 2, 16, torch.float16, device(), "NHD").fill_(0)
        slots = (torch.randperm(48, generator=g)[:rows]).to(device())
        meta = types.SimpleNamespace(slot_mapping=slots)
        positions = torch.randint(0, 512, (rows,), generator=g).to(device())
        with forward_context(ForwardContext(meta, [cache], None, valid_slots=True)):
            q, new_res = layer.pre_attention(positions, hidden, res)
        return q, new_res, cache

    for rows, residual in ((1, True), (5, False), (17, True)):
        flags("1", "0")
        want = run(rows, residual)
        assert not calls
        flags("1", "1")
        got = run(rows, residual)
        assert len(calls) == (rows <= 16), (rows, calls)
        calls.clear()
        for a, b in zip(got, want):
            assert torch.equal(a, b), rows


COMPILE_FOR_HOPPER = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from phloem.ops import skinny_rope_kernels as rk
from phloem.worker.triton_prebuild import TritonShapes, launch_all
from phloem.worker.triton_variants import cuda_target, record_variants

types = dict(pos_ptr="*i64", slot_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", M="i32",
             N="i32", K="i32", s_xm="i32", s_wn="i32", eps="fp32", k_scale="fp32",
             v_scale="fp32", **{f"s_{n}": "i32" for n in ("cos", "cb", "ckv", "cs", "ch")})
built = []
for fn, rows, block_n, norm, cache in ((rk._rope_fma_kernel, 1, 8, True, "*bf16"),
                                       (rk._rope_fma_kernel, 4, 8, False, "*fp8e4nv"),
                                       (rk._rope_dot_kernel, 16, 32, False, "*bf16"),
                                       (rk._rope_dot_kernel, 4, 16, True, "*fp8e4nv")):
    const = dict(HAS_BIAS=False, BLOCK_N=block_n, BLOCK_K=256, EVEN_K=True, NORM=norm,
                 HAS_RES=norm, NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, PAGE=16,
                 CLAMP=cache != "*bf16", LIMIT=448.0,
                 **(dict(INTERPRET=False) if fn is rk._rope_dot_kernel else dict(ROWS=rows)))
    sig = {n: "constexpr" if n in const else types.get(n, cache if n == "cache_ptr" else "*bf16")
           for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in const and sig[n] in ("*bf16", "i32") and n != "M"}
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4, num_stages=3)).asm["ptx"]
    assert ("mma" in ptx) == (fn is rk._rope_dot_kernel), "tl.dot only on the tensor cores"
    assert ("rsqrt.approx" in ptx) == norm, "norm: each row's 1 / rms"
    assert ("e4m3" in ptx) == (cache != "*bf16"), "an FP8 cache converts to e4m3"
    assert "atom" not in ptx, "one split of K: no atomics"
    built.append(f"{fn.fn.__name__} rows={rows} norm={norm} cache={cache}")
print("compiled:", "; ".join(built))
llama = dict(num_heads=32, num_kv_heads=8, head_dim=128, rotary_dim=128, hidden_size=4096,
             intermediate_size=14336, shared_prefix=False, skinny_gemm="auto")
for fused in (False, True):
    variants = record_variants(lambda: launch_all(TritonShapes(**llama, fused_qkv_rope=fused)),
                               cuda_target((9, 0)))
    print(fused, "", *sorted(v.describe() for v in variants if "_rope_" in v.describe()
                             and "_rope_kv_kernel" not in v.describe()), sep="|")
"""


def test_kernels_compile_for_hopper_and_the_prebuild_records_them(compile_for_hopper):
    """The GPU compiler takes both tile products with the epilogue (bf16 and FP8 caches, with
    and without the norm; no split-K atomics); the engine's prebuild records the fused
    variants of Llama-3.1-8B's qkv (with the measured tables: the norm fused at 1 row, with
    and without a residual; 2-16 rows without) only with PHLOEM_FUSED_QKV_ROPE=1."""
    out = compile_for_hopper(COMPILE_FOR_HOPPER)
    assert out.count("rows=") == 4, out
    lines = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
    assert lines["False"] == "", lines
    fused = set(lines["True"].split("|")) - {""}
    normed = [v for v in fused if "NORM=True" in v]
    assert len(normed) == 2 and any("HAS_RES=False" in v for v in normed), fused
    assert any("_rope_dot_kernel" in v for v in fused) and len(fused) >= 4, fused
