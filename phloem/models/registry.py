"""HF `architectures` string -> phloem model class (imported lazily, on lookup)."""

from __future__ import annotations

import importlib

# architecture -> (module under phloem.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    """The HF architecture names phloem can run, sorted."""
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None) -> type:
    """The model class for the first supported name in `architectures` (from the HF config).

    Raises:
        ValueError: if none is supported; the message names them and lists the supported ones.
    """
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            module = importlib.import_module(f"phloem.models.{module_name}")
            return getattr(module, class_name)
    raise ValueError(
        f"unsupported model architecture {architectures!r}; supported: {supported_architectures()}"
    )
