"""The tile helpers of the skinny-GEMM kernels (`phloem.ops.skinny_gemm`): loading a tile of W,
a row or tile of x with what a fused variant computes on it as it loads (SiLU-and-mul of
[gate | up]; residual add + RMSNorm), and storing a finished row. Triton jit functions, inlined
into the kernels that call them.

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

from phloem.ops.activation import silu_mul


@triton.jit
def w_tile(w_ptrs, n_ok, k_ok, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile of W at `w_ptrs` (zeros outside N and the K range)."""
    if EVEN_K:
        return tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
    return tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def row_times_w(x_ptr, m, M, K, offs_k, k_ok, w, rn, s_xm, GATED: tl.constexpr):
    """Row m of x over `offs_k` (zeros past M rows or outside the K range), broadcast over the
    tile's rows, times the fp32 tile w: fp32 [BLOCK_N, BLOCK_K]. The pointers repeat along the
    rows, so x is loaded in w's own layout (no shared-memory layout conversion and barrier in
    the loop; the repeated addresses hit L1). GATED: x's row is [gate | up] (2K wide) and the
    product takes silu(gate) * up rounded to x's dtype, computed once per column (a vector in
    the slice of w's layout, then broadcast: not once per tile row)."""
    if GATED:
        row = x_ptr + m * s_xm + offs_k
        ok = k_ok & ((offs_k * 0 + m) < M)
        gate = tl.load(row, mask=ok, other=0.0)
        h = silu_mul(gate, tl.load(row + K, mask=ok, other=0.0)).to(gate.dtype)
        return w * h.to(tl.float32)[None, :]
    ptrs = x_ptr + m * s_xm + offs_k[None, :] + rn[:, None] * 0
    ok = k_ok[None, :] & ((rn[:, None] * 0 + m) < M)
    return w * tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def norm_row(x_ptr, r_ptr, ro_ptr, m, M, K, offs_k, k_ok, nw, pid_n, HAS_RES: tl.constexpr):
    """(h * nw, h * h), fp32 [BLOCK_K] each, over `offs_k` of row m (zeros past M rows or
    outside the K range): h = x + residual rounded to x's dtype (x alone without HAS_RES; x,
    residual and the new residual contiguous [M, K]), which program 0 along N stores as the new
    residual; nw: the norm weight over `offs_k`, fp32."""
    ok = k_ok & ((offs_k * 0 + m) < M)
    h = tl.load(x_ptr + m * K + offs_k, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + m * K + offs_k, mask=ok, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        tl.store(ro_ptr + m * K + offs_k, h, mask=ok & ((offs_k * 0 + pid_n) == 0))
    hf = h.to(tl.float32)
    return hf * nw, hf * hf


@triton.jit
def norm_tile(x, r_ptr, ro_ptr, nw_ptr, rm, cols, K, k_ok, ok, pid_n, HAS_RES: tl.constexpr):
    """(h * nw rounded to x's dtype, the sum of h * h over the columns: fp32 [16]) for the x tile
    [16, BLOCK_K] of rows `rm` and columns `cols` loaded under `ok`: h = x + residual rounded to
    x's dtype (x alone without HAS_RES; residual and new residual contiguous [M, K]), stored as
    the new residual by program 0 along N; nw: the norm weight over `cols`."""
    if HAS_RES:
        offs = rm[:, None] * K + cols[None, :]
        r = tl.load(r_ptr + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ro_ptr + offs, x, mask=ok & ((cols[None, :] * 0 + pid_n) == 0))
    h = x.to(tl.float32)
    nw = tl.load(nw_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
    return (h * nw[None, :]).to(x.dtype), tl.sum(h * h, axis=1)


@triton.jit
def finish_row(out_ptr, m, M, rn, n_ok, acc, scale, bias, s_om, SPLIT: tl.constexpr):
    """out[m, rn] = scale * the sum over K of acc [BLOCK_N, BLOCK_K] + bias (rounded to out's
    dtype), or added atomically (fp32) when SPLIT."""
    ok = n_ok & ((rn * 0 + m) < M)
    y = tl.sum(acc, axis=1) * scale + bias
    if SPLIT:
        tl.atomic_add(out_ptr + m * s_om + rn, y, mask=ok, sem="relaxed")
    else:
        tl.store(out_ptr + m * s_om + rn, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def norm_step(
    a, q, m, x_ptr, r_ptr, ro_ptr, nw_ptr, M, K, offs_k, k_ok, w, pid_n, HAS_RES: tl.constexpr
):  # fmt: skip
    """One K step of row m on the CUDA cores under NORM: (a + w times h * the norm weight,
    q + h * h), a the row's fp32 accumulator [BLOCK_N, BLOCK_K] and q its fp32 sums of squares
    [BLOCK_K] (h as in `norm_row`; the row's 1 / rms scales its sum at the end: `rms_scale`)."""
    nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    v, sq = norm_row(x_ptr, r_ptr, ro_ptr, m, M, K, offs_k, k_ok, nw, pid_n, HAS_RES)
    return a + w * v[None, :], q + sq


@triton.jit
def rms_scale(q, K, eps, NORM: tl.constexpr):
    """1 / sqrt(mean square + eps) of a row from its sums of squares q (fp32 [BLOCK_K]) under
    NORM, else 1."""
    if NORM:
        return tl.rsqrt(tl.sum(q) / K + eps)
    return 1.0
