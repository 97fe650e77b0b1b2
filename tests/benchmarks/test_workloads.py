"""Workload shapes: exact lengths, shared prefixes, seeding."""

import pytest

from phloem.bench.workloads import WORKLOADS, make_workload


def test_batchllm_groups_share_exact_prefixes_and_are_shuffled():
    w = make_workload("batchllm", 5000, num_groups=4, degree=3, prefix_len=20, suffix_len=5)
    assert w.num_requests == 12 and all(len(p) == 25 for p in w.prompts)
    assert set(w.output_lens) == {100}
    assert sorted(i for _, m in w.groups for i in m) == list(range(12))
    for p, members in w.groups:
        assert p == 20 and len({tuple(w.prompts[i][:20]) for i in members}) == 1
    assert [m for _, m in w.groups] != [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


@pytest.mark.parametrize(
    "name,shape",
    [
        ("decode-heavy", (1000, 1000, 1000)),
        ("prefill-heavy", (1000, 2048, 128)),
        ("latency", (1, 128, 256)),
    ],
)
def test_default_shapes(name, shape):
    w = make_workload(name, 50_000)
    n, i, o = shape
    assert w.num_requests == n and {len(p) for p in w.prompts} == {i} and set(w.output_lens) == {o}
    assert w.sequential == (name == "latency")


def test_shared_prefix_defaults_and_scaling():
    w = make_workload("shared-prefix", 50_000)
    assert w.num_requests == 64 * 16 and {len(p) for p in w.prompts} == {2048 + 128}
    assert make_workload("shared-prefix", 50_000, num_groups=2).num_requests == 32


def test_seeded_and_in_vocab():
    for name in WORKLOADS:
        a = make_workload(name, 3000, seed=1, num_requests=3, num_groups=2, input_len=50)
        b = make_workload(name, 3000, seed=1, num_requests=3, num_groups=2, input_len=50)
        assert a.prompts == b.prompts and a.output_lens == b.output_lens
        assert all(1000 <= t < 3000 for p in a.prompts for t in p)


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope", 5000)


def test_random_has_sharegpt_like_long_tailed_lengths():
    import statistics

    w = make_workload("random", 50_000, seed=3, num_requests=4000)
    ins, outs = [len(p) for p in w.prompts], w.output_lens
    assert 130 <= statistics.median(ins) <= 170 and 210 <= statistics.mean(ins) <= 270
    assert 112 <= statistics.median(outs) <= 144 and 165 <= statistics.mean(outs) <= 215
    assert min(ins) >= 4 and max(ins) <= 4096 and max(ins) > 1500  # a long tail, clipped
    assert min(outs) >= 4 and max(outs) <= 1024
    assert {len(g[1]) for g in w.groups} == {1}  # nothing shared
    doubled = make_workload("random", 50_000, seed=3, num_requests=4000, input_len=300)
    assert 260 <= statistics.median(len(p) for p in doubled.prompts) <= 340
