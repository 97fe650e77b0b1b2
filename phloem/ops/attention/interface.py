"""The attention-backend interface: what one model step hands to every attention kernel.

KV cache layout (one tensor per layer, FlashInfer's "NHD" paged layout):
    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
A token's *slot* is `block_id * block_size + offset_in_block`. Kernels always see that shape; its
memory may be head-major instead (`CacheConfig.kv_layout="HND"`: a strided view, see
`ops/kv_store.py`), so they index through the strides.

The tokens of one step are packed: the step holds B sequences, sequence b contributes the query
tokens `query_start_loc[b] : query_start_loc[b+1]`, which are its *last* q_len_b tokens, so

    |------------- seq_lens[b] (KV length after this step) -------------|
    |-- already in the KV cache --|--- q_len_b tokens computed now ---|

and query token i of sequence b sits at position seq_lens[b] - q_len_b + i (causal: it attends to
KV positions 0 .. that position). Prefill chunks (q_len > 1) and decode tokens (q_len = 1) mix
freely in one step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

logger = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """Per-step attention inputs; T = tokens in the step, B = sequences in the step.

    Attributes:
        slot_mapping: int64 [T]; KV slot each new token's K/V is written to (-1 = skip, padding).
        query_start_loc: int32 [B + 1]; cumulative query lengths (CSR offsets into the T tokens).
        seq_lens: int32 [B]; KV length of each sequence including this step's tokens [tokens].
        block_tables: int32 [B, max_blocks_per_seq]; block ids of each sequence, 0-padded.
        block_size: tokens per KV block.
        max_query_len: max q_len over the B sequences [tokens].
        max_seq_len: max seq_lens [tokens].
        query_start_loc_cpu / seq_lens_cpu: the same offsets as Python lists, for host-side loops.
        block_tables_cpu: the block ids of each sequence as Python lists (unpadded, at least
            ceil(seq_lens[b] / block_size) ids each), for backends that plan on the host
            (FlashInfer); None when the builder of the metadata did not provide them.
        prefix_lens_cpu: per sequence, the tokens at the start of its block table that are its
            prefix group's shared blocks (0 for none); read by the shared-prefix backend
            (`shared_prefix.py`) to batch a group's queries against the prefix KV once.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_tables_cpu: list[list[int]] | None = None
    prefix_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    """A paged attention kernel. Implementations: `reference.ReferenceAttention` (plain torch, the
    CPU path and the oracle); fast GPU backends are created lazily by `get_attention_backend`.

    A backend may also define `begin_step(meta, cuda_graph=False)`: the model runner calls it once
    per step, before the forward pass (and before replaying a captured CUDA graph), so the backend
    can plan the step on the host once instead of once per layer (FlashInfer's `plan()`).
    A backend that never reads the padded device `meta.block_tables` (it plans from
    `block_tables_cpu`) sets `needs_block_tables = False`, and the model runner skips building it.
    With `cuda_graph=True` the plan must write into buffers of fixed address that a graph captured
    for `meta.num_seqs` sequences reads.
    """

    name: str

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of the step's queries over each sequence's paged KV.

        Args:
            query: [T, num_heads, head_dim], model dtype.
            kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]; this step's K/V are
                already written (see `phloem.ops.kv_store.write_kv`).
            meta: the step's metadata.
            scale: softmax scale (usually head_dim ** -0.5).
        Returns:
            [T, num_heads, head_dim], same dtype as `query`. num_heads must be a multiple of
            num_kv_heads (GQA: query head h reads KV head h // (num_heads // num_kv_heads)).
        """
        ...


BACKENDS = ("auto", "reference", "flashinfer", "shared_prefix")


def get_attention_backend(name: str = "reference", **geometry) -> AttentionBackend:
    """Create an attention backend by name; fast backends import their library here, lazily.

    Args:
        name: "reference" (plain torch; the CPU path), "flashinfer" (paged FlashInfer kernels,
            CUDA only), "shared_prefix": prefix-shared (cascade) attention on steps where the
            cost rule says sharing pays (BatchLLM §5), wrapping the plain backend ("flashinfer"
            on CUDA when it imports, else "reference") for all other steps, or "auto": on a
            CUDA device with FlashInfer, "shared_prefix" over FlashInfer when Triton imports
            (else plain FlashInfer); otherwise the reference.
        geometry: what a planning backend needs up front, ignored by the reference:
            num_heads, num_kv_heads, head_dim, scale, dtype (of q), kv_dtype (of the KV cache,
            default dtype), device,
            max_num_blocks_per_seq (bound on a sequence's block table, for CUDA-graph buffers),
            max_num_seqs (largest batch of a step, sizes FlashInfer's workspace),
            kv_layout ("NHD" or "HND", the cache's memory layout, `kv_store.allocate_kv_cache`).
    Raises:
        ValueError: for an unknown backend name.
        ImportError / RuntimeError: "flashinfer" asked for explicitly but unavailable.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; supported: {list(BACKENDS)}")
    if name in ("auto", "shared_prefix"):
        plain = _plain_backend("auto", geometry)
        if name == "auto" and (plain.name != "flashinfer" or not _importable("triton")):
            return plain
        from phloem.ops.attention.shared_prefix import SharedPrefixAttention

        return SharedPrefixAttention(
            plain,
            num_heads=geometry.get("num_heads"),
            num_kv_heads=geometry.get("num_kv_heads"),
            head_dim=geometry.get("head_dim"),
            device=geometry.get("device"),
            prefill_backend=_hopper_prefill_backend(plain, geometry),
        )
    return _plain_backend(name, geometry)


def _hopper_prefill_backend(plain: AttentionBackend, geometry: dict) -> AttentionBackend | None:
    """FlashInfer's "fa3" prefill kernels for the long prefill chunks of shared-prefix steps, on
    Hopper (compute capability 9.x) when the plain backend is FlashInfer; else None. Its
    workspace is sized for 256 sequences (chunks of >= 64 tokens in an 8K-16K token step). None
    for an FP8 KV cache."""
    device = geometry.get("device")
    if plain.name != "flashinfer" or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    if geometry.get("kv_dtype", geometry.get("dtype")) != geometry.get("dtype"):
        return None  # fa3 reads a cache of the query's dtype; an FP8 cache stays on our kernel
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(**{**geometry, "max_num_seqs": 256}, kernel_backend="fa3")


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _plain_backend(name: str, geometry: dict) -> AttentionBackend:
    """ "reference", "flashinfer", or "auto" (FlashInfer on CUDA when it imports, else the
    reference), without prefix sharing."""
    device = geometry.get("device")
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if name == "auto":
        name = "reference"
        if on_cuda:
            try:
                import flashinfer  # noqa: F401

                name = "flashinfer"
            except ImportError as e:  # the reference runs anywhere, slowly
                logger.warning("FlashInfer unavailable (%s); using the reference attention", e)
    if name == "flashinfer":
        if not on_cuda:
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        from phloem.ops.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(**geometry)
    from phloem.ops.attention.reference import ReferenceAttention

    return ReferenceAttention()
