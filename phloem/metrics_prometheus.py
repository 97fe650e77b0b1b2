"""Prometheus metrics of a serving engine (vLLM's metric set, `phloem:` prefix).

One `EngineMetrics` per server, on its own `CollectorRegistry` (so tests can run several servers
in one process). With the engine core in its own process (`phloem.engine.core_client`), the
front updates it on the event loop: `on_first_token`, `on_generated`, `on_finished` from the
requests' deltas and `set_core_stats` from the counts each core step carries. With the in-thread
engine (`phloem.engine.async_engine`), the engine thread calls `on_output`, `set_gauges`,
`set_prefix_cache_totals`, and `observe_step` is a step observer of the engine (preemptions,
speculative decoding's drafts);
prometheus-client objects are thread-safe.

    gauges:     phloem:num_requests_running, phloem:num_requests_waiting,
                phloem:kv_cache_usage_perc (0..1; blocks only the prefix cache holds count as
                free, as in vLLM), phloem:num_kv_blocks_free
    counters:   phloem:prompt_tokens_total, phloem:generation_tokens_total,
                phloem:prefix_cache_queries_total, phloem:prefix_cache_hits_total [tokens],
                phloem:prompt_tokens_computed_total, phloem:prompt_tokens_reused_total
                [tokens] (engine core only: prompt tokens the model ran, and those admitted
                requests started with from shared blocks),
                phloem:request_success_total{finished_reason}, phloem:request_failed_total,
                phloem:request_aborted_total{phase="waiting"|"running"},
                phloem:num_preemptions_total,
                phloem:spec_decode_num_draft_tokens_total,
                phloem:spec_decode_num_accepted_tokens_total [tokens] (speculative decoding)
    histograms: phloem:time_to_first_token_seconds, phloem:time_per_output_token_seconds,
                phloem:e2e_request_latency_seconds
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from phloem.engine.step_observer import StepRecord

disable_created_metrics()  # no `*_created` series (vLLM's exposition has none either)

_TTFT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineMetrics:
    """The server's metrics. `model_name` labels every series (as vLLM's `model_name`)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self._totals: dict[str, int] = {}
        self._define_load_and_tokens()
        self._define_requests()

    def _gauge(self, name: str, doc: str):
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(self._model_name)

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self._model_name)

    def _histogram(self, name: str, doc: str, buckets):
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(
            self._model_name
        )

    def _define_load_and_tokens(self) -> None:
        """Scheduler load, KV use, and token counters (prefix cache, speculative decoding)."""
        gauge, counter = self._gauge, self._counter
        self.num_running = gauge("phloem:num_requests_running", "Requests running this step.")
        self.num_waiting = gauge("phloem:num_requests_waiting", "Requests waiting to run.")
        self.kv_usage = gauge("phloem:kv_cache_usage_perc", "KV blocks in use (1 = all).")
        self.kv_free = gauge("phloem:num_kv_blocks_free", "Free KV blocks [blocks].")
        self.prompt_tokens = counter("phloem:prompt_tokens", "Prompt tokens of started requests.")
        self.generation_tokens = counter("phloem:generation_tokens", "Generated tokens.")
        self.prefix_queries = counter(
            "phloem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "phloem:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.prompt_computed = counter(
            "phloem:prompt_tokens_computed", "Prompt tokens the model ran (recomputes included)."
        )
        self.prompt_reused = counter(
            "phloem:prompt_tokens_reused", "Prompt tokens started from shared or cached blocks."
        )
        self.spec_drafts = counter(
            "phloem:spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding)."
        )
        self.spec_accepted = counter(
            "phloem:spec_decode_num_accepted_tokens",
            "Draft tokens accepted (speculative decoding).",
        )

    def _define_requests(self) -> None:
        """Request outcomes (finished, failed, aborted, preempted) and latency histograms."""
        self._success = Counter(
            "phloem:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.preemptions = self._counter(
            "phloem:num_preemptions", "Requests preempted (KV blocks ran out; recomputed later)."
        )
        self.failed = self._counter("phloem:request_failed", "Requests failed inside the engine.")
        self._aborted = Counter(
            "phloem:request_aborted",
            "Requests aborted (client gone) by phase.",
            ["model_name", "phase"],
            registry=self.registry,
        )
        self.ttft = self._histogram(
            "phloem:time_to_first_token_seconds", "Time to first token [s].", _TTFT_BUCKETS
        )
        self.tpot = self._histogram(
            "phloem:time_per_output_token_seconds", "Time per output token [s].", _TPOT_BUCKETS
        )
        self.e2e = self._histogram(
            "phloem:e2e_request_latency_seconds", "End-to-end request latency [s].", _E2E_BUCKETS
        )

    # -- hooks called from the engine thread -----------------------------------------------------

    def on_request_added(self, num_prompt_tokens: int) -> None:
        pass  # prompt tokens are counted at the first output (the prefill has run)

    def on_request_aborted(self, running: bool) -> None:
        self._aborted.labels(self._model_name, "running" if running else "waiting").inc()

    def on_request_failed(self) -> None:
        self.failed.inc()

    def on_output(self, output, num_tokens_before: int, num_tokens_now: int) -> None:
        """Count the output's new tokens; observe TTFT at its first token, E2E/TPOT at the end."""
        self.on_generated(num_tokens_now - num_tokens_before)
        if num_tokens_before == 0 and num_tokens_now > 0:
            ttft = output.metrics.ttft if output.metrics is not None else None
            self.on_first_token(len(output.prompt_token_ids), ttft)
        if output.finished:
            self.on_finished(output)

    def on_generated(self, num_tokens: int) -> None:
        """Count generated tokens [tokens]."""
        if num_tokens > 0:
            self.generation_tokens.inc(num_tokens)

    def on_first_token(self, num_prompt_tokens: int, ttft: float | None) -> None:
        """A request's first token came: its prompt ran; observe its TTFT [s]."""
        self.prompt_tokens.inc(num_prompt_tokens)
        if ttft is not None:
            self.ttft.observe(max(ttft, 0.0))

    def on_finished(self, output) -> None:
        """A request finished (a `RequestOutput`): finish reasons, E2E latency, TPOT."""
        m = output.metrics
        for c in output.outputs:
            self._success.labels(self._model_name, c.finish_reason or "unknown").inc()
        if m is not None and m.finished_time is not None:
            self.e2e.observe(max(m.finished_time - m.arrival_time, 0.0))
        tpot = output.tpot
        if tpot is not None:
            self.tpot.observe(tpot)

    def set_core_stats(self, stats) -> None:
        """The gauges and totals of an engine core step (`core_messages.CoreStats`)."""
        self.set_gauges(
            stats.num_running, stats.num_waiting, stats.num_free_blocks, stats.num_blocks
        )
        self.set_prefix_cache_totals(stats.prefix_cache_queries, stats.prefix_cache_hits)
        aborted = self._aborted
        for key, total, counter in (
            ("preemptions", stats.num_preemptions, self.preemptions),
            ("prompt_computed", stats.num_computed_prompt_tokens, self.prompt_computed),
            ("prompt_reused", stats.num_reused_prompt_tokens, self.prompt_reused),
            ("spec_drafts", stats.num_draft_tokens, self.spec_drafts),
            ("spec_accepted", stats.num_accepted_tokens, self.spec_accepted),
            (
                "aborted_waiting",
                stats.num_aborted_waiting,
                aborted.labels(self._model_name, "waiting"),
            ),
            (
                "aborted_running",
                stats.num_aborted_running,
                aborted.labels(self._model_name, "running"),
            ),
        ):
            self._advance(key, total, counter)

    def _advance(self, key: str, total: int, counter) -> None:
        """Move `counter` up to the running `total` (kept under `key`)."""
        increase = total - self._totals.get(key, 0)
        if increase > 0:
            counter.inc(increase)
            self._totals[key] = total

    def set_gauges(self, num_running: int, num_waiting: int, num_free_blocks: int, num_blocks: int):
        """Set the request and KV gauges (blocks only the prefix cache holds count as free)."""
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_free.set(num_free_blocks)
        self.kv_usage.set(1.0 - num_free_blocks / num_blocks if num_blocks else 0.0)

    def set_prefix_cache_totals(self, queries: int, hits: int) -> None:
        """Advance the prefix-cache counters to the KV manager's running totals [tokens]."""
        self._advance("prefix_queries", queries, self.prefix_queries)
        self._advance("prefix_hits", hits, self.prefix_hits)

    def observe_step(self, record: StepRecord) -> None:
        """A step observer: count the requests the step's scheduling preempted, and the drafts
        it verified and accepted (speculative decoding). A void row's drafts (stacked on a row
        that rejected a draft: `core/draft_tokens.py`) were never verified and are not counted,
        as in the drafter's `SpecDecodeStats`."""
        num_preempted = len(record.scheduler_output.preempted_seq_ids)
        if num_preempted:
            self.preemptions.inc(num_preempted)
        runner = record.runner_output
        if runner is not None and runner.num_accepted_drafts:
            accepted = runner.num_accepted_drafts  # verify rows only: a void row has no entry
            sched = record.scheduler_output.scheduled
            self.spec_drafts.inc(sum(len(s.draft_token_ids) for s in sched if s.seq_id in accepted))
            self.spec_accepted.inc(sum(accepted.values()))

    def render(self) -> bytes:
        """The Prometheus text exposition of all series."""
        return generate_latest(self.registry)
