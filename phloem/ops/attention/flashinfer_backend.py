"""Paged attention on the GPU through FlashInfer (arXiv 2501.01005), imported lazily.

One kernel family serves every step: FlashInfer's batch prefill over a paged KV cache (the "fa2"
backend), which handles whole prompts, chunked appends (q_len < kv_len) and decode tokens
(q_len = 1, GQA groups packed into tensor-core tiles) mixed in one launch. Using one compiled
module for all of them keeps the JIT build to one module per head dim.

An FP8 cache (`kv_dtype` float8_e4m3fn) runs its prefill, mixed and verify steps on the same
prefill kernel, reading e4m3 pages. PHLOEM_FP8_DECODE_KERNEL picks the kernel of its
decode-only steps (eager and graphs), resolved once per backend (`fp8_decode_kernel`,
`flashinfer_xqa.resolve_fp8_decode`, `fp8_decode_path`):

  auto       (default: unset) "xqa" on a GPU XQA runs on (sm_90/100/120) for a geometry it
             compiles, else "prefill": XQA measured 1.126x the prefill kernel on decode-heavy
             on an H200 (`flashinfer_xqa.py`)
  prefill    the fa2 prefill kernel at q_len 1, bf16 queries, e4m3 tiles converted (turns XQA
             off)
  cuda_core  the CUDA-core batch decode kernel, for the GQA groups it is compiled for
             (`FP8_DECODE_GROUP_SIZES`): it took these steps until 2026-11-27, when it measured
             2x slower than the prefill kernel over the same e4m3 pages on an H200 (batch 64,
             1,000 tokens of KV, GQA group 4: 153 vs 78 us a layer;
             benchmarks/results/2026-11-27-h200/)
  xqa        FlashInfer's XQA decode kernel, e4m3 math (`flashinfer_xqa.py`); a ValueError on a
             GPU it does not run on

The prefill and CUDA-core kernels take the layer's per-tensor scales as FlashInfer defines
them: `k_scale` multiplies the softmax scale, `v_scale` the output.
`benchmarks/fp8_kv_decode.py` times every FP8 decode kernel.

Per step, `begin_step(meta)` plans once on the host (FlashInfer's `plan()`: work partition,
split-KV decisions); every layer's `forward` then only launches the kernel. A decode step captured
in a CUDA graph uses a wrapper of its own per batch size, planned into fixed buffers
(`prepare_replay`), so the replayed kernel reads the new step's page table. A verify step of
speculative decoding captured in a CUDA graph (`worker/verify_graph.py`: every sequence padded
to q = 1 + k query tokens) likewise has a prefill wrapper per (batch, q), whose query offsets
never change (b * q) (`prepare_verify_replay`). FlashInfer's plan in CUDA-graph mode keeps the
batch size and the total query rows of the capture, sizing its tiles for the worst ragged split
of those rows; the launch grid is fixed, the work per block varies with the page table.

KV layout: phloem's cache tensor is FlashInfer's "NHD" paged layout (`[num_blocks, 2, block_size,
H_kv, D]`), passed as is; an "HND" cache (`kv_store.allocate_kv_cache`) is a transposed view of a
contiguous `[num_blocks, 2, H_kv, block_size, D]` tensor, FlashInfer's "HND", passed transposed
back. Page tables: `page_tables.py`.
"""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Mapping

import numpy as np
import torch

from phloem.config import KV_LAYOUTS
from phloem.ops.attention.flashinfer_xqa import (
    XQA_PAGE_SIZES,
    XqaDecode,
    XqaStep,
    check_xqa_device,
    cuda_capability,
    resolve_fp8_decode,
)
from phloem.ops.attention.interface import AttentionBackend
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.page_tables import paged_kv_layout
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata
from phloem.ops.staging import pinned

logger = logging.getLogger(__name__)

_WORKSPACE_BYTES = 256 << 20  # per 256 sequences of max_num_seqs (split-KV partial states)
# GQA groups whose FP8 decode steps can run FlashInfer's CUDA-core batch decode kernel
FP8_DECODE_GROUP_SIZES = (1, 2, 3, 4)
FP8_DECODE_KERNELS = ("prefill", "cuda_core", "xqa")  # the kernels of FP8 decode-only steps
FP8_DECODE_CHOICES = ("auto", *FP8_DECODE_KERNELS)  # PHLOEM_FP8_DECODE_KERNEL's values


