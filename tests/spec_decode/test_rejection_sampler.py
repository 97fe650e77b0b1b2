"""Exactness of `rejection_sample`: emitted tokens follow the target distribution (chi-square on
200k batched samples), and the same check fails a deliberately wrong residual; greedy rows,
ragged rows, seeded reproducibility, no NaN on degenerate inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from phloem.spec_decode.rejection_sampler import PAD_TOKEN_ID, rejection_sample

VOCAB = 6
NUM_SAMPLES = 200_000
# chi-square critical value at p = 1e-6: a correct sampler fails about once in a million runs
ALPHA = 1e-6


def _markov_chain(seed: int, vocab: int, concentration: float):
    """A target P (p0 [V], P [V, V] rows p(next | prev)) and a draft Q of the same shape; Q has
    zeros, so the residual and one-hot edge cases both occur."""
    gen = torch.Generator().manual_seed(seed)

    def dirichlet(*shape):
        g = torch.distributions.Gamma(concentration, 1.0).sample(shape)  # uses global RNG
        return g / g.sum(-1, keepdim=True)

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    p0, p = dirichlet(vocab), dirichlet(vocab, vocab)
    q0, q = dirichlet(vocab), dirichlet(vocab, vocab)
    q0[0] = 0.0
    q[:, 1] = 0.0
    return p0, p, q0 / q0.sum(), q / q.sum(-1, keepdim=True)


def _speculate_batch(p0, p, q0, q, k: int, n: int, seed: int, one_hot: bool):
    """n rows of one speculative step on the chain: drafts x_j ~ q(. | x_{j-1}), target probs
    at each scored position conditioned on the drafts. Returns target [n, k+1, V], drafts
    [n, k], draft probs [n, k, V] (or None for one-hot drafts drawn from q)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.empty(n, k + 1, VOCAB)
    draft_probs = torch.empty(n, k, VOCAB)
    drafts = torch.empty(n, k, dtype=torch.long)
    target[:, 0], draft_probs[:, 0] = p0, q0
    for j in range(k):
        drafts[:, j] = torch.multinomial(draft_probs[:, j], 1, generator=gen).squeeze(1)
        target[:, j + 1] = p[drafts[:, j]]
        if j + 1 < k:
            draft_probs[:, j + 1] = q[drafts[:, j]]
    return target, drafts, (None if one_hot else draft_probs)


def _pair_counts(tokens: torch.Tensor, p: torch.Tensor, seed: int) -> np.ndarray:
    """Counts [V, V] of (first, second) emitted token; a row that emitted one token continues
    with the target's own next-token draw (what the next step's first token is, tested above)."""
    gen = torch.Generator().manual_seed(seed + 1)
    first = tokens[:, 0]
    second = tokens[:, 1].clone()
    short = second == PAD_TOKEN_ID
    second[short] = torch.multinomial(p[first[short]], 1, generator=gen).squeeze(1)
    flat = (first * VOCAB + second).numpy()
    return np.bincount(flat, minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB)


def _chi_square_ok(counts: np.ndarray, expected_probs: np.ndarray) -> bool:
    counts, probs = counts.ravel(), expected_probs.ravel()
    keep = probs > 0
    if counts[~keep].sum() > 0:
        return False  # a token the target never emits
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return stat < chi2.ppf(1 - ALPHA, df=int(keep.sum()) - 1)


