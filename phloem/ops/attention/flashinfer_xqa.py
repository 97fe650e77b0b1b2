"""FlashInfer's XQA decode kernel for an FP8 cache's decode-only steps, and when they run it
(PHLOEM_FP8_DECODE_KERNEL, `flashinfer_backend.fp8_decode_kernel` / `fp8_decode_path`; issue 18).

When: by default ("auto", the variable unset) on a CUDA GPU XQA runs on (compute capability
major in `XQA_CAPABILITY_MAJORS`: sm_90, sm_100, sm_120), for every geometry it compiles
(`fp8_decode_path`: head_dim a multiple of 16 up to 256, block size in `XQA_PAGE_SIZES`); other
GPUs and geometries, and the CPU, keep the fa2 prefill kernel. `resolve_fp8_decode` is that
rule, a pure function of the capability, so the backend's choice, its CUDA graphs' capture and
replays, and the start-up prebuild's module list (`worker/kernel_prebuild.py`) agree. The
default since 2026-11-27: on an H200, decode-heavy 256 x 1,000/256 on Llama-3.1-8B shapes with
an FP8 cache ran 6,532 output tokens/s with XQA against 5,802 on the prefill kernel (1.126x)
and 6,096 with a bf16 cache (1.07x), in one device call
(benchmarks/results/2026-11-27g-h200/fp8_xqa). Its e4m3 math costs the embedded model 1.6 points
of top-1 agreement beyond the e4m3 cache's (0.922 vs 0.938, CPU emulation
`reference.XqaEmulatedAttention`, benchmarks/results/2026-11-27f-cpu-xqa-quality);
PHLOEM_FP8_DECODE_KERNEL=prefill turns it off.

`xqa_batch_decode_with_kv_cache` is TensorRT-LLM's XQA kernel; on sm_90 with an e4m3 cache its
FP8 GMMA kernel (`mha_sm90.cu`) rounds the query to e4m3, computes the scores as K . q^T (64 KV
tokens as wgmma's M side, the GQA group padded to N = 8), rounds P to e4m3 for P . V and reads
the pages by TMA. It takes the softmax scale times k_scale as bmm1_scale and v_scale as
bmm2_scale, a dense [B, pages] page table with uint32 lengths (`page_tables.dense_page_table`),
and a zeroed workspace of its own (its semaphores reset themselves after each launch). On an
H200 it reads e4m3 pages 1.69-1.96x as fast as FlashInfer reads bf16 ones (batch 64-512, 1-2K
tokens; benchmarks/results/2026-11-27f-h200).

`XqaDecode` plans a step (eager: fresh device tensors; graph: the fixed buffers of the batch's
graphs, rewritten before each capture or replay) and launches the kernel on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.page_tables import dense_page_table
from phloem.ops.staging import pinned, to_device

XQA_PAGE_SIZES = (16, 32, 64, 128)  # the block sizes FlashInfer's XQA module compiles for
XQA_CAPABILITY_MAJORS = (9, 10, 12)  # where FlashInfer's XQA compiles and runs (sm_90/100/120)
WORKSPACE_BYTES = 32 << 20  # 8 MiB of semaphores, then multi-block partials (< 1 MiB)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA `device`; None for another device."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def xqa_runs_on(capability: tuple[int, int] | None) -> bool:
    """Whether XQA compiles and runs on a device of this compute capability (None: not CUDA)."""
    return capability is not None and capability[0] in XQA_CAPABILITY_MAJORS


def resolve_fp8_decode(kernel: str, capability: tuple[int, int] | None) -> str:
    """The kernel asked for an FP8 cache's decode-only steps with "auto" resolved for a device
    of `capability` (None: not CUDA): "xqa" where XQA runs (`xqa_runs_on`), else "prefill";
    any other name is returned as it is (validated by `fp8_decode_path`, which also falls back
    to "prefill" for a geometry the kernel is not compiled for). Pure: the backend, its graphs
    and the kernel prebuild resolve alike."""
    if kernel != "auto":
        return kernel
    return "xqa" if xqa_runs_on(capability) else "prefill"


def check_xqa_device(kernel: str, device: torch.device) -> None:
    """Refuse `kernel` "xqa" (PHLOEM_FP8_DECODE_KERNEL) on a CUDA device XQA does not run on
    ("auto" never resolves to it there).

    Raises:
        ValueError: naming PHLOEM_FP8_DECODE_KERNEL, the GPUs XQA needs and this one's."""
    capability = cuda_capability(device) if kernel == "xqa" else None
    if capability is None or xqa_runs_on(capability):
        return
    major, minor = capability
    raise ValueError(
        f"PHLOEM_FP8_DECODE_KERNEL=xqa needs a GPU of compute capability "
        f"{'/'.join(f'{m}.x' for m in XQA_CAPABILITY_MAJORS)}, this one is {major}.{minor}"
    )


