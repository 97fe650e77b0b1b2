"""A one-shot all-reduce for the small messages of decode steps, over CUDA symmetric memory.

A decode step of an 8B model at batch B all-reduces B x 8 KB twice per layer; NCCL's latency for
such messages (tens of microseconds inside a CUDA graph, NVLink multicast off) is a large part
of a tensor-parallel decode step. The peers' answer is a custom all-reduce over buffers every
rank can read through NVLink (vLLM's custom all-reduce, TensorRT-LLM's one-shot all-reduce):
each rank copies its input into its own slot of a symmetric buffer, the ranks meet at a
barrier, and each reads every peer's slot and sums — one kernel, no ring. PyTorch ships that
kernel (`torch.ops.symm_mem.one_shot_all_reduce_copy_out` over `torch.distributed.
_symmetric_memory`), so phloem uses it rather than writing its own.

Chosen by `PHLOEM_TP_ALLREDUCE` (read when the group starts, the same on every rank since the
ranks inherit the environment): "nccl" (the default until the GPU measurement says otherwise),
"symm_mem" (this module for messages up to `PHLOEM_TP_ALLREDUCE_MAX_KB`, default 512 KiB;
NCCL for larger ones, e.g. prefill steps), "fused_norm" (the all-reduce fused with the
residual add and RMSNorm after it, for messages up to the same size: FlashInfer's kernel,
`fused_norm_all_reduce.py`) or "symm_norm" (the same fusion as phloem's own Triton kernel over
symmetric memory, up to 16 rows: `symm_norm_all_reduce.py`).
"""

from __future__ import annotations

import os

import torch

ALL_REDUCE_CHOICES = ("nccl", "symm_mem", "fused_norm", "symm_norm")
DEFAULT_MAX_KB = 512
_ALIGN_BYTES = 16  # the kernel reads and writes 16-byte vectors


def all_reduce_choice(environ: dict[str, str] | None = None) -> tuple[str, int]:
    """(choice, largest message [bytes] for the symmetric-memory path) from the environment.

    Raises:
        ValueError: naming PHLOEM_TP_ALLREDUCE or PHLOEM_TP_ALLREDUCE_MAX_KB for a bad value.
    """
    env = os.environ if environ is None else environ
    choice = env.get("PHLOEM_TP_ALLREDUCE", "nccl")
    if choice not in ALL_REDUCE_CHOICES:
        raise ValueError(f"PHLOEM_TP_ALLREDUCE must be one of {ALL_REDUCE_CHOICES}, got {choice!r}")
    raw = env.get("PHLOEM_TP_ALLREDUCE_MAX_KB", str(DEFAULT_MAX_KB))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"PHLOEM_TP_ALLREDUCE_MAX_KB must be a positive integer, got {raw!r}")
    return choice, int(raw) << 10


class OneShotAllReduce:
    """Sum a small CUDA tensor over the group through one symmetric buffer of `max_bytes`.

    Built collectively: every rank of `group` constructs it at the same point (the buffer's
    rendezvous exchanges the ranks' handles).

    Args:
        group: the NCCL process group (`torch.distributed.ProcessGroup`).
        device: this rank's CUDA device.
        max_bytes: the largest message [bytes]; larger ones are not `fits`.
    Raises:
        RuntimeError: from PyTorch when symmetric memory cannot be set up (no peer access).
    """

    def __init__(self, group, device: torch.device, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` takes this path: contiguous CUDA, floating point, at most `max_bytes`,
        and a whole number of 16-byte vectors."""
        nbytes = x.numel() * x.element_size()
        return (
            x.is_cuda
            and x.is_floating_point()
            and x.is_contiguous()
            and 0 < nbytes <= self.max_bytes
            and nbytes % _ALIGN_BYTES == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `x` (any shape, `fits`), as a new tensor of its shape and
        dtype; `x` is not modified. Its barrier is on the device, so decode CUDA graphs capture it
        (tests/distributed/test_tp_gpu.py checks that on two GPUs; not yet run there)."""
        out = torch.empty_like(x)
        flat = x.view(-1)
        slot = self.buffer.view(x.dtype)[: flat.numel()]
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            slot, flat, "sum", self.group_name, out.view(-1)
        )
        return out
