"""Data-parallel replicas under one global prefix plan: prefix groups assigned to replicas.

One `PrefixPlan` is made for the whole batch (`prefix_planner.plan_prefix_groups`); its groups
are then dealt to N replicas so that each shared prefix is computed once in the whole cluster
(on the replica that holds its group) and the replicas' planned costs are balanced.

The rule (`partition_groups`):

1. Whole groups by longest-processing-time-first (LPT; Graham, "Bounds on multiprocessing
   timing anomalies", SIAM J. Appl. Math. 1969): groups in decreasing cost, each to the
   replica with the least cost so far; the makespan is at most (4/3 - 1/(3N)) times the best
   whole-group one. This is the deal whenever no group costs more than the mean replica load
   (total / N), which covers a batch of many groups (batchllm 400 x 16 on 8 replicas).
2. Otherwise whole groups cannot balance (fewer groups than replicas, or one huge group): a
   replica would hold one group and nothing else while others idle. Then the groups are also
   dealt by McNaughton's wrap-around rule (Management Science 6(1), 1959, for preemptive
   scheduling): groups in decreasing cost fill replica 0 up to a target load T, the member that
   would overflow starts a piece of its group on the next replica, and so on; T is the least
   load (bisection between the mean and the LPT makespan) for which the last replica stays
   within it. A piece on another replica pays its group's prefix again (that replica computes
   the prefix once), so splitting costs prefix tokens: the split deal is taken only when its
   makespan, prefix repeats included, is below the whole-group one, and the plan's extra
   prefix tokens are reported (`extra_prefix_tokens`).

A group's cost is its roofline time in seconds (shared/docs/ROOFLINE.md, `bench.roofline`):
its FLOPs at `flops_per_s` plus its KV bytes at `bytes_per_s` (prefix once, each member's own
prompt tokens and outputs). The weights' bytes, read once per decode step by the whole batch, are
a per-replica constant and left out. The cost is additive over members plus one prefix term
(the prefix's FLOPs and its KV read once per decode step of the group's longest output), so a
piece costs its prefix term plus its members' costs.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from phloem.core.prefix_planner import PrefixGroup, PrefixPlan

DATA_PARALLEL_ROUTINGS = ("prefix", "contiguous")  # `EngineArgs.data_parallel_routing`
_BISECTION_STEPS = 40  # the wrap-around target T to within (hi - lo) / 2**40


@dataclass(frozen=True)
class ReplicaAssignment:
    """Which plan groups (or pieces of them) each replica runs.

    Attributes:
        replica_groups: per replica, indices into `plan.groups` it runs all or part of, in the
            plan's schedule order.
        planned_cost_s: per replica, the sum of its groups' (pieces') costs [s].
        pieces: (replica, group) -> the members that replica runs, for a group split across
            replicas (members in schedule order); a group absent here runs whole on one replica.
    """

    replica_groups: list[list[int]]
    planned_cost_s: list[float]
    pieces: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @property
    def num_replicas(self) -> int:
        return len(self.replica_groups)

    @property
    def imbalance(self) -> float:
        """max / mean of the replicas' planned costs (1.0 is perfect; 1.0 for zero cost)."""
        mean = sum(self.planned_cost_s) / len(self.planned_cost_s)
        return max(self.planned_cost_s) / mean if mean > 0 else 1.0

    @property
    def split_groups(self) -> list[int]:
        """Groups split across replicas, ascending."""
        return sorted({g for _, g in self.pieces})

    def extra_prefix_tokens(self, plan: PrefixPlan) -> int:
        """Prompt tokens computed beyond the plan's `num_physical_prompt_tokens` because split
        groups compute their prefix once per replica holding a piece [tokens]."""
        holders = Counter(g for _, g in self.pieces)
        return sum(plan.groups[g].prefix_len * (k - 1) for g, k in holders.items())

    def replica_requests(self, plan: PrefixPlan, replica: int) -> list[int]:
        """Request indices of `replica`, in schedule order (its groups' members, or its pieces'
        members for split groups, concatenated)."""
        return [i for _, members in self.replica_share(plan, replica) for i in members]

    def replica_share(self, plan: PrefixPlan, replica: int) -> list[tuple[int, tuple[int, ...]]]:
        """The global plan restricted to `replica`: (prefix_len, members) per group or piece it
        runs, in schedule order; the members are request indices of the batch. A piece of one
        member keeps its group's prefix_len (its prompt still starts with that prefix)."""
        return [
            (plan.groups[g].prefix_len,
             tuple(self.pieces.get((replica, g), plan.groups[g].request_indices)))
            for g in self.replica_groups[replica]
        ]  # fmt: skip


