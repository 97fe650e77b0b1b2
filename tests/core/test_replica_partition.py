"""Prefix groups dealt to data-parallel replicas (LPT, and McNaughton's wrap-around when a group
outweighs the mean load) and the scaling model built on it: every group lands once, LPT stays
within Graham's bound of the optimum, groups are split only when one outweighs the mean load
(then every replica gets work and the extra prefix tokens are counted), costs follow the
roofline, and prefix-aware routing keeps one replica's reuse at any scale while contiguous
slicing and random routing lose it."""

from __future__ import annotations

import itertools
import random

import pytest

from phloem.bench.plan_scaling import STRATEGIES, scaling_point, scaling_table
from phloem.bench.roofline import ModelShape, batch_work
from phloem.bench.workloads import make_workload
from phloem.core.prefix_planner import plan_prefix_groups
from phloem.core.replica_partition import (
    assign_groups,
    cost_terms_s,
    group_costs_s,
    partition_groups,
)

SHAPE = ModelShape(hidden=256, layers=4, q_heads=8, kv_heads=2, head_dim=32, mlp=512, vocab=2000)
F, B = 1e14, 1e12


def _random_costs(rng: random.Random, n: int) -> list[float]:
    return [rng.choice([0.0, rng.random(), 10 * rng.random()]) for _ in range(n)]


def _optimal_makespan(costs: list[float], m: int) -> float:
    """The best makespan over every assignment (brute force, small instances only)."""
    return min(
        max(sum(c for c, r in zip(costs, owners) if r == k) for k in range(m))
        for owners in itertools.product(range(m), repeat=len(costs))
    )


@pytest.mark.parametrize("seed", range(30))
def test_lpt_assigns_every_group_once_within_grahams_bound(seed) -> None:
    rng = random.Random(seed)
    costs = _random_costs(rng, rng.randrange(0, 9))
    m = rng.randrange(1, 4)
    a = assign_groups(costs, m)
    assert a.num_replicas == m
    flat = sorted(g for groups in a.replica_groups for g in groups)
    assert flat == list(range(len(costs)))
    for groups in a.replica_groups:
        assert groups == sorted(groups)  # plan order kept within a replica
    for r, groups in enumerate(a.replica_groups):
        assert a.planned_cost_s[r] == pytest.approx(sum(costs[g] for g in groups))
    best = _optimal_makespan(costs, m) if costs else 0.0
    assert max(a.planned_cost_s) <= (4 / 3 - 1 / (3 * m)) * best + 1e-9
    assert assign_groups(costs, m) == a  # deterministic


def test_lpt_balances_equal_groups_exactly_and_rejects_bad_input() -> None:
    a = assign_groups([1.0] * 16, 8)
    assert a.imbalance == 1.0 and all(len(g) == 2 for g in a.replica_groups)
    assert assign_groups([], 3).imbalance == 1.0
    with pytest.raises(ValueError, match="num_replicas must be at least 1"):
        assign_groups([1.0], 0)
    with pytest.raises(ValueError, match="non-negative"):
        assign_groups([1.0, -0.5], 2)


def test_group_costs_follow_the_roofline() -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(100, 900) for _ in range(48)]
    prompts = [prefix + [rng.randrange(100, 900) for _ in range(rng.randrange(1, 20))]
               for _ in range(6)] + [[rng.randrange(100, 900) for _ in range(30)]]  # fmt: skip
    outs = [rng.randrange(1, 40) for _ in prompts]
    plan = plan_prefix_groups(prompts, outs, block_size=16)
    costs = group_costs_s(plan, [len(p) for p in prompts], outs, SHAPE, F, B)
    assert len(costs) == len(plan.groups) and len(plan.shared_groups) == 1
    for group, cost in zip(plan.groups, costs):
        members = [(len(prompts[i]), outs[i]) for i in group.request_indices]
        flops, nbytes = batch_work(SHAPE, [(group.prefix_len, members)])
        nbytes -= SHAPE.weight_bytes * max(o for _, o in members)
        assert cost == pytest.approx(flops / F + nbytes / B)
        assert cost > 0
    with pytest.raises(ValueError, match="ceilings must be positive"):
        group_costs_s(plan, [len(p) for p in prompts], outs, SHAPE, 0, B)
    with pytest.raises(ValueError, match="prompt lengths"):
        group_costs_s(plan, [1], outs, SHAPE, F, B)


def _groups_batch(rng: random.Random, sizes: list[int], prefix_len: int = 64):
    """Prompts of groups of `sizes` members sharing `prefix_len` tokens each (then 8 own
    tokens), and their output lengths."""
    prompts = []
    for size in sizes:
        prefix = [rng.randrange(100, 900) for _ in range(prefix_len)]
        prompts += [prefix + [rng.randrange(100, 900) for _ in range(8)] for _ in range(size)]
    return prompts, [rng.randrange(8, 24) for _ in prompts]


