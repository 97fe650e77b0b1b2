"""`verify_drafts`, the verify step's sampling: its emitted tokens follow the sampler's processed
distribution (temperature 1, top-k, top-p, min-p) at each position, for a good and for a
deliberately bad draft (chi-square, fixed seeds, seeded and unseeded rows); a row without
drafts draws exactly the sampler's token; greedy rows accept while the draft is the argmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from phloem.layers.sampler import Sampler, SamplingRow, processed_probs, seeded_generator
from phloem.sampling_params import SamplingParams
from phloem.spec_decode.verifier import verify_drafts

VOCAB = 8
NUM_ROWS = 40_000
ALPHA = 1e-6  # a correct verifier fails about once in a million runs


def _logits(seed: int) -> torch.Tensor:
    """Two scored positions' logits [2, V] (position 0 after the last token, 1 after d_1)."""
    return torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    """P-value of `counts` under `probs` (cells with probability 0 must be empty)."""
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, keep.sum() - 1))


def _run(params: SamplingParams, draft: int, seed: int):
    """NUM_ROWS verify rows of one draft each, the same logits; returns (first emitted, second
    emitted or -1, accepted counts) and the processed distributions [2, V]."""
    base = _logits(seed)
    logits = base.repeat(NUM_ROWS, 1)  # rows packed: position 0, position 1 of each row
    rows = [
        SamplingRow(params, [1], [], seeded_generator(i, "cpu") if i % 20 == 0 else None)
        for i in range(NUM_ROWS)
    ]
    verified = verify_drafts(logits, rows, [(draft,)] * NUM_ROWS, torch.Generator().manual_seed(7))
    final = verified.result().token_ids
    accepted = verified.num_accepted
    first = [draft if a else t for t, a in zip(final, accepted)]
    second = [t if a else -1 for t, a in zip(final, accepted)]
    return np.array(first), np.array(second), processed_probs(base, [params] * 2).numpy()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
        SamplingParams(temperature=0.8, min_p=0.05),
    ],
    ids=["plain", "top_k_top_p", "min_p"],
)
@pytest.mark.parametrize("which", ["likely", "unlikely"])
def test_emitted_tokens_follow_the_target(params, which):
    probs0 = processed_probs(_logits(3)[:1], [params]).numpy()[0]
    support = np.flatnonzero(probs0)
    draft = int(probs0.argmax()) if which == "likely" else int(support[probs0[support].argmin()])
    first, second, probs = _run(params, draft, seed=3)
    assert _chi_square(np.bincount(first, minlength=VOCAB), probs[0]) > ALPHA
    if which == "likely":  # (an unlikely draft is accepted too rarely to test what follows)
        after = second[first == draft]  # the draft was accepted: the bonus token follows p_1
        assert len(after) > 1000
        assert _chi_square(np.bincount(after, minlength=VOCAB), probs[1]) > ALPHA


def test_a_biased_verifier_fails_the_same_check():
    """The check has power: counts drawn from a 5%-shifted distribution fail it."""
    params = SamplingParams(temperature=1.0)
    probs = processed_probs(_logits(3)[:1], [params]).numpy()[0]
    biased = probs.copy()
    biased[biased.argmax()] += 0.05
    biased /= biased.sum()
    draws = np.random.default_rng(0).choice(VOCAB, size=NUM_ROWS, p=biased)
    assert _chi_square(np.bincount(draws, minlength=VOCAB), probs) < ALPHA


def test_a_row_without_drafts_draws_the_samplers_token():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_p=0.8)
    for seed in range(5):
        rows = [SamplingRow(params, [1], [], seeded_generator(seed, "cpu")) for _ in range(1)]
        want = Sampler()(logits[:1], rows).token_ids
        rows = [SamplingRow(params, [1], [], seeded_generator(seed, "cpu"))]
        got = verify_drafts(logits[:1], rows, [()], None).result().token_ids
        assert got == want


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(2))
    argmax = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, [1], [], None), SamplingRow(greedy, [1], [], None)]
    # row 0: 3 drafts at positions 0..3, the first two right; row 1: 2 drafts at 4..6, all right
    drafts = [(argmax[0], argmax[1], (argmax[2] + 1) % VOCAB), (argmax[4], argmax[5])]
    verified = verify_drafts(logits, rows, drafts, None)
    assert verified.result().token_ids == [argmax[2], argmax[6]]
    assert verified.num_accepted == [2, 2]


def test_a_failed_guess_comes_back_unverified_and_is_counted_apart():
    """A row whose guess of its pending token failed (`valid` False) verifies nothing: its flag
    rides back with the tokens (`VerifyStep.verified`), and the engine's counts list it apart
    from the verify rows (`stacked_rows.verify_counts`); a void row is in neither."""
    from phloem.spec_decode.verifier import launch_verify
    from phloem.worker.stacked_rows import verify_counts

    logits = torch.randn(9, VOCAB, generator=torch.Generator().manual_seed(3))
    argmax = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, [1], [], None) for _ in range(4)]
    # rows: 0 guess held (2 right drafts), 1 guess failed (2 right drafts), 2 plain, 3 void
    drafts = [(argmax[0], argmax[1]), (argmax[3], argmax[4]), (), (argmax[7],)]
    valid = torch.tensor([True, False, True, True])

    def sample_plain(plain_logits, plain):
        return Sampler().launch(plain_logits, [rows[b] for b in plain], None)

    step = launch_verify(logits, rows, drafts, None, sample_plain, valid)
    tokens = step.result().token_ids
    assert step.num_accepted == [2, 0, 0, 1] and step.verified == [True, False, False, True]
    assert tokens[1] == argmax[3]  # the target's token at its first position
    seq_ids = ["a", "g", "p", "v"]
    accepted, missed = verify_counts(seq_ids, drafts, step.num_accepted, step.verified,
                                     ["a", "g", "p"])  # fmt: skip
    assert accepted == {"a": 2} and missed == ["g"]