@dataclass
class XqaStep:
    """A planned XQA decode step on the device: tables int32 [B, W] (`dense_page_table`,
    W >= the step's longest page count), seq_lens int32 [B] (read as uint32), block_size."""

    tables: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int


class XqaDecode:
    """XQA's plans and launches for one attention backend.

    Args:
        device: the CUDA device.
        max_num_blocks_per_seq: the longest block table (the width of the graphs' tables).
    """

    def __init__(self, device: torch.device, max_num_blocks_per_seq: int) -> None:
        self.device = device
        self.max_num_blocks_per_seq = max_num_blocks_per_seq
        self._workspace: torch.Tensor | None = None  # zeroed at the first plan
        self._graph: dict[int, XqaStep] = {}  # batch -> its fixed buffers
        self._buffer: torch.Tensor | None = None  # shared by those buffers

    def _graph_step(self, batch_size: int, block_size: int) -> XqaStep:
        """The fixed buffers of XQA graphs of `batch_size` sequences (made once): a page table
        [batch_size, max_num_blocks_per_seq] and lengths [batch_size], views of one buffer that
        every bucket made after its last growth shares (only one graph replays at a time, and
        each replay's plan rewrites them first: the FlashInfer backend's page-index rule)."""
        step = self._graph.get(batch_size)
        if step is None:
            width = self.max_num_blocks_per_seq
            need = batch_size * (width + 1)
            if self._buffer is None or self._buffer.numel() < need:
                self._buffer = torch.zeros(need, dtype=torch.int32, device=self.device)
            tables = self._buffer[: batch_size * width].view(batch_size, width)
            lens = self._buffer[batch_size * width : need]
            step = self._graph[batch_size] = XqaStep(tables, lens, block_size)
        return step

    def plan(self, meta: AttentionMetadata, graph: bool) -> XqaStep:
        """Plan a decode-only step: its dense page table and lengths to the device (into the
        graph's fixed buffers for a capture or replay, else fresh tensors).

        Raises:
            ValueError: for a step whose longest table exceeds max_num_blocks_per_seq (graphs).
        """
        if self._workspace is None:  # here, never inside a graph capture (its semaphores
            # must be 0 before the first launch, eager or replayed)
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        table, lens = dense_page_table(meta)
        if not graph:
            return XqaStep(to_device(table, self.device), to_device(lens, self.device),
                           meta.block_size)  # fmt: skip
        step = self._graph_step(meta.num_seqs, meta.block_size)
        if table.shape[1] > step.tables.shape[1]:
            raise ValueError(f"a sequence needs {table.shape[1]} pages, graphs hold "
                             f"{step.tables.shape[1]}")  # fmt: skip
        step.tables[:, : table.shape[1]].copy_(pinned(table), non_blocking=True)
        step.seq_lens.copy_(pinned(lens), non_blocking=True)
        step.block_size = meta.block_size
        return step

    def run(self, step: XqaStep, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
            bmm1_scale: float, bmm2_scale: float, kv_layout: str) -> None:  # fmt: skip
        """XQA over `step` into `out` ([B, H, D], contiguous); the kernel reads the query as a
        contiguous [B, H, D] (a strided view is copied first). bmm1_scale: the softmax scale
        times k_scale; bmm2_scale: v_scale."""
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        xqa_batch_decode_with_kv_cache(
            query.contiguous(), kv_cache, self._workspace, step.tables,
            step.seq_lens.view(torch.uint32), step.tables.shape[1] * step.block_size,
            bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, out=out, kv_layout=kv_layout,
        )  # fmt: skip
