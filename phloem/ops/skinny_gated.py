"""y = (silu(gate) * up) W^T (+ b) for decode-sized [gate | up] rows: a gated MLP's SiLU-and-mul
fused into its down projection's skinny GEMM (issues 19 and 24), so the step runs one kernel
where it ran two.

A decode layer's small kernels cost more than their bytes (a launch slot and a gap each: ~13
a layer, 1-3 us apiece on an H200, benchmarks/results/2026-11-26d-h200-serving). Where the down
projection takes `phloem.ops.skinny_gemm`'s kernel, that kernel (its `GATED` variant) reads the
gate_up output [T, 2K] itself and computes silu(gate) * up while it loads each x tile, rounded
to the model dtype with the standalone kernel's expression (`phloem.ops.activation.silu_mul`):
the GEMM multiplies the very values `silu_and_mul` would have written, so for the same config
the output equals the unfused pair's bit for bit. The [T, K] intermediate is never written.

The price: every program along N recomputes the activation of the x columns it reads, for
every row its tile product computes (the rows bucket on the CUDA cores, 16 on the tensor
cores): `silu_per_weight` = those rows / block_n activations per weight element, each an exp
and an IEEE division (2 MUFU ops and ~15 instructions in the sm_90 SASS). An H100 streams ~7
bf16 weight elements per SM clock (an H200 ~10) and issues 16 MUFU ops, so at 1 activation per
weight element (16 rows, block_n 16) the kernel would be bound by that arithmetic, not by HBM;
at <= 1/2 it should stay hidden (benchmarks/results/2026-11-27-cpu-decode-fusion). So by
default (`CONFIGS` silent) a rows bucket fuses only where its config computes <= 1/2
(`MAX_SILU_PER_WEIGHT`); `CONFIGS` holds measured choices (benchmarks/skinny_fusions.py prints
them) and overrides the rule either way.
"""

from __future__ import annotations

import torch

from phloem.ops import skinny_gemm as sk

# (rows bucket, N, K) -> the fused kernel's config, or None: run SiLU-and-mul and the GEMM apart.
# Measured on an H200 by benchmarks/skinny_fusions.py (2026-11-27: Llama-3.1-8B shapes at TP = 1
# and 2; benchmarks/results/2026-11-27-h200x2), each entry the best fused config of its grid
# against the two kernels apart, both timed inside CUDA graphs.
_C = sk.SkinnyConfig  # (block_n, block_k, split_k, num_warps, num_stages, tensor_cores)
CONFIGS: dict[tuple[int, int, int], sk.SkinnyConfig | None] = {
    (1, 4096, 14336): _C(16, 512, 1, 8, 1, None),  # apart 31.5 -> fused 30.1 us
    (2, 4096, 14336): None,  # apart 34.6 us, best fused 36.0 us
    (4, 4096, 14336): _C(64, 128, 4, 8, 4, True),  # apart 38.8 -> fused 36.1 us
    (8, 4096, 14336): _C(64, 128, 4, 8, 4, None),  # apart 39.4 -> fused 36.0 us
    (16, 4096, 14336): _C(64, 128, 4, 8, 4, None),  # apart 40.2 -> fused 35.2 us
    (1, 4096, 7168): _C(16, 512, 1, 8, 1, None),  # apart 18.1 -> fused 16.5 us
    (2, 4096, 7168): None,  # apart 19.6 us, best fused 21.8 us
    (4, 4096, 7168): _C(64, 128, 4, 8, 4, True),  # apart 22.4 -> fused 21.8 us
    (8, 4096, 7168): _C(64, 128, 4, 8, 4, None),  # apart 22.2 -> fused 21.9 us
    (16, 4096, 7168): _C(64, 128, 4, 8, 4, None),  # apart 22.6 -> fused 21.6 us
}
# The most activations per weight element a launch may recompute without a `CONFIGS` entry.
MAX_SILU_PER_WEIGHT = 0.5


