"""Suffix drafts (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975): the most frequent
continuation of the request's recent tokens, from a suffix trie over the request's own prompt and
outputs and from one shared trie over the outputs of the batch's other requests (batch jobs -
extraction, rewriting, code edits - repeat themselves across requests).

Per request and step: both tries draft (`SuffixTrie.draft`: longest matching suffix, the
most frequent path below it, at most ceil(spec_factor x match length) tokens, cut where the path
probability drops below `min_token_prob`), and the draft with the higher score (expected
accepted tokens) wins, cut to the request's `max_draft_tokens` (§3-4 of the paper, with a path
instead of a speculation tree: phloem verifies one chain of drafts per request).

Memory: a request's own trie holds at most (prompt + output) x max_depth nodes and goes with the
request (`finish`); the shared trie is capped at `max_shared_nodes`, evicting the oldest
requests' outputs first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phloem.spec_decode.proposer import DraftRequest, Proposer, check_draft_request
from phloem.spec_decode.suffix_tree import SharedSuffixTrie, SuffixTrie


@dataclass(frozen=True)
class SuffixConfig:
    """Settings of the suffix proposer.

    Attributes:
        max_depth: the tries' depth: the longest substring counted [tokens]; a draft and the
            suffix it continues fit in it together.
        max_pattern_len: the longest suffix of the history matched [tokens], < max_depth.
        spec_factor: draft length per matched token (the paper's alpha): a match of p tokens
            drafts at most ceil(spec_factor x p) [tokens / token].
        min_token_prob: the draft stops before a token whose estimated path probability is
            below it (the paper's threshold), in (0, 1].
        max_shared_nodes: the cap on the shared trie's nodes [nodes].
        use_shared: draft from other requests' outputs too (False: own history only).
    """

    max_depth: int = 32
    max_pattern_len: int = 16
    spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_shared_nodes: int = 1_000_000
    use_shared: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the field out of range."""
        if self.max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {self.max_depth}")
        if not 1 <= self.max_pattern_len < self.max_depth:
            raise ValueError(
                f"max_pattern_len must lie in [1, max_depth = {self.max_depth}), "
                f"got {self.max_pattern_len}"
            )
        if self.spec_factor <= 0:
            raise ValueError(f"spec_factor must be > 0, got {self.spec_factor}")
        if not 0 < self.min_token_prob <= 1:
            raise ValueError(f"min_token_prob must lie in (0, 1], got {self.min_token_prob}")
        if self.max_shared_nodes < 1:
            raise ValueError(f"max_shared_nodes must be >= 1, got {self.max_shared_nodes}")


@dataclass
class _RequestState:
    """A request's own trie and how much of its history the tries have seen."""

    trie: SuffixTrie
    open_paths: list[int]  # node ids (see `SuffixTrie.append`)
    num_indexed: int  # tokens of the history in its own trie
    num_shared: int  # output tokens given to the shared trie


class SuffixProposer(Proposer):
    """SuffixDecoding drafts (see the module docstring)."""

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.config.validate()
        self.shared = SharedSuffixTrie(self.config.max_depth, self.config.max_shared_nodes)
        self._requests: dict[str, _RequestState] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Drafts per request (see `Proposer.propose`). Indexes every request's new tokens
        first (so requests of this step learn from each other), then drafts."""
        for request in requests:
            check_draft_request(request)
            self._index(request)
        return [self._draft(request) for request in requests]

    def finish(self, request_id: str) -> None:
        """Drop the request's own trie; its outputs stay in the shared trie until evicted."""
        if self._requests.pop(request_id, None) is not None:
            self.shared.close(request_id)

    def _index(self, request: DraftRequest) -> None:
        """Add the tokens appended since the last call to the request's trie, and its new
        output tokens to the shared trie."""
        state = self._requests.get(request.request_id)
        tokens = request.token_ids
        if state is None or state.num_indexed > len(tokens):
            state = _RequestState(SuffixTrie(self.config.max_depth), [], 0, 0)
            self._requests[request.request_id] = state
        trie, paths = state.trie, state.open_paths
        for token in tokens[state.num_indexed :]:
            paths = trie.append(paths, token)
        state.open_paths, state.num_indexed = paths, len(tokens)
        if self.config.use_shared:
            start = request.num_prompt_tokens + state.num_shared
            self.shared.extend(request.request_id, tokens[start:])
            state.num_shared = len(tokens) - request.num_prompt_tokens

    def _draft(self, request: DraftRequest) -> list[int]:
        """The better-scoring of the own and shared tries' drafts, cut to max_draft_tokens.

        The request's open paths in each trie are the nodes of its history's suffixes, so only
        suffixes longer than its part in the shared trie (its outputs) are looked up."""
        if request.max_draft_tokens == 0:
            return []
        cfg = self.config
        state = self._requests[request.request_id]
        own = state.trie.suffix_nodes(
            request.token_ids, cfg.max_pattern_len, state.open_paths[::-1]
        )
        best, best_score = state.trie.draft(own, cfg.spec_factor, cfg.min_token_prob)
        if cfg.use_shared:
            trie = self.shared.trie
            known = self.shared.open_paths(request.request_id)[::-1]
            nodes = trie.suffix_nodes(request.token_ids, cfg.max_pattern_len, known)
            draft, score = trie.draft(nodes, cfg.spec_factor, cfg.min_token_prob)
            if score > best_score:
                best = draft
        return best[: request.max_draft_tokens]
