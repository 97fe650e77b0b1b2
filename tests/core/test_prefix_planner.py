"""Prefix planner: enlargement rule, block rounding, duplicates, ordering, exact token counts."""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Sequence
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phloem.core import prefix_planner
from phloem.core.prefix_planner import (
    PrefixPlan,
    _common_prefix_tokens,
    _encode,
    plan_prefix_groups,
)

_next_token = iter(range(1_000_000, 2**31))


def fresh(n: int) -> list[int]:
    """n token ids never used before (no accidental sharing between test prompts)."""
    return [next(_next_token) for _ in range(n)]


def groups_as_sets(plan: PrefixPlan) -> set[tuple[int, frozenset[int]]]:
    return {(g.prefix_len, frozenset(g.request_indices)) for g in plan.groups}


def check_plan(
    plan: PrefixPlan, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]
) -> None:
    """Every structural promise of a plan, recomputed from scratch."""
    n, bs = len(prompts), plan.block_size
    assert sorted(plan.order) == list(range(n))
    assert plan.order == [i for g in plan.groups for i in g.request_indices]  # contiguous groups
    physical = 0
    keys = []
    for gi, g in enumerate(plan.groups):
        members = g.request_indices
        assert all(plan.request_group[i] == gi for i in members)
        assert g.prefix_len % bs == 0
        if g.prefix_len == 0:
            assert len(members) == 1
        else:
            assert len(members) >= 2
            head = list(prompts[members[0]][: g.prefix_len])
            assert all(list(prompts[i][: g.prefix_len]) == head for i in members)
            assert all(len(prompts[i]) > g.prefix_len for i in members)
        prefill = g.prefix_len + sum(len(prompts[i]) - g.prefix_len for i in members)
        physical += prefill
        keys.append(sum(max_tokens[i] for i in members) / prefill)
    assert keys == sorted(keys, reverse=True)  # decode-heavy first (§4.3)
    assert plan.num_physical_prompt_tokens == physical
    assert plan.num_logical_prompt_tokens == sum(len(p) for p in prompts)
    assert physical <= plan.num_logical_prompt_tokens


# --------------------------------------------------------------------------- enlargement rule
def enlargement_workload(child_len: int, grandchild_len: int) -> list[list[int]]:
    """root ─ child (child_len) ─┬─ grandchild (grandchild_len) ─ 3 leaves (requests 0-2)
    └─ 2 other leaves (requests 3, 4), each with 5 own tokens."""
    child, grandchild = fresh(child_len), fresh(grandchild_len)
    prompts = [child + grandchild + fresh(5) for _ in range(3)]
    prompts += [child + fresh(5) for _ in range(2)]
    return prompts


def test_lifting_grandchild_pays() -> None:
    # gain = (3 - 1) * 10 - 4 = 16 > 0: the grandchild becomes its own group.
    prompts = enlargement_workload(child_len=4, grandchild_len=10)
    plan = plan_prefix_groups(prompts, [1] * 5, block_size=1)
    assert groups_as_sets(plan) == {(14, frozenset({0, 1, 2})), (4, frozenset({3, 4}))}
    assert plan.num_physical_prompt_tokens == 14 + 3 * 5 + 4 + 2 * 5
    check_plan(plan, prompts, [1] * 5)


@pytest.mark.parametrize("child_len", [20, 30])  # gain 0 (not > 0) and -10
def test_lifting_grandchild_does_not_pay(child_len: int) -> None:
    prompts = enlargement_workload(child_len=child_len, grandchild_len=10)
    plan = plan_prefix_groups(prompts, [1] * 5, block_size=1)
    assert groups_as_sets(plan) == {(child_len, frozenset(range(5)))}
    assert plan.num_physical_prompt_tokens == child_len + 3 * 15 + 2 * 5
    check_plan(plan, prompts, [1] * 5)


def test_enlargement_uses_block_rounded_lengths() -> None:
    # Tokens: child 4 + grandchild 10 = 14. With block_size 8 the child rounds to 0 and the
    # grandchild's prefix to 8: requests 0-2 share one block, 3 and 4 share none.
    prompts = enlargement_workload(child_len=4, grandchild_len=10)
    plan = plan_prefix_groups(prompts, [1] * 5, block_size=8)
    assert groups_as_sets(plan) == {
        (8, frozenset({0, 1, 2})),
        (0, frozenset({3})),
        (0, frozenset({4})),
    }
    check_plan(plan, prompts, [1] * 5)


