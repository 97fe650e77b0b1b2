"""`ops.seeded_noise` on CUDA (the Triton kernel): its 23 bits of u equal the torch reference's
on random seeds and draw counters (128K vocabulary), its -log(u) is the reference's to an ulp,
rows it is not given stay untouched, one step's seeded rows cost one kernel (no per-row
`exponential_`), and the sampler's tokens on CUDA equal its tokens on the CPU."""

import pytest
import torch

from phloem.layers.sampler import Sampler, SamplingRow
from phloem.ops.seeded_noise import (
    SeedStream,
    exponentials_reference,
    row_keys,
    seeded_exponentials_,
    uniform_bits,
)
from phloem.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 128_256


def _streams(num: int, seed: int) -> list[SeedStream]:
    """`num` streams of random 64-bit seeds and counters, plus the range's ends."""
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**62, (num,), generator=gen).tolist()
    draws = torch.randint(0, 10_000, (num,), generator=gen).tolist()
    streams = [SeedStream(s * 4 + k % 4, d) for k, (s, d) in enumerate(zip(seeds, draws))]
    return streams + [SeedStream(0), SeedStream(2**64 - 1, 2**40), SeedStream(2**63, 1)]


@pytest.mark.parametrize("vocab", [1, 1000, VOCAB])
def test_kernel_bits_equal_the_reference(vocab):
    from phloem.ops.seeded_noise_triton import launch

    streams = _streams(37, vocab)
    keys = row_keys(streams)
    rows = torch.randperm(len(streams) + 5)[: len(streams)]
    out = torch.full((len(streams) + 5, vocab), -7, dtype=torch.int32, device="cuda")
    launch(out, keys.cuda(), rows.cuda(), write_bits=True)
    got = out.cpu()
    assert torch.equal(got[rows].long(), uniform_bits(keys, vocab))
    untouched = torch.ones(len(streams) + 5, dtype=torch.bool)
    untouched[rows] = False
    assert bool((got[untouched] == -7).all())


def test_noise_matches_the_reference_and_advances_the_streams():
    streams = _streams(64, 1)  # 64 random streams and the 3 at the range's ends
    end = 3 + len(streams)
    want = exponentials_reference(row_keys(streams), VOCAB)
    q = torch.full((end + 3, VOCAB), -1.0, device="cuda")
    seeded_exponentials_(q, list(range(3, end)), streams)
    got = q.cpu()
    torch.testing.assert_close(got[3:end], want, rtol=3e-7, atol=0.0)  # 2 ulps
    assert bool((got[:3] == -1).all()) and bool((got[end:] == -1).all())
    assert [s.draws for s in streams] == [s.draws + 1 for s in _streams(64, 1)]


def test_a_steps_seeded_rows_cost_one_kernel():
    """256 seeded rows' noise (`Sampler.draw_noise`): one seeded-noise kernel, no exponential_."""
    params = SamplingParams(temperature=0.7)
    rows = [SamplingRow(params, [], [], None, (), s) for s in _streams(253, 2)]
    sampler = Sampler(device="cuda")
    sampler.draw_noise(rows, VOCAB, "cuda")  # compiled before the profile
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        sampler.draw_noise(rows, VOCAB, "cuda")
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_seeded_noise_kernel" in n for n in names) == 1, names
    assert not any("exponential" in n for n in names), names


def test_sampling_on_cuda_equals_the_cpu():
    """64 seeded rows of random 128K logits, three steps: the tokens agree (a token may differ
    only where two candidates' ratios tie to an ulp of the log: at most one in the run)."""
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.7)  # (no top-p: its cut may move by an ulp too)
    cpu_streams, cuda_streams = _streams(61, 4), _streams(61, 4)
    mismatches = 0
    for _ in range(3):
        logits = torch.randn(len(cpu_streams), VOCAB, generator=gen) * 4
        cpu = Sampler()(logits, [SamplingRow(params, [], [], None, (), s) for s in cpu_streams])
        cuda = Sampler(device="cuda")(
            logits.cuda(), [SamplingRow(params, [], [], None, (), s) for s in cuda_streams]
        )
        mismatches += sum(a != b for a, b in zip(cpu.token_ids, cuda.token_ids))
    assert mismatches <= 1
    assert [s.draws for s in cuda_streams] == [s.draws for s in cpu_streams]
