"""Suffix drafts (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975): the most frequent
continuation of the request's recent tokens, from a suffix index over the request's own prompt
and outputs and from one shared index over the outputs of the batch's other requests (batch jobs -
extraction, rewriting, code edits - repeat themselves across requests).

Per request and step: both indexes draft (`SuffixIndex.draft`: longest matching suffix, the
most frequent path after it, at most ceil(spec_factor x match length) tokens, cut where the path
probability drops below `min_token_prob`), and the draft with the higher score (expected
accepted tokens) wins, cut to the request's `max_draft_tokens` (§3-4 of the paper, with a path
instead of a speculation tree: phloem verifies one chain of drafts per request). A match in the
request's prompt that restarted after one substituted token (an edit of the text being copied)
also counts the run behind that token (`SuffixConfig.min_bridge_run`), so the first draft after
an edit is as long as the drafts before it, as n-gram drafts are. The counts are
taken over the `max_matches` most recent occurrences of the suffix's key (`suffix_tree`), so
indexing costs O(1) per token, not one trie node per depth.

Memory: a request's own index holds its history (a few ints per token) and goes with the
request (`finish`); the shared index is capped at `max_shared_tokens`, evicting the oldest
requests' outputs first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phloem.spec_decode.proposer import DraftRequest, Proposer, check_draft_request
from phloem.spec_decode.suffix_tree import SharedSuffixIndex, SuffixIndex


@dataclass(frozen=True)
class SuffixConfig:
    """Settings of the suffix proposer.

    Attributes:
        max_depth: the longest substring counted [tokens]: a draft and the suffix it continues
            fit in it together (the depth of the paper's tree).
        max_pattern_len: the longest suffix of the history matched [tokens], < max_depth.
        spec_factor: draft length per matched token (the paper's alpha): a match of p tokens
            drafts at most ceil(spec_factor x p) [tokens / token]. 2 (the paper's 1 took 72
            steps to 64 on the paced copy batch of 32: after each edit the match restarts at 2
            tokens and its drafts grow with it; benchmarks/results/2026-11-27-cpu-spec-suffix).
        min_token_prob: the draft stops before a token whose estimated path probability is
            below it (the paper's threshold), in (0, 1].
        max_matches: the most recent occurrences of a suffix's key that a match and its
            counts are taken from [occurrences], >= 1 (bounds a lookup's work on repetitive
            text).
        max_shared_tokens: the cap on the shared index's tokens [tokens].
        min_match_len: the shortest suffix either index drafts from [tokens], >= 1 (capped
            at max_pattern_len): a one-token match is mostly chance and drafts few tokens
            (ceil(spec_factor)); in random-id copy batches nearly all one-token matches in the
            shared index were rejected, pulling the acceptance rate down until the cost rule
            stopped drafting (benchmarks/results/2026-11-26g-cpu-suffix-cost).
        min_bridge_run: a match in the request's prompt that restarted after one substituted
            token (an edit of a copied text) counts the run matched behind that token where it
            is at least this long [tokens], 0 = off (`SuffixIndex.bridge`): its first draft
            after the edit is then as long as before it, one step after the edit, not
            ceil(spec_factor x 2) tokens two steps after it. In the prompt only: a model's own
            output repeats templates ("a source of beauty, with ..." / "of wonder, with ..."),
            where the text after the substituted word goes elsewhere. Measured in
            benchmarks/results/2026-11-27b-cpu-spec-drafts.
        use_shared: draft from other requests' outputs too (False: own history only).
    """

    max_depth: int = 32
    max_pattern_len: int = 16
    spec_factor: float = 2.0
    min_token_prob: float = 0.1
    max_matches: int = 64
    max_shared_tokens: int = 100_000
    min_match_len: int = 2
    min_bridge_run: int = 6
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
        if self.max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {self.max_matches}")
        if self.max_shared_tokens < 1:
            raise ValueError(f"max_shared_tokens must be >= 1, got {self.max_shared_tokens}")
        if self.min_match_len < 1:
            raise ValueError(f"min_match_len must be >= 1, got {self.min_match_len}")
        if self.min_bridge_run < 0:
            raise ValueError(f"min_bridge_run must be >= 0, got {self.min_bridge_run}")


@dataclass
class _RequestState:
    """A request's own index and how much of its outputs the shared index has seen."""

    index: SuffixIndex
    num_shared: int  # output tokens given to the shared index


class SuffixProposer(Proposer):
    """SuffixDecoding drafts (see the module docstring)."""

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.config.validate()
        cfg = self.config
        self.shared = SharedSuffixIndex(cfg.max_depth, cfg.max_matches, cfg.max_shared_tokens)
        self._requests: dict[str, _RequestState] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Drafts per request (see `Proposer.propose`). Indexes every request's new tokens
        first (so requests of this step learn from each other), then drafts."""
        for request in requests:
            check_draft_request(request)
            self._index(request)
        return [self._draft(request) for request in requests]

    def finish(self, request_id: str) -> None:
        """Drop the request's own index; its outputs stay in the shared index until evicted."""
        if self._requests.pop(request_id, None) is not None:
            self.shared.close(request_id)

    def _index(self, request: DraftRequest) -> None:
        """Add the tokens appended since the last call to the request's own index, and its new
        output tokens to the shared index."""
        state = self._requests.get(request.request_id)
        tokens = request.token_ids
        if state is None or state.index.num_tokens > len(tokens):
            own = SuffixIndex(self.config.max_depth, self.config.max_matches)
            state = self._requests[request.request_id] = _RequestState(own, 0)
        indexed = state.index.num_tokens
        new = tokens[indexed:]  # (one slice: `tokens` may be a view)
        start = request.num_prompt_tokens + state.num_shared
        if not self.config.use_shared:
            state.index.extend("", new)
            return
        if start == indexed:  # the same new tokens for both (all but the first call)
            self.shared.extend_with(request.request_id, new, state.index, "")
        else:
            state.index.extend("", new)
            self.shared.extend(request.request_id, tokens[start:])
        state.num_shared = len(tokens) - request.num_prompt_tokens

    def _draft(self, request: DraftRequest) -> list[int]:
        """The better-scoring of the own and shared indexes' drafts, cut to max_draft_tokens."""
        if request.max_draft_tokens == 0:
            return []
        cfg = self.config
        own = self._requests[request.request_id].index
        min_len = min(cfg.min_match_len, cfg.max_pattern_len)
        args = (cfg.spec_factor, cfg.min_token_prob, min_len, request.num_lead_tokens)
        # a match restarted after an edit bridges to the prompt only (`min_bridge_run`)
        bridge = (cfg.min_bridge_run, request.num_prompt_tokens)
        suffix = own.suffix("", cfg.max_pattern_len)  # the history's (`_index`), for both
        best, best_score = own.draft_suffix(suffix, *args, *bridge)
        if cfg.use_shared:
            draft, score = self.shared.index.draft_suffix(suffix, *args)
            if score > best_score:
                best = draft
        return best[: request.max_draft_tokens]