def fp8_decode_kernel(environ: Mapping[str, str] | None = None) -> str:
    """The kernel asked for an FP8 cache's decode-only steps, from PHLOEM_FP8_DECODE_KERNEL
    (one of `FP8_DECODE_CHOICES`, module docstring; unset: "auto", which the backend resolves
    per device with `flashinfer_xqa.resolve_fp8_decode`).

    Raises:
        ValueError: naming PHLOEM_FP8_DECODE_KERNEL for another value.
    """
    env = os.environ if environ is None else environ
    choice = env.get("PHLOEM_FP8_DECODE_KERNEL", "auto")
    if choice not in FP8_DECODE_CHOICES:
        raise ValueError(
            f"PHLOEM_FP8_DECODE_KERNEL must be one of {FP8_DECODE_CHOICES}, got {choice!r}"
        )
    return choice


def fp8_decode_path(kernel: str, gqa_group: int, head_dim: int, block_size: int) -> str:
    """The kernel an FP8 cache's decode-only steps run when `kernel` (one of
    `FP8_DECODE_KERNELS`: "auto" resolved first) is asked for: the asked one where it is
    compiled for this geometry ("cuda_core": GQA groups in
    `FP8_DECODE_GROUP_SIZES`; "xqa": head_dim a multiple of 16 up to 256 and block_size in
    `XQA_PAGE_SIZES`), else "prefill". Pure: a graph's capture and its replays agree.

    Raises:
        ValueError: for a kernel not in `FP8_DECODE_KERNELS`.
    """
    if kernel not in FP8_DECODE_KERNELS:
        raise ValueError(f"FP8 decode kernel must be one of {FP8_DECODE_KERNELS}, got {kernel!r}")
    if kernel == "cuda_core" and gqa_group in FP8_DECODE_GROUP_SIZES:
        return kernel
    if kernel == "xqa" and head_dim % 16 == 0 and head_dim <= 256 and block_size in XQA_PAGE_SIZES:
        return kernel
    return "prefill"


def fp8_decode_on_cuda_cores(gqa_group: int) -> bool:
    """Whether an FP8 cache's decode-only steps with this GQA group (query heads per KV head)
    run FlashInfer's CUDA-core batch decode kernel (`fp8_decode_kernel`)."""
    return gqa_group in FP8_DECODE_GROUP_SIZES and fp8_decode_kernel() == "cuda_core"


def tensor_max(*args, **kwargs):
    """Python's `max`, but one `Tensor.max()` for a single non-empty 1-D CPU tensor.

    The builtin iterates a tensor element by element, four tensor ops each (select, gt,
    is_nonzero, item: a few us apiece); the result is the same 0-d tensor of the largest value.
    """
    if len(args) == 1 and not kwargs:
        (x,) = args
        if isinstance(x, torch.Tensor) and x.dim() == 1 and x.device.type == "cpu" and x.numel():
            return x.max()
    return builtins.max(*args, **kwargs)


def _install_tensor_max(module) -> None:
    """Make `module`'s global name `max` `tensor_max` (FlashInfer's prefill module).

    FlashInfer 0.6's `BatchPrefillWithPagedKVCacheWrapper.plan` takes the longest KV of a step
    as `max(kv_lens_arr_host)` over a host tensor: ~2,000 tensor ops at 1,024 sequences, ~5 ms
    of host time a step on an H200 machine, in series with the launch of every planned step
    (profiled in benchmarks/results/2026-11-27d-h200). Its `max_sequence_kv` argument would skip
    that loop but also skips the host KV lengths its fa2 planner needs (an `UnboundLocalError`).
    The module-level name shadows the builtin for that module only; every other call of `max`
    there returns what the builtin returns.
    """
    if getattr(module, "max", None) is not tensor_max:
        module.max = tensor_max


