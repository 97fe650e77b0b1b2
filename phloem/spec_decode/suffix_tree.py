"""The suffix index of SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975, §3): for a request's
history, the longest suffix seen in the indexed sequences, and the most frequent continuation of
that suffix with its estimated probabilities, found from the suffix's occurrences.

The paper keeps a suffix tree with occurrence counts. A trie of depth D costs D node updates per
token (every path that starts in the last D positions grows), and where a batch copies its
prompts every such path is a repeat and stays open: at depth 32 the catch-up of a batch-32
proposal cost ~13 ms, 8 steps of a small model on a GPU (benchmarks/results/2026-11-26f-cpu-spec-
overhead and 2026-11-26g-cpu-suffix-cost). This index does O(1) work per token, and counts at
draft time instead:

- per key length K in `KEY_LENS` (12, 4, 1), a hash table holds the latest position whose last
  K tokens have a key (the tokens packed into one int, `_key`), and each position links to the previous one of the same key (a chain
  per key, newest first; plain ints, nothing for Python's cyclic GC to scan);
- a lookup walks the chain of the longest key length that fits and has an occurrence with a
  next token, takes the `max_matches` most recent such occurrences, extends each match
  backwards (at most `max_len` tokens), and keeps the occurrences of the longest match, p
  tokens (the long keys find a long match among the few occurrences of its 12- or 4-gram, not
  among the many of its last token);
- the draft follows those occurrences forward: at each step the most frequent next token
  (ties: the lower id), its conditional probability = its count / the occurrences that go on.

So counts are those of a suffix trie of depth `max_depth` (a node's count = the substring's
occurrences) restricted to the `max_matches` most recent occurrences of the key: exact where a
key occurs at most that often, an estimate from recent text where it is more common. A key that
hits fewer than K tokens of the suffix (a collision: ids outside [0, 2^32)) is skipped.

    sequence:  ... s_{e-p+1} ... s_e | s_{e+1} ... s_{e+d}      (one occurrence, ends at e)
    history:   ... h_{L-p}  ... h_{L-1}                         (the suffix, p tokens matched)
                                       draft: the majority s_{e+1}, then among those s_{e+2}, ...

Sequences are contributions keyed by an id (a request's own history is one; the shared index
holds many requests' outputs); the shared index removes its oldest contributions to stay under a
token cap (`SharedSuffixIndex`). "Most recent" is the order positions were indexed in, except
that a removal re-indexes the contributions held, oldest first, each whole.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

KEY_LENS = (12, 4, 1)  # the key lengths, longest first [tokens]
_POS_BITS = 32  # an occurrence is one int: (slot << 32) | end position
_POS_MASK = (1 << _POS_BITS) - 1
NO_POS = -1


# A key of K tokens packs them 32 bits apiece, the oldest highest, as one int masked to K x 32
# bits: each position's key comes from the previous one's by a shift, an or and a mask
# (`SuffixIndex._link`), ~2x cheaper a token than hashing a tuple of each window. The key is a
# function of the window's tokens alone (older bits are shifted out past the mask), so equal
# windows share a key for any int ids; ids outside [0, 2^32) may collide, which a lookup skips
# (a hit that matches fewer than K tokens), so drafts do not depend on the key function.
_MASKS = tuple((1 << (32 * length)) - 1 for length in KEY_LENS)
assert KEY_LENS[-1] == 1 and len(KEY_LENS) == 3  # `SuffixIndex._link` is written for these


def _key(tokens: Sequence[int], end: int, length: int) -> int:
    """The key of `tokens[end - length + 1 : end + 1]` (the token itself for length 1)."""
    if length == 1:
        return tokens[end]
    key, mask = 0, (1 << (32 * length)) - 1
    for token in tokens[end - length + 1 : end + 1]:
        key = ((key << 32) | token) & mask
    return key


class Suffix(NamedTuple):
    """A history's last tokens as `SuffixIndex.match` reads them.

    Attributes:
        tokens: the last n = min(max_len, len(history), max_depth - 1) tokens.
        keys: per key length of `KEY_LENS`, the key of the last `length` tokens (`_key`);
            None where length > n.
    """

    tokens: list[int]
    keys: tuple[int | None, ...]

    @classmethod
    def of(cls, history: Sequence[int], max_len: int, max_depth: int) -> Suffix:
        """The suffix of `history` that an index of `max_depth` matches, at most `max_len`
        tokens (`history` may be a view: one slice is taken)."""
        n = max(min(max_len, len(history), max_depth - 1), 0)
        tokens = list(history[len(history) - n :]) if n else []
        keys = tuple(_key(tokens, n - 1, length) if length <= n else None for length in KEY_LENS)
        return cls(tokens, keys)


class SuffixIndex:
    """Occurrences of suffixes in one or more growing sequences (see the module docstring).

    Storage per contribution (a slot): its tokens and, per key length, `prev[k][i]`, the
    previous occurrence (any slot) of the key that ends at position i (NO_POS if none, or i is
    too close to the start); `latest[k]` maps a key to its newest occurrence.
    """

    def __init__(self, max_depth: int, max_matches: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        self.max_depth, self.max_matches = max_depth, max_matches
        self.num_tokens = 0
        self._slots: OrderedDict[str, int] = OrderedDict()  # id -> slot, oldest first
        self._tokens: dict[int, list[int]] = {}
        self._prev: dict[int, list[list[int]]] = {}
        self._roll: dict[int, list[int]] = {}  # slot -> its 12- and 4-token keys at its end
        self._latest: list[dict[int, int]] = [{} for _ in KEY_LENS]
        self._next_slot = 0

    def extend(self, contribution_id: str, token_ids: Sequence[int]) -> None:
        """Append tokens to a contribution (created on first use); O(len(token_ids)) hash
        inserts per key length. Token ids must be ints."""
        slot = self._slots.get(contribution_id)
        if slot is None:
            slot = self._slots[contribution_id] = self._next_slot
            self._next_slot += 1
            self._tokens[slot], self._prev[slot] = [], [[] for _ in KEY_LENS]
            self._roll[slot] = [0, 0]
        tokens = self._tokens[slot]
        start = len(tokens)
        tokens.extend(token_ids)
        self.num_tokens += len(tokens) - start
        self._link(slot, start)

    def _link(self, slot: int, start: int) -> None:
        """Chain the keys that end at positions start .. len - 1 of a slot, in order: one pass
        over the tokens, each position's keys rolled from the previous position's (`_MASKS`;
        the slot's keys at its last position are kept in `_roll`)."""
        tokens, base = self._tokens[slot], slot << _POS_BITS
        (long_chain, mid_chain, token_chain), roll = self._prev[slot], self._roll[slot]
        long_latest, mid_latest, token_latest = self._latest
        long_get, mid_get, token_get = long_latest.get, mid_latest.get, token_latest.get
        (long_back, mid_back, _), (long_mask, mid_mask, _) = [n - 1 for n in KEY_LENS], _MASKS
        long_key, mid_key = roll
        for pos in range(start, min(long_back, len(tokens))):  # too close to the start for
            token = tokens[pos]  # a 12-token key (and maybe a 4-token one)
            long_key = ((long_key << 32) | token) & long_mask
            mid_key = ((mid_key << 32) | token) & mid_mask
            long_chain.append(NO_POS)
            if pos >= mid_back:
                mid_chain.append(mid_get(mid_key, NO_POS))
                mid_latest[mid_key] = base | pos
            else:
                mid_chain.append(NO_POS)
            token_chain.append(token_get(token, NO_POS))
            token_latest[token] = base | pos
        for pos in range(max(start, long_back), len(tokens)):
            token = tokens[pos]
            long_key = ((long_key << 32) | token) & long_mask
            mid_key = ((mid_key << 32) | token) & mid_mask
            occ = base | pos
            long_chain.append(long_get(long_key, NO_POS))
            long_latest[long_key] = occ
            mid_chain.append(mid_get(mid_key, NO_POS))
            mid_latest[mid_key] = occ
            token_chain.append(token_get(token, NO_POS))
            token_latest[token] = occ
        roll[0], roll[1] = long_key, mid_key

    def extend_pair(
        self, contribution_id: str, token_ids: Sequence[int], other: SuffixIndex, other_id: str
    ) -> None:
        """`self.extend(contribution_id, token_ids)`, then `other.extend(other_id, token_ids)`
        (a request's own index and its outputs in the shared one), in one pass where both
        contributions hold at least a long key's tokens and end alike: a position's keys are
        those of its window's tokens, equal in both, so they are rolled once (a verify step's
        ~13 tokens a request: ~25 % less than the two passes). Else the two calls."""
        slot, other_slot = self._slots.get(contribution_id), other._slots.get(other_id)
        back = KEY_LENS[0] - 1
        if slot is None or other_slot is None or other is self or not token_ids:
            self.extend(contribution_id, token_ids)
            other.extend(other_id, token_ids)
            return
        tokens, other_tokens = self._tokens[slot], other._tokens[other_slot]
        if len(other_tokens) < back or len(tokens) < back or tokens[-back:] != other_tokens[-back:]:
            self.extend(contribution_id, token_ids)
            other.extend(other_id, token_ids)
            return
        start, other_start = len(tokens), len(other_tokens)
        tokens.extend(token_ids)
        other_tokens.extend(token_ids)
        self.num_tokens += len(tokens) - start
        other.num_tokens += len(tokens) - start
        self._link_pair(slot, start, other, other_slot, other_start)

    def _link_pair(
        self, slot: int, start: int, other: SuffixIndex, other_slot: int, other_start: int
    ) -> None:
        """`_link` of both slots (`extend_pair`), the keys rolled from this slot's."""
        tokens, base, other_base = self._tokens[slot], slot << _POS_BITS, other_slot << _POS_BITS
        (long_chain, mid_chain, token_chain), roll = self._prev[slot], self._roll[slot]
        long_latest, mid_latest, token_latest = self._latest
        long_get, mid_get, token_get = long_latest.get, mid_latest.get, token_latest.get
        other_long_chain, other_mid_chain, other_token_chain = other._prev[other_slot]
        other_long, other_mid, other_token = other._latest
        other_long_get, other_mid_get, other_token_get = (
            other_long.get,
            other_mid.get,
            other_token.get,
        )
        (long_mask, mid_mask, _), (long_key, mid_key) = _MASKS, roll
        for pos, other_pos in zip(range(start, len(tokens)), itertools.count(other_start)):
            token = tokens[pos]
            long_key = ((long_key << 32) | token) & long_mask
            mid_key = ((mid_key << 32) | token) & mid_mask
            occ, other_occ = base | pos, other_base | other_pos
            long_chain.append(long_get(long_key, NO_POS))
            long_latest[long_key] = occ
            mid_chain.append(mid_get(mid_key, NO_POS))
            mid_latest[mid_key] = occ
            token_chain.append(token_get(token, NO_POS))
            token_latest[token] = occ
            other_long_chain.append(other_long_get(long_key, NO_POS))
            other_long[long_key] = other_occ
            other_mid_chain.append(other_mid_get(mid_key, NO_POS))
            other_mid[mid_key] = other_occ
            other_token_chain.append(other_token_get(token, NO_POS))
            other_token[token] = other_occ
        roll[0], roll[1] = long_key, mid_key
        other._roll[other_slot][:] = roll

    def remove(self, contribution_ids: Sequence[str]) -> None:
        """Drop contributions and re-chain the rest, oldest first: O(tokens held). Afterwards
        the index equals one built by extending the held contributions whole, oldest first."""
        for cid in contribution_ids:
            slot = self._slots.pop(cid)
            self.num_tokens -= len(self._tokens.pop(slot))
            del self._prev[slot], self._roll[slot]
        self._latest = [{} for _ in KEY_LENS]
        for slot in self._slots.values():
            self._prev[slot], self._roll[slot] = [[] for _ in KEY_LENS], [0, 0]
            self._link(slot, 0)

    def contribution_ids(self) -> list[str]:
        """The ids held, oldest first."""
        return list(self._slots)

    def num_tokens_of(self, contribution_id: str) -> int:
        """The tokens a contribution holds (0 if none)."""
        slot = self._slots.get(contribution_id)
        return 0 if slot is None else len(self._tokens[slot])

    def suffix(self, contribution_id: str, max_len: int) -> Suffix:
        """`Suffix.of` the contribution's tokens (it must exist), its keys read from the last
        `_link` instead of packed again (a request's own index: its history's suffix, for
        every index that drafts for it)."""
        slot = self._slots[contribution_id]
        tokens, (long_key, mid_key) = self._tokens[slot], self._roll[slot]
        n = max(min(max_len, len(tokens), self.max_depth - 1), 0)
        if not n:
            return Suffix([], (None,) * len(KEY_LENS))
        (long_len, mid_len, _) = KEY_LENS
        keys = (long_key if long_len <= n else None, mid_key if mid_len <= n else None, tokens[-1])
        return Suffix(tokens[-n:], keys)

    def match(self, suffix: Suffix) -> tuple[int, list[int]]:
        """The longest suffix of the history (p <= len(suffix.tokens) tokens) seen here with a
        next token, among the `max_matches` most recent occurrences of the longest key that
        fits; returns (p, the occurrences of that suffix, newest first) or (0, []). Reads only."""
        suffix_tokens, keys = suffix.tokens, suffix.keys
        n = max_len = len(suffix_tokens)
        for k, length in enumerate(KEY_LENS):
            if length > max_len:
                continue
            occ = self._latest[k].get(keys[k], NO_POS)
            found, best, best_occ = 0, 0, []
            while occ != NO_POS and found < self.max_matches:
                slot, end = occ >> _POS_BITS, occ & _POS_MASK
                tokens = self._tokens[slot]
                if end + 1 < len(tokens):  # has a next token
                    p, limit = 0, min(max_len, end + 1)
                    while p < limit and tokens[end - p] == suffix_tokens[n - 1 - p]:
                        p += 1
                    if p >= length:  # not a collision
                        found += 1
                        if p > best:
                            best, best_occ = p, [occ]
                        elif p == best:
                            best_occ.append(occ)
                occ = self._prev[slot][k][end]
            if found:
                return best, best_occ
        return 0, []

    def bridge(
        self,
        suffix: Suffix,
        p: int,
        occs: list[int],
        min_run: int,
        source_end: int = _POS_MASK,
    ) -> tuple[int, list[int]]:
        """Extend a match of p tokens (`match`: `occs` its occurrences) across one substituted
        token: for each occurrence, q = how many tokens behind the one where its match stopped
        (that token skipped on both sides) equal the history's, all within the suffix's
        tokens; only occurrences that end before position `source_end` of their sequence (the
        proposer: the request's prompt) count. Returns (p + q, the occurrences with that q) for
        the longest q if it is at least `min_run`, else (p, occs). Reads only;
        O(occurrences x max_len).

            source:   ... s_a .. s_b  x  s_e-p+1 .. s_e | next
            history:  ... h_a .. h_b  y  h_L-p  .. h_L-1       (x != y; q = b - a + 1)
        """
        suffix_tokens = suffix.tokens
        n = len(suffix_tokens)
        if not 0 < p < n - min_run:
            return p, occs
        best, best_occ = 0, occs
        for occ in occs:
            end = occ & _POS_MASK
            if end >= source_end:
                continue
            tokens = self._tokens[occ >> _POS_BITS]
            q, limit = 0, min(n - p - 1, end - p)
            while q < limit and tokens[end - p - 1 - q] == suffix_tokens[n - p - 2 - q]:
                q += 1
            if q > best:
                best, best_occ = q, [occ]
            elif q == best and q:
                best_occ.append(occ)
        return (p + best, best_occ) if best >= max(min_run, 1) else (p, occs)

    def draft(
        self,
        history: Sequence[int],
        max_len: int,
        spec_factor: float,
        min_prob: float,
        min_len: int = 1,
        lead: int = 0,
        min_run: int = 0,
        source_end: int = _POS_MASK,
    ) -> tuple[list[int], float]:
        """`draft_suffix` of the history's last tokens (at most `max_len`): `Suffix.of`."""
        suffix = Suffix.of(history, max_len, self.max_depth)
        return self.draft_suffix(suffix, spec_factor, min_prob, min_len, lead, min_run, source_end)

    def draft_suffix(
        self,
        suffix: Suffix,
        spec_factor: float,
        min_prob: float,
        min_len: int = 1,
        lead: int = 0,
        min_run: int = 0,
        source_end: int = _POS_MASK,
    ) -> tuple[list[int], float]:
        """The most frequent continuation of the longest matching suffix (`match`) and its
        score.

        SuffixDecoding §3 (path variant): the draft holds at most ceil(spec_factor x p) tokens
        for a match of p tokens (and p + draft <= max_depth), and stops before a token whose
        path probability (the product of conditional estimates along the draft) falls below
        `min_prob`. The score is the sum of those path probabilities, the draft's expected
        number of accepted tokens under the counts. `lead` more tokens are allowed where the
        first ones predict tokens already on their way (`DraftRequest.num_lead_tokens`): the
        cap is on what is drafted past them. `min_run` > 0: a match (ending before
        `source_end`) that stopped at a token the history substituted counts the run behind it
        too where that run holds at least `min_run` tokens (`bridge`; the cap and `min_len` read
        p + q, and the draft follows the occurrences that the run aligns), so that the first
        draft after an edit of a copied text is as long as before the edit, not
        ceil(spec_factor x 1 or 2). Returns ([], 0.0) on no match or one shorter than
        `min_len` tokens. Reads only. `suffix`: the history's last tokens and their keys
        (`Suffix.of`), built once for the indexes that draft for the same history.
        """
        p, occs = self.match(suffix)
        length = p
        if min_run:  # a match restarted after a substitution counts the run behind it
            length, occs = self.bridge(suffix, p, occs, min_run, source_end)
        if length < max(min_len, 1):
            return [], 0.0
        limit = min(self.max_depth - p, math.ceil(spec_factor * length)) + lead
        runs = [(self._tokens[occ >> _POS_BITS], (occ & _POS_MASK) + 1) for occ in occs]
        return _walk(runs, limit, min_prob)


def _walk(
    runs: list[tuple[list[int], int]], limit: int, min_prob: float
) -> tuple[list[int], float]:
    """`SuffixIndex.draft`'s walk forward from the occurrences (token list, position after the
    match): at each position the majority next token (ties: the lower id) and its conditional
    probability, at most `limit` tokens, stopping below path probability `min_prob`. Returns
    (draft, score: the sum of the path probabilities)."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    narrowed = True  # the occurrences followed changed: try the rest of the path at once
    while len(draft) < limit:
        pos = len(draft)
        if narrowed:  # they all go on alike (one of them left, or copies of one text):
            tokens, start = runs[0]  # the rest of the path has probability 1
            tail = tokens[start + pos : start + limit]
            if all(t[s + pos : s + limit] == tail for t, s in runs[1:]):
                draft += tail
                for _ in tail:  # (the sum as the loop below adds it, bit for bit)
                    score += prob
                break
        num_runs = len(runs)
        groups: dict[int, list[tuple[list[int], int]]] = {}  # next token -> its runs
        for run in runs:
            tokens, start = run
            if start + pos < len(tokens):
                token = tokens[start + pos]
                group = groups.get(token)
                if group is None:
                    groups[token] = [run]
                else:
                    group.append(run)
        if not groups:
            break
        if len(groups) == 1:  # every occurrence that goes on agrees: probability 1
            token, runs = groups.popitem()
        else:
            token = min(groups, key=lambda t: (-len(groups[t]), t))
            runs = groups[token]
            prob *= len(runs) / sum(map(len, groups.values()))
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        narrowed = len(runs) < num_runs
    return draft, score


class SharedSuffixIndex:
    """A `SuffixIndex` over several requests' outputs, capped at `max_tokens` tokens.

    When the index exceeds `max_tokens`, whole contributions are removed, oldest first (the
    current one last), until it holds at most 90 % of the cap (so one O(tokens) re-chaining
    frees >= 10 %), and an evicted id adds nothing more.
    """

    def __init__(self, max_depth: int, max_matches: int, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.index = SuffixIndex(max_depth, max_matches)
        self.max_tokens = max_tokens
        self._evicted: set[str] = set()

    def extend(self, contribution_id: str, token_ids: Sequence[int]) -> None:
        """Append tokens to a contribution (created on first use), then evict to the cap."""
        if contribution_id in self._evicted or not token_ids:
            return
        self.index.extend(contribution_id, token_ids)
        self._evict()

    def _evict(self) -> None:
        """Over the cap: remove the oldest contributions to 90 % of it (the class docstring)."""
        if self.index.num_tokens > self.max_tokens:
            held = self.index.contribution_ids()
            victims, num_tokens = [], self.index.num_tokens
            for victim in held:
                if num_tokens <= 0.9 * self.max_tokens:
                    break
                num_tokens -= self.index.num_tokens_of(victim)
                victims.append(victim)
            self._drop(victims)

    def extend_with(
        self, contribution_id: str, token_ids: Sequence[int], own: SuffixIndex, own_id: str
    ) -> None:
        """`own.extend(own_id, token_ids)` and `self.extend(contribution_id, token_ids)` in one
        pass where they can share it (`SuffixIndex.extend_pair`)."""
        if contribution_id in self._evicted or not token_ids:
            own.extend(own_id, token_ids)
            return
        own.extend_pair(own_id, token_ids, self.index, contribution_id)
        self._evict()

    def evict_oldest(self) -> str:
        """Remove the oldest contribution; returns its id (it adds nothing more)."""
        victim = self.index.contribution_ids()[0]
        self._drop([victim])
        return victim

    def _drop(self, victims: list[str]) -> None:
        self.index.remove(victims)
        self._evicted.update(victims)

    def close(self, contribution_id: str) -> None:
        """The contribution will not grow again: keep its tokens (and forget it was evicted, so
        the set of evicted ids does not grow for ever)."""
        self._evicted.discard(contribution_id)

    def contribution_ids(self) -> list[str]:
        """The ids whose tokens are held, oldest first."""
        return self.index.contribution_ids()
