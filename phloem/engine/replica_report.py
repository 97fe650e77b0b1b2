"""What a data-parallel batch was planned to do and did, per replica: the deal (`Deal`: which
requests each replica runs under the routing, planned costs and prompt tokens) and the report
(`ReplicaReport`: planned vs achieved time, imbalance, computed prompt tokens), which
`LLM.last_replica_report`, the job summaries and `phloem bench throughput` read."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phloem.core.prefix_planner import PrefixPlan


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's part of one batch.

    Attributes:
        replica: its index. num_requests: what it was dealt. num_groups: plan groups it runs
            all or part of (prefix routing), or groups of its own plan (contiguous routing).
        planned_cost_s: its share's roofline cost at the nominal ceilings [s]; compare ratios.
        achieved_s: wall time from sending its share to its last output [s] (0 without work).
        num_computed_prompt_tokens: prompt tokens its engine ran for this batch [tokens].
        sent_s / received_s / queued_s: when its share was sent, had arrived in the replica
            (unpacked), and was queued in its engine (planned), from the batch's start (before
            the deal) [s]: the dispatch before it computes (0.0 where not measured).
    """

    replica: int
    num_requests: int
    num_groups: int
    planned_cost_s: float
    achieved_s: float
    num_computed_prompt_tokens: int
    sent_s: float = 0.0
    received_s: float = 0.0
    queued_s: float = 0.0


