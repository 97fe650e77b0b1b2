"""The n-gram proposer: continuations of repeated patterns, nothing on no match, and its
incremental index equal to a brute-force scan on random histories (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phloem.spec_decode.ngram_proposer import (
    NgramConfig,
    NgramIndex,
    NgramProposer,
    brute_force_lookup,
)
from phloem.spec_decode.proposer import DraftRequest


def _request(tokens, k=4, rid="r", prompt=None):
    return DraftRequest(rid, tokens, len(tokens) if prompt is None else prompt, k)


def test_finds_the_continuation_of_a_repeated_pattern() -> None:
    proposer = NgramProposer(NgramConfig(min_n=2, max_n=3))
    text = [5, 6, 7, 8, 9, 10, 1, 2, 5, 6, 7]
    assert proposer.propose([_request(text)]) == [[8, 9, 10, 1]]


def test_takes_the_latest_match_and_the_longest_n() -> None:
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=3))
    # "3 4" occurs twice (followed by 11, then 12); "2 3 4" once (followed by 11): longest wins
    tokens = [2, 3, 4, 11, 0, 3, 4, 12, 0, 2, 3, 4]
    assert proposer.propose([_request(tokens, k=2)]) == [[11, 0]]
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=2))
    assert proposer.propose([_request(tokens, k=2)]) == [[12, 0]]


def test_nothing_on_no_match_and_at_most_k() -> None:
    proposer = NgramProposer()
    assert proposer.propose([_request(list(range(50)))]) == [[]]
    assert proposer.propose([_request([1, 2, 1, 2, 1, 2], k=0, rid="z")]) == [[]]
    drafts = proposer.propose([_request([1, 2, 3] * 10, k=3, rid="y")])
    assert drafts == [[1, 2, 3]]


def test_the_index_follows_growing_histories_and_restarts_on_reuse() -> None:
    proposer = NgramProposer(NgramConfig(min_n=2, max_n=2))
    history = [1, 2, 3, 4]
    assert proposer.propose([_request(history)]) == [[]]
    history += [9, 1, 2]
    assert proposer.propose([_request(history)]) == [[3, 4, 9, 1]]
    assert proposer.propose([_request([7, 8, 7])]) == [[]]  # shorter: a new request
    proposer.finish("r")
    proposer.finish("unknown")


def test_bad_requests_raise_naming_the_field() -> None:
    with pytest.raises(ValueError, match="max_draft_tokens"):
        NgramProposer().propose([DraftRequest("r", [1, 2], 2, -1)])
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        NgramProposer().propose([DraftRequest("r", [1, 2], 3, 1)])
    with pytest.raises(ValueError, match="max_n"):
        NgramConfig(min_n=3, max_n=2).validate()
    with pytest.raises(ValueError, match="min_n"):
        NgramConfig(min_n=0).validate()


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=80),
    chunks=st.lists(st.integers(1, 20), min_size=1, max_size=20),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(0, 6),
)
def test_incremental_index_equals_brute_force(tokens, chunks, min_n, extra, k) -> None:
    index = NgramIndex(min_n, min_n + extra)
    pos, chunk_iter = 0, iter(chunks * 60)
    while pos < len(tokens):
        step = next(chunk_iter)
        index.extend(tokens[pos : pos + step])
        pos = min(len(tokens), pos + step)
        want = brute_force_lookup(tokens[:pos], min_n, min_n + extra, k)
        assert index.lookup(k) == want
