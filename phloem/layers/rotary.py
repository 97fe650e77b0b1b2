"""Rotary position embedding (RoPE), neox / HF `rotate_half` layout, applied by absolute positions.

For a head vector x of rotary_dim r (the first r of head_dim; the rest passes through):
    x1 = x[:r/2], x2 = x[r/2:r], f_i = inv_freq_i * position
    out = [x1 cos f - x2 sin f, x2 cos f + x1 sin f]
Supported `rope_type`s: "default", "linear" and "llama3" (Llama-3.1 frequency smoothing). Values match
transformers' float32 inv_freq and cos/sin bit for bit; the rotation runs in float32.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from phloem.layers.compilable import Compilable

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters_from_hf(hf_config: Any) -> dict[str, Any]:
    """The RoPE parameters of an HF config as one flat dict with at least `rope_theta`, `rope_type`.

    Reads transformers 5 `rope_parameters`, falling back to the older `rope_theta` + `rope_scaling`
    attributes. Raises NotImplementedError for per-layer-type RoPE dicts.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise NotImplementedError(f"per-layer-type RoPE parameters are not supported: {params}")
    legacy = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "llama3":
        params.setdefault(
            "original_max_position_embeddings", getattr(hf_config, "max_position_embeddings", None)
        )
    return params


def compute_inv_freq(rotary_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    """float32 [rotary_dim / 2] inverse frequencies for `rope` (see `rope_parameters_from_hf`).

    Raises:
        NotImplementedError: for an unsupported rope_type.
    """
    rope_type = rope.get("rope_type", "default")
    base = float(rope["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # wavelen < high_freq_wavelen: keep; > low_freq_wavelen: divide by factor; between: blend.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(Compilable):
    """Applies RoPE to q and k by absolute position, from a float32 cos/sin table.

    Args:
        head_dim: size of each head; rotary_dim: leading part of it that is rotated (even);
        max_position: table length [positions]; rope: parameters (`rope_parameters_from_hf`).
    The table is a non-persistent float32 buffer [max_position, rotary_dim / 2] each for cos and
    sin; keep it float32 (move the module with `.to(device)`, not `.to(dtype)`).
    """

    cos: torch.Tensor  # the buffers registered in __init__
    sin: torch.Tensor

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, rope: dict[str, Any]):
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(rotary_dim, rope)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.reshape(num_tokens, -1, self.head_dim)
        half = self.rotary_dim // 2
        x1 = x[..., :half].float()
        x2 = x[..., half : self.rotary_dim].float()
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.rotary_dim < self.head_dim:
            parts.append(x[..., self.rotary_dim :].float())
        return torch.cat(parts, dim=-1).to(x.dtype)

    def compute(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k.

        Args:
            positions: int64 [T], absolute positions in [0, max_position).
            query: [T, num_heads * head_dim] (or [T, num_heads, head_dim]); key likewise.
        Returns:
            (query, key) as new tensors [T, heads, head_dim] in the input dtypes.
        """
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, rotary_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max={self.max_position}"
