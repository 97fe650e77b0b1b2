"""The online prefix cache: a block-aligned radix tree from token ids to cached KV block ids.

SGLang RadixAttention (Zheng et al., arXiv 2312.07104, §3): every finished (or fully prefilled)
request leaves its prompt's KV blocks in a radix tree keyed by token ids; a new request reuses
the blocks of its longest cached prefix; blocks that no running request uses are evicted
least-recently-used first, leaves before their parents, only when the allocator runs dry.

Block alignment: the tree caches whole KV blocks only. Every edge holds a multiple of
`block_size` tokens and one block id per `block_size` tokens, so a match is always a whole
number of blocks and a node is only ever split on a block boundary::

    root ─[t0..t7 | b3 b9]─ A ─[t8..t11 | b4]─ B        (block_size 4)
                             └─[u8..u15 | b7 b2]─ C

Ownership: the tree is one holder of a reference to each block it stores. It never talks to an
allocator: `insert` tells the caller which of the passed blocks it did not take, and `evict`
returns the blocks it let go of, so the caller (the KV manager) adjusts ref counts.

Locking: `lock(node)` adds one to `lock_ref` of the node and of every ancestor, so a locked
path is never evicted. Invariant: lock_ref(node) == direct locks on node + Σ lock_ref(child),
hence an unlocked node's whole subtree is unlocked and can be freed leaf by leaf.

LRU time is a logical clock that ticks once per `match_prefix` / `insert`; an access stamps
the whole root path, so a parent is never older than its children.

The offline prefix planner (`prefix_planner.py`) builds its own static token-level tree: it
needs per-token depths and leaf counts over a whole batch, not block ids, locks or eviction.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


class RadixNode:
    """One edge of the tree and the node below it.

    `key` is the edge's token ids (a non-empty multiple of block_size, empty only for the root),
    `block_ids` the KV blocks holding them (len(key) // block_size). Callers treat nodes as
    opaque handles for `lock` / `unlock`; the fields are read-only outside this module.
    """

    __slots__ = (
        "key",
        "block_ids",
        "parent",
        "children",
        "lock_ref",
        "num_direct_locks",
        "last_access",
        "node_id",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        block_ids: list[int],
        parent: RadixNode | None,
        last_access: int,
        node_id: int,
    ) -> None:
        self.key = key
        self.block_ids = block_ids
        self.parent = parent
        # Keyed by the child's first block of tokens (a tuple of block_size ids).
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.num_direct_locks = 0
        self.last_access = last_access
        self.node_id = node_id

    def __repr__(self) -> str:
        return (
            f"RadixNode(id={self.node_id}, tokens={len(self.key)}, blocks={self.block_ids}, "
            f"lock_ref={self.lock_ref}, last_access={self.last_access})"
        )


@dataclass(frozen=True)
class PrefixMatch:
    """Result of `RadixCache.match_prefix`.

    Attributes:
        block_ids: KV block ids of the matched prefix, in order (one per block_size tokens).
        num_tokens: matched prefix length in tokens (len(block_ids) * block_size).
        last_node: the node ending exactly at the match (the root when nothing matched); pass it
            to `lock` to keep these blocks from eviction while a request uses them.
    """

    block_ids: list[int] = field(repr=True)
    num_tokens: int
    last_node: RadixNode = field(repr=False)


class RadixCache:
    """Block-aligned radix tree over token ids holding KV block ids (SGLang RadixAttention).

    Not thread-safe; the scheduler owns it.
    """

    def __init__(self, block_size: int) -> None:
        """Raises ValueError if block_size < 1 (tokens per KV block)."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self._clock = 0
        self._next_node_id = 1
        self.root = RadixNode((), [], None, 0, 0)
        self._cached_block_ids: set[int] = set()
        self._num_evictable_blocks = 0
        # Nodes without children, the root excluded (evict's candidates): kept up to date so
        # that an eviction looks at the leaves only, not at the whole tree.
        self._leaves: set[RadixNode] = set()

    # ----------------------------------------------------------------------------- queries
    @property
    def num_cached_blocks(self) -> int:
        """Blocks held by the tree (each counts one reference the caller gave it)."""
        return len(self._cached_block_ids)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks in unlocked nodes: what `evict` can free right now."""
        return self._num_evictable_blocks

    # ---------------------------------------------------------------------------- matching
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Find the longest cached prefix of `token_ids` made of whole blocks.

        Only the first len(token_ids) // block_size blocks can match; a request that must
        compute at least one token itself (to get logits) should pass token_ids[:-1].

        Mutates: splits a node whose edge matches only partly (on a block boundary) so that
        `last_node` ends exactly at the match; stamps the matched path with a new access time.
        Never changes which blocks are cached, nor lock counts.
        """
        self._clock += 1
        bs = self.block_size
        tokens = tuple(token_ids[: len(token_ids) // bs * bs])
        self.root.last_access = self._clock
        block_ids: list[int] = []
        node, pos = self._descend(self.root, tokens, block_ids)
        return PrefixMatch(block_ids=block_ids, num_tokens=pos, last_node=node)

    def num_matching_tokens(self, token_ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of `token_ids` made of whole blocks [tokens], as
        `match_prefix` would find it. Reads only: no split, no access stamp, no clock tick."""
        bs = self.block_size
        tokens = tuple(token_ids[: len(token_ids) // bs * bs])
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                break
            num_blocks = self._num_matching_blocks(child.key, tokens, pos)
            pos += num_blocks * bs
            if num_blocks < len(child.block_ids):
                break
            node = child
        return pos

    # ---------------------------------------------------------------------------- insertion
    def insert(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        after: RadixNode | None = None,
    ) -> list[int]:
        """Cache the full blocks of a prefilled sequence; return the passed ids it did not take.

        Args:
            token_ids: the sequence's tokens; only the first len(block_ids) * block_size count
                (a trailing partial block is ignored).
            block_ids: the KV block holding each full block of `token_ids`, in order.
            after: a node of the tree (e.g. one a request holds locked) whose root path spells
                the tokens that come *before* `token_ids`: the sequence is then that path
                followed by `token_ids`, and the tree is left exactly as inserting the whole
                sequence from the root would leave it, without reading the known part again.
                The caller's blocks for the known part are not passed (each was already
                cached, so the caller drops its reference to them as to returned ones).
                None (the default) is the root.

        Returns:
            The block ids from `block_ids` at positions that were already cached (whether
            computed twice or obtained from `match_prefix`), in order: always a prefix,
            `block_ids[:k]` for the k leading blocks already cached. Reference contract:
            insert consumes one caller reference per passed block. The tree keeps that
            reference for every block it newly stores; for the returned ones it keeps its
            existing block, so the caller must drop its own reference to each returned id.

        Mutates: may split one node on a block boundary; adds at most one leaf holding the new
        blocks (unlocked); stamps the whole path from the root with a new access time.

        Cost: O(len(token_ids)) plus O(nodes on the root path of `after`).

        Raises:
            ValueError: if len(block_ids) != len(token_ids) // block_size, if `block_ids`
                repeats an id, if a block to be stored is already cached elsewhere in the
                tree, or if `after` is not in the tree (evicted). Nothing is stored then (a
                split or access stamps may have happened; they change no content).
        """
        bs = self.block_size
        if len(block_ids) != len(token_ids) // bs:
            raise ValueError(
                f"block_ids has {len(block_ids)} blocks; {len(token_ids)} tokens fill "
                f"{len(token_ids) // bs} blocks of {bs}"
            )
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block_ids repeats a block id: {list(block_ids)}")
        self._clock += 1
        tokens = tuple(token_ids[: len(block_ids) * bs])
        # the known part is whole nodes: nothing to split there, only the root path to stamp
        self._stamp_root_path(self.root if after is None else after)
        node, pos = self._descend(self.root if after is None else after, tokens)
        first_new = pos // bs
        new_block_ids = list(block_ids[first_new:])
        clashes = self._cached_block_ids.intersection(new_block_ids)
        if clashes:
            raise ValueError(f"blocks {sorted(clashes)} are already cached at another position")
        if new_block_ids:
            self._add_leaf(node, tokens[pos:], new_block_ids)
        return list(block_ids[:first_new])

    def _stamp_root_path(self, node: RadixNode) -> None:
        """Stamp `node` and its ancestors with the current access time. Raises ValueError when
        the path does not end at the root (the node was evicted)."""
        ancestor = node
        while ancestor.parent is not None:
            ancestor.last_access = self._clock
            ancestor = ancestor.parent
        if ancestor is not self.root:
            raise ValueError(f"insert after a node that is not in the tree: {node!r}")
        ancestor.last_access = self._clock

    def _descend(
        self, node: RadixNode, tokens: tuple[int, ...], block_ids: list[int] | None = None
    ) -> tuple[RadixNode, int]:
        """Follow `tokens` down from `node` a whole block at a time: each node on the way is
        stamped (and its blocks appended to `block_ids` when given); an edge that matches only
        partly is split at the last matching block, and the walk ends there. Returns the
        deepest node reached and the number of tokens matched below `node`."""
        bs = self.block_size
        pos = 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                break
            num_blocks = self._num_matching_blocks(child.key, tokens, pos)
            partial = num_blocks < len(child.block_ids)
            if partial:
                child = self._split(child, num_blocks)
            child.last_access = self._clock
            if block_ids is not None:
                block_ids.extend(child.block_ids)
            pos += len(child.key)
            node = child
            if partial:
                break
        return node, pos

    def _add_leaf(self, node: RadixNode, key: tuple[int, ...], block_ids: list[int]) -> None:
        """A new unlocked leaf under `node` holding `block_ids` for the tokens `key`."""
        leaf = RadixNode(key, block_ids, node, self._clock, self._next_node_id)
        self._next_node_id += 1
        node.children[key[: self.block_size]] = leaf
        self._leaves.discard(node)
        self._leaves.add(leaf)
        self._cached_block_ids.update(block_ids)
        self._num_evictable_blocks += len(block_ids)

    # ------------------------------------------------------------------------------ locking
    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction (one more lock on the path).

        Mutates: lock_ref += 1 on node and each ancestor; blocks of nodes that become locked
        leave `num_evictable_blocks`. Locking the root is a no-op (it holds no blocks).
        Assumes `node` is in the tree (a locked node never leaves it).
        """
        if node is self.root:
            return
        node.num_direct_locks += 1
        cur: RadixNode | None = node
        while cur is not None and cur is not self.root:
            if cur.lock_ref == 0:
                self._num_evictable_blocks -= len(cur.block_ids)
            cur.lock_ref += 1
            cur = cur.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`.

        Mutates: lock_ref -= 1 on node and each ancestor; nodes reaching 0 become evictable.
        Unlocking the root is a no-op.

        Raises:
            ValueError: if `node` holds no lock of its own (nothing is changed then).
        """
        if node is self.root:
            return
        if node.num_direct_locks == 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        node.num_direct_locks -= 1
        cur: RadixNode | None = node
        while cur is not None and cur is not self.root:
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._num_evictable_blocks += len(cur.block_ids)
            cur = cur.parent

    # ----------------------------------------------------------------------------- eviction
    def evict(self, num_blocks: int) -> list[int]:
        """Free up to `num_blocks` blocks from unlocked leaves, least recently used first.

        A leaf is trimmed from its tail block by block; a leaf left empty is removed and its
        parent may become an evictable leaf in turn. Frees exactly
        min(num_blocks, num_evictable_blocks) blocks.

        Returns:
            The freed block ids in eviction order; the tree no longer holds them, so the caller
            drops the tree's reference to each.

        Mutates: removes/trims unlocked nodes; never touches locked ones or access times.
        Cost: O(leaves) to collect the unlocked ones plus O(log leaves) per leaf freed.
        """
        evicted: list[int] = []
        if num_blocks <= 0:
            return evicted
        # (last_access, node_id) is unique per node, so the pop order depends on the keys only
        heap = [
            (node.last_access, node.node_id, node) for node in self._leaves if not node.lock_ref
        ]
        heapq.heapify(heap)
        while heap and len(evicted) < num_blocks:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_blocks - len(evicted), len(leaf.block_ids))
            freed = leaf.block_ids[len(leaf.block_ids) - take :][::-1]
            evicted.extend(freed)
            self._cached_block_ids.difference_update(freed)
            self._num_evictable_blocks -= take
            if take < len(leaf.block_ids):
                del leaf.block_ids[len(leaf.block_ids) - take :]
                leaf.key = leaf.key[: len(leaf.block_ids) * self.block_size]
                break
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[: self.block_size]]
            leaf.parent = None
            self._leaves.discard(leaf)
            if parent is not self.root and not parent.children:
                self._leaves.add(parent)
                if parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return evicted

    # ---------------------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (for tests; O(tree size)).

        Checks: edge lengths are non-empty multiples of block_size with one block id per block;
        each child is filed under its first block and points back to its parent; lock_ref ==
        direct locks + Σ children's lock_ref; a parent is never older than its children; no
        block id appears twice; the cached-block and evictable counters and the leaf set match
        the tree.
        """
        bs = self.block_size
        seen: set[int] = set()
        num_evictable = 0
        _require(self.root.key == () and not self.root.block_ids, "root holds tokens")
        _require(self.root.lock_ref == 0 and self.root.num_direct_locks == 0, "root locked")
        for node in self._iter_nodes():
            child_locks = 0
            for first_block, child in node.children.items():
                _require(child.parent is node, "{!r} has a wrong parent", child)
                _require(first_block == child.key[:bs], "{!r} filed under {}", child, first_block)
                _require(len(first_block) == bs, "{!r} filed under a short key", child)
                _require(child.last_access <= node.last_access, "{!r} newer than parent", child)
                child_locks += child.lock_ref
            if node is self.root:
                continue
            _require(len(node.key) > 0 and len(node.key) % bs == 0, "{!r} key not aligned", node)
            _require(len(node.block_ids) == len(node.key) // bs, "{!r} block count", node)
            _require(node.num_direct_locks >= 0, "{!r} negative direct locks", node)
            _require(
                node.lock_ref == node.num_direct_locks + child_locks, "{!r} lock_ref sum", node
            )
            for block_id in node.block_ids:
                _require(block_id not in seen, "block {} cached twice", block_id)
                seen.add(block_id)
            if node.lock_ref == 0:
                num_evictable += len(node.block_ids)
        _require(seen == self._cached_block_ids, "cached block set out of sync")
        leaves = {n for n in self._iter_nodes() if not n.children and n is not self.root}
        _require(leaves == self._leaves, "leaf set out of sync")
        _require(num_evictable == self._num_evictable_blocks, "evictable count out of sync")

    # ----------------------------------------------------------------------------- helpers
    def _num_matching_blocks(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        """Whole blocks of `key` equal to tokens[pos:] (the first block is known to match)."""
        bs = self.block_size
        if tokens[pos : pos + len(key)] == key:
            return len(key) // bs
        num_blocks = 1
        while (num_blocks + 1) * bs <= len(key) and (
            key[num_blocks * bs : (num_blocks + 1) * bs]
            == tokens[pos + num_blocks * bs : pos + (num_blocks + 1) * bs]
        ):
            num_blocks += 1
        return num_blocks

    def _split(self, child: RadixNode, num_blocks: int) -> RadixNode:
        """Insert a new node above `child` holding its first `num_blocks` blocks; return it.

        `child` keeps the rest (so a handle to it still names the same full prefix); the new
        node inherits child's lock_ref and access time, keeping every invariant.
        """
        bs = self.block_size
        parent = child.parent
        assert parent is not None and 0 < num_blocks < len(child.block_ids)
        cut = num_blocks * bs
        new = RadixNode(
            child.key[:cut],
            child.block_ids[:num_blocks],
            parent,
            child.last_access,
            self._next_node_id,
        )
        self._next_node_id += 1
        new.lock_ref = child.lock_ref
        parent.children[new.key[:bs]] = new
        child.key = child.key[cut:]
        child.block_ids = child.block_ids[num_blocks:]
        child.parent = new
        new.children[child.key[:bs]] = child
        return new

    def _iter_nodes(self) -> list[RadixNode]:
        """All nodes, root first (iterative DFS; trees can be deep)."""
        nodes: list[RadixNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes


def _require(condition: bool, message: str, *args: object) -> None:
    """Raise AssertionError if not condition; `message.format(*args)` is built only then (the
    integrity check runs over every node of big trees in tests)."""
    if not condition:
        raise AssertionError(f"RadixCache integrity: {message.format(*args)}")
