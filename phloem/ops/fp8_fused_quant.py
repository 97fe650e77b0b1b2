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

Rows up to `MAX_FUSED_COLUMNS` wide (the producers fall back to the unfused pair above that).
Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phloem.ops.fp8_quant import store_row_quantized

# one program holds a row: 32768 columns is 64 fp32 values per thread at 16 warps
MAX_FUSED_COLUMNS = 32768


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
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, y_ptr, d, s_x, s_q, s_y, min_scale,
                               HAS_Y: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + row * s_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + d + cols, mask=ok, other=0.0).to(tl.float32)
    # the expression of phloem/ops/activation.py's kernel: the same values, rounded once
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
    if HAS_Y:
        tl.store(y_ptr + row * s_y + cols, y, mask=ok)
    store_row_quantized(y.to(tl.float32), ok, q_ptr + row * s_q + cols, s_ptr + row, min_scale)


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
        ValueError: for an odd last dim, or shapes or strides other than these.
    """
    _check_2d(x, "silu_and_mul_quant")
    rows, two_d = x.shape
    if two_d % 2:
        raise ValueError(f"silu_and_mul_quant needs an even last dim, got {tuple(x.shape)}")
    d = two_d // 2
    _check_width(d, "silu_and_mul_quant")
    q, scale = _outputs(rows, d, x.device)
    y_dst = y if y is not None else x  # not written without y
    if rows:
        _silu_and_mul_quant_kernel[(rows,)](
            x, q, scale, y_dst, d, x.stride(0), q.stride(0), y_dst.stride(0), min_scale,
            HAS_Y=y is not None, **_launch(d),
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
