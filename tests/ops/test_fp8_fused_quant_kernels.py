"""The fused RMSNorm / SiLU-and-mul + per-token FP8 kernels (phloem/ops/fp8_fused_quant.py),
interpreted on the CPU: their model-dtype output (written to `y` for the test) against the
layers' torch math, and their scales and e4m3 bytes against `fp8_math`'s quantization of that
same output. The interpreter's casts are not the GPU's (fp32 -> bf16 truncates; fp32 -> e4m3
is not round-to-nearest-even on ties, carries into the next binade, mis-casts subnormals), so the
outputs are checked to a few bf16 steps, the scales exactly, and the bytes as 95% equal and every
value within half of itself; tests/gpu/test_fp8_fused_quant_gpu.py checks every byte on the GPU.
Since the interpreter also accepts code the GPU compiler rejects, both kernels are compiled for
sm_90 here as well (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phloem.layers.norm import RMSNorm
from phloem.layers.quantization import fp8_math

torch.set_num_threads(1)
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
fq = pytest.importorskip("phloem.ops.fp8_fused_quant")


@triton.jit
def _divide_kernel(y_ptr, scale, q_ptr, n, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    b, r = fq._divisor(scale)
    tl.store(q_ptr + cols, fq._div_rn_by(tl.load(y_ptr + cols, mask=ok), b, r), mask=ok)


@pytest.fixture
def ops(triton_kernels):
    return triton_kernels("phloem.ops.fp8_fused_quant", "_rms_norm_quant_kernel")


def rows_of(seed: int, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows from 1e-4 to 1e6 in magnitude with an outlier column; row 0 all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-4, 6, rows)[:, None]
    x[:, 3] *= 100.0
    x[0] = 0.0
    return x.to(dtype)


def quantized_like_the_reference(q, scale, y) -> None:
    """Scales exactly `quantize_per_token`'s for the kernel's own output y; bytes as close as
    the interpreter's e4m3 cast allows; the zero row at the minimum scale."""
    ref_q, ref_scale = fp8_math.quantize_per_token(y)
    assert torch.equal(scale, ref_scale)
    got, want = q.float(), ref_q.float()
    assert (got == want).float().mean() > 0.95
    # (+ 2^-5: fp32-subnormal quotients, which the interpreter does not cast to 0)
    assert ((got - want).abs() <= 0.5 * want.abs() + 2.0**-5).all()
    assert float(scale[0]) == pytest.approx(fp8_math.MIN_SCALE) and (got[0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("rows", "k"), [(5, 100), (3, 4096)])
def test_rms_norm_quant(ops, dtype, with_residual, rows, k):
    norm = RMSNorm(k, 1e-6, dtype)
    norm.weight.data.copy_(torch.rand(k) * 4)
    x = rows_of(k, rows, k, dtype)
    residual = rows_of(k + 1, rows, k, dtype) if with_residual else None
    y = torch.empty_like(x)
    q, scale, res = ops.rms_norm_quant(x, norm.weight.data, norm.eps, fp8_math.MIN_SCALE,
                                       residual, y)  # fmt: skip
    assert q.shape == (rows, k) and scale.shape == (rows, 1)
    step = 2.0**-5 if dtype == torch.bfloat16 else 1e-5  # three roundings, truncated here
    if residual is None:
        assert res is None
        want = norm.compute(x)
    else:
        want, want_res = norm.compute(x, residual)
        torch.testing.assert_close(res.float(), want_res.float(), rtol=step, atol=0)
    torch.testing.assert_close(y.float(), want.float(), rtol=step, atol=1e-6)
    quantized_like_the_reference(q, scale, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "d"), [(5, 100), (3, 5000)])
def test_silu_and_mul_quant(ops, dtype, rows, d):
    x = rows_of(d, rows, 2 * d, dtype) / 1e3
    y = torch.empty(rows, d, dtype=dtype)
    q, scale = ops.silu_and_mul_quant(x, fp8_math.MIN_SCALE, y)
    x64 = x.double()
    want = F.silu(x64[:, :d]) * x64[:, d:]
    step = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), want, rtol=step, atol=1e-12)
    quantized_like_the_reference(q, scale, y)


def test_silu_and_mul_quant_programs_walk_rows_alike(ops):
    """The persistent kernel: each program walks rows first, first + programs, ..., its
    loads pipelined (NUM_STAGES 3) or not (1, the launch of rows too wide for the pipeline's
    shared memory); whatever the number of programs (1: one walks every row; rows: one row
    each, every copy ahead masked) and stages, the rows come out the same, bit for bit.
    14336 columns use all three pieces (8192 + 4096 + 2048)."""
    rows, d = 3, 14336
    x = rows_of(7, rows, 2 * d, torch.bfloat16) / 1e3
    y = torch.empty(rows, d, dtype=torch.bfloat16)
    launches = [(1, 3), (2, 3), (rows, 3), (rows, 1)]
    outs = [ops._silu_and_mul_quant(x, fp8_math.MIN_SCALE, y, n, 16, s) for n, s in launches]
    for q, scale in outs[1:]:
        assert torch.equal(scale, outs[0][1])
        assert torch.equal(q.view(torch.uint8), outs[0][0].view(torch.uint8))
    x64 = x.double()
    want = F.silu(x64[:, :d]) * x64[:, d:]
    torch.testing.assert_close(y.double(), want, rtol=2.0**-7, atol=1e-12)
    quantized_like_the_reference(*outs[0], y)


