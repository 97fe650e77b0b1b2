"""y = x W^T (+ b) for decode-sized x (1..16 rows) in one Triton kernel launch that streams W once.

At batch 1..16 a linear layer's GEMM is a matrix-vector product bound by reading the weight: an
8B model's decode step reads 15 GB of weights through four GEMMs a layer. cuBLAS, as torch's
`F.linear` picks it, reads the small Llama-3.1-8B matrices well below the copy ceiling (qkv and
o_proj at 2.6-3.2 TB/s of ~4.2 on an H200) and adds a split-K reduce kernel to o_proj and down
(benchmarks/results/2026-11-26d-h200-checks/README.md). This kernel gives each program
`block_n` whole rows of W (contiguous in K, so every load is a long coalesced run) and loops over
K in `block_k` steps; the grid is sized so enough loads are in flight to cover HBM latency.

The product of a tile: with at most 4 rows of x, on the CUDA cores (`_skinny_fma_kernel`: each
W tile times each row of x into fp32 accumulators of the tile's shape, summed over K once at the
end, the next tile's loads issued before this tile's FMAs; each weight element costs <= 4 FMAs,
far below the bandwidth); with 5..16 rows (or by choice at fewer), `tl.dot` with x padded to 16
rows (`_skinny_dot_kernel`: tensor cores, fp32 accumulation, W's loads staged through shared
memory by Triton's pipeliner, `num_stages` deep). `split_k` > 1 also splits K over programs,
each adding its fp32 partial sums into a zeroed fp32 buffer (`tl.atomic_add`), which is then
rounded to the output dtype: two more kernels (a memset and a cast), for shapes with too few
rows of W to fill the GPU. Both kernels' `GATED` variant reads [gate | up] rows of twice K and
multiplies silu(gate) * up instead of x (`phloem.ops.skinny_gated`: SiLU-and-mul fused into the
down projection); their `NORM` variant adds the residual to x and applies RMSNorm
(`phloem.ops.skinny_norm`: the norm fused into the qkv and gate_up projections). The tile
helpers they share are `phloem.ops.skinny_tiles`'.

Accumulation is fp32 and the output is rounded once, so results equal `F.linear`'s to bf16
rounding (not bit for bit: the summation order differs). Which config each shape gets is
`config_for`: the table `CONFIGS` measured by benchmarks/skinny_gemm.py, else a rule of thumb;
a shape the table gives None stays with cuBLAS (`takes` says no).
Every launch allocates only its output (and, split, an fp32 buffer of fixed size) and never
syncs, so it is captured by CUDA graphs.

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from phloem.ops.activation import silu_mul
from phloem.ops.skinny_tiles import (
    finish_row,
    norm_step,
    norm_tile,
    rms_scale,
    row_times_w,
    w_tile,
)

MAX_ROWS = 16  # the most rows of x this kernel takes (a decode step's batch)
DOT_MIN_ROWS = 5  # from this many rows on, the tile product runs on the tensor cores
FMA_MAX_ROWS = 4  # the most rows the CUDA-core product takes
DTYPES = (torch.bfloat16, torch.float16)  # 2-byte weights (fp32 would need tl.dot's IEEE mode)
# Whether kernels run on the CPU here (Triton's interpreter, read when Triton is imported).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration.

    Attributes:
        block_n: rows of W (output features) per program; >= 16 on the tensor cores.
        block_k: input features per loop step; a power of two >= 16.
        split_k: programs sharing one block of rows, each over a contiguous K range (1: none).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the tensor-core kernel's K loop (the CUDA-core
            kernel prefetches one tile ahead itself and ignores it).
        tensor_cores: the tile product by `tl.dot` with x padded to 16 rows (True), on the
            CUDA cores (False: at most FMA_MAX_ROWS rows), or None: tensor cores from
            DOT_MIN_ROWS rows on.
    """

    block_n: int = 8
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    tensor_cores: bool | None = None

    def uses_tensor_cores(self, rows: int) -> bool:
        """Whether a launch of `rows` rows takes the `tl.dot` tile product."""
        return rows >= DOT_MIN_ROWS if self.tensor_cores is None else self.tensor_cores

    def validate(self, rows: int) -> None:
        """Raises ValueError naming the field whose value a launch of `rows` rows cannot use."""
        for name in ("block_n", "block_k", "split_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SkinnyConfig.{name} must be a power of two >= 1, got {value}")
        if self.block_k < 16:
            raise ValueError(f"SkinnyConfig.block_k must be >= 16, got {self.block_k}")
        if self.uses_tensor_cores(rows) and self.block_n < 16:
            raise ValueError(
                f"SkinnyConfig.block_n must be >= 16 for {rows} rows on the tensor cores "
                f"(tl.dot), got {self.block_n}"
            )
        if not self.uses_tensor_cores(rows) and rows > FMA_MAX_ROWS:
            raise ValueError(
                f"SkinnyConfig.tensor_cores=False takes at most {FMA_MAX_ROWS} rows, got {rows}"
            )
        if self.num_stages < 1:
            raise ValueError(f"SkinnyConfig.num_stages must be >= 1, got {self.num_stages}")


