"""SiLU-and-mul as one Triton kernel (the gated MLP's elementwise step), imported lazily.

`silu(gate) * up` over x = [gate | up] reads 2 * T * d and writes T * d elements: pure bandwidth,
so the kernel's only job is to move those bytes at HBM bandwidth, which torch.compile's generated
kernel for this step does not reach. This kernel tiles each row into contiguous column blocks (2D
grid), so every load and store is a coalesced, vectorized run. The arithmetic runs in float32 and
rounds once to the output dtype. The two kernels' times: the kernel table of
benchmarks/results/2026-11-23-h200-b/README.md.

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in float32 (gate, up: tensors of one shape, any float dtype): the one
    expression of SiLU-and-mul in phloem's kernels, so that a kernel that fuses it into its
    loads (`phloem.ops.skinny_gated`) rounds the same values as this module's kernel."""
    g = gate.to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, s_x, s_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + row * s_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * s_x + d + cols, mask=ok, other=0.0)
    y = silu_mul(gate, up)
    tl.store(out_ptr + row * s_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x of shape [..., 2d] (float dtypes; last dim contiguous).

    Returns:
        [..., d] in x.dtype.
    Raises:
        ValueError: if the last dimension is odd or not contiguous.
    """
    two_d = x.shape[-1]
    if two_d % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul needs an even, contiguous last dim; got {tuple(x.shape)}")
    d = two_d // 2
    rows = x.reshape(-1, two_d)
    out = torch.empty(rows.shape[0], d, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](rows, out, d, rows.stride(0), out.stride(0), BLOCK=block,
                                   num_warps=4)  # fmt: skip
    return out.view(*x.shape[:-1], d)


def compile_variants(intermediate_size: int, dtype: torch.dtype) -> None:
    """Call `silu_and_mul` once on a CPU row of [gate | up] (2 * `intermediate_size` columns, this
    rank's), for `phloem.worker.triton_prebuild`'s compile-only driver: the launch records the
    variant the engine compiles and runs nothing (see `phloem.ops.rope_kv.compile_variants`)."""
    silu_and_mul(torch.zeros(1, 2 * intermediate_size, dtype=dtype))
