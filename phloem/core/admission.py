"""Memory-centric admission: may a waiting request start beside the running ones (BatchLLM §4.3)?

A request is admitted only if the KV blocks it will need to finish (prompt + max_tokens, net of
the shared blocks it starts from) fit beside what the running requests still need, so admitted
requests rarely have to be preempted. A request without `max_tokens` reserves its tokens plus
one block. The first request is always admitted (preemption stays the safety net). With chunked
prefill off, a request's remaining tokens must also fit the step's token budget.

Pure functions of counts: allocates nothing, mutates nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from phloem.config import SchedulerConfig
from phloem.core.kv_manager import KVManager
from phloem.core.request import Request


class Admission:
    """The admission rule over one KV manager.

    Args:
        config: `memory_centric_admission`, `enable_chunked_prefill`, `max_model_len`.
        kv_manager: block tables and the pool's reclaimable blocks (read only).
    """

    def __init__(self, config: SchedulerConfig, kv_manager: KVManager) -> None:
        self.config = config
        self.kv = kv_manager

    def admissible(
        self,
        request: Request,
        budget: int,
        reserved: int,
        num_computed: int,
        running: list[Request],
        num_blocks_to_attach: int = 0,
    ) -> bool:
        """Whether a waiting `request` with `num_computed` tokens of KV (held, or about to be
        attached as `num_blocks_to_attach` shared blocks) may be admitted beside `running`
        requests that still need `reserved` blocks [blocks]: with chunked prefill off its
        remaining tokens must fit `budget` [tokens]; with memory-centric admission the blocks
        it needs to finish must fit the reclaimable ones (the first running request always
        fits)."""
        if not self.config.enable_chunked_prefill and request.num_tokens - num_computed > budget:
            return False
        if not self.config.memory_centric_admission or not running:
            return True
        need = self.blocks_to_finish((request,)) - num_blocks_to_attach
        return need + reserved <= self.kv.num_reclaimable_blocks

    def reserved_blocks(self, running: list[Request]) -> int:
        """Σ `blocks_to_finish` over the running requests, 0 without memory-centric admission
        [blocks]."""
        return self.blocks_to_finish(running) if self.config.memory_centric_admission else 0

    def blocks_to_finish(self, requests: Iterable[Request]) -> int:
        """Σ over `requests` of the blocks each still needs to reach its end: prompt +
        max_tokens, or without a declared budget its tokens plus one block; capped at the
        context [blocks]. One loop, no call per request: it runs over every running request in
        every step that has requests waiting."""
        block_size = self.kv.block_size
        max_model_len = self.config.max_model_len
        block_ids = self.kv.block_ids
        total = 0
        for request in requests:
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is None:
                end = request.num_tokens + block_size
            else:
                end = request.num_prompt_tokens + max_tokens
            if end > max_model_len:
                end = max_model_len
            need = -(-end // block_size) - len(block_ids(request.request_id))
            if need > 0:
                total += need
        return total
