"""Tests for `apply_top_k_top_p` (phloem.layers.logits_processors) and `Truncation.probs`:
the kept sets equal a float64 full-sort reference on every path, and no path reads the device
(the host chooses it from host values, so async scheduling never waits on the sampler)."""

from __future__ import annotations

import pytest
import torch

from phloem.layers import logits_processors
from phloem.layers.logits_processors import Truncation, apply_top_k_top_p
from phloem.sampling_params import SamplingParams

torch.set_num_threads(1)

VOCAB = 3000  # > _TOP_P_CANDIDATES: the candidates, the search and the full sort all run


def reference_keep(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The docstring's definition in float64 with one full sort: [B, V] bool, kept."""
    x = logits.double()
    s = x.sort(dim=-1, descending=True).values
    in_top_k = torch.arange(x.shape[1])[None, :] < torch.tensor(top_k)[:, None]
    probs = s.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
    p = torch.tensor(top_p, dtype=torch.float64)[:, None]
    keep = in_top_k & ((probs.cumsum(dim=-1) - probs < p) | (p >= 1.0))
    return x >= s.gather(1, (keep.sum(dim=-1).clamp_min(1) - 1)[:, None])


def random_case(gen: torch.Generator, trial: int) -> tuple[torch.Tensor, list[int], list[float]]:
    """8 rows: flat and peaked, some with ties, mixed top-k / top-p / both, extreme values."""
    rows = 8
    scale = torch.where(torch.rand(rows, 1, generator=gen) < 0.5, 0.5, 7.0)  # flat / peaked
    logits = torch.randn(rows, VOCAB, generator=gen) * scale
    logits[::3] = (logits[::3] * 2).round() / 2  # many ties, at either boundary
    top_p = (torch.rand(rows, generator=gen) * 0.999 + 0.001).tolist()
    top_k = [VOCAB] * rows  # pure top-p
    if trial % 3 >= 1:  # mixed: top-k rows, top-k + top-p rows
        top_k[1], top_k[2], top_k[5] = 1, int(torch.randint(2, 1025, (1,), generator=gen)), 40
        top_p[1], top_p[5] = 1.0, 1.0
    if trial % 3 == 2:  # a k between the candidates and V: the full sort
        top_k[4] = 2000
    top_p[3], top_p[6] = 1e-6, 1.0  # tiny: the top token (and its ties) only; 1: all
    return logits, top_k, top_p


def kept(logits, top_k, top_p, host_reads) -> torch.Tensor:
    k, p = torch.tensor(top_k), torch.tensor(top_p)
    return apply_top_k_top_p(logits, k, p, top_k, top_p, host_reads).isfinite()


def test_kept_sets_equal_the_float64_full_sort():
    gen = torch.Generator().manual_seed(2026)
    for trial in range(12):
        logits, top_k, top_p = random_case(gen, trial)
        want = reference_keep(logits, top_k, top_p)
        for host_reads in (False, True):
            assert torch.equal(kept(logits, top_k, top_p, host_reads), want), (trial, host_reads)


def test_flat_rows_take_the_search_and_match_the_reference_exactly():
    """Rows whose top 1,024 tokens hold < top_p (random-weight-like) are cut by the bisection;
    uniform rows (one tie group) keep everything."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, VOCAB, generator=gen) * 0.3
    logits[5] = 1.25
    top_p = [0.5, 0.8, 0.9, 0.95, 0.99, 0.9]
    cand = logits.topk(1024, dim=-1).values
    mass = (cand - logits.logsumexp(dim=-1, keepdim=True)).exp().sum(dim=-1)
    assert bool((mass < torch.tensor(top_p)).all())  # every row needs the search
    got = kept(logits, [VOCAB] * 6, top_p, False)
    assert torch.equal(got, reference_keep(logits, [VOCAB] * 6, top_p))
    assert bool(got[5].all())


def test_bisection_key_order_round_trips():
    values = torch.tensor([float("-inf"), -3.5, -1e-38, -0.0, 0.0, 1e-45, 2.0, float("inf")])
    keys = logits_processors._float_key(values)
    assert bool((keys[1:] > keys[:-1]).all())
    assert torch.equal(logits_processors._key_float(keys), values)


@pytest.fixture
def no_device_reads(monkeypatch):
    """Every way a tensor's values reach the host raises while the fixture is active."""

    def read(*args, **kwargs):
        raise RuntimeError("device-to-host read")

    for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, read)


def test_truncation_reads_nothing_from_the_device(no_device_reads):
    """The device path (host_reads False, as on a GPU) over pure top-p, top-k and mixed rows,
    flat and peaked; the CPU's shortcut read is what the guard catches."""
    gen = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=50),
        SamplingParams(top_k=5, top_p=0.5),
        SamplingParams(),
        SamplingParams(top_p=0.95, min_p=0.05),
    ]
    truncation = Truncation.build(params, VOCAB, torch.float32, "cpu")
    truncation.host_reads = False
    x = torch.randn(5, VOCAB, generator=gen) * torch.tensor([[0.5], [6.0], [0.5], [1.0], [0.5]])
    assert truncation.probs(x.clone()).shape == (5, VOCAB)
    pure = Truncation.build([SamplingParams(top_p=0.9)] * 2, VOCAB, torch.float32, "cpu")
    pure.host_reads = False
    assert pure.probs(x[:2].clone()).shape == (2, VOCAB)
    k, p = truncation.top_k, truncation.top_p
    with pytest.raises(RuntimeError, match="device-to-host"):
        apply_top_k_top_p(x[:3], k[:3], p[:3])  # no host lists: read from the tensors
    with pytest.raises(RuntimeError, match="device-to-host"):
        apply_top_k_top_p(x[:3], k[:3], p[:3], [VOCAB, 50, 5], [0.9, 1.0, 0.5], None)
