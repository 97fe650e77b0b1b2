"""Attention kernels behind one declared interface (`interface.AttentionBackend`), and the factory
that makes them by name, importing each fast backend (and its library) only when asked for.

Modules: `metadata` (what a step hands a kernel), `interface` (the backend ABC, the decode-plan
types), `reference` (plain torch), `flashinfer_backend`, and the shared-prefix (cascade) family:
`prefix_groups`, `shared_prefix_reference`, `sharing_rule`, `shared_prefix` (the backend),
`prefill_split`, `tile_plan`, `shared_prefix_triton` (kernels), `decode_graph_plan`,
`shared_prefix_flashinfer` (the library baseline); `small_decode` (decode steps of a few short
sequences in one split-KV launch, `small_decode_triton`; `small_decode_rule` says when: by
default on CUDA over FlashInfer, steps of <= 16 sequences within a KV-length rule).
"""

from __future__ import annotations

import logging

import torch

from phloem.config import ATTENTION_BACKENDS as BACKENDS  # the one list of names
from phloem.ops.attention.interface import AttentionBackend, DecodePath, DecodePlan
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.small_decode_rule import SmallDecodeSettings

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "DecodePath",
    "DecodePlan",
    "get_attention_backend",
]

logger = logging.getLogger(__name__)


# Head dims FlashInfer's Hopper and Ampere paged kernels compile for (others fail to build).
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def get_attention_backend(name: str = "reference", **geometry) -> AttentionBackend:
    """Create an attention backend by name; fast backends import their library here, lazily.

    Args:
        name: "reference" (plain torch; the CPU path), "flashinfer" (paged FlashInfer kernels,
            CUDA only), "shared_prefix": prefix-shared (cascade) attention on steps where the
            cost rule says sharing pays (BatchLLM §5), wrapping the plain backend ("flashinfer"
            on CUDA when it imports, else "reference") for all other steps, or "auto": on a
            CUDA device with FlashInfer, "shared_prefix" over FlashInfer when Triton imports
            (else plain FlashInfer); otherwise the reference. On Hopper the shared-prefix
            backend hands the long prefill chunks of eager steps to FlashInfer's fa3 kernels
            (`_hopper_prefill_backend`).
        geometry: what a planning backend needs up front, ignored by the reference:
            num_heads, num_kv_heads, head_dim, scale, dtype (of q), kv_dtype (of the KV cache,
            default dtype), device,
            max_num_blocks_per_seq (bound on a sequence's block table, for CUDA-graph buffers),
            max_num_seqs (largest batch of a step, sizes FlashInfer's workspace),
            kv_layout ("NHD" or "HND", the cache's memory layout, `kv_store.allocate_kv_cache`).
        The plain backend (under "shared_prefix" too) is wrapped in
        `small_decode.SmallDecodeAttention`, which runs decode-only steps of at most
        PHLOEM_SMALL_DECODE_MAX_BATCH (16) sequences itself: by default (PHLOEM_SMALL_DECODE_
        ATTENTION unset or "auto") FlashInfer on CUDA, for steps whose longest sequence is
        within `small_decode_rule.LengthRule`; with "1" any plain backend, any length; "0" none.
    Raises:
        ValueError: for an unknown backend name, or PHLOEM_FA3_PLAIN_PREFILL not 0 or 1, or a
            malformed PHLOEM_SMALL_DECODE_* value.
        ImportError / RuntimeError: "flashinfer" asked for explicitly but unavailable.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; supported: {list(BACKENDS)}")
    small = SmallDecodeSettings.from_env()  # PHLOEM_SMALL_DECODE_*, read once per backend
    if name in ("auto", "shared_prefix"):
        plain = _plain_backend("auto", geometry)
        if name == "auto" and (plain.name != "flashinfer" or not _importable("triton")):
            return _wrap_small_decode(plain, geometry, small)
        from phloem.ops.attention.prefill_split import plain_prefill_split
        from phloem.ops.attention.shared_prefix import SharedPrefixAttention

        return SharedPrefixAttention(
            _wrap_small_decode(plain, geometry, small),
            num_heads=geometry.get("num_heads"),
            num_kv_heads=geometry.get("num_kv_heads"),
            head_dim=geometry.get("head_dim"),
            device=geometry.get("device"),
            prefill_backend=_hopper_prefill_backend(plain, geometry),
            prefill_plain_steps=plain_prefill_split(),  # PHLOEM_FA3_PLAIN_PREFILL, read once
        )
    return _wrap_small_decode(_plain_backend(name, geometry), geometry, small)


def _hopper_prefill_backend(plain: AttentionBackend, geometry: dict) -> AttentionBackend | None:
    """FlashInfer's "fa3" prefill kernels for the long prefill chunks of eager steps (shared-prefix
    steps, and plain ones unless PHLOEM_FA3_PLAIN_PREFILL=0: `prefill_split`), on Hopper
    (compute capability 9.x) when the plain backend is FlashInfer; else None. Its workspace is
    sized for 256 sequences (chunks of >= 64 tokens in an 8K-16K token step; a step with more
    is not split, `PrefillSplit.max_num_seqs`). None for an FP8 KV cache."""
    device = geometry.get("device")
    if plain.name != "flashinfer" or torch.cuda.get_device_capability(device)[0] != 9:
        return None  # (FlashInfer is the plain backend only for head dims it compiles)
    if geometry.get("kv_dtype", geometry.get("dtype")) != geometry.get("dtype"):
        return None  # fa3 reads a cache of the query's dtype; an FP8 cache stays on our kernel
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(**{**geometry, "max_num_seqs": 256}, kernel_backend="fa3")


def _wrap_small_decode(
    plain: AttentionBackend, geometry: dict, settings: SmallDecodeSettings
) -> AttentionBackend:
    """`plain` wrapped in `small_decode.SmallDecodeAttention` where `settings` turn it on for
    it (`SmallDecodeSettings.enabled`) and the geometry is known, else `plain` itself; on a
    CUDA device without Triton, `plain` (logged)."""
    device = torch.device(geometry.get("device") or "cpu")
    need = ("num_heads", "num_kv_heads", "head_dim")
    if not settings.enabled(device, plain.name) or any(geometry.get(k) is None for k in need):
        return plain
    if device.type == "cuda" and not _importable("triton"):
        logger.warning("small decode attention off: Triton unavailable")
        return plain
    from phloem.ops.attention.small_decode import SmallDecodeAttention

    rule = settings.length_rule()
    logger.info("small decode attention: decode steps of <= %d sequences, %s",
                settings.max_batch, rule or "any length")  # fmt: skip
    return SmallDecodeAttention(
        plain, geometry["num_heads"], geometry["num_kv_heads"], geometry["head_dim"], device,
        settings.max_batch, geometry.get("max_num_blocks_per_seq") or 8192, length_rule=rule,
    )  # fmt: skip


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
        head_dim = geometry.get("head_dim")
        if on_cuda and head_dim not in FLASHINFER_HEAD_DIMS:
            logger.warning("head_dim %s: FlashInfer compiles %s only; using the reference "
                           "attention", head_dim, FLASHINFER_HEAD_DIMS)  # fmt: skip
        elif on_cuda:
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
