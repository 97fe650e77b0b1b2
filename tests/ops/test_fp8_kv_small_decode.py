"""phloem's small-decode Triton kernel over an FP8 (e4m3) cache in each of its FP8 maths (issue
18): "f16" (default), "q" (the query's dtype) and "mma" (e4m3 x e4m3 products with the operands
swapped: the query and P rounded to e4m3), against float64 attention over the dequantized cache,
one split and several (the in-launch merge), bf16 queries. Interpreted on the CPU (tests/conftest.py
sets TRITON_INTERPRET); benchmarks/fp8_kv_decode.py times them on a GPU."""

from __future__ import annotations

import pytest
import torch

from phloem.ops.attention import small_decode as sd
from phloem.ops.attention.reference import paged_attention_reference
from tests.ops.test_small_decode import device, launch, make_step

# relative (Frobenius) error bounds: bf16 output rounding; e4m3 query and P (~3-4% measured
# in float64 on random data, benchmarks/results/2026-11-27f-cpu-fp8-kv-decode)
REL_TOL = {"f16": 1e-2, "q": 1e-2, "mma": 8e-2}


@pytest.fixture
def kernel(triton_kernels):
    return triton_kernels("phloem.ops.attention.small_decode_triton", "small_decode_kernel")


@pytest.mark.parametrize("fp8_math", ["f16", "q", "mma"])
def test_fp8_maths_match_float64(kernel, fp8_math):
    """Lengths 13 and 70 (ragged last tiles), 2 KV heads of GQA 4, head dim 32; k_scale 0.5 and
    v_scale 2.0 (a dropped scale is off by 2x); splits of 16 tokens (2 and 3 used)."""
    query, kv, meta = make_step([13, 70], 2, 4, 32, 16, seed=7)
    kv8 = (kv * 3).clamp(-448, 448).to(torch.float8_e4m3fn)
    # bf16 queries that e4m3 holds exactly: the interpreter's float -> e4m3 conversion drops the
    # carry of a mantissa rounding up into the exponent (1.95 -> 1.0, not 2.0; Triton 3.9, ~3%
    # of N(0, 1) values), which the "mma" query rounding would show; sm_90's cvt.rn.satfinite
    # rounds right. (P's rounding still goes through it: ~2% here.)
    q = query.to(torch.float8_e4m3fn).to(torch.bfloat16)
    want = paged_attention_reference(q.double(), kv8.double(), meta, 0.3, k_scale=0.5,
                                     v_scale=2.0)[:2]  # fmt: skip
    plan = sd.SmallDecodePlan(2, 8, 2, 32, 8, device(), splits=3, split_tokens=16)
    for block_n in (16, 64):
        got = launch(kernel, plan, q, kv8, meta, 0.3, k_scale=0.5, v_scale=2.0, block_n=block_n,
                     fp8_math=fp8_math)  # fmt: skip
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err <= REL_TOL[fp8_math], f"block_n {block_n}: relative error {err:.1e}"
        assert not plan.counters.any()


def test_unknown_fp8_math_is_refused(kernel):
    query, kv, meta = make_step([5], 1, 2, 16, 16, seed=1)
    plan = sd.SmallDecodePlan(1, 2, 1, 16, 2, device())
    with pytest.raises(ValueError, match="fp8_math must be"):
        launch(kernel, plan, query, kv.to(torch.float8_e4m3fn), meta, 0.3, fp8_math="e5m2")


def test_launch_defaults_switch(kernel, monkeypatch):
    """PHLOEM_SMALL_DECODE_FP8 ("<fp8_math>[:<block_n>]") sets an FP8 cache's launches that
    name no fp8_math (the engine's): parsed, refused naming the variable, read once."""
    from phloem.ops.attention import small_decode_fp8 as sdt

    assert sdt.fp8_launch_defaults("") == ("f16", None)
    assert sdt.fp8_launch_defaults("mma:128") == ("mma", 128)
    assert sdt.fp8_launch_defaults("q") == ("q", None)
    for bad in ("mma:100", "e5m2", "f16:8", "mma:"):
        with pytest.raises(ValueError, match="PHLOEM_SMALL_DECODE_FP8 must be"):
            sdt.fp8_launch_defaults(bad)
    monkeypatch.setenv(sdt.FP8_ENV, "mma:64")
    sdt.fp8_launch_defaults.cache_clear()
    try:
        assert sdt.fp8_launch_defaults() == ("mma", 64)
        query, kv, meta = make_step([40], 1, 4, 16, 16, seed=3)
        plan = sd.SmallDecodePlan(1, 4, 1, 16, 3, device())
        kv8 = kv.to(torch.float8_e4m3fn)
        q = query.to(torch.float8_e4m3fn).to(torch.bfloat16)
        got = launch(kernel, plan, q, kv8, meta, 0.25)  # mma, BLOCK_N 64
        want = paged_attention_reference(q.double(), kv8.double(), meta, 0.25)[:1]
        assert ((got.double() - want).norm() / want.norm()).item() <= REL_TOL["mma"]
    finally:
        sdt.fp8_launch_defaults.cache_clear()
