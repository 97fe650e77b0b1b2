"""The front's state of one request served by the engine core: its sequences' token ids, text
and log-probs, grown from the core's deltas, and the `RequestOutput` the server reads.

Per new token the work is O(1) amortized: an append to the sequence's token list, one
`IncrementalDetokenizer.add_token` (one `DecodeStream` step for fast tokenizers) and, only when the request has stop
strings, a search over the text's tail. A stop string found here finishes that sequence (its
text cut before the string, finish_reason "stop", stop_reason the string, as `LLMEngine` does
in-process); the client then tells the core to stop it. The request's one `RequestOutput` is
updated in place and shares the live lists (no copy, no new objects per token): what a consumer
reads is valid until it awaits again.
"""

from __future__ import annotations

import asyncio

from phloem.engine.core_messages import RequestDelta
from phloem.engine.detokenizer import IncrementalDetokenizer
from phloem.outputs import CompletionOutput, RequestMetrics, RequestOutput
from phloem.sampling_params import SamplingParams


class SeqState:
    """One sequence of the request: tokens, text, log-probs, finish."""

    __slots__ = (
        "token_ids",
        "detokenizer",
        "logprobs",
        "cumulative_logprob",
        "finish_reason",
        "stop_reason",
    )

    def __init__(self, detokenizer: IncrementalDetokenizer, with_logprobs: bool) -> None:
        self.token_ids: list[int] = []
        self.detokenizer = detokenizer
        self.logprobs: list[dict[int, float]] | None = [] if with_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if with_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class RequestStream:
    """Front-side state of one request (touched only on the event loop).

    Args:
        request_id: the engine request id.
        prompt: the prompt's text (or None), prompt_token_ids: its ids.
        params: its sampling parameters (stop strings and `skip_special_tokens` apply here).
        tokenizer: the front's tokenizer.
        arrival_time: [s, time.monotonic].
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        stop = params.stop or []
        self.seqs = [
            SeqState(
                IncrementalDetokenizer(
                    tokenizer, prompt_token_ids, params.skip_special_tokens, stop
                ),
                params.logprobs is not None,
            )
            for _ in range(params.n)
        ]
        self.metrics = RequestMetrics(arrival_time)
        self.num_cached_tokens = 0
        self.num_tokens = 0  # output tokens over all sequences
        self._waiter: asyncio.Future | None = None  # the consumer's, while it waits
        self.dirty = False  # news since the consumer last read
        self.finished = False  # no more news: done, failed or aborted
        self.error: BaseException | None = None
        self._output: RequestOutput | None = None

    def seq_id(self, index: int) -> str:
        """The core's id of sequence `index` (the request id when n == 1)."""
        return self.request_id if len(self.seqs) == 1 else f"{self.request_id}#{index}"

    def apply(self, delta: RequestDelta, now: float) -> tuple[int, list[str]]:
        """Take one step's delta; returns (new tokens kept, ids of sequences a stop string
        finished here while the core still runs them). Mutates the state; the request is
        finished once every sequence is."""
        num_new, stopped = 0, []
        for sd in delta.seqs:
            seq = self.seqs[sd.index]
            if seq.finish_reason is not None:
                continue  # stopped here by a stop string; the core's news is stale
            stop = None
            detok = seq.detokenizer
            kept = 0
            for token_id in sd.token_ids:
                seq.token_ids.append(token_id)
                kept += 1
                stop = detok.add_token(token_id)
                if stop is not None:
                    break
            if seq.logprobs is not None and sd.logprobs is not None:
                seq.logprobs.extend(sd.logprobs[:kept])
                seq.cumulative_logprob = sd.cumulative_logprob
            num_new += kept
            if stop is None and sd.finish_reason is not None:
                stop = detok.flush()
                seq.finish_reason, seq.stop_reason = sd.finish_reason, sd.stop_reason
            if stop is not None:  # wins over a length or EOS finish in this same step
                seq.finish_reason, seq.stop_reason = "stop", stop
                if not delta.finished:
                    stopped.append(self.seq_id(sd.index))
        self.num_cached_tokens = delta.num_cached_tokens
        if num_new:
            self.num_tokens += num_new
            self.metrics.first_token_time = self.metrics.first_token_time or now
            self.metrics.last_token_time = now
        if delta.finished or all(s.finish_reason is not None for s in self.seqs):
            self.finished = True
            self.metrics.finished_time = now
        self.dirty = True
        self._wake()
        return num_new, stopped

    def output(self) -> RequestOutput:
        """The cumulative output so far: one object per request, updated in place (live lists
        and fields: valid until the next await)."""
        out = self._output
        if out is None:
            out = self._output = RequestOutput(
                request_id=self.request_id,
                prompt=self.prompt,
                prompt_token_ids=self.prompt_token_ids,
                outputs=[
                    CompletionOutput(i, "", s.token_ids, s.cumulative_logprob, s.logprobs)
                    for i, s in enumerate(self.seqs)
                ],
                finished=False,
                metrics=self.metrics,
            )
        for c, s in zip(out.outputs, self.seqs):
            c.text = s.detokenizer.text
            c.cumulative_logprob = s.cumulative_logprob
            c.finish_reason, c.stop_reason = s.finish_reason, s.stop_reason
        out.finished = self.finished and self.error is None
        out.num_cached_tokens = self.num_cached_tokens
        return out

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (raised by its consumer)."""
        if self.finished and self.error is not None:
            return
        self.finished = True
        self.error = error
        self._wake()

    async def wait(self) -> None:
        """Return once there is news (`dirty` or `error` set): at once if there is already.

        One consumer at a time. A future per wait, set by `apply` / `fail` (an `asyncio.Event`
        does the same with more work per token).
        """
        if self.dirty or self.error is not None:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