def test_nested_few_shot_and_per_question_prefixes() -> None:
    # 3 questions × 4 samples each behind one 64-token few-shot prefix; question 32 tokens.
    few_shot = fresh(64)
    questions = [fresh(32) for _ in range(3)]
    prompts = [few_shot + q + fresh(3 + j) for q in questions for j in range(4)]
    # gain(question | few-shot) = (4 - 1) * 32 - 64 = 32 > 0: one group per question.
    plan = plan_prefix_groups(prompts, [8] * 12, block_size=16)
    assert groups_as_sets(plan) == {(96, frozenset(range(4 * q, 4 * q + 4))) for q in range(3)}
    assert plan.num_physical_prompt_tokens == 3 * 96 + 3 * sum(3 + j for j in range(4))
    check_plan(plan, prompts, [8] * 12)
    # A 128-token few-shot prefix: gain = 96 - 128 < 0, so one group over the few-shot part.
    few_shot = fresh(128)
    prompts = [few_shot + q + fresh(3 + j) for q in questions for j in range(4)]
    plan = plan_prefix_groups(prompts, [8] * 12, block_size=16)
    assert groups_as_sets(plan) == {(128, frozenset(range(12)))}
    check_plan(plan, prompts, [8] * 12)


def test_request_ending_at_a_branch_point_keeps_one_own_token() -> None:
    base = fresh(8)
    prompts = [base, base + fresh(8), base + fresh(4)]
    plan = plan_prefix_groups(prompts, [1] * 3, block_size=4)
    # Request 0 ends at the shared node: the prefix is capped at 8 - 1 -> 4 tokens (1 block).
    assert groups_as_sets(plan) == {(4, frozenset({0, 1, 2}))}
    check_plan(plan, prompts, [1] * 3)


# ---------------------------------------------------------------------------------- duplicates
@pytest.mark.parametrize(
    ("length", "block_size", "prefix_len"),
    [(8, 4, 4), (9, 4, 8), (8, 1, 7), (3, 4, 0), (4, 4, 0)],
)
def test_identical_prompts_keep_at_least_one_own_token(
    length: int, block_size: int, prefix_len: int
) -> None:
    prompt = fresh(length)
    prompts = [list(prompt) for _ in range(3)]
    plan = plan_prefix_groups(prompts, [1] * 3, block_size=block_size)
    if prefix_len:
        assert groups_as_sets(plan) == {(prefix_len, frozenset({0, 1, 2}))}
    else:
        assert all(g.prefix_len == 0 for g in plan.groups) and len(plan.groups) == 3
    assert plan.num_physical_prompt_tokens == prefix_len + 3 * (length - prefix_len)
    check_plan(plan, prompts, [1] * 3)


# -------------------------------------------------------------------------------- no sharing
def test_no_sharing_gives_plain_requests() -> None:
    prompts = [fresh(10 + i) for i in range(6)]
    max_tokens = [5, 50, 1, 20, 20, 0]
    plan = plan_prefix_groups(prompts, max_tokens, block_size=4)
    assert plan.shared_groups == []
    assert plan.num_physical_prompt_tokens == plan.num_logical_prompt_tokens == sum(range(10, 16))
    assert plan.planned_reuse_ratio == 0.0
    # Ratios: 5/10, 50/11, 1/12, 20/13, 20/14, 0/15.
    assert plan.order == [1, 3, 4, 0, 2, 5]
    check_plan(plan, prompts, max_tokens)


def test_empty_batch() -> None:
    plan = plan_prefix_groups([], [], block_size=16)
    assert plan.groups == [] and plan.order == []
    assert plan.planned_reuse_ratio == 0.0


# ----------------------------------------------------------------------------------- ordering
def test_order_by_decode_ratio_keeps_groups_contiguous() -> None:
    shared = fresh(8)
    prompts = [
        fresh(10),  # 0: lone, ratio 1/10
        shared + fresh(2),  # 1: group (8 + 2 + 2 = 12 prefill tokens, 12 decode) ratio 1.0
        fresh(10),  # 2: lone, ratio 20/10
        shared + fresh(2),  # 3: group
    ]
    max_tokens = [1, 6, 20, 6]
    plan = plan_prefix_groups(prompts, max_tokens, block_size=4)
    assert plan.order == [2, 1, 3, 0]
    assert [g.prefix_len for g in plan.groups] == [0, 8, 0]
    assert plan.prefix_len(3) == 8 and plan.prefix_len(0) == 0
    check_plan(plan, prompts, max_tokens)


@settings(max_examples=150, deadline=None)
@given(
    templates=st.lists(
        st.lists(st.integers(0, 3), min_size=0, max_size=12), min_size=1, max_size=4
    ),
    picks=st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=6), st.integers(0, 9)),
        min_size=1,
        max_size=25,
    ),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_random_plans_keep_every_promise(
    templates: list[list[int]], picks: list[tuple[int, list[int], int]], block_size: int
) -> None:
    prompts = [templates[t % len(templates)] + tail or [0] for t, tail, _ in picks]
    max_tokens = [m for _, _, m in picks]
    plan = plan_prefix_groups(prompts, max_tokens, block_size)
    check_plan(plan, prompts, max_tokens)


