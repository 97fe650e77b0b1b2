"""The attention layer: writes this step's K/V into its layer's paged cache, then calls the backend.

It reads everything step-specific from `phloem.forward_context.get_forward_context()`: the metadata,
`kv_caches[layer_idx]` and the backend. It owns no kernel: given the model's RotaryEmbedding, it
rotates q and k itself, on CUDA with the fused RoPE + KV-write Triton kernel
(`phloem.ops.rope_kv`, imported lazily; it skips negative slots on the device), elsewhere with the
module and a KV write: sync-free `write_kv_slots` when the context says every slot is valid
(`ForwardContext.valid_slots`, the model runner's steps), else `write_kv`, which skips -1 slots.
With PHLOEM_FUSED_QKV_ROPE on (the default) a decode step's QKV projection may do both itself
(`phloem.ops.skinny_rope`, given `rope_kv_args`); `store_kv` is then not called.

FP8 KV cache scales: each layer has one `k_scale` and one `v_scale` (fp32 per tensor, Python
floats: constants of a CUDA-graph capture). An FP8 cache stores k / k_scale and v / v_scale in
e4m3 (`phloem.ops.kv_store`); every writer and backend gets them from here. They come from the
checkpoint when it has them (`kv_scale_targets`: HF / AutoFP8 `self_attn.k_scale` and
`v_scale`, or one `kv_scale` for both; compressed-tensors' `k_proj.output_scale` and
`v_proj.output_scale`); otherwise they are 1.0 (vLLM's default without calibration), or with
`kv_cache_scales="calibrate"` set once at load from one forward pass
(`phloem.worker.kv_calibration`, before any CUDA graph is captured). e4m3 keeps 3 mantissa bits
over its normal range, 2^-6 to 448, so a scale only matters for values outside it
(benchmarks/results/2026-11-27f-cpu-fp8-kv-scales). A model whose K or V exceed 448 needs
checkpoint or calibrated scales (beyond 448 * scale, values clamp). A bf16/fp32 cache ignores
them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from phloem.forward_context import get_forward_context
from phloem.layers.linear import CheckpointSlice, Loaded
from phloem.layers.quantization.base import skinny_rope_module
from phloem.ops.kv_store import FP8_KV_DTYPE, check_kv_scale, write_kv, write_kv_slots

if TYPE_CHECKING:
    from phloem.layers.rotary import RotaryEmbedding
    from phloem.ops.skinny_rope import RopeKv

# Checkpoint KV-scale names (suffix after "<layer>.self_attn") -> which of the layer's scales.
_KV_SCALE_SUFFIXES = {
    "k_scale": ("k",),
    "v_scale": ("v",),
    "kv_scale": ("k", "v"),  # one scale for both (older AutoFP8 checkpoints)
    "k_proj.output_scale": ("k",),  # compressed-tensors' kv_cache_scheme, older layout
    "v_proj.output_scale": ("v",),
    "q_scale": (),  # FP8 attention inputs: phloem keeps q in the model dtype (not read)
    "prob_scale": (),
}


def kv_scale_targets(name: str) -> tuple[str, tuple[str, ...]] | None:
    """Where a checkpoint's attention scale tensor goes: (the `Attention` module's name, which
    scales: ("k",), ("v",), both, or () for one phloem does not read), or None when `name` is
    not an attention scale. E.g. "model.layers.3.self_attn.k_scale" ->
    ("model.layers.3.self_attn.attn", ("k",))."""
    head, sep, tail = name.partition(".self_attn.")
    if not sep or tail not in _KV_SCALE_SUFFIXES:
        return None
    return f"{head}.self_attn.attn", _KV_SCALE_SUFFIXES[tail]


class Attention(nn.Module):
    """Paged causal attention of one layer (no parameters).

    Args:
        num_heads: query heads (this TP rank's); num_kv_heads: KV heads; head_dim: per head;
        scale: softmax scale; layer_idx: index into the forward context's `kv_caches`.

    Attributes:
        k_scale, v_scale: the layer's FP8 KV scales (floats > 0; 1.0 unless the checkpoint sets
            them through `load_kv_scale` or `phloem.worker.kv_calibration` calibrates them).
        kv_scale_source: where they came from: "default" (1.0), "checkpoint" or "calibrated".
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
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.kv_scale_source = "default"  # "checkpoint" (load_kv_scale) or "calibrated"

    def load_kv_scale(self, which: tuple[str, ...], tensor: Loaded, name: str) -> None:
        """Set the scales in `which` ("k", "v") from the checkpoint tensor `name` (a tensor, or
        under tensor parallelism a lazy `CheckpointSlice`: every rank reads the whole scalar;
        mutates the layer).

        Raises:
            ValueError: naming the tensor, unless it holds one finite value > 0 (per-tensor
                scales only; a per-head or per-channel scale is refused, not averaged).
        """
        if isinstance(tensor, CheckpointSlice):
            tensor = tensor.full()
        if tensor.numel() != 1:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)}; phloem's FP8 KV cache takes one "
                "per-tensor scale (shape [] or [1])"
            )
        value = check_kv_scale(name, float(tensor.reshape(()).float()))
        for kind in which:
            setattr(self, f"{kind}_scale", value)
        if which:
            self.kv_scale_source = "checkpoint"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        rotary_emb: RotaryEmbedding | None = None,
    ) -> torch.Tensor:
        """Attention over the step's packed tokens: `store_kv`, then `attend`.

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
        out = self.attend(self.store_kv(q, k, v, positions, rotary_emb))
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        rotary_emb: RotaryEmbedding | None = None,
    ) -> torch.Tensor:
        """The part before the backend call (`forward`'s arguments): RoPE on q and k when
        `rotary_emb` is given, and the write of k and v into the layer's cache at the context's
        `slot_mapping` (mutates `kv_caches[layer_idx]`). Without a host sync when the context
        has `valid_slots`, so a CUDA graph can capture it (the piecewise graphs of
        `phloem.worker.piecewise_graph` end here).

        Returns:
            the rotated q, [T, num_heads, head_dim] in q's dtype.
        """
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.layer_idx]
        slot_mapping = ctx.attn_metadata.slot_mapping
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # views for the QKV split
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        ks, vs = self._kv_scales(kv_cache)
        fused = _rope_kv_kernel(q) if rotary_emb is not None else None
        if fused is not None and rotary_emb is not None:  # fused implies a rotary_emb
            return fused(positions, q, k, v, rotary_emb.cos, rotary_emb.sin, kv_cache,
                         slot_mapping, ks, vs)  # fmt: skip
        if rotary_emb is not None:
            q, k = rotary_emb(positions, q, k)
        if ctx.valid_slots:
            write_kv_slots(kv_cache, slot_mapping, k, v, ks, vs)
        else:
            write_kv(kv_cache, k, v, slot_mapping, ks, vs)
        return q

    def rope_kv_args(self, positions: torch.Tensor, rotary_emb: RotaryEmbedding) -> RopeKv | None:
        """What a QKV projection that rotates q and k and writes this layer's K/V itself needs
        (`phloem.ops.skinny_rope.RopeKv`: the step's positions and slots from the forward
        context, the cos/sin table, this layer's cache and scales), or None where that fusion
        is off (PHLOEM_FUSED_QKV_ROPE=0, or no skinny GEMM: `skinny_rope_module`).
        Reads host metadata only (no sync: CUDA-graph safe)."""
        fused = skinny_rope_module()
        if fused is None:
            return None
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.layer_idx]
        ks, vs = self._kv_scales(kv_cache)
        return fused.RopeKv(positions, rotary_emb.cos, rotary_emb.sin, kv_cache,
                            ctx.attn_metadata.slot_mapping, ks, vs, self.num_heads,
                            self.num_kv_heads, self.head_dim)  # fmt: skip

    def attend(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The backend call: attention of q [T, num_heads, head_dim] (rotated, its K/V already
        in the cache: `store_kv`) over the context's step (`AttentionBackend.forward`), into
        `out` when given (q's shape and dtype, contiguous). Returns [T, num_heads, head_dim]."""
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.layer_idx]
        ks, vs = self._kv_scales(kv_cache)
        return ctx.backend.forward(q, kv_cache, ctx.attn_metadata, self.scale, out, ks, vs)

    def _kv_scales(self, kv_cache: torch.Tensor) -> tuple[float, float]:
        """(k_scale, v_scale) for an FP8 cache; (1.0, 1.0) for any other."""
        return (self.k_scale, self.v_scale) if kv_cache.dtype == FP8_KV_DTYPE else (1.0, 1.0)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"layer={self.layer_idx}, k_scale={self.k_scale:g}, v_scale={self.v_scale:g}"
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