@pytest.mark.parametrize(
    "sizes, replicas, split",
    [([4], 2, True), ([16, 16, 16], 4, True), ([40, 2, 2, 2], 3, True), ([5], 8, True),
     ([3, 3], 2, False), ([6, 5, 4, 3, 2], 2, False), ([2, 2, 2, 2], 2, False)],
)  # fmt: skip
def test_partition_splits_only_a_group_that_outweighs_the_mean_load(sizes, replicas, split):
    prompts, outs = _groups_batch(random.Random(len(sizes) * replicas), sizes)
    plan = plan_prefix_groups(prompts, outs, block_size=16)
    terms = cost_terms_s(plan, [len(p) for p in prompts], outs, SHAPE, F, B)
    costs = group_costs_s(plan, [len(p) for p in prompts], outs, SHAPE, F, B)
    assert costs == pytest.approx([terms[0][g] + sum(terms[1][i] for i in group.request_indices)
                                   for g, group in enumerate(plan.groups)])  # fmt: skip
    a = partition_groups(plan, *terms, replicas)
    whole = assign_groups(costs, replicas)
    shares = [a.replica_requests(plan, r) for r in range(replicas)]
    assert sorted(i for share in shares for i in share) == list(range(len(prompts)))
    assert max(a.planned_cost_s) <= max(whole.planned_cost_s)
    if max(costs) <= sum(costs) / replicas:  # whole groups balance: none is split
        assert not split
    if not split:  # whole groups, or a split that would not lower the makespan
        assert a == whole and a.split_groups == [] and a.extra_prefix_tokens(plan) == 0
        return
    # a group outweighs the mean load: it is split, every replica gets work (as far as there
    # are requests) and each piece computes its group's prefix once
    assert a.split_groups and max(a.planned_cost_s) < max(whole.planned_cost_s)
    assert sum(1 for share in shares if share) == min(replicas, len(prompts))
    holders = {
        g: sum(1 for r in range(replicas) if g in a.replica_groups[r]) for g in a.split_groups
    }
    assert all(k >= 2 for k in holders.values())
    assert a.extra_prefix_tokens(plan) == sum(
        plan.groups[g].prefix_len * (k - 1) for g, k in holders.items()
    )
    for (r, g), members in a.pieces.items():
        assert g in a.replica_groups[r] and set(members) <= set(plan.groups[g].request_indices)
    assert partition_groups(plan, *terms, replicas) == a  # deterministic


def test_one_group_two_replicas_both_get_work() -> None:
    prompts, outs = _groups_batch(random.Random(1), [6])
    plan = plan_prefix_groups(prompts, outs, block_size=16)
    a = partition_groups(plan, *cost_terms_s(plan, [len(p) for p in prompts], outs, SHAPE, F, B),
                         2)  # fmt: skip
    assert len(plan.groups) == 1 and a.split_groups == [0]
    assert [len(a.replica_requests(plan, r)) for r in (0, 1)] in ([3, 3], [2, 4], [4, 2])
    assert a.extra_prefix_tokens(plan) == plan.groups[0].prefix_len == 64
    with pytest.raises(ValueError, match="num_replicas must be at least 1"):
        partition_groups(plan, *cost_terms_s(plan, [len(p) for p in prompts], outs, SHAPE, F, B),
                         0)  # fmt: skip


@pytest.fixture(scope="module")
def workload():
    return make_workload("batchllm", SHAPE.vocab, num_groups=24, prefix_len=96, suffix_len=8,
                         output_len=4)  # fmt: skip


def test_prefix_aware_keeps_one_replicas_reuse(workload) -> None:
    points = scaling_table(workload, SHAPE, [1, 4, 16], flops_per_s=F, bytes_per_s=B)
    by = {(p["replicas"], p["strategy"]): p for p in points}
    assert {p["strategy"] for p in points} == set(STRATEGIES)
    one = by[1, "prefix_aware"]["reuse_ratio"]
    assert one > 0.5
    for n in (1, 4, 16):
        assert by[n, "prefix_aware"]["reuse_ratio"] == one
        assert (
            by[n, "prefix_aware"]["computed_prompt_tokens"]
            == by[1, "prefix_aware"]["computed_prompt_tokens"]
        )
    for s in ("contiguous", "random"):
        assert by[1, s]["reuse_ratio"] == pytest.approx(one)
        assert by[16, s]["reuse_ratio"] < by[4, s]["reuse_ratio"] < one
    assert by[16, "prefix_aware"]["reuse_ratio"] >= 2 * by[16, "contiguous"]["reuse_ratio"]
    # 24 equal groups over 4 replicas: exactly balanced
    assert by[4, "prefix_aware"]["planned_imbalance"] == pytest.approx(1.0)
    assert by[4, "prefix_aware"]["makespan_s"] < by[1, "prefix_aware"]["makespan_s"]


def test_scaling_model_splits_groups_when_replicas_outnumber_them() -> None:
    """shared-prefix-like 4 x 16 over 16 replicas: whole groups leave 12 replicas idle; split,
    every replica works and the reuse counts each repeated prefix."""
    w = make_workload("shared-prefix", SHAPE.vocab, num_groups=4, prefix_len=64, suffix_len=8,
                      output_len=4)  # fmt: skip
    four = scaling_point(w, SHAPE, 4, "prefix_aware", flops_per_s=F, bytes_per_s=B)
    many = scaling_point(w, SHAPE, 16, "prefix_aware", flops_per_s=F, bytes_per_s=B)
    assert four["split_groups"] == 0 and many["split_groups"] >= 3
    assert many["computed_prompt_tokens"] > four["computed_prompt_tokens"]
    assert many["reuse_ratio"] < four["reuse_ratio"]
    assert many["imbalance"] < 1.5 and many["makespan_s"] < four["makespan_s"]


def test_scaling_point_rejects_bad_input(workload) -> None:
    with pytest.raises(ValueError, match="strategy must be one of"):
        scaling_point(workload, SHAPE, 2, "sticky", flops_per_s=F, bytes_per_s=B)
    with pytest.raises(ValueError, match="replicas must be at least 1"):
        scaling_point(workload, SHAPE, 0, "random", flops_per_s=F, bytes_per_s=B)