@pytest.mark.parametrize("seed", range(6))
def test_all_greedy_rows_match_the_rejection_samplers_greedy_path(seed):
    """An all-greedy verify step takes a path that reads only argmaxes (`_verify_greedy`); it
    emits what the general path (`rejection_sample` over the float32 logits, greedy rows) does:
    tokens, accepted counts, `full`, non-finite flags, with ties (bf16 logits on a coarse grid),
    a NaN position, rows of 0..4 drafts, drafts right or wrong, and `valid` masks."""
    from phloem.layers.sampler import non_finite
    from phloem.spec_decode.rejection_sampler import PAD_TOKEN_ID, rejection_sample

    rng = np.random.default_rng(seed)
    counts = [int(c) for c in rng.integers(0, 5, size=9)]
    n = sum(counts) + len(counts)
    logits = torch.tensor(rng.integers(-3, 4, size=(n, VOCAB)), dtype=torch.bfloat16)
    logits[int(rng.integers(n)), 2] = float("nan")
    argmax = logits.float().masked_fill(logits.float().isnan().any(-1, keepdim=True), 0)
    argmax = argmax.argmax(-1).tolist()
    starts = np.cumsum([0] + [1 + c for c in counts])
    drafts = [
        tuple(argmax[starts[b] + j] if rng.random() < 0.7 else int(rng.integers(VOCAB))
              for j in range(c))
        for b, c in enumerate(counts)
    ]  # fmt: skip
    valid = torch.tensor(rng.random(len(counts)) < 0.8)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in counts]
    got = verify_drafts(logits, rows, drafts, None, valid)
    out = got.result()

    flags = non_finite(logits.amax(dim=-1))
    x = logits.float().masked_fill((flags != 0)[:, None], 0.0)
    width = max(counts)
    gather = torch.tensor([[starts[b] + min(j, c) for j in range(width + 1)]
                           for b, c in enumerate(counts)])  # fmt: skip
    padded = torch.tensor([list(d) + [PAD_TOKEN_ID] * (width - len(d)) for d in drafts])
    want = rejection_sample(x[gather], padded.view(len(counts), width), counts,
                            is_greedy=[True] * len(counts), valid=valid)  # fmt: skip
    want_final = want.token_ids.gather(1, want.num_accepted[:, None]).squeeze(1)
    assert out.token_ids == want_final.tolist()
    assert got.num_accepted == want.num_accepted.tolist()
    assert got.full.tolist() == (want.num_accepted == torch.tensor(counts)).tolist()
    assert out.num_nonfinite == flags[gather].amax(dim=1).tolist()
    # the same step through `launch_verify`, rows without drafts to the sampler: the drafted
    # rows' argmaxes are read in place there (no copy of their logits), same answers
    from phloem.spec_decode.verifier import launch_verify

    def sample_plain(plain_logits, plain):
        return Sampler().launch(plain_logits, [rows[b] for b in plain], None)

    step = launch_verify(logits, rows, drafts, None, sample_plain, valid)
    tokens = step.result().token_ids
    drafted = [b for b, c in enumerate(counts) if c]
    assert [tokens[b] for b in drafted] == [out.token_ids[b] for b in drafted]
    assert [step.num_accepted[b] for b in drafted] == [got.num_accepted[b] for b in drafted]
    assert [step.verified[b] for b in drafted] == [bool(valid[b]) for b in drafted]


def test_staged_rows_match_the_per_draft_loop():
    """`_stage_rows` (numpy) against the per-draft Python loop it replaced, on rows of 0 to 5
    drafts in random order."""
    import itertools

    from phloem.spec_decode.rejection_sampler import PAD_TOKEN_ID
    from phloem.spec_decode.verifier import _stage_rows

    rng = np.random.default_rng(0)
    for num_rows in (1, 2, 7):
        drafts = [tuple(rng.integers(0, 50, rng.integers(0, 6)).tolist()) for _ in range(num_rows)]
        counts = [len(d) for d in drafts]
        starts = [0, *itertools.accumulate(1 + k for k in counts)]
        width = max(counts)
        want = [
            [starts[b] + min(j, k) for j in range(width + 1)] + list(d)
            + [PAD_TOKEN_ID] * (width - k) + [k]
            for b, (d, k) in enumerate(zip(drafts, counts))
        ]  # fmt: skip
        got = torch.cat([t.reshape(num_rows, -1) for t in _stage_rows(
            drafts, counts, starts, torch.device("cpu"))], dim=1)  # fmt: skip
        assert got.tolist() == want
