"""y = RMSNorm(x + residual) W^T (+ b) for decode-sized x: the residual add and RMSNorm before a
decoder layer's qkv and gate_up projections fused into their skinny GEMM (issues 19 and 24), so
the step runs one kernel where it ran two (the norm was inductor's add + RMSNorm kernel).

The GEMM's K loop already streams the whole row of x through every program (one split of K),
so each program also adds the residual, sums the squares of the row (h = x + residual, rounded
to the model dtype as the unfused add rounds it) and multiplies h by the norm weight as it
loads each tile; the row's 1 / sqrt(mean(h^2) + eps) scales its sum at the end
(norm(h) W^T = rms^-1 (h * w_norm) W^T). Program 0 along N writes h, the next residual stream
(bit for bit the unfused add's). The GEMM's input is h * w_norm (rounded to the model dtype on
the tensor cores, fp32 on the CUDA cores) where the unfused path rounds h * rms^-1 and then its
product with the weight: the outputs agree to bf16 rounding, not bit for bit.

The price per weight element is small next to SiLU-and-mul's (`phloem.ops.skinny_gated`): per
row computed (the rows bucket on the CUDA cores, 16 on the tensor cores) and program along N,
one more load of the residual (L2) and a few FMAs, no exp or division. `CONFIGS` holds
measured choices (None: keep the norm apart); without an entry a launch fuses where
`skinny_gemm` takes the shape and its config keeps K in one split.
"""

from __future__ import annotations

import torch

from phloem.ops import skinny_gemm as sk

# (rows bucket, N, K) -> the fused kernel's config, or None: run the norm and the GEMM apart.
# Measured on an H200 by benchmarks/skinny_fusions.py (2026-11-27: Llama-3.1-8B shapes at TP = 1
# and 2; benchmarks/results/2026-11-27-h200x2), each entry the best fused config of its grid
# against the two kernels apart, both timed inside CUDA graphs.
_C = sk.SkinnyConfig  # (block_n, block_k, split_k, num_warps, num_stages, tensor_cores)
CONFIGS: dict[tuple[int, int, int], sk.SkinnyConfig | None] = {
    (1, 6144, 4096): _C(8, 256, 1, 4, 1, None),  # apart 17.9 -> fused 15.3 us
    (2, 6144, 4096): None,  # apart 18.4 us, best fused 19.0 us
    (4, 6144, 4096): None,  # apart 20.3 us, best fused 21.4 us
    (8, 6144, 4096): None,  # apart 18.7 us, best fused 21.5 us
    (16, 6144, 4096): None,  # apart 18.9 us, best fused 21.7 us
    (1, 28672, 4096): _C(16, 128, 1, 4, 1, None),  # apart 60.7 -> fused 58.3 us
    (2, 28672, 4096): None,  # apart 59.7 us, best fused 65.0 us
    (4, 28672, 4096): None,  # apart 60.2 us, best fused 64.9 us
    (8, 28672, 4096): None,  # apart 60.1 us, best fused 64.8 us
    (16, 28672, 4096): None,  # apart 60.7 us, best fused 64.8 us
    (1, 3072, 4096): _C(8, 512, 1, 4, 1, None),  # apart 11.6 -> fused 9.3 us
    (2, 3072, 4096): _C(8, 512, 1, 4, 1, None),  # apart 11.8 -> fused 10.8 us
    (4, 3072, 4096): None,  # apart 14.6 us, best fused 20.7 us
    (8, 3072, 4096): None,  # apart 14.6 us, best fused 20.8 us
    (16, 3072, 4096): None,  # apart 14.7 us, best fused 21.1 us
    (1, 14336, 4096): _C(16, 128, 1, 4, 1, None),  # apart 33.2 -> fused 31.3 us
    (2, 14336, 4096): None,  # apart 32.5 us, best fused 33.4 us
    (4, 14336, 4096): None,  # apart 32.7 us, best fused 33.2 us
    (8, 14336, 4096): None,  # apart 32.6 us, best fused 33.0 us
    (16, 14336, 4096): None,  # apart 33.1 us, best fused 33.4 us
}


