"""The engine's state of one user request (a prompt) and of its n sequences: text, log-probs,
metrics, and the `RequestOutput` (or, in the engine core, the `RequestDelta`) built from them
(`LLMEngine` keeps one `PromptEntry` per request id and one `SequenceEntry` per sequence id)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from phloem.core.request import Request, RequestStatus
from phloem.engine.core_messages import RequestDelta, SeqDelta
from phloem.engine.detokenizer import IncrementalDetokenizer
from phloem.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from phloem.worker.model_runner import ModelRunnerOutput


class OutputMode(enum.Enum):
    """What `LLMEngine.step()` returns (fixed when the engine is built).

    FINAL: a `RequestOutput` per prompt that finished, its text decoded once at the end (the
        offline `LLM`).
    STREAM: a cumulative `RequestOutput` (text kept up to date) per prompt that got a token
        (the in-thread `AsyncLLMEngine`).
    DELTA: a `RequestDelta` (engine/core_messages.py) per prompt that got a token: only the
        step's new token ids, no text, and stop strings are NOT applied (the engine core
        process; the front detokenizes and aborts on a stop string).
    """

    FINAL = "final"
    STREAM = "stream"
    DELTA = "delta"


StepOutput = Union[RequestOutput, RequestDelta]  # noqa: UP007 - a runtime alias
_RUNNING = RequestStatus.RUNNING


@dataclass
class SequenceEntry:
    """Engine-side state of one sequence: its text and log-probs (no detokenizer in the
    engine core's DELTA mode: the front makes the text)."""

    request: Request
    index: int
    prompt_id: str
    detokenizer: IncrementalDetokenizer | None
    cumulative_logprob: float | None = None  # only when the request asked for logprobs
    logprobs: list[dict[int, float]] | None = None
    num_sent: int = 0  # output tokens already sent as deltas (DELTA mode)
    finish_sent: bool = False  # its finish reason was sent (DELTA mode)

    def to_delta(self) -> SeqDelta | None:
        """The tokens (and log-probs) since the last delta, and the finish once; None when
        nothing changed. Mutates `num_sent` / `finish_sent`."""
        request = self.request
        tokens = request.output_token_ids
        start = self.num_sent
        status = request.status  # running (no finish reason): the common case, no lookup
        finish = None if status is _RUNNING else status.finish_reason
        if start == len(tokens) and (finish is None or self.finish_sent):
            return None
        self.num_sent = len(tokens)
        self.finish_sent = finish is not None
        logprobs = self.logprobs[start:] if self.logprobs is not None else None
        return SeqDelta(
            self.index,
            tokens[start:],  # a new list: the delta never aliases the request's outputs
            logprobs,
            self.cumulative_logprob,
            finish,
            request.stop_reason,
        )

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
                    text=seq.detokenizer.text if seq.detokenizer is not None else "",
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

    def to_delta(self) -> RequestDelta:
        """The prompt's news since its last delta (engine core, DELTA mode). Built for every
        touched prompt of every step: n == 1 (the common case) takes no list comprehension
        or generator (the same delta)."""
        sequences = self.sequences
        if len(sequences) == 1:
            seq = sequences[0]
            delta = seq.to_delta()
            return RequestDelta(
                self.request_id,
                [delta] if delta is not None else [],
                self.finished,
                seq.request.num_cached_tokens,
                self.error,
            )
        seqs = [d for s in sequences if (d := s.to_delta()) is not None]
        return RequestDelta(
            self.request_id,
            seqs,
            self.finished,
            sum(s.request.num_cached_tokens for s in sequences),
            self.error,
        )