# Measured choices: (rows bucket, N, K) -> config, or None where cuBLAS was faster; rows bucket =
# the smallest of 1, 2, 4, 8, 16 that holds the rows. benchmarks/skinny_gemm.py's table on an
# H100 80GB HBM3 (2026-11-26, benchmarks/results/2026-11-26f-h100/): Llama-3.1-8B's qkv, o,
# gate_up and down at TP = 1 and 2, the best config against F.linear's time. By default
# (PHLOEM_SKINNY_GEMM unset) only these shapes run here; PHLOEM_SKINNY_GEMM=1 gives the others
# `default_config`.
_C = SkinnyConfig  # (block_n, block_k, split_k, num_warps, num_stages, tensor_cores)
# fmt: off
CONFIGS: dict[tuple[int, int, int], SkinnyConfig | None] = {  # F.linear -> kernel time
    (1, 6144, 4096): _C(8, 512, 1, 4, 3, None),  # 20.8 -> 19.9 us
    (2, 6144, 4096): _C(32, 128, 1, 4, 4, True),  # 20.8 -> 20.3 us
    (4, 6144, 4096): _C(16, 128, 1, 4, 4, True),  # 20.8 -> 20.4 us
    (8, 6144, 4096): _C(32, 128, 1, 4, 4, None),  # 21.0 -> 20.4 us
    (16, 6144, 4096): _C(32, 128, 1, 4, 4, None),  # 21.3 -> 20.6 us
    (1, 4096, 4096): _C(4, 512, 1, 4, 1, None),  # 16.4 -> 13.6 us
    (2, 4096, 4096): _C(8, 512, 1, 4, 3, None),  # 16.2 -> 14.3 us
    (4, 4096, 4096): _C(16, 256, 1, 4, 4, True),  # 16.3 -> 14.6 us
    (8, 4096, 4096): _C(16, 256, 1, 4, 4, None),  # 16.4 -> 14.7 us
    (16, 4096, 4096): _C(16, 256, 1, 4, 4, None),  # 16.7 -> 14.9 us
    (1, 28672, 4096): _C(4, 512, 1, 4, 1, None),  # 82.3 -> 78.4 us
    (2, 28672, 4096): _C(64, 128, 1, 8, 4, True),  # 82.4 -> 81.4 us
    (4, 28672, 4096): _C(64, 128, 1, 8, 4, True),  # 82.6 -> 81.8 us
    (8, 28672, 4096): _C(64, 128, 1, 8, 4, None),  # 83.0 -> 82.3 us
    (16, 28672, 4096): _C(64, 128, 1, 8, 4, None),  # 83.6 -> 83.3 us
    (1, 4096, 14336): _C(4, 1024, 1, 4, 1, None),  # 44.4 -> 41.3 us
    (2, 4096, 14336): _C(4, 1024, 1, 4, 1, None),  # 44.3 -> 43.4 us
    (4, 4096, 14336): _C(32, 512, 1, 8, 4, True),  # 44.3 -> 43.7 us
    (8, 4096, 14336): _C(16, 256, 1, 4, 4, None),  # 44.7 -> 43.8 us
    (16, 4096, 14336): _C(16, 256, 1, 4, 4, None),  # 45.3 -> 43.9 us
    (1, 3072, 4096): _C(4, 1024, 1, 4, 1, None),  # 14.1 -> 11.0 us
    (2, 3072, 4096): _C(4, 512, 1, 4, 1, None),  # 14.1 -> 11.3 us
    (4, 3072, 4096): _C(32, 256, 1, 8, 4, True),  # 14.2 -> 12.7 us
    (8, 3072, 4096): _C(32, 256, 1, 8, 4, None),  # 14.3 -> 12.7 us
    (16, 3072, 4096): _C(32, 256, 1, 8, 4, None),  # 14.6 -> 12.8 us
    (1, 4096, 2048): _C(4, 512, 1, 4, 1, None),  # 8.6 -> 7.8 us
    (2, 4096, 2048): _C(16, 512, 1, 8, 1, None),  # 8.6 -> 8.5 us
    (4, 4096, 2048): None,  # F.linear 8.5 us, kernel 8.7 us
    (8, 4096, 2048): None,  # F.linear 8.6 us, kernel 8.8 us
    (16, 4096, 2048): None,  # F.linear 8.7 us, kernel 8.8 us
    (1, 14336, 4096): _C(4, 512, 1, 4, 1, None),  # 42.2 -> 41.1 us
    (2, 14336, 4096): None,  # F.linear 42.2 us, kernel 42.8 us
    (4, 14336, 4096): None,  # F.linear 42.3 us, kernel 43.4 us
    (8, 14336, 4096): None,  # F.linear 43.6 us, kernel 43.6 us
    (16, 14336, 4096): None,  # F.linear 42.9 us, kernel 43.9 us
    (1, 4096, 7168): _C(4, 512, 1, 4, 1, None),  # 25.2 -> 22.1 us
    (2, 4096, 7168): _C(8, 512, 1, 4, 1, None),  # 24.9 -> 23.2 us
    (4, 4096, 7168): _C(16, 256, 1, 4, 4, True),  # 25.1 -> 23.4 us
    (8, 4096, 7168): _C(16, 256, 1, 4, 4, None),  # 25.1 -> 23.5 us
    (16, 4096, 7168): _C(16, 256, 1, 4, 4, None),  # 25.6 -> 23.7 us
}
# fmt: on


