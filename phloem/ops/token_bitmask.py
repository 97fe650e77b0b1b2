"""A grammar's token bitmask applied to the constrained rows of a logits matrix, in place.

Structured outputs (`phloem.structured_output`) give each constrained row of a step a packed
bitmask: int32 words, bit t % 32 of word t // 32 set = token t allowed (xgrammar's and
llguidance's layout). Sampling sets every disallowed token's logit to -inf. Unpacking the bits
into a bool [R, V] tensor, gathering the rows, filling and scattering them back moves the
logits several times over (1,024 rows of a 128K vocabulary: ~0.5 GB of temporaries); here:

- CUDA: one Triton kernel (`phloem.ops.token_bitmask_triton`, imported lazily) reads a block of words per program and writes -inf only where a bit
  is clear (predicated stores), on the row named by the row index; nothing is read from the
  logits and no temporary is made.
- CPU: the words are inverted and unpacked by numpy (`np.unpackbits`, little bit order) a
  chunk of rows at a time into bool rows, and each logits row is filled in place
  (`masked_fill_`): no gather or scatter, one chunk's [64, V] bools at a time.

Tokens the bitmask does not cover (t >= 32 * words, a logits row wider than the grammar's
vocabulary) are disallowed; bits past the logits' width are ignored.
"""

from __future__ import annotations

import numpy as np
import torch

CPU_CHUNK_ROWS = 64  # rows unpacked together on the CPU (64 x 128K bools: 8 MB)


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor) -> None:
    """The CPU path (module docstring): numpy unpacks a chunk of inverted rows, each logits row
    is filled in place."""
    vocab = logits.shape[1]
    covered = min(vocab, 32 * bitmask.shape[1])
    packed = bitmask.contiguous().numpy().view(np.uint8)
    rows = row_indices.tolist()
    for start in range(0, len(rows), CPU_CHUNK_ROWS):
        chunk = np.unpackbits(~packed[start : start + CPU_CHUNK_ROWS], axis=1, bitorder="little")
        disallowed = torch.from_numpy(chunk).view(torch.bool)
        for k, row in enumerate(rows[start : start + CPU_CHUNK_ROWS]):
            logits[row, :covered].masked_fill_(disallowed[k, :covered], float("-inf"))
            if covered < vocab:
                logits[row, covered:] = float("-inf")


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor
) -> torch.Tensor:
    """Set `logits[row_indices[i], t] = -inf` for every token t that row i of `bitmask` does not
    allow, in place; returns `logits`. Rows not named are untouched.

    Args:
        logits: [B, V] float (any float dtype), its last dimension contiguous; modified.
        bitmask: int32 [R, W] on logits' device, bit t % 32 of word t // 32 set = token t
            allowed (little-endian words). Tokens t >= 32 * W are disallowed; bits for t >= V
            are ignored.
        row_indices: int64 or int32 [R] on logits' device, each in [0, B) (not checked on
            CUDA; on the CPU an index out of range raises IndexError).
    Raises:
        ValueError: naming the argument whose shape, dtype or device does not fit.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with V contiguous, got {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(
            f"bitmask must be int32 [R, W], got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if row_indices.shape != (bitmask.shape[0],):
        raise ValueError(
            f"row_indices must be [R] = [{bitmask.shape[0]}], got {tuple(row_indices.shape)}"
        )
    if bitmask.device != logits.device or row_indices.device != logits.device:
        raise ValueError(
            f"bitmask ({bitmask.device}) and row_indices ({row_indices.device}) must be on "
            f"logits' device ({logits.device})"
        )
    if bitmask.shape[0] == 0:
        return logits
    if logits.is_cuda:
        from phloem.ops.token_bitmask_triton import launch

        launch(logits, bitmask.contiguous(), row_indices)
    else:
        _apply_torch(logits, bitmask, row_indices)
    return logits
