"""A device-side wait for a flag in page-locked host memory (CUDA): one program spins until the
host writes a sequence number, so work enqueued behind it on the same stream (a grammar
bitmask's host-to-device copy, `engine/device_wait.py`) reads what the host wrote before.

`words` is int32 [2] in page-locked host memory: word 0 the flag (the host stores the last
sequence number it released, never lowering it), word 1 the error word. The program reads
word 0 with volatile loads (no caching, no hoisting out of the loop) until it is >= `seq`. The
spin is bounded: once `timeout_ns` passed on the GPU's global timer (`%globaltimer`, ns) it
stores `seq` into word 1 and returns, so a flag that never comes cannot hang the device; the
host reads the error word once the step is collected. Under the interpreter (no inline PTX) the
bound is `max_spins` loads instead.

The launcher takes the host pointer through `data_ptr()` and asks the driver for its device
address (`cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)`): for memory pinned by
`cudaHostAlloc` (torch's `pin_memory=True`) under UVA that is the same address; for pageable
memory the launcher raises ValueError (nothing silently reads a stale copy).

Running under the interpreter: set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# seq, the timeout and the spin bound change every call: never specialized (one compile)
@triton.jit(do_not_specialize=["seq", "timeout_ns", "max_spins"])
def _flag_wait_kernel(words_ptr, seq, timeout_ns, max_spins, INTERPRET: tl.constexpr):
    value = tl.load(words_ptr, volatile=True)
    spins = 0
    if INTERPRET:
        start = 0
    else:
        start = tl.extra.cuda.globaltimer()
    waiting = value < seq
    while waiting:
        value = tl.load(words_ptr, volatile=True)
        spins += 1
        if INTERPRET:
            expired = spins >= max_spins
        else:
            expired = (tl.extra.cuda.globaltimer() - start) > timeout_ns
        waiting = (value < seq) & ~expired
    if value < seq:
        tl.store(words_ptr + 1, seq)


class _Mapped:
    """A page-locked CPU tensor seen by the launcher as a pointer (`data_ptr`, `dtype`): the
    frontend then never asks for its device; the driver maps the address."""

    __slots__ = ("dtype", "_ptr")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.dtype, self._ptr = tensor.dtype, tensor.data_ptr()

    def data_ptr(self) -> int:
        return self._ptr


def launch(words: torch.Tensor, seq: int, timeout_ns: int, max_spins: int = 1 << 20) -> None:
    """Enqueue the wait on the current stream: returns at once; the stream proceeds past it once
    `words[0] >= seq` (or, after `timeout_ns` [ns] on the GPU, `max_spins` loads interpreted,
    with `words[1] = seq`).

    Args:
        words: int32 [2], contiguous, page-locked CPU memory (a CPU tensor under the
            interpreter). seq: in [1, 2**31). timeout_ns: > 0. max_spins: > 0.
    Raises:
        ValueError: `words` is not int32 [2] on the CPU (the launcher: not page-locked)."""
    if words.dtype != torch.int32 or words.shape != (2,) or words.device.type != "cpu":
        raise ValueError(f"words must be int32 [2] on the CPU, got {words.dtype} {words.shape}")
    arg = words if INTERPRET else _Mapped(words)
    _flag_wait_kernel[(1,)](arg, seq, timeout_ns, max_spins, INTERPRET=INTERPRET, num_warps=1)