def _imbalance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class Deal:
    """Which requests each replica runs in one batch, and what the plan expects of them.

    Attributes:
        routing: "prefix" or "contiguous" (module docstring).
        shares: per replica, request indices of the batch (schedule order under "prefix",
            input order under "contiguous").
        num_groups: per replica, as `ReplicaStats.num_groups`.
        planned_cost_s: per replica, its share's roofline cost at the nominal ceilings [s].
        num_split_groups: plan groups split across replicas (prefix routing; 0 otherwise).
        planned_computed_prompt_tokens: prompt tokens the cluster is planned to compute: the
            global plan's plus one prefix per extra piece of a split group (prefix), or the sum
            of the slices' own plans (contiguous) [tokens].
        share_groups: under prefix routing, per replica, the global plan restricted to its share
            ((prefix_len, request indices) per group or piece, in schedule order: the replica
            queues them as they are); None under contiguous routing (each replica plans).
    """

    routing: str
    shares: list[list[int]]
    num_groups: list[int]
    planned_cost_s: list[float]
    num_split_groups: int
    planned_computed_prompt_tokens: int
    share_groups: list[list[tuple[int, tuple[int, ...]]]] | None = None

    def describe(self) -> str:
        """Lines for `phloem generate --plan-only`: the deal per replica and its imbalance."""
        total = sum(self.planned_cost_s) or 1.0
        lines = [
            f"data-parallel deal ({self.routing} routing) over {len(self.shares)} replicas: "
            f"planned imbalance {_imbalance(self.planned_cost_s):.3f}, "
            f"{self.num_split_groups} groups split, "
            f"{self.planned_computed_prompt_tokens} prompt tokens computed in the cluster"
        ]
        for r, share in enumerate(self.shares):
            lines.append(
                f"  replica {r}: {len(share)} requests in {self.num_groups[r]} groups, "
                f"{self.planned_cost_s[r] / total:.1%} of the planned cost"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class ReplicaReport:
    """Planned vs achieved work per replica for the last batch (`LLM.last_replica_report`).

    Attributes:
        deal: how the batch was dealt (`Deal`).
        replicas: one `ReplicaStats` per replica.
        request_replica: for each request of the batch (its index), the replica that ran it.
        request_group: for each request, its group in the batch's global plan.
        attention: per replica, its attention backend's counters after the batch (None for a
            backend that keeps none, or a replica without work).
        deal_s: the deal's own time [s] (0.0 where not measured).
    """

    deal: Deal
    replicas: list[ReplicaStats]
    request_replica: list[int]
    request_group: list[int]
    attention: list[dict | None]
    deal_s: float = 0.0

    @property
    def dispatch_s(self) -> float:
        """From the batch's start to the last replica's share queued [s]: the deal, sending
        the shares and each replica unpacking and queuing its share (0.0 where not measured)."""
        return max(s.queued_s for s in self.replicas)

    @property
    def planned_imbalance(self) -> float:
        """max / mean of the planned costs (1.0 is perfect)."""
        return _imbalance([s.planned_cost_s for s in self.replicas])

    @property
    def achieved_imbalance(self) -> float:
        """max / mean of the achieved wall times (1.0 is perfect)."""
        return _imbalance([s.achieved_s for s in self.replicas])

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens the whole cluster ran for this batch [tokens]."""
        return sum(s.num_computed_prompt_tokens for s in self.replicas)

    def to_dict(self) -> dict[str, Any]:
        """The `data_parallel` object of the job summary (without the per-request lists)."""
        return {
            "num_replicas": len(self.replicas),
            "routing": self.deal.routing,
            "planned_imbalance": self.planned_imbalance,
            "achieved_imbalance": self.achieved_imbalance,
            "makespan_s": max(s.achieved_s for s in self.replicas),
            "deal_s": self.deal_s,
            "dispatch_s": self.dispatch_s,
            "num_split_groups": self.deal.num_split_groups,
            "planned_computed_prompt_tokens": self.deal.planned_computed_prompt_tokens,
            "num_computed_prompt_tokens": self.num_computed_prompt_tokens,
            "replicas": [dataclasses.asdict(s) for s in self.replicas],
        }


class BatchProgress:
    """What the replicas reported of one batch so far (`DataParallelEngine.run`): times on the
    host's monotonic clock, from `start` (before the deal) [s].

    Attributes:
        start: `time.monotonic()` at the batch's start. deal_s: the deal's time [s].
        sent_s: per replica, when its share was sent. achieved / computed / attention /
            received_s / queued_s: per replica, from its "done" (`done`).
    """

    def __init__(self, start: float, num_replicas: int) -> None:
        self.start = start
        self.deal_s = 0.0
        self.sent_s = [0.0] * num_replicas
        self.achieved = [0.0] * num_replicas
        self.computed = [0] * num_replicas
        self.attention: list[dict | None] = [None] * num_replicas
        self.received_s = [0.0] * num_replicas
        self.queued_s = [0.0] * num_replicas

    def sent(self, rank: int) -> None:
        """Mark `rank`'s share sent now."""
        self.sent_s[rank] = time.monotonic() - self.start

    def done(self, rank: int, stats: dict[str, Any]) -> int:
        """Record `rank`'s "done" stats (now: its achieved time); returns its computed prompt
        tokens [tokens]."""
        self.achieved[rank] = time.monotonic() - self.start
        self.computed[rank] = stats["num_computed_prompt_tokens"]
        self.attention[rank] = stats["attention"]
        self.received_s[rank] = stats["received_at"] - self.start
        self.queued_s[rank] = stats["queued_at"] - self.start
        return self.computed[rank]

    def report(self, plan: PrefixPlan, deal: Deal) -> ReplicaReport:
        """The batch's `ReplicaReport` from what was recorded."""
        report = replica_report(plan, deal, self.achieved, self.computed, self.attention)
        stats = [
            dataclasses.replace(s, sent_s=self.sent_s[r], received_s=self.received_s[r],
                                queued_s=self.queued_s[r])
            for r, s in enumerate(report.replicas)
        ]  # fmt: skip
        return dataclasses.replace(report, replicas=stats, deal_s=self.deal_s)


def replica_report(
    plan: PrefixPlan,
    deal: Deal,
    achieved: list[float],
    computed: list[int],
    attention: list[dict | None],
) -> ReplicaReport:
    """The `ReplicaReport` of one batch from its deal and what each replica reported."""
    request_replica = [0] * len(plan.request_group)
    for rank, share in enumerate(deal.shares):
        for i in share:
            request_replica[i] = rank
    stats = [
        ReplicaStats(
            replica=rank,
            num_requests=len(deal.shares[rank]),
            num_groups=deal.num_groups[rank],
            planned_cost_s=deal.planned_cost_s[rank],
            achieved_s=achieved[rank],
            num_computed_prompt_tokens=computed[rank],
        )
        for rank in range(len(deal.shares))
    ]
    return ReplicaReport(deal, stats, request_replica, list(plan.request_group), attention)
