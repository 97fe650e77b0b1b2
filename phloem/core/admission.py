"""Memory-centric admission: may a waiting request start beside the running ones (BatchLLM §4.3)?

A request is admitted only if the KV blocks it will need to finish (prompt + max_tokens, net of
the shared blocks it starts from) fit beside what the running requests still need, so admitted
requests rarely have to be preempted. A request without `max_tokens` reserves its tokens plus
one block. The first request is always admitted (preemption stays the safety net). With chunked
prefill off, a request's remaining tokens must also fit the step's token budget.

Balanced waves: when the queue's requests all need more KV than the pool holds, admission by
finishing size runs in waves (the pool fills, its requests finish at about the same time, the
next ones start), and the last wave can be a small remainder that decodes for its whole output at
a small batch, each step still reading all the weights (decode-heavy 500 x 1000/1000 on an H200:
~428 requests, then ~72 for another 1,000 steps). So while the KV the running and waiting
requests need to finish, D, is more than one pool but at most `MAX_BALANCED_WAVES` pools, and
every waiting request decodes long (`LONG_DECODE_RATIO`), the running requests' own blocks are
capped at D / ceil(D / pool): waves of equal size (250 + 250 there; -3.8% modelled,
benchmarks/results/2026-11-27h-cpu-decode-waves). The cap only admits less than the rule above:
it adds no preemption and changes no output. `PHLOEM_BALANCED_WAVES=0` turns it off (read when
the admission is built).

Reads counts only: allocates nothing; `reserved_blocks` sets the wave cap of the admission pass
it starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from phloem.config import SchedulerConfig
from phloem.core.kv_manager import KVManager
from phloem.core.request import Request

MAX_BALANCED_WAVES = 2  # balance the waves only while the queue needs at most this many pools
# ... and only while every waiting request decodes at least this many times the steps that
# prefilling a pool's worth of tokens takes: only then do the waves stay apart and a remainder
# decode alone (decode-heavy 1000/1000: 1,000 steps against ~105 at 8,192 tokens a step;
# prefill-heavy 2048/128 and batchllm's 100 outputs are not balanced)
LONG_DECODE_RATIO = 2


class Admission:
    """The admission rule over one KV manager.

    Args:
        config: `memory_centric_admission`, `enable_chunked_prefill`, `max_model_len`.
        kv_manager: block tables and the pool's reclaimable blocks (read only).
        balanced_waves: cap the waves (module docstring); None reads `PHLOEM_BALANCED_WAVES`
            (on unless "0"). Only with memory-centric admission.
    """

    def __init__(
        self, config: SchedulerConfig, kv_manager: KVManager, balanced_waves: bool | None = None
    ) -> None:
        self.config = config
        self.kv = kv_manager
        if balanced_waves is None:
            balanced_waves = os.environ.get("PHLOEM_BALANCED_WAVES", "1") != "0"
        self.balanced_waves = balanced_waves
        # this admission pass's cap (`reserved_blocks`) on reserved - reclaimable [blocks]
        self._wave_limit: float = float("inf")

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
        reclaimable = self.kv.num_reclaimable_blocks
        if need + reserved > reclaimable:
            return False
        # the pass's admissions so far hold (reclaimable_0 - reclaimable) and reserve the rest
        return need + reserved - reclaimable <= self._wave_limit

    def reserved_blocks(self, running: list[Request], waiting: Iterable[Request] = ()) -> int:
        """Start an admission pass: Σ `blocks_to_finish` over the running requests, 0 without
        memory-centric admission [blocks]. With balanced waves, also sets the pass's cap on
        the running requests' own blocks from the `waiting` requests' needs (`wave_cap`)."""
        if not self.config.memory_centric_admission:
            return 0
        reserved = self.blocks_to_finish(running)
        self._wave_limit = float("inf")
        if self.balanced_waves and self._head_may_fit(waiting, reserved):
            room = self.wave_room(running, waiting)
            if room is not None:  # admitted own blocks: (reserved + held) - (reserved_0 + held_0)
                self._wave_limit = room + reserved - self.kv.num_reclaimable_blocks
        return reserved

    def _head_may_fit(self, waiting: Iterable[Request], reserved: int) -> bool:
        """Whether the head of `waiting` could fit by finishing size if all but the last token
        it holds came from shared blocks: when not, this pass admits nothing and needs no wave
        cap (the cap's walk over the queue is skipped in the steps of a full pool). A head held
        back by `admission_gate` lets a later request in without the cap: by finishing size."""
        head = next(iter(waiting), None)
        if head is None:
            return False
        block_size = self.kv.block_size
        end = min(head.num_prompt_tokens + (head.sampling_params.max_tokens or block_size),
                  self.config.max_model_len)  # fmt: skip
        least = -(-end // block_size) - (head.num_tokens - 1) // block_size
        return least + reserved <= self.kv.num_reclaimable_blocks

    def wave_room(self, running: list[Request], waiting: Iterable[Request]) -> int | None:
        """Own blocks the requests admitted from `waiting` may add to the running ones' before
        the waves are unequal [blocks]: D / ceil(D / pool) less the running requests' own blocks
        at their end, where D = those + the waiting requests' own blocks at their end (a
        group's unheld prefix once) and pool = the blocks no group prefix holds. None (no cap)
        when D fits one pool, needs more than `MAX_BALANCED_WAVES` pools, or a waiting request
        decodes fewer than `LONG_DECODE_RATIO` x pool x block_size / max_num_batched_tokens
        tokens. Walks `waiting` only until one of those is known."""
        held = sum(len(g.block_ids or ()) for g in self.kv.held_shared_prefixes())
        pool = self.kv.num_blocks - held
        block_size, max_model_len = self.kv.block_size, self.config.max_model_len
        min_decode = LONG_DECODE_RATIO * pool * block_size / self.config.max_num_batched_tokens
        limit = MAX_BALANCED_WAVES * pool
        own = demand = -1  # the running requests' own blocks, after the first waiting request
        unheld: set[int] = set()  # groups whose prefix is counted once, with their first member
        for request in waiting:
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is None or max_tokens < min_decode:
                return None
            if own < 0:
                own = demand = self.own_blocks_at_end(running)
            demand += -(-min(request.num_prompt_tokens + max_tokens, max_model_len) // block_size)
            group = request.shared_prefix
            if group is not None:
                demand -= group.prefix_len // block_size  # a member's own blocks
                if group.block_ids is None and id(group) not in unheld:
                    unheld.add(id(group))
                    demand += group.prefix_len // block_size
            if demand > limit:
                return None
        if demand <= pool:
            return None
        return -(-demand // -(-demand // pool)) - own

    def own_blocks_at_end(self, running: Iterable[Request]) -> int:
        """Σ over `running` of the blocks each holds at its end (as `blocks_to_finish` counts
        it), less those it started from (a group's prefix or radix-cache blocks:
        `num_cached_tokens`) [blocks]. One loop, no call per request."""
        block_size, max_model_len = self.kv.block_size, self.config.max_model_len
        tables = self.kv.block_tables
        total = 0
        for request in running:
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is None:
                end = request.num_tokens + block_size
            else:
                end = request.num_prompt_tokens + max_tokens
            end = -(-min(end, max_model_len) // block_size)
            held = len(tables.get(request.request_id, ()))
            total += (end if end > held else held) - request.num_cached_tokens // block_size
        return total

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