class FlashInferAttention(AttentionBackend):
    """The FlashInfer attention backend (CUDA only; see the module docstring).

    Args:
        num_heads, num_kv_heads, head_dim: this rank's attention geometry.
        dtype: dtype of queries and outputs (bf16 or fp16).
        kv_dtype: dtype of the KV cache (default `dtype`; torch.float8_e4m3fn for an FP8 cache).
        device: the CUDA device.
        scale: softmax scale (default head_dim ** -0.5); every layer must use the same.
        max_num_blocks_per_seq: longest block table a sequence can have; sizes the page-index
            buffer that the CUDA-graph wrappers share.
        max_num_seqs: largest batch of a step; sizes the workspace (FlashInfer's split-KV
            partial states grow with the batch: 256 MiB per 256 sequences).
        kernel_backend: FlashInfer's prefill kernel family for eager steps, "fa2" (default:
            any GPU, one module per head dim) or "fa3" (Hopper only; JIT-built on first use);
            graph steps always use "fa2".
        kv_layout: "NHD" or "HND", the layout of the caches `forward` will get (see above).
        fp8_decode: the kernel asked for an FP8 cache's decode-only steps (`FP8_DECODE_CHOICES`;
            None: PHLOEM_FP8_DECODE_KERNEL's, "auto" when unset: XQA where it runs, module
            docstring); unused for a cache in the query's dtype.
    Raises:
        ValueError: for an unknown kv_layout or fp8_decode, num_heads not a multiple of
            num_kv_heads, or "xqa" asked for on a GPU XQA does not run on.
    """

    name = "flashinfer"
    needs_block_tables = False  # plans from `block_tables_cpu`
    supports_cuda_graphs = True
    supports_verify_graphs = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scale: float | None = None,
        kv_dtype: torch.dtype | None = None,
        max_num_blocks_per_seq: int = 8192,
        max_num_seqs: int = 256,
        kernel_backend: str = "fa2",
        kv_layout: str = "NHD",
        fp8_decode: str | None = None,
    ) -> None:
        import flashinfer
        import flashinfer.prefill

        _install_tensor_max(flashinfer.prefill)
        self._flashinfer = flashinfer
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {list(KV_LAYOUTS)}, got {kv_layout!r}")
        self.kv_layout = kv_layout
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.device = torch.device(device)
        self.scale = head_dim**-0.5 if scale is None else scale
        self.max_num_blocks_per_seq = max_num_blocks_per_seq
        # FP8 cache: the kernel of its decode-only steps, "auto" resolved for this device once
        # (module docstring), so every plan, graph capture and replay takes the same path
        self.fp8_decode_kernel = "prefill"
        if self.kv_dtype == torch.float8_e4m3fn:
            asked = fp8_decode_kernel() if fp8_decode is None else fp8_decode
            self.fp8_decode_kernel = resolve_fp8_decode(asked, cuda_capability(self.device))
            logger.info("FP8 KV cache: decode-only steps on the %s kernel (asked: %s; the "
                        "prefill kernel for a geometry it is not compiled for)",
                        self.fp8_decode_kernel, asked)  # fmt: skip
        fp8_decode_path(self.fp8_decode_kernel, 1, head_dim, 16)  # validates the name
        check_xqa_device(self.fp8_decode_kernel, self.device)
        workspace_bytes = _WORKSPACE_BYTES * max(1, -(-max_num_seqs // 256))
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._graph_kv_indices: torch.Tensor | None = None  # shared by the graph wrappers
        self._eager = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout, backend=kernel_backend
        )
        self._graph_wrappers: dict[int, object] = {}
        self._verify_wrappers: dict[tuple[int, int], object] = {}  # (batch, q) -> wrapper
        self._eager_decode = None
        self._xqa = XqaDecode(self.device, max_num_blocks_per_seq)  # PHLOEM_FP8_DECODE_KERNEL=xqa
        self._active = None
        self._num_query_tokens = 0

    # -- planning --------------------------------------------------------------------------------

    def decode_path(self, block_size: int) -> str:
        """The kernel of this backend's decode-only steps at `block_size` ("prefill",
        "cuda_core" or "xqa": `fp8_decode_path`; always "prefill" for a 16-bit cache)."""
        return fp8_decode_path(self.fp8_decode_kernel, self.num_heads // self.num_kv_heads,
                               self.head_dim, block_size)  # fmt: skip

    def _graph_wrapper(self, batch_size: int, path: str = "prefill"):
        """The fixed-buffer wrapper for graphs of `batch_size` decode sequences on `path`'s
        kernel ("prefill" or "cuda_core"; made once)."""
        wrapper = self._graph_wrappers.get(batch_size)
        if wrapper is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            self._graph_indices(batch_size * self.max_num_blocks_per_seq)
            if path == "cuda_core":
                wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace,
                    self.kv_layout,
                    use_cuda_graph=True,
                    use_tensor_cores=False,
                    paged_kv_indptr_buffer=torch.zeros(batch_size + 1, **i32),
                    paged_kv_indices_buffer=self._graph_kv_indices,
                    paged_kv_last_page_len_buffer=torch.zeros(batch_size, **i32),
                )
            else:
                wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace,
                    self.kv_layout,
                    use_cuda_graph=True,
                    qo_indptr_buf=torch.arange(batch_size + 1, **i32),
                    paged_kv_indptr_buf=torch.zeros(batch_size + 1, **i32),
                    paged_kv_indices_buf=self._graph_kv_indices,
                    paged_kv_last_page_len_buf=torch.zeros(batch_size, **i32),
                    backend="fa2",
                )
            self._graph_wrappers[batch_size] = wrapper
        return wrapper

    def _graph_indices(self, need: int) -> torch.Tensor:
        """The page-index buffer of the graph wrappers made from now on, grown to `need`
        entries. One buffer serves every bucket of the decode and verify graphs (the largest
        is made first): only one graph replays at a time, and each replay's plan rewrites the
        buffer first (wrappers made before a growth keep the old one)."""
        if self._graph_kv_indices is None or self._graph_kv_indices.numel() < need:
            self._graph_kv_indices = torch.zeros(need, dtype=torch.int32, device=self.device)
        return self._graph_kv_indices

    def _verify_wrapper(self, batch_size: int, query_len: int, block_size: int):
        """The fixed-buffer prefill wrapper of verify graphs of `batch_size` sequences of
        `query_len` query tokens each (made once): a padded sequence's KV is at most
        max_num_blocks_per_seq pages plus the pages its query_len - 1 padding tokens add."""
        wrapper = self._verify_wrappers.get((batch_size, query_len))
        if wrapper is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            pages = self.max_num_blocks_per_seq + -(-query_len // block_size)
            wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace,
                self.kv_layout,
                use_cuda_graph=True,
                qo_indptr_buf=torch.arange(batch_size + 1, **i32) * query_len,
                paged_kv_indptr_buf=torch.zeros(batch_size + 1, **i32),
                paged_kv_indices_buf=self._graph_indices(batch_size * pages),
                paged_kv_last_page_len_buf=torch.zeros(batch_size, **i32),
                backend="fa2",
            )
            self._verify_wrappers[batch_size, query_len] = wrapper
        return wrapper

    def _eager_decode_wrapper(self):
        """The FP8 cache's decode wrapper for eager decode-only steps (made on first use)."""
        if self._eager_decode is None:
            self._eager_decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, self.kv_layout, use_tensor_cores=False
            )
        return self._eager_decode

    def _plan_xqa(self, meta: AttentionMetadata, graph: bool) -> None:
        """Plan an XQA decode step (`XqaDecode.plan`), which becomes the active one."""
        self._active = self._xqa.plan(meta, graph)
        self._num_query_tokens = meta.query_start_loc_cpu[-1]

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Plan an eager step (host work, one small host-to-device copy). Call once per step,
        before the forward pass; mutates the wrapper the step's layers will use."""
        path = self.decode_path(meta.block_size) if meta.max_query_len == 1 else "prefill"
        if path == "xqa":
            self._plan_xqa(meta, graph=False)
        elif path == "cuda_core":
            self._plan(meta, self._eager_decode_wrapper())
        else:
            self._plan(meta, self._eager)

    def prepare_replay(
        self,
        meta: AttentionMetadata,
        variant: str = "plain",
        groups: SharedPrefixMetadata | None = None,
    ) -> None:
        """Plan a decode step (every q_len 1, padded to the graph's batch by whole dummy
        sequences) into the fixed buffers of the wrapper for `meta.num_seqs` sequences, before
        the capture or replay of its "plain" graph. `groups` is not read (no prefix sharing).

        Raises:
            ValueError: for another variant or a step that is not decode-only.
        """
        if variant != "plain":
            raise ValueError(f"unknown CUDA-graph variant {variant!r} for {self.name!r}")
        if meta.max_query_len != 1:
            raise ValueError("CUDA-graph steps must be decode-only (q_len 1)")
        path = self.decode_path(meta.block_size)
        if path == "xqa":
            self._plan_xqa(meta, graph=True)
        else:
            self._plan(meta, self._graph_wrapper(meta.num_seqs, path))

    def prepare_verify_replay(self, meta: AttentionMetadata) -> None:
        """Plan a padded verify step (every sequence `meta.max_query_len` query tokens) into
        the fixed buffers of the wrapper for `meta.num_seqs` sequences of that length, before
        the capture or a replay of its verify graph; always the fa2 prefill kernel (an FP8
        cache's too).

        Raises:
            ValueError: if the sequences' query lengths differ.
        """
        q_len = meta.max_query_len
        if meta.query_start_loc_cpu[-1] != q_len * meta.num_seqs:
            raise ValueError(f"verify CUDA-graph steps need {q_len} query tokens a sequence")
        self._plan(meta, self._verify_wrapper(meta.num_seqs, q_len, meta.block_size))

    def _plan(self, meta: AttentionMetadata, wrapper) -> None:
        """FlashInfer's `plan()` of the step into `wrapper`, which becomes the active one."""
        kv_indptr, kv_indices, last_page_len = paged_kv_layout(meta)
        # FlashInfer copies a HOST page-index tensor into a CUDA-graph wrapper's buffer with a
        # blocking copy: the host would wait for every queued kernel (under async scheduling,
        # the whole step in flight) before it could launch the next one. Sent ahead from pinned
        # memory, the indices arrive by a device-to-device copy that waits for nothing.
        kv_indices = kv_indices.to(self.device, non_blocking=True)
        self._active = wrapper
        self._num_query_tokens = meta.query_start_loc_cpu[-1]
        if isinstance(wrapper, self._flashinfer.BatchDecodeWithPagedKVCacheWrapper):
            wrapper.plan(
                kv_indptr,
                kv_indices,
                last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                meta.block_size,
                sm_scale=self.scale,
                q_data_type=self.dtype,
                kv_data_type=self.kv_dtype,
            )
            return
        qo_indptr = pinned(np.array(meta.query_start_loc_cpu, dtype=np.int32))
        # The longest query given here: without it `plan()` finds it with Python's `max` over a
        # host tensor, tensor ops a sequence (see `_install_tensor_max` for the longest KV).
        wrapper.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            meta.block_size,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
            max_token_per_sequence=meta.max_query_len,
        )

    # -- the kernel ------------------------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Causal paged attention (the contract of `AttentionBackend.forward`).

        Plans lazily if `begin_step` was not called for this step (tests, other callers); query
        tokens past `query_start_loc[-1]` (padding) get zeros. `out` (contiguous, query's shape
        and dtype), if given, receives the result (and is returned). An FP8 cache's `k_scale`
        and `v_scale` go to FlashInfer's `run` (constants of a CUDA-graph capture), or to XQA
        as its bmm1 / bmm2 scales.
        """
        if abs(scale - self.scale) > 1e-6 * self.scale:
            raise ValueError(f"scale {scale} differs from the planned softmax scale {self.scale}")
        if self._active is None:
            self.begin_step(meta)
        if self.kv_layout == "HND":
            kv_cache = kv_cache.transpose(2, 3)  # the contiguous [num_blocks, 2, H_kv, bs, D]
        num_tokens = self._num_query_tokens
        if isinstance(self._active, XqaStep):
            out = torch.empty_like(query) if out is None else out
            out[num_tokens:].zero_()
            self._xqa.run(self._active, query[:num_tokens], kv_cache, out[:num_tokens],
                          self.scale * k_scale, v_scale, self.kv_layout)  # fmt: skip
            return out
        scales = {}
        if self.kv_dtype == torch.float8_e4m3fn:  # a scale of 1.0 is left out (run() would
            # still launch an elementwise multiply of the output for v_scale)
            scales = {k: s for k, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s != 1.0}
        # FlashInfer's run() zero-fills an output it allocates itself (a fill kernel per layer
        # and step: 32 a decode step of Llama-3.1-8B); its kernel writes every planned row.
        out = torch.empty_like(query) if out is None else out
        if num_tokens == query.shape[0]:
            return self._active.run(query, kv_cache, out=out, **scales)
        out[num_tokens:].zero_()
        self._active.run(query[:num_tokens], kv_cache, out=out[:num_tokens], **scales)
        return out

    def end_step(self) -> None:
        """Forget the step's plan (the next forward without `begin_step` plans again)."""
        self._active = None
