"""A bounded-depth suffix trie with occurrence counts: the data structure of SuffixDecoding
(Oliaro et al. 2024, arXiv 2411.04975, §3), which drafts the most frequent continuation of the
longest suffix of a request's history that the trie has seen.

Every position i of an inserted sequence adds the path `tokens[i : i + max_depth]`; a node's
`count` is the number of positions whose path passes through it, i.e. the occurrences of that
substring (up to `max_depth` tokens). Appending a token extends the at most `max_depth` paths that
are still open (one per recent start position), so insertion is O(max_depth) per token and a
sequence of L tokens holds at most L x max_depth nodes (far fewer on repetitive text, which is
where it pays).

A continuation's probability is estimated from counts: child c of node n is followed with
probability count(c) / sum of n's children's counts (occurrences of n that have a next token; the
request's own last occurrence has none yet and so does not dilute the estimate).

Sequences are contributions keyed by an id, and a contribution can be removed again (its counts
decremented, nodes whose count drops to 0 deleted): the shared trie evicts its oldest
contributions to stay under a node cap (`SharedSuffixTrie`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence


class SuffixNode:
    """One substring: `count` occurrences; `children` maps the next token to its node."""

    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, SuffixNode] = {}
        self.count = 0


class SuffixTrie:
    """Suffix paths of up to `max_depth` tokens of one or more sequences, with counts."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = SuffixNode()
        self.num_nodes = 0  # excluding the root

    def append(self, open_paths: list[SuffixNode], token: int) -> list[SuffixNode]:
        """Add one token to a sequence whose open paths are `open_paths` (the nodes of the
        suffixes that start at its last max_depth - 1 positions, oldest start first); returns
        the new open paths, same order. Mutates counts and adds nodes."""
        extended = []
        for node in (*open_paths, self.root):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = SuffixNode()
                self.num_nodes += 1
            child.count += 1
            extended.append(child)
        # the path started max_depth tokens ago is complete (depth max_depth): drop it
        return extended[1:] if len(extended) == self.max_depth else extended

    def remove(self, token_ids: Sequence[int]) -> None:
        """Undo `append` of every token of one sequence (all of it must have been inserted, in
        one contribution); nodes whose count reaches 0 are deleted with their subtrees."""
        length = len(token_ids)
        for start in range(length):
            node = self.root
            for token in token_ids[start : min(length, start + self.max_depth)]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    self.num_nodes -= _subtree_size(child)
                    break
                node = child

    def find(self, token_ids: Sequence[int]) -> SuffixNode | None:
        """The node of the substring `token_ids` (len <= max_depth), None if never seen."""
        node = self.root
        for token in token_ids:
            found = node.children.get(token)
            if found is None:
                return None
            node = found
        return node

    def draft(
        self, history: Sequence[int], max_pattern_len: int, spec_factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """The most frequent continuation of the longest suffix of `history` (at most
        `max_pattern_len` tokens) that has a continuation here, and its score.

        SuffixDecoding §3 (path variant): the draft holds at most ceil(spec_factor x p) tokens
        for a match of p tokens (longer matches are trusted with longer drafts) and stops before
        a token whose path probability (the product of conditional estimates along the draft)
        falls below `min_prob`. The score is the sum of those path probabilities, the draft's
        expected number of accepted tokens under the counts. Returns ([], 0.0) on no match.
        """
        match, match_len = None, 0
        for p in range(1, min(max_pattern_len, len(history), self.max_depth - 1) + 1):
            node = self.find(history[len(history) - p :])
            if node is None:
                break  # a longer suffix cannot occur if this one does not
            if node.children:
                match, match_len = node, p
        if match is None:
            return [], 0.0
        limit = min(self.max_depth - match_len, math.ceil(spec_factor * match_len))
        return _best_path(match, limit, min_prob)


def _best_path(node: SuffixNode, limit: int, min_prob: float) -> tuple[list[int], float]:
    """Greedy most-frequent path below `node` of at most `limit` tokens (see `draft`)."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < limit and node.children:
        total = sum(child.count for child in node.children.values())
        token, child = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))
        prob *= child.count / total
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        node = child
    return draft, score


def _subtree_size(node: SuffixNode) -> int:
    """Nodes in the subtree rooted at `node`, itself included."""
    size, stack = 0, [node]
    while stack:
        current = stack.pop()
        size += 1
        stack.extend(current.children.values())
    return size


class SharedSuffixTrie:
    """A `SuffixTrie` over several sequences (contributions), capped at `max_nodes` nodes.

    Each contribution is a growing sequence keyed by an id. When the trie exceeds `max_nodes`,
    whole contributions are removed, oldest first (the current one last), and an evicted id adds
    nothing more: memory stays bounded by max_nodes plus one token's max_depth new nodes.
    """

    def __init__(self, max_depth: int, max_nodes: int) -> None:
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.trie = SuffixTrie(max_depth)
        self.max_nodes = max_nodes
        # id -> (tokens inserted, open paths); insertion order = age
        self._contributions: OrderedDict[str, tuple[list[int], list[SuffixNode]]] = OrderedDict()
        self._evicted: set[str] = set()

    def extend(self, contribution_id: str, token_ids: Sequence[int]) -> None:
        """Append tokens to a contribution (created on first use), then evict to the cap."""
        if contribution_id in self._evicted or not token_ids:
            return
        tokens, paths = self._contributions.setdefault(contribution_id, ([], []))
        for token in token_ids:
            paths = self.trie.append(paths, token)
            tokens.append(token)
        self._contributions[contribution_id] = (tokens, paths)
        while self.trie.num_nodes > self.max_nodes and self._contributions:
            self.evict_oldest()

    def evict_oldest(self) -> str:
        """Remove the oldest contribution's counts; returns its id (it adds nothing more)."""
        victim, (tokens, _) = self._contributions.popitem(last=False)
        self.trie.remove(tokens)
        self._evicted.add(victim)
        return victim

    def close(self, contribution_id: str) -> None:
        """The contribution will not grow again: keep its counts, drop its open paths (and
        forget it was evicted, so the id's set entry does not grow for ever)."""
        entry = self._contributions.get(contribution_id)
        if entry is not None:
            self._contributions[contribution_id] = (entry[0], [])
        self._evicted.discard(contribution_id)

    def contribution_ids(self) -> list[str]:
        """The ids whose counts are in the trie, oldest first."""
        return list(self._contributions)
