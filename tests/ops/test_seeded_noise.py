"""`phloem.ops.seeded_noise` (the torch reference, CPU): a row's noise is a pure function of
(seed, draw counter, token id), whatever the batch; the draws are Exp(1) (moments, uniform bits
by chi-square); rows of nearby seeds and of successive draws are uncorrelated; and sampling
through them follows the target distribution (chi-square with a fixed seed, a check that a 5%
bias fails). All fixed seeds: deterministic. The Triton kernel's bits are checked against this
reference in tests/gpu/test_seeded_noise_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from phloem.layers.sampler import Sampler, SamplingRow, processed_probs
from phloem.ops.seeded_noise import (
    NUM_BITS,
    SeedStream,
    exponentials_reference,
    row_keys,
    seeded_exponentials_,
    uniform_bits,
)
from phloem.sampling_params import SamplingParams

ALPHA = 1e-6  # a correct stream fails a check about once in a million seeds


def _p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of `counts` under `probs` (all positive)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(probs) - 1))


def test_a_row_is_a_function_of_seed_counter_and_index_only():
    streams = [SeedStream(2**64 - 1, 3), SeedStream(0), SeedStream(7, 2), SeedStream(2**63)]
    q = torch.full((6, 300), -1.0)
    seeded_exponentials_(q, [5, 0, 3, 1], streams)
    assert [s.draws for s in streams] == [4, 1, 3, 1]  # each advanced by one draw
    assert torch.equal(q[[2, 4]], torch.full((2, 300), -1.0))  # rows not named: untouched
    for row, (seed, draws) in zip([5, 0, 3, 1], [(2**64 - 1, 3), (0, 0), (7, 2), (2**63, 0)]):
        alone = torch.empty(1, 300)
        seeded_exponentials_(alone, [0], [SeedStream(seed, draws)])
        assert torch.equal(q[row], alone[0])
    # a longer vocabulary extends the row: entry v does not depend on V
    longer = exponentials_reference(row_keys([SeedStream(2**64 - 1, 3)]), 500)
    assert torch.equal(longer[0, :300], q[5])
    # seeds are taken modulo 2^64, as `SamplingParams.generator_seed` gives them
    assert torch.equal(row_keys([SeedStream(-1)]), row_keys([SeedStream(2**64 - 1)]))


def test_draws_are_exp1_and_their_bits_uniform():
    streams = [SeedStream(seed, draws) for seed in range(16) for draws in range(4)]
    keys = row_keys(streams)
    q = exponentials_reference(keys, 4096).double()  # 262,144 draws
    n = q.numel()
    assert abs(q.mean().item() - 1.0) < 5 / n**0.5  # Exp(1): mean 1, sd 1
    assert abs(q.var().item() - 1.0) < 5 * 8**0.5 / n**0.5  # var of (q - 1)^2 is 8
    assert q.min().item() > 0 and q.max().item() < 17
    bits = uniform_bits(keys, 4096)
    assert bits.min().item() >= 0 and bits.max().item() < 2**NUM_BITS
    counts = torch.bincount((bits >> (NUM_BITS - 6)).flatten(), minlength=64).numpy()
    assert _p_value(counts, np.full(64, 1 / 64)) > ALPHA


def test_nearby_seeds_and_successive_draws_are_uncorrelated():
    vocab = 20_000
    for a, b in [((0, 0), (1, 0)), ((5, 0), (5, 1)), ((5, 1), (6, 0)), ((2**64 - 1, 0), (0, 0))]:
        q = exponentials_reference(row_keys([SeedStream(*a), SeedStream(*b)]), vocab)
        corr = torch.corrcoef(q)[0, 1].item()
        assert abs(corr) < 5 / vocab**0.5, (a, b, corr)
    # neighbouring token ids of one row: lag-1 correlation
    q = exponentials_reference(row_keys([SeedStream(3)]), vocab)[0]
    assert abs(torch.corrcoef(torch.stack((q[:-1], q[1:])))[0, 1].item()) < 5 / vocab**0.5


@pytest.mark.parametrize("over", ["seeds", "draws"])
def test_sampling_through_streams_follows_the_target(over):
    """20,000 draws of one 8-token distribution: one row per seed (first draw), or one seed's
    20,000 successive draws; chi-square against the target, and against a 5%-shifted target
    (which the same counts must fail: the check has power)."""
    num, vocab = 20_000, 8
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]])
    params = SamplingParams(temperature=0.7)
    probs = processed_probs(logits, [params])[0].double().numpy()
    if over == "seeds":
        streams = [SeedStream(seed) for seed in range(num)]
    else:
        streams = [SeedStream(12345, draws) for draws in range(num)]
    rows = [SamplingRow(params, [], [], None, (), s) for s in streams]
    tokens = Sampler(seed=0)(logits.expand(num, vocab), rows).token_ids
    counts = np.bincount(tokens, minlength=vocab)
    assert _p_value(counts, probs) > ALPHA
    biased = probs.copy()
    biased[int(probs.argmax())] += 0.05
    assert _p_value(counts, biased / biased.sum()) < ALPHA
