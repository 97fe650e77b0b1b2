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

_TOKEN_BITS = 32  # an edge's key: (parent node id << 32) | token id, token ids in [0, 2^32)
NO_NODE = -1


class SuffixTrie:
    """Suffix paths of up to `max_depth` tokens of one or more sequences, with counts.

    Flat storage (one dict of edges and per-node lists, about a third of the time of a node
    object per edge in CPython): node 0 is the root; `count[n]` its occurrences, `cont[n]` the
    sum of its children's counts, `best[n]` its child of highest count (ties: the lower token)
    and `best_token[n]` that child's token. Append keeps `best` exact (counts only grow); removal
    marks the nodes whose best child lost count, and `refresh_best()` recomputes them.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.edges: dict[int, int] = {}  # (parent << 32) | token -> child node id
        self.count, self.cont = [0], [0]
        self.best, self.best_token = [NO_NODE], [0]
        self._free: list[int] = []  # ids of removed nodes, reused by later appends
        self._stale: set[int] = set()  # nodes whose `best` must be recomputed

    @property
    def num_nodes(self) -> int:
        """Nodes, the root excluded."""
        return len(self.edges)

    def append(self, open_paths: list[int], token: int) -> list[int]:
        """Add one token to a sequence whose open paths are `open_paths` (the nodes of the
        suffixes that start at its last max_depth - 1 positions, oldest start first); returns
        the new open paths, same order. Mutates counts and adds nodes. `token` in [0, 2^32)."""
        edges, count, cont, best = self.edges, self.count, self.cont, self.best
        extended = []
        for node in (*open_paths, 0):
            key = (node << _TOKEN_BITS) | token
            child = edges.get(key)
            if child is None:  # a new node (inlined: this loop is the proposer's hot path)
                if self._free:
                    child = self._free.pop()
                    count[child], cont[child], best[child] = 0, 0, NO_NODE
                else:
                    child = len(count)
                    count.append(0)
                    cont.append(0)
                    best.append(NO_NODE)
                    self.best_token.append(0)
                edges[key] = child
            count[child] += 1
            cont[node] += 1
            top = best[node]
            if (
                top == NO_NODE
                or count[child] > count[top]
                or (count[child] == count[top] and token < self.best_token[node])
            ):
                best[node], self.best_token[node] = child, token
            extended.append(child)
        # the path started max_depth tokens ago is complete (depth max_depth): drop it
        return extended[1:] if len(extended) == self.max_depth else extended

    def remove(self, token_ids: Sequence[int]) -> None:
        """Undo `append` of every token of one sequence (all of it inserted, in one
        contribution): counts drop, nodes at count 0 are deleted; call `refresh_best()` before
        the next `draft`."""
        edges, count, cont = self.edges, self.count, self.cont
        length = len(token_ids)
        for start in range(length):
            node = 0
            for token in token_ids[start : min(length, start + self.max_depth)]:
                key = (node << _TOKEN_BITS) | token
                child = edges[key]
                count[child] -= 1
                cont[node] -= 1
                if self.best[node] == child:
                    self._stale.add(node)
                if count[child] == 0:  # the rest of this path held this occurrence only
                    del edges[key]
                    self._free.append(child)
                node = child

    def refresh_best(self) -> None:
        """Recompute `best` of the nodes removal touched: one pass over the edges, O(nodes)."""
        stale = self._stale
        if not stale:
            return
        for node in stale:
            self.best[node] = NO_NODE
        for node in self._free:
            stale.discard(node)
        for key, child in self.edges.items():
            node = key >> _TOKEN_BITS
            if node in stale:
                token, top = key & ((1 << _TOKEN_BITS) - 1), self.best[node]
                if top == NO_NODE or (self.count[child], -token) > (
                    self.count[top],
                    -self.best_token[node],
                ):
                    self.best[node], self.best_token[node] = child, token
        stale.clear()

    def find(self, token_ids: Sequence[int]) -> int:
        """The node of the substring `token_ids` (len <= max_depth), NO_NODE if never seen."""
        node = 0
        for token in token_ids:
            node = self.edges.get((node << _TOKEN_BITS) | token, NO_NODE)
            if node == NO_NODE:
                return NO_NODE
        return node

    def suffix_nodes(
        self, history: Sequence[int], max_len: int, known: Sequence[int] = ()
    ) -> list[int]:
        """Nodes of the suffixes of `history` of lengths 1, 2, ... (at most `max_len`, up to
        the first one never seen). `known`: the nodes of lengths 1..len(known) if the caller
        has them (a sequence's open paths, reversed), so only longer ones are looked up."""
        nodes = list(known[:max_len])
        for p in range(len(nodes) + 1, min(max_len, len(history), self.max_depth - 1) + 1):
            node = self.find(history[len(history) - p :])
            if node == NO_NODE:
                break  # a longer suffix cannot occur if this one does not
            nodes.append(node)
        return nodes

    def draft(
        self, suffix_nodes: Sequence[int], spec_factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """The most frequent continuation of the longest suffix (node `suffix_nodes[p - 1]` for
        length p, see `suffix_nodes`) that has a continuation here, and its score.

        SuffixDecoding §3 (path variant): the draft holds at most ceil(spec_factor x p) tokens
        for a match of p tokens (longer matches are trusted with longer drafts) and stops before
        a token whose path probability (the product of conditional estimates along the draft)
        falls below `min_prob`. The score is the sum of those path probabilities, the draft's
        expected number of accepted tokens under the counts. Returns ([], 0.0) on no match.
        """
        cont = self.cont
        match_len = len(suffix_nodes)
        while match_len and not cont[suffix_nodes[match_len - 1]]:
            match_len -= 1
        if not match_len:
            return [], 0.0
        node = suffix_nodes[match_len - 1]
        limit = min(self.max_depth - match_len, math.ceil(spec_factor * match_len))
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < limit and cont[node]:
            child = self.best[node]
            prob *= self.count[child] / cont[node]
            if prob < min_prob:
                break
            draft.append(self.best_token[node])
            score += prob
            node = child
        return draft, score

    def substring_counts(self) -> dict[tuple[int, ...], int]:
        """{substring: count} of every node (for tests; O(nodes x depth))."""
        out: dict[tuple[int, ...], int] = {}
        children: dict[int, list[tuple[int, int]]] = {}
        for key, child in self.edges.items():
            children.setdefault(key >> _TOKEN_BITS, []).append((key & 0xFFFFFFFF, child))
        stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]
        while stack:
            node, path = stack.pop()
            for token, child in children.get(node, []):
                out[path + (token,)] = self.count[child]
                stack.append((child, path + (token,)))
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError unless `cont` and `best` agree with the edges and counts."""
        cont: dict[int, int] = {}
        best: dict[int, tuple[int, int]] = {}
        for key, child in self.edges.items():
            node, token = key >> _TOKEN_BITS, key & 0xFFFFFFFF
            cont[node] = cont.get(node, 0) + self.count[child]
            if node not in best or (self.count[child], -token) > (
                self.count[best[node][0]],
                -best[node][1],
            ):
                best[node] = (child, token)
        for node, total in cont.items():
            assert self.cont[node] == total, (node, self.cont[node], total)
            assert (self.best[node], self.best_token[node]) == best[node], node
            assert self.count[node] >= total or node == 0


class SharedSuffixTrie:
    """A `SuffixTrie` over several sequences (contributions), capped at `max_nodes` nodes.

    Each contribution is a growing sequence keyed by an id. When the trie exceeds `max_nodes`,
    whole contributions are removed, oldest first (the current one last), until it holds at most
    90 % of the cap, and an evicted id adds nothing more: memory stays bounded by max_nodes plus
    one token's max_depth new nodes.
    """

    def __init__(self, max_depth: int, max_nodes: int) -> None:
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.trie = SuffixTrie(max_depth)
        self.max_nodes = max_nodes
        # id -> (tokens inserted, open paths); insertion order = age
        self._contributions: OrderedDict[str, tuple[list[int], list[int]]] = OrderedDict()
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
        if self.trie.num_nodes > self.max_nodes:
            # down to 90 % of the cap, so that one O(nodes) `refresh_best` pass frees >= 10 %
            while self.trie.num_nodes > 0.9 * self.max_nodes and self._contributions:
                self.evict_oldest()
            self.trie.refresh_best()

    def evict_oldest(self) -> str:
        """Remove the oldest contribution's counts; returns its id (it adds nothing more).
        Call `trie.refresh_best()` before the next draft."""
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

    def open_paths(self, contribution_id: str) -> list[int]:
        """The contribution's open paths (`SuffixTrie.append`; empty once closed or evicted)."""
        entry = self._contributions.get(contribution_id)
        return entry[1] if entry is not None else []

    def contribution_ids(self) -> list[str]:
        """The ids whose counts are in the trie, oldest first."""
        return list(self._contributions)
