"""A grammar's token bitmask applied to the constrained rows of a logits matrix, in place.

Structured outputs (`phloem.structured_output`) give each constrained row of a step a packed
bitmask: int32 words, bit t % 32 of word t // 32 set = token t allowed (xgrammar's and
llguidance's layout). Sampling sets every disallowed token's logit to -inf. Unpacking the bits
into a bool [R, V] tensor, gathering the rows, filling and scattering them back moves the
logits several times over (1,024 rows of a 128K vocabulary: ~0.5 GB of temporaries); here:

- CUDA: one Triton kernel (`phloem.ops.token_bitmask_triton`, imported lazily) reads a block
  of words per program and writes -inf only where a bit is clear (predicated stores), on the
  row named by the row index; nothing is read from the logits and no temporary is made.
- CPU: the words are inverted and unpacked by numpy (`np.unpackbits`, little bit order) a
  chunk of rows at a time into bool rows, and the logits rows are filled in place
  (`masked_fill_`): one call for a chunk whose rows are consecutive (a step whose rows are all
  constrained), else one a row; no gather or scatter, one chunk's [64, V] bools at a time.

The bitmask reaches a GPU on a copy stream of its own (`bitmask_to_device`): filled on the host
while the step's forward pass runs, its copy (16 MB for 1,024 rows of a 128K vocabulary) then
overlaps the forward pass instead of waiting behind it on the compute stream.

Tokens the bitmask does not cover (t >= 32 * words, a logits row wider than the grammar's
vocabulary) are disallowed; bits past the logits' width are ignored.
"""

from __future__ import annotations

import numpy as np
import torch

from phloem.ops.staging import to_device

_copy_streams: dict[torch.device, torch.cuda.Stream] = {}  # per GPU, made on first use

CPU_CHUNK_ROWS = 64  # rows unpacked together on the CPU (64 x 128K bools: 8 MB)


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor) -> None:
    """The CPU path (module docstring): numpy unpacks a chunk of inverted rows, the logits
    rows are filled in place (a run of consecutive rows in one call)."""
    vocab = logits.shape[1]
    covered = min(vocab, 32 * bitmask.shape[1])
    packed = bitmask.contiguous().numpy().view(np.uint8)
    rows = row_indices.tolist()
    for start in range(0, len(rows), CPU_CHUNK_ROWS):
        chunk = np.unpackbits(~packed[start : start + CPU_CHUNK_ROWS], axis=1, bitorder="little")
        disallowed = torch.from_numpy(chunk).view(torch.bool)[:, :covered]
        chunk_rows = rows[start : start + CPU_CHUNK_ROWS]
        first, num = chunk_rows[0], len(chunk_rows)
        if (
            0 <= first
            and first + num <= len(logits)
            and chunk_rows == list(range(first, first + num))
        ):
            targets = [(logits[first : first + num], disallowed)]  # a view: one fill
        else:
            targets = [(logits[row], disallowed[k]) for k, row in enumerate(chunk_rows)]
        for target, bits in targets:
            target[..., :covered].masked_fill_(bits, float("-inf"))
            if covered < vocab:
                target[..., covered:] = float("-inf")


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


def bitmask_to_device(
    bitmask: np.ndarray, row_indices: np.ndarray, device: torch.device, before_copy=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bitmask, row_indices) as tensors on `device`, for `apply_token_bitmask_`.

    On a GPU both are copied on a copy stream of the device's own (without waiting for the
    work queued on the current stream), and the current stream waits for the copies: work
    enqueued after this call reads them, and the copy of a step's bitmask runs while its
    forward pass still does. The host arrays may be reused once the current stream has passed
    this point (the manager's buffers are rewritten only after the step was collected); best
    from pinned memory (`StructuredOutputManager(pin_memory=True)`), else staged
    (`staging.to_device`). Elsewhere: `to_device`.

    With `before_copy` (a callable, `engine/device_wait.py`) it is called first, on the copy
    stream: work it enqueues there (a wait for the host to finish writing `bitmask`) comes
    before the copy, which then reads `bitmask` in place, so `bitmask` must be page-locked
    (ValueError otherwise: a staged copy would read the rows before they are written).
    Elsewhere it is called before the copy, which may block.

    Args:
        bitmask: int32 [R, W]. row_indices: int64 [R].
    """
    if device.type != "cuda":
        if before_copy is not None:
            before_copy()
        return to_device(bitmask, device), to_device(row_indices, device)
    device = torch.device(
        "cuda", torch.cuda.current_device() if device.index is None else device.index
    )
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        indices = to_device(row_indices, device)  # staged now: made by the caller already
        if before_copy is None:
            tensors = to_device(bitmask, device), indices
        else:
            host = torch.from_numpy(bitmask)
            if not host.is_pinned():
                raise ValueError("a bitmask copied behind a wait must be page-locked")
            before_copy()
            tensors = host.to(device, non_blocking=True), indices
    current.wait_stream(stream)
    for t in tensors:  # allocated on the copy stream, freed after the current stream's use
        t.record_stream(current)
    return tensors