def load_configs(path: str) -> int:
    """Add the table benchmarks/skinny_gemm.py wrote (`--configs-out`: a JSON list of {"rows",
    "n", "k", "config": SkinnyConfig fields or null}) to `CONFIGS` (mutates it); returns the
    number of entries. For trying measured configs before they are pasted into `CONFIGS`.

    Raises:
        ValueError: naming `path`, for an entry that is not of that form.
    """
    import json

    with open(path) as f:
        entries = json.load(f)
    for entry in entries:
        try:
            key = (int(entry["rows"]), int(entry["n"]), int(entry["k"]))
            fields = entry["config"]
            config = None if fields is None else SkinnyConfig(**fields)
            if config is not None:
                config.validate(key[0])
            CONFIGS[key] = config
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: bad skinny-GEMM config entry {entry!r}: {e}") from None
    return len(entries)


def rows_bucket(rows: int) -> int:
    """The smallest power of two >= rows (1, 2, 4, 8 or 16 for 1..16 rows)."""
    return 1 << max(0, rows - 1).bit_length()


def default_config(rows: int, n: int, k: int) -> SkinnyConfig:
    """The rule of thumb for shapes `CONFIGS` lacks (no measurement behind it yet): about 4
    programs per SM of an H100/H200 (132 SMs) from rows of W alone where N allows it (block_n 8
    on the CUDA cores, 16 on the tensor cores), else K split in two or four."""
    block_n = 16 if rows >= DOT_MIN_ROWS else 8
    block_k = 512 if rows <= 2 else 256  # CUDA cores: <= 64 accumulator registers a thread
    split_k = 1
    while triton.cdiv(n, block_n) * split_k < 512 and k >= 4 * block_k * split_k and split_k < 4:
        split_k *= 2
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k)


def fused_fits(config: SkinnyConfig, rows: int) -> bool:
    """Whether a fused launch's tensor-core tiles ((num_stages - 1) x (W's + two x-sized), sm_90's
    shared memory) stay within 200 KB of an H100/H200's 227 (CUDA cores: no staging)."""
    if not config.uses_tensor_cores(rows):
        return True
    return (config.num_stages - 1) * 2 * config.block_k * (config.block_n + 33) <= 200 * 1024


def config_for(rows: int, n: int, k: int) -> SkinnyConfig:
    """The config of a launch of `rows` rows of x [rows, k] against W [n, k]."""
    return CONFIGS.get((rows_bucket(rows), n, k)) or default_config(rows, n, k)


