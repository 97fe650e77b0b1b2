"""Per-request block tables over the shared block pool, plus the two ways blocks are reused.

The KV manager owns the mapping request -> block ids (its block table). It allocates blocks for
the tokens a step schedules, lets a request start from blocks already computed (shared by
reference count, never copied), and drops a request's references when it finishes, is aborted
or is preempted. Reuse comes from:

- shared prefixes (`SharedPrefix`: BatchLLM groups and n > 1 siblings), whose blocks the group
  holds while it has unfinished members (the scheduler releases an idle group's hold earlier
  when KV runs short);
- the online radix prefix cache (`RadixCache`, SGLang RadixAttention), which keeps finished
  requests' full blocks and hands them to later requests by longest-prefix match, evicting
  least-recently-used unlocked leaves only when the pool runs dry.

Holders of a block reference: each block table that lists it, a `SharedPrefix` that holds it,
and the radix cache. A block is free exactly when none of these holds it.
"""

from __future__ import annotations

from collections.abc import Mapping

from phloem.core.block_allocator import BlockAllocator
from phloem.core.radix_tree import RadixCache, RadixNode
from phloem.core.request import Request, SharedPrefix


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVManager:
    """Block tables for all live requests.

    Args:
        num_blocks: size of the pool [blocks].
        block_size: tokens per block.
        enable_prefix_cache: keep finished requests' blocks in a radix cache for reuse.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = False) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_cache = RadixCache(block_size) if enable_prefix_cache else None
        self._block_tables: dict[str, list[int]] = {}
        # request -> (the radix node it holds locked, tokens on that node's root path)
        self._locked_nodes: dict[str, tuple[RadixNode, int]] = {}
        self._num_cached_prompt_blocks: dict[str, int] = {}
        self._held_prefixes: dict[int, SharedPrefix] = {}
        # One eviction scans the whole tree (O(nodes)); when the pool runs dry in steady state
        # every allocation would evict, so each eviction frees at least this many blocks.
        self.evict_batch_blocks = max(1, num_blocks // 128)
        self.num_prefix_cache_queries = 0  # prompt tokens looked up in the radix cache
        self.num_prefix_cache_hits = 0  # prompt tokens found there

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_reclaimable_blocks(self) -> int:
        """Free blocks plus those only the radix cache holds (evictable on demand)."""
        evictable = self.prefix_cache.num_evictable_blocks if self.prefix_cache else 0
        return self.allocator.num_free_blocks + evictable

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (its list, not a copy: do not mutate)."""
        return self._block_tables.get(request_id, [])

    @property
    def block_tables(self) -> Mapping[str, list[int]]:
        """Request id -> block table, for loops over every running request (read only: the
        lists themselves, not copies; a request without blocks is absent)."""
        return self._block_tables

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so that `num_computed_tokens + num_new_tokens` tokens fit [blocks]."""
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(self.block_ids(request.request_id)))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens`.

        Evicts radix-cache blocks (least recently used first, at least `evict_batch_blocks` at
        a time) if the free list is short. Mutates the request's block table
        (appends fresh blocks). Returns False, allocating nothing, when even eviction cannot
        free enough blocks.
        """
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed == 0:
            return True
        if needed > self.num_reclaimable_blocks:
            return False
        # Evicted blocks may still be in use elsewhere (a group or another request holds
        # them), so evict until enough are really free or nothing evictable is left; each
        # eviction takes at least `evict_batch_blocks` (LRU order), amortizing its tree scan.
        cache = self.prefix_cache
        while needed > self.allocator.num_free_blocks and cache and cache.num_evictable_blocks:
            short = needed - self.allocator.num_free_blocks
            self.allocator.decref(cache.evict(max(short, self.evict_batch_blocks)))
        if needed > self.allocator.num_free_blocks:
            return False
        table = self._block_tables.setdefault(request.request_id, [])
        table.extend(self.allocator.allocate(needed))
        return True

    # -- reuse ------------------------------------------------------------------------------

    def attach_blocks(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        """Start `request`'s (empty) block table with `block_ids` holding its first `num_tokens`
        tokens: adds a reference to each and sets `num_computed_tokens` and `num_cached_tokens`.

        Raises ValueError if the request already holds blocks.
        """
        if self._block_tables.get(request.request_id):
            raise ValueError(f"request {request.request_id} already holds blocks")
        self.allocator.incref(block_ids)
        self._block_tables[request.request_id] = list(block_ids)
        request.num_computed_tokens = num_tokens
        request.num_cached_tokens = num_tokens

    def match_prefix_cache(self, request: Request) -> None:
        """Start a fresh request from its longest cached prefix (at least one prompt token is
        left to compute, for logits). Locks the matched path until the request is freed."""
        if self.prefix_cache is None or self._block_tables.get(request.request_id):
            return
        self.num_prefix_cache_queries += request.num_prompt_tokens
        match = self.prefix_cache.match_prefix(request.prompt_token_ids[:-1])
        if match.num_tokens == 0:
            return
        self.prefix_cache.lock(match.last_node)
        self._locked_nodes[request.request_id] = (match.last_node, match.num_tokens)
        self.attach_blocks(request, match.block_ids, match.num_tokens)
        self.num_prefix_cache_hits += match.num_tokens

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of the request's prompt (all but its last) the radix cache holds, whole blocks
        [tokens]; 0 without a cache. Reads only."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.num_matching_tokens(request.prompt_token_ids[:-1])

    def cache_prompt_blocks(self, request: Request) -> None:
        """Offer the request's newly completed full prompt blocks to the radix cache while it
        still runs, so requests admitted later reuse them at once (not only after it finishes).
        The cache takes its own reference to blocks it did not have; the request's matched path
        lock moves to the new deepest node. No-op without a radix cache."""
        cache = self.prefix_cache
        if cache is None:
            return
        num_full = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        if num_full <= self._num_cached_prompt_blocks.get(request.request_id, 0):
            return
        tokens = request.prompt_token_ids[: num_full * self.block_size]
        blocks = self.block_ids(request.request_id)[:num_full]
        # the cache already had the leading blocks it hands back; it keeps the rest
        num_duplicates = len(cache.insert(tokens, blocks))
        self.allocator.incref(blocks[num_duplicates:])
        node = cache.match_prefix(tokens).last_node
        cache.lock(node)
        old = self._locked_nodes.get(request.request_id)
        if old is not None:
            cache.unlock(old[0])
        self._locked_nodes[request.request_id] = (node, len(tokens))
        self._num_cached_prompt_blocks[request.request_id] = num_full

    def hold_shared_prefix(self, group: SharedPrefix, leader: Request) -> None:
        """Give `group` its own reference to the prefix blocks the leader just computed."""
        num_blocks = group.prefix_len // self.block_size
        group.block_ids = list(self.block_ids(leader.request_id)[:num_blocks])
        self.allocator.incref(group.block_ids)
        self._held_prefixes[id(group)] = group

    def release_shared_prefix(self, group: SharedPrefix) -> None:
        """Drop the group's reference to its prefix blocks (no-op if it holds none)."""
        if group.block_ids is not None:
            self.allocator.decref(group.block_ids)
            group.block_ids = None
            self._held_prefixes.pop(id(group), None)

    def held_shared_prefixes(self) -> list[SharedPrefix]:
        return list(self._held_prefixes.values())

    # -- freeing ----------------------------------------------------------------------------

    def free(self, request: Request, cache: bool = False) -> None:
        """Drop the request's references to all its blocks (blocks shared with others survive).

        With `cache` and a radix cache, the request's full computed blocks are first offered to
        the cache, which keeps one reference to those it did not have yet. The blocks up to the
        node the request holds locked are in the cache already, so the insertion starts there:
        its cost is the request's blocks past that node (its own suffix and outputs, for a
        member of a shared-prefix group), not its whole sequence.
        """
        table = self._block_tables.pop(request.request_id, None)
        locked = self._locked_nodes.pop(request.request_id, None)
        self._num_cached_prompt_blocks.pop(request.request_id, None)
        bs = self.block_size
        if table and cache and self.prefix_cache is not None:
            # async scheduling: computed positions may hold tokens not yet known on the host
            computed = min(request.num_computed_tokens, request.num_known_tokens)
            num_full = min(computed // bs, len(table))
            # |-- root path of the locked node (cached) --|-- offered now --|-- not full --|
            # 0                                      locked_len       num_full * bs
            after, locked_len = locked if locked is not None else (None, 0)
            if locked_len > num_full * bs:  # not expected (the lock covers computed blocks)
                after, locked_len = None, 0  # the root is always a correct start
            if num_full:
                tokens = request.token_ids(locked_len, num_full * bs)
                new = table[locked_len // bs : num_full]
                num_duplicates = locked_len // bs + len(
                    self.prefix_cache.insert(tokens, new, after=after)
                )
                # the cache took over the request's reference to each new block (those after
                # the leading duplicates it handed back); drop the others
                table = table[:num_duplicates] + table[num_full:]
        if locked is not None:
            self.prefix_cache.unlock(locked[0])  # type: ignore[union-attr]
        if table:
            self.allocator.decref(reversed(table))

    def trim(self, request: Request) -> None:
        """Drop the request's blocks past the one holding its last computed token (the slots of
        rejected draft tokens, speculative decoding): they are the request's own fresh blocks
        (shared and cached blocks hold computed tokens only), so each goes back to the pool.
        Mutates its block table and `num_sent_blocks` (the worker trims its copy by the same
        rule, `cdiv(num_computed_tokens, block_size)` blocks kept)."""
        table = self._block_tables.get(request.request_id)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return
        self.allocator.decref(reversed(table[keep:]))
        del table[keep:]
        request.num_sent_blocks = min(request.num_sent_blocks, keep)

    def check_integrity(self, live_requests: list[Request] | None = None) -> None:
        """Assert: every block's ref count == the number of its holders (block tables, held
        shared prefixes, the radix cache), and every table covers its computed tokens."""
        self.allocator.check_integrity()
        holders = [0] * self.allocator.num_blocks
        for table in self._block_tables.values():
            for block_id in table:
                holders[block_id] += 1
        for group in self._held_prefixes.values():
            for block_id in group.block_ids or ():
                holders[block_id] += 1
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            for block_id in self.prefix_cache._cached_block_ids:
                holders[block_id] += 1
        for block_id, count in enumerate(holders):
            assert self.allocator.ref_count(block_id) == count, (
                f"block {block_id}: ref count {self.allocator.ref_count(block_id)} "
                f"but {count} holders"
            )
        for request in live_requests or []:
            table = self._block_tables.get(request.request_id, [])
            assert len(table) * self.block_size >= request.num_computed_tokens, (
                f"request {request.request_id}: {len(table)} blocks cannot hold "
                f"{request.num_computed_tokens} computed tokens"
            )