def share_plan(
    prefix_lens: Sequence[int],
    group_sizes: Sequence[int],
    prompt_lens: Sequence[int],
    block_size: int,
) -> PrefixPlan:
    """The `PrefixPlan` of a replica's share made from the driver's global plan, without
    planning again: the share's requests are numbered 0..n-1 in the order the driver listed
    them (`ReplicaAssignment.replica_share`: groups in schedule order, members contiguous), and
    group j holds the next group_sizes[j] of them behind prefix_lens[j] shared tokens. A group
    of one member runs as a plain request (prefix_len 0), as the planner would have it.

    Why not plan the share again: the share's own plan can differ from the global plan's groups
    on it (a member set smaller than the global subtree can expose a longer common prefix, or a
    piece of a split group rank differently), and only the global plan's groups make the
    cluster compute exactly the prompt tokens one engine computes. Where the two agree (whole
    groups with no nested sharing, e.g. the batchllm workload) this is the share's own plan
    (tests/core/test_share_plan.py) and saves re-planning it.

    Raises:
        ValueError: sizes that do not add up to len(prompt_lens), an empty group, or a
            prefix_len that is not a multiple of block_size or leaves a member no own token.
    """
    if len(prefix_lens) != len(group_sizes) or sum(group_sizes) != len(prompt_lens):
        raise ValueError(
            f"{len(prefix_lens)} prefix lengths and groups of {sum(group_sizes)} requests for "
            f"a share of {len(prompt_lens)} requests"
        )
    groups, request_group, start, physical = [], [], 0, 0
    for g, (prefix_len, size) in enumerate(zip(prefix_lens, group_sizes)):
        members = range(start, start + size)
        if (
            size < 1
            or prefix_len % block_size
            or any(prompt_lens[i] <= prefix_len for i in members)
        ):
            raise ValueError(
                f"group {g} of the share: {size} members behind prefix_len {prefix_len} "
                f"(block_size {block_size}) is not a planned group"
            )
        shared = prefix_len if size >= 2 else 0
        groups.append(PrefixGroup(shared, tuple(members)))
        request_group.extend([g] * size)
        physical += shared + sum(prompt_lens[i] for i in members) - shared * size
        start += size
    return PrefixPlan(
        groups=groups,
        order=list(range(len(prompt_lens))),
        request_group=request_group,
        block_size=block_size,
        num_logical_prompt_tokens=sum(prompt_lens),
        num_physical_prompt_tokens=physical,
    )


def cost_terms_s(
    plan: PrefixPlan,
    prompt_lens: Sequence[int],
    max_tokens: Sequence[int],
    shape: Any,
    flops_per_s: float,
    bytes_per_s: float,
) -> tuple[list[float], list[float]]:
    """(prefix term per group, cost per request) [s] (module docstring): a group's cost is its
    prefix term plus its members' costs.

    Args:
        prompt_lens / max_tokens: per request index of the planned batch [tokens] (max_tokens
            counts every sequence of a request: n x max_tokens).
        shape: a `phloem.bench.roofline.ModelShape`.
        flops_per_s / bytes_per_s: the ceilings the costs are expressed against (> 0).

    Raises:
        ValueError: on non-positive ceilings or lengths that do not match the plan.
    """
    from phloem.bench.roofline import batch_work

    if flops_per_s <= 0 or bytes_per_s <= 0:
        raise ValueError(f"ceilings must be positive, got {flops_per_s} FLOP/s, {bytes_per_s} B/s")
    if len(prompt_lens) != len(plan.request_group) or len(max_tokens) != len(prompt_lens):
        raise ValueError(
            f"{len(prompt_lens)} prompt lengths and {len(max_tokens)} max_tokens for a plan of "
            f"{len(plan.request_group)} requests"
        )
    kv, weights = shape.kv_bytes_per_token, shape.weight_bytes
    prefix_terms = []
    member_costs = [0.0] * len(prompt_lens)
    for group in plan.groups:
        p = group.prefix_len
        prefix_flops, _ = batch_work(shape, [(p, [(p, 0)])])  # the prefix alone, no outputs
        longest = max(max_tokens[i] for i in group.request_indices)
        prefix_terms.append(prefix_flops / flops_per_s + kv * p * longest / bytes_per_s)
        for i in group.request_indices:
            o = max_tokens[i]
            flops, nbytes = batch_work(shape, [(p, [(prompt_lens[i], o)])])
            own_bytes = nbytes - kv * p * o - weights * o
            member_costs[i] = (flops - prefix_flops) / flops_per_s + own_bytes / bytes_per_s
    return prefix_terms, member_costs


def group_costs_s(
    plan: PrefixPlan,
    prompt_lens: Sequence[int],
    max_tokens: Sequence[int],
    shape: Any,
    flops_per_s: float,
    bytes_per_s: float,
) -> list[float]:
    """Planned cost [s] of each group of `plan` (module docstring): roofline FLOPs / flops_per_s
    + KV bytes / bytes_per_s, weights left out. Arguments and errors as `cost_terms_s`."""
    prefix, member = cost_terms_s(plan, prompt_lens, max_tokens, shape, flops_per_s, bytes_per_s)
    return [
        prefix[g] + sum(member[i] for i in group.request_indices)
        for g, group in enumerate(plan.groups)
    ]