def takes(gate_up: torch.Tensor, weight: torch.Tensor, measured_only: bool = False) -> bool:
    """Whether `silu_and_mul_linear(gate_up, weight)` runs here and is meant for this call:
    gate_up [..., 2K] contiguous along its last dim, W [N, K], the rows and shape that
    `skinny_gemm.takes` sends to the kernel (`measured_only` as there), and `fuses` the rows."""
    two_k = gate_up.shape[-1]
    if weight.dim() != 2 or two_k != 2 * weight.shape[1] or gate_up.stride(-1) != 1 or not two_k:
        return False
    rows = gate_up.numel() // two_k
    return fuses(rows, *weight.shape) and sk.takes_rows(gate_up, rows, weight, measured_only)


def fuses(rows: int, n: int, k: int) -> bool:
    """Whether a call of `rows` rows against W [n, k] should fuse: `CONFIGS`' entry where it has
    one (None: no), else whether `config_for`'s config recomputes at most
    `MAX_SILU_PER_WEIGHT` activations per weight element and its tiles fit
    (`skinny_gemm.fused_fits`)."""
    key = (sk.rows_bucket(rows), n, k)
    if key in CONFIGS:
        return CONFIGS[key] is not None
    config = sk.config_for(rows, n, k)
    return sk.fused_fits(config, rows) and silu_per_weight(config, rows) <= MAX_SILU_PER_WEIGHT


def silu_per_weight(config: sk.SkinnyConfig, rows: int) -> float:
    """Activations a fused launch of `rows` rows with `config` computes per weight element it
    reads: the rows its tile product computes (16 on the tensor cores, the rows bucket on the
    CUDA cores: masked rows too) over block_n (the programs along N that each recompute them)."""
    computed = 16 if config.uses_tensor_cores(rows) else sk.rows_bucket(rows)
    return computed / config.block_n


def config_for(rows: int, n: int, k: int) -> sk.SkinnyConfig:
    """The config of a fused launch of `rows` rows against W [n, k]."""
    return CONFIGS.get((sk.rows_bucket(rows), n, k)) or sk.config_for(rows, n, k)


def silu_and_mul_linear(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: sk.SkinnyConfig | None = None,
) -> torch.Tensor:
    """`F.linear(silu_and_mul(gate_up), weight, bias)` for at most `skinny_gemm.MAX_ROWS` rows,
    in one kernel launch (split K: and the memset and cast of `skinny_gemm.launch`).

    Args:
        gate_up: [..., 2K] = [gate | up] (a gated MLP's gate_up output), bf16 or fp16; made
            contiguous along the last dim if it is not.
        weight: [N, K], gate_up's dtype, rows contiguous in K. bias: [N] or None.
        config: the launch configuration; None: `config_for` the shape.
    Returns:
        [..., N] in gate_up's dtype: silu(gate) * up rounded to it, then fp32 accumulation
        rounded once.
    Raises:
        ValueError: more than MAX_ROWS rows, a shape, layout or dtype mismatch, a bad config.
    """
    if weight.dim() != 2 or gate_up.shape[-1] != 2 * weight.shape[1]:
        raise ValueError(
            f"gate_up must be [..., 2K] for weight [N, K], got {tuple(gate_up.shape)} and "
            f"{tuple(weight.shape)}"
        )
    sk.check_inputs(gate_up[..., : weight.shape[1]], weight, bias)
    rows_x = sk.rows_of(gate_up)
    n, k = weight.shape
    out = sk.launch(rows_x, weight, bias, config or config_for(rows_x.shape[0], n, k), True)
    return out.view(*gate_up.shape[:-1], n)


def compile_variants(
    shapes: list[tuple[int, int]], dtype: torch.dtype, measured_only: bool = False
) -> None:
    """For each (N, K) of `shapes` (one rank's linear layers) that follows a gated MLP's
    gate_up ((2K, N) is also in `shapes`: down), call `silu_and_mul_linear` on CPU tensors at
    1, 2, 4, 8 and 16 rows where `takes` would send a decode step here, for the Triton
    prebuild's compile-only driver (see `skinny_gemm.compile_variants`, which calls this). Also
    with PHLOEM_FUSED_SILU_DOWN=0, which leaves these variants unused."""
    for n, k in shapes:
        if (2 * k, n) not in shapes:
            continue
        weight = torch.empty(n, k, dtype=dtype)
        for rows in (1, 2, 4, 8, 16):
            if sk.runs_shape(rows, n, k, measured_only) and fuses(rows, n, k):
                silu_and_mul_linear(torch.empty(rows, 2 * k, dtype=dtype), weight)
