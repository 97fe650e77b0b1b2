"""The draft model's own paged KV bookkeeping: per request, the tokens whose KV the draft model
has written and the blocks holding them, over a `BlockAllocator` of its own. Pure Python.

The draft cache holds a prefix of the request's history followed by the drafts it computed
(every draft but the last is an input of a later draft pass). Before each proposal the request's
history (which only grows: rejected drafts never enter it) is compared with the cached tokens
past the last verified point, and the cache is cut back to their common prefix, freeing the
blocks beyond it; the tokens after that are recomputed (catch-up):

    cached:   |-- verified (history at the last call) --|-- d_1 .. d_{k-1} --|
    history:  |-- verified --|-- accepted d_1 .. d_a | next token | ...    --|
    kept:     |-- verified + a --|  (at most len(history) - 1: the last token is always fed)

A request's blocks are freed when it finishes, is aborted or preempted (`release`), or when the
pool runs short and it is not drafting this step (`evict_one`, least recently used first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from phloem.core.block_allocator import BlockAllocator


@dataclass
class DraftSequence:
    """One request's share of the draft cache.

    Attributes:
        token_ids: the tokens whose KV is written, in position order [tokens].
        block_ids: its block table; covers at least `len(token_ids)` positions.
        num_verified: how many of `token_ids` equal the history seen at the last `sync`
            [tokens]; the tokens after them are unverified drafts.
    """

    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_verified: int = 0


class DraftKV:
    """Block tables and cached tokens of the draft model's requests (see the module docstring).

    Args:
        num_blocks: blocks in the draft model's KV pool [blocks], >= 1.
        block_size: tokens per block, >= 1.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.sequences: OrderedDict[str, DraftSequence] = OrderedDict()  # least recent first

    def sync(self, request_id: str, history: Sequence[int]) -> int:
        """Cut the request's cache back to its longest prefix that agrees with `history` (and
        is shorter than it), freeing the blocks past it; creates the request's entry. Marks it
        most recently used. Returns the cached tokens kept [tokens].

        A history shorter than the verified tokens (a reused id) restarts the request."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.num_verified > len(history):
            if seq is not None:
                self.release(request_id)
            seq = self.sequences[request_id] = DraftSequence()
        self.sequences.move_to_end(request_id)
        cached = seq.token_ids
        keep = min(len(cached), len(history) - 1)
        match = seq.num_verified
        while match < keep and cached[match] == history[match]:
            match += 1
        del cached[match:]
        seq.num_verified = match
        self._shrink(seq, match)
        return match

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's block table to cover `num_tokens` positions; False (nothing
        taken) when the pool has too few free blocks."""
        seq = self.sequences[request_id]
        need = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        if need > self.allocator.num_free_blocks:
            return False
        seq.block_ids += self.allocator.allocate(need)
        return True

    def append(self, request_id: str, token_ids: Sequence[int], verified: bool) -> None:
        """Record that the KV of `token_ids` was written after the cached tokens (their slots
        must be inside the reserved table); `verified`: they are history tokens, not drafts."""
        seq = self.sequences[request_id]
        seq.token_ids.extend(token_ids)
        if verified:
            seq.num_verified = len(seq.token_ids)
        assert len(seq.token_ids) <= len(seq.block_ids) * self.block_size, "KV past the table"

    def release(self, request_id: str) -> None:
        """Free the request's blocks and forget it; an unknown id is ignored."""
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.allocator.decref(seq.block_ids)

    def evict_one(self, keep: set[str]) -> bool:
        """Release the least recently used request not in `keep`; False when there is none."""
        for request_id in self.sequences:
            if request_id not in keep:
                self.release(request_id)
                return True
        return False

    def _shrink(self, seq: DraftSequence, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` positions."""
        num_blocks = -(-num_tokens // self.block_size)
        if len(seq.block_ids) > num_blocks:
            self.allocator.decref(seq.block_ids[num_blocks:])
            del seq.block_ids[num_blocks:]

    def check_integrity(self) -> None:
        """Assert that the tables and the allocator agree: each used block belongs to exactly
        one request, and each request's cached tokens fit its table."""
        owned = [b for seq in self.sequences.values() for b in seq.block_ids]
        assert len(owned) == len(set(owned)), "a draft block is in two tables"
        assert len(owned) == self.allocator.num_used_blocks, "draft blocks leaked"
        for seq in self.sequences.values():
            assert len(seq.token_ids) <= len(seq.block_ids) * self.block_size
            assert seq.num_verified <= len(seq.token_ids)
        self.allocator.check_integrity()