def takes(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    measured_only: bool = False,
) -> bool:
    """Whether `rms_norm_linear(x, residual, norm_weight, eps, weight)` runs here and is meant for
    this call: x [..., K] (residual None or x's shape and dtype), a norm weight [K] in x's dtype,
    the rows and shape `skinny_gemm.takes` sends to the kernel (`measured_only` as there), and
    `fuses` the rows."""
    k = x.shape[-1]
    if (
        not k
        or weight.dim() != 2
        or weight.shape[1] != k
        or tuple(norm_weight.shape) != (k,)
        or norm_weight.dtype != x.dtype
        or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))
    ):
        return False
    rows = x.numel() // k
    return fuses(rows, *weight.shape) and sk.takes_rows(x, rows, weight, measured_only)


def fuses(rows: int, n: int, k: int) -> bool:
    """Whether a call of `rows` rows against W [n, k] should fuse: `CONFIGS`' entry where it has
    one (None: no), else whether `config_for`'s config keeps K in one split and its tiles fit
    (`skinny_gemm.fused_fits`)."""
    key = (sk.rows_bucket(rows), n, k)
    if key in CONFIGS:
        return CONFIGS[key] is not None
    config = sk.config_for(rows, n, k)
    return config.split_k == 1 and sk.fused_fits(config, rows)


def config_for(rows: int, n: int, k: int) -> sk.SkinnyConfig:
    """The config of a fused launch of `rows` rows against W [n, k]."""
    return CONFIGS.get((sk.rows_bucket(rows), n, k)) or sk.config_for(rows, n, k)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: sk.SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(RMSNorm(h), weight, bias), h) with h = x + residual (rounded to x's dtype) or x
    alone, RMSNorm(h) = norm_weight * h / sqrt(mean(h^2) + eps) (`phloem.layers.norm.RMSNorm`),
    for at most `skinny_gemm.MAX_ROWS` rows, in one kernel launch.

    Args:
        x: [..., K], bf16 or fp16 (made contiguous if it is not); residual: x's shape and
            dtype, or None. norm_weight: [K], x's dtype. eps: added to the mean square.
        weight: [N, K], x's dtype, rows contiguous in K. bias: [N] or None.
        config: the launch configuration (one split of K); None: `config_for` the shape.
    Returns:
        ([..., N] in x's dtype, h [..., K]: a new tensor with a residual, else x itself).
    Raises:
        ValueError: more than MAX_ROWS rows, a shape, layout or dtype mismatch, a config that
            splits K.
    """
    sk.check_inputs(x, weight, bias)
    k = weight.shape[1]
    if tuple(norm_weight.shape) != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight must be [{k}] in {x.dtype}, got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must be x's {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")  # fmt: skip
    rows_x = x.reshape(-1, k).contiguous()
    res = None if residual is None else residual.reshape(-1, k).contiguous()
    res_out = rows_x if res is None else torch.empty_like(rows_x)
    n = weight.shape[0]
    config = config or config_for(rows_x.shape[0], n, k)
    norm = sk.NormArgs(res, norm_weight, float(eps), res_out)
    out = sk.launch(rows_x, weight, bias, config, False, norm)
    return out.view(*x.shape[:-1], n), (x if res is None else res_out.view(x.shape))


def compile_variants(
    shapes: list[tuple[int, int]], down: tuple[int, int], dtype: torch.dtype,
    measured_only: bool = False,
) -> None:  # fmt: skip
    """For the projections of `shapes` (one rank's linear layers, (N, K)) that read a norm's
    output, given `down` = (hidden, intermediate) of the MLP's down projection: qkv (K = hidden,
    N != hidden: not o_proj) with and without a residual (the first layer has none) and gate_up
    (2 * intermediate, hidden) with one, call `rms_norm_linear` on CPU tensors at 1, 2, 4, 8
    and 16 rows where `takes` would send a decode step here, for the Triton prebuild's
    compile-only driver (see `skinny_gemm.compile_variants`, which calls this)."""
    hidden, intermediate = down
    for n, k in shapes:
        if k != hidden or n == hidden:
            continue
        weight, norm_weight = torch.empty(n, k, dtype=dtype), torch.empty(k, dtype=dtype)
        for rows in (1, 2, 4, 8, 16):
            if sk.runs_shape(rows, n, k, measured_only) and fuses(rows, n, k):
                x = torch.empty(rows, k, dtype=dtype)
                for residual in (torch.empty_like(x), None)[: 1 if n == 2 * intermediate else 2]:
                    rms_norm_linear(x, residual, norm_weight, 1e-6, weight)
