"""The Triton kernel of `phloem.ops.token_bitmask` (CUDA): a grammar's packed token bitmask
applied in place to the constrained rows of a logits matrix.

Program (i, j) covers words [j * BLOCK_WORDS, (j + 1) * BLOCK_WORDS) of bitmask row i: it reads
them once, expands each to its 32 bits in registers and stores -inf into logits row
`rows[i]` where a bit is clear (predicated stores: the logits are never read, allowed tokens
are not written). Tokens past the bitmask's words are disallowed, tokens past V are not
touched.

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_WORDS = 128  # bitmask words (4,096 tokens) a program covers


# Only the dtype of the logits picks a variant: the widths and strides are not specialized (one
# compiled kernel serves every vocabulary; the stores are predicated per token anyway).
@triton.jit(do_not_specialize=["vocab", "num_words", "s_logits", "s_mask"])
def _token_bitmask_kernel(
    logits_ptr, mask_ptr, rows_ptr, vocab, num_words, s_logits, s_mask,
    BLOCK_WORDS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    words = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    bits = tl.arange(0, 32)
    packed = tl.load(mask_ptr + i.to(tl.int64) * s_mask + words, mask=words < num_words, other=0)
    allowed = ((packed[:, None] >> bits[None, :]) & 1) != 0  # [BLOCK_WORDS, 32]
    tokens = words[:, None] * 32 + bits[None, :]
    ninf = tl.full([BLOCK_WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * s_logits + tokens, ninf, mask=(tokens < vocab) & ~allowed)


def launch(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor) -> None:
    """Mask `logits[row_indices[i]]` by bitmask row i for every i, in place.

    logits: [B, V] float, V contiguous; bitmask: int32 [R, W], contiguous; row_indices: int64
    or int32 [R]; all on one device (checked by `token_bitmask.apply_token_bitmask_`, the
    public entry)."""
    num_rows, vocab = bitmask.shape[0], logits.shape[1]
    grid = (num_rows, triton.cdiv(triton.cdiv(vocab, 32), BLOCK_WORDS))
    _token_bitmask_kernel[grid](logits, bitmask, row_indices, vocab, bitmask.shape[1],
                                logits.stride(0), bitmask.stride(0), BLOCK_WORDS=BLOCK_WORDS,
                                num_warps=4)  # fmt: skip


def compile_variants(dtype: torch.dtype) -> None:
    """Launch the kernel once on CPU tensors per logits dtype the sampler masks (`dtype`, the
    model's: a greedy step's copy of its logits; float32: the random path's copy), for
    `phloem.worker.triton_prebuild`'s compile-only driver: each launch records the variant the
    engine compiles (only the logits' dtype picks one) and runs nothing. Under a real driver
    it would launch on CPU memory: call it only there."""
    for logits_dtype in dict.fromkeys([dtype, torch.float32]):
        logits = torch.zeros(1, 64, dtype=logits_dtype)
        launch(logits, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