@pytest.mark.parametrize("scale", [1e-12, 3.0 / 448, 0.7, 1e5, 7.5e35, float("inf")])
def test_division_by_the_row_scale_rounds_as_div_rn(ops, scale):
    """`_div_rn_by` (three FMA-unit operations on a divisor's reciprocal computed once a row)
    on every finite bf16 value y with |y| <= 448 scale (the values a row of that scale holds)
    against IEEE division: equal where neither y nor the quotient is tiny; elsewhere (e4m3
    zeros, as scale >= 2^-80) tiny, with y's sign (-0 / scale = -0); an infinite scale gives
    y * 0. Interpreted, the reciprocal is numpy's correctly rounded 1 / scale, not the GPU's
    rcp.approx: benchmarks/fp8_fused_quant_bench.py's "exact" rows check the GPU's bytes."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    y = bits.view(torch.bfloat16).float()
    y = y[y.isfinite() & (y.abs() <= 448 * torch.tensor(scale, dtype=torch.float32))]
    q = torch.empty_like(y)
    _divide_kernel[(1,)](y, scale, q, y.numel(), BLOCK=triton.next_power_of_2(y.numel()))
    want = y / torch.tensor(scale, dtype=torch.float32)
    # fp32 subnormal y or y / scale: not the fast path's domain; all are e4m3 zeros
    fast = (want.abs() >= 2.0**-126) & (y.abs() >= 2.0**-100)
    assert fast.any() or scale == float("inf")
    assert torch.equal(q[fast], want[fast])
    assert (want[~fast].abs() < 2.0**-11).all() and (q[~fast].abs() < 2.0**-11).all()
    assert torch.equal(torch.signbit(q[~fast]), torch.signbit(y[~fast]))


@pytest.mark.parametrize(
    ("d", "dtype", "stages"),
    [(14336, torch.bfloat16, 3), (18944, torch.bfloat16, 3), (28672, torch.bfloat16, 1),
     (14336, torch.float32, 1), (100, torch.float32, 3)],
)  # fmt: skip
def test_silu_launch_pipelines_rows_that_fit_shared_memory(d, dtype, stages):
    from phloem.ops.fp8_fused_quant import _silu_launch

    launch = _silu_launch(1000, d, dtype, torch.device("cpu"))
    assert launch["num_stages"] == stages and launch["programs"] == (2 if stages == 3 else 1000)
    assert 4 <= launch["num_warps"] <= 32


@pytest.mark.parametrize("width", [1, 5, 100, 4096, 5000, 11008, 14336, 18944, 28672, 32768])
def test_row_pieces_cover_a_row_with_powers_of_two(width):
    from phloem.ops.fp8_fused_quant import _row_pieces

    pieces = _row_pieces(width)
    assert list(pieces) == sorted(pieces, reverse=True) and min(pieces) >= 16
    assert all(p & (p - 1) == 0 for p in pieces) and sum(pieces) >= width
    # never more padding than one power-of-two block; none at Llama-3's MLP widths
    assert sum(pieces) <= max(48, 1 << (width - 1).bit_length())
    if width in (4096, 14336, 28672, 32768):
        assert sum(pieces) == width


def test_bad_input_is_named(ops):
    x = torch.zeros(2, 6)
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul_quant(torch.zeros(2, 7), fp8_math.MIN_SCALE)
    with pytest.raises(ValueError, match="at most"):
        ops.silu_and_mul_quant(torch.zeros(1, 2 * ops.MAX_FUSED_COLUMNS + 2), fp8_math.MIN_SCALE)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm_quant(x, torch.ones(6, dtype=torch.bfloat16), 1e-6, fp8_math.MIN_SCALE)
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm_quant(x, torch.ones(6), 1e-6, fp8_math.MIN_SCALE, torch.zeros(3, 6))
    with pytest.raises(ValueError, match="2-D"):
        ops.rms_norm_quant(torch.zeros(6), torch.ones(6), 1e-6, fp8_math.MIN_SCALE)


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from phloem.ops import fp8_fused_quant as m

ptr = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16"}
norm = {**ptr, "r_ptr": "*bf16", "w_ptr": "*bf16", "r_out_ptr": "*bf16", "k": "i32",
        "num_cols": "fp32", "s_x": "i32", "s_r": "i32", "s_q": "i32", "s_ro": "i32", "s_y": "i32",
        "eps": "fp32", "min_scale": "fp32", "HAS_RESIDUAL": "constexpr", "HAS_Y": "constexpr",
        "BLOCK": "constexpr"}
silu = {**ptr, "rows": "i32", "d": "i32", "s_x": "i32", "s_q": "i32", "s_y": "i32",
        "min_scale": "fp32", "HAS_Y": "constexpr", "BLOCK0": "constexpr", "BLOCK1": "constexpr",
        "BLOCK2": "constexpr", "NUM_STAGES": "constexpr"}
for fn, sig, const, warps in (
    (m._rms_norm_quant_kernel, norm, {"HAS_RESIDUAL": True, "HAS_Y": False, "BLOCK": 4096}, 8),
    (m._silu_and_mul_quant_kernel, silu,
     {"HAS_Y": False, "BLOCK0": 8192, "BLOCK1": 4096, "BLOCK2": 2048, "NUM_STAGES": 3}, 16),
):
    src = ASTSource(fn=fn, signature={n: sig[n] for n in fn.arg_names}, constexprs=const)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
    assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx, fn.__name__
print("compiled")
"""


def test_kernels_compile_for_hopper(compile_for_hopper):
    """The interpreter accepts what the GPU compiler may not: compile both kernels for sm_90
    (Triton's frontend, PTX and ptxas; no GPU needed) in a process without TRITON_INTERPRET,
    and check the PTX has the IEEE divisions and the e4m3 round-to-nearest cast the exactness
    rests on."""
    assert "compiled" in compile_for_hopper(COMPILE_FOR_HOPPER)
