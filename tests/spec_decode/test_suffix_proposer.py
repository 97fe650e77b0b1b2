"""The suffix proposer (SuffixDecoding): learns an output repeated across requests, drafts from
a request's own history, respects the length limits and the probability threshold, and keeps the
shared trie under its node cap by evicting the oldest requests' outputs."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phloem.spec_decode.proposer import DraftRequest
from phloem.spec_decode.suffix_proposer import SuffixConfig, SuffixProposer
from phloem.spec_decode.suffix_tree import SharedSuffixTrie, SuffixTrie

OUTPUT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]


def _generate(proposer, rid, prompt, output, k=8):
    """Feed a request's output one token at a time (as decode steps would); returns the drafts
    proposed before each output token."""
    drafts = []
    for i in range(len(output) + 1):
        history = prompt + output[:i]
        drafts += proposer.propose([DraftRequest(rid, history, len(prompt), k)])
    return drafts


def test_learns_an_output_repeated_across_requests() -> None:
    proposer = SuffixProposer(SuffixConfig(spec_factor=4.0))
    _generate(proposer, "a", [1, 2, 3], OUTPUT)
    proposer.finish("a")
    # another request, another prompt, its output starts like a's
    prompt = [7, 8, 9, 10]
    drafts = proposer.propose([DraftRequest("b", prompt + OUTPUT[:2], len(prompt), 5)])
    assert drafts == [OUTPUT[2:7]]
    alone = SuffixProposer(SuffixConfig(spec_factor=4.0, use_shared=False))
    assert alone.propose([DraftRequest("b", prompt + OUTPUT[:2], len(prompt), 5)]) == [[]]


def test_drafts_from_the_requests_own_prompt() -> None:
    proposer = SuffixProposer(SuffixConfig(spec_factor=2.0))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 0, 0]
    drafts = proposer.propose([DraftRequest("r", prompt + [5, 6, 7], len(prompt), 10)])
    assert drafts == [[8, 9, 10, 11, 12, 0]]  # match of 3 tokens x factor 2 = 6 tokens


def test_respects_max_draft_tokens_and_the_match_length_limit() -> None:
    proposer = SuffixProposer(SuffixConfig(spec_factor=1.0))
    history = list(range(20)) + [0, 1]
    assert proposer.propose([DraftRequest("r", history, 20, 10)]) == [[2, 3]]  # p = 2
    assert proposer.propose([DraftRequest("s", history + [2, 3], 20, 3)]) == [[4, 5, 6]]
    assert proposer.propose([DraftRequest("t", history, 20, 0)]) == [[]]


def test_the_threshold_cuts_an_uncertain_continuation() -> None:
    # after [1, 2]: 3 follows 3 times out of 4; after [1, 2, 3]: 4 and 5 split 2 / 1
    text = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 8, 9, 1, 2]
    trie = SuffixTrie(16)
    paths = []
    for token in text:
        paths = trie.append(paths, token)
    draft, score = trie.draft(trie.suffix_nodes(text, 2), spec_factor=8.0, min_prob=0.4)
    # P(3) = 3/4, P(3 4) = 3/4 x 2/3 = 1/2; 9 1 2 3 always follow "1 2 3 4" here (1/2 each);
    # then 4 and 5 split 1/1: 1/4 < 0.4 stops the draft
    assert draft == [3, 4, 9, 1, 2, 3]
    assert score == pytest.approx(0.75 + 5 * 0.5)
    assert trie.draft(trie.suffix_nodes(text, 2), spec_factor=8.0, min_prob=0.6)[0] == [3]
    assert trie.draft(trie.suffix_nodes(text, 2), spec_factor=8.0, min_prob=0.8) == ([], 0.0)


def test_counts_and_removal_match_a_rebuild() -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    shared = SharedSuffixTrie(max_depth=5, max_nodes=10**6)
    for i, seq in enumerate(seqs):
        for start in range(0, len(seq), 3):
            shared.extend(str(i), seq[start : start + 3])
    shared.evict_oldest()
    shared.evict_oldest()
    rebuilt = SharedSuffixTrie(max_depth=5, max_nodes=10**6)
    for i, seq in enumerate(seqs[2:]):
        rebuilt.extend(str(i), seq)
    shared.trie.refresh_best()
    shared.trie.check_integrity()
    assert shared.trie.substring_counts() == rebuilt.trie.substring_counts()
    assert shared.trie.num_nodes == rebuilt.trie.num_nodes == len(rebuilt.trie.substring_counts())
    # the freed node ids are reused by later appends, and the trie stays consistent
    for i, seq in enumerate(seqs[:2]):
        shared.extend(f"again{i}", seq)
        rebuilt.extend(f"again{i}", seq)
    shared.trie.check_integrity()
    assert shared.trie.substring_counts() == rebuilt.trie.substring_counts()


def test_the_shared_trie_stays_under_its_cap_evicting_oldest_first() -> None:
    cfg = SuffixConfig(max_depth=8, max_pattern_len=4, max_shared_nodes=400, spec_factor=4.0)
    proposer = SuffixProposer(cfg)
    rng = random.Random(1)
    outputs = [[rng.randrange(1000, 2000) for _ in range(30)] for _ in range(10)]
    for i, output in enumerate(outputs):
        _generate(proposer, f"r{i}", [i], output)
        proposer.finish(f"r{i}")
        assert proposer.shared.trie.num_nodes <= cfg.max_shared_nodes
    kept = proposer.shared.contribution_ids()
    assert kept and kept[-1] == "r9" and "r0" not in kept
    proposer.shared.trie.check_integrity()
    assert len(proposer.shared.trie.substring_counts()) == proposer.shared.trie.num_nodes

    def probe(output):
        rid = f"probe{outputs.index(output)}"
        return proposer.propose([DraftRequest(rid, [7] + output[:3], 1, 4)])[0]

    assert probe(outputs[9]) == outputs[9][3:7]  # the newest is remembered
    assert probe(outputs[0]) == []  # the oldest was evicted
    proposer.finish("probe0")


def test_bad_config_raises_naming_the_field() -> None:
    for field, value in [("max_depth", 1), ("max_pattern_len", 32), ("spec_factor", 0.0),
                         ("min_token_prob", 0.0), ("max_shared_nodes", 0)]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            SuffixConfig(**{field: value}).validate()


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=25), min_size=1, max_size=5),
    depth=st.integers(2, 6),
    evict=st.integers(0, 4),
)
def test_counts_equal_substring_occurrences(seqs, depth, evict) -> None:
    """Every node's count is the number of occurrences of its substring (<= depth tokens) in
    the contributions still held, after random evictions; best children stay exact."""
    shared = SharedSuffixTrie(max_depth=depth, max_nodes=10**6)
    for i, seq in enumerate(seqs):
        shared.extend(str(i), seq)
    for _ in range(min(evict, len(shared.contribution_ids()))):
        shared.evict_oldest()
    shared.trie.refresh_best()
    shared.trie.check_integrity()
    held = [seqs[int(i)] for i in shared.contribution_ids()]
    want = Counter(
        tuple(seq[s : s + n]) for seq in held for s in range(len(seq))
        for n in range(1, depth + 1) if s + n <= len(seq)
    )  # fmt: skip
    assert shared.trie.substring_counts() == dict(want)
