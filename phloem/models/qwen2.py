"""Qwen2: the Llama architecture with biases on q/k/v (not on o_proj) and untied or tied embeddings.

Sliding-window layers (`use_sliding_window: true`) are rejected; released Qwen2/2.5 checkpoints have
it off.
"""

from __future__ import annotations

from typing import Any

from phloem.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """HF `Qwen2ForCausalLM`; same forward/load API as `LlamaForCausalLM`."""

    def attention_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return {"qkv_bias": True, "o_bias": False}
