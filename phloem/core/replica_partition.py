"""Data-parallel replicas under one global prefix plan: whole prefix groups assigned to replicas.

One `PrefixPlan` is made for the whole batch (`prefix_planner.plan_prefix_groups`); its groups
are then dealt to N replicas so that a group is never split (its shared prefix is computed once
in the whole cluster, on the replica that holds the group) and the replicas' planned costs are
balanced. Balancing is longest-processing-time-first (LPT; Graham, "Bounds on multiprocessing
timing anomalies", SIAM J. Appl. Math. 1969): groups in decreasing cost, each to the replica
with the least cost so far; the makespan is at most (4/3 - 1/(3N)) times the optimum.

A group's cost is its roofline time in seconds (shared/docs/ROOFLINE.md, `bench.roofline`):
its FLOPs at `flops_per_s` plus its KV bytes at `bytes_per_s` (prefix once, each member's own
prompt tokens and outputs). The weights' bytes, read once per decode step by the whole batch, are
a per-replica constant and left out of the per-group cost.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phloem.core.prefix_planner import PrefixPlan


@dataclass(frozen=True)
class ReplicaAssignment:
    """Which plan groups each replica runs.

    Attributes:
        replica_groups: per replica, indices into `plan.groups`, in the plan's schedule order.
        planned_cost_s: per replica, the sum of its groups' costs [s].
    """

    replica_groups: list[list[int]]
    planned_cost_s: list[float]

    @property
    def num_replicas(self) -> int:
        return len(self.replica_groups)

    @property
    def imbalance(self) -> float:
        """max / mean of the replicas' planned costs (1.0 is perfect; 1.0 for zero cost)."""
        mean = sum(self.planned_cost_s) / len(self.planned_cost_s)
        return max(self.planned_cost_s) / mean if mean > 0 else 1.0

    def replica_requests(self, plan: PrefixPlan, replica: int) -> list[int]:
        """Request indices of `replica`, in schedule order (its groups' members, concatenated)."""
        return [i for g in self.replica_groups[replica] for i in plan.groups[g].request_indices]


def group_costs_s(
    plan: PrefixPlan,
    prompt_lens: Sequence[int],
    max_tokens: Sequence[int],
    shape: Any,
    flops_per_s: float,
    bytes_per_s: float,
) -> list[float]:
    """Planned cost [s] of each group of `plan` (module docstring): roofline FLOPs / flops_per_s
    + KV bytes / bytes_per_s, weights left out.

    Args:
        prompt_lens / max_tokens: per request index of the planned batch [tokens].
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
    costs = []
    for group in plan.groups:
        members = [(prompt_lens[i], max_tokens[i]) for i in group.request_indices]
        flops, nbytes = batch_work(shape, [(group.prefix_len, members)])
        nbytes -= shape.weight_bytes * max(o for _, o in members)
        costs.append(flops / flops_per_s + nbytes / bytes_per_s)
    return costs


def assign_groups(costs: Sequence[float], num_replicas: int) -> ReplicaAssignment:
    """Deal groups (by cost, in plan order) to `num_replicas` replicas by LPT; deterministic:
    ties go to the lower group index first and to the lower replica index.

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
