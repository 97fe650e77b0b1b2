"""Per-request block tables over the shared block pool.

The KV manager owns the mapping request -> block ids (its block table). It allocates blocks for
the tokens a step schedules, lets a request start from blocks another request already computed
(shared by reference count, never copied), and frees a request's references when it finishes,
is aborted or is preempted.
"""

from __future__ import annotations

from phloem.core.block_allocator import BlockAllocator
from phloem.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVManager:
    """Block tables for all live requests.

    Args:
        num_blocks: size of the pool [blocks].
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (its list, not a copy: do not mutate)."""
        return self._block_tables.get(request_id, [])

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so that `num_computed_tokens + num_new_tokens` tokens fit [blocks]."""
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(self.block_ids(request.request_id)))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens`.

        Mutates the request's block table (appends fresh blocks). Returns False, changing
        nothing, when the pool has too few free blocks.
        """
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > self.allocator.num_free_blocks:
            return False
        if needed:
            table = self._block_tables.setdefault(request.request_id, [])
            table.extend(self.allocator.allocate(needed))
        return True

    def share_blocks(self, request: Request, block_ids: list[int]) -> None:
        """Start `request`'s (empty) block table with `block_ids`, adding a reference to each.

        The caller sets `request.num_computed_tokens` to the tokens those blocks hold.
        Raises ValueError if the request already holds blocks.
        """
        if self._block_tables.get(request.request_id):
            raise ValueError(f"request {request.request_id} already holds blocks")
        self.allocator.incref(block_ids)
        self._block_tables[request.request_id] = list(block_ids)

    def free(self, request: Request) -> None:
        """Drop the request's references to all its blocks (blocks shared with others survive)."""
        table = self._block_tables.pop(request.request_id, None)
        if table:
            self.allocator.decref(reversed(table))

    def check_integrity(self, live_requests: list[Request] | None = None) -> None:
        """Assert: ref count of every block == number of block tables holding it (+ `extra`
        holders are not modelled here), and every table covers its request's computed tokens."""
        self.allocator.check_integrity()
        holders = [0] * self.allocator.num_blocks
        for table in self._block_tables.values():
            for block_id in table:
                holders[block_id] += 1
        for block_id, count in enumerate(holders):
            assert self.allocator.ref_count(block_id) == count, (
                f"block {block_id}: ref count {self.allocator.ref_count(block_id)} "
                f"but held by {count} block tables"
            )
        for request in live_requests or []:
            table = self._block_tables.get(request.request_id, [])
            assert len(table) * self.block_size >= request.num_computed_tokens, (
                f"request {request.request_id}: {len(table)} blocks cannot hold "
                f"{request.num_computed_tokens} computed tokens"
            )
