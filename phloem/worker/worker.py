"""One worker: a device, the model's weights on it, a KV pool sized for it, and a model runner.

Tensor-parallel ranks will each run one of these; today there is one rank.
"""

from __future__ import annotations

import logging

import torch

from phloem.config import CacheConfig, ModelConfig
from phloem.ops.attention.interface import get_attention_backend
from phloem.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda if available, else cpu. Raises ValueError for cuda without a GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" -> float32 on CPU, bfloat16 on GPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens over all layers [bytes]."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element


class Worker:
    """Loads the model and builds its runner.

    Args:
        model_config, cache_config: this worker's parts of the engine config.
        source, hf_config: the resolved checkpoint and its transformers config.
        seed: the sampler's seed; eos_token_id: banned below `min_tokens`.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        source,
        hf_config,
        seed: int = 0,
        eos_token_id: int | None = None,
    ) -> None:
        from phloem.models.loader import load_model

        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        torch.manual_seed(seed)
        self.model = load_model(
            source, hf_config, self.dtype, self.device, load_format=model_config.load_format
        )
        self.num_blocks = self._num_kv_blocks(cache_config)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens)",
            self.num_blocks,
            cache_config.block_size,
            self.num_blocks * cache_config.block_size,
        )
        self.model_runner = ModelRunner(
            self.model,
            num_blocks=self.num_blocks,
            block_size=cache_config.block_size,
            kv_dtype=self.dtype,
            device=self.device,
            backend=get_attention_backend("reference"),
            seed=seed,
            eos_token_id=eos_token_id,
        )

    def _num_kv_blocks(self, cache: CacheConfig) -> int:
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        per_block = kv_bytes_per_block(self.model, cache.block_size, self.dtype)
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cache.gpu_memory_utilization) - used
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; "
                "raise kv_cache_memory_bytes or gpu_memory_utilization"
            )
        return num_blocks
