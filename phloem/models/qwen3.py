"""Qwen3: the Llama architecture plus RMSNorm over head_dim on each q and k head, before RoPE.

    x -> qkv_proj -> q [T, H, D], k [T, H_kv, D] -> q_norm(q), k_norm(k) -> RoPE -> attention

Biases on q/k/v/o follow `attention_bias` (false in released checkpoints); `head_dim` is explicit in
the config (128 for most sizes, so H * D may differ from hidden_size).
"""

from __future__ import annotations

from typing import Any

from phloem.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """HF `Qwen3ForCausalLM`; same forward/load API as `LlamaForCausalLM`."""

    def attention_kwargs(self, hf_config: Any) -> dict[str, Any]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
