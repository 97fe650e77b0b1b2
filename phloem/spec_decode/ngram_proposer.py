"""N-gram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of the
request's last n tokens, n from `max_n` down to `min_n` (prompt lookup decoding, Saxena 2023;
vLLM's `ngram` method).

Each request keeps an incremental index, one hash table per n: n-gram -> end position of its
latest occurrence that is not the history's own suffix. Appending a token inserts the
`max_n - min_n + 1` n-grams that end at the previous last token, so a step costs O(new tokens x
max_n) however long the prompt is, and a lookup costs one hash probe per n:

    history:   t_0 ... t_e | t_{e+1} ... t_{e+k} ... | t_{L-n} ... t_{L-1}
               match ends ^  drafts (k tokens)        the suffix (n tokens)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phloem.spec_decode.proposer import DraftRequest, Proposer, check_draft_request


@dataclass(frozen=True)
class NgramConfig:
    """Settings of the n-gram proposer.

    Attributes:
        min_n: the shortest suffix matched [tokens], >= 1.
        max_n: the longest suffix matched (tried first) [tokens], >= min_n.
    """

    min_n: int = 2
    max_n: int = 5

    def validate(self) -> None:
        """Raise ValueError naming the field out of range."""
        if self.min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {self.min_n}")
        if self.max_n < self.min_n:
            raise ValueError(f"max_n must be >= min_n = {self.min_n}, got {self.max_n}")


class NgramIndex:
    """One history's n-gram tables (see the module docstring); grows by `extend`.

    An n-gram's key is one int, its tokens packed 32 bits apiece (the oldest highest): ints are
    not tracked by Python's cyclic garbage collector, tuples are, and a batch's prompts indexed
    at once made tens of thousands of tuples, whose collections (full ones scan the engine's
    whole heap) cost a first proposal ~100 ms (results/2026-11-26f-cpu-spec-overhead). Token
    ids must lie in [0, 2^32)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.token_ids: list[int] = []
        # tables[n - min_n]: n-gram key -> end position of its latest occurrence ending <= L - 2
        self.tables: list[dict[int, int]] = [{} for _ in range(min_n, max_n + 1)]
        # the key of the last max_n tokens that end at the last linked end (L - 2): table n's
        # key there is its low n x 32 bits (`_masks`), so a step's tokens roll one key along
        self._roll = 0
        self._masks = [(1 << (32 * n)) - 1 for n in range(min_n, max_n + 1)]
        self._pairs = list(zip(self.tables, self._masks))

    def extend(self, new_token_ids: Sequence[int]) -> None:
        """Append tokens; O(len(new_token_ids) x max_n) int operations and hash inserts.

        The n-grams ending at positions old length - 1 .. new length - 2 become searchable
        (later ends overwrite earlier ones: the latest occurrence wins): per end, the key of
        its last max_n tokens from the previous end's by a shift, an or and a mask, and each
        table's key its low bits. A step's 17 tokens took 5.3 us (the tables of n = 2..5),
        against 11.4 us for list comprehensions per n and one `dict.update` a table, which
        were the faster way to pack each n-gram anew (results/2026-11-27c-cpu-spec-drafting)."""
        tokens = self.token_ids
        first = max(len(tokens) - 1, 0)  # the previous last token's n-grams become searchable
        tokens.extend(new_token_ids)
        stop = len(tokens) - 1  # the new last token's n-grams wait for the next token
        roll, mask, pairs = self._roll, self._masks[-1], self._pairs
        full = min(max(first, self.max_n - 1), stop)  # ends before it lack max_n tokens
        for end in range(first, full):
            roll = ((roll << 32) | tokens[end]) & mask
            for n, (table, table_mask) in enumerate(pairs, self.min_n):
                if n <= end + 1:  # (an n-gram that would start before position 0: none)
                    table[roll & table_mask] = end
        for end in range(full, stop):
            roll = ((roll << 32) | tokens[end]) & mask
            for table, table_mask in pairs:
                table[roll & table_mask] = end
        self._roll = roll

    def lookup(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` ids that followed the latest earlier occurrence of the longest
        matching suffix (n from max_n down to min_n); [] when no suffix occurred before."""
        tokens, length = self.token_ids, len(self.token_ids)
        if num_tokens <= 0:
            return []
        top = min(self.max_n, length - 1)
        suffix_key = _pack(tokens[length - top :])  # the last `top` tokens, as `extend` packs
        for n in range(top, self.min_n - 1, -1):
            end = self.tables[n - self.min_n].get(suffix_key & self._masks[n - self.min_n])
            if end is not None:
                return tokens[end + 1 : end + 1 + num_tokens]
        return []


def _pack(token_ids: Sequence[int]) -> int:
    """The key of these tokens, 32 bits apiece, the oldest highest (`NgramIndex`)."""
    key = 0
    for token in token_ids:
        key = (key << 32) | token
    return key


def brute_force_lookup(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The same answer as `NgramIndex.lookup`, by scanning the whole history (O(L x max_n));
    the oracle of the index's tests."""
    tokens, length = list(token_ids), len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k] if k > 0 else []
    return []


class NgramProposer(Proposer):
    """Prompt-lookup drafts from each request's own prompt and outputs (one `NgramIndex` per
    request, updated with the tokens appended since the previous call)."""

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self.config.validate()
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Drafts per request (see `Proposer.propose`); indexes the new tokens first."""
        drafts: list[list[int]] = []
        for request in requests:
            check_draft_request(request)
            index = self._indexes.get(request.request_id)
            if index is None or len(index.token_ids) > len(request.token_ids):
                index = NgramIndex(self.config.min_n, self.config.max_n)
                self._indexes[request.request_id] = index
            index.extend(request.token_ids[len(index.token_ids) :])
            drafts.append(index.lookup(request.max_draft_tokens))
        return drafts

    def finish(self, request_id: str) -> None:
        """Drop the request's index."""
        self._indexes.pop(request_id, None)
