"""RMSNorm (with its residual add) and SiLU-and-mul fused with per-token FP8 quantization of
their output, as Triton kernels, imported lazily.

Under FP8 W8A8 the output of the norm before qkv_proj and gate_up_proj, and of SiLU-and-mul
before down_proj, is read by one FP8 GEMM only, which wants it in e4m3 with one fp32 scale per
token. Unfused, the producer writes the row in the model dtype and the quantizer
(`fp8_quant.per_token_quant`) reads it back; here one program holds a token's whole row in
registers, computes it exactly as the producer's kernel rounds it (model dtype), then its
scale and e4m3 values (`fp8_quant.store_row_quantized`), and writes only those (plus the
residual sum): per bf16 element of output, 1 byte written instead of 2 written and 2 read
again, and one launch less.

SiLU-and-mul runs as persistent programs (16 warps an SM on a GPU), each walking rows first,
first + programs, ..., with Triton's pipeliner copying the next two rows into shared memory
(cp.async) while it computes this one: a row's arithmetic (exp, two divisions and the e4m3
cast: 30 to 40 instructions a value) takes about as long on an SM as its bytes take to
arrive. One program per row loaded, then computed, then stored, with only 2 programs an SM
(registers) to overlap those phases: 286 us for 8192 x 14336 on an H200, about half its copy
bandwidth. (Loads of the next row into registers do not do it: ptxas schedules them after
this row's SiLU, to spare registers.) Rows too wide for two rows' copies in shared memory run
one program per row (`_silu_launch`). A row is held as three power-of-two pieces
(`_row_pieces`) rather than one padded block: 14336 = 8192 + 4096 + 2048 computes no padding,
where a 16384 block computed 12.5% more. And the division by the row's scale takes
div.rn.f32's reciprocal once a row rather than once a value (`_div_rn_by`: about 17% fewer
instructions a row). Same values, same rounding: the scales and bytes do not depend on how a
row is split or walked, and the division gives div.rn's e4m3 bytes (NaN activations aside).

Rows up to `MAX_FUSED_COLUMNS` wide (the producers fall back to the unfused pair above that).
Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from phloem.ops.activation import silu_mul
from phloem.ops.fp8_quant import FP8_MAX, store_row_quantized

# one program holds a row: 32768 columns is 64 values per thread at 16 warps (RMSNorm), 32 at
# 32 warps (SiLU-and-mul)
MAX_FUSED_COLUMNS = 32768
# SiLU-and-mul's persistent programs: warps an SM, and the shared memory their pipelined copies
# may use (two rows' gate and up halves each; an H100's or H200's SM has 227 KB for blocks)
WARPS_PER_SM = 16
PIPELINE_SHARED_BYTES = 200 * 1024
_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, r_out_ptr, y_ptr, k, num_cols,
                           s_x, s_r, s_q, s_ro, s_y, eps, min_scale, HAS_RESIDUAL: tl.constexpr,
                           HAS_Y: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < k
    x = tl.load(x_ptr + row * s_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:  # residual + x, rounded to the model dtype, is the next residual stream
        r = tl.load(r_ptr + row * s_r + cols, mask=ok, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(r_out_ptr + row * s_ro + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    mean_square = tl.math.div_rn(tl.sum(x32 * x32, axis=0), num_cols)
    normed = (x32 * tl.math.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = (w * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)  # RMSNorm's output, as stored
    if HAS_Y:
        tl.store(y_ptr + row * s_y + cols, y, mask=ok)
    store_row_quantized(y.to(tl.float32), ok, q_ptr + row * s_q + cols, s_ptr + row, min_scale)


@triton.jit
def _load_gate_up(x_ptr, row, rows, d, s_x, start, BLOCK: tl.constexpr):
    """Columns [start, start + BLOCK) of row `row`'s gate (x[row, :d]) and up (x[row, d:])
    halves as loaded; zeros past d, and everywhere once row >= rows (the pipeliner's copies
    past the last row)."""
    cols = start + tl.arange(0, BLOCK)
    ok = cols < tl.where(row < rows, d, 0)
    ptrs = x_ptr + row * s_x + cols
    return tl.load(ptrs, mask=ok, other=0.0), tl.load(ptrs + d, mask=ok, other=0.0)


@triton.jit
def _divisor(scale):
    """(b, r) for `_div_rn_by`: the divisor and the reciprocal that `div.rn.f32` computes
    for it on every division (rcp.approx, as `1 / scale` rounds it below 2^126, and one
    Newton step), once per row instead of once per value; (0, 0) for an infinite scale."""
    r = 1.0 / scale
    r = tl.fma(r, tl.fma(-scale, r, 1.0), r)
    infinite = scale == float("inf")
    return tl.where(infinite, 0.0, scale), tl.where(infinite, 0.0, r)


@triton.jit
def _div_rn_by(y, b, r):
    """y / b rounded to nearest even, as `tl.math.div_rn(y, b)` for the row's divisor b
    (`_divisor`; b a scale: >= 2^-80, below 2^120, or infinite) wherever the e4m3 value of
    the quotient depends on it, for any non-NaN y: ptxas's div.rn.f32 is this fast path
    (q0 = y r, q = q0 + r (y - b q0), in two FMAs) plus a slow path for operands whose
    exponents could make it under- or overflow. Here the quotient has |y / b| <= 448, and
    where y or y / b is tiny enough for that (|y| < 2^-100, so |y / b| < 2^-20; or y / b an
    fp32 subnormal) every value casts to an e4m3 zero, whose sign (y's, as the division's)
    is set explicitly. With b = r = 0 (an infinite scale) it gives y * 0, as y / inf. NaN y:
    NaN (the e4m3 NaN, its sign bit not necessarily the division's)."""
    q0 = y * r
    q = tl.fma(r, tl.fma(-b, q0, y), q0)
    return tl.where(q == 0.0, y * 0.0, q)


@triton.jit
def _store_quantized(y, b, r, row, d, q_ptr, y_ptr, s_q, s_y, start, HAS_Y: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    """Store columns [start, start + BLOCK) (those < d) of row `row`: the activation y (model
    dtype) if HAS_Y, and y / scale in e4m3 (`store_row_quantized`'s values; b, r: the scale's
    `_divisor`)."""
    cols = start + tl.arange(0, BLOCK)
    ok = cols < d
    if HAS_Y:
        tl.store(y_ptr + row * s_y + cols, y, mask=ok)
    q = _div_rn_by(y.to(tl.float32), b, r).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * s_q + cols, q, mask=ok)


# rows, the token count, unspecialized: one variant for every count (as the prebuild compiles)
@triton.jit(do_not_specialize=["rows"])
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, y_ptr, rows, d, s_x, s_q, s_y, min_scale,
                               HAS_Y: tl.constexpr, BLOCK0: tl.constexpr, BLOCK1: tl.constexpr,
                               BLOCK2: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    # Rows first, first + step, ...; a row is held in registers as three power-of-two pieces
    # (|-- BLOCK0 --|-- BLOCK1 --|-- BLOCK2 --| >= d, see `_row_pieces`). NUM_STAGES = 3:
    # Triton's pipeliner keeps the copies of the next two rows into shared memory (cp.async)
    # in flight while this row computes; 1: plain loads (one row per program, `_silu_launch`).
    first = tl.program_id(0).to(tl.int64)  # so that row (and row * strides) is 64-bit
    for row in tl.range(first, rows, tl.num_programs(0), num_stages=NUM_STAGES):
        g0, u0 = _load_gate_up(x_ptr, row, rows, d, s_x, 0, BLOCK0)
        g1, u1 = _load_gate_up(x_ptr, row, rows, d, s_x, BLOCK0, BLOCK1)
        g2, u2 = _load_gate_up(x_ptr, row, rows, d, s_x, BLOCK0 + BLOCK1, BLOCK2)
        # phloem/ops/activation.py's expression, rounded once to the model dtype (0 past d)
        y0 = silu_mul(g0, u0).to(x_ptr.dtype.element_ty)
        y1 = silu_mul(g1, u1).to(x_ptr.dtype.element_ty)
        y2 = silu_mul(g2, u2).to(x_ptr.dtype.element_ty)
        amax = tl.maximum(tl.max(tl.abs(y0.to(tl.float32)), axis=0),
                          tl.max(tl.abs(y1.to(tl.float32)), axis=0))  # fmt: skip
        amax = tl.maximum(amax, tl.max(tl.abs(y2.to(tl.float32)), axis=0))
        scale = tl.maximum(tl.math.div_rn(amax, _FP8_MAX), min_scale)  # store_row_quantized's
        tl.store(s_ptr + row, scale)
        b, r = _divisor(scale)
        _store_quantized(y0, b, r, row, d, q_ptr, y_ptr, s_q, s_y, 0, HAS_Y, BLOCK0)
        _store_quantized(y1, b, r, row, d, q_ptr, y_ptr, s_q, s_y, BLOCK0, HAS_Y, BLOCK1)
        _store_quantized(y2, b, r, row, d, q_ptr, y_ptr, s_q, s_y, BLOCK0 + BLOCK1, HAS_Y,
                         BLOCK2)  # fmt: skip


@functools.cache
def _row_pieces(width: int) -> tuple[int, int, int]:
    """Three powers of two b0 >= b1 >= b2 >= 16 whose sum covers `width` columns with the
    fewest padded ones (the larger b0 among equals): a row held as one power-of-two block
    would compute on up to width - 1 padded columns (14336 -> 16384: 12.5% of the work), here
    14336 = 8192 + 4096 + 2048 exactly."""
    sizes = [16 << i for i in range(max(1, triton.next_power_of_2(width) // 16).bit_length())]
    fits = [(b0 + b1 + b2, -b0, (b0, b1, b2)) for b0 in sizes for b1 in sizes if b1 <= b0
            for b2 in sizes if b2 <= b1 and b0 + b1 + b2 >= width]  # fmt: skip
    return min(fits)[2]


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _silu_launch(rows: int, d: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """The launch of SiLU-and-mul over `rows` rows of d columns in `dtype`: `programs`,
    `num_warps` (16 to 32 columns a thread) and NUM_STAGES. When two rows' gate and up halves
    fit `PIPELINE_SHARED_BYTES` (bf16: d <= 25600), persistent programs and a 3-stage pipeline:
    on a GPU, enough programs an SM for `WARPS_PER_SM` warps as far as their copies fit the
    same shared memory (14336 columns: one of 16 warps, which also fills the SM's registers),
    elsewhere two (the interpreter, the prebuild's compile-only launches: each walks several
    rows). Wider rows: one program per row, plain loads. num_warps and NUM_STAGES depend on d
    and dtype only, so the prebuild records the variant a GPU launches."""
    num_warps = max(4, min(32, triton.next_power_of_2(d) // 1024))
    pipelined = 2 * (2 * sum(_row_pieces(d)) * dtype.itemsize)  # shared bytes of a program
    if pipelined > PIPELINE_SHARED_BYTES:
        return {"programs": rows, "num_warps": num_warps, "num_stages": 1}
    launch = {"programs": min(rows, 2), "num_warps": num_warps, "num_stages": 3}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        per_sm = max(1, min(WARPS_PER_SM // num_warps, PIPELINE_SHARED_BYTES // pipelined))
        launch["programs"] = min(rows, _sm_count(index) * per_sm)
    return launch


def _check_width(width: int, what: str) -> None:
    if width > MAX_FUSED_COLUMNS:
        raise ValueError(f"{what}: rows of {width} columns, at most {MAX_FUSED_COLUMNS}")


def _check_2d(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{what} needs a 2-D x with a contiguous last dim, got {tuple(x.shape)}")


def _launch(width: int) -> dict[str, int]:
    block = triton.next_power_of_2(width)
    return {"BLOCK": block, "num_warps": max(4, min(16, block // 512))}


def _outputs(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=device)
    return q, torch.empty(rows, 1, dtype=torch.float32, device=device)


def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    min_scale: float,
    residual: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x (+ residual), quantized per token (Zhang & Sennrich 2019, "Root Mean Square
    Layer Normalization"; per-token FP8 as `fp8_math.quantize_per_token`).

    With s = residual + x (or x), in x's dtype: y = weight * (s * rsqrt(mean(s^2) + eps)) with
    fp32 statistics, rounded to x's dtype after the normalization and after the weight
    (`phloem.layers.norm.RMSNorm`); scale = max(max |y| / 448, min_scale) per row, and
    q = y / scale in e4m3.

    Args:
        x: [T, K] float dtype, last dim contiguous, K <= MAX_FUSED_COLUMNS; weight: [K] in
            x's dtype; eps: added to the mean square; min_scale: the smallest scale;
        residual: [T, K] in x's dtype, last dim contiguous, or None;
        y: None, or a [T, K] tensor in x's dtype that receives the norm's output (tests).
    Returns:
        (q float8_e4m3fn [T, K], scale fp32 [T, 1], residual + x [T, K] or None).
    Raises:
        ValueError: for shapes, dtypes or strides other than these.
    """
    _check_2d(x, "rms_norm_quant")
    rows, k = x.shape
    _check_width(k, "rms_norm_quant")
    if weight.shape != (k,) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm_quant: weight {tuple(weight.shape)} {weight.dtype}, "
                         f"expected ({k},) {x.dtype}")  # fmt: skip
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm_quant: residual {tuple(residual.shape)}, expected {(rows, k)}")
    q, scale = _outputs(rows, k, x.device)
    r_out = torch.empty_like(x) if residual is not None else None
    r_in = residual if residual is not None else x  # not read without a residual
    r_dst = r_out if r_out is not None else x  # not written without a residual
    y_dst = y if y is not None else x  # not written without y
    if rows:
        _rms_norm_quant_kernel[(rows,)](
            x, r_in, weight, q, scale, r_dst, y_dst, k, float(k), x.stride(0), r_in.stride(0),
            q.stride(0), r_dst.stride(0), y_dst.stride(0), eps, min_scale,
            HAS_RESIDUAL=residual is not None, HAS_Y=y is not None, **_launch(k),
        )  # fmt: skip
    return q, scale, r_out


def silu_and_mul_quant(
    x: torch.Tensor, min_scale: float, y: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(x[:, :d]) * x[:, d:] (float32 math, rounded once to x's dtype, as
    `phloem.ops.activation.silu_and_mul`), quantized per token: scale = max(max |y| / 448,
    min_scale) per row, q = y / scale in e4m3.

    Args:
        x: [T, 2d] float dtype, last dim contiguous, d <= MAX_FUSED_COLUMNS;
        min_scale: the smallest scale; y: None, or a [T, d] tensor in x's dtype that receives
            the activation (tests).
    Returns:
        (q float8_e4m3fn [T, d], scale fp32 [T, 1]).
    Raises:
        ValueError: for an odd last dim, shapes or strides other than these, or a min_scale
            below 2^-80.
    """
    _check_2d(x, "silu_and_mul_quant")
    rows, two_d = x.shape
    if two_d % 2:
        raise ValueError(f"silu_and_mul_quant needs an even last dim, got {tuple(x.shape)}")
    _check_width(two_d // 2, "silu_and_mul_quant")
    if not min_scale >= 2.0**-80:  # `_div_rn_by`'s domain
        raise ValueError(f"silu_and_mul_quant: min_scale {min_scale} below 2^-80")
    return _silu_and_mul_quant(x, min_scale, y, **_silu_launch(rows, two_d // 2, x.dtype, x.device))


def _silu_and_mul_quant(
    x: torch.Tensor,
    min_scale: float,
    y: torch.Tensor | None,
    programs: int,
    num_warps: int,
    num_stages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_and_mul_quant` of a checked x on `programs` programs of `num_warps` warps, with
    the kernel's NUM_STAGES = num_stages (the benchmark sweeps them)."""
    rows, d = x.shape[0], x.shape[1] // 2
    q, scale = _outputs(rows, d, x.device)
    y_dst = y if y is not None else x  # not written without y
    if rows:
        b0, b1, b2 = _row_pieces(d)
        _silu_and_mul_quant_kernel[(min(rows, programs),)](
            x, q, scale, y_dst, rows, d, x.stride(0), q.stride(0), y_dst.stride(0), min_scale,
            HAS_Y=y is not None, BLOCK0=b0, BLOCK1=b1, BLOCK2=b2, NUM_STAGES=num_stages,
            num_warps=num_warps,
        )  # fmt: skip
    return q, scale


def compile_variants(hidden_size: int, intermediate_size: int | None, dtype: torch.dtype) -> None:
    """Call the fused quantizers once each on CPU rows of the model's widths, for
    `phloem.worker.triton_prebuild`'s compile-only driver (the launches record the variants the
    engine compiles and run nothing; see `phloem.ops.rope_kv.compile_variants`): the norm
    without a residual (the first layer's input norm) and with one (every other norm), and
    SiLU-and-mul over `intermediate_size` columns (this rank's) unless it is None (a
    down projection that quantizes its own input)."""
    x = torch.zeros(1, hidden_size, dtype=dtype)
    weight = torch.ones(hidden_size, dtype=dtype)
    rms_norm_quant(x, weight, 1e-6, 1.0)
    rms_norm_quant(x, weight, 1e-6, 1.0, torch.zeros_like(x))
    if intermediate_size is not None:
        silu_and_mul_quant(torch.zeros(1, 2 * intermediate_size, dtype=dtype), 1.0)
