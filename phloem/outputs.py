"""What `LLM.generate` returns (vLLM's `RequestOutput` / `CompletionOutput` field names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: which of the prompt's n sequences this is.
        text: generated text (stop strings excluded).
        token_ids: generated token ids.
        cumulative_logprob: sum of the sampled tokens' log-probs (raw model distribution).
        logprobs: per generated token, {token_id: logprob} of the top-k plus the sampled token,
            when `SamplingParams.logprobs` was set; else None.
        finish_reason: "stop" (EOS, stop string or stop token), "length" (max_tokens or the
            context), "abort", "error" (the request failed in the engine; see
            `RequestOutput.error`), or None while running.
        stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps [seconds, time.monotonic] of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token [s]."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The result of one prompt: its n completions and their bookkeeping.

    `error` is None unless the request failed alone in the engine (an exception while setting
    it up, sampling, detokenizing or applying its stop rules, or non-finite logits): then it
    holds the reason, `finished` is True and its unfinished completions have finish_reason
    "error" (their text and tokens are what was generated before the failure).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    num_computed_prompt_tokens: int = 0
    extra: dict = field(default_factory=dict)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, over all completions [s]."""
        m = self.metrics
        num_tokens = max(len(o.token_ids) for o in self.outputs) if self.outputs else 0
        if m is None or m.first_token_time is None or m.last_token_time is None or num_tokens < 2:
            return None
        return (m.last_token_time - m.first_token_time) / (num_tokens - 1)
