"""Speculative decoding's counters in `/metrics`: from the engine core's per-step stats and from a
step observer of the in-thread engine (`phloem:spec_decode_num_draft_tokens_total`,
`phloem:spec_decode_num_accepted_tokens_total`)."""

from __future__ import annotations

from phloem.core.scheduler_output import ScheduledSequence, SchedulerOutput
from phloem.engine.core_messages import CoreStats
from phloem.engine.step_observer import StepRecord
from phloem.metrics_prometheus import EngineMetrics
from phloem.worker.model_runner import ModelRunnerOutput


def _value(metrics: EngineMetrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not rendered")


def test_core_stats_totals_reach_the_counters():
    metrics = EngineMetrics("m")
    metrics.set_core_stats(CoreStats(1, 0, 10, 10, 0, 0, 0, 0, 0, 0, 0, 12, 7))
    metrics.set_core_stats(CoreStats(1, 0, 10, 10, 0, 0, 0, 0, 0, 0, 0, 20, 9))
    assert _value(metrics, "phloem:spec_decode_num_draft_tokens_total") == 20
    assert _value(metrics, "phloem:spec_decode_num_accepted_tokens_total") == 9


def test_step_observer_counts_a_verify_step():
    metrics = EngineMetrics("m")
    sched = SchedulerOutput(
        [ScheduledSequence("a", 5, 4, True, draft_token_ids=(1, 2, 3)),
         ScheduledSequence("b", 5, 1, True)]
    )  # fmt: skip
    runner = ModelRunnerOutput({"a": 4, "b": 5}, num_accepted_drafts={"a": 2})
    metrics.observe_step(StepRecord(0, sched, runner, 0.0, 0.0, 0.0, 0.0))
    assert _value(metrics, "phloem:spec_decode_num_draft_tokens_total") == 3
    assert _value(metrics, "phloem:spec_decode_num_accepted_tokens_total") == 2


def test_step_observer_leaves_out_void_rows_drafts():
    """A void row (stacked on a row that rejected a draft) verified nothing: its drafts are
    not counted as verified, so the acceptance rate is that of the rows that verified."""
    metrics = EngineMetrics("m")
    sched = SchedulerOutput(
        [ScheduledSequence("a", 5, 4, True, draft_token_ids=(1, 2, 3)),
         ScheduledSequence("v", 5, 5, True, draft_token_ids=(4, 5, 6, 7))]
    )  # fmt: skip
    runner = ModelRunnerOutput({"a": 4}, num_accepted_drafts={"a": 3})  # "v" void: no entry
    metrics.observe_step(StepRecord(0, sched, runner, 0.0, 0.0, 0.0, 0.0))
    assert _value(metrics, "phloem:spec_decode_num_draft_tokens_total") == 3
    assert _value(metrics, "phloem:spec_decode_num_accepted_tokens_total") == 3
