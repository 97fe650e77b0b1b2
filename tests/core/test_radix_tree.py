"""RadixCache: exact block ids for match/insert/evict/lock, and fuzzing against a dict model."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from phloem.core.radix_tree import RadixCache, RadixNode


def seq(*blocks: int, block_size: int = 4) -> list[int]:
    """Tokens made of blocks: block b is [b*100, b*100+1, ...] (distinct per b)."""
    return [b * 100 + j for b in blocks for j in range(block_size)]


# ----------------------------------------------------------------------------- match / insert
def test_empty_cache_matches_nothing() -> None:
    cache = RadixCache(4)
    m = cache.match_prefix(seq(1, 2))
    assert (m.block_ids, m.num_tokens, m.last_node) == ([], 0, cache.root)
    assert cache.num_cached_blocks == 0
    cache.check_integrity()


def test_integrity_check_names_the_broken_invariant() -> None:
    """A corrupted tree fails the check with a message naming the node and the invariant."""
    cache = RadixCache(4)
    cache.insert(seq(1, 2), [10, 11])
    cache.insert(seq(1, 3), [10, 12])
    node = cache.match_prefix(seq(1, 3)).last_node
    node.block_ids.append(99)  # two blocks' ids on a one-block edge
    with pytest.raises(AssertionError, match=r"RadixNode\(id=.*blocks=\[12, 99\].*block count"):
        cache.check_integrity()
    node.block_ids[1:] = []
    cache.check_integrity()
    node.block_ids[0] = 11  # the sibling's block: cached twice
    with pytest.raises(AssertionError, match="block 11 cached twice"):
        cache.check_integrity()


def test_insert_then_match_full_and_partial_blocks() -> None:
    cache = RadixCache(4)
    assert cache.insert(seq(1, 2, 3), [10, 11, 12]) == []
    assert cache.num_cached_blocks == 3
    m = cache.match_prefix(seq(1, 2, 3))
    assert (m.block_ids, m.num_tokens) == ([10, 11, 12], 12)
    # A trailing partial block never matches; a partial first block matches nothing.
    m = cache.match_prefix(seq(1, 2, 3) + [7, 7])
    assert (m.block_ids, m.num_tokens) == ([10, 11, 12], 12)
    assert cache.match_prefix(seq(1)[:3]).block_ids == []
    # Divergence inside the second block: only block 1 matches.
    tokens = seq(1, 2, 3)
    tokens[6] = 999
    m = cache.match_prefix(tokens)
    assert (m.block_ids, m.num_tokens) == ([10], 4)
    cache.check_integrity()


def test_partial_match_splits_node_on_block_boundary() -> None:
    cache = RadixCache(4)
    cache.insert(seq(1, 2, 3), [10, 11, 12])
    m = cache.match_prefix(seq(1, 2, 9))
    assert m.block_ids == [10, 11]
    node = m.last_node
    assert node.key == tuple(seq(1, 2)) and node.block_ids == [10, 11]
    (child,) = node.children.values()
    assert child.key == tuple(seq(3)) and child.block_ids == [12]
    assert cache.match_prefix(seq(1, 2, 3)).block_ids == [10, 11, 12]
    cache.check_integrity()


def test_insert_returns_already_cached_blocks_and_stores_new_ones() -> None:
    cache = RadixCache(4)
    cache.insert(seq(1, 2, 3), [10, 11, 12])
    # Same first two blocks computed again (ids 20, 21), then a new block 22.
    assert cache.insert(seq(1, 2, 5), [20, 21, 22]) == [20, 21]
    assert cache.num_cached_blocks == 4
    assert cache.match_prefix(seq(1, 2, 5)).block_ids == [10, 11, 22]
    # Passing the cached ids themselves (from match_prefix) also returns them.
    assert cache.insert(seq(1, 2, 5, 6), [10, 11, 22, 23]) == [10, 11, 22]
    assert cache.match_prefix(seq(1, 2, 5, 6)).block_ids == [10, 11, 22, 23]
    # A prefix of a cached sequence stores nothing.
    assert cache.insert(seq(1), [30]) == [30]
    assert cache.num_cached_blocks == 5
    cache.check_integrity()


def test_insert_ignores_trailing_partial_block() -> None:
    cache = RadixCache(4)
    assert cache.insert(seq(1, 2) + [5, 6], [10, 11]) == []
    assert cache.match_prefix(seq(1, 2) + [5, 6, 7, 8]).block_ids == [10, 11]


@pytest.mark.parametrize(
    ("tokens", "block_ids"),
    [
        (seq(1, 2), [10]),  # too few block ids
        (seq(1, 2), [10, 11, 12]),  # too many
        (seq(1, 2), [10, 10]),  # repeated id
        (seq(7, 8), [12, 13]),  # 12 already cached elsewhere
    ],
)
def test_insert_rejects_bad_block_ids_and_stores_nothing(
    tokens: list[int], block_ids: list[int]
) -> None:
    cache = RadixCache(4)
    cache.insert(seq(1, 2, 3), [10, 11, 12])
    with pytest.raises(ValueError):
        cache.insert(tokens, block_ids)
    assert cache.num_cached_blocks == 3
    assert cache.match_prefix(seq(7, 8)).block_ids == []
    cache.check_integrity()


def snapshot(cache: RadixCache) -> tuple:
    """Everything `insert` may change: structure, blocks, locks, access times, node ids."""

    def node_state(node: RadixNode) -> tuple:
        children = sorted(node.children.items())
        return (node.key, tuple(node.block_ids), node.lock_ref, node.last_access, node.node_id,
                tuple((k, node_state(c)) for k, c in children))  # fmt: skip

    return (node_state(cache.root), cache._clock, cache.num_evictable_blocks,
            cache.num_cached_blocks, sorted(n.node_id for n in cache._leaves))  # fmt: skip


def twin_caches() -> tuple[RadixCache, RadixCache, RadixNode, RadixNode]:
    """Two identical caches with [1 2 3] -> {[4], [5 6]} cached and [1 2 3] locked in each, its
    node split since (a match of [1 2] after the lock): the locked handle keeps naming all of
    [1 2 3] though its own edge is [3] now."""
    nodes = []
    caches = []
    for _ in range(2):
        cache = RadixCache(4)
        cache.insert(seq(1, 2, 3, 4), [10, 11, 12, 14])
        cache.insert(seq(1, 2, 3, 5, 6), [10, 11, 12, 15, 16])
        node = cache.match_prefix(seq(1, 2, 3)).last_node
        cache.lock(node)
        cache.match_prefix(seq(1, 2, 9))  # splits the locked node after block 2
        caches.append(cache)
        nodes.append(node)
    return caches[0], caches[1], nodes[0], nodes[1]


@pytest.mark.parametrize(
    "rest, rest_blocks",
    [
        ([], []),  # nothing past the node: only the path's access times change
        (seq(4), [44]),  # fully cached below: returned, nothing stored
        (seq(4, 7), [44, 47]),  # new leaf under the cached [4]
        (seq(5, 7), [45, 47]),  # splits [5 6] below the node, then a new leaf
        (seq(8, 9), [48, 49]),  # a new child of the node itself
    ],
)
def test_insert_after_node_equals_insert_from_root(rest, rest_blocks) -> None:
    from_root, from_node, _, node = twin_caches()
    known = from_root.match_prefix(seq(1, 2, 3)).block_ids  # ticks both clocks alike
    from_node.match_prefix(seq(1, 2, 3))
    returned = from_root.insert(seq(1, 2, 3) + rest, known + rest_blocks)
    returned_after = from_node.insert(rest, rest_blocks, after=node)
    assert returned == known + returned_after
    assert snapshot(from_root) == snapshot(from_node)
    from_node.check_integrity()


def test_insert_after_an_evicted_node_raises() -> None:
    cache = RadixCache(4)
    cache.insert(seq(1, 2), [10, 11])
    node = cache.match_prefix(seq(1, 2)).last_node
    assert cache.evict(2) == [11, 10]
    with pytest.raises(ValueError, match="not in the tree"):
        cache.insert(seq(3), [13], after=node)
    assert cache.num_cached_blocks == 0
    cache.check_integrity()


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        RadixCache(0)


# ------------------------------------------------------------------------------------ eviction
def test_evict_least_recently_used_leaf_first_from_its_tail() -> None:
    cache = RadixCache(4)
    cache.insert(seq(1, 2), [10, 11])  # clock 1
    cache.insert(seq(3, 4), [30, 31])  # clock 2
    cache.match_prefix(seq(1, 2))  # clock 3: [1, 2] is now the most recent
    assert cache.evict(1) == [31]
    assert cache.match_prefix(seq(3, 4)).block_ids == [30]  # touches [3] again (clock 4)
    assert cache.evict(2) == [11, 10]
    assert cache.num_cached_blocks == 1
    assert cache.evict(5) == [30]
    assert cache.evict(1) == []
    assert cache.num_cached_blocks == cache.num_evictable_blocks == 0
    cache.check_integrity()


def test_evicting_children_exposes_parent_as_leaf() -> None:
    cache = RadixCache(4)
    cache.insert(seq(1, 2), [10, 11])
    cache.insert(seq(1, 3), [10, 13])  # splits [1 2] into [1] -> {[2], [3]}
    cache.match_prefix(seq(1, 3))
    cache.insert(seq(5), [50])
    # LRU leaves: [2] (clock 1), then [3] and parent [1] (clock 3), then [5] (clock 4).
    assert cache.evict(3) == [11, 13, 10]
    assert cache.match_prefix(seq(5)).block_ids == [50]
    cache.check_integrity()


def test_evict_zero_or_negative_frees_nothing() -> None:
    cache = RadixCache(4)
    cache.insert(seq(1), [10])
    assert cache.evict(0) == [] and cache.evict(-3) == []
    assert cache.num_cached_blocks == 1


# ------------------------------------------------------------------------------------- locking
def test_locked_path_is_never_evicted() -> None:
    cache = RadixCache(4)
    cache.insert(seq(1, 2, 3), [10, 11, 12])
    cache.insert(seq(1, 2, 4), [10, 11, 14])
    m = cache.match_prefix(seq(1, 2, 3))
    cache.lock(m.last_node)
    assert cache.num_evictable_blocks == 1  # only [4]
    assert cache.evict(10) == [14]
    assert cache.num_cached_blocks == 3 and cache.num_evictable_blocks == 0
    cache.check_integrity()
    cache.unlock(m.last_node)
    assert cache.num_evictable_blocks == 3
    assert cache.evict(10) == [12, 11, 10]
    cache.check_integrity()


def test_lock_counts_nest_and_unlock_without_lock_raises() -> None:
    cache = RadixCache(4)
    cache.insert(seq(1, 2), [10, 11])
    node = cache.match_prefix(seq(1, 2)).last_node
    cache.lock(node)
    cache.lock(node)
    cache.unlock(node)
    assert cache.evict(5) == []
    cache.unlock(node)
    with pytest.raises(ValueError):
        cache.unlock(node)
    # Locking the root (an empty match) is a no-op.
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.evict(5) == [11, 10]
    cache.check_integrity()


def test_split_of_locked_node_keeps_lock_on_whole_path() -> None:
    cache = RadixCache(4)
    cache.insert(seq(1, 2, 3), [10, 11, 12])
    node = cache.match_prefix(seq(1, 2, 3)).last_node
    cache.lock(node)
    cache.match_prefix(seq(1, 9))  # splits the locked node after block 1
    cache.insert(seq(1, 7), [10, 17])
    cache.check_integrity()
    assert node.parent is not None and node.parent.lock_ref == 1
    assert cache.evict(10) == [17]
    cache.unlock(node)
    assert cache.num_evictable_blocks == 3
    cache.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    cache = RadixCache(4)
    cache.insert(seq(1, 2), [10, 11])
    cache.insert(seq(3), [30])
    node = cache.match_prefix(seq(3)).last_node
    node.block_ids.append(10)  # block 10 twice, and a wrong block count
    with pytest.raises(AssertionError):
        cache.check_integrity()
    node.block_ids.pop()
    cache.check_integrity()
    node.lock_ref = 1  # lock_ref without a direct lock
    with pytest.raises(AssertionError):
        cache.check_integrity()


# ------------------------------------------------------------------------------------- fuzzing
BLOCK = 2
token_seqs = st.lists(st.integers(0, 1), min_size=0, max_size=10)


class RadixCacheModel(RuleBasedStateMachine):
    """The tree against a dict {block-aligned prefix: block id} with per-prefix access times."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixCache(BLOCK)
        self.cached: dict[tuple[int, ...], int] = {}
        self.tick: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.next_block_id = 0
        self.locks: list[tuple[RadixNode, tuple[int, ...]]] = []

    def _blocks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        """The block-aligned prefixes of tokens, shortest first."""
        return [tuple(tokens[: k * BLOCK]) for k in range(1, len(tokens) // BLOCK + 1)]

    def _locked(self, prefix: tuple[int, ...]) -> bool:
        return any(p[: len(prefix)] == prefix for _, p in self.locks)

    def _match(self, tokens: list[int]) -> tuple[RadixNode, tuple[int, ...]]:
        m = self.cache.match_prefix(tokens)
        self.clock += 1
        matched = []
        for prefix in self._blocks(tokens):
            if prefix not in self.cached:
                break
            matched.append(prefix)
            self.tick[prefix] = self.clock
        assert m.block_ids == [self.cached[p] for p in matched]
        assert m.num_tokens == len(matched) * BLOCK
        return m.last_node, (matched[-1] if matched else ())

    @rule(tokens=token_seqs)
    def match(self, tokens: list[int]) -> None:
        self._match(tokens)

    @rule(tokens=token_seqs)
    def match_and_lock(self, tokens: list[int]) -> None:
        node, prefix = self._match(tokens)
        self.cache.lock(node)
        if prefix:
            self.locks.append((node, prefix))
        else:
            assert node is self.cache.root

    @precondition(lambda self: bool(self.locks))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(node)

    @rule(tokens=token_seqs, reuse_cached=st.booleans())
    def insert(self, tokens: list[int], reuse_cached: bool) -> None:
        prefixes = self._blocks(tokens)
        block_ids = []
        for p in prefixes:
            if reuse_cached and p in self.cached:
                block_ids.append(self.cached[p])
            else:
                block_ids.append(self.next_block_id)
                self.next_block_id += 1
        returned = self.cache.insert(tokens, block_ids)
        self.clock += 1
        expected = [b for p, b in zip(prefixes, block_ids) if p in self.cached]
        assert returned == expected
        assert returned == block_ids[: len(returned)]  # a prefix: the KV manager relies on it
        for p, b in zip(prefixes, block_ids):
            self.cached.setdefault(p, b)
            self.tick[p] = self.clock

    @precondition(lambda self: bool(self.locks))
    @rule(data=st.data(), rest=token_seqs)
    def insert_after_locked(self, data: st.DataObject, rest: list[int]) -> None:
        """`insert(rest, after=node)` behaves as inserting the node's prefix + rest."""
        node, prefix = self.locks[data.draw(st.integers(0, len(self.locks) - 1))]
        tokens = list(prefix) + rest
        prefixes = self._blocks(tokens)[len(prefix) // BLOCK :]
        block_ids = list(range(self.next_block_id, self.next_block_id + len(prefixes)))
        self.next_block_id += len(prefixes)
        returned = self.cache.insert(rest, block_ids, after=node)
        self.clock += 1
        assert returned == [b for p, b in zip(prefixes, block_ids) if p in self.cached]
        for p in self._blocks(tokens):
            self.tick[p] = self.clock
        for p, b in zip(prefixes, block_ids):
            self.cached.setdefault(p, b)

    @rule(num_blocks=st.integers(0, 8))
    def evict(self, num_blocks: int) -> None:
        evictable = sum(not self._locked(p) for p in self.cached)
        evicted = self.cache.evict(num_blocks)
        assert len(evicted) == min(num_blocks, evictable)
        owner = {b: p for p, b in self.cached.items()}
        for block_id in evicted:
            prefix = owner[block_id]
            candidates = [
                p
                for p in self.cached
                if not self._locked(p)
                and not any(q[: len(p)] == p and len(q) > len(p) for q in self.cached)
            ]
            assert prefix in candidates, "evicted a locked or inner block"
            assert self.tick[prefix] == min(self.tick[p] for p in candidates), "not LRU"
            del self.cached[prefix]
            del self.tick[prefix]

    @invariant()
    def consistent(self) -> None:
        self.cache.check_integrity()
        assert self.cache.num_cached_blocks == len(self.cached)
        assert self.cache.num_evictable_blocks == sum(not self._locked(p) for p in self.cached)


RadixCacheModel.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
test_radix_cache_against_dict_model = RadixCacheModel.TestCase


def test_num_matching_tokens_reads_what_match_prefix_finds() -> None:
    """The read-only peek agrees with `match_prefix` and changes nothing (no split, no stamp)."""
    rng = random.Random(3)
    cache = RadixCache(block_size=2)
    next_block = 0
    for _ in range(30):
        tokens = [rng.randrange(4) for _ in range(rng.randint(2, 12))]
        before = snapshot(cache)
        peek = cache.num_matching_tokens(tokens)
        assert snapshot(cache) == before
        match = cache.match_prefix(tokens)
        assert peek == match.num_tokens
        blocks = list(range(next_block, next_block + len(tokens) // 2))
        next_block += len(blocks)
        cache.insert(tokens, blocks)