@given(
    head=st.lists(st.integers(0, 2**32 - 1), max_size=20),
    a_tail=st.lists(st.sampled_from([0, 1, 2**31, 2**32 - 1]), max_size=6),
    b_tail=st.lists(st.sampled_from([0, 1, 2**31, 2**32 - 1]), max_size=6),
)
def test_common_prefix_tokens_of_encoded_prompts(
    head: list[int], a_tail: list[int], b_tail: list[int]
) -> None:
    a, b = head + a_tail, head + b_tail
    expected = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    a_arr, b_arr = (np.frombuffer(_encode(p, 0), dtype=np.uintc) for p in (a, b))
    assert _common_prefix_tokens(a_arr, b_arr) == expected
    assert _common_prefix_tokens(b_arr, a_arr) == expected


def naive_common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The LCP token by token in Python (what the vectorized one must equal)."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@settings(max_examples=60, deadline=None)
@given(
    templates=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1),
    picks=st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(0, 5), max_size=6), st.integers(0, 9)),
        min_size=1,
        max_size=25,
    ),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_packed_prompts_plan_exactly_as_lists(
    templates: list[list[int]], picks: list[tuple[int, list[int], int]], block_size: int
) -> None:
    """`array('I')` prompts (what `LLM.generate` packs while checking) give the very plan the
    token-id lists give, and so do arrays of another typecode (packed on the way) and the
    planner with a token-by-token LCP."""
    prompts = [templates[t % len(templates)] + tail for t, tail, _ in picks]
    max_tokens = [m for _, _, m in picks]
    plan = plan_prefix_groups(prompts, max_tokens, block_size)
    with mock.patch.object(prefix_planner, "_common_prefix_tokens", naive_common_prefix):
        assert plan_prefix_groups(prompts, max_tokens, block_size) == plan
    assert plan_prefix_groups([array("I", p) for p in prompts], max_tokens, block_size) == plan
    assert plan_prefix_groups([array("q", p) for p in prompts], max_tokens, block_size) == plan
    check_plan(plan, prompts, max_tokens)


# ------------------------------------------------------------------------------- exact counts
@pytest.mark.parametrize(("prefix_tokens", "block_size"), [(32, 16), (40, 16), (64, 1)])
def test_groups_times_requests_workload_counts(prefix_tokens: int, block_size: int) -> None:
    num_groups, per_group = 4, 5
    prompts, max_tokens = [], []
    for _ in range(num_groups):
        prefix = fresh(prefix_tokens)
        for d in range(per_group):
            prompts.append(prefix + fresh(7 + d))
            max_tokens.append(16)
    plan = plan_prefix_groups(prompts, max_tokens, block_size)
    shared = prefix_tokens // block_size * block_size
    suffixes = num_groups * sum(7 + d for d in range(per_group))
    logical = num_groups * per_group * prefix_tokens + suffixes
    physical = num_groups * shared + num_groups * per_group * (prefix_tokens - shared) + suffixes
    assert len(plan.shared_groups) == num_groups
    assert plan.num_logical_prompt_tokens == logical
    assert plan.num_physical_prompt_tokens == physical
    assert plan.planned_reuse_ratio == pytest.approx((logical - physical) / logical)
    check_plan(plan, prompts, max_tokens)
    summary = plan.describe()
    assert f"{num_groups} shared-prefix groups" in summary
    assert f"{logical} logical, {physical} computed" in summary


# ------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("prompts", "max_tokens", "block_size"),
    [
        ([[1, 2]], [1], 0),
        ([[1, 2]], [1, 2], 4),
        ([[1, 2], []], [1, 1], 4),
        ([[1, -2]], [1], 4),
        ([[1, 2]], [-1], 4),
    ],
)
def test_invalid_inputs_raise(
    prompts: list[list[int]], max_tokens: list[int], block_size: int
) -> None:
    with pytest.raises(ValueError):
        plan_prefix_groups(prompts, max_tokens, block_size)


# ------------------------------------------------------------------------- complexity guard
def test_ten_thousand_prompts_plan_in_under_a_second() -> None:
    rng = random.Random(0)
    system = [rng.randrange(50_000) for _ in range(64)]
    docs = [[rng.randrange(50_000) for _ in range(160)] for _ in range(400)]
    prompts = [
        system + docs[rng.randrange(400)] + [rng.randrange(50_000) for _ in range(76)]
        for _ in range(10_000)
    ]
    max_tokens = [rng.randrange(1, 256) for _ in prompts]
    elapsed = []
    for _ in range(2):  # best of two: a guard against O(n^2) or per-token objects, not a bench
        start = time.perf_counter()
        plan = plan_prefix_groups(prompts, max_tokens, block_size=16)
        elapsed.append(time.perf_counter() - start)
    assert min(elapsed) < 1.0, elapsed
    assert len(plan.shared_groups) == 400
    assert all(g.prefix_len == 224 for g in plan.shared_groups)  # (64 + 160) tokens = 14 blocks
