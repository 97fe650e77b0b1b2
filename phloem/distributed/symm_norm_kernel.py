"""The Triton kernel of `symm_norm_all_reduce.py`: one-shot all-reduce, residual add and RMSNorm
of a few rows in one launch, over buffers every rank can address (CUDA symmetric memory).

One program per row. Each program of rank r, for its row t:

    1. copy     x[t] (this rank's partial sum) -> buffer_r[slot][t]            (its own buffer)
    2. barrier  with program t of every peer, through the signal pads           (BARRIER only)
    3. sum      buffer_0[slot][t] + ... + buffer_{W-1}[slot][t], in fp32, in rank order
    4. add      + residual[t], rounded to the model dtype: the new residual row
    5. norm     RMSNorm of that row (fp32 statistics), times the weight

Every rank sums the same values in the same order, so the ranks' residual streams stay
identical bit for bit. Program t reads from each peer only row t, which program t of that peer
wrote before it arrived, so a barrier per program (not per grid) is enough.

The barrier (step 2) uses one 32-bit flag per (program, sender) in each rank's signal pad:

    signal_pad_p[t * W + r] = 1   "rank r's program t has written row t"   (set by r, on p's pad)

Arrive: for each peer p, compare-and-swap p's flag (t, r) from 0 to 1 with release semantics at
system scope, spinning while it is still 1 (p has not yet consumed the previous call's flag: r may
run one call ahead of p). Wait: for each peer p, compare-and-swap our own flag (t, p) from 1 back
to 0 with acquire semantics, spinning until it was 1. The flags go back to 0 by themselves, so
the protocol needs no counter from the host and a CUDA graph can replay it any number of times;
the grids of one call must match on every rank (they do: the same rows everywhere). The release
orders the program's copies (made visible to the whole block by a `__syncthreads` first) before
the flag; the acquire orders the peers' rows after it.

Every spin polls an abort flag (an int32 in pinned host memory, its address after the signal
pads' in the pad table) once per ABORT_POLL_SPINS tries: when a peer dies, nothing else could
end the spin (an NCCL abort does not reach it) and the driver would wait for this kernel
forever. `SymmNormAllReduce.abort` sets it (the executor's watchdog, on a rank's death); the
kernel then leaves its barrier with whatever the buffers hold, and the step fails. The common
case (the peer arrives within a few tries) never reads it.

Step 1 writes into `slot`, one of two halves of each buffer, and callers alternate them between
consecutive calls (`symm_norm_all_reduce.py`): a rank may begin call n + 1 while a peer still
reads call n's rows from its buffer, but not call n + 2 (it would first need that peer at call
n + 1's barrier).

Under TRITON_INTERPRET (CPU tests) BARRIER=False skips step 2: `buffer_ptrs` then holds the
addresses of plain tensors standing in for the peers' buffers, already filled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phloem.distributed.symm_norm_all_reduce import MAX_COLUMNS

# failed compare-and-swaps between two reads of the abort flag (module docstring; a read crosses
# PCIe, ~1 us, so the poll costs nothing while the peers keep pace)
ABORT_POLL_SPINS = tl.constexpr(1024)


@triton.jit
def _swap_flag(flag, expected, desired, abort, SEM: tl.constexpr):
    """Compare-and-swap the int32 at `flag` from `expected` to `desired` (system scope, `SEM`
    ordering), retrying until it succeeds or the int32 at `abort` is non-zero."""
    done = (tl.atomic_cas(flag, expected, desired, sem=SEM, scope="sys") == expected).to(tl.int32)
    tries = 0
    while done == 0:
        done = (tl.atomic_cas(flag, expected, desired, sem=SEM, scope="sys") == expected).to(
            tl.int32
        )
        tries += 1
        if tries % ABORT_POLL_SPINS == 0:
            done = done | (tl.load(abort, volatile=True) != 0).to(tl.int32)


@triton.jit
def _block_barrier(signal_ptrs, rank, block, WORLD: tl.constexpr):
    """Meet program `block` of every peer (module docstring: arrive, then wait). signal_ptrs:
    int64 [WORLD + 1], each rank's signal pad address (int32 flags, WORLD per program), then the
    abort flag's."""
    abort = tl.load(signal_ptrs + WORLD).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            pad = tl.load(signal_ptrs + peer).to(tl.pointer_type(tl.int32))
            _swap_flag(pad + block * WORLD + rank, 0, 1, abort, "release")
    own = tl.load(signal_ptrs + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            _swap_flag(own + block * WORLD + peer, 1, 0, abort, "acquire")


@triton.jit(do_not_specialize=["rank"])
def _all_reduce_add_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buffer_ptrs,
                                signal_ptrs, rank, slot_offset, eps, HIDDEN: tl.constexpr,
                                WORLD: tl.constexpr, BLOCK: tl.constexpr,
                                BARRIER: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    offs = row.to(tl.int64) * HIDDEN + cols
    # the buffers are 16-byte aligned (symmetric memory's allocations): vector loads and stores
    own = tl.multiple_of(tl.load(buffer_ptrs + rank).to(x_ptr.dtype), 16)
    tl.store(own + slot_offset + offs, tl.load(x_ptr + offs, mask=ok, other=0.0), mask=ok)
    # loaded before the barrier: their latency overlaps the wait for the peers
    res = tl.load(res_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if BARRIER:
        tl.debug_barrier()  # every thread's copy before the flag that publishes it
        _block_barrier(signal_ptrs, rank, row, WORLD)
        tl.debug_barrier()  # the peers' rows after the flag that announced them
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):  # rank order: the same sum on every rank
        part = tl.multiple_of(tl.load(buffer_ptrs + peer).to(x_ptr.dtype), 16)
        total += tl.load(part + slot_offset + offs, mask=ok, other=0.0).to(tl.float32)
    h = (total + res).to(x_ptr.dtype.element_ty)  # the next residual stream, as stored
    tl.store(res_out_ptr + offs, h, mask=ok)
    h32 = h.to(tl.float32)
    mean_square = tl.math.div_rn(tl.sum(h32 * h32, axis=0), HIDDEN)
    normed = (h32 * tl.math.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, (w * normed.to(tl.float32)).to(x_ptr.dtype.element_ty), mask=ok)


def all_reduce_add_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    rank: int,
    slot_offset: int,
    barrier: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s + residual) * weight, s + residual), s = the sum of every rank's x, in one
    launch (module docstring). Mutates this rank's buffer (x's rows at `slot_offset`) and, with
    `barrier`, the signal pads' flags (back to 0 when every rank has run it).

    Args:
        x: this rank's partial sum [T, hidden], contiguous, T >= 1 (the same T on every rank).
        residual: [T, hidden] in x's dtype, contiguous. weight: [hidden]. eps: added to the mean
            square.
        buffer_ptrs: int64 [W] on x's device: the address of each rank's buffer (the symmetric
            memory handle's `buffer_ptrs`; plain tensors' `data_ptr()` in CPU tests), each at
            least slot_offset + T * hidden elements of x's dtype.
        signal_ptrs: int64 [W + 1]: each rank's signal pad, >= 4 * T * W bytes, then the address
            of the abort flag (an int32 the GPU can read: pinned host memory); read with barrier.
        rank: this rank in [0, W). slot_offset: [elements] where this call's rows start in each
            buffer (a multiple of 8: 16-byte vectors).
        barrier: False only where no peer runs (the peers' buffers are filled already).
    Returns:
        (normalized, new residual): new [T, hidden] tensors in x's dtype.
    Raises:
        ValueError: rows wider than MAX_COLUMNS, a shape that is not [T, hidden] as above, or
            (with barrier) a pad table of other than W + 1 entries.
    """
    num_rows, hidden = x.shape
    if hidden > MAX_COLUMNS or residual.shape != x.shape or weight.shape != (hidden,):
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight "
                         f"{tuple(weight.shape)}: need [T, <= {MAX_COLUMNS}], the same, [hidden]")  # fmt: skip
    if barrier and signal_ptrs.numel() != buffer_ptrs.numel() + 1:
        raise ValueError(f"{signal_ptrs.numel()} pad table entries for {buffer_ptrs.numel()} "
                         "ranks: need one per rank, then the abort flag")  # fmt: skip
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    _all_reduce_add_norm_kernel[(num_rows,)](
        x, residual, weight, out, residual_out, buffer_ptrs, signal_ptrs, rank, slot_offset, eps,
        HIDDEN=hidden, WORLD=buffer_ptrs.numel(), BLOCK=block, BARRIER=barrier,
        num_warps=max(4, min(16, block // 512)),
    )  # fmt: skip
    return out, residual_out


def slot_elements(max_rows: int, hidden_size: int) -> int:
    """[elements] between the two slots of a buffer of `max_rows` rows: rounded up to 16, so
    both slot offsets specialize alike (divisible by 16) and keep rows 16-byte aligned."""
    return -(-max_rows * hidden_size // 16) * 16


def compile_variants(hidden_size: int, world_size: int, max_rows: int, dtype: torch.dtype) -> None:
    """Call `all_reduce_add_norm` as `SymmNormAllReduce` does (barrier on, both slots) on CPU
    tensors, for `phloem.worker.triton_prebuild`: under its compile-only Triton driver the launch
    records the variant the engine compiles and runs nothing (the kernel specializes on the
    dtype, the width, the world size and 16-byte alignments, not on the row count or the rank).
    Under a real driver it would launch on CPU memory: call it only there."""
    x = torch.zeros(1, hidden_size, dtype=dtype)
    table = torch.zeros(world_size, dtype=torch.int64)
    pads = torch.zeros(world_size + 1, dtype=torch.int64)  # the pads, then the abort flag
    for slot in (0, 1):
        all_reduce_add_norm(
            x, x, x[0], 1e-6, table, pads, 0, slot * slot_elements(max_rows, hidden_size)
        )
