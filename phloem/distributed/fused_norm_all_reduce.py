"""All-reduce fused with the residual add and RMSNorm that follow it, for small CUDA messages.

In a Llama-style block every row-parallel layer (o_proj, down_proj) is followed by an all-reduce
and then by a fused residual add + RMSNorm (the post-attention norm, or the next layer's input
norm). At batch 1 of an 8B model at TP = 2 the all-reduce (6.4 us, NCCL's LL ring) and the norm
(2.1 us) are two of the fixed-latency kernels that keep the step from halving
(benchmarks/results/2026-11-26g-h200x2, section 2). The peers fuse the three into one one-shot
kernel over buffers every rank reads through NVLink (TensorRT-LLM's `allReduceFusion`, used by
vLLM and SGLang for TP decode); FlashInfer ships it (`flashinfer.comm.allreduce_fusion` over a
TRT-LLM workspace, pattern `AllReduceFusionPattern.kARResidualRMSNorm`), so phloem calls it
rather than writing one. Its buffers are PyTorch symmetric memory (peer mappings over NVLink, no
NVLink multicast).

Chosen by `PHLOEM_TP_ALLREDUCE=fused_norm` (symm_all_reduce.py reads it). The model then leaves
each row-parallel layer's all-reduce to the norm that consumes its output
(`LlamaModel.defer_all_reduces_to_norms`); the norm calls this module when the message fits,
else NCCL's all-reduce followed by its own add + norm (prefill chunks, gloo groups, FP8-output
norms): the same math, so the choice changes kernels, not results beyond rounding.
"""

from __future__ import annotations

import torch

FUSED_DTYPES = (torch.bfloat16, torch.float16)


class FusedAllReduceNorm:
    """One-shot all-reduce + residual add + RMSNorm of up to `max_tokens` rows of `hidden_size`.

    Built collectively: every rank of `group` constructs it at the same point (the workspace's
    IPC buffers are exchanged through the group). Its barrier is on the device, so CUDA graphs
    capture it.

    Args:
        group: the NCCL process group (`torch.distributed.ProcessGroup`).
        rank, size: this rank and the group's size.
        hidden_size: the normalized dimension (the model's hidden size).
        max_tokens: the most rows a message may have (the workspace holds
            size x max_tokens x hidden_size x 2 bytes, three times for the Lamport buffers).
        dtype: the messages' dtype (bfloat16 or float16).
    Raises:
        ValueError: dtype is not bfloat16 or float16.
        ImportError: FlashInfer is not installed.
        RuntimeError: from FlashInfer or PyTorch when the workspace cannot be set up (no peer
            access between the GPUs).
    """

    def __init__(
        self, group, rank: int, size: int, hidden_size: int, max_tokens: int, dtype: torch.dtype
    ) -> None:
        from flashinfer import comm

        if dtype not in FUSED_DTYPES:
            raise ValueError(f"the fused all-reduce takes {FUSED_DTYPES}, not {dtype}")
        self._comm = comm
        self.hidden_size, self.max_tokens, self.dtype = hidden_size, max_tokens, dtype
        self._workspace = comm.create_allreduce_fusion_workspace(
            backend="trtllm", world_size=size, rank=rank, max_token_num=max_tokens,
            hidden_dim=hidden_size, dtype=dtype, force_oneshot_support=True, group=group,
        )  # fmt: skip

    def fits(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether this pair takes the fused kernel: contiguous 2-D CUDA tensors in the
        workspace's dtype, `hidden_size` wide, 1..max_tokens rows, the residual of x's shape and dtype."""
        return (
            x.is_cuda
            and x.dim() == 2
            and x.dtype == self.dtype
            and x.shape[1] == self.hidden_size
            and 0 < x.shape[0] <= self.max_tokens
            and x.is_contiguous()
            and residual.shape == x.shape
            and residual.dtype == x.dtype
            and residual.is_contiguous()
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
        slot: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(RMSNorm(sum + residual) * weight, sum + residual), sum = x summed over the ranks
        (one-shot: every rank reads every peer's rows; fp32 accumulation).

        Args:
            x: this rank's partial sum [T, hidden_size] (`fits`); not modified.
            residual: the residual stream [T, hidden_size]; not modified.
            weight: the norm's weight [hidden_size]; eps: added to the mean square.
            slot: unused (the workspace's Lamport buffers rotate by themselves; the argument
                of `SymmNormAllReduce`, which the norm passes to either kernel).
        Returns:
            (normalized [T, hidden_size], new residual [T, hidden_size]), new tensors of x's dtype.
        """
        comm = self._comm
        norm_out, residual_out = torch.empty_like(x), torch.empty_like(x)
        comm.allreduce_fusion(
            x, self._workspace, comm.AllReduceFusionPattern.kARResidualRMSNorm,
            launch_with_pdl=False, residual_out=residual_out, norm_out=norm_out,
            residual_in=residual, rms_gamma=weight, rms_eps=eps, use_oneshot=True, fp32_acc=True,
        )  # fmt: skip
        return norm_out, residual_out

    def abort(self) -> None:
        """Nothing: FlashInfer's kernel cannot be told to stop waiting for a dead peer (the
        interface `SymmNormAllReduce.abort` defines)."""

    def close(self) -> None:
        """Release the workspace's buffers (every rank, when the group ends)."""
        if self._workspace is not None:
            self._workspace.destroy()
            self._workspace = None
