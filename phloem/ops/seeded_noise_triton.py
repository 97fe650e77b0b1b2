"""The Triton kernel of `phloem.ops.seeded_noise` (CUDA): every seeded row's Exp(1) noise of a
step in one launch.

Program (i, j) covers vocabulary entries [j * BLOCK, (j + 1) * BLOCK) of stream i: it loads the
row's 64-bit key, hashes key + (v + 1) * GAMMA with splitmix64's output function in uint64
registers (multiplications wrap mod 2^64, shifts are logical), and stores -log(u) into row
`rows[i]` of q (or, with WRITE_BITS, the 23 bits u is made of, for the test against the torch
reference). Nothing is read from q; entries past V are not touched.

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # vocabulary entries a program covers

# the constants of `seeded_noise` as unsigned 64-bit words (literals >= 2^63 are uint64)
_GAMMA = tl.constexpr(0x9E3779B97F4A7C15)
_MIX_1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX_2 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _mix64(x):
    """splitmix64's output function on uint64 x."""
    x = x ^ (x >> 30)
    x = x * _MIX_1
    x = x ^ (x >> 27)
    x = x * _MIX_2
    return x ^ (x >> 31)


@triton.jit(do_not_specialize=["vocab", "s_q"])
def _seeded_noise_kernel(
    q_ptr, keys_ptr, rows_ptr, vocab, s_q, BLOCK: tl.constexpr, WRITE_BITS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    key = tl.load(keys_ptr + i).to(tl.uint64, bitcast=True)
    row = tl.load(rows_ptr + i).to(tl.int64)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = _mix64(key + (v + 1).to(tl.uint64) * _GAMMA)
    bits = (h >> 41).to(tl.int32)  # seeded_noise.SHIFT: the top 23 bits
    if WRITE_BITS:
        tl.store(q_ptr + row * s_q + v, bits, mask=v < vocab)
    else:
        u = (bits * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2^-24, exact
        # tl.log of float32 is libdevice's __nv_logf on NVIDIA (within an ulp; checked in the
        # PTX for sm_90): an approximate lg2 would lose the small q of u near 1, the race's
        # likeliest winners
        tl.store(q_ptr + row * s_q + v, -tl.log(u), mask=v < vocab)


def launch(
    q: torch.Tensor, keys: torch.Tensor, row_indices: torch.Tensor, write_bits: bool = False
) -> None:
    """Fill `q[row_indices[i]]` with the noise of key i for every i, in place.

    q: float32 [R, V] (int32 with write_bits: the 23-bit integers instead of -log u), V
    contiguous; keys: int64 [S]; row_indices: int64 [S], distinct rows of q; all on one CUDA
    device (checked by `seeded_noise.seeded_exponentials_`, the public entry)."""
    num_rows, vocab = keys.shape[0], q.shape[1]
    grid = (num_rows, triton.cdiv(vocab, BLOCK))
    _seeded_noise_kernel[grid](q, keys, row_indices, vocab, q.stride(0), BLOCK=BLOCK,
                               WRITE_BITS=write_bits, num_warps=4)  # fmt: skip
