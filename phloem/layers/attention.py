"""The attention layer: writes this step's K/V into its layer's paged cache, then calls the backend.

It reads everything step-specific from `phloem.forward_context.get_forward_context()`: the metadata,
`kv_caches[layer_idx]` and the backend. It owns no kernel: given the model's RotaryEmbedding, it
rotates q and k itself, on CUDA with the fused RoPE + KV-write Triton kernel
(`phloem.ops.rope_kv`, imported lazily; it skips negative slots on the device), elsewhere with the
module and a KV write: sync-free `write_kv_slots` when the context says every slot is valid
(`ForwardContext.valid_slots`, the model runner's steps), else `write_kv`, which skips -1 slots.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from phloem.forward_context import get_forward_context
from phloem.ops.kv_store import write_kv, write_kv_slots


class Attention(nn.Module):
    """Paged causal attention of one layer (no parameters).

    Args:
        num_heads: query heads (this TP rank's); num_kv_heads: KV heads; head_dim: per head;
        scale: softmax scale; layer_idx: index into the forward context's `kv_caches`.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        rotary_emb: nn.Module | None = None,
    ) -> torch.Tensor:
        """Attention over the step's packed tokens.

        Args:
            q: [T, num_heads * head_dim] (or [T, num_heads, head_dim]); k, v: [T, num_kv_heads *
                head_dim] (or 3-D); views with a contiguous last dim are fine. k and v are written
                to the cache at `attn_metadata.slot_mapping` (mutates `kv_caches[layer_idx]`).
            positions: int64 [T] and rotary_emb (a `RotaryEmbedding`): when given, q and k are
                rotated first (RoPE), fused with the KV write on CUDA.
        Returns:
            [T, num_heads * head_dim] in q's dtype.
        Raises:
            RuntimeError: outside `with forward_context(...)`.
        """
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        kv_cache = ctx.kv_caches[self.layer_idx]
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # views for the QKV split
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        fused = _rope_kv_kernel(q) if rotary_emb is not None else None
        if fused is not None:
            q = fused(positions, q, k, v, rotary_emb.cos, rotary_emb.sin, kv_cache,
                      meta.slot_mapping)  # fmt: skip
        else:
            if rotary_emb is not None:
                q, k = rotary_emb(positions, q, k)
            if ctx.valid_slots:
                write_kv_slots(kv_cache, meta.slot_mapping, k, v)
            else:
                write_kv(kv_cache, k, v, meta.slot_mapping)
        out = ctx.backend.forward(q, kv_cache, meta, self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"layer={self.layer_idx}"
        )


def _rope_kv_kernel(q: torch.Tensor):
    """The fused RoPE + KV-write kernel for q's device: on CUDA where Triton imports, else None
    (tests swap this to run the kernel under the interpreter)."""
    return _fused_rope_kv() if q.is_cuda else None


@functools.cache
def _fused_rope_kv():
    """The Triton RoPE + KV-write kernel, or None where Triton does not import."""
    try:
        from phloem.ops.rope_kv import rope_and_write_kv
    except ImportError:
        return None
    return rope_and_write_kv
