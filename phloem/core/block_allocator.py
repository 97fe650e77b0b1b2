"""The pool of physical KV blocks: a free list and a reference count per block.

A block is shared (prompt blocks of n > 1 children, a group's prefix) by holding more than one
reference; it returns to the free list when its last reference is dropped. PagedAttention
(Kwon et al., SOSP 2023, §4.2-4.4).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when the pool has fewer free blocks than asked for."""


class BlockAllocator:
    """Hands out block ids in [0, num_blocks) and counts references to them.

    Invariant: a block is on the free list iff its ref count is 0, and appears there once.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, each with ref count 1 (lowest-recently-freed first).

        Raises:
            NoFreeBlocksError: if fewer than `num_blocks` are free; nothing is taken then.
        """
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each (already allocated) block. Raises ValueError on a free one."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is free; cannot share it")
            self._ref_counts[block_id] += 1

    def decref(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference from each block; returns the blocks that became free.

        Raises:
            ValueError: on a block that holds no reference (a double free).
        """
        freed = []
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)
                freed.append(block_id)
        return freed

    def check_integrity(self) -> None:
        """Assert the invariant: free list == {blocks with ref count 0}, no duplicates."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        zero = {b for b, c in enumerate(self._ref_counts) if c == 0}
        assert free == zero, f"free list {sorted(free)} != zero-ref blocks {sorted(zero)}"
        assert all(c >= 0 for c in self._ref_counts)
