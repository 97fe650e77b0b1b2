"""Attention kernels behind one small interface (see interface.py)."""

from phloem.ops.attention.interface import (
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