@triton.jit
def _skinny_fma_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, r_ptr, nw_ptr, ro_ptr, M, N, K, K_PER_SPLIT, s_xm, s_wn, s_om,
    eps, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """The CUDA-core product for ROWS (1, 2 or 4) >= M rows: program (n, s) computes
    out[:, n-block] (+)= x[:, K range s] W[n-block, K range s]^T. Each row of x has an fp32
    accumulator of W's tile shape, updated elementwise (FMAs only in the loop: no shuffles, no
    barriers) and summed over K once at the end. K range s, EVEN_K, SPLIT, GATED, NORM and
    HAS_RES as in `_skinny_dot_kernel`."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * s_wn + (k_start + rk)[None, :]
    a0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    q0 = tl.zeros((BLOCK_K,), dtype=tl.float32)  # NORM: each row's sums of squares
    q1, q2, q3 = q0, q0, q0
    w_next = w_tile(w_ptrs, n_ok, (k_start + rk) < k_end, EVEN_K)
    for k in range(k_start, k_end, BLOCK_K):
        # Prefetch: the next tile's loads are issued before this tile's FMAs, so two tiles are
        # in flight per program (the last step reloads its own tile: no mask, no HBM traffic).
        w = w_next.to(tl.float32)
        step = BLOCK_K * (k + BLOCK_K < k_end).to(tl.int32)
        w_ptrs += step
        w_next = w_tile(w_ptrs, n_ok, (k + step + rk) < k_end, EVEN_K)
        offs_k = k + rk
        k_ok = offs_k < k_end
        if NORM:  # each row's h * w_norm, and its squares
            rest = (x_ptr, r_ptr, ro_ptr, nw_ptr, M, K, offs_k, k_ok, w, pid_n, HAS_RES)
            a0, q0 = norm_step(a0, q0, 0, *rest)
            if ROWS > 1:
                a1, q1 = norm_step(a1, q1, 1, *rest)
            if ROWS > 2:
                a2, q2 = norm_step(a2, q2, 2, *rest)
                a3, q3 = norm_step(a3, q3, 3, *rest)
        else:
            a0 += row_times_w(x_ptr, 0, M, K, offs_k, k_ok, w, rn, s_xm, GATED)
            if ROWS > 1:
                a1 += row_times_w(x_ptr, 1, M, K, offs_k, k_ok, w, rn, s_xm, GATED)
            if ROWS > 2:
                a2 += row_times_w(x_ptr, 2, M, K, offs_k, k_ok, w, rn, s_xm, GATED)
                a3 += row_times_w(x_ptr, 3, M, K, offs_k, k_ok, w, rn, s_xm, GATED)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        first = (rn * 0 + pid_s) == 0  # the bias is added by split 0 only
        bias = tl.load(b_ptr + rn, mask=n_ok & first, other=0.0).to(tl.float32)
    finish_row(out_ptr, 0, M, rn, n_ok, a0, rms_scale(q0, K, eps, NORM), bias, s_om, SPLIT)
    if ROWS > 1:
        finish_row(out_ptr, 1, M, rn, n_ok, a1, rms_scale(q1, K, eps, NORM), bias, s_om, SPLIT)
    if ROWS > 2:
        finish_row(out_ptr, 2, M, rn, n_ok, a2, rms_scale(q2, K, eps, NORM), bias, s_om, SPLIT)
        finish_row(out_ptr, 3, M, rn, n_ok, a3, rms_scale(q3, K, eps, NORM), bias, s_om, SPLIT)


@triton.jit
def _skinny_dot_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, r_ptr, nw_ptr, ro_ptr, M, N, K, K_PER_SPLIT, s_xm, s_wn, s_om,
    eps, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
    HAS_RES: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The tensor-core product, x padded to 16 rows: program (n, s) computes
    out[:, n-block] (+)= x[:, K range s] W[n-block, K range s]^T with `tl.dot` (fp32).

    K range s = [s * K_PER_SPLIT, min(K, (s + 1) * K_PER_SPLIT)), K_PER_SPLIT a multiple of
    BLOCK_K. EVEN_K: K is a multiple of BLOCK_K (no K mask). SPLIT: out is fp32 and zeroed, and
    every program adds its partial sums atomically (the bias once, by split 0). GATED: x is
    [M, 2K] = [gate | up]; the product takes silu(gate) * up rounded to x's dtype. NORM (one
    split, x contiguous): the product takes h * the norm weight (nw_ptr), h = x + the residual
    (r_ptr, HAS_RES) rounded to x's dtype, and each row's sum is scaled by 1 / sqrt(mean(h^2)
    + eps); program 0 along N writes h to ro_ptr. INTERPRET: Triton's interpreter, whose bf16
    `tl.dot` returns garbage (Triton 3.9), multiplies the same values in fp32 (IEEE)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = tl.arange(0, 16)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * s_wn + (k_start + rk)[None, :]
    x_ptrs = x_ptr + rm[:, None] * s_xm + (k_start + rk)[None, :]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    ss = tl.zeros((16,), dtype=tl.float32)  # NORM: each row's sum of squares
    for k in range(k_start, k_end, BLOCK_K):
        k_ok = (k + rk) < k_end
        w = w_tile(w_ptrs, n_ok, k_ok, EVEN_K)
        if EVEN_K:
            x_ok = m_ok[:, None]
        else:
            x_ok = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        if GATED:
            x = silu_mul(x, tl.load(x_ptrs + K, mask=x_ok, other=0.0)).to(x.dtype)
        if NORM:
            x, sq = norm_tile(x, r_ptr, ro_ptr, nw_ptr, rm, k + rk, K, k_ok, x_ok, pid_n, HAS_RES)
            ss += sq
        if INTERPRET:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(w, tl.trans(x), out_dtype=tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if NORM:
        acc = acc * tl.rsqrt(ss / K + eps)[None, :]
    if HAS_BIAS:
        first = (rn * 0 + pid_s) == 0  # the bias is added by split 0 only
        acc += tl.load(b_ptr + rn, mask=n_ok & first, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rm[None, :] * s_om + rn[:, None]  # acc is out^T: [BLOCK_N, 16]
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        tl.atomic_add(out_ptrs, acc, mask=ok, sem="relaxed")
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def takes(x: torch.Tensor, weight: torch.Tensor, measured_only: bool = False) -> bool:
    """Whether `skinny_linear(x, weight)` runs here and is meant for this call: 1..MAX_ROWS rows
    of x, both in one dtype of `DTYPES`, W's rows contiguous, on CUDA (or on the CPU under
    Triton's interpreter, for tests), and a shape `CONFIGS` does not leave to cuBLAS; with
    `measured_only`, a shape `CONFIGS` gives a config (measured faster than cuBLAS)."""
    k = x.shape[-1]
    return k > 0 and takes_rows(x, x.numel() // k, weight, measured_only)


def takes_rows(x: torch.Tensor, rows: int, weight: torch.Tensor, measured_only: bool) -> bool:
    """`takes` for `rows` rows of W's K input features held in x (read for its dtype and
    device only: also the [gate | up] rows of `phloem.ops.skinny_gated`)."""
    return (
        weight.dim() == 2
        and runs_shape(rows, weight.shape[0], weight.shape[1], measured_only)
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and weight.stride(1) == 1
        and (x.is_cuda or INTERPRETED)
    )


def runs_shape(rows: int, n: int, k: int, measured_only: bool) -> bool:
    """Whether `CONFIGS` sends a call of `rows` rows against W [n, k] to the kernel: 1..MAX_ROWS
    rows, not measured slower than cuBLAS, and, `measured_only`, measured faster."""
    key = (rows_bucket(rows), n, k)
    return 0 < rows <= MAX_ROWS and (CONFIGS.get(key) is not None or not (
        measured_only or key in CONFIGS))  # fmt: skip


def check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raises ValueError for inputs `skinny_linear` does not take."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, K] with K contiguous, got {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} input features, weight {weight.shape[1]}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype of {DTYPES}, got {x.dtype}, "
                         f"{weight.dtype}")  # fmt: skip
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for at most `MAX_ROWS` rows of x, in one pass over weight.

    Args:
        x: [..., K] with at most MAX_ROWS rows in all (product of the leading dims), bf16 or
            fp16; the last dim is made contiguous if it is not.
        weight: [N, K], x's dtype, rows contiguous in K. bias: [N] or None.
        config: the launch configuration; None: `config_for` the shape.
    Returns:
        [..., N] in x's dtype (fp32 accumulation, rounded once).
    Raises:
        ValueError: more than MAX_ROWS rows, a shape, layout or dtype mismatch, a bad config.
    """
    check_inputs(x, weight, bias)
    out = launch(rows_of(x), weight, bias, config, gated=False)
    return out.view(*x.shape[:-1], weight.shape[0])


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x [..., W] as [rows, W] with unit stride along a row (a copy only where it has not)."""
    rows_x = x.reshape(-1, x.shape[-1])
    return rows_x if rows_x.stride(-1) == 1 else rows_x.contiguous()


class NormArgs(NamedTuple):
    """The residual add + RMSNorm a launch computes on x before the product (`NORM` in
    `_skinny_dot_kernel`; `phloem.ops.skinny_norm`)."""

    residual: torch.Tensor | None  # [rows, K] contiguous, added to x; None: x alone
    weight: torch.Tensor  # the norm weight [K], x's dtype
    eps: float  # added to the mean square
    residual_out: torch.Tensor  # [rows, K] contiguous: receives x + residual (with a residual)


def launch(
    rows_x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig | None,
    gated: bool,
    norm: NormArgs | None = None,
) -> torch.Tensor:
    """One kernel launch (split: and a memset and a cast): out [rows, N] = x W^T + b, x =
    rows_x [rows, K] or, `gated`, silu(gate) * up of rows_x [rows, 2K] = [gate | up], or, with
    `norm`, RMSNorm(rows_x + residual) (rows_x contiguous); the arguments checked by the caller
    (`check_inputs`).

    Raises:
        ValueError: more than MAX_ROWS rows, a config the rows cannot use (or, with `norm`,
            that splits K).
    """
    n, k = weight.shape
    rows = rows_x.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"the skinny GEMM takes at most {MAX_ROWS} rows of x, got {rows}")
    config = config or config_for(rows, n, k)
    config.validate(rows)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    splits = triton.cdiv(k, k_per_split)
    split = splits > 1
    if norm is not None and split:
        raise ValueError(f"a launch with RMSNorm takes one split of K, {config} gives {splits}")
    out_dtype = torch.float32 if split else rows_x.dtype
    make = torch.zeros if split else torch.empty
    out = make(rows, n, dtype=out_dtype, device=rows_x.device)
    if rows and n:
        grid = (triton.cdiv(n, config.block_n), splits)
        has_res = norm is not None and norm.residual is not None
        r, nw, ro = (weight, weight, weight)  # unread without `norm` (no residual: r unread)
        if norm is not None:
            r, nw, ro = norm.residual if has_res else weight, norm.weight, norm.residual_out
        args = (rows_x, weight, bias if bias is not None else weight, out, r, nw, ro, rows, n, k,
                k_per_split, rows_x.stride(0), weight.stride(0), out.stride(0),
                norm.eps if norm is not None else 0.0)  # fmt: skip
        consts = dict(HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                      EVEN_K=k % config.block_k == 0, SPLIT=split, GATED=gated,
                      NORM=norm is not None, HAS_RES=has_res, num_warps=config.num_warps,
                      num_stages=config.num_stages)  # fmt: skip
        if config.uses_tensor_cores(rows):
            _skinny_dot_kernel[grid](*args, INTERPRET=INTERPRETED, **consts)
        else:
            _skinny_fma_kernel[grid](*args, ROWS=rows_bucket(rows), **consts)
    return out.to(rows_x.dtype) if split else out


def compile_variants(
    shapes: list[tuple[int, int]], dtype: torch.dtype, measured_only: bool = False
) -> None:
    """Call `skinny_linear` on CPU tensors for each (N, K) of `shapes` (one rank's linear layers)
    at 1, 2, 4, 8 and 16 rows, for `phloem.worker.triton_prebuild`'s compile-only driver: the
    launches record every variant a decode step of 1..16 rows compiles (Triton specializes M
    only on equalling 1 or being divisible by 16; the rows bucket picks the constexprs) and run
    nothing; `measured_only`: only the launches `takes(..., measured_only=True)` sends here.
    Then the fused launches: `skinny_gated.compile_variants` (down projections) and, for a
    down projection (N, K) whose gate_up (2K, N) is in `shapes`, `skinny_norm.compile_variants`
    (the projections after a norm). Under a real driver it would launch on CPU memory: call it
    only there. W is allocated, never written (`torch.empty`)."""
    from phloem.ops import skinny_gated, skinny_norm  # they import this module

    for n, k in shapes:
        weight = torch.empty(n, k, dtype=dtype)
        for rows in (1, 2, 4, 8, 16):
            if runs_shape(rows, n, k, measured_only):
                skinny_linear(torch.empty(rows, k, dtype=dtype), weight)
    skinny_gated.compile_variants(shapes, dtype, measured_only)
    for down in {(n, k) for n, k in shapes if (2 * k, n) in shapes}:
        skinny_norm.compile_variants(shapes, down, dtype, measured_only)
