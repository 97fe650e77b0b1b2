"""The scaling model of data-parallel prefix sharing: cluster-wide prompt-token reuse and planned
imbalance of a workload spread over N replicas, by three ways of routing requests, on the CPU.

- `prefix_aware` (phloem): one global prefix plan; groups dealt to replicas by
  `core.replica_partition.partition_groups` (whole groups by LPT, so each shared prefix is
  computed once in the cluster; a group costlier than the mean replica load is split when that
  lowers the makespan, and its prefix is then counted once per replica holding a piece);
- `contiguous`: the request list cut into N contiguous slices (vLLM's data-parallel example);
- `random`: each request to a uniformly random replica (seeded), as a load balancer unaware of
  prefixes does.

For `contiguous` and `random` each replica still plans its own share (phloem's planner on every
replica, the best case for them). Reported per strategy and replica count: the cluster-wide reuse
ratio ((logical - computed) / logical prompt tokens), each replica's roofline time
(`bench.roofline.batch_work` of its own groups at the given ceilings), and the imbalance
(max / mean of those times) and makespan (the max).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from phloem.bench.roofline import ModelShape, batch_work
from phloem.bench.workloads import Workload
from phloem.core.prefix_planner import PrefixPlan, plan_prefix_groups
from phloem.core.replica_partition import cost_terms_s, partition_groups

STRATEGIES = ("prefix_aware", "contiguous", "random")


def _time_s(pieces, requests: Sequence[int], workload, shape, f, b) -> float:
    """Roofline time [s] of one replica running `pieces`, (prefix length, request indices) each,
    whose request indices map to the workload's through `requests`."""
    groups = [
        (prefix_len,
         [(len(workload.prompts[requests[i]]), workload.output_lens[requests[i]])
          for i in members])
        for prefix_len, members in pieces
    ]  # fmt: skip
    if not groups:
        return 0.0
    flops, nbytes = batch_work(shape, groups)
    return max(flops / f, nbytes / b)


def _shares(strategy: str, n: int, replicas: int, seed: int) -> list[list[int]]:
    if strategy == "contiguous":
        bounds = [n * r // replicas for r in range(replicas + 1)]
        return [list(range(bounds[r], bounds[r + 1])) for r in range(replicas)]
    rng = random.Random(seed)
    shares: list[list[int]] = [[] for _ in range(replicas)]
    for i in range(n):
        shares[rng.randrange(replicas)].append(i)
    return shares


def _summary(strategy, replicas, logical, computed, times) -> dict[str, Any]:
    mean = sum(times) / len(times)
    return {
        "strategy": strategy,
        "replicas": replicas,
        "logical_prompt_tokens": logical,
        "computed_prompt_tokens": computed,
        "reuse_ratio": (logical - computed) / logical if logical else 0.0,
        "makespan_s": max(times),
        "imbalance": max(times) / mean if mean > 0 else 1.0,
        "replica_time_s": {"min": min(times), "mean": mean, "max": max(times)},
    }


def scaling_point(
    workload: Workload,
    shape: ModelShape,
    replicas: int,
    strategy: str,
    *,
    block_size: int = 16,
    flops_per_s: float,
    bytes_per_s: float,
    seed: int = 0,
    global_plan: PrefixPlan | None = None,
) -> dict[str, Any]:
    """One strategy at one replica count (see the module docstring for the fields).

    Raises:
        ValueError: an unknown strategy or replicas < 1.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    prompts, outs = workload.prompts, workload.output_lens
    logical = sum(map(len, prompts))
    f, b = flops_per_s, bytes_per_s
    if strategy == "prefix_aware":
        plan = global_plan or plan_prefix_groups(prompts, outs, block_size)
        terms = cost_terms_s(plan, [len(p) for p in prompts], outs, shape, f, b)
        assignment = partition_groups(plan, *terms, replicas)
        everyone = range(len(prompts))
        times = [
            _time_s([(plan.groups[g].prefix_len, assignment.pieces.get((r, g),
                      plan.groups[g].request_indices)) for g in groups],
                    everyone, workload, shape, f, b)
            for r, groups in enumerate(assignment.replica_groups)
        ]  # fmt: skip
        computed = plan.num_physical_prompt_tokens + assignment.extra_prefix_tokens(plan)
        point = _summary(strategy, replicas, logical, computed, times)
        point["planned_imbalance"] = assignment.imbalance
        point["split_groups"] = len(assignment.split_groups)
        return point
    computed, times = 0, []
    for requests in _shares(strategy, len(prompts), replicas, seed):
        if not requests:
            times.append(0.0)
            continue
        local = plan_prefix_groups([prompts[i] for i in requests], [outs[i] for i in requests],
                                   block_size)  # fmt: skip
        computed += local.num_physical_prompt_tokens
        pieces = [(g.prefix_len, g.request_indices) for g in local.groups]
        times.append(_time_s(pieces, requests, workload, shape, f, b))
    return _summary(strategy, replicas, logical, computed, times)


def scaling_table(
    workload: Workload,
    shape: ModelShape,
    replica_counts: Sequence[int],
    *,
    block_size: int = 16,
    flops_per_s: float,
    bytes_per_s: float,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """`scaling_point` for every strategy at every replica count (the global plan made once)."""
    plan = plan_prefix_groups(workload.prompts, workload.output_lens, block_size)
    return [
        scaling_point(workload, shape, n, s, block_size=block_size, flops_per_s=flops_per_s,
                      bytes_per_s=bytes_per_s, seed=seed, global_plan=plan)
        for n in replica_counts
        for s in STRATEGIES
    ]  # fmt: skip


def format_table(points: list[dict[str, Any]]) -> str:
    """The table `phloem bench plan-scaling` prints: one line per (replicas, strategy)."""
    lines = [f"{'replicas':>8} {'strategy':<13} {'reuse':>7} {'imbalance':>9} {'makespan':>10}"]
    for p in points:
        lines.append(
            f"{p['replicas']:>8} {p['strategy']:<13} {p['reuse_ratio']:>7.1%} "
            f"{p['imbalance']:>9.3f} {p['makespan_s']:>9.3f}s"
        )
    return "\n".join(lines)
