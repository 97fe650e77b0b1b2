"""The suffix proposer (SuffixDecoding): learns an output repeated across requests, drafts from
a request's own history, respects the length limits and the probability threshold, keeps the
shared index under its token cap by evicting the oldest requests' outputs, and its index drafts
what a brute-force matcher over the same sequences drafts."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phloem.spec_decode.proposer import DraftRequest
from phloem.spec_decode.suffix_proposer import SuffixConfig, SuffixProposer
from phloem.spec_decode.suffix_tree import KEY_LENS, SharedSuffixIndex, Suffix, SuffixIndex

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
    # one token in common with the shared outputs is not enough (min_match_len = 2)
    assert proposer.propose([DraftRequest("c", prompt + OUTPUT[:1], len(prompt), 5)]) == [[]]
    loose = SuffixProposer(SuffixConfig(spec_factor=4.0, min_match_len=1))
    _generate(loose, "a", [1, 2, 3], OUTPUT)
    assert loose.propose([DraftRequest("c", prompt + OUTPUT[:1], len(prompt), 5)]) == [OUTPUT[1:5]]


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
    index = SuffixIndex(max_depth=16, max_matches=64)
    index.extend("", text)
    draft, score = index.draft(text, 2, spec_factor=8.0, min_prob=0.4)
    # P(3) = 3/4, P(3 4) = 3/4 x 2/3 = 1/2; 9 1 2 3 always follow "1 2 3 4" here (1/2 each);
    # then 4 and 5 split 1/1: 1/4 < 0.4 stops the draft
    assert draft == [3, 4, 9, 1, 2, 3]
    assert score == pytest.approx(0.75 + 5 * 0.5)
    assert index.draft(text, 2, spec_factor=8.0, min_prob=0.6)[0] == [3]
    assert index.draft(text, 2, spec_factor=8.0, min_prob=0.8) == ([], 0.0)
    # counted over the 2 newest occurrences of "2" that go on: 8 and 3 split 1 / 1 (the lower
    # id wins), then the one occurrence of "2 3" goes on: 5 9 1 2 8 9 1 2, each at 1/2
    recent = SuffixIndex(max_depth=16, max_matches=2)
    recent.extend("", text)
    assert recent.draft(text, 2, spec_factor=8.0, min_prob=0.4) == ([3] + text[13:], 4.5)
    assert recent.draft(text, 2, spec_factor=8.0, min_prob=0.6) == ([], 0.0)


def _brute_draft(log, seqs, history, max_len, index, spec_factor, min_prob, min_run=0):
    """The draft by definition (module docstring of suffix_tree): scan every indexed position,
    newest first, for the longest key that fits; the longest match among the first
    `max_matches` hits (`min_run` > 0: extended across one substituted token by the longest
    run behind it of at least `min_run` tokens, `SuffixIndex.bridge`); then the majority
    continuation, step by step."""
    n = len(history)
    max_len = min(max_len, n, index.max_depth - 1)
    for length in [k for k in KEY_LENS if k <= max_len]:
        hits = [(seqs[cid], e) for cid, e in reversed(log)
                if e + 1 < len(seqs[cid]) and e >= length - 1
                and seqs[cid][e - length + 1 : e + 1] == history[n - length :]]  # fmt: skip
        hits = hits[: index.max_matches]
        if not hits:
            continue

        def matched(seq, e):
            p = 0
            while p < min(max_len, e + 1) and seq[e - p] == history[n - 1 - p]:
                p += 1
            return p

        def behind(seq, e, p):  # tokens equal behind the first mismatch, in the window
            q = 0
            while p + 2 + q <= max_len and e - p - 1 - q >= 0:
                if seq[e - p - 1 - q] != history[n - p - 2 - q]:
                    break
                q += 1
            return q

        p = max(matched(seq, e) for seq, e in hits)
        occ = [(seq, e) for seq, e in hits if matched(seq, e) == p]
        length = p
        if min_run:
            q = max(behind(seq, e, p) for seq, e in occ)
            if q >= min_run:
                length, occ = p + q, [(seq, e) for seq, e in occ if behind(seq, e, p) == q]
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < min(index.max_depth - p, math.ceil(spec_factor * length)):
            d = len(draft)
            nexts = Counter(seq[e + 1 + d] for seq, e in occ if e + 1 + d < len(seq))
            if not nexts:
                break
            token, count = min(nexts.items(), key=lambda item: (-item[1], item[0]))
            prob *= count / sum(nexts.values())
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            occ = [(seq, e) for seq, e in occ if e + 1 + d < len(seq) and seq[e + 1 + d] == token]
        return draft, score
    return [], 0.0


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    vocab=st.integers(1, 4),
    depth=st.integers(2, 24),
    max_matches=st.sampled_from([1, 2, 3, 1000]),
    spec_factor=st.sampled_from([0.5, 1.0, 3.0]),
    min_prob=st.sampled_from([0.1, 0.5, 1.0]),
    min_run=st.sampled_from([0, 1, 3]),
)
def test_drafts_equal_a_brute_force_matcher(
    seed, vocab, depth, max_matches, spec_factor, min_prob, min_run
) -> None:
    """Random sequences over a small vocabulary (many repeats, so keys of every length hit
    and the `max_matches` cap bites), extended in interleaved chunks; every draft (and score)
    equals the brute-force one, for histories taken from the sequences and random ones."""
    rng = random.Random(seed)
    index = SuffixIndex(depth, max_matches)
    seqs, log = {}, []
    for _ in range(rng.randrange(1, 12)):
        cid = str(rng.randrange(3))
        chunk = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
        seq = seqs.setdefault(cid, [])
        log += [(cid, len(seq) + i) for i in range(len(chunk))]
        seq += chunk
        index.extend(cid, chunk)
    for cid, seq in seqs.items():  # the keys rolled while linking equal those packed anew
        for max_len in (1, 5, 16):
            assert index.suffix(cid, max_len) == Suffix.of(seq, max_len, depth)
    histories = [seq[: rng.randrange(len(seq) + 1)] for seq in seqs.values()]
    histories += [[rng.randrange(vocab) for _ in range(rng.randrange(30))] for _ in range(3)]
    for history in histories:
        for max_len in (1, 5, 16):
            args = (spec_factor, min_prob)
            want = _brute_draft(log, seqs, history, max_len, index, *args, min_run)
            got = index.draft(history, max_len, *args, min_run=min_run)
            assert got[0] == want[0], (history, max_len)
            assert got[1] == pytest.approx(want[1])


def test_a_match_restarted_after_an_edit_drafts_as_before_it() -> None:
    """Copying a source with one token substituted: one token after the edit, the match across
    the substitution drafts the copy's continuation, as long as before the edit; a run behind
    the substitution shorter than `min_bridge_run` (chance, in prose) does not count."""
    source = list(range(100, 140))
    prompt = [1, 2] + source
    copied = source[:20] + [999] + source[21:22]  # edit at 20, then one copied token
    k = 12
    for min_bridge_run, want in ((0, []), (6, source[22 : 22 + k])):
        proposer = SuffixProposer(SuffixConfig(min_bridge_run=min_bridge_run))
        got = proposer.propose([DraftRequest("r", prompt + copied, len(prompt), k)])
        assert got == [want]
    # two tokens after the edit: 4 drafts without the bridge (2 x a 2-token match)
    proposer = SuffixProposer(SuffixConfig(min_bridge_run=0))
    history = prompt + copied + [source[22]]
    assert proposer.propose([DraftRequest("r", history, len(prompt), k)]) == [source[23:27]]
    # a run of 5 behind the substituted token: not counted at 6
    short = [7, 8, 9] + source[15:20] + [999] + source[21:22]
    proposer = SuffixProposer(SuffixConfig(min_bridge_run=6))
    assert proposer.propose([DraftRequest("s", prompt + short, len(prompt), k)]) == [[]]
    proposer = SuffixProposer(SuffixConfig(min_bridge_run=5))
    assert proposer.propose([DraftRequest("s", prompt + short, len(prompt), k)]) == [
        source[22 : 22 + k]
    ]
    # the same text repeated in the outputs (a template the model repeats): no bridge
    proposer = SuffixProposer(SuffixConfig(min_bridge_run=6))
    history = [1, 2] + source + copied
    assert proposer.propose([DraftRequest("o", history, 2, k)]) == [[]]


def test_a_paired_extend_equals_two_extends() -> None:
    """`extend_pair` (a request's own index and the shared one, linked in one pass) leaves
    both indexes as `extend` on each does: requests' histories growing in random chunks, the
    shared index holding their outputs (once 11 tokens in, the same last tokens as the own)."""
    rng = random.Random(0)
    for vocab in (3, 1000):
        paired = [SuffixIndex(20, 4) for _ in range(3)] + [SuffixIndex(20, 4)]
        plain = [SuffixIndex(20, 4) for _ in range(3)] + [SuffixIndex(20, 4)]
        for index in (*paired[:3], *plain[:3]):  # prompts, not shared
            index.extend("", [7, 8, 9] * 5)
        for _ in range(60):
            i = rng.randrange(3)
            chunk = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
            paired[i].extend_pair("", chunk, paired[3], str(i))
            plain[i].extend("", chunk)
            plain[3].extend(str(i), chunk)
        for a, b in zip(paired, plain):
            assert (a._prev, a._latest, a._roll, a.num_tokens) == (
                b._prev, b._latest, b._roll, b.num_tokens)  # fmt: skip


def test_removal_equals_a_rebuild_of_the_held_contributions() -> None:
    rng = random.Random(0)
    seqs: dict[str, list[int]] = {str(i): [] for i in range(5)}
    shared = SharedSuffixIndex(max_depth=20, max_matches=3, max_tokens=10**6)
    for _ in range(40):  # interleaved growth
        cid = str(rng.randrange(5))
        chunk = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
        seqs[cid] += chunk
        shared.extend(cid, chunk)
    first, second = shared.evict_oldest(), shared.evict_oldest()
    rebuilt = SuffixIndex(max_depth=20, max_matches=3)
    for cid in shared.contribution_ids():
        rebuilt.extend(cid, seqs[cid])
    assert first not in shared.contribution_ids() and second not in shared.contribution_ids()
    assert shared.index.num_tokens == rebuilt.num_tokens
    for _ in range(50):
        history = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
        assert shared.index.draft(history, 16, 2.0, 0.1) == rebuilt.draft(history, 16, 2.0, 0.1)
    shared.extend(first, [1, 2, 3])  # an evicted id adds nothing more
    assert first not in shared.contribution_ids()


def test_the_shared_index_stays_under_its_cap_evicting_oldest_first() -> None:
    cfg = SuffixConfig(max_depth=8, max_pattern_len=4, max_shared_tokens=100, spec_factor=4.0)
    proposer = SuffixProposer(cfg)
    rng = random.Random(1)
    outputs = [[rng.randrange(1000, 2000) for _ in range(30)] for _ in range(10)]
    for i, output in enumerate(outputs):
        _generate(proposer, f"r{i}", [i], output)
        proposer.finish(f"r{i}")
        assert proposer.shared.index.num_tokens <= cfg.max_shared_tokens
    kept = proposer.shared.contribution_ids()
    assert kept and kept[-1] == "r9" and "r0" not in kept

    def probe(output):
        rid = f"probe{outputs.index(output)}"
        return proposer.propose([DraftRequest(rid, [7] + output[:3], 1, 4)])[0]

    assert probe(outputs[9]) == outputs[9][3:7]  # the newest is remembered
    assert probe(outputs[0]) == []  # the oldest was evicted
    proposer.finish("probe0")


def test_bad_config_raises_naming_the_field() -> None:
    for field, value in [("max_depth", 1), ("max_pattern_len", 32), ("spec_factor", 0.0),
                         ("min_token_prob", 0.0), ("max_matches", 0),
                         ("max_shared_tokens", 0), ("min_match_len", 0)]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            SuffixConfig(**{field: value}).validate()
