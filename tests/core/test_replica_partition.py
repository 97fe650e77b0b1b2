"""Whole prefix groups dealt to data-parallel replicas (LPT) and the scaling model built on it:
groups are never split, every group lands once, LPT stays within Graham's bound of the optimum,
costs follow the roofline, and prefix-aware routing keeps one replica's reuse at any scale while
contiguous slicing and random routing lose it."""

from __future__ import annotations

import itertools
import random

import pytest

from phloem.bench.plan_scaling import STRATEGIES, scaling_point, scaling_table
from phloem.bench.roofline import ModelShape, batch_work
from phloem.bench.workloads import make_workload
from phloem.core.prefix_planner import plan_prefix_groups
from phloem.core.replica_partition import assign_groups, group_costs_s

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


def test_scaling_point_rejects_bad_input(workload) -> None:
    with pytest.raises(ValueError, match="strategy must be one of"):
        scaling_point(workload, SHAPE, 2, "sticky", flops_per_s=F, bytes_per_s=B)
    with pytest.raises(ValueError, match="replicas must be at least 1"):
        scaling_point(workload, SHAPE, 0, "random", flops_per_s=F, bytes_per_s=B)
