"""The engine's state of one user request (a prompt) and of its n sequences: text, log-probs,
metrics, and the `RequestOutput` built from them (`LLMEngine` keeps one `PromptEntry` per
request id and one `SequenceEntry` per sequence id)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from phloem.core.request import Request
from phloem.engine.detokenizer import IncrementalDetokenizer
from phloem.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from phloem.worker.model_runner import ModelRunnerOutput


@dataclass
class SequenceEntry:
    """Engine-side state of one sequence: its text and log-probs."""

    request: Request
    index: int
    prompt_id: str
    detokenizer: IncrementalDetokenizer
    cumulative_logprob: float | None = None  # only when the request asked for logprobs
    logprobs: list[dict[int, float]] | None = None

    def record_logprobs(self, runner_output: ModelRunnerOutput, token_id: int) -> None:
        """Add the step's log-prob of `token_id` (and its top-k, when asked for)."""
        seq_id = self.request.request_id
        logprob = runner_output.logprobs.get(seq_id)
        if logprob is not None and self.cumulative_logprob is not None:
            self.cumulative_logprob += logprob
        if self.logprobs is not None:
            top = runner_output.top_logprobs.get(seq_id) or {token_id: logprob}
            self.logprobs.append(top)


@dataclass
class PromptEntry:
    """One user request (a prompt and its n sequences)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceEntry]
    metrics: RequestMetrics
    finished: bool = False
    extra: dict = field(default_factory=dict)
    error: str | None = None  # why the request failed, if it did

    def to_output(self) -> RequestOutput:
        outputs = []
        for seq in self.sequences:
            request = seq.request
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.text,
                    token_ids=list(request.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=seq.logprobs,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=sum(s.request.num_cached_tokens for s in self.sequences),
            metrics=self.metrics,
            extra=self.extra,
            error=self.error,
        )
