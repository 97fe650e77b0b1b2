"""The explicit per-step context that attention layers read (never module globals).

The model runner wraps each forward pass in `with forward_context(ctx):`; `Attention` layers call
`get_forward_context()` to find the step's metadata, their layer's KV cache and the backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from phloem.ops.attention.interface import AttentionBackend
from phloem.ops.attention.metadata import AttentionMetadata


@dataclass
class ForwardContext:
    """What one forward pass needs beyond input ids and positions.

    Attributes:
        attn_metadata: the step's attention metadata.
        kv_caches: one [num_blocks, 2, block_size, num_kv_heads, head_dim] tensor per layer,
            indexed by the attention layer's `layer_idx`.
        backend: the attention backend to call.
        valid_slots: True when every entry of `attn_metadata.slot_mapping` is a real slot
            (>= 0): the layers then write K/V with no filter and no host sync (which stream
            capture forbids and which would stall the GPU once per layer). The model runner's
            and the graph runner's steps always are (graph padding rows write to the scratch
            block). False (hand-built steps, tests): -1 slots are skipped, at the cost of one
            host sync per layer on a GPU (`kv_store.write_kv`).
    """

    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend
    valid_slots: bool = False


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` current for the duration of one forward pass (not re-entrant)."""
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    """The current context. Raises RuntimeError outside `forward_context`."""
    if _current is None:
        raise RuntimeError("attention layer called outside `with forward_context(...)`")
    return _current