def assign_groups(costs: Sequence[float], num_replicas: int) -> ReplicaAssignment:
    """Deal whole groups (by cost, in plan order) to `num_replicas` replicas by LPT;
    deterministic: ties go to the lower group index first and to the lower replica index.

    Raises:
        ValueError: num_replicas < 1, or a negative cost.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if any(c < 0 for c in costs):
        raise ValueError("group costs must be non-negative")
    loads = [(0.0, r) for r in range(num_replicas)]  # a heap of (cost so far, replica)
    owner = [0] * len(costs)
    for g in sorted(range(len(costs)), key=lambda g: (-costs[g], g)):
        load, r = heapq.heappop(loads)
        owner[g] = r
        heapq.heappush(loads, (load + costs[g], r))
    replica_groups: list[list[int]] = [[] for _ in range(num_replicas)]
    planned = [0.0] * num_replicas
    for g, r in enumerate(owner):  # plan order within each replica
        replica_groups[r].append(g)
        planned[r] += costs[g]
    return ReplicaAssignment(replica_groups, planned)


def partition_groups(
    plan: PrefixPlan,
    prefix_terms: Sequence[float],
    member_costs: Sequence[float],
    num_replicas: int,
) -> ReplicaAssignment:
    """The deal of the module docstring: whole groups by LPT, or, when a group costs more than
    the mean replica load, McNaughton's wrap-around over members if its makespan is lower.

    Args:
        prefix_terms / member_costs: from `cost_terms_s` [s].
    Raises:
        ValueError: num_replicas < 1, or a negative cost.
    """
    if any(c < 0 for c in (*prefix_terms, *member_costs)):
        raise ValueError("group costs must be non-negative")
    costs = [
        prefix_terms[g] + sum(member_costs[i] for i in group.request_indices)
        for g, group in enumerate(plan.groups)
    ]
    whole = assign_groups(costs, num_replicas)
    mean = sum(costs) / num_replicas
    if num_replicas == 1 or not costs or max(costs) <= mean:
        return whole
    order = sorted(range(len(costs)), key=lambda g: (-costs[g], g))
    lo, hi = mean, max(whole.planned_cost_s)

    def fill(target: float) -> tuple[list[list[tuple[int, list[int]]]], list[float]]:
        return _wrap_around(plan, order, prefix_terms, member_costs, num_replicas, target)

    if max(fill(hi)[1]) > hi:  # even the LPT makespan is no target the wrap-around meets
        return whole
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if max(fill(mid)[1]) <= mid else (mid, hi)
    replicas, loads = fill(hi)
    if max(loads) >= max(whole.planned_cost_s):
        return whole
    return _assignment(replicas, loads)


def _wrap_around(
    plan: PrefixPlan,
    order: Sequence[int],
    prefix_terms: Sequence[float],
    member_costs: Sequence[float],
    num_replicas: int,
    target: float,
) -> tuple[list[list[tuple[int, list[int]]]], list[float]]:
    """McNaughton's fill: groups in `order`, members in schedule order, onto replica r until the
    next member would lift its load above `target`; then on to r + 1 (a piece started there pays
    its group's prefix term). The last replica takes whatever is left. Returns (per replica its
    (group, members) pieces, per replica its load [s])."""
    replicas: list[list[tuple[int, list[int]]]] = [[] for _ in range(num_replicas)]
    loads = [0.0] * num_replicas
    r = 0
    for g in order:
        piece: list[int] = []
        for i in plan.groups[g].request_indices:
            add = member_costs[i] + (0.0 if piece else prefix_terms[g])
            if loads[r] > 0 and loads[r] + add > target and r < num_replicas - 1:
                if piece:
                    replicas[r].append((g, piece))
                    piece = []
                r += 1
                add = member_costs[i] + prefix_terms[g]
            piece.append(i)
            loads[r] += add
        replicas[r].append((g, piece))
    return replicas, loads


def _assignment(
    replicas: list[list[tuple[int, list[int]]]], loads: list[float]
) -> ReplicaAssignment:
    """The `ReplicaAssignment` of wrap-around pieces: groups in plan order per replica, and the
    pieces of every group that landed on more than one replica."""
    holders = Counter(g for pieces in replicas for g, _ in pieces)
    split = {
        (r, g): members
        for r, pieces in enumerate(replicas)
        for g, members in pieces
        if holders[g] > 1
    }
    groups = [sorted(g for g, _ in pieces) for pieces in replicas]
    return ReplicaAssignment(groups, loads, split)
