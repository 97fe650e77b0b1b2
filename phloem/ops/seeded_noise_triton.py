"""The Triton kernel of `phloem.ops.seeded_noise` (CUDA): every seeded row's Exp(1) noise of a
step in one launch.

Program (i, j) covers vocabulary entries [j * BLOCK, (j + 1) * BLOCK) of stream i: it loads the
row's 64-bit key, hashes key + (v + 1) * GAMMA with splitmix64's output function in uint64
registers (multiplications wrap mod 2^64, shifts are logical), and stores -log(u) into row
`rows[i]` of q (or, with WRITE_BITS, the 23 bits u is made of, for the test against the torch
reference). Nothing is read from q; entries past V are not touched.

`compile_variants` lists the variant the sampler launches for `phloem.worker.triton_prebuild`.

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


# keys and row indices are read a scalar per program: their 16-byte alignment changes no code (the
# row indices are a view at offset 8 * S of one staged [2, S] copy, aligned only for an even S), so
# it is not specialized on and every step launches one variant
@triton.jit(
    do_not_specialize=["vocab", "s_q"], do_not_specialize_on_alignment=["keys_ptr", "rows_ptr"]
)
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


def compile_variants() -> None:
    """Launch the kernel once on CPU tensors as `seeded_noise.seeded_exponentials_` does (float32
    q; keys and row indices as the two rows of one staged int64 [2, S] tensor), for
    `phloem.worker.triton_prebuild`'s compile-only driver: the launch records the one variant
    the sampler compiles and runs nothing. The variant depends on nothing of the model: q is
    float32 whatever the model's dtype, BLOCK and num_warps are fixed, the vocabulary size and
    q's row stride are not specialized on, nor are the keys' and row indices' alignments.
    Under a real driver it would launch on CPU memory: call it only there."""
    staged = torch.zeros(2, 1, dtype=torch.int64)  # keys, row indices
    launch(torch.zeros(1, 64, dtype=torch.float32), staged[0], staged[1])
