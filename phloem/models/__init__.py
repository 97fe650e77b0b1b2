"""Model architectures (one file each), the registry, and checkpoint loading (HF dir or GGUF)."""

from phloem.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
