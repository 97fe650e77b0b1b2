"""A data-parallel replica queues its share under the driver's global plan (`share_plan` of
`ReplicaAssignment.replica_share`) instead of planning it again: on whole-group deals of
batchllm-shaped batches (and of batches whose groups share nothing with each other) that plan
is exactly the share's own plan, order included; where the two differ (nested sharing, a piece
of a split group) the driver's plan still computes exactly the global plan's prompt tokens
(one engine's), which the share's own plan does not promise; bad shapes are refused."""

from __future__ import annotations

import random

import pytest

from phloem.bench.roofline import ModelShape
from phloem.bench.workloads import make_workload
from phloem.core.prefix_planner import PrefixPlan, plan_prefix_groups
from phloem.core.replica_partition import cost_terms_s, partition_groups, share_plan

SHAPE = ModelShape(hidden=256, layers=4, q_heads=8, kv_heads=2, head_dim=32, mlp=512, vocab=2000)
F, B = 1e14, 1e12


def _deal(prompts, max_tokens, block_size, num_replicas):
    plan = plan_prefix_groups(prompts, max_tokens, block_size)
    lens = [len(p) for p in prompts]
    terms = cost_terms_s(plan, lens, max_tokens, SHAPE, F, B)
    return plan, partition_groups(plan, *terms, num_replicas)


def _driver_plan(plan, assignment, replica, prompts, block_size) -> tuple[PrefixPlan, list[int]]:
    """(the share's plan from the global one, the share's request indices in its order)."""
    groups = assignment.replica_share(plan, replica)
    indices = [i for _, members in groups for i in members]
    lens = [len(prompts[i]) for i in indices]
    prefix_lens = [p for p, _ in groups]
    return share_plan(prefix_lens, [len(m) for _, m in groups], lens, block_size), indices


def _own_plan(indices, prompts, max_tokens, block_size) -> PrefixPlan:
    return plan_prefix_groups(
        [prompts[i] for i in indices], [max_tokens[i] for i in indices], block_size
    )


@pytest.mark.parametrize("num_replicas", [2, 4, 8])
@pytest.mark.parametrize("shape", [(40, 16, 64, 16, 8), (24, 8, 96, 24, 50), (30, 3, 32, 5, 4)])
def test_whole_group_deals_equal_the_shares_own_plans(num_replicas, shape):
    """batchllm-shaped batches (shuffled, distinct prefixes, varied max_tokens): every replica's
    plan from the driver's equals the plan its share would get on its own, field for field."""
    groups, degree, prefix, suffix, out = shape
    workload = make_workload("batchllm", 5000, seed=num_replicas, num_groups=groups,
                             degree=degree, prefix_len=prefix, suffix_len=suffix)  # fmt: skip
    prompts = workload.prompts
    rng = random.Random(groups)
    max_tokens = [rng.randrange(1, out + 1) for _ in prompts]
    plan, assignment = _deal(prompts, max_tokens, 16, num_replicas)
    assert not assignment.pieces  # whole groups only
    total = 0
    for r in range(num_replicas):
        driver, indices = _driver_plan(plan, assignment, r, prompts, 16)
        assert driver == _own_plan(indices, prompts, max_tokens, 16)
        total += driver.num_physical_prompt_tokens
    assert total == plan.num_physical_prompt_tokens


def test_random_batches_without_nested_sharing_equal_too():
    rng = random.Random(3)
    for trial in range(20):
        prompts = []
        for g in range(rng.randrange(2, 12)):
            prefix = [1000 * (trial + 1) + g] + [
                rng.randrange(5000) for _ in range(rng.randrange(3, 40))
            ]
            prompts += [prefix + [rng.randrange(5000) for _ in range(rng.randrange(1, 9))]
                        for _ in range(rng.randrange(1, 6))]  # fmt: skip
        prompts += [[9] + [rng.randrange(5000) for _ in range(rng.randrange(1, 30))]
                    for _ in range(rng.randrange(0, 4))]  # fmt: skip
        rng.shuffle(prompts)
        max_tokens = [rng.randrange(0, 20) for _ in prompts]
        block = rng.choice([1, 4, 8])
        num_replicas = rng.randrange(2, 5)
        plan, assignment = _deal(prompts, max_tokens, block, num_replicas)
        for r in range(num_replicas):
            driver, indices = _driver_plan(plan, assignment, r, prompts, block)
            if not any(r == rr for rr, _ in assignment.pieces):
                assert driver == _own_plan(indices, prompts, max_tokens, block)


def test_nested_sharing_own_plan_differs_driver_plan_keeps_the_global_tokens():
    """Global: Q (4 tokens) shared by 8 requests, of which 2 share R (Q + 4 more) and 6 share
    P (Q + 12 more, a group of its own); R is not worth a group of its own under Q. A replica
    holding Q's group without P's sees R as a root-level group: its own plan would compute
    fewer tokens than the global plan promised, so it is not used."""
    q = [7, 8, 9, 10]
    r = q + [11, 12, 13, 14]
    p = q + list(range(20, 32))
    prompts = [r + [40 + k] for k in range(2)] + [p + [50 + k] for k in range(6)]
    max_tokens = [4] * len(prompts)
    plan = plan_prefix_groups(prompts, max_tokens, 1)
    by_prefix = {g.prefix_len: set(g.request_indices) for g in plan.groups}
    assert by_prefix == {4: {0, 1}, 16: {2, 3, 4, 5, 6, 7}}
    for g in plan.groups:
        members = list(g.request_indices)
        driver = share_plan([g.prefix_len], [len(members)], [len(prompts[i]) for i in members], 1)
        own = plan_prefix_groups([prompts[i] for i in members], [4] * len(members), 1)
        expected = g.prefix_len + sum(len(prompts[i]) - g.prefix_len for i in members)
        assert driver.num_physical_prompt_tokens == expected
        if g.prefix_len == 4:
            assert own.groups[0].prefix_len == 8  # R, found only without P's requests
            assert own.num_physical_prompt_tokens < expected


def test_one_member_piece_runs_plain_and_bad_shapes_are_refused():
    plan = share_plan([8, 8, 0], [1, 2, 1], [10, 9, 12, 3], 4)
    assert [g.prefix_len for g in plan.groups] == [0, 8, 0]
    assert plan.order == [0, 1, 2, 3] and plan.request_group == [0, 1, 1, 2]
    assert plan.num_physical_prompt_tokens == 10 + 8 + 1 + 4 + 3
    with pytest.raises(ValueError, match="for a share of 3 requests"):
        share_plan([0], [2], [1, 2, 3], 1)
    with pytest.raises(ValueError, match="group 0 of the share"):
        share_plan([6], [2], [9, 9], 4)  # not a multiple of block_size
    with pytest.raises(ValueError, match="group 1 of the share"):
        share_plan([0, 8], [1, 2], [3, 9, 8], 4)  # a member with no token of its own
