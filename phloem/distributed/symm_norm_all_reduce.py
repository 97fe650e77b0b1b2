"""All-reduce fused with the residual add and RMSNorm that follow it: phloem's own one-shot kernel
over CUDA symmetric memory (PHLOEM_TP_ALLREDUCE=symm_norm).

The same fusion as `fused_norm_all_reduce.py` (FlashInfer's TensorRT-LLM kernel), without its
JIT module: FlashInfer's `trtllm_comm` module did not compile within 200 s on an H200 host
(benchmarks/results/2026-11-27-h200x4), so that path cannot start in a start-up's time. This one
is a Triton kernel (`symm_norm_kernel.py`) that phloem's Triton prebuild compiles in about a
second, over buffers PyTorch's symmetric memory maps into every rank (NVLink peer mappings, no
multicast). One launch replaces the all-reduce kernel, the boundary after it and the norm kernel
at each row-parallel layer's output (two per decoder layer): ~0.3 ms of a 3.7 ms TP = 2 decode
step of an 8B model at batch 1 (benchmarks/results/2026-11-26g-h200x2, section 2).

The model hands each row-parallel layer's all-reduce to the norm that consumes its output
(`LlamaModel.defer_all_reduces_to_norms`, as for fused_norm); the norm calls this when the rows
fit (1..`MAX_ROWS`, at most PHLOEM_TP_ALLREDUCE_MAX_KB), else the group's all-reduce and its own
add + norm (prefill steps, FP8-output norms).

Buffer reuse. Each rank's buffer has two slots; the norms after o_proj use slot 0 and those
after down_proj slot 1 (`RMSNorm.reduce_slot`), so consecutive calls alternate within a forward
pass and across passes (the last call of a pass, the final norm, is slot 1; the first, layer
0's post-attention norm, slot 0). The slot is fixed per layer, not counted on the host, so CUDA
graphs captured at any point replay it correctly. A call skipped in between (an FP8 norm, a
layer with a bias) runs a collective instead, which orders the ranks as a barrier would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phloem.distributed.fused_norm_all_reduce import FUSED_DTYPES

# the most rows a call takes (decode batches; larger steps take the group's all-reduce)
MAX_ROWS = 16
# the widest row: one program holds a row in registers (16 fp32 values per thread at 16 warps)
MAX_COLUMNS = 8192
# torch's smallest default signal pad: 32 blocks x 8 ranks x 4-byte flags [bytes]; the kernel
# uses 4 x rows x world_size bytes of it
SIGNAL_PAD_BYTES = 1024


def rows_for(hidden_size: int, world_size: int, max_bytes: int) -> int:
    """The most rows a `SymmNormAllReduce` of this group takes: up to MAX_ROWS, `max_bytes` of
    2-byte rows and the signal pad's flags; 0 when the width is not one the kernel takes (a
    multiple of 8 up to MAX_COLUMNS: the group's all-reduce then serves every norm)."""
    if hidden_size % 8 or hidden_size > MAX_COLUMNS:
        return 0
    return max(
        0, min(MAX_ROWS, max_bytes // (2 * hidden_size), SIGNAL_PAD_BYTES // (4 * world_size))
    )


class SymmNormAllReduce:
    """One-shot all-reduce + residual add + RMSNorm of up to `max_rows` rows of `hidden_size`,
    in one Triton kernel over a symmetric buffer of 2 x max_rows rows per rank.

    Built collectively: every rank of `group` constructs it at the same point (the buffer's
    rendezvous exchanges the ranks' handles; a barrier then makes sure every rank's flags are
    clear before any peer sets one). Its barrier is on the device, so CUDA graphs capture it.

    Args:
        group: the NCCL process group (`torch.distributed.ProcessGroup`).
        device: this rank's CUDA device.
        hidden_size: the normalized dimension (a multiple of 8, at most MAX_COLUMNS).
        max_rows: the most rows a message may have (1..`rows_for` the group).
        dtype: the messages' dtype (bfloat16 or float16).
    Raises:
        ValueError: a dtype, width or row count outside the above.
        ImportError: Triton is not installed. RuntimeError: from PyTorch when symmetric memory
            cannot be set up (no peer access between the GPUs).
    """

    def __init__(
        self, group, device: torch.device, hidden_size: int, max_rows: int, dtype: torch.dtype
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from phloem.distributed import symm_norm_kernel as kernel

        world = group.size()
        if dtype not in FUSED_DTYPES:
            raise ValueError(f"the symm_norm all-reduce takes {FUSED_DTYPES}, not {dtype}")
        if not 1 <= max_rows <= rows_for(hidden_size, world, max_rows * 2 * hidden_size):
            raise ValueError(f"max_rows {max_rows} of hidden_size {hidden_size} at world size "
                             f"{world}: see rows_for")  # fmt: skip
        self._kernel = kernel
        self.hidden_size, self.max_rows, self.dtype = hidden_size, max_rows, dtype
        self.slot_elements = kernel.slot_elements(max_rows, hidden_size)
        symm_mem.enable_symm_mem_for_group(group.group_name)
        self.buffer = symm_mem.empty(2 * self.slot_elements, dtype=dtype, device=device)
        self._handle = symm_mem.rendezvous(self.buffer, group)
        self.rank = self._handle.rank
        self.buffer_ptrs = torch.tensor(self._handle.buffer_ptrs, dtype=torch.int64, device=device)
        # read by the kernel's spins (`abort`): pinned host memory, which the GPU reads in place
        self.abort_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.signal_ptrs = torch.tensor(
            [*self._handle.signal_pad_ptrs, self.abort_flag.data_ptr()],
            dtype=torch.int64, device=device,
        )  # fmt: skip
        pad = self._handle.get_signal_pad(self.rank, [max_rows * world], dtype=torch.int32)
        pad.zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every pad is clear before any rank's first call
        torch.cuda.synchronize(device)

    def fits(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether this pair takes the kernel: contiguous 2-D CUDA tensors in the buffer's
        dtype, `hidden_size` wide, 1..max_rows rows, the residual of x's shape and dtype."""
        return (
            x.is_cuda
            and x.dim() == 2
            and x.dtype == self.dtype
            and x.shape[1] == self.hidden_size
            and 0 < x.shape[0] <= self.max_rows
            and x.is_contiguous()
            and residual.shape == x.shape
            and residual.dtype == x.dtype
            and residual.is_contiguous()
        )

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        slot: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(sum + residual) * weight, sum + residual), sum = x summed over the ranks in
        rank order in fp32 (the same bits on every rank).

        Args:
            x: this rank's partial sum [T, hidden_size] (`fits`); not modified.
            residual: the residual stream [T, hidden_size]; not modified.
            weight: the norm's weight [hidden_size]; eps: added to the mean square.
            slot: 0 or 1, the buffer slot (module docstring: consecutive calls alternate).
        Returns:
            (normalized [T, hidden_size], new residual [T, hidden_size]), new tensors of x's dtype.
        """
        return self._kernel.all_reduce_add_norm(
            x, residual, weight, eps, self.buffer_ptrs, self.signal_ptrs, self.rank,
            (slot & 1) * self.slot_elements,
        )  # fmt: skip

    def abort(self) -> None:
        """Make every barrier of this rank's calls, running or later, give up waiting
        (`symm_norm_kernel`: the spins poll this flag): for when a peer died and would leave them
        spinning forever. The results of those calls are garbage; the group must end. A host
        write only (no CUDA call), so any thread may call it while another waits on the GPU."""
        self.abort_flag.fill_(1)

    def close(self) -> None:
        """Drop the buffer (every rank, when the group ends; PyTorch frees it with the handle)."""
        self._handle = self.buffer = None