def _wrong_rejection_sample(target, drafts, draft_probs, seed):
    """A broken verifier written here on purpose: after a rejection it resamples from p instead
    of norm(max(0, p - q)) (the classic bug). The same check must reject it."""
    gen = torch.Generator().manual_seed(seed)
    n, k = drafts.shape
    p_draft = target[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    accept = torch.rand(n, k, generator=gen) * q_draft < p_draft
    num_accepted = accept.long().cumprod(-1).sum(-1)
    final_dist = target[torch.arange(n), num_accepted]  # wrong: p, not the residual
    final = torch.multinomial(final_dist, 1, generator=gen).squeeze(1)
    out = torch.full((n, k + 1), PAD_TOKEN_ID, dtype=torch.long)
    for j in range(k):
        out[:, j] = torch.where(j < num_accepted, drafts[:, j], out[:, j])
    out.scatter_(1, num_accepted[:, None], final[:, None])
    return out


@pytest.mark.parametrize(
    ("k", "one_hot", "seed", "bad_draft"),
    [(2, False, 0, False), (3, False, 1, False), (3, True, 2, False), (3, False, 4, True)],
)
def test_emitted_tokens_follow_the_target(k: int, one_hot: bool, seed: int, bad_draft) -> None:
    p0, p, q0, q = _markov_chain(seed, VOCAB, concentration=0.7)
    if bad_draft:  # a deliberately bad draft: always the target's least likely token
        q0 = torch.nn.functional.one_hot(p0.argmin(), VOCAB).float()
        q = torch.nn.functional.one_hot(p.argmin(-1), VOCAB).float()
    target, drafts, draft_probs = _speculate_batch(p0, p, q0, q, k, NUM_SAMPLES, seed, one_hot)
    out = rejection_sample(
        target, drafts, [k] * NUM_SAMPLES, draft_probs=draft_probs,
        fallback_generator=torch.Generator().manual_seed(seed + 7),
    )  # fmt: skip
    tokens = out.token_ids
    assert torch.equal(tokens.ne(PAD_TOKEN_ID).sum(-1), out.num_accepted + 1)
    first = np.bincount(tokens[:, 0].numpy(), minlength=VOCAB)
    assert _chi_square_ok(first, p0.double().numpy())
    pair_probs = (p0[:, None].double() * p.double()).numpy()
    assert _chi_square_ok(_pair_counts(tokens, p, seed), pair_probs)
    # acceptance is not trivial: some drafts are accepted, some rejected
    assert 0 < out.num_accepted.float().mean() < k


def test_the_same_check_fails_a_wrong_residual() -> None:
    seed, k = 3, 3
    p0, p, q0, q = _markov_chain(seed, VOCAB, concentration=0.7)
    target, drafts, draft_probs = _speculate_batch(p0, p, q0, q, k, NUM_SAMPLES, seed, False)
    wrong = _wrong_rejection_sample(target, drafts, draft_probs, seed)
    first = np.bincount(wrong[:, 0].numpy(), minlength=VOCAB)
    assert not _chi_square_ok(first, p0.double().numpy())
    pair_probs = (p0[:, None].double() * p.double()).numpy()
    assert not _chi_square_ok(_pair_counts(wrong, p, seed), pair_probs)


def test_greedy_rows_accept_while_drafts_equal_the_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 10)  # greedy rows may pass logits: only argmax is read
    argmax = logits.argmax(-1)
    drafts = argmax[:, :3].clone()
    drafts[1, 1] = (argmax[1, 1] + 1) % 10  # row 1: second draft wrong
    drafts[2, 0] = (argmax[2, 0] + 1) % 10  # row 2: first draft wrong
    out = rejection_sample(logits, drafts, [3, 3, 3], is_greedy=[True] * 3)
    assert out.num_accepted.tolist() == [3, 1, 0]
    assert out.token_ids[0].tolist() == argmax[0].tolist()  # all accepted + bonus argmax
    assert out.token_ids[1].tolist() == [argmax[1, 0], argmax[1, 1], -1, -1]
    assert out.token_ids[2].tolist() == [argmax[2, 0], -1, -1, -1]


def test_ragged_rows_and_mixed_greedy() -> None:
    probs = torch.full((3, 4, 5), 0.0)
    probs[..., 2] = 1.0  # the target always emits 2
    drafts = torch.tensor([[2, 2, -1], [2, -1, -1], [-1, -1, -1]])
    greedy = [False, True, False]
    out = rejection_sample(probs, drafts, [2, 1, 0], is_greedy=greedy)
    assert out.num_accepted.tolist() == [2, 1, 0]
    assert out.token_ids.tolist() == [[2, 2, 2, -1], [2, 2, -1, -1], [2, -1, -1, -1]]


def test_padding_positions_are_never_accepted() -> None:
    probs = torch.full((1, 3, 4), 0.25)
    out = rejection_sample(probs, torch.tensor([[1, 1]]), [0])
    assert out.num_accepted.tolist() == [0]
    assert out.token_ids[0, 1:].tolist() == [-1, -1]


def _seeded_run(seed: int, batch_neighbours: int) -> torch.Tensor:
    torch.manual_seed(123)
    row_probs, row_drafts = torch.softmax(torch.randn(1, 4, 50), -1), torch.randint(0, 50, (1, 3))
    probs = torch.cat([row_probs, torch.softmax(torch.randn(batch_neighbours, 4, 50), -1)])
    drafts = torch.cat([row_drafts, torch.randint(0, 50, (batch_neighbours, 3))])
    gens = [torch.Generator().manual_seed(seed)] + [None] * batch_neighbours
    out = rejection_sample(probs, drafts, [3] + [2] * batch_neighbours, generators=gens)
    return out.token_ids[0]


def test_a_seeded_row_is_reproducible_and_independent_of_its_batch() -> None:
    runs = [_seeded_run(seed, 0) for seed in range(20)]
    assert all(torch.equal(r, _seeded_run(s, 5)) for s, r in enumerate(runs))
    assert len({tuple(r.tolist()) for r in runs}) > 1  # the seed matters


def test_no_nan_when_p_equals_q_or_q_has_zeros() -> None:
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]]]).repeat(64, 1, 1)
    drafts = torch.tensor([[0, 2]]).repeat(64, 1)
    same = rejection_sample(p, drafts, [2] * 64, draft_probs=p[:, :2].clone())
    assert same.num_accepted.tolist() == [2] * 64  # p == q: always accepted
    q = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]).repeat(64, 1, 1)
    out = rejection_sample(p, drafts, [2] * 64, draft_probs=q)
    assert (out.token_ids[:, 0] != 2).all()  # p0(2) = 0 is never emitted
    assert not torch.isnan(out.token_ids.float()).any()
    assert (out.token_ids >= -1).all() and (out.token_ids < 3).all()


def test_bad_shapes_raise_naming_the_argument() -> None:
    probs = torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(probs, torch.zeros(2, 3, dtype=torch.long), [2, 2])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(probs, torch.zeros(2, 2, dtype=torch.long), [3, 2])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(probs, torch.zeros(2, 2, dtype=torch.long), [2, 2], draft_probs=probs)
